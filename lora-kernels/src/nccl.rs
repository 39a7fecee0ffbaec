//! NCCL communicators on a CUDA [`Device`]'s stream: what a tensor- or
//! expert-parallel group's ranks use to all-reduce and all-gather device
//! buffers (cudarc's `nccl` bindings, loaded at run time like the driver).
//!
//! [`NcclComm::one_rank`] is a group of one (all collectives are copies,
//! and the code path runs on one GPU); [`NcclComm::from_rank`] joins a group
//! of `world` ranks that share an [`NcclId`] (made by one rank, sent to
//! the others by the engine's own means). Collectives are queued on the
//! device's one stream, after everything queued before them, and are
//! CUDA-graph capturable as NCCL allows.
//!
//! This module must never be the engine's only way to talk: an engine that
//! already holds a communicator passes its own collective to the layers
//! above; and it must never run on the CPU backend (a typed error), nor
//! panic when `libnccl` is absent (a typed error, [`KernelError::NcclMissing`]).

use cudarc::nccl::{result, sys};

use crate::buffer::{DeviceBuffer, check_range};
use crate::device::{Backend, Device};
use crate::error::KernelError;

/// The identity of an NCCL group: made once by one rank, given to every
/// rank's [`NcclComm::from_rank`].
#[derive(Clone, Copy)]
pub struct NcclId(sys::ncclUniqueId);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A fresh group identity (`ncclGetUniqueId`).
    pub fn new() -> Result<NcclId, KernelError> {
        nccl_present()?;
        result::get_uniqueid().map(NcclId).map_err(nccl_err("ncclGetUniqueId"))
    }

    /// Its 128 bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    /// An identity another rank sent as [`NcclId::to_bytes`].
    pub fn from_bytes(bytes: [u8; 128]) -> NcclId {
        NcclId(sys::ncclUniqueId {
            internal: bytes.map(|b| b as ::core::ffi::c_char),
        })
    }
}

/// One rank's NCCL communicator, bound to a CUDA device's stream.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    device: Device,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls
// on it do not overlap; every call here takes `&mut self` or, for the
// read-only accessors, touches no NCCL state, and `Drop` runs once.
unsafe impl Send for NcclComm {}

fn nccl_err(call: &'static str) -> impl Fn(result::NcclError) -> KernelError {
    move |e| KernelError::Nccl {
        call,
        detail: format!("{:?}", e.0),
    }
}

/// Whether `libnccl` can be loaded.
fn nccl_present() -> Result<(), KernelError> {
    // SAFETY: `is_culib_present` only tries `dlopen` on the library's
    // candidate names and drops the handle; it touches no other state.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(KernelError::NcclMissing)
    }
}

impl NcclComm {
    /// A group of one rank on `device` (`ncclCommInitAll` over one device).
    ///
    /// Errors: the CPU backend ([`KernelError::Unsupported`]), no
    /// `libnccl` ([`KernelError::NcclMissing`]), NCCL's refusal.
    pub fn one_rank(device: &Device) -> Result<NcclComm, KernelError> {
        let Backend::Cuda(c) = device.backend() else {
            return Err(unsupported(device));
        };
        nccl_present()?;
        c.ctx.bind_to_thread().map_err(|e| KernelError::Driver {
            call: "cuCtxSetCurrent",
            detail: e.to_string(),
        })?;
        let ordinal = [c.ctx.ordinal() as ::core::ffi::c_int];
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is one writable communicator handle and `ordinal`
        // one device ordinal, as `ncclCommInitAll(comm, 1, devlist)` reads.
        unsafe { result::comm_init_all(&mut comm, 1, ordinal.as_ptr()) }.map_err(nccl_err("ncclCommInitAll"))?;
        Ok(NcclComm {
            comm,
            rank: 0,
            world: 1,
            device: device.clone(),
        })
    }

    /// Rank `rank` of a group of `world` on `device`, every rank given the
    /// same `id` (`ncclCommInitRank`: blocks until every rank has joined).
    pub fn from_rank(device: &Device, rank: usize, world: usize, id: &NcclId) -> Result<NcclComm, KernelError> {
        let Backend::Cuda(c) = device.backend() else {
            return Err(unsupported(device));
        };
        if rank >= world {
            return Err(KernelError::InvalidArgument {
                arg: "rank",
                reason: format!("rank {rank} is not below world {world}"),
            });
        }
        let to_int = |what: &'static str, v: usize| {
            ::core::ffi::c_int::try_from(v).map_err(|_| KernelError::InvalidArgument {
                arg: what,
                reason: format!("{v} does not fit a C int"),
            })
        };
        let (rank_i, world_i) = (to_int("rank", rank)?, to_int("world", world)?);
        nccl_present()?;
        c.ctx.bind_to_thread().map_err(|e| KernelError::Driver {
            call: "cuCtxSetCurrent",
            detail: e.to_string(),
        })?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is one writable communicator handle; `id` is an
        // identity from `ncclGetUniqueId` (or its bytes); rank < world.
        unsafe { result::comm_init_rank(&mut comm, world_i, id.0, rank_i) }.map_err(nccl_err("ncclCommInitRank"))?;
        Ok(NcclComm {
            comm,
            rank,
            world,
            device: device.clone(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Every rank's first `len` elements of `buf` summed, in place, on
    /// every rank (`ncclAllReduce`, f32 sum), queued on the device's stream.
    pub fn all_reduce_sum(&mut self, buf: &mut DeviceBuffer<f32>, len: usize) -> Result<(), KernelError> {
        self.device.expect_same("buf", buf.device())?;
        check_range("buf", 0, len, buf.len())?;
        let Backend::Cuda(c) = self.device.backend() else {
            return Err(unsupported(&self.device));
        };
        let ptr = buf.device_addr() as *mut ::core::ffi::c_void;
        // SAFETY: `buf` is a live allocation of this communicator's device
        // holding at least `len` f32s (checked above), used in place; the
        // stream is the device's own, which orders every use of `buf`.
        unsafe {
            result::all_reduce(
                ptr,
                ptr,
                len,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                c.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(nccl_err("ncclAllReduce"))
    }

    /// Every rank's first `part_len` elements of `part` written into `out`,
    /// rank `r`'s at `r * part_len` (`ncclAllGather`, f32), queued on the
    /// device's stream.
    pub fn all_gather(
        &mut self,
        part: &DeviceBuffer<f32>,
        part_len: usize,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<(), KernelError> {
        self.device.expect_same("part", part.device())?;
        self.device.expect_same("out", out.device())?;
        check_range("part", 0, part_len, part.len())?;
        let total = part_len.checked_mul(self.world).ok_or(KernelError::InvalidArgument {
            arg: "part_len",
            reason: "part_len * world overflows".into(),
        })?;
        check_range("out", 0, total, out.len())?;
        let Backend::Cuda(c) = self.device.backend() else {
            return Err(unsupported(&self.device));
        };
        // SAFETY: both buffers are live allocations of this device holding
        // `part_len` and `world * part_len` f32s (checked above); `out` is
        // borrowed mutably while `part` is borrowed shared, so they do not
        // overlap; the device's stream orders every use of both.
        unsafe {
            result::all_gather(
                part.device_addr() as *const ::core::ffi::c_void,
                out.device_addr() as *mut ::core::ffi::c_void,
                part_len,
                sys::ncclDataType_t::ncclFloat32,
                self.comm,
                c.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(nccl_err("ncclAllGather"))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: `comm` came from a successful init and is destroyed
            // once, here; an error while tearing down has no one to tell.
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}

fn unsupported(device: &Device) -> KernelError {
    KernelError::Unsupported {
        what: "NCCL",
        device: device.name(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::cuda_or_skip;

    #[test]
    fn the_cpu_backend_has_no_nccl() {
        let err = NcclComm::one_rank(&Device::cpu()).unwrap_err();
        assert!(matches!(err, KernelError::Unsupported { what: "NCCL", .. }), "{err}");
        let id = NcclId::from_bytes([7; 128]);
        assert_eq!(id.to_bytes(), [7; 128]);
        assert!(NcclComm::from_rank(&Device::cpu(), 0, 2, &id).is_err());
    }

    /// A one-rank communicator on one GPU: the all-reduce leaves the
    /// buffer as it was, the all-gather copies the part; poisoned outputs.
    #[test]
    #[ignore = "needs a GPU with libnccl: run with --include-ignored where CUDA is usable"]
    fn a_one_rank_communicator_reduces_and_gathers_on_one_gpu() {
        let Some(device) = cuda_or_skip("a_one_rank_communicator_reduces_and_gathers_on_one_gpu") else {
            return;
        };
        let mut comm = match NcclComm::one_rank(&device) {
            Err(KernelError::NcclMissing) if std::env::var_os("LORA_REQUIRE_GPU").is_none() => {
                eprintln!("SKIPPED: libnccl is not present");
                return;
            }
            other => other.expect("one-rank communicator"),
        };
        assert_eq!((comm.rank(), comm.world()), (0, 1));
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut buf = device.upload(&x).expect("upload");
        comm.all_reduce_sum(&mut buf, x.len()).expect("all_reduce");
        assert_eq!(buf.download().expect("download"), x);
        let part = device.upload(&x[..300]).expect("upload");
        let mut out = device.upload(&vec![f32::NAN; 400]).expect("upload");
        comm.all_gather(&part, 300, &mut out).expect("all_gather");
        let got = out.download().expect("download");
        assert_eq!(&got[..300], &x[..300]);
        assert!(got[300..].iter().all(|v| v.is_nan()), "past the gather: untouched");
        assert!(
            comm.all_gather(&part, 300, &mut device.upload(&[0.0f32; 10]).expect("upload"))
                .is_err()
        );
    }
}
