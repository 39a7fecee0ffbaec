//! [`RankGather`]: the all-gather a fully-sharded pool's apply calls
//! between its shrink and its expand ([`crate::LoraPool::apply_fully_sharded`]).
//!
//! Under the placement's fully-sharded option (vLLM's `fully_sharded_loras`)
//! a column-parallel pair's A holds only the rank's block of rank rows, so
//! each rank's shrink gives `[rows, targets, max_rank / tp_world]`; every
//! rank needs every rank's block before its expand. The pool asks a
//! `RankGather` for that: NCCL's `ncclAllGather` on the rank's CUDA device
//! ([`lora_kernels::NcclComm`] implements it), or the engine's own
//! communicator. This module must never implement a collective itself: the
//! pool has no means of reaching another rank.

use lora_kernels::{DeviceBuffer, NcclComm};

use crate::error::PoolError;

/// One rank's all-gather of f32 device buffers across its tensor-parallel
/// group. Every rank of the group calls it the same number of times, in the
/// same order, with the same `part_len`.
pub trait RankGather {
    /// This rank (the group's rank of the pool's `tp_rank`).
    fn rank(&self) -> usize;
    /// Ranks in the group (the pool's `tp_world`).
    fn world(&self) -> usize;
    /// Every rank's first `part_len` elements of `part` into `out`, rank
    /// `r`'s at `r * part_len`, queued after the work already queued on
    /// the buffers' device (or done by the time it returns). A failure is
    /// [`PoolError::Kernel`] (NCCL's) or [`PoolError::Gather`] (another
    /// communicator's, in its words).
    fn all_gather(
        &mut self,
        part: &DeviceBuffer<f32>,
        part_len: usize,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<(), PoolError>;
}

impl RankGather for NcclComm {
    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }

    fn world(&self) -> usize {
        NcclComm::world(self)
    }

    fn all_gather(
        &mut self,
        part: &DeviceBuffer<f32>,
        part_len: usize,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<(), PoolError> {
        Ok(NcclComm::all_gather(self, part, part_len, out)?)
    }
}
