use super::*;
use crate::testing::{Rng, rel_error};

/// `x · w^T` in f64 with the most obvious loop: the oracle.
fn naive(x: &[f32], w: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; n * m];
    for r in 0..n {
        for o in 0..m {
            let mut s = 0.0f64;
            for i in 0..k {
                s += f64::from(x[r * k + i]) * f64::from(w[o * k + i]);
            }
            y[r * m + o] = s as f32;
        }
    }
    y
}

fn random(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.uniform()).collect()
}

#[test]
fn the_cpu_reference_matches_a_naive_loop() {
    let dev = Device::cpu();
    let mut rng = Rng::new(41);
    for (n, k, m) in [(1, 1, 1), (3, 5, 7), (37, 129, 70), (1, 300, 513), (64, 64, 1)] {
        let x = random(&mut rng, n * k);
        let w = random(&mut rng, m * k);
        let xb = dev.upload(&x).unwrap();
        let wb = dev.upload(&w).unwrap();
        let mut yb = dev.upload(&vec![f32::NAN; n * m]).unwrap();
        linear_f32(&dev, &xb, &wb, n, k, m, &mut yb).unwrap();
        let err = rel_error(&yb.download().unwrap(), &naive(&x, &w, n, k, m));
        assert!(err < 1e-6, "{n}x{k}x{m}: rel err {err:e}");
    }
}

#[test]
fn only_the_shaped_prefixes_are_read_and_written() {
    let dev = Device::cpu();
    let mut rng = Rng::new(3);
    let (n, k, m) = (4, 6, 5);
    let x = random(&mut rng, n * k + 9);
    let w = random(&mut rng, m * k + 2);
    let xb = dev.upload(&x).unwrap();
    let wb = dev.upload(&w).unwrap();
    let mut yb = dev.upload(&vec![-3.0f32; n * m + 4]).unwrap();
    linear_f32(&dev, &xb, &wb, n, k, m, &mut yb).unwrap();
    let y = yb.download().unwrap();
    let want = naive(&x[..n * k], &w[..m * k], n, k, m);
    assert!(rel_error(&y[..n * m], &want) < 1e-6);
    assert_eq!(&y[n * m..], &[-3.0; 4]);
}

#[test]
fn empty_shapes() {
    let dev = Device::cpu();
    let x = dev.upload(&[1.0f32; 6]).unwrap();
    let w = dev.upload(&[1.0f32; 6]).unwrap();
    // k == 0: an empty sum, zeros.
    let mut y = dev.upload(&[5.0f32; 6]).unwrap();
    linear_f32(&dev, &x, &w, 2, 0, 3, &mut y).unwrap();
    assert_eq!(y.download().unwrap(), vec![0.0; 6]);
    // n == 0 or m == 0: nothing written.
    let mut y = dev.upload(&[5.0f32; 6]).unwrap();
    linear_f32(&dev, &x, &w, 0, 3, 2, &mut y).unwrap();
    linear_f32(&dev, &x, &w, 2, 3, 0, &mut y).unwrap();
    assert_eq!(y.download().unwrap(), vec![5.0; 6]);
}

#[test]
fn bad_shapes_and_devices_are_refused_before_anything_is_written() {
    let dev = Device::cpu();
    let x = dev.upload(&[1.0f32; 6]).unwrap();
    let w = dev.upload(&[1.0f32; 6]).unwrap();
    let mut y = dev.upload(&[5.0f32; 4]).unwrap();
    let oob = |r: Result<(), KernelError>, arg: &str| {
        assert!(
            matches!(&r, Err(KernelError::OutOfBounds { arg: a, .. }) if *a == arg),
            "{arg}: {r:?}"
        );
    };
    oob(linear_f32(&dev, &x, &w, 3, 3, 2, &mut y), "x");
    oob(linear_f32(&dev, &x, &w, 2, 3, 3, &mut y), "w");
    oob(linear_f32(&dev, &x, &w, 2, 2, 3, &mut y), "y");
    let huge = usize::MAX / 2;
    assert!(matches!(
        linear_f32(&dev, &x, &w, huge, 1, 1, &mut y),
        Err(KernelError::InvalidArgument { arg: "n", .. })
    ));
    oob(linear_f32(&dev, &x, &w, 1 << 30, 1 << 30, 1, &mut y), "x");
    let other = Device::cpu();
    let foreign = other.upload(&[1.0f32; 6]).unwrap();
    assert!(matches!(
        linear_f32(&dev, &foreign, &w, 2, 3, 2, &mut y),
        Err(KernelError::DeviceMismatch { arg: "x", .. })
    ));
    assert!(matches!(
        linear_f32(&dev, &x, &foreign, 2, 3, 2, &mut y),
        Err(KernelError::DeviceMismatch { arg: "w", .. })
    ));
    let mut foreign_y = other.alloc_zeros::<f32>(4).unwrap();
    assert!(matches!(
        linear_f32(&dev, &x, &w, 2, 3, 2, &mut foreign_y),
        Err(KernelError::DeviceMismatch { arg: "y", .. })
    ));
    assert_eq!(y.download().unwrap(), vec![5.0; 4]);
}
