//! The launch floor of a measurement: one block of an empty kernel
//! (`lora_empty` in `cuda/bgmv.cu`). Benchmarks time it the way they time
//! every op, so the share of a small batch's time that is launch and cold
//! start, not kernel work, is visible beside it. It reads and writes nothing.

use crate::cuda_rt::{CudaBackend, Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::KernelError;

/// Launch one block of one thread that does nothing (a no-op on the CPU
/// backend). Capturable into a CUDA graph like every apply call.
pub fn empty_launch(device: &Device) -> Result<(), KernelError> {
    match device.backend() {
        Backend::Cpu(_) => Ok(()),
        Backend::Cuda(c) => empty_launch_on(c, false),
    }
}

/// [`empty_launch`] on `c`, as a programmatic dependent where `dependent`.
pub(crate) fn empty_launch_on(c: &CudaBackend, dependent: bool) -> Result<(), KernelError> {
    let unused: u64 = 0;
    let kernel = Kernel {
        family: Family::Bgmv,
        name: "lora_empty",
    };
    let launch = Launch {
        grid: (1, 1, 1),
        block: 1,
        smem: 0,
    };
    // SAFETY: `lora_empty` takes one u64 by value and touches no memory, so
    // as a dependent it needs no wait for the kernel before it.
    unsafe { c.launch_chained(kernel, launch, &unused, dependent) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_empty_launch_is_a_no_op_on_the_cpu() {
        assert!(empty_launch(&Device::cpu()).is_ok());
    }
}
