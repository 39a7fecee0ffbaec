//! What tensor-parallel ranks say to each other: the [`Collective`] a
//! rank's forward calls where the base model's row-parallel projections
//! (o_proj, down_proj) leave partial sums, and where an expert-parallel
//! MoE layer dispatches tokens to the ranks holding their experts and
//! brings the outputs back ([`Collective::all_to_all_v`]), and [`HostCollective`], the
//! host implementation for ranks run as threads of one process (the CPU
//! backend's tensor-parallel runs and their tests), and [`NcclCollective`],
//! the same collectives through NCCL on each rank's GPU.
//!
//! A rank adds its LoRA deltas to its partial base output before the
//! all-reduce (row-parallel deltas are partial sums too), so the deltas
//! need no communication of their own.
//!
//! This module must never decide what is reduced or in which order of the
//! forward: the forward calls it; and it must never compute a delta.

use std::sync::{Arc, Barrier, Mutex, PoisonError};

use lora_kernels::{Device, DeviceBuffer, NcclComm};
use lora_pool::{PoolError, RankGather};

use crate::error::EngineError;

/// The collectives of one tensor-parallel group, as one rank sees them.
/// Every rank of the group calls each collective the same number of times,
/// in the same order, with buffers of the same length.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Replace `buf` on every rank with the element-wise sum of every
    /// rank's `buf`. Every rank gets the same values (the same summation
    /// order), so ranks that sample from reduced logits agree.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), EngineError>;
    /// Write every rank's `part` into `out` (`world * part.len()`), rank
    /// `r`'s at `r * part.len()`.
    fn all_gather(&self, part: &[f32], out: &mut [f32]) -> Result<(), EngineError>;

    /// Send `send[d]` to rank `d` (one buffer per rank, any lengths, this
    /// rank's own included) and return what each rank sent this one,
    /// `recv[s]` from rank `s`, in rank order: the all-to-all of an
    /// expert-parallel token dispatch. Provided on top of
    /// [`Collective::all_gather`], so every collective has it: the
    /// lengths are gathered first (each as two 16-bit halves, exact in
    /// f32), then every rank's buffers, concatenated and padded to the
    /// longest rank's; values are only copied, never combined, so what
    /// arrives is bit for bit what was sent.
    fn all_to_all_v(&self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let (rank, world) = (self.rank(), self.world());
        if send.len() != world {
            return Err(EngineError::Collective(format!(
                "all_to_all_v with {} buffers for {world} ranks",
                send.len()
            )));
        }
        let mut lens = Vec::with_capacity(2 * world);
        for buf in send {
            let len = u32::try_from(buf.len())
                .map_err(|_| EngineError::Collective(format!("all_to_all_v of {} values to one rank", buf.len())))?;
            lens.extend([(len >> 16) as f32, (len & 0xffff) as f32]);
        }
        let mut all_lens = vec![0f32; 2 * world * world];
        self.all_gather(&lens, &mut all_lens)?;
        // all_lens[(s * world + d) * 2 ..]: what rank s sends rank d.
        let len = |s: usize, d: usize| {
            let i = (s * world + d) * 2;
            ((all_lens[i] as usize) << 16) | all_lens[i + 1] as usize
        };
        let total = |s: usize| (0..world).map(|d| len(s, d)).sum::<usize>();
        let longest = (0..world).map(total).max().unwrap_or(0);
        let mut part: Vec<f32> = send.iter().flatten().copied().collect();
        part.resize(longest, 0.0);
        let mut all = vec![0f32; world * longest];
        self.all_gather(&part, &mut all)?;
        Ok((0..world)
            .map(|s| {
                let start = s * longest + (0..rank).map(|d| len(s, d)).sum::<usize>();
                all[start..start + len(s, rank)].to_vec()
            })
            .collect())
    }
}

/// The state the threads of one [`HostCollective`] group share.
#[derive(Debug)]
struct Shared {
    world: usize,
    barrier: Barrier,
    /// Each rank's contribution to the collective in progress.
    parts: Mutex<Vec<Vec<f32>>>,
}

/// Collectives on the host for ranks that are threads of one process:
/// each rank posts its buffer, waits for the others, reads everyone's,
/// and waits again before the next collective may post. Made once per
/// group with [`HostCollective::group`]; each rank's thread takes its own.
///
/// A rank that stops calling (an error on one thread) leaves the others
/// waiting at the barrier: a group whose ranks may fail independently
/// needs a communicator with timeouts (NCCL's), not this one.
#[derive(Debug, Clone)]
pub struct HostCollective {
    rank: usize,
    shared: Arc<Shared>,
}

impl HostCollective {
    /// One handle per rank of a group of `world` ranks (at least 1).
    pub fn group(world: usize) -> Vec<HostCollective> {
        let world = world.max(1);
        let shared = Arc::new(Shared {
            world,
            barrier: Barrier::new(world),
            parts: Mutex::new(vec![Vec::new(); world]),
        });
        (0..world)
            .map(|rank| HostCollective {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    /// Post `part`, wait for every rank's, run `read` over all of them in
    /// rank order, and wait until every rank has read.
    fn exchange(&self, part: &[f32], read: impl FnOnce(&[Vec<f32>])) -> Result<(), EngineError> {
        let s = &self.shared;
        s.parts.lock().unwrap_or_else(PoisonError::into_inner)[self.rank] = part.to_vec();
        s.barrier.wait();
        let parts = s.parts.lock().unwrap_or_else(PoisonError::into_inner).clone();
        s.barrier.wait();
        if let Some((r, p)) = parts.iter().enumerate().find(|(_, p)| p.len() != part.len()) {
            return Err(EngineError::Collective(format!(
                "rank {r} posted {} values, rank {} posted {}",
                p.len(),
                self.rank,
                part.len()
            )));
        }
        read(&parts);
        Ok(())
    }
}

impl Collective for HostCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), EngineError> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let posted = buf.to_vec();
        self.exchange(&posted, |parts| {
            buf.fill(0.0);
            for p in parts {
                for (b, v) in buf.iter_mut().zip(p) {
                    *b += v;
                }
            }
        })
    }

    fn all_gather(&self, part: &[f32], out: &mut [f32]) -> Result<(), EngineError> {
        if out.len() != part.len() * self.shared.world {
            return Err(EngineError::Collective(format!(
                "all_gather of {} values into {} for {} ranks",
                part.len(),
                out.len(),
                self.shared.world
            )));
        }
        self.exchange(part, |parts| {
            for (dst, p) in out.chunks_exact_mut(part.len().max(1)).zip(parts) {
                dst.copy_from_slice(p);
            }
        })
    }
}

/// The collectives through an NCCL communicator on the rank's CUDA
/// device: the host values go up, NCCL reduces or gathers them on the
/// device's stream, the result comes back (the reference engine keeps its
/// activations on the host).
#[derive(Debug)]
pub struct NcclCollective {
    comm: Mutex<NcclComm>,
    device: Device,
}

impl NcclCollective {
    /// The collectives of `comm`, a communicator on `device`.
    pub fn new(comm: NcclComm, device: &Device) -> NcclCollective {
        NcclCollective {
            comm: Mutex::new(comm),
            device: device.clone(),
        }
    }
}

fn nccl_failed(e: lora_kernels::KernelError) -> EngineError {
    EngineError::Collective(e.to_string())
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.comm.lock().unwrap_or_else(PoisonError::into_inner).rank()
    }

    fn world(&self) -> usize {
        self.comm.lock().unwrap_or_else(PoisonError::into_inner).world()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), EngineError> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.device.upload(buf).map_err(nccl_failed)?;
        let mut comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        comm.all_reduce_sum(&mut dev, buf.len()).map_err(nccl_failed)?;
        buf.copy_from_slice(&dev.download().map_err(nccl_failed)?);
        Ok(())
    }

    fn all_gather(&self, part: &[f32], out: &mut [f32]) -> Result<(), EngineError> {
        let mut comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        if out.len() != part.len() * comm.world() {
            return Err(EngineError::Collective(format!(
                "all_gather of {} values into {} for {} ranks",
                part.len(),
                out.len(),
                comm.world()
            )));
        }
        if part.is_empty() {
            return Ok(());
        }
        let dev_part = self.device.upload(part).map_err(nccl_failed)?;
        let mut dev_out = self.device.alloc_zeros::<f32>(out.len()).map_err(nccl_failed)?;
        comm.all_gather(&dev_part, part.len(), &mut dev_out)
            .map_err(nccl_failed)?;
        out.copy_from_slice(&dev_out.download().map_err(nccl_failed)?);
        Ok(())
    }
}

/// A rank's [`Collective`] as the all-gather a fully-sharded pool's apply
/// asks for ([`lora_pool::LoraPool::apply_fully_sharded`]): the rank's
/// shrink output goes to the host, the collective gathers every rank's,
/// and the gathered parts go back to the device (the reference engine
/// keeps its activations on the host; a serving engine passes its NCCL
/// communicator itself, which gathers on the device's stream).
pub struct CollectiveGather<'c>(pub &'c dyn Collective);

impl RankGather for CollectiveGather<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world(&self) -> usize {
        self.0.world()
    }

    fn all_gather(
        &mut self,
        part: &DeviceBuffer<f32>,
        part_len: usize,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<(), PoolError> {
        let host = part.download_range(0, part_len)?;
        let mut all = vec![0f32; part_len * self.0.world()];
        self.0
            .all_gather(&host, &mut all)
            .map_err(|e| PoolError::Gather(e.to_string()))?;
        Ok(out.write(0, &all)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_reduce_and_gather_in_rank_order() {
        let group = HostCollective::group(3);
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let mut buf = vec![r, 10.0 * r];
                        c.all_reduce_sum(&mut buf).expect("reduce");
                        let mut out = vec![0.0; 6];
                        c.all_gather(&[r, -r], &mut out).expect("gather");
                        (buf, out)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        for (buf, out) in results {
            assert_eq!(buf, [3.0, 30.0]);
            assert_eq!(out, [0.0, -0.0, 1.0, -1.0, 2.0, -2.0]);
        }
        let one = HostCollective::group(1);
        let back = one[0].all_to_all_v(&[vec![4.0, 5.0]]).expect("one rank");
        assert_eq!(back, [vec![4.0, 5.0]]);
        assert!(one[0].all_to_all_v(&[]).is_err());
        let mut out = vec![0.0; 3];
        assert!(one[0].all_gather(&[1.0, 2.0], &mut out).is_err());
    }
}

#[cfg(test)]
mod all_to_all_tests {
    use super::*;

    /// Rank `s` sends rank `d` a buffer whose length and values name both
    /// (some empty, one longer than 16 bits of length); each rank gets
    /// exactly what was sent to it, in rank order.
    #[test]
    fn every_rank_gets_what_each_rank_sent_it() {
        let world = 3;
        let msg = |s: usize, d: usize| -> Vec<f32> {
            let len = if (s, d) == (2, 1) { 70_000 } else { (s * 2 + d) % 4 };
            (0..len).map(|i| (s * 1000 + d * 100) as f32 + i as f32 / 8.0).collect()
        };
        let group = HostCollective::group(world);
        let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let send: Vec<Vec<f32>> = (0..world).map(|d| msg(c.rank(), d)).collect();
                        c.all_to_all_v(&send).expect("all_to_all_v")
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        for (d, recv) in got.iter().enumerate() {
            assert_eq!(recv.len(), world);
            for (s, buf) in recv.iter().enumerate() {
                assert_eq!(buf, &msg(s, d), "rank {d} from rank {s}");
            }
        }
    }
}
