//! Expert and router probes answered through the serving path: the pool's
//! expert tables and the MoE folds on the pool's device (CPU reference or
//! CUDA), for `cargo xtask probe` and the oracle tests.
//!
//! Each probe is one small prefill batch of the probed adapter's slot: the
//! router probe runs the router fold on zero logits; an expert probe routes
//! every probe row to the expert(s) it names, runs the sorted fold of the
//! projection group the engine would run (gate_up or down) on a zero
//! output, and reads back the probed columns. Outputs are deltas, shaped as
//! the oracle's `probe_out::` tensors: `[n, out]`, or `[E, n, out]` for a
//! transformers 5.x fused parameter, in the parameter's own output order
//! (`gate_up_proj`: Gate columns, then Up; gpt_oss: interleaved, so the
//! fold's `gate | up` columns are put back in that order, as an engine
//! serving gpt_oss maps its grouped GEMM's columns, see [`ExpertTarget`]).
//!
//! Probe rows are f32 and served activations BF16. Rounding a probe row to
//! BF16 alone moves a small, cancelling output by more than a percent
//! (Qwen3-Next's `shared_expert_gate`: 1.5 %), which would measure the input
//! format rather than the served pairs. The fold is linear in x, so each
//! probe row `x` is served as two BF16 token rows, `hi = bf16(x)` and
//! `lo = bf16(x - hi)`, and their deltas are summed: the input then keeps
//! about 16 bits.

use std::collections::BTreeMap;

use half::bf16;
use lora_audit::{FusedParam, PROBE_IN, PROBE_OUT, ProbeInputs, ProbeTensor, WeightRef, parse_weight_name};
use lora_kernels::{Rows, RowsMut};
use lora_layout::{ExpertProj, GateUpLayout, ModelConfig};
use lora_pool::{LoraPool, PrefillSeq, PrefillStep, SlotCompanion, SlotLease, StepRow};

use crate::error::MoeError;
use crate::fold::SortedRows;
use crate::layer::{MoeCapacity, MoeLora};
use crate::target::ExpertTarget;

/// What [`probe_expert_lora`] answered.
#[derive(Debug, Clone, Default)]
pub struct ExpertProbeOutputs {
    /// `probe_out::<weight>` tensors by full key.
    pub tensors: BTreeMap<String, ProbeTensor>,
    /// Probed weights that are not routed-expert or router weights (dense
    /// projections, token tables, unserved weights): the caller answers them.
    pub not_expert: Vec<String>,
}

/// Answer every routed-expert and router probe of `inputs` for the adapter
/// `lease` holds, through the pool's expert tables and the MoE folds. An adapter
/// without expert deltas answers zeros (that is what is served); a slot
/// whose route is refused is an error.
pub fn probe_expert_lora<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    lease: &SlotLease,
    inputs: &ProbeInputs,
) -> Result<ExpertProbeOutputs, MoeError> {
    let cfg = pool.config().clone();
    let cfg = &cfg;
    let mut out = ExpertProbeOutputs::default();
    for (weight, x) in &inputs.inputs {
        let probe = Probe::new(weight, x)?;
        let tensor = match parse_weight_name(weight, cfg)? {
            WeightRef::Router { layer } => probe.router(pool, lease, layer)?,
            WeightRef::Expert { layer, expert, proj } => probe.expert(pool, lease, layer, expert, proj)?,
            WeightRef::Fused { layer, param } => probe.fused(pool, lease, layer, param)?,
            WeightRef::Dense { .. } | WeightRef::Table(_) | WeightRef::Unserved => {
                out.not_expert.push(weight.clone());
                continue;
            }
        };
        out.tensors.insert(format!("{PROBE_OUT}{weight}"), tensor);
    }
    Ok(out)
}

/// One probe input: `n` rows of `width`, served as `2n` BF16 token rows
/// (the `hi` rows, then the `lo` rows).
struct Probe<'a> {
    name: &'a str,
    n: usize,
    width: usize,
    x_split: Vec<bf16>,
}

impl<'a> Probe<'a> {
    fn new(name: &'a str, x: &ProbeTensor) -> Result<Probe<'a>, MoeError> {
        let bad = |reason: String| MoeError::Probe {
            name: format!("{PROBE_IN}{name}"),
            reason,
        };
        let [n, width] = x.shape[..] else {
            return Err(bad(format!("shape {:?}; expected [rows, in]", x.shape)));
        };
        if n.checked_mul(width) != Some(x.data.len()) {
            return Err(bad(format!("{} values for shape {:?}", x.data.len(), x.shape)));
        }
        let hi: Vec<bf16> = x.data.iter().map(|&v| bf16::from_f32(v)).collect();
        let lo = x.data.iter().zip(&hi).map(|(&v, h)| bf16::from_f32(v - h.to_f32()));
        let mut x_split = hi.clone();
        x_split.extend(lo);
        Ok(Probe {
            name,
            n,
            width,
            x_split,
        })
    }

    /// Token rows served per probe: `2n`.
    fn tokens(&self) -> usize {
        2 * self.n
    }

    /// Sum the `hi` and `lo` deltas of each of `blocks` consecutive blocks
    /// of `2n` output rows of `width`: `[blocks, n, width]`.
    fn combine(&self, y: &[f32], width: usize, blocks: usize) -> Vec<f32> {
        let n = self.n;
        let mut out = Vec::with_capacity(blocks * n * width);
        for b in 0..blocks {
            for j in 0..n {
                let hi = (b * 2 * n + j) * width;
                let lo = hi + n * width;
                out.extend(y[hi..hi + width].iter().zip(&y[lo..lo + width]).map(|(a, b)| a + b));
            }
        }
        out
    }

    fn error(&self, reason: impl Into<String>) -> MoeError {
        MoeError::Probe {
            name: format!("{PROBE_IN}{}", self.name),
            reason: reason.into(),
        }
    }

    fn check_width(&self, in_dim: usize) -> Result<(), MoeError> {
        if self.width == in_dim {
            Ok(())
        } else {
            Err(self.error(format!(
                "width {}, but the weight's input width is {in_dim}",
                self.width
            )))
        }
    }

    /// A scratch set from a one-sequence prefill step of `lease`'s adapter,
    /// and the step (held while the probe folds).
    fn batch<C: SlotCompanion>(
        &self,
        pool: &mut LoraPool<C>,
        lease: &SlotLease,
        sorted_rows: usize,
    ) -> Result<(MoeLora, PrefillStep), MoeError> {
        let mut moe = MoeLora::new(
            pool,
            MoeCapacity {
                max_tokens: self.tokens(),
                max_sorted_rows: sorted_rows,
            },
        )?;
        let step = pool.prefill_step(&[PrefillSeq {
            row: StepRow::Adapter(lease),
            len: self.tokens(),
        }])?;
        moe.set_prefill_step(pool, &step)?;
        Ok((moe, step))
    }

    fn router<C: SlotCompanion>(
        &self,
        pool: &mut LoraPool<C>,
        lease: &SlotLease,
        layer: usize,
    ) -> Result<ProbeTensor, MoeError> {
        let cfg = pool.config();
        self.check_width(cfg.hidden_size)?;
        let num_experts = num_experts(cfg)?;
        let (moe, step) = self.batch(pool, lease, 0)?;
        let pool = &*pool;
        let device = pool.device();
        let tokens = self.tokens();
        let x = device.upload(&self.x_split)?;
        let mut logits = device.alloc_zeros::<f32>(tokens * num_experts)?;
        moe.apply_router_lora(
            pool,
            &step,
            layer,
            Rows::dense(&x, tokens, self.width),
            RowsMut::dense(&mut logits, tokens, num_experts),
        )?;
        device.check_faults()?;
        Ok(ProbeTensor {
            shape: vec![self.n, num_experts],
            data: self.combine(&logits.download()?, num_experts, 1),
        })
    }

    fn expert<C: SlotCompanion>(
        &self,
        pool: &mut LoraPool<C>,
        lease: &SlotLease,
        layer: usize,
        expert: usize,
        proj: ExpertProj,
    ) -> Result<ProbeTensor, MoeError> {
        let cfg = pool.config().clone();
        let cfg = &cfg;
        if expert >= num_experts(cfg)? {
            return Err(self.error(format!("the model has no expert {expert}")));
        }
        let group = ProjGroup::of(proj);
        let (y, width) = self.fold_sorted(pool, lease, layer, &[expert], group)?;
        let (col, out) = group.columns(cfg, proj)?;
        let data = y
            .chunks_exact(width)
            .flat_map(|row| row[col..col + out].iter().copied())
            .collect();
        Ok(ProbeTensor {
            shape: vec![self.n, out],
            data,
        })
    }

    fn fused<C: SlotCompanion>(
        &self,
        pool: &mut LoraPool<C>,
        lease: &SlotLease,
        layer: usize,
        param: FusedParam,
    ) -> Result<ProbeTensor, MoeError> {
        let num_experts = num_experts(pool.config())?;
        let group = match param {
            FusedParam::GateUp => ProjGroup::GateUp,
            FusedParam::Down => ProjGroup::Down,
        };
        let all: Vec<usize> = (0..num_experts).collect();
        // Sorted rows are expert major, so the output already is [E, n, out].
        let (folded, width) = self.fold_sorted(pool, lease, layer, &all, group)?;
        // The fold wrote each projection at its target's columns; the
        // parameter keeps them in the family's layout.
        let cfg = pool.config();
        let layout = GateUpLayout::of(cfg.family);
        let inter = cfg.moe.as_ref().map_or(0, |m| m.expert_intermediate_size);
        let mut data = vec![0.0; folded.len()];
        for t in group.targets(inter) {
            let (out, _) = t
                .proj
                .dims(cfg)
                .ok_or_else(|| self.error(format!("the model has no expert {}", t.proj)))?;
            for (src, dst) in folded.chunks_exact(width).zip(data.chunks_exact_mut(width)) {
                for j in 0..out {
                    dst[layout.column(t.proj, j, inter)] = src[t.y_col_offset + j];
                }
            }
        }
        Ok(ProbeTensor {
            shape: vec![num_experts, self.n, width],
            data,
        })
    }

    /// Route every token row to each of `experts` (ascending), fold `group`
    /// over the sorted rows onto a zero output; the combined output
    /// `[experts, n, width]` and its width.
    fn fold_sorted<C: SlotCompanion>(
        &self,
        pool: &mut LoraPool<C>,
        lease: &SlotLease,
        layer: usize,
        experts: &[usize],
        group: ProjGroup,
    ) -> Result<(Vec<f32>, usize), MoeError> {
        let cfg = pool.config();
        let moe_dims = cfg.moe.as_ref().ok_or(MoeError::NotMoe {
            model_type: cfg.family.model_type(),
        })?;
        let targets = group.targets(moe_dims.expert_intermediate_size);
        let (_, in_dim) = targets[0]
            .proj
            .dims(cfg)
            .ok_or_else(|| self.error("the model has no experts"))?;
        self.check_width(in_dim)?;
        let width = group.width(cfg)?;
        let tokens = self.tokens();
        let too_big = || self.error("the probe batch is too large");
        let n_sorted = tokens.checked_mul(experts.len()).ok_or_else(too_big)?;
        let top_k = moe_dims.top_k;
        // Every sorted row is token (row % tokens)'s first routed copy.
        let sorted_token = (0..n_sorted)
            .map(|i| i32::try_from((i % tokens) * top_k).map_err(|_| too_big()))
            .collect::<Result<Vec<i32>, _>>()?;
        let mut offsets = Vec::with_capacity(moe_dims.num_experts + 1);
        let mut total = 0usize;
        offsets.push(0i32);
        for e in 0..moe_dims.num_experts {
            if experts.contains(&e) {
                total += tokens;
            }
            offsets.push(i32::try_from(total).map_err(|_| too_big())?);
        }
        let x_sorted: Vec<bf16> = experts.iter().flat_map(|_| self.x_split.iter().copied()).collect();
        let (mut moe, step) = self.batch(pool, lease, n_sorted)?;
        let pool = &*pool;
        let device = pool.device();
        let sorted_token = device.upload(&sorted_token)?;
        let expert_offsets = device.upload(&offsets)?;
        let x = device.upload(&x_sorted)?;
        let mut y = device.alloc_zeros::<f32>(n_sorted.checked_mul(width).ok_or_else(too_big)?)?;
        moe.index_sorted_rows(
            pool,
            &step,
            SortedRows {
                sorted_token: &sorted_token,
                n_sorted,
                expert_offsets: &expert_offsets,
            },
        )?;
        moe.apply_expert_lora_sorted(
            pool,
            &step,
            layer,
            &targets,
            Rows::dense(&x, n_sorted, in_dim),
            RowsMut::dense(&mut y, n_sorted, width),
        )?;
        device.check_faults()?;
        Ok((self.combine(&y.download()?, width, experts.len()), width))
    }
}

/// The projections one grouped GEMM of an expert computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProjGroup {
    GateUp,
    Down,
}

impl ProjGroup {
    fn of(proj: ExpertProj) -> ProjGroup {
        match proj {
            ExpertProj::Gate | ExpertProj::Up => ProjGroup::GateUp,
            ExpertProj::Down => ProjGroup::Down,
        }
    }

    fn targets(self, expert_inter: usize) -> Vec<ExpertTarget> {
        match self {
            ProjGroup::GateUp => ExpertTarget::gate_up(expert_inter).to_vec(),
            ProjGroup::Down => ExpertTarget::down().to_vec(),
        }
    }

    /// Width of the group's output rows.
    fn width(self, cfg: &ModelConfig) -> Result<usize, MoeError> {
        let moe = cfg.moe.as_ref().ok_or(MoeError::NotMoe {
            model_type: cfg.family.model_type(),
        })?;
        Ok(match self {
            ProjGroup::GateUp => 2 * moe.expert_intermediate_size,
            ProjGroup::Down => cfg.hidden_size,
        })
    }

    /// `(first column, width)` of `proj` in the group's output.
    fn columns(self, cfg: &ModelConfig, proj: ExpertProj) -> Result<(usize, usize), MoeError> {
        let target = self
            .targets(cfg.moe.as_ref().map_or(0, |m| m.expert_intermediate_size))
            .into_iter()
            .find(|t| t.proj == proj)
            .ok_or_else(|| MoeError::shape("proj", format!("{proj} is not computed with {self:?}")))?;
        let (out, _) = proj
            .dims(cfg)
            .ok_or_else(|| MoeError::shape("proj", format!("the model has no expert {proj}")))?;
        Ok((target.y_col_offset, out))
    }
}

fn num_experts(cfg: &ModelConfig) -> Result<usize, MoeError> {
    cfg.moe.as_ref().map(|m| m.num_experts).ok_or(MoeError::NotMoe {
        model_type: cfg.family.model_type(),
    })
}

#[cfg(test)]
mod tests;
