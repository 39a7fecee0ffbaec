//! The CUDA f32 linear layer (cuBLAS SGEMM) against the CPU reference, over
//! fresh random inputs and outputs poisoned first: f32 numerics (no TF32:
//! its ~1e-3 error would fail the bound), the row-major layout, only the
//! shaped prefix of y written, and the error paths on the device.

#![allow(clippy::unwrap_used)]

use lora_kernels::testing::{Rng, cuda_or_skip, rel_error};
use lora_kernels::{Device, KernelError, linear_f32};

fn run(dev: &Device, x: &[f32], w: &[f32], n: usize, k: usize, m: usize, y_len: usize) -> Vec<f32> {
    let xb = dev.upload(x).unwrap();
    let wb = dev.upload(w).unwrap();
    let mut yb = dev.upload(&vec![f32::NAN; y_len]).unwrap();
    linear_f32(dev, &xb, &wb, n, k, m, &mut yb).unwrap();
    yb.download().unwrap()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn cuda_linear_f32_matches_the_cpu_reference() {
    let Some(cuda) = cuda_or_skip("cuda_linear_f32_matches_the_cpu_reference") else {
        return;
    };
    let mut rng = Rng::fresh("linear_f32");
    let cpu = Device::cpu();
    // Decode rows, prefill blocks, odd sizes, a vocabulary-wide head, k = 1.
    for (n, k, m) in [
        (1, 64, 192),
        (3, 5, 7),
        (37, 129, 70),
        (300, 1000, 513),
        (5, 64, 4096),
        (129, 2048, 96),
        (8, 1, 33),
    ] {
        let x: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
        let w: Vec<f32> = (0..m * k).map(|_| rng.uniform() / (k as f32).sqrt()).collect();
        // Two elements past the shape stay poisoned on both backends.
        let want = run(&cpu, &x, &w, n, k, m, n * m + 2);
        let got = run(&cuda, &x, &w, n, k, m, n * m + 2);
        assert!(got[n * m..].iter().all(|v| v.is_nan()), "{n}x{k}x{m}: wrote past n * m");
        let err = rel_error(&got[..n * m], &want[..n * m]);
        assert!(err < 1e-5, "{n}x{k}x{m}: rel err {err:e}");
    }
    // k == 0 writes zeros; n == 0 writes nothing.
    assert_eq!(run(&cuda, &[], &[], 2, 0, 3, 6), vec![0.0; 6]);
    assert!(run(&cuda, &[], &[1.0; 4], 0, 4, 1, 3).iter().all(|v| v.is_nan()));
    // Repeated calls on one device reuse its handle and give the same bits.
    let x: Vec<f32> = (0..16 * 256).map(|_| rng.uniform()).collect();
    let w: Vec<f32> = (0..96 * 256).map(|_| rng.uniform()).collect();
    let a = run(&cuda, &x, &w, 16, 256, 96, 16 * 96);
    let b = run(&cuda, &x, &w, 16, 256, 96, 16 * 96);
    assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn cuda_linear_f32_refuses_bad_arguments() {
    let Some(cuda) = cuda_or_skip("cuda_linear_f32_refuses_bad_arguments") else {
        return;
    };
    let x = cuda.upload(&[1.0f32; 6]).unwrap();
    let w = cuda.upload(&[1.0f32; 6]).unwrap();
    let mut y = cuda.upload(&[5.0f32; 4]).unwrap();
    assert!(matches!(
        linear_f32(&cuda, &x, &w, 3, 3, 2, &mut y),
        Err(KernelError::OutOfBounds { arg: "x", .. })
    ));
    let cpu = Device::cpu();
    let host = cpu.upload(&[1.0f32; 6]).unwrap();
    assert!(matches!(
        linear_f32(&cuda, &x, &host, 2, 3, 2, &mut y),
        Err(KernelError::DeviceMismatch { arg: "w", .. })
    ));
    assert_eq!(y.download().unwrap(), vec![5.0; 4]);
}
