//! The crate's error type: one enum, each variant carrying the argument,
//! address or kernel at fault.

use std::fmt;

/// Everything a device, buffer or kernel call can refuse or fail with.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// `libcuda` could not be loaded (no NVIDIA driver on this machine).
    #[error("CUDA driver library (libcuda) not found")]
    DriverMissing,
    /// `libnvrtc` could not be loaded (no CUDA runtime compiler on this machine).
    #[error("NVRTC library (libnvrtc) not found; set LD_LIBRARY_PATH to the CUDA lib64 folder")]
    NvrtcMissing,
    /// `libcublas` could not be loaded (the f32 linear layers on CUDA need it).
    #[error("cuBLAS library (libcublas) not found; set LD_LIBRARY_PATH to the CUDA lib64 folder")]
    CublasMissing,
    /// `libnccl` could not be loaded (NCCL collectives need it).
    #[error("NCCL library (libnccl) not found; set LD_LIBRARY_PATH to its folder")]
    NcclMissing,
    /// An NCCL call failed.
    #[error("NCCL call {call} failed: {detail}")]
    Nccl {
        /// The NCCL operation.
        call: &'static str,
        /// NCCL's result code, as text.
        detail: String,
    },
    /// The driver is there but reports no device with this ordinal.
    #[error("no CUDA device with ordinal {ordinal} ({count} present)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {detail}")]
    Driver {
        /// The driver operation.
        call: &'static str,
        /// The driver's error code, as text.
        detail: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS call {call} failed: {detail}")]
    Cublas {
        /// The cuBLAS operation.
        call: &'static str,
        /// cuBLAS's status, as text.
        detail: String,
    },
    /// NVRTC rejected a kernel family's source.
    #[error("NVRTC could not compile {module}:\n{log}")]
    Compile {
        /// The `.cu` file.
        module: &'static str,
        /// NVRTC's log.
        log: String,
    },
    /// An allocation does not fit the device's free memory (the CPU
    /// backend's limit, see [`crate::Device::cpu_with_memory_limit`]).
    #[error("out of device memory: {requested} bytes requested, {free} free")]
    OutOfMemory {
        /// Bytes the allocation asked for.
        requested: usize,
        /// Bytes free when it was asked.
        free: usize,
    },
    /// A page-locked host allocation does not fit the host's available
    /// memory (`MemAvailable`), checked before it is taken.
    #[error("out of host memory: {requested} bytes of pinned memory requested, {free} available")]
    OutOfHostMemory {
        /// Bytes the allocation asked for.
        requested: usize,
        /// Bytes the host had available when it was asked.
        free: usize,
    },
    /// An operation this device kind cannot do (e.g. CUDA graphs on the CPU).
    #[error("{what} is not supported on {device}")]
    Unsupported {
        /// The operation.
        what: &'static str,
        /// The device's name.
        device: String,
    },
    /// A buffer of one device was passed to an operation on another.
    #[error("argument {arg} lives on {found}, the call runs on {expected}")]
    DeviceMismatch {
        /// The argument.
        arg: &'static str,
        /// The buffer's device.
        found: String,
        /// The call's device.
        expected: String,
    },
    /// An element range falls outside its buffer.
    #[error("argument {arg}: elements {start}..{end} are outside a buffer of {len}")]
    OutOfBounds {
        /// The argument.
        arg: &'static str,
        /// First element of the range.
        start: usize,
        /// One past the last element of the range.
        end: usize,
        /// The buffer's length.
        len: usize,
    },
    /// A shape, length or count argument is inconsistent.
    #[error("argument {arg}: {reason}")]
    InvalidArgument {
        /// The argument.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A device address (from a table or the caller) does not point into a
    /// live allocation of this device for the whole range it must cover.
    #[error("{what}: address {addr:#x} (+{bytes} bytes) {reason}")]
    BadAddress {
        /// What the address was for (e.g. "entry 3 A").
        what: String,
        /// The address.
        addr: u64,
        /// Bytes that must be readable there.
        bytes: usize,
        /// Why it does not resolve.
        reason: &'static str,
    },
    /// A row or segment names a table entry past the table.
    #[error("{arg}[{position}] = {index} is outside a table of {n_entries} entries")]
    BadIndex {
        /// The index array.
        arg: &'static str,
        /// Position in the index array.
        position: usize,
        /// The index found there.
        index: i64,
        /// The table's entry count.
        n_entries: usize,
    },
    /// A table entry whose rank exceeds the stride, or a non-zero rank with a null address.
    #[error("table entry {entry}: rank {rank} with stride {stride} (a={a:#x}, b={b:#x})")]
    BadEntry {
        /// The entry index.
        entry: usize,
        /// Its rank.
        rank: u32,
        /// The rank stride of the call.
        stride: usize,
        /// Its A address.
        a: u64,
        /// Its B address.
        b: u64,
    },
    /// A device write failed on purpose: the fault armed by
    /// [`crate::Device::inject_write_fault_after`] (CPU backend, tests).
    /// Nothing of the write reached the device.
    #[error("injected device fault on {op} (device write #{write})")]
    InjectedFault {
        /// The write that failed (`"write"`, `"copy"`, `"zero"`, `"repack"`).
        op: &'static str,
        /// The device's write count before it ([`crate::Device::write_count`]).
        write: u64,
    },
    /// A kernel found bad data on the device and skipped it (see [`FaultFlags`]).
    #[error("kernels reported faults: {0}")]
    KernelFault(FaultFlags),
}

/// Fault bits the CUDA kernels OR into the device's fault word when device
/// data is bad (bits match `cuda/common.cuh`). The CPU reference returns the
/// matching [`KernelError`] at once instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultFlags(pub u32);

impl FaultFlags {
    /// A row or segment index past its table.
    pub const BAD_INDEX: u32 = 1;
    /// A table entry with rank above the stride or a null address.
    pub const BAD_RANK: u32 = 2;
    /// `cu_seqlens` not monotonic or past the row count.
    pub const BAD_SEQLENS: u32 = 4;
    /// A token id past the vocabulary.
    pub const BAD_TOKEN: u32 = 8;
    /// An overlay row index past the overlay's rows.
    pub const BAD_OVERLAY_ROW: u32 = 16;
    /// An expert id past the expert count.
    pub const BAD_EXPERT: u32 = 32;

    /// Whether no fault is set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for FaultFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [(u32, &str); 6] = [
            (FaultFlags::BAD_INDEX, "index past table"),
            (FaultFlags::BAD_RANK, "bad entry rank/address"),
            (FaultFlags::BAD_SEQLENS, "bad cu_seqlens"),
            (FaultFlags::BAD_TOKEN, "token id past vocab"),
            (FaultFlags::BAD_OVERLAY_ROW, "overlay row past overlay"),
            (FaultFlags::BAD_EXPERT, "expert id past expert count"),
        ];
        let names: Vec<&str> = NAMES.iter().filter(|(b, _)| self.0 & b != 0).map(|(_, n)| *n).collect();
        if names.is_empty() {
            write!(f, "none")
        } else {
            write!(f, "{} ({:#x})", names.join(", "), self.0)
        }
    }
}

pub(crate) fn invalid(arg: &'static str, reason: impl Into<String>) -> KernelError {
    KernelError::InvalidArgument {
        arg,
        reason: reason.into(),
    }
}
