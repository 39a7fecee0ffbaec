//! Host f32 numerics of the decoder: linear layers, RMSNorm, SiLU, softmax, RoPE.
//!
//! Each function states the transformers expression it reproduces. All are
//! deterministic: every output element is one fixed-order sum, whatever the
//! thread count. Nothing here knows about layers, tensors names or hooks, and
//! nothing here may allocate per element or check input (callers pass slices
//! whose lengths the config fixed).

use rayon::prelude::*;

/// Output features computed together by one task of [`linear`].
const OUT_BLOCK: usize = 16;
/// Below this many multiply-adds a linear runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// `y = x @ w^T (+ bias)`: `nn.functional.linear`.
///
/// `x` is `[n, in_dim]`, `w` is `[out_dim, in_dim]` (the PyTorch layout),
/// `y` is `[n, out_dim]`, all row-major.
pub(crate) fn linear(x: &[f32], w: &[f32], bias: Option<&[f32]>, in_dim: usize, y: &mut [f32]) {
    let out_dim = w.len() / in_dim.max(1);
    let n = y.len() / out_dim.max(1);
    debug_assert_eq!(x.len(), n * in_dim);
    debug_assert_eq!(y.len(), n * out_dim);
    if n == 0 || out_dim == 0 {
        return;
    }
    let row = |r: usize, o: usize| -> f32 {
        let d = dot(&x[r * in_dim..(r + 1) * in_dim], &w[o * in_dim..(o + 1) * in_dim]);
        match bias {
            Some(b) => d + b[o],
            None => d,
        }
    };
    if n * in_dim * out_dim < PAR_MIN_WORK {
        for r in 0..n {
            for o in 0..out_dim {
                y[r * out_dim + o] = row(r, o);
            }
        }
        return;
    }
    // Column-major scratch so that one task owns a block of output features
    // for every row: the block's weight rows stay in cache while rows stream.
    let mut t = vec![0.0f32; n * out_dim];
    t.par_chunks_mut(OUT_BLOCK * n).enumerate().for_each(|(b, tb)| {
        for (i, col) in tb.chunks_mut(n).enumerate() {
            let o = b * OUT_BLOCK + i;
            for (r, v) in col.iter_mut().enumerate() {
                *v = row(r, o);
            }
        }
    });
    for o in 0..out_dim {
        for r in 0..n {
            y[r * out_dim + o] = t[o * n + r];
        }
    }
}

/// A dot product with eight independent accumulators (vectorizes; fixed order).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += xa[i] * xb[i];
        }
    }
    let mut tail = 0.0f32;
    for (p, q) in ra.iter().zip(rb) {
        tail += p * q;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// RMSNorm of every `w.len()`-wide row of `x` into `out`:
/// `w * (x * rsqrt(mean(x^2) + eps))`, computed in f32 as transformers does.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = g * (v * inv);
        }
    }
}

/// RMSNorm in place (for the per-head q/k norms).
pub(crate) fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = g * (*v * inv);
        }
    }
}

/// `silu(x) = x * sigmoid(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `silu(gate) * up` of a `[rows, 2 * inter]` gate|up block into `[rows, inter]`.
pub(crate) fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    for (gu, o) in gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (g, u) = gu.split_at(inter);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = silu(g) * u;
        }
    }
}

/// Softmax of one row in place: `exp(x - max) / sum`.
pub(crate) fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// The default rotary embedding of one head width.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    /// `1 / theta^(2i / head_dim)` for `i < head_dim / 2`, as f32.
    inv_freq: Vec<f32>,
}

impl Rope {
    /// transformers' `compute_default_rope_parameters`.
    pub(crate) fn new(theta: f64, head_dim: usize) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                (1.0 / theta.powf(f64::from(exponent))) as f32
            })
            .collect();
        Self { inv_freq }
    }

    /// `(cos, sin)` of the `head_dim / 2` angles at `pos`; the angle is the
    /// f32 product `pos * inv_freq`, as in transformers.
    pub(crate) fn cos_sin(&self, pos: u32, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = f64::from(p * f);
            *c = angle.cos() as f32;
            *s = angle.sin() as f32;
        }
    }

    /// `x * cos + rotate_half(x) * sin` on every `head_dim`-wide head of `x`.
    pub(crate) fn apply(x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = cos.len();
        for head in x.chunks_exact_mut(2 * half) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], b: Option<&[f32]>, n: usize, k: usize, m: usize) -> Vec<f32> {
        let mut y = vec![0.0; n * m];
        for r in 0..n {
            for o in 0..m {
                let mut s = 0.0f64;
                for i in 0..k {
                    s += f64::from(x[r * k + i]) * f64::from(w[o * k + i]);
                }
                y[r * m + o] = s as f32 + b.map_or(0.0, |b| b[o]);
            }
        }
        y
    }

    #[test]
    fn linear_matches_naive_serial_and_parallel() {
        for &(n, k, m) in &[(3usize, 5usize, 7usize), (37, 129, 70), (1, 300, 513)] {
            let x: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 23) as f32 / 11.0 - 1.0).collect();
            let w: Vec<f32> = (0..m * k).map(|i| ((i * 104_729) % 19) as f32 / 9.0 - 1.0).collect();
            let b: Vec<f32> = (0..m).map(|i| i as f32 * 0.01).collect();
            let mut y = vec![0.0; n * m];
            linear(&x, &w, Some(&b), k, &mut y);
            let want = naive(&x, &w, Some(&b), n, k, m);
            for (a, e) in y.iter().zip(&want) {
                assert!((a - e).abs() <= 1e-4 * (1.0 + e.abs()), "{a} vs {e} at {n}x{k}x{m}");
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_by_position() {
        let rope = Rope::new(10_000.0, 4);
        let (mut c, mut s) = (vec![0.0; 2], vec![0.0; 2]);
        rope.cos_sin(0, &mut c, &mut s);
        assert_eq!((c.clone(), s.clone()), (vec![1.0, 1.0], vec![0.0, 0.0]));
        rope.cos_sin(1, &mut c, &mut s);
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        Rope::apply(&mut x, &c, &s);
        // pair (x0, x2) rotated by angle 1 (inv_freq[0] = 1)
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn softmax_and_norm() {
        let mut p = vec![1.0, 2.0, 3.0];
        softmax_in_place(&mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6 && p[2] > p[1]);
        let mut out = vec![0.0; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let inv = 1.0 / 12.5f32.sqrt();
        assert_eq!(out, vec![3.0 * inv, 2.0 * (4.0 * inv)]);
    }
}
