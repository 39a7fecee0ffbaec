//! DoRA's host math, exactly as PEFT 0.21 computes it (`tuners/lora/dora.py`,
//! `DoraLinearLayer`), shared by the pool (which computes each slot's
//! rescale when an adapter is staged), the probe path and the tests.
//!
//! PEFT's DoRA output of a linear layer with weight `W [out, in]`, bias `b`,
//! pair `A`, `B`, scale `s` and magnitude `m [out]` (eval mode, or dropout
//! off) is
//!
//! ```text
//! base   = W x + b                      (the base layer's own output)
//! g      = m / ‖W + s · B A‖₂ per row    (`get_weight_norm`, detached)
//! result = base + (g − 1) ⊙ (base − b) + g ⊙ s · B A x
//!        = g ⊙ (W x + s · B A x) + b
//! ```
//!
//! so the bias stays outside the rescale. The pool serves it as the plain
//! LoRA expand (`y = W x + b + s · B A x`, in place) followed by
//! `y ← g ⊙ (y − b) + b` on the rows of DoRA slots ([`rescale`]). `g` holds
//! no input: it is computed once per slot, from the served (BF16-rounded)
//! A and B, the base weight and `m`, with the row norm in f32 over f64
//! sums (PEFT takes `torch.linalg.norm` of the sum in the activations'
//! dtype: f32 for an f32 model, the oracle here; a BF16 model's PEFT norm is
//! the same value rounded coarser). PEFT detaches the norm (a training
//! matter: no gradient flows through it); served, it is a constant per slot.
//!
//! Served: DoRA on the dense projections, which are `nn.Linear` in every
//! family here: PEFT turns a `fan_in_fan_out = true` off for an
//! `nn.Linear` (it matters for GPT-2's `Conv1D` only), so the weight is
//! `[out, in]` and the norm is over its rows either way. Refused: DoRA
//! on routed experts and routers (`REJECT[dora]`), on embeddings
//! (`REJECT[embedding-lora]`, as any embedding LoRA) and convolutions (no
//! such projection in a decoder). Never touches a GPU.

use half::bf16;

/// Suffix of a DoRA magnitude key as PEFT saves it
/// (`…q_proj.lora_magnitude_vector`).
pub const MAGNITUDE_SUFFIX: &str = ".lora_magnitude_vector";

/// The module path of a DoRA magnitude key (`….q_proj`), `None` for any
/// other key. PEFT saves `….lora_magnitude_vector`; older checkpoints that
/// kept the parameter's own `.weight` are read the same.
pub fn magnitude_module(key: &str) -> Option<&str> {
    key.strip_suffix(MAGNITUDE_SUFFIX)
        .or_else(|| key.strip_suffix(".lora_magnitude_vector.weight"))
}

/// A base projection as the engine holds it: `weight [out, in]` row-major,
/// f32, and its bias `[out]` if it has one.
#[derive(Debug, Clone, Copy)]
pub struct BaseProjection<'a> {
    /// `[out, in]`, row-major.
    pub weight: &'a [f32],
    /// `[out]`.
    pub bias: Option<&'a [f32]>,
}

/// The shape of one DoRA pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoraShape {
    /// Output rows.
    pub out: usize,
    /// Input width.
    pub inp: usize,
    /// Rank of the pair.
    pub rank: usize,
}

/// Why a DoRA rescale cannot be computed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DoraError {
    /// A slice does not have the length its shape says.
    #[error("{what} has {got} values; the projection needs {expected}")]
    Length {
        /// Which input.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length the shape needs.
        expected: usize,
    },
    /// `m / ‖W + s·B A‖` is not finite in row `row` (a zero or non-finite
    /// norm, or a non-finite magnitude).
    #[error("row {row}: magnitude {magnitude} over norm {norm} is not finite")]
    NonFinite {
        /// The output row.
        row: usize,
        /// `m[row]`.
        magnitude: f32,
        /// The row norm.
        norm: f32,
    },
}

/// `g[o] = m[o] / ‖W[o, :] + scale · (B A)[o, :]‖₂`, PEFT's
/// `mag_norm_scale`, with A `[rank, in]` and B `[out, rank]` as served.
pub fn row_scale(
    magnitude: &[f32],
    weight: &[f32],
    a: &[bf16],
    b: &[bf16],
    shape: DoraShape,
    scale: f32,
) -> Result<Vec<f32>, DoraError> {
    let DoraShape { out, inp, rank } = shape;
    let check = |what, got: usize, expected: Option<usize>| match expected {
        Some(expected) if got == expected => Ok(()),
        expected => Err(DoraError::Length {
            what,
            got,
            expected: expected.unwrap_or(usize::MAX),
        }),
    };
    check("the magnitude", magnitude.len(), Some(out))?;
    check("the base weight", weight.len(), out.checked_mul(inp))?;
    check("lora_A", a.len(), rank.checked_mul(inp))?;
    check("lora_B", b.len(), out.checked_mul(rank))?;
    let a: Vec<f32> = a.iter().map(|v| v.to_f32()).collect();
    let mut g = Vec::with_capacity(out);
    for o in 0..out {
        let brow: Vec<f32> = b[o * rank..(o + 1) * rank].iter().map(|v| v.to_f32()).collect();
        let mut sum = 0f64;
        for (i, w) in weight[o * inp..(o + 1) * inp].iter().enumerate() {
            let lora = brow
                .iter()
                .enumerate()
                .fold(0f32, |acc, (k, bv)| acc + bv * a[k * inp + i]);
            let v = f64::from(w + scale * lora);
            sum += v * v;
        }
        let norm = sum.sqrt() as f32;
        let value = magnitude[o] / norm;
        if !value.is_finite() {
            return Err(DoraError::NonFinite {
                row: o,
                magnitude: magnitude[o],
                norm,
            });
        }
        g.push(value);
    }
    Ok(g)
}

/// The served rescale of one output value `y = W x + b + s·B A x`:
/// `g · (y − b) + b` (f32; the kernels round once to the output type).
#[inline]
pub fn rescale(y: f32, g: f32, bias: f32) -> f32 {
    g * (y - bias) + bias
}

#[cfg(test)]
mod tests;
