//! The RDMA READ transport's pieces. What needs no device (read planning,
//! access-flag choice, completion-status mapping, errors) is always built
//! and tested; the device code (`ibverbs-sys` FFI behind RAII wrappers,
//! queue-pair setup, the transport and the peer's side) is under the
//! `ibverbs` feature.
//!
//! Rules it keeps: peer staging memory is registered for remote read only
//! (the CPU fills it, the HCA only reads it, so not even local write); the
//! engine's landing buffer for local write only; the engine's queue pair
//! grants no remote access at all. Wrappers release their resource in
//! `Drop` and never panic there.
//!
//! Device memory: the engine reads into a registered host staging buffer
//! and copies each piece into its landing image; the pool's publish then
//! copies the image to the GPU, so every byte crosses host memory twice.
//! What a host with an RDMA NIC beside the GPU would add (not built here:
//! it needs both on one host to test, and neither exists where this is
//! built): register every pool slot's device memory once, when the pool is
//! made (the pool never moves, so the registration holds for its life), as
//! a dmabuf — the CUDA driver exports the slot's range as a dmabuf fd
//! (`cuMemGetHandleForAddressRange` with
//! `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`) and `ibv_reg_dmabuf_mr`
//! registers it for local write only — and post each READ with the victim
//! slot's region of the part (computed locally from lora-layout, as now) as
//! its local address. The NIC then writes the bytes straight into the slot
//! over PCIe: no staging buffer, no image, no host-to-device copy. Two
//! rules move with it: the victim slot leaves service before the first
//! READ (no lease, its table entries cleared) rather than at the publish,
//! so nothing still lands in a live slot; and the checksums are computed
//! by a kernel over the landed regions, so the publish only writes the
//! pair tables once they match. A failed landing leaves that slot out of
//! service, every other slot unchanged.

use std::io;
use std::time::Duration;

use crate::protocol::EndpointError;

pub mod plan;

#[cfg(feature = "ibverbs")]
mod device;
#[cfg(feature = "ibverbs")]
mod transport;

#[cfg(feature = "ibverbs")]
pub use device::{Context, MemoryRegion, RegisteredBytes, list_devices};
#[cfg(feature = "ibverbs")]
pub use transport::{PeerDevice, PeerQueuePair, VerbsOptions, VerbsTransport};

/// What a registered buffer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryRole {
    /// A peer's staged adapter: remote engines RDMA READ it.
    PeerStaging,
    /// The engine's landing buffer: RDMA READ responses are written into it.
    EngineLanding,
}

/// Memory access rights, as `ibv_access_flags` grants them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// `IBV_ACCESS_LOCAL_WRITE`: the local HCA may write the memory.
    pub local_write: bool,
    /// `IBV_ACCESS_REMOTE_READ`.
    pub remote_read: bool,
    /// `IBV_ACCESS_REMOTE_WRITE` (never granted here).
    pub remote_write: bool,
    /// `IBV_ACCESS_REMOTE_ATOMIC` (never granted here).
    pub remote_atomic: bool,
}

/// The exact rights a buffer of `role` is registered with: the least each
/// needs.
pub fn access_for(role: MemoryRole) -> Access {
    match role {
        MemoryRole::PeerStaging => Access {
            remote_read: true,
            ..Access::default()
        },
        MemoryRole::EngineLanding => Access {
            local_write: true,
            ..Access::default()
        },
    }
}

/// A work completion's status (`enum ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`
    Success,
    /// `IBV_WC_LOC_LEN_ERR`: a message over the port's limit.
    LocalLength,
    /// `IBV_WC_LOC_QP_OP_ERR`
    LocalQpOperation,
    /// `IBV_WC_LOC_EEC_OP_ERR`
    LocalEecOperation,
    /// `IBV_WC_LOC_PROT_ERR`: the local buffer is not registered for this.
    LocalProtection,
    /// `IBV_WC_WR_FLUSH_ERR`: flushed after the queue pair failed.
    Flushed,
    /// `IBV_WC_MW_BIND_ERR`
    MemoryWindowBind,
    /// `IBV_WC_BAD_RESP_ERR`
    BadResponse,
    /// `IBV_WC_LOC_ACCESS_ERR`
    LocalAccess,
    /// `IBV_WC_REM_INV_REQ_ERR`: the peer refused the request (e.g. its
    /// queue pair does not allow remote read).
    RemoteInvalidRequest,
    /// `IBV_WC_REM_ACCESS_ERR`: the remote range or key is not readable
    /// (deregistered, out of bounds, wrong key).
    RemoteAccess,
    /// `IBV_WC_REM_OP_ERR`
    RemoteOperation,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer stopped answering.
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`
    RnrRetryExceeded,
    /// `IBV_WC_LOC_RDD_VIOL_ERR`
    LocalRddViolation,
    /// `IBV_WC_REM_INV_RD_REQ_ERR`
    RemoteInvalidRdRequest,
    /// `IBV_WC_REM_ABORT_ERR`
    RemoteAborted,
    /// `IBV_WC_INV_EECN_ERR`
    InvalidEecn,
    /// `IBV_WC_INV_EEC_STATE_ERR`
    InvalidEecState,
    /// `IBV_WC_FATAL_ERR`
    Fatal,
    /// `IBV_WC_RESP_TIMEOUT_ERR`
    ResponseTimeout,
    /// `IBV_WC_GENERAL_ERR`
    General,
    /// `IBV_WC_TM_ERR`
    TagMatching,
    /// `IBV_WC_TM_RNDV_INCOMPLETE`
    TagMatchingRendezvous,
    /// A code this build does not know.
    Unknown(u32),
}

impl WcStatus {
    /// Every known status in code order: `KNOWN[code]` has that code.
    pub const KNOWN: [WcStatus; 24] = [
        WcStatus::Success,
        WcStatus::LocalLength,
        WcStatus::LocalQpOperation,
        WcStatus::LocalEecOperation,
        WcStatus::LocalProtection,
        WcStatus::Flushed,
        WcStatus::MemoryWindowBind,
        WcStatus::BadResponse,
        WcStatus::LocalAccess,
        WcStatus::RemoteInvalidRequest,
        WcStatus::RemoteAccess,
        WcStatus::RemoteOperation,
        WcStatus::RetryExceeded,
        WcStatus::RnrRetryExceeded,
        WcStatus::LocalRddViolation,
        WcStatus::RemoteInvalidRdRequest,
        WcStatus::RemoteAborted,
        WcStatus::InvalidEecn,
        WcStatus::InvalidEecState,
        WcStatus::Fatal,
        WcStatus::ResponseTimeout,
        WcStatus::General,
        WcStatus::TagMatching,
        WcStatus::TagMatchingRendezvous,
    ];

    /// The status of a raw `ibv_wc_status` code.
    pub fn from_code(code: u32) -> WcStatus {
        usize::try_from(code)
            .ok()
            .and_then(|i| WcStatus::KNOWN.get(i).copied())
            .unwrap_or(WcStatus::Unknown(code))
    }

    /// The raw code.
    pub fn code(self) -> u32 {
        match self {
            WcStatus::Unknown(code) => code,
            known => WcStatus::KNOWN.iter().position(|&s| s == known).unwrap_or(0) as u32,
        }
    }
}

/// An RDMA failure.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA device of that name (or none at all).
    #[error("no RDMA device {0:?}")]
    NoDevice(String),
    /// A verbs call failed.
    #[error("{call} failed: {source}")]
    Call {
        /// The call.
        call: &'static str,
        /// The errno it gave.
        source: io::Error,
    },
    /// A work request completed with an error.
    #[error("RDMA READ {wr_id} completed with {status:?} (vendor error {vendor_err:#x})")]
    Completion {
        /// The request.
        wr_id: u64,
        /// Its status.
        status: WcStatus,
        /// The vendor syndrome.
        vendor_err: u32,
    },
    /// A read completed with fewer bytes than asked.
    #[error("RDMA READ {wr_id} moved {got} bytes, {expected} were asked for")]
    ShortRead {
        /// The request.
        wr_id: u64,
        /// Bytes moved.
        got: usize,
        /// Bytes asked.
        expected: usize,
    },
    /// Completions did not arrive in time.
    #[error("RDMA completions did not arrive within {0:?}")]
    Timeout(Duration),
    /// The ops cannot be planned.
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    /// The peer's endpoint is invalid.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The local port is not usable.
    #[error("RDMA port {port}: {reason}")]
    Port {
        /// The port.
        port: u8,
        /// What is wrong.
        reason: String,
    },
}

impl VerbsError {
    /// The error of a verbs call that returned `errno` (or set it).
    pub fn call(call: &'static str, errno: i32) -> VerbsError {
        let source = if errno > 0 {
            io::Error::from_raw_os_error(errno)
        } else {
            io::Error::last_os_error()
        };
        VerbsError::Call { call, source }
    }

    /// The error of a completion with `status`, or `None` for success.
    pub fn completion(wr_id: u64, status: WcStatus, vendor_err: u32) -> Option<VerbsError> {
        (status != WcStatus::Success).then_some(VerbsError::Completion {
            wr_id,
            status,
            vendor_err,
        })
    }
}

#[cfg(test)]
mod tests;
