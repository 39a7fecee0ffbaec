//! The deltas of one step, applied through the public API: a [`DeltaHooks`]
//! over a [`LoraPool`] (with its [`TokenOverlays`]) and an [`MoeLora`],
//! bound to the pool step that holds the step's adapters.
//!
//! Every hook uploads the projection's input and base output, runs the
//! pool's apply call for the step (decode rows: BGMV; prefill segments:
//! SGMV, or the one-adapter GEMM pair when every sequence runs one
//! adapter), and reads the output back. Served activations are BF16 while
//! the base here is f32: each input row `x` is served as two BF16 rows,
//! `hi = bf16(x)` and `lo = bf16(x - hi)`, applied one after the other onto
//! the same output (every delta is linear in x), so the input keeps about
//! 16 bits and the comparison with PEFT measures the served pairs, not the
//! input format. This module must never compute a delta itself: every
//! number added to the base comes from the library's kernels.

use half::bf16;
use lora_kernels::{Choice, DecodeOptions, Device, DeviceBuffer, Rows, RowsMut};
use lora_layout::{LoraModule, ModelConfig, Placement, ShardKind};
use lora_moe::{ExpertTarget, MoeLora, SortedRows};
use lora_overlay::TokenOverlays;
use lora_pool::{DecodeStep, FusedTargets, LoraPool, PrefillStep, RowSlot, Step, StepSlots};

use crate::collective::CollectiveGather;
use crate::error::{BoxError, EngineError};
use crate::hooks::DeltaHooks;
use crate::model::{Mlp, Model};

/// The fused targets of the four dense sites, from the model config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DenseTargets {
    qkv: FusedTargets,
    o: FusedTargets,
    gate_up: FusedTargets,
    down: FusedTargets,
}

impl DenseTargets {
    /// The targets of tensor-parallel rank `placement` (the rank's columns
    /// of each fused output; the whole outputs at world 1).
    pub(crate) fn at(cfg: &ModelConfig, placement: Placement) -> Result<DenseTargets, lora_pool::PoolError> {
        Ok(DenseTargets {
            qkv: FusedTargets::qkv_at(cfg, placement)?,
            o: FusedTargets::single_at(cfg, placement, LoraModule::OProj)?,
            gate_up: FusedTargets::gate_up_at(cfg, placement)?,
            down: FusedTargets::single_at(cfg, placement, LoraModule::DownProj)?,
        })
    }
}

/// The pool step a forward runs under.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StepRef<'s> {
    Decode(&'s DecodeStep),
    Prefill(&'s PrefillStep),
}

impl StepRef<'_> {
    fn requests(&self) -> &[RowSlot] {
        match self {
            StepRef::Decode(s) => s.requests(),
            StepRef::Prefill(s) => s.requests(),
        }
    }

    /// The slot of each kernel row.
    fn row_slots(&self) -> Vec<RowSlot> {
        match self {
            StepRef::Decode(s) => s.requests().to_vec(),
            StepRef::Prefill(s) => {
                let cu = s.cu_seqlens();
                s.requests()
                    .iter()
                    .enumerate()
                    .flat_map(|(i, r)| std::iter::repeat_n(*r, cu[i + 1] - cu[i]))
                    .collect()
            }
        }
    }
}

/// The hooks of one forward under one step.
pub(crate) struct StepHooks<'a> {
    pub(crate) pool: &'a LoraPool<TokenOverlays>,
    pub(crate) step: StepRef<'a>,
    pub(crate) moe: Option<&'a mut MoeLora>,
    pub(crate) targets: DenseTargets,
    /// The base model, for each dense site's bias (DoRA's split rows).
    pub(crate) model: &'a Model,
}

fn hook_err(hook: &'static str) -> impl FnOnce(BoxError) -> EngineError {
    move |source| EngineError::Hook { hook, source }
}

/// `x` as two BF16 row sets whose sum keeps about 16 bits of it.
fn split(x: &[f32]) -> (Vec<bf16>, Vec<bf16>) {
    let hi: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let lo = x
        .iter()
        .zip(&hi)
        .map(|(&v, h)| bf16::from_f32(v - h.to_f32()))
        .collect();
    (hi, lo)
}

/// Upload `x` (split) and `y`; run `apply` once per half onto the same
/// output; read `y` back.
fn apply_split(
    device: &Device,
    x: &[f32],
    width: usize,
    y: &mut [f32],
    mut apply: impl FnMut(Rows<'_, bf16>, &mut DeviceBuffer<f32>) -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    if width == 0 || x.is_empty() {
        return Ok(());
    }
    let n = x.len() / width;
    let (hi, lo) = split(x);
    let mut y_dev = device.upload(y)?;
    let mut x_dev = device.upload(&hi)?;
    apply(Rows::dense(&x_dev, n, width), &mut y_dev)?;
    x_dev.write(0, &lo)?;
    apply(Rows::dense(&x_dev, n, width), &mut y_dev)?;
    y.copy_from_slice(&y_dev.download()?);
    Ok(())
}

/// [`apply_split`] for a pool that serves DoRA, whose rescale
/// `y ← g ⊙ (y − b) + b` is affine in y rather than additive: the `hi` half
/// runs onto `y` (the base output `W x + b`), the `lo` half onto its own
/// rows that start at the site's bias `b` (`bias`, one output row, zeros
/// without one), and `y = y_hi + (y_lo − b)`. For a DoRA row that is
/// `g ⊙ (W x + d_hi) + b + g ⊙ d_lo = g ⊙ (W x + d) + b`, PEFT's output; for
/// a plain or base row, `y + d` as before.
fn apply_split_affine(
    device: &Device,
    x: &[f32],
    width: usize,
    y: &mut [f32],
    bias: &[f32],
    mut apply: impl FnMut(Rows<'_, bf16>, &mut DeviceBuffer<f32>) -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    if width == 0 || x.is_empty() || bias.is_empty() {
        return Ok(());
    }
    let n = x.len() / width;
    let (hi, lo) = split(x);
    let lo_start: Vec<f32> = bias.repeat(y.len() / bias.len());
    let mut y_hi = device.upload(y)?;
    let mut y_lo = device.upload(&lo_start)?;
    let mut x_dev = device.upload(&hi)?;
    apply(Rows::dense(&x_dev, n, width), &mut y_hi)?;
    x_dev.write(0, &lo)?;
    apply(Rows::dense(&x_dev, n, width), &mut y_lo)?;
    for (((dst, h), l), b) in y.iter_mut().zip(y_hi.download()?).zip(y_lo.download()?).zip(&lo_start) {
        *dst = h + (l - b);
    }
    Ok(())
}

/// The promise every decode apply of the engine keeps (see `StepHooks::dense`).
const OVERLAP_PREVIOUS: DecodeOptions = DecodeOptions {
    choice: Choice::Auto,
    overlap_previous: true,
};

impl StepHooks<'_> {
    fn dense(
        &self,
        layer: usize,
        targets: &FusedTargets,
        bias: Option<&[f32]>,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), BoxError> {
        let pool = self.pool;
        if y.is_empty() {
            return Ok(());
        }
        let n = y.len() / targets.width();
        let width = x.len() / n.max(1);
        // Under the fully-sharded option a column-parallel site's A holds
        // the rank's block of rank rows: its apply all-gathers the ranks'
        // shrink outputs through the model's collective.
        let placement = pool.layout().placement();
        let split = placement.fully_sharded()
            && placement.tp_world() > 1
            && targets
                .targets()
                .iter()
                .all(|t| t.module.shard_kind() == ShardKind::Column);
        let collective = match (&self.model.collective, split) {
            (Some(c), true) => Some(c.as_ref()),
            (None, true) => {
                return Err(Box::new(EngineError::Collective(
                    "a fully-sharded pool of tp_world above 1 needs the rank's collective".into(),
                )));
            }
            (_, false) => None,
        };
        let apply = |xr: Rows<'_, bf16>, y_dev: &mut DeviceBuffer<f32>| {
            let yr = RowsMut::dense(y_dev, n, targets.width());
            if let Some(c) = collective {
                let mut gather = CollectiveGather(c);
                match self.step {
                    StepRef::Decode(s) => pool.apply_fully_sharded(s, layer, targets, xr, yr, &mut gather)?,
                    StepRef::Prefill(s) => pool.apply_fully_sharded(s, layer, targets, xr, yr, &mut gather)?,
                }
                return Ok(());
            }
            match self.step {
                // The kernel before every decode apply here is the base
                // projection or the other half's apply, which write y only:
                // row slots and tables are written by copies at step and swap
                // time, so the apply may read them under that kernel.
                StepRef::Decode(s) => pool.apply_decode_with(s, layer, targets, xr, yr, OVERLAP_PREVIOUS)?,
                StepRef::Prefill(s) if s.one_adapter().is_some() => {
                    pool.apply_one_adapter(s, layer, targets, xr, yr)?
                }
                StepRef::Prefill(s) => pool.apply_prefill(s, layer, targets, xr, yr)?,
            }
            Ok(())
        };
        if pool.options().dora {
            let zeros = vec![0f32; targets.width()];
            apply_split_affine(pool.device(), x, width, y, bias.unwrap_or(&zeros), apply)
        } else {
            apply_split(pool.device(), x, width, y, apply)
        }
    }

    /// The dense MLP's projections of `layer` (none in a routed-expert layer).
    fn mlp(&self, layer: usize) -> Option<(&crate::projection::Projection, &crate::projection::Projection)> {
        match &self.model.layers.get(layer)?.mlp {
            Mlp::Dense { gate_up, down } => Some((gate_up, down)),
            Mlp::Moe { .. } => None,
        }
    }

    fn step_slots(&self) -> Result<StepSlots<'_>, BoxError> {
        Ok(match self.step {
            StepRef::Decode(s) => self.pool.step_slots(s)?,
            StepRef::Prefill(s) => self.pool.step_slots(s)?,
        })
    }

    fn embed_rows(&self, ids: &[u32], rows: &mut [f32]) -> Result<(), BoxError> {
        self.embed_overlays(ids, rows)?;
        self.embed_lora(ids, rows)
    }

    /// The token overlays of the rows' slots (trainable tokens, saved tables).
    fn embed_overlays(&self, ids: &[u32], rows: &mut [f32]) -> Result<(), BoxError> {
        let overlays = self.pool.companion();
        let any = self.step.requests().iter().any(|r| {
            r.slot()
                .and_then(|s| overlays.slot(s.index()))
                .is_some_and(|o| o.embed().is_some())
        });
        if !any || ids.is_empty() {
            return Ok(());
        }
        let device = self.pool.device();
        let hidden = rows.len() / ids.len();
        let ids_dev = device.upload(ids)?;
        let mut out = device.alloc_zeros::<bf16>(rows.len())?;
        overlays.embed(
            &ids_dev,
            Some(self.step_slots()?),
            RowsMut::dense(&mut out, ids.len(), hidden),
        )?;
        let out = out.download()?;
        // Only the rows the row's slot overrides take the served row; the
        // others keep the f32 base row (the kernel's copy of it is BF16).
        // Overlay ids are table rows: a vocab-parallel rank's tokens less
        // its first id; another rank's token is never overridden here.
        let tables = overlays.tables();
        for (r, slot) in self.step.row_slots().into_iter().enumerate() {
            let Some(overlay) = slot
                .slot()
                .and_then(|s| overlays.slot(s.index()))
                .and_then(|o| o.embed())
            else {
                continue;
            };
            if tables
                .local_id(ids[r])
                .is_some_and(|t| overlay.overrides().ids().contains(&t))
            {
                for (dst, src) in rows[r * hidden..(r + 1) * hidden].iter_mut().zip(&out[r * hidden..]) {
                    *dst = src.to_f32();
                }
            }
        }
        Ok(())
    }

    /// The LoRA on the input embedding of the rows' slots, added in f32 onto
    /// the (overlaid) rows: PEFT's order, the lookup then the delta.
    fn embed_lora(&self, ids: &[u32], rows: &mut [f32]) -> Result<(), BoxError> {
        let pool = self.pool;
        let any = self.step.requests().iter().any(|r| {
            r.slot()
                .and_then(|s| pool.embedding_entry(s))
                .is_some_and(|e| e.rank > 0)
        });
        if !any || ids.is_empty() {
            return Ok(());
        }
        let device = pool.device();
        let hidden = rows.len() / ids.len();
        let ids_dev = device.upload(ids)?;
        let mut out = device.upload(rows)?;
        let out_rows = RowsMut::dense(&mut out, ids.len(), hidden);
        match self.step {
            StepRef::Decode(s) => pool.apply_embedding(s, &ids_dev, out_rows)?,
            StepRef::Prefill(s) => pool.apply_embedding(s, &ids_dev, out_rows)?,
        }
        rows.copy_from_slice(&out.download()?);
        Ok(())
    }

    /// The logits: the head's token overlay of the rows' slots, then their
    /// LoRA on the head. PEFT's order: the LoRA wraps the head's token
    /// adapter (or the head with its saved table), so its delta `scale ·
    /// (h Aᵀ) Bᵀ` is added over the overlaid logits, across the whole
    /// vocabulary (a vocab-parallel rank: across its logit columns, with
    /// its overlay rows; the forward gathers the ranks' columns).
    fn head(&self, hidden: &[f32], logits: &mut [f32]) -> Result<(), BoxError> {
        self.head_overlay(hidden, logits)?;
        self.head_lora(hidden, logits)
    }

    /// The LoRA on the output head of the rows' slots, added in f32 onto
    /// the logits (the decode rule table's or the segment apply's tall
    /// expand).
    fn head_lora(&self, hidden: &[f32], logits: &mut [f32]) -> Result<(), BoxError> {
        let pool = self.pool;
        let any = self
            .step
            .requests()
            .iter()
            .any(|r| r.slot().and_then(|s| pool.lm_head_entry(s)).is_some_and(|e| e.rank > 0));
        if !any || logits.is_empty() {
            return Ok(());
        }
        let n = self.step.row_slots().len();
        let (width, vocab) = (hidden.len() / n, logits.len() / n);
        apply_split(pool.device(), hidden, width, logits, |xr, y_dev| {
            let yr = RowsMut::dense(y_dev, n, vocab);
            match self.step {
                // As in `dense`: the previous kernel writes y only.
                StepRef::Decode(s) => pool.apply_lm_head_decode(s, xr, yr, OVERLAP_PREVIOUS)?,
                StepRef::Prefill(s) => pool.apply_lm_head_prefill(s, xr, yr)?,
            }
            Ok(())
        })
    }

    /// The head's token overlays of the rows' slots (trainable tokens,
    /// saved tables).
    fn head_overlay(&self, hidden: &[f32], logits: &mut [f32]) -> Result<(), BoxError> {
        let overlays = self.pool.companion();
        let any = self.step.requests().iter().any(|r| {
            r.slot()
                .and_then(|s| overlays.slot(s.index()))
                .is_some_and(|o| !o.head_ids().is_empty())
        });
        if !any || logits.is_empty() {
            return Ok(());
        }
        let device = self.pool.device();
        let n = self.step.row_slots().len();
        let (width, vocab) = (hidden.len() / n, logits.len() / n);
        let slots = self.step_slots()?;
        let (hi, lo) = split(hidden);
        // The overlay writes dot(hidden, row) into the overridden logits:
        // once with `hi` over the base logits, once with `lo` over zeros,
        // summed (the other logits stay base + 0).
        let hi_dev = device.upload(&hi)?;
        let mut with_hi = device.upload(logits)?;
        overlays.lm_head(
            Rows::dense(&hi_dev, n, width),
            slots,
            RowsMut::dense(&mut with_hi, n, vocab),
        )?;
        let lo_dev = device.upload(&lo)?;
        let mut with_lo = device.alloc_zeros::<f32>(logits.len())?;
        overlays.lm_head(
            Rows::dense(&lo_dev, n, width),
            slots,
            RowsMut::dense(&mut with_lo, n, vocab),
        )?;
        for ((dst, a), b) in logits.iter_mut().zip(with_hi.download()?).zip(with_lo.download()?) {
            *dst = a + b;
        }
        Ok(())
    }

    fn router(&mut self, layer: usize, x: &[f32], logits: &mut [f32]) -> Result<(), BoxError> {
        let (pool, step) = (self.pool, self.step);
        // No MoE scratch: the pool serves no expert deltas.
        let Some(moe) = self.moe.as_deref() else {
            return Ok(());
        };
        let n = match step {
            StepRef::Decode(s) => s.kernel_rows(),
            StepRef::Prefill(s) => s.kernel_rows(),
        };
        if n == 0 {
            return Ok(());
        }
        let (width, experts) = (x.len() / n, logits.len() / n);
        apply_split(pool.device(), x, width, logits, |xr, y_dev| {
            let yr = RowsMut::dense(y_dev, n, experts);
            match step {
                StepRef::Decode(s) => moe.apply_router_lora(pool, s, layer, xr, yr)?,
                StepRef::Prefill(s) => moe.apply_router_lora(pool, s, layer, xr, yr)?,
            }
            Ok(())
        })
    }

    /// One routed-expert fold. `x` holds one row per token (`expand`:
    /// each token's row serves its `k` expanded rows) or one per expanded
    /// row; `y` one per expanded row. Decode runs the expanded form;
    /// prefill sorts the expanded rows by expert, as a grouped GEMM does,
    /// and runs the sorted form.
    fn experts(
        &mut self,
        layer: usize,
        targets: &[ExpertTarget],
        x: &[f32],
        expand: bool,
        topk: &[u32],
        y: &mut [f32],
    ) -> Result<(), BoxError> {
        let (pool, step) = (self.pool, self.step);
        let device = pool.device().clone();
        let Some(moe) = self.moe.as_deref_mut() else {
            return Ok(());
        };
        let rows = topk.len();
        if rows == 0 {
            return Ok(());
        }
        let k = moe.top_k();
        let (out_w, in_w) = (
            y.len() / rows,
            if expand { x.len() / (rows / k) } else { x.len() / rows },
        );
        let x_row = |r: usize| if expand { r / k } else { r };
        match step {
            StepRef::Decode(s) => {
                let x_exp: Vec<f32> = (0..rows)
                    .flat_map(|r| x[x_row(r) * in_w..(x_row(r) + 1) * in_w].iter().copied())
                    .collect();
                let ids: Vec<i32> = topk.iter().map(|&e| e as i32).collect();
                moe.index_decode_rows(pool, s, &device.upload(&ids)?)?;
                apply_split(&device, &x_exp, in_w, y, |xr, y_dev| {
                    moe.apply_expert_lora_decode(pool, s, layer, targets, xr, RowsMut::dense(y_dev, rows, out_w))?;
                    Ok(())
                })
            }
            StepRef::Prefill(s) => {
                let n_experts = topk.iter().map(|&e| e as usize + 1).max().unwrap_or(0);
                let mut order: Vec<usize> = (0..rows).collect();
                order.sort_by_key(|&r| (topk[r], r));
                let mut offsets = vec![0i32; pool.config().moe.as_ref().map_or(n_experts, |m| m.num_experts) + 1];
                for &e in topk {
                    offsets[e as usize + 1] += 1;
                }
                for e in 1..offsets.len() {
                    offsets[e] += offsets[e - 1];
                }
                let sorted_token: Vec<i32> = order.iter().map(|&r| r as i32).collect();
                let sorted = Sorted {
                    order: &order,
                    sorted_token: &sorted_token,
                    offsets: &offsets,
                };
                fold_sorted(moe, pool, s, (layer, targets), sorted, (x, in_w, &x_row), y)
            }
        }
    }
}

/// Expert parallelism: the rows another rank (or this one) dispatched to
/// this rank's experts fold with the adapter map that travelled with them.
impl StepHooks<'_> {
    /// The step's per-token adapter map, as the dispatch sends it
    /// (`MoeLora::dispatch_map`); -1 each without MoE scratch.
    fn dispatch_map(&mut self, n_tokens: usize) -> Result<Vec<i32>, BoxError> {
        let Some(moe) = self.moe.as_deref() else {
            return Ok(vec![-1; n_tokens]);
        };
        let (map, n) = moe.dispatch_map()?;
        if n != n_tokens {
            return Err(format!("the step's adapter map has {n} tokens, the batch {n_tokens}").into());
        }
        let mut map = map.download()?;
        map.truncate(n);
        Ok(map)
    }

    /// One fold over dispatched rows: received row `r` is its own token
    /// (expanded row `r * top_k`), its adapter map entry `tags[r]` landed
    /// with `MoeLora::receive_dispatch_map`; the rows are folded
    /// expert-sorted, then the step's own batch is set back for the next
    /// layer's router fold.
    fn dispatched(
        &mut self,
        layer: usize,
        targets: &[ExpertTarget],
        x: &[f32],
        experts: &[u32],
        tags: &[i32],
        y: &mut [f32],
    ) -> Result<(), BoxError> {
        let (pool, step) = (self.pool, self.step);
        let rows = experts.len();
        let Some(moe) = self.moe.as_deref_mut() else {
            return Ok(());
        };
        if rows == 0 {
            return Ok(());
        }
        let result = match step {
            StepRef::Decode(s) => fold_dispatched(moe, pool, s, layer, targets, x, experts, tags, y),
            StepRef::Prefill(s) => fold_dispatched(moe, pool, s, layer, targets, x, experts, tags, y),
        };
        match step {
            StepRef::Decode(s) => moe.set_decode_step(pool, s)?,
            StepRef::Prefill(s) => moe.set_prefill_step(pool, s)?,
        };
        result
    }
}

/// [`StepHooks::dispatched`]'s fold under `step`.
#[allow(clippy::too_many_arguments)]
fn fold_dispatched<S: Step>(
    moe: &mut MoeLora,
    pool: &LoraPool<TokenOverlays>,
    step: &S,
    layer: usize,
    targets: &[ExpertTarget],
    x: &[f32],
    experts: &[u32],
    tags: &[i32],
    y: &mut [f32],
) -> Result<(), BoxError> {
    let rows = experts.len();
    let in_w = x.len() / rows;
    moe.receive_dispatch_map(pool, step, rows)?.write(0, tags)?;
    let k = moe.top_k();
    let mut order: Vec<usize> = (0..rows).collect();
    order.sort_by_key(|&r| (experts[r], r));
    let num_experts = pool.config().moe.as_ref().map_or(0, |m| m.num_experts);
    let mut offsets = vec![0i32; num_experts + 1];
    for &e in experts {
        let slot = offsets
            .get_mut(e as usize + 1)
            .ok_or_else(|| format!("expert {e} of {num_experts}"))?;
        *slot += 1;
    }
    for e in 1..offsets.len() {
        offsets[e] += offsets[e - 1];
    }
    let sorted_token: Vec<i32> = order.iter().map(|&r| i32::try_from(r * k)).collect::<Result<_, _>>()?;
    let sorted = Sorted {
        order: &order,
        sorted_token: &sorted_token,
        offsets: &offsets,
    };
    fold_sorted(moe, pool, step, (layer, targets), sorted, (x, in_w, &|r| r), y)
}

/// The expert-sorted order of a fold's rows: `order[i]` is the row the
/// `i`th sorted row is, `sorted_token[i]` the token index the kernels see
/// for it, `offsets` the experts' prefix counts (`[num_experts + 1]`).
struct Sorted<'a> {
    order: &'a [usize],
    sorted_token: &'a [i32],
    offsets: &'a [i32],
}

/// A routed-expert fold in `sorted` order under `step`: row `r` reads
/// `x`'s row `x_row(r)` (`in_w` wide) and adds its delta into `y`'s row
/// `r`.
fn fold_sorted<S: Step>(
    moe: &mut MoeLora,
    pool: &LoraPool<TokenOverlays>,
    step: &S,
    (layer, targets): (usize, &[ExpertTarget]),
    sorted: Sorted<'_>,
    (x, in_w, x_row): (&[f32], usize, &dyn Fn(usize) -> usize),
    y: &mut [f32],
) -> Result<(), BoxError> {
    let device = pool.device().clone();
    let Sorted {
        order,
        sorted_token,
        offsets,
    } = sorted;
    let rows = order.len();
    let out_w = y.len() / rows;
    let x_sorted: Vec<f32> = order
        .iter()
        .flat_map(|&r| x[x_row(r) * in_w..(x_row(r) + 1) * in_w].iter().copied())
        .collect();
    let mut y_sorted: Vec<f32> = order
        .iter()
        .flat_map(|&r| y[r * out_w..(r + 1) * out_w].iter().copied())
        .collect();
    let sorted_dev = device.upload(sorted_token)?;
    let offsets_dev = device.upload(offsets)?;
    moe.index_sorted_rows(
        pool,
        step,
        SortedRows {
            sorted_token: &sorted_dev,
            n_sorted: rows,
            expert_offsets: &offsets_dev,
        },
    )?;
    apply_split(&device, &x_sorted, in_w, &mut y_sorted, |xr, y_dev| {
        moe.apply_expert_lora_sorted(pool, step, layer, targets, xr, RowsMut::dense(y_dev, rows, out_w))?;
        Ok(())
    })?;
    for (i, &r) in order.iter().enumerate() {
        y[r * out_w..(r + 1) * out_w].copy_from_slice(&y_sorted[i * out_w..(i + 1) * out_w]);
    }
    Ok(())
}

impl StepHooks<'_> {
    /// The routed experts' fused gate | up targets (the model's expert
    /// intermediate size; none without MoE).
    fn expert_gate_up_targets(&self) -> [ExpertTarget; 2] {
        let inter = self
            .pool
            .config()
            .moe
            .as_ref()
            .map_or(0, |m| m.expert_intermediate_size);
        ExpertTarget::gate_up(inter)
    }
}

impl DeltaHooks for StepHooks<'_> {
    fn embed(&mut self, ids: &[u32], rows: &mut [f32]) -> Result<(), EngineError> {
        self.embed_rows(ids, rows).map_err(hook_err("embed"))
    }
    fn qkv(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
        let t = self.targets.qkv;
        let bias = self.model.layers.get(layer).and_then(|l| l.qkv.b.as_deref());
        self.dense(layer, &t, bias, x, y).map_err(hook_err("qkv"))
    }
    fn o(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
        let t = self.targets.o;
        let bias = self.model.layers.get(layer).and_then(|l| l.o.b.as_deref());
        self.dense(layer, &t, bias, x, y).map_err(hook_err("o"))
    }
    fn gate_up(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
        let t = self.targets.gate_up;
        let bias = self.mlp(layer).and_then(|(gate_up, _)| gate_up.b.as_deref());
        self.dense(layer, &t, bias, x, y).map_err(hook_err("gate_up"))
    }
    fn down(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
        let t = self.targets.down;
        let bias = self.mlp(layer).and_then(|(_, down)| down.b.as_deref());
        self.dense(layer, &t, bias, x, y).map_err(hook_err("down"))
    }
    fn router(&mut self, layer: usize, x: &[f32], logits: &mut [f32]) -> Result<(), EngineError> {
        StepHooks::router(self, layer, x, logits).map_err(hook_err("router"))
    }
    fn expert_gate_up(&mut self, layer: usize, x: &[f32], topk: &[u32], y: &mut [f32]) -> Result<(), EngineError> {
        let targets = self.expert_gate_up_targets();
        self.experts(layer, &targets, x, true, topk, y)
            .map_err(hook_err("expert_gate_up"))
    }
    fn expert_down(&mut self, layer: usize, x: &[f32], topk: &[u32], y: &mut [f32]) -> Result<(), EngineError> {
        self.experts(layer, &ExpertTarget::down(), x, false, topk, y)
            .map_err(hook_err("expert_down"))
    }
    fn lm_head(&mut self, hidden: &[f32], logits: &mut [f32]) -> Result<(), EngineError> {
        self.head(hidden, logits).map_err(hook_err("lm_head"))
    }
    fn dispatch_tags(&mut self, _layer: usize, n_tokens: usize) -> Result<Vec<i32>, EngineError> {
        self.dispatch_map(n_tokens).map_err(hook_err("dispatch_tags"))
    }
    fn dispatched_gate_up(
        &mut self,
        layer: usize,
        x: &[f32],
        experts: &[u32],
        tags: &[i32],
        y: &mut [f32],
    ) -> Result<(), EngineError> {
        let targets = self.expert_gate_up_targets();
        self.dispatched(layer, &targets, x, experts, tags, y)
            .map_err(hook_err("dispatched_gate_up"))
    }
    fn dispatched_down(
        &mut self,
        layer: usize,
        x: &[f32],
        experts: &[u32],
        tags: &[i32],
        y: &mut [f32],
    ) -> Result<(), EngineError> {
        self.dispatched(layer, &ExpertTarget::down(), x, experts, tags, y)
            .map_err(hook_err("dispatched_down"))
    }
}
