//! [`Device`]: the CPU reference backend or one CUDA device, cheap to clone.

use std::fmt;
use std::sync::Arc;

use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{self, CudaBackend};
use crate::error::{FaultFlags, KernelError};

/// Where buffers live and kernels run: the CPU reference backend or one CUDA
/// device (a context, one stream, a fault word). Clones share the device.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Backend>,
}

pub(crate) enum Backend {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

pub(crate) struct CpuBackend {
    pub(crate) memory: Arc<CpuMemory>,
}

/// Which of a device's two streams an operation is queued on. Everything
/// runs on [`Lane::Compute`] unless a call names [`Lane::Copy`]: the swap
/// path's uploads, device copies, repack and value scan, so an adapter lands
/// while the compute stream replays decode graphs. Work on the two lanes is
/// unordered until the caller orders it with events
/// ([`Device::record_event_on`], [`Device::wait_event`]). The CPU backend
/// runs every operation at once, so its lanes are one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lane {
    /// The device's stream: every apply, graph and buffer operation.
    #[default]
    Compute,
    /// The copy stream, beside it.
    Copy,
}

/// Which backend a [`Device`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU reference backend.
    Cpu,
    /// A CUDA device.
    Cuda,
}

impl Device {
    /// A new CPU device with its own address space.
    pub fn cpu() -> Device {
        Device {
            inner: Arc::new(Backend::Cpu(CpuBackend {
                memory: CpuMemory::new(),
            })),
        }
    }

    /// A new CPU device whose live allocations may total at most
    /// `limit_bytes`: an allocation beyond it fails with
    /// [`KernelError::OutOfMemory`], and [`Device::memory_info`] reports the
    /// limit. For testing what callers do when device memory runs out.
    pub fn cpu_with_memory_limit(limit_bytes: usize) -> Device {
        Device {
            inner: Arc::new(Backend::Cpu(CpuBackend {
                memory: CpuMemory::with_limit(Some(limit_bytes)),
            })),
        }
    }

    /// CUDA device `ordinal`, with a fresh stream. A missing driver, missing
    /// NVRTC or absent device is an error, never a panic.
    pub fn cuda(ordinal: usize) -> Result<Device, KernelError> {
        Ok(Device {
            inner: Arc::new(Backend::Cuda(Box::new(cuda_rt::open(ordinal)?))),
        })
    }

    /// CUDA device 0 when it can be used, else the CPU, with the reason CUDA
    /// was not taken.
    pub fn best() -> (Device, Option<KernelError>) {
        match Device::cuda(0) {
            Ok(d) => (d, None),
            Err(e) => (Device::cpu(), Some(e)),
        }
    }

    /// The backend kind.
    pub fn kind(&self) -> DeviceKind {
        match &*self.inner {
            Backend::Cpu(_) => DeviceKind::Cpu,
            Backend::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        self.kind() == DeviceKind::Cuda
    }

    /// A human name: `"NVIDIA H200 (sm_90)"` or `"cpu"`.
    pub fn name(&self) -> String {
        match &*self.inner {
            Backend::Cpu(_) => "cpu".to_string(),
            Backend::Cuda(c) => {
                let (major, minor) = c.compute_capability;
                format!("{} (sm_{major}{minor})", c.name)
            }
        }
    }

    /// What the launch planners read of a CUDA device (`None` on the CPU,
    /// which runs the reference and plans nothing).
    pub fn limits(&self) -> Option<crate::ops::limits::DeviceLimits> {
        match &*self.inner {
            Backend::Cpu(_) => None,
            Backend::Cuda(c) => Some(crate::ops::limits::DeviceLimits::of(c)),
        }
    }

    /// Compute capability of a CUDA device.
    pub fn compute_capability(&self) -> Option<(i32, i32)> {
        match &*self.inner {
            Backend::Cpu(_) => None,
            Backend::Cuda(c) => Some(c.compute_capability),
        }
    }

    /// Multiprocessors of a CUDA device (launch sizing); the CPU reports 1.
    pub fn sm_count(&self) -> usize {
        match &*self.inner {
            Backend::Cpu(_) => 1,
            Backend::Cuda(c) => c.sm_count as usize,
        }
    }

    /// L2 cache bytes of a CUDA device (0 on the CPU).
    pub fn l2_bytes(&self) -> usize {
        match &*self.inner {
            Backend::Cpu(_) => 0,
            Backend::Cuda(c) => c.l2_bytes,
        }
    }

    /// `(free, total)` bytes of device memory (on the CPU: the limit of
    /// [`Device::cpu_with_memory_limit`], else host memory from `/proc/meminfo`).
    pub fn memory_info(&self) -> Result<(usize, usize), KernelError> {
        match &*self.inner {
            Backend::Cpu(cpu) => cpu
                .memory
                .limit_info()
                .or_else(host_memory_info)
                .ok_or(KernelError::Unsupported {
                    what: "memory query without /proc/meminfo",
                    device: self.name(),
                }),
            Backend::Cuda(c) => c.mem_info(),
        }
    }

    /// Wait until everything issued on the device (both lanes) has finished.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        match &*self.inner {
            Backend::Cpu(_) => Ok(()),
            Backend::Cuda(c) => c.synchronize(),
        }
    }

    /// Compile and load every kernel family now (CUDA), so that nothing is
    /// compiled later, e.g. during a graph capture. No-op on the CPU.
    pub fn preload_kernels(&self) -> Result<(), KernelError> {
        match &*self.inner {
            Backend::Cpu(_) => Ok(()),
            Backend::Cuda(c) => c.preload(),
        }
    }

    /// Read and clear the faults CUDA kernels raised since the last call
    /// (synchronises). The CPU backend reports bad data as errors at once,
    /// so its faults are always empty.
    pub fn take_faults(&self) -> Result<FaultFlags, KernelError> {
        match &*self.inner {
            Backend::Cpu(_) => Ok(FaultFlags::default()),
            Backend::Cuda(c) => c.take_faults().map(FaultFlags),
        }
    }

    /// [`Device::take_faults`] as a result: an error when any fault was raised.
    pub fn check_faults(&self) -> Result<(), KernelError> {
        let faults = self.take_faults()?;
        if faults.is_empty() {
            Ok(())
        } else {
            Err(KernelError::KernelFault(faults))
        }
    }

    /// Test and debug aid (CPU backend only): let the next `n` device writes
    /// on this device succeed and make the one after fail with
    /// [`KernelError::InjectedFault`], writing nothing. One-shot: the fault
    /// disarms itself when it fires; arming again replaces a fault not yet
    /// fired. Clones of the device share it.
    ///
    /// A device write is one call of [`DeviceBuffer::write`],
    /// [`DeviceBuffer::upload_pinned`], [`DeviceBuffer::copy_from`],
    /// [`DeviceBuffer::zero_range`] or [`crate::repack`] that writes at
    /// least one element (a call refused for its arguments, or with nothing
    /// to write, is not one). Kernel outputs and allocations are not.
    /// [`Device::write_count`] counts them, so a test can run an operation
    /// once, count its writes, and then fail each in turn.
    ///
    /// When no fault is armed a CPU write pays one relaxed counter increment
    /// and one flag load. On a CUDA device this call refuses with
    /// [`KernelError::Unsupported`] and arms nothing; CUDA writes are never
    /// counted or faulted.
    ///
    /// [`DeviceBuffer::write`]: crate::DeviceBuffer::write
    /// [`DeviceBuffer::upload_pinned`]: crate::DeviceBuffer::upload_pinned
    /// [`DeviceBuffer::copy_from`]: crate::DeviceBuffer::copy_from
    /// [`DeviceBuffer::zero_range`]: crate::DeviceBuffer::zero_range
    pub fn inject_write_fault_after(&self, n: usize) -> Result<(), KernelError> {
        match &*self.inner {
            Backend::Cpu(cpu) => {
                cpu.memory.inject_write_fault_after(n);
                Ok(())
            }
            Backend::Cuda(_) => Err(KernelError::Unsupported {
                what: "device write fault injection",
                device: self.name(),
            }),
        }
    }

    /// Disarm the fault of [`Device::inject_write_fault_after`]; whether one
    /// was still armed (had not fired). Always `false` on CUDA.
    pub fn clear_write_fault(&self) -> bool {
        match &*self.inner {
            Backend::Cpu(cpu) => cpu.memory.clear_write_fault(),
            Backend::Cuda(_) => false,
        }
    }

    /// Device writes (as [`Device::inject_write_fault_after`] counts them,
    /// faulted ones included) issued on this CPU device so far; `None` on
    /// CUDA, which does not count them.
    pub fn write_count(&self) -> Option<u64> {
        match &*self.inner {
            Backend::Cpu(cpu) => Some(cpu.memory.write_count()),
            Backend::Cuda(_) => None,
        }
    }

    /// Count one device write on the CPU backend and fail it when it is the
    /// injected fault; nothing on CUDA.
    pub(crate) fn before_write(&self, op: &'static str) -> Result<(), KernelError> {
        match &*self.inner {
            Backend::Cpu(cpu) => cpu.memory.before_write(op),
            Backend::Cuda(_) => Ok(()),
        }
    }

    /// Whether two handles are the same device.
    pub fn same_as(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub(crate) fn backend(&self) -> &Backend {
        &self.inner
    }

    /// An error unless `other` (the device of argument `arg`) is this device.
    pub(crate) fn expect_same(&self, arg: &'static str, other: &Device) -> Result<(), KernelError> {
        if self.same_as(other) {
            Ok(())
        } else {
            Err(KernelError::DeviceMismatch {
                arg,
                found: other.describe(),
                expected: self.describe(),
            })
        }
    }

    fn describe(&self) -> String {
        format!("{} @{:p}", self.name(), Arc::as_ptr(&self.inner))
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("name", &self.name()).finish()
    }
}

pub(crate) fn host_memory_info() -> Option<(usize, usize)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<usize> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        kb.checked_mul(1024)
    };
    Some((field("MemAvailable:")?, field("MemTotal:")?))
}

/// Compile every kernel family with NVRTC for `compute_capability` (needs
/// `libnvrtc` only, no GPU): a build check for the CUDA sources.
pub fn compile_all_kernels(compute_capability: (i32, i32)) -> Result<(), KernelError> {
    for family in cuda_rt::Family::ALL {
        cuda_rt::compile_family(family, compute_capability)?;
    }
    Ok(())
}

/// The translation units NVRTC compiles, one per kernel family, as
/// `(file name, source)`: for inspecting the machine code offline (e.g.
/// compiling them with `nvcc -cubin` and comparing builds function by function).
pub fn kernel_sources() -> Vec<(&'static str, String)> {
    cuda_rt::Family::ALL
        .iter()
        .map(|f| (f.module_name(), f.source()))
        .collect()
}

#[cfg(test)]
mod tests;
