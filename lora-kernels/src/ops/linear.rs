//! f32 linear layers: `y[n, m] = x[n, k] · w[m, k]^T`, row-major, with `w` in
//! PyTorch's `nn.Linear` layout `[out, in]` — the base projections of a model
//! whose weights live on the device.
//!
//! On CUDA this is one cuBLAS SGEMM on the device's stream (f32 in, f32
//! accumulation, f32 out; the handle's default math mode, so no TF32), through
//! a handle the device creates at its first call. On the CPU it is a plain
//! reference loop: every output element is one f32 sum over `k` in index
//! order. The two sum in different orders, so they agree to f32 rounding,
//! not bit for bit.
//!
//! Unlike the apply calls this op is not promised to be graph-capturable
//! or allocation-free: the first call on a device creates the cuBLAS handle,
//! and cuBLAS may allocate its workspace when it first needs it. It never
//! synchronises (on CUDA it is ordered on the stream like every kernel; a
//! download of `y` waits for it). A bias, where a projection has one, is the
//! caller's to add.

use crate::buffer::{DeviceBuffer, check_range};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};
use crate::ops::to_i32;

/// `y[n, m] = x[n, k] · w[m, k]^T` in f32, all row-major, over the first
/// `n * k` elements of `x`, `m * k` of `w` and `n * m` of `y` (the buffers
/// may be longer; elements of `y` past `n * m` are left as they are). With
/// `k == 0` the product is all zeros; with `n == 0` or `m == 0` nothing is
/// written.
///
/// Errors, before anything runs: a buffer of another device
/// ([`KernelError::DeviceMismatch`]), a buffer shorter than its shape
/// ([`KernelError::OutOfBounds`]), a dimension or element count that does
/// not fit cuBLAS's 32-bit dimensions or `usize`
/// ([`KernelError::InvalidArgument`]); on CUDA, a missing `libcublas`
/// ([`KernelError::CublasMissing`]) or a failed cuBLAS call
/// ([`KernelError::Cublas`]).
///
/// ```
/// use lora_kernels::{Device, linear_f32};
/// let dev = Device::cpu();
/// let x = dev.upload(&[1.0f32, 2.0, 3.0, 4.0]).unwrap(); // [2, 2]
/// let w = dev.upload(&[1.0f32, 0.0, 1.0, 1.0, 0.0, -1.0]).unwrap(); // [3, 2]
/// let mut y = dev.alloc_zeros::<f32>(6).unwrap();
/// linear_f32(&dev, &x, &w, 2, 2, 3, &mut y).unwrap();
/// assert_eq!(y.download().unwrap(), vec![1.0, 3.0, -2.0, 3.0, 7.0, -4.0]);
/// ```
pub fn linear_f32(
    device: &Device,
    x: &DeviceBuffer<f32>,
    w: &DeviceBuffer<f32>,
    n: usize,
    k: usize,
    m: usize,
    y: &mut DeviceBuffer<f32>,
) -> Result<(), KernelError> {
    device.expect_same("x", x.device())?;
    device.expect_same("w", w.device())?;
    device.expect_same("y", y.device())?;
    let (n_i, k_i, m_i) = (to_i32("n", n)?, to_i32("k", k)?, to_i32("m", m)?);
    let x_len = elems("x", n, k)?;
    let w_len = elems("w", m, k)?;
    let y_len = elems("y", n, m)?;
    check_range("x", 0, x_len, x.len())?;
    check_range("w", 0, w_len, w.len())?;
    check_range("y", 0, y_len, y.len())?;
    if y_len == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(_) => {
            let xs = x.download_range(0, x_len)?;
            let ws = w.download_range(0, w_len)?;
            y.cpu_modify(0, y_len, |out| linear_reference(&xs, &ws, n, k, m, out))
        }
        Backend::Cuda(c) => {
            if k == 0 {
                return y.zero_range(0, y_len);
            }
            // SAFETY: the three buffers are live allocations of this device
            // (checked above) holding at least `n * k`, `m * k` and `n * m`
            // f32s (checked above); `y` is borrowed mutably while `x` and `w`
            // are borrowed shared, so it overlaps neither; `n`, `m` and `k`
            // are positive (`y_len > 0`, `k != 0`) and fit i32.
            unsafe { c.sgemm_nt(x.device_addr(), w.device_addr(), y.device_addr(), n_i, k_i, m_i) }
        }
    }
}

/// `a * b` elements of argument `arg`, or an error when that overflows.
fn elems(arg: &'static str, a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_mul(b)
        .ok_or_else(|| invalid(arg, format!("{a} x {b} elements overflow")))
}

/// The CPU reference: each output one f32 sum over `k` in index order.
/// Lengths are the caller's (checked): `x` `n * k`, `w` `m * k`, `y` `n * m`.
fn linear_reference(x: &[f32], w: &[f32], n: usize, k: usize, m: usize, y: &mut [f32]) {
    for r in 0..n {
        let xr = &x[r * k..(r + 1) * k];
        for o in 0..m {
            let wr = &w[o * k..(o + 1) * k];
            let mut s = 0.0f32;
            for (a, b) in xr.iter().zip(wr) {
                s += a * b;
            }
            y[r * m + o] = s;
        }
    }
}

#[cfg(test)]
mod tests;
