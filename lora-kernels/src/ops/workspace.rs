//! Caller-owned scratch for the segment apply: sized once, up front, so the
//! apply calls allocate nothing and keep one address (graph capture).

use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::{KernelError, invalid};

/// Most K splits the shrink uses (each split keeps its own partial rank
/// vectors, summed by the expand).
pub(crate) const MAX_K_SPLITS: usize = 8;

/// The largest call a [`LoraWorkspace`] serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceSpec {
    /// Most rows (tokens) per call.
    pub max_rows: usize,
    /// Largest rank stride (the pool's `max_rank`).
    pub max_rank: usize,
    /// Most segments per call.
    pub max_segments: usize,
    /// Most targets per call (at most [`super::MAX_TARGETS`]).
    pub max_targets: usize,
}

/// Scratch for [`super::sgmv::sgmv`] and [`super::sgmv::one_adapter`]: the
/// partial rank vectors `[targets][k_splits][rows][rank_pad]` (f32), room
/// for 8 K splits: `32 · max_targets · max_rows · max_rank` bytes (rank
/// rounded up to 16) on a CUDA device, nothing on the CPU.
pub struct LoraWorkspace {
    spec: WorkspaceSpec,
    rank_pad: usize,
    scratch: DeviceBuffer<f32>,
}

impl LoraWorkspace {
    /// Allocate the scratch for `spec` on `device` (nothing on the CPU, whose
    /// reference needs none).
    pub fn new(device: &Device, spec: WorkspaceSpec) -> Result<LoraWorkspace, KernelError> {
        if spec.max_targets == 0 || spec.max_targets > super::MAX_TARGETS {
            return Err(invalid(
                "max_targets",
                format!("{}; 1..={} allowed", spec.max_targets, super::MAX_TARGETS),
            ));
        }
        if spec.max_rank == 0 {
            return Err(invalid("max_rank", "must be at least 1"));
        }
        let rank_pad = spec.max_rank.div_ceil(16) * 16;
        let len = if device.is_cuda() {
            spec.max_targets
                .checked_mul(MAX_K_SPLITS)
                .and_then(|v| v.checked_mul(spec.max_rows))
                .and_then(|v| v.checked_mul(rank_pad))
                .ok_or_else(|| invalid("spec", "workspace size overflows"))?
        } else {
            0
        };
        super::fits_i32("max_rows", spec.max_rows)?;
        Ok(LoraWorkspace {
            spec,
            rank_pad,
            scratch: device.alloc_zeros(len)?,
        })
    }

    /// What this workspace was sized for.
    pub fn spec(&self) -> &WorkspaceSpec {
        &self.spec
    }

    /// The device it lives on.
    pub fn device(&self) -> &Device {
        self.scratch.device()
    }

    /// Fill the scratch with NaN (tests: a kernel reading scratch nobody
    /// wrote then shows NaN in its output).
    pub fn poison(&mut self) -> Result<(), KernelError> {
        let nan = vec![f32::NAN; self.scratch.len()];
        self.scratch.write(0, &nan)
    }

    pub(crate) fn rank_pad(&self) -> usize {
        self.rank_pad
    }

    pub(crate) fn addr(&self) -> u64 {
        self.scratch.device_addr()
    }
}
