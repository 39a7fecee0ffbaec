//! The pure probe path: an adapter's deltas as they will be served, computed
//! on the host from the audited pairs (BF16-rounded A and B as stored, the
//! pair's scale, FP32 arithmetic) and the token overlays, for probe tensors
//! named after the base model's own weights.
//!
//! Input keys: `probe_in::<weight>` (`[n, in]`) and `rows_idx::<table>`
//! (token ids); other keys are ignored. Output keys: `probe_out::<weight>`
//! (`[n, out]`; for a transformers 5.x fused expert parameter `[E, n, out]`)
//! and `rows_merged::<table>` (`[ids, hidden]`, the served rows). This is how
//! users check an adapter against PEFT's merged weights, and how the tests do.
//!
//! A DoRA pair's probe is a *module-output* probe: its output depends on
//! `W x`, so the probe file also gives the projection's base weight
//! (`base_weight::<weight>`, `[out, in]`) and bias (`base_bias::<weight>`,
//! `[out]`, when it has one), and `probe_out::<weight>` is PEFT's DoRA
//! module output minus the base module's output,
//! `g ⊙ (W x + s·B A x) + b − (W x + b)` ([`crate::dora`]). Without the base
//! weight the adapter is refused, `REJECT[dora-needs-base-weights]`.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use lora_layout::{
    ExpertProj, ExpertSite, GateUpLayout, LayoutError, LoraModule, ModelConfig, ModuleShard, Placement, ShardKind,
};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::error::{AuditError, RejectCode};
use crate::key::{LayerModule, non_text_tower, resolve_layer_module, split_layer_path};
use crate::overlay::{CompiledOverlay, OverlayModule};
use crate::prepare::{HostEmbeddingPair, PreparedAdapter};
use crate::tensors::{LoadedSafetensors, load_f32, load_i64};

/// Prefix of a probe input.
pub const PROBE_IN: &str = "probe_in::";
/// Prefix of a probe output.
pub const PROBE_OUT: &str = "probe_out::";
/// Prefix of requested table rows.
pub const ROWS_IDX: &str = "rows_idx::";
/// Prefix of served table rows.
pub const ROWS_MERGED: &str = "rows_merged::";
/// Prefix of a base projection's weight `[out, in]` (DoRA probes).
pub const BASE_WEIGHT: &str = "base_weight::";
/// Prefix of a base projection's bias `[out]` (DoRA probes).
pub const BASE_BIAS: &str = "base_bias::";

/// A transformers 5.x fused experts parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedParam {
    /// `gate_up_proj` `[E, 2·inter, hidden]`: Gate rows, then Up rows
    /// (gpt_oss: `[E, hidden, 2·inter]`, Gate and Up interleaved; a probe
    /// answers in the parameter's own output order, [`GateUpLayout`]).
    GateUp,
    /// `down_proj` `[E, hidden, inter]`.
    Down,
}

/// What a base-model weight name refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightRef {
    /// A dense projection (`model.layers.0.self_attn.q_proj.weight`).
    Dense {
        /// Layer.
        layer: usize,
        /// Projection.
        module: LoraModule,
    },
    /// One expert's projection, 4.x form
    /// (`model.layers.0.mlp.experts.3.gate_proj.weight`,
    /// `…block_sparse_moe.experts.3.w1.weight`).
    Expert {
        /// Layer.
        layer: usize,
        /// Expert.
        expert: usize,
        /// Projection.
        proj: ExpertProj,
    },
    /// A 5.x fused experts parameter (`model.layers.0.mlp.experts.gate_up_proj`).
    Fused {
        /// Layer.
        layer: usize,
        /// Which parameter.
        param: FusedParam,
    },
    /// The router (`…mlp.gate.weight`, `…block_sparse_moe.gate.weight`).
    Router {
        /// Layer.
        layer: usize,
    },
    /// A token table (`…embed_tokens.weight`, `lm_head.weight`).
    Table(OverlayModule),
    /// A layer weight that exists but takes no delta when served (a
    /// gated-delta-net input, a norm): the served delta is zero.
    Unserved,
}

/// Parse a base-model weight name.
pub fn parse_weight_name(name: &str, cfg: &ModelConfig) -> Result<WeightRef, AuditError> {
    let bad = |reason: String| AuditError::Probe {
        name: name.to_string(),
        reason,
    };
    if name.ends_with("embed_tokens.weight") {
        return Ok(WeightRef::Table(OverlayModule::Embed));
    }
    if name == "lm_head.weight" || name.ends_with(".lm_head.weight") {
        return Ok(WeightRef::Table(OverlayModule::LmHead));
    }
    if non_text_tower(name).is_some() {
        // Another tower of a multimodal wrapper: never served.
        return Ok(WeightRef::Unserved);
    }
    let (_, layer, rest) =
        split_layer_path(name).ok_or_else(|| bad("not a weight of a decoder layer or a token table".into()))?;
    let (module_rest, fused) = match rest.strip_suffix(".weight") {
        Some(m) => (m, None),
        None => match rest.rsplit_once('.') {
            Some((container, "gate_up_proj")) => (container, Some(FusedParam::GateUp)),
            Some((container, "down_proj")) => (container, Some(FusedParam::Down)),
            // gpt_oss's expert biases exist but take no delta when served.
            Some((_, "gate_up_proj_bias" | "down_proj_bias")) => return Ok(WeightRef::Unserved),
            _ => return Err(bad("expected `<module>.weight` or a fused experts parameter".into())),
        },
    };
    match (resolve_layer_module(cfg, layer, module_rest, name), fused) {
        (Ok(LayerModule::Dense(module)), None) => Ok(WeightRef::Dense { layer, module }),
        (Ok(LayerModule::Expert { expert, proj }), None) => Ok(WeightRef::Expert { layer, expert, proj }),
        (Ok(LayerModule::Router), None) => Ok(WeightRef::Router { layer }),
        (Ok(LayerModule::ExpertsContainer), Some(param)) => Ok(WeightRef::Fused { layer, param }),
        (Err(r), _) if matches!(r.code, RejectCode::GdnTarget | RejectCode::UnsupportedTarget) => {
            Ok(WeightRef::Unserved)
        }
        (Err(r), _) => Err(bad(r.reason)),
        (Ok(_), _) => Err(bad(format!("`{rest}` is not a weight of this model"))),
    }
}

/// A probe tensor: shape and row-major values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProbeTensor {
    /// The shape.
    pub shape: Vec<usize>,
    /// The values.
    pub data: Vec<f32>,
}

/// The probes of one input file.
#[derive(Debug, Clone, Default)]
pub struct ProbeInputs {
    /// `probe_in::<weight>` by weight name.
    pub inputs: BTreeMap<String, ProbeTensor>,
    /// `rows_idx::<table>` by table name.
    pub rows: BTreeMap<String, Vec<i64>>,
    /// `base_weight::<weight>` by weight name: what a DoRA pair's probe
    /// needs (with `base_bias::<weight>` when the projection has a bias).
    pub base: BTreeMap<String, ProbeBase>,
}

/// A base projection given with the probes (DoRA).
#[derive(Debug, Clone, Default)]
pub struct ProbeBase {
    /// `base_weight::<weight>`, `[out, in]`.
    pub weight: ProbeTensor,
    /// `base_bias::<weight>`, `[out]`.
    pub bias: Option<ProbeTensor>,
}

/// Read a probe file; keys with other prefixes are ignored, and a file with
/// no probe tensor is [`AuditError::NoProbes`].
pub fn read_probe_inputs(path: &Path) -> Result<ProbeInputs, AuditError> {
    let inputs = probe_tensors(path)?;
    if inputs.inputs.is_empty() && inputs.rows.is_empty() {
        return Err(AuditError::NoProbes {
            path: path.display().to_string(),
        });
    }
    Ok(inputs)
}

/// The `probe_in::` and `rows_idx::` tensors of a file (perhaps none).
fn probe_tensors(path: &Path) -> Result<ProbeInputs, AuditError> {
    let mapped = LoadedSafetensors::open(path)?;
    let mut out = ProbeInputs::default();
    for info in mapped.infos()? {
        if let Some(weight) = info.name.strip_prefix(PROBE_IN) {
            let (shape, data) = load_f32(&mapped, &info.name)?;
            out.inputs.insert(weight.to_string(), ProbeTensor { shape, data });
        } else if let Some(table) = info.name.strip_prefix(ROWS_IDX) {
            let (_, ids) = load_i64(&mapped, &info.name)?;
            out.rows.insert(table.to_string(), ids);
        } else if let Some(weight) = info.name.strip_prefix(BASE_WEIGHT) {
            let (shape, data) = load_f32(&mapped, &info.name)?;
            out.base.entry(weight.to_string()).or_default().weight = ProbeTensor { shape, data };
        } else if let Some(weight) = info.name.strip_prefix(BASE_BIAS) {
            let (shape, data) = load_f32(&mapped, &info.name)?;
            out.base.entry(weight.to_string()).or_default().bias = Some(ProbeTensor { shape, data });
        }
    }
    Ok(out)
}

/// A PEFT oracle (`oracle.safetensors`): the probe inputs and PEFT's own
/// answers (`probe_out::<weight>`, `rows_merged::<table>`, by full key).
#[derive(Debug, Clone, Default)]
pub struct Oracle {
    /// `probe_in::` and `rows_idx::` inputs.
    pub inputs: ProbeInputs,
    /// PEFT's outputs by full key.
    pub expected: BTreeMap<String, ProbeTensor>,
}

/// Read an oracle file.
pub fn read_oracle(path: &Path) -> Result<Oracle, AuditError> {
    let inputs = probe_tensors(path)?;
    let mapped = LoadedSafetensors::open(path)?;
    let mut expected = BTreeMap::new();
    for info in mapped.infos()? {
        if info.name.starts_with(PROBE_OUT) || info.name.starts_with(ROWS_MERGED) {
            let (shape, data) = load_f32(&mapped, &info.name)?;
            expected.insert(info.name.clone(), ProbeTensor { shape, data });
        }
    }
    Ok(Oracle { inputs, expected })
}

/// The served base token tables, BF16 `[vocab, hidden]`.
#[derive(Debug, Clone, Default)]
pub struct BaseTables {
    /// The input embedding.
    pub embed: Option<Vec<bf16>>,
    /// The output head; `None` on a tied model (the embedding serves it).
    pub lm_head: Option<Vec<bf16>>,
}

/// Read `--base`: the tensors whose names end in `embed_tokens.weight` and
/// `lm_head.weight`.
pub fn read_base_tables(path: &Path) -> Result<BaseTables, AuditError> {
    let mapped = LoadedSafetensors::open(path)?;
    let tensors = crate::tensors::load_bf16(&mapped, |n| {
        n.ends_with("embed_tokens.weight") || n == "lm_head.weight" || n.ends_with(".lm_head.weight")
    })?;
    let mut tables = BaseTables::default();
    for (name, t) in tensors {
        if name.ends_with("embed_tokens.weight") {
            tables.embed = Some(t.data);
        } else {
            tables.lm_head = Some(t.data);
        }
    }
    Ok(tables)
}

/// What a probe run produced.
#[derive(Debug, Clone, Default)]
pub struct ProbeOutputs {
    /// `probe_out::<weight>` and `rows_merged::<table>` tensors by full key.
    pub tensors: BTreeMap<String, ProbeTensor>,
    /// Probed weights that take no delta when served (no output written).
    pub unserved: Vec<String>,
}

/// The most bytes of output (f32) one probe run produces, over all its
/// output tensors: 1 GiB. A probe's output is `rows x width` per weight,
/// where the width comes from the model config (up to 2^24 per dimension),
/// so even a small probe file can ask for more than any host holds; past
/// this bound the run stops with [`AuditError::ProbeTooLarge`] naming the
/// probe and the config field, before allocating. Split larger probes
/// into several runs.
pub const MAX_PROBE_OUTPUT_BYTES: usize = 1 << 30;

/// What is left of [`MAX_PROBE_OUTPUT_BYTES`] in one run; every output
/// buffer is allocated through it, fallibly.
struct OutputBudget {
    left: usize,
}

impl OutputBudget {
    /// `rows x width` zeros, charged to the budget; an error naming the
    /// probe and `field` past the budget or when the host cannot allocate.
    fn zeros(&mut self, name: &str, field: &'static str, rows: usize, width: usize) -> Result<Vec<f32>, AuditError> {
        let bytes = (rows as u128) * (width as u128) * 4;
        let too_large = || AuditError::ProbeTooLarge {
            name: name.to_string(),
            field,
            rows,
            width,
            bytes,
            limit: self.left,
        };
        let len = rows
            .checked_mul(width)
            .filter(|_| bytes <= self.left as u128)
            .ok_or_else(too_large)?;
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| too_large())?;
        v.resize(len, 0.0);
        self.left -= len * 4;
        Ok(v)
    }

    /// Give back a temporary buffer's share.
    fn release(&mut self, v: Vec<f32>) {
        self.left += v.len() * 4;
    }
}

/// The model-config field(s) a probed weight's output width comes from.
fn width_field(weight: &WeightRef) -> &'static str {
    match weight {
        WeightRef::Dense { module, .. } => match module {
            LoraModule::QProj => "num_attention_heads x head_dim",
            LoraModule::KProj | LoraModule::VProj => "num_key_value_heads x head_dim",
            LoraModule::GateProj | LoraModule::UpProj => "intermediate_size",
            LoraModule::SharedGateProj | LoraModule::SharedUpProj => "shared_expert_intermediate_size",
            LoraModule::QAProj | LoraModule::QBProj | LoraModule::KvAProjWithMqa | LoraModule::KvBProj => {
                "the MLA head dimensions"
            }
            LoraModule::SharedExpertGate => "1",
            LoraModule::QkvProj => "(num_attention_heads + 2 x num_key_value_heads) x head_dim",
            LoraModule::GateUpProj => "2 x intermediate_size",
            _ => "hidden_size",
        },
        WeightRef::Expert { proj, .. } => match proj {
            ExpertProj::Gate | ExpertProj::Up => "moe_intermediate_size",
            ExpertProj::Down => "hidden_size",
        },
        WeightRef::Fused { param, .. } => match param {
            FusedParam::GateUp => "num_experts x 2 x moe_intermediate_size",
            FusedParam::Down => "num_experts x hidden_size",
        },
        WeightRef::Router { .. } => "num_experts",
        WeightRef::Table(OverlayModule::LmHead) => "vocab_size",
        WeightRef::Table(OverlayModule::Embed) => "hidden_size",
        WeightRef::Unserved => "none",
    }
}

/// Answer every probe from the prepared adapter. Outputs total at most
/// [`MAX_PROBE_OUTPUT_BYTES`]; past it, [`AuditError::ProbeTooLarge`].
pub fn probe_adapter(
    adapter: &PreparedAdapter,
    cfg: &ModelConfig,
    inputs: &ProbeInputs,
    base: Option<&BaseTables>,
) -> Result<ProbeOutputs, AuditError> {
    probe_within(adapter, cfg, inputs, base, Placement::SINGLE, MAX_PROBE_OUTPUT_BYTES)
}

/// [`probe_adapter`] for one tensor-parallel rank: each dense probe's
/// output is the rank's part of the served delta
/// ([`lora_layout::ModuleShard`]). A column-parallel module answers its
/// output columns `[n, out_r]` (the rank's block; for a fused module the
/// rank's block of each fused part, in fused order; a replicated key/value
/// head's columns on every rank holding it); a row-parallel module answers
/// the partial delta `[n, out]` from the rank's columns of the probe input
/// and of A, which the ranks' sum (the base model's all-reduce) makes
/// whole; a replicated module answers the whole delta, and so does the
/// output head's LoRA pair (`probe_in::lm_head.weight`), replicated whole on
/// every rank ([`lora_layout::ModuleShard::lm_head`]), unless the placement
/// is [`Placement::vocab_parallel`]: then the head probe answers the rank's
/// logit columns `[n, V/W]` ([`Placement::vocab_range`]).
///
/// Under expert parallelism (`ep_world > 1`) an expert probe of an expert
/// the rank holds ([`Placement::expert_range`]) answers its whole delta,
/// one of an expert it does not hold answers zeros of the same shape (a
/// fused-experts probe `[E, n, out]` has zeros in the other ranks'
/// experts), so the expert-parallel ranks' outputs sum to the unsharded
/// ones; a router probe answers the whole (replicated) delta on every
/// rank. A model whose `num_experts` does not divide by `ep_world` is
/// [`AuditError::Layout`] naming it. Token-table probes (`rows_idx::`, and
/// `probe_in::` of a table without a LoRA pair), and expert and router
/// probes under `tp_world > 1` without expert parallelism, have no
/// placement: [`AuditError::Probe`].
pub fn probe_adapter_at(
    adapter: &PreparedAdapter,
    cfg: &ModelConfig,
    inputs: &ProbeInputs,
    base: Option<&BaseTables>,
    placement: Placement,
) -> Result<ProbeOutputs, AuditError> {
    probe_within(adapter, cfg, inputs, base, placement, MAX_PROBE_OUTPUT_BYTES)
}

/// [`probe_adapter_at`] with `limit` bytes of output.
fn probe_within(
    adapter: &PreparedAdapter,
    cfg: &ModelConfig,
    inputs: &ProbeInputs,
    base: Option<&BaseTables>,
    placement: Placement,
    limit: usize,
) -> Result<ProbeOutputs, AuditError> {
    let mut out = ProbeOutputs::default();
    let mut budget = OutputBudget { left: limit };
    if placement.tp_world() > 1
        && let Some(table) = inputs.rows.keys().next()
    {
        return Err(AuditError::Probe {
            name: format!("{ROWS_IDX}{table}"),
            reason: format!(
                "token-table probes have no tensor-parallel placement (tp_world {})",
                placement.tp_world()
            ),
        });
    }
    for (weight, x) in &inputs.inputs {
        match probe_weight(adapter, cfg, weight, x, inputs.base.get(weight), placement, &mut budget)? {
            Some(t) => {
                out.tensors.insert(format!("{PROBE_OUT}{weight}"), t);
            }
            None => out.unserved.push(weight.clone()),
        }
    }
    if !inputs.rows.is_empty() {
        let served = ServedTables::new(adapter, cfg, base)?;
        for (table, ids) in &inputs.rows {
            let module = match parse_weight_name(table, cfg)? {
                WeightRef::Table(m) => m,
                _ => {
                    return Err(AuditError::Probe {
                        name: format!("{ROWS_IDX}{table}"),
                        reason: "rows can only be asked of embed_tokens or lm_head".into(),
                    });
                }
            };
            if module == OverlayModule::LmHead && adapter.lm_head.is_some() {
                // The merged head is its table plus a delta in every row:
                // PEFT's oracle probes that delta as a linear weight.
                return Err(AuditError::Probe {
                    name: format!("{ROWS_IDX}{table}"),
                    reason: "the adapter has a LoRA on lm_head: probe its delta with probe_in::".into(),
                });
            }
            let rows = served.rows(module, table, ids, &mut budget)?;
            out.tensors.insert(format!("{ROWS_MERGED}{table}"), rows);
        }
    }
    Ok(out)
}

/// One probe: `None` for a weight that takes no delta.
fn probe_weight(
    adapter: &PreparedAdapter,
    cfg: &ModelConfig,
    weight: &str,
    x: &ProbeTensor,
    base: Option<&ProbeBase>,
    placement: Placement,
    budget: &mut OutputBudget,
) -> Result<Option<ProbeTensor>, AuditError> {
    let name = format!("{PROBE_IN}{weight}");
    let bad = |reason: String| AuditError::Probe {
        name: name.clone(),
        reason,
    };
    let [n, width] = x.shape[..] else {
        return Err(bad(format!("shape {:?}; expected [rows, in]", x.shape)));
    };
    if n.checked_mul(width) != Some(x.data.len()) {
        return Err(bad(format!("{} values for shape {:?}", x.data.len(), x.shape)));
    }
    let check_width = |inp: usize| {
        if width == inp {
            Ok(())
        } else {
            Err(bad(format!("width {width}, but the weight's input width is {inp}")))
        }
    };
    let weight_ref = parse_weight_name(weight, cfg)?;
    let field = width_field(&weight_ref);
    // `y [n, out]`: zeros, plus the pair's delta when the weight has one.
    let pair_out =
        |budget: &mut OutputBudget, pair: Option<(&[bf16], &[bf16], usize, f32)>, (out, inp): (usize, usize)| {
            let mut y = budget.zeros(&name, field, n, out)?;
            if let Some((a, b, rank, scale)) = pair
                && !apply_pair_into(&x.data, a, b, PairShape { n, rank, inp, out }, scale, &mut y)
            {
                return Err(bad("the pair's factors do not have their shapes' lengths".into()));
            }
            Ok(y)
        };
    let dense = |layer, module: LoraModule| {
        adapter
            .dense_pair(layer, module)
            .map(|p| (p.a.as_slice(), p.b.as_slice(), p.rank, p.scale))
    };
    // An expert-parallel rank answers its own experts and the router;
    // an expert it does not hold answers zeros (tokens routed to it are
    // dispatched to the rank that holds it).
    let num_experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    let held = placement
        .expert_range(num_experts)
        .map_err(|e| AuditError::Layout(LayoutError::from(e)))?;
    let expert = |layer, site| {
        if let ExpertSite::Expert { expert, .. } = site
            && !held.contains(&expert)
        {
            return None;
        }
        adapter
            .expert_pair(layer, site)
            .map(|p| (p.a.as_slice(), p.b.as_slice(), p.rank, p.scale))
    };
    let no_site = || bad("the model has no such site".into());
    // Experts and the router are placed by expert parallelism only: under
    // tensor parallelism without it they have no placement. The output
    // head's LoRA pair is replicated (whole on every rank, as the base model
    // keeps lm_head whole): its probe answers the whole delta; under the
    // vocab-parallel cut, the rank's logit columns.
    let unplaced = match weight_ref {
        WeightRef::Dense { .. } | WeightRef::Unserved => false,
        WeightRef::Table(OverlayModule::LmHead) => adapter.lm_head.is_none(),
        WeightRef::Table(_) => true,
        WeightRef::Expert { .. } | WeightRef::Router { .. } | WeightRef::Fused { .. } => placement.ep_world() == 1,
    };
    if placement.tp_world() > 1 && unplaced {
        return Err(bad(format!(
            "token-table probes, and expert and router probes without expert parallelism, have no tensor-parallel placement (tp_world {})",
            placement.tp_world()
        )));
    }
    Ok(Some(match weight_ref {
        WeightRef::Unserved => return Ok(None),
        // The output head with a LoRA pair: its delta over the whole
        // vocabulary, probed like a linear weight (in = hidden, out = vocab).
        WeightRef::Table(OverlayModule::LmHead) if adapter.lm_head.is_some() => {
            let (out, inp) = (cfg.vocab_size, cfg.hidden_size);
            check_width(inp)?;
            let pair = adapter
                .lm_head
                .as_ref()
                .map(|p| (p.a.as_slice(), p.b.as_slice(), p.rank, p.scale));
            // A vocab-parallel rank answers its logit columns `[n, V/W]`.
            let cols = placement
                .vocab_range(out)
                .map_err(|e| AuditError::Layout(LayoutError::from(e)))?;
            let y = pair_out(budget, pair, (out, inp))?;
            if cols.len() == out {
                ProbeTensor {
                    shape: vec![n, out],
                    data: y,
                }
            } else {
                let mut y_r = budget.zeros(&name, field, n, cols.len())?;
                for (dst, src) in y_r.chunks_exact_mut(cols.len().max(1)).zip(y.chunks_exact(out.max(1))) {
                    dst.copy_from_slice(&src[cols.clone()]);
                }
                budget.release(y);
                ProbeTensor {
                    shape: vec![n, cols.len()],
                    data: y_r,
                }
            }
        }
        WeightRef::Table(_) => {
            return Err(bad(
                "token tables are probed with rows_idx:: (probe_in:: only for lm_head with a LoRA pair)".into(),
            ));
        }
        WeightRef::Dense { layer, module } if placement.tp_world() > 1 => {
            let (out, inp) = module.dims(cfg);
            check_width(inp)?;
            // DoRA's row norm spans every input column, which a row-parallel
            // rank does not hold: not served under tensor parallelism.
            if adapter.dense_pair(layer, module).is_some_and(|p| p.magnitude.is_some()) {
                return Err(bad(format!(
                    "DoRA has no tensor-parallel placement (tp_world {})",
                    placement.tp_world()
                )));
            }
            let shard =
                ModuleShard::of(module, cfg, placement).map_err(|e| AuditError::Layout(LayoutError::from(e)))?;
            let (out_r, in_r) = shard.dims();
            if shard.kind == ShardKind::Row {
                // The partial delta of the rank's input columns.
                let cols = shard.in_start..shard.in_start + in_r;
                let take = |row: &[f32]| row[cols.clone()].to_vec();
                let x_r: Vec<f32> = x.data.chunks_exact(inp.max(1)).flat_map(take).collect();
                let mut y = budget.zeros(&name, field, n, out)?;
                if let Some((a, b, rank, scale)) = dense(layer, module) {
                    let a_r: Vec<bf16> = a
                        .chunks_exact(inp.max(1))
                        .flat_map(|row| row[cols.clone()].to_vec())
                        .collect();
                    let shape = PairShape {
                        n,
                        rank,
                        inp: in_r,
                        out,
                    };
                    if a_r.len() != rank * in_r || !apply_pair_into(&x_r, &a_r, b, shape, scale, &mut y) {
                        return Err(bad("the pair's factors do not have their shapes' lengths".into()));
                    }
                }
                ProbeTensor {
                    shape: vec![n, out],
                    data: y,
                }
            } else {
                // The rank's output columns of the whole delta.
                let y = pair_out(budget, dense(layer, module), (out, inp))?;
                let mut y_r = budget.zeros(&name, field, n, out_r)?;
                for j in 0..out_r {
                    let col = shard
                        .src_row(j)
                        .ok_or_else(|| bad(format!("no source column for the rank's column {j}")))?;
                    for t in 0..n {
                        y_r[t * out_r + j] = y[t * out + col];
                    }
                }
                budget.release(y);
                ProbeTensor {
                    shape: vec![n, out_r],
                    data: y_r,
                }
            }
        }
        WeightRef::Dense { layer, module } => {
            let (out, inp) = module.dims(cfg);
            check_width(inp)?;
            let mut data = pair_out(budget, dense(layer, module), (out, inp))?;
            if let Some(pair) = adapter.dense_pair(layer, module)
                && let Some(m) = &pair.magnitude
            {
                dora_probe(adapter, pair, m, base, &x.data, (out, inp), &mut data).map_err(|e| match e {
                    DoraProbeError::Bad(reason) => bad(reason),
                    DoraProbeError::Refused(e) => e,
                })?;
            }
            ProbeTensor {
                shape: vec![n, out],
                data,
            }
        }
        WeightRef::Expert { layer, expert: e, proj } => {
            let site = ExpertSite::Expert { expert: e, proj };
            let dims = site.dims(cfg).ok_or_else(no_site)?;
            check_width(dims.1)?;
            ProbeTensor {
                shape: vec![n, dims.0],
                data: pair_out(budget, expert(layer, site), dims)?,
            }
        }
        WeightRef::Router { layer } => {
            let dims = ExpertSite::Router.dims(cfg).ok_or_else(no_site)?;
            check_width(dims.1)?;
            ProbeTensor {
                shape: vec![n, dims.0],
                data: pair_out(budget, expert(layer, ExpertSite::Router), dims)?,
            }
        }
        WeightRef::Fused { layer, param } => {
            let moe = cfg.moe.as_ref().ok_or_else(no_site)?;
            let projs: &[ExpertProj] = match param {
                FusedParam::GateUp => &[ExpertProj::Gate, ExpertProj::Up],
                FusedParam::Down => &[ExpertProj::Down],
            };
            let dims: Vec<(usize, usize)> = projs
                .iter()
                .map(|p| p.dims(cfg).ok_or_else(no_site))
                .collect::<Result<_, _>>()?;
            let Some(&(_, inp)) = dims.first() else {
                return Err(no_site());
            };
            check_width(inp)?;
            let out_total: usize = dims.iter().map(|d| d.0).sum();
            let rows = moe.num_experts.saturating_mul(n);
            let mut data = budget.zeros(&name, field, rows, out_total)?;
            // Each projection's outputs where the parameter keeps them.
            let layout = GateUpLayout::of(cfg.family);
            let inter = moe.expert_intermediate_size;
            for e in 0..moe.num_experts {
                for (proj, &d) in projs.iter().zip(&dims) {
                    let y = pair_out(budget, expert(layer, ExpertSite::Expert { expert: e, proj: *proj }), d)?;
                    for row in 0..n {
                        let dst = (e * n + row) * out_total;
                        for (j, v) in y[row * d.0..(row + 1) * d.0].iter().enumerate() {
                            data[dst + layout.column(*proj, j, inter)] = *v;
                        }
                    }
                    budget.release(y);
                }
            }
            ProbeTensor {
                shape: vec![moe.num_experts, n, out_total],
                data,
            }
        }
    }))
}

/// Why a DoRA probe cannot be answered.
enum DoraProbeError {
    /// The probe file's fault (a base tensor of the wrong shape).
    Bad(String),
    /// The adapter cannot be served this way (no base weight given).
    Refused(AuditError),
}

/// A DoRA pair's probe is a module-output probe: PEFT's DoRA module output
/// minus the base module's output, `g ⊙ (W x + s·B A x) + b − (W x + b)`.
/// `y` holds the pair's plain delta `s·B A x` on entry and the probe's
/// answer on return; computed as served: `base + delta`, rescaled by
/// [`crate::dora::rescale`], minus `base`.
fn dora_probe(
    adapter: &PreparedAdapter,
    pair: &crate::prepare::HostPair,
    magnitude: &[f32],
    base: Option<&ProbeBase>,
    x: &[f32],
    (out, inp): (usize, usize),
    y: &mut [f32],
) -> Result<(), DoraProbeError> {
    let Some(base) = base else {
        let mut report = adapter.report.clone();
        let key = adapter
            .report
            .placed
            .iter()
            .find(|p| (p.layer, p.module) == (pair.layer, pair.module))
            .and_then(|p| p.magnitude_key.clone())
            .unwrap_or_default();
        report.refuse(crate::error::Refusal::new(
            RejectCode::DoraNeedsBaseWeights,
            key,
            "a DoRA pair's probe needs the projection's base weight (base_weight::<weight> in the probe file)",
        ));
        return Err(DoraProbeError::Refused(AuditError::Refused(Box::new(report))));
    };
    if base.weight.shape != [out, inp] {
        return Err(DoraProbeError::Bad(format!(
            "{BASE_WEIGHT} has shape {:?}; the projection is [{out}, {inp}]",
            base.weight.shape
        )));
    }
    if let Some(b) = &base.bias
        && b.shape != [out]
    {
        return Err(DoraProbeError::Bad(format!(
            "{BASE_BIAS} has shape {:?}; the projection's bias is [{out}]",
            b.shape
        )));
    }
    let shape = crate::dora::DoraShape {
        out,
        inp,
        rank: pair.rank,
    };
    let g = crate::dora::row_scale(magnitude, &base.weight.data, &pair.a, &pair.b, shape, pair.scale)
        .map_err(|e| DoraProbeError::Bad(format!("DoRA rescale: {e}")))?;
    let w = &base.weight.data;
    for (row, yr) in y.chunks_exact_mut(out.max(1)).enumerate() {
        let xr = &x[row * inp..(row + 1) * inp];
        for (o, v) in yr.iter_mut().enumerate() {
            let bias = base.bias.as_ref().map_or(0.0, |b| b.data[o]);
            let wx = w[o * inp..(o + 1) * inp]
                .iter()
                .zip(xr)
                .fold(0f32, |acc, (w, x)| acc + w * x);
            let served = wx + bias;
            *v = crate::dora::rescale(served + *v, g[o], bias) - served;
        }
    }
    Ok(())
}

/// The shape of one pair application: `n` rows of width `inp` through a
/// pair of rank `rank` into width `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairShape {
    /// Rows of x.
    pub n: usize,
    /// Rank of the pair.
    pub rank: usize,
    /// Input width.
    pub inp: usize,
    /// Output width.
    pub out: usize,
}

/// `y[n, out] = scale · (x[n, in] · Aᵀ) · Bᵀ` with A `[rank, in]`, B
/// `[out, rank]` in BF16 and FP32 accumulation. `None` when a slice does
/// not have the length its shape says.
pub fn apply_pair(x: &[f32], a: &[bf16], b: &[bf16], shape: PairShape, scale: f32) -> Option<Vec<f32>> {
    let mut y = vec![0.0f32; shape.n.checked_mul(shape.out)?];
    apply_pair_into(x, a, b, shape, scale, &mut y).then_some(y)
}

/// [`apply_pair`] into `y` (`n x out`, overwritten); `false` when a slice
/// does not have the length its shape says.
fn apply_pair_into(x: &[f32], a: &[bf16], b: &[bf16], shape: PairShape, scale: f32, y: &mut [f32]) -> bool {
    let PairShape { n, rank, inp, out } = shape;
    let fits = |len: usize, rows: usize, cols: usize| rows.checked_mul(cols) == Some(len);
    if !(fits(x.len(), n, inp) && fits(a.len(), rank, inp) && fits(b.len(), out, rank) && fits(y.len(), n, out)) {
        return false;
    }
    let mut t = vec![0.0f32; rank];
    for row in 0..n {
        let xr = &x[row * inp..(row + 1) * inp];
        for (k, tk) in t.iter_mut().enumerate() {
            let ak = &a[k * inp..(k + 1) * inp];
            *tk = xr.iter().zip(ak).map(|(xi, ai)| xi * ai.to_f32()).sum();
        }
        for (o, yo) in y[row * out..(row + 1) * out].iter_mut().enumerate() {
            let bo = &b[o * rank..(o + 1) * rank];
            *yo = scale * t.iter().zip(bo).map(|(tk, bk)| tk * bk.to_f32()).sum::<f32>();
        }
    }
    true
}

/// The served token tables of one adapter: base tables plus its compiled
/// overlays.
struct ServedTables<'a> {
    hidden: usize,
    vocab: usize,
    embed_base: Option<&'a [bf16]>,
    head_base: Option<&'a [bf16]>,
    embed: Option<CompiledOverlay>,
    head: Option<CompiledOverlay>,
    /// The LoRA on the input embedding, added onto the served embed rows.
    embed_lora: Option<&'a HostEmbeddingPair>,
}

impl<'a> ServedTables<'a> {
    fn new(adapter: &'a PreparedAdapter, cfg: &ModelConfig, base: Option<&'a BaseTables>) -> Result<Self, AuditError> {
        let need = |what: &str| AuditError::Probe {
            name: ROWS_IDX.to_string(),
            reason: format!("rows_idx probes need --base with {what}"),
        };
        let base = base.ok_or_else(|| need("the token tables"))?;
        let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
        let embed_base = base.embed.as_deref();
        // A tied head is the embedding table.
        let head_base = base
            .lm_head
            .as_deref()
            .or(if cfg.tie_word_embeddings { embed_base } else { None });
        let compile = |overlay: Option<&crate::overlay::TableOverlay>, table: Option<&[bf16]>, what: &str| {
            overlay
                .map(|o| {
                    let table = table.ok_or_else(|| need(what))?;
                    o.compile(table, vocab, hidden).map_err(|e| AuditError::Probe {
                        name: format!("{ROWS_IDX}{what}"),
                        reason: e.to_string(),
                    })
                })
                .transpose()
        };
        let embed = compile(adapter.overlay.embed.as_ref(), embed_base, "embed_tokens.weight")?;
        let head_overlay = adapter.overlay.lm_head_table();
        let head = compile(head_overlay.as_deref(), head_base, "lm_head.weight")?;
        Ok(ServedTables {
            hidden,
            vocab,
            embed_base,
            head_base,
            embed,
            head,
            embed_lora: adapter.embedding.as_ref(),
        })
    }

    fn rows(
        &self,
        module: OverlayModule,
        table: &str,
        ids: &[i64],
        budget: &mut OutputBudget,
    ) -> Result<ProbeTensor, AuditError> {
        let (base, overlay) = match module {
            OverlayModule::Embed => (self.embed_base, &self.embed),
            OverlayModule::LmHead => (self.head_base, &self.head),
        };
        let bad = |reason: String| AuditError::Probe {
            name: format!("{ROWS_IDX}{table}"),
            reason,
        };
        let base = base.ok_or_else(|| bad(format!("--base has no {} table", module.name())))?;
        if Some(base.len()) != self.vocab.checked_mul(self.hidden) {
            return Err(bad(format!(
                "the base table has {} elements, expected {} x {}",
                base.len(),
                self.vocab,
                self.hidden
            )));
        }
        let name = format!("{ROWS_IDX}{table}");
        let mut data = budget.zeros(&name, "hidden_size", ids.len(), self.hidden)?;
        for (k, &id) in ids.iter().enumerate() {
            let i = usize::try_from(id)
                .ok()
                .filter(|&i| i < self.vocab)
                .ok_or_else(|| bad(format!("id {id} is outside the vocabulary of {}", self.vocab)))?;
            let row = match overlay {
                Some(o) => o.served_row(i, base, self.hidden),
                None => base.get(i * self.hidden..(i + 1) * self.hidden),
            }
            .ok_or_else(|| bad(format!("no row for id {id}")))?;
            let dst = &mut data[k * self.hidden..(k + 1) * self.hidden];
            for (d, v) in dst.iter_mut().zip(row) {
                *d = v.to_f32();
            }
            // PEFT's order: the (overlaid) lookup, then the LoRA delta.
            if let (OverlayModule::Embed, Some(lora)) = (module, self.embed_lora) {
                let delta = lora
                    .row_delta(i)
                    .ok_or_else(|| bad(format!("the embedding LoRA has no column for id {id}")))?;
                for (d, v) in dst.iter_mut().zip(delta) {
                    *d += v;
                }
            }
        }
        Ok(ProbeTensor {
            shape: vec![ids.len(), self.hidden],
            data,
        })
    }
}

/// The probe path as the `lora-audit probe` command and the Python package
/// run it: `adapter`'s deltas for the probe file `probes` (with the base
/// token tables of `base`, for `rows_idx::` probes), written to `out`.
pub fn probe_files(
    adapter: &PreparedAdapter,
    cfg: &ModelConfig,
    probes: &Path,
    base: Option<&Path>,
    out: &Path,
) -> Result<ProbeOutputs, AuditError> {
    probe_files_at(adapter, cfg, probes, base, out, Placement::SINGLE)
}

/// [`probe_files`] for one tensor-parallel rank ([`probe_adapter_at`]).
pub fn probe_files_at(
    adapter: &PreparedAdapter,
    cfg: &ModelConfig,
    probes: &Path,
    base: Option<&Path>,
    out: &Path,
    placement: Placement,
) -> Result<ProbeOutputs, AuditError> {
    let inputs = read_probe_inputs(probes)?;
    let base = base.map(read_base_tables).transpose()?;
    let outputs = probe_adapter_at(adapter, cfg, &inputs, base.as_ref(), placement)?;
    write_probe_outputs(out, &outputs)?;
    Ok(outputs)
}

/// Write probe outputs as F32 tensors (each tensor's bytes allocated
/// fallibly: an error, never an abort, when the host lacks the memory).
/// Outputs with no tensor are [`AuditError::NothingProbed`], never an empty
/// file.
pub fn write_probe_outputs(path: &Path, outputs: &ProbeOutputs) -> Result<(), AuditError> {
    if outputs.tensors.is_empty() {
        return Err(AuditError::NothingProbed {
            unserved: outputs.unserved.clone(),
        });
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = outputs
        .tensors
        .iter()
        .map(|(k, t)| {
            let no_memory = || AuditError::Tensor {
                name: k.clone(),
                reason: format!("{} values do not fit in the host's memory", t.data.len()),
            };
            let mut b = Vec::new();
            b.try_reserve_exact(t.data.len().checked_mul(4).ok_or_else(no_memory)?)
                .map_err(|_| no_memory())?;
            b.extend(t.data.iter().flat_map(|v| v.to_le_bytes()));
            Ok((k.clone(), t.shape.clone(), b))
        })
        .collect::<Result<_, AuditError>>()?;
    let views = bytes
        .iter()
        .map(|(k, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (k.clone(), v))
                .map_err(|e| AuditError::Tensor {
                    name: k.clone(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| AuditError::Write {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests;
