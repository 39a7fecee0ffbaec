//! What the audit concludes about an adapter: placed dense and expert
//! pairs, token overlays, skips and refusals, and the pool bytes it needs.

use std::collections::BTreeSet;
use std::ops::Range;

use lora_layout::{ExpertSite, LoraModule, ModelConfig};
use std::collections::BTreeMap;

use crate::error::{Refusal, RejectCode};
use crate::overlay::{OverlayModule, OverlayTensors};

/// A dense pair placed in the slot pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedPair {
    /// Global layer index.
    pub layer: usize,
    /// The projection.
    pub module: LoraModule,
    /// Rank, from the tensor shapes.
    pub rank: usize,
    /// PEFT's scaling for this pair.
    pub scale: f32,
    /// The `lora_A` tensor.
    pub a_key: String,
    /// The `lora_B` tensor.
    pub b_key: String,
    /// DoRA: the `lora_magnitude_vector` tensor (`[out]`), served as the
    /// per-row rescale `m / ‖W + scale · B A‖` ([`crate::dora`]).
    pub magnitude_key: Option<String>,
}

/// A LoRA on the input embedding, placed in the slot's embedding place:
/// the row of token `t` gains `scale · B · A[:, t]`.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedEmbedding {
    /// Rank, from the tensor shapes.
    pub rank: usize,
    /// PEFT's scaling for this pair.
    pub scale: f32,
    /// The `lora_embedding_A` tensor, `[r, vocab]`.
    pub a_key: String,
    /// The `lora_embedding_B` tensor, `[hidden, r]`.
    pub b_key: String,
}

/// A LoRA on the output head, placed in the slot's head place: the
/// logits of a hidden row `h` gain `scale · B · (A · h)` over the whole
/// vocabulary.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedHead {
    /// Rank, from the tensor shapes.
    pub rank: usize,
    /// PEFT's scaling for this pair.
    pub scale: f32,
    /// The `lm_head.lora_A` tensor, `[r, hidden]`.
    pub a_key: String,
    /// The `lm_head.lora_B` tensor, `[vocab, r]`.
    pub b_key: String,
}

/// Where an expert pair's factors sit in its tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertSlice {
    /// The tensors are this pair's own A `[r, in]` and B `[out, r]`
    /// (transformers 4.x per-expert modules, routers).
    Direct,
    /// A transformers 5.x fused pair: A `[E·r, in]` holds expert `e`'s rows
    /// `e·r..(e+1)·r`; B `[out_total, E·r]` holds its columns `k·E + e`
    /// (interleaved), of which rows `out_rows` belong to this projection
    /// (`gate_up_proj`: Gate rows first, then Up).
    Fused {
        /// Experts in the fused parameter.
        num_experts: usize,
        /// Rows of B for this projection.
        out_rows: Range<usize>,
    },
    /// gpt_oss's fused `gate_up_proj` (gate and up interleaved along its
    /// output, [`GateUpLayout::Interleaved`]): as [`ExpertSlice::Fused`], but
    /// this projection's B rows are every second row, `first_row`,
    /// `first_row + 2`, …, `rows` of them (Gate: the even rows, Up: the odd).
    ///
    /// [`GateUpLayout::Interleaved`]: lora_layout::GateUpLayout::Interleaved
    FusedInterleaved {
        /// Experts in the fused parameter.
        num_experts: usize,
        /// The first row of B for this projection.
        first_row: usize,
        /// How many rows (the projection's output width).
        rows: usize,
    },
}

impl ExpertSlice {
    /// The rows of B that belong to the projection, in its output order
    /// (none for [`ExpertSlice::Direct`], whose B is the projection's own).
    pub fn out_rows(&self) -> Vec<usize> {
        match self {
            ExpertSlice::Direct => Vec::new(),
            ExpertSlice::Fused { out_rows, .. } => out_rows.clone().collect(),
            ExpertSlice::FusedInterleaved { first_row, rows, .. } => (0..*rows).map(|k| first_row + 2 * k).collect(),
        }
    }
}

/// An expert or router pair placed in the expert pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedExpertPair {
    /// Global layer index.
    pub layer: usize,
    /// The routed expert's projection, or the router.
    pub site: ExpertSite,
    /// Rank (per expert), from the tensor shapes.
    pub rank: usize,
    /// PEFT's scaling (from the per-expert rank).
    pub scale: f32,
    /// The `lora_A` tensor.
    pub a_key: String,
    /// The `lora_B` tensor.
    pub b_key: String,
    /// How the factors are cut out of the tensors.
    pub slice: ExpertSlice,
}

/// How the output head is served, as the audit decided it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LmHeadMode {
    /// Not overlaid.
    None,
    /// Tied head: the embedding's trainable-token rows also serve the head.
    TiedTrainableRows,
    /// The head's own tensors.
    Own,
}

/// The audited token overlays.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditedOverlay {
    /// The overlay tensors by role.
    pub tensors: OverlayTensors,
    /// Trainable ids of the embedding, in config order (delta row `k` is
    /// `embed_ids[k]`'s), before clamping to the vocabulary.
    pub embed_ids: Vec<u32>,
    /// Trainable ids of an untied head (dict form), in config order.
    pub lm_head_ids: Vec<u32>,
    /// How the head is served.
    pub lm_head: LmHeadMode,
}

impl AuditedOverlay {
    /// Whether any token row is overlaid.
    pub fn is_empty(&self) -> bool {
        self.tensors.embed.delta.is_none()
            && self.tensors.embed.base_table().is_none()
            && self.lm_head == LmHeadMode::None
    }

    /// The config ids of a table.
    pub fn ids(&self, module: OverlayModule) -> &[u32] {
        match module {
            OverlayModule::Embed => &self.embed_ids,
            OverlayModule::LmHead => &self.lm_head_ids,
        }
    }
}

/// What the audit concluded about an adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditReport {
    /// The adapter directory.
    pub adapter: String,
    /// Dense pairs per (layer, module), sorted.
    pub placed: Vec<PlacedPair>,
    /// Expert and router pairs per (layer, site), sorted.
    pub experts: Vec<PlacedExpertPair>,
    /// The LoRA on the input embedding, if any.
    pub embedding: Option<PlacedEmbedding>,
    /// The LoRA on the output head, if any.
    pub lm_head: Option<PlacedHead>,
    /// Token overlays.
    pub overlay: AuditedOverlay,
    /// Items left out under `allow_partial`, each with its reason.
    pub skipped: Vec<Refusal>,
    /// Items that make the adapter unservable.
    pub refused: Vec<Refusal>,
    /// Whether the adapter has routed-expert or router tensors at all
    /// (placed or skipped): a request for it must fold them or be refused.
    pub has_expert_deltas: bool,
    /// Expert and router pairs placed across the whole expert-parallel
    /// group: `experts.len()` at `ep_world` 1; under expert parallelism
    /// also the other ranks' experts, which `experts` leaves out. Above 0,
    /// a token of this adapter carries its slot in the per-token map on
    /// every rank, whichever rank folds it.
    pub group_expert_pairs: usize,
    /// Bytes of one slot of the dense pool at `max_rank`, for the options'
    /// tensor-parallel rank, the embedding place included when the options
    /// give slots one (`LoraOptions::slot_layout`).
    pub slot_bytes: usize,
    /// Bytes the placed expert and router pairs take in the expert pool at
    /// `expert_rank` (`lora_layout::expert_router_bytes`).
    pub expert_bytes: usize,
    /// The options it was audited under: `max_rank`.
    pub max_rank: usize,
    /// The options it was audited under: `expert_rank`.
    pub expert_rank: usize,
}

impl AuditReport {
    /// The report as JSON: what `lora-audit check --json` prints and the
    /// Python package returns (every placed pair, expert pair, overlay,
    /// skip and refusal, with the pool bytes).
    pub fn to_json(&self, cfg: &ModelConfig) -> serde_json::Value {
        use serde_json::json;
        let refusal = |r: &Refusal| json!({ "code": r.code.as_str(), "subject": r.subject, "reason": r.reason });
        let site_name = |site: ExpertSite| match site {
            ExpertSite::Expert { expert, proj } => format!("expert {expert} {proj}"),
            ExpertSite::Router => "router".to_string(),
        };
        let t = &self.overlay.tensors;
        json!({
            "adapter": self.adapter,
            "model_type": cfg.family.model_type(),
            "servable": self.is_servable(),
            "placed": self.placed.iter().map(|p| json!({
                "layer": p.layer, "module": p.module.path(cfg.family), "rank": p.rank, "scale": p.scale,
                "dora": p.magnitude_key.is_some(),
            })).collect::<Vec<_>>(),
            "experts": self.experts.iter().map(|p| json!({
                "layer": p.layer, "site": site_name(p.site), "rank": p.rank, "scale": p.scale,
                "format": match p.slice {
                    ExpertSlice::Direct => "direct",
                    ExpertSlice::Fused { .. } => "fused",
                    ExpertSlice::FusedInterleaved { .. } => "fused_interleaved",
                },
            })).collect::<Vec<_>>(),
            "embedding": self.embedding.as_ref().map(|e| json!({ "rank": e.rank, "scale": e.scale })),
            "lm_head": self.lm_head.as_ref().map(|e| json!({ "rank": e.rank, "scale": e.scale })),
            "overlay": {
                "embed_trainable_ids": self.overlay.embed_ids,
                "embed_table": t.embed.base_table(),
                "lm_head_trainable_ids": self.overlay.lm_head_ids,
                "lm_head_table": t.lm_head.base_table(),
                "lm_head": self.overlay.lm_head.as_str(),
            },
            "has_expert_deltas": self.has_expert_deltas,
            "skipped": self.skipped.iter().map(refusal).collect::<Vec<_>>(),
            "refused": self.refused.iter().map(refusal).collect::<Vec<_>>(),
            "max_rank": self.max_rank,
            "expert_rank": self.expert_rank,
            "slot_bytes": self.slot_bytes,
            "expert_bytes": self.expert_bytes,
        })
    }

    /// Whether any placed pair is a DoRA pair (it then needs a pool built
    /// for DoRA and the engine's base weights).
    pub fn is_dora(&self) -> bool {
        self.placed.iter().any(|p| p.magnitude_key.is_some())
    }

    /// Whether the adapter can be served: nothing was refused.
    pub fn is_servable(&self) -> bool {
        self.refused.is_empty()
    }

    /// The distinct refusal codes, sorted.
    pub fn refused_codes(&self) -> BTreeSet<RejectCode> {
        self.refused.iter().map(|r| r.code).collect()
    }

    /// Every tensor this report serves: both factors of each placed dense
    /// and expert / router pair, the trainable-token deltas and the full
    /// `modules_to_save` tables, DoRA magnitude vectors. These are the tensors whose values must be
    /// checked (see [`first_non_finite`](crate::first_non_finite)) on any
    /// path that serves them without [`prepare_adapter`](crate::prepare_adapter).
    pub fn served_tensors(&self) -> BTreeSet<String> {
        let pairs = self
            .placed
            .iter()
            .flat_map(|p| [Some(p.a_key.clone()), Some(p.b_key.clone()), p.magnitude_key.clone()])
            .chain(
                self.embedding
                    .iter()
                    .flat_map(|e| [Some(e.a_key.clone()), Some(e.b_key.clone())]),
            )
            .chain(
                self.lm_head
                    .iter()
                    .flat_map(|e| [Some(e.a_key.clone()), Some(e.b_key.clone())]),
            )
            .flatten();
        let experts = self.experts.iter().flat_map(|p| [p.a_key.clone(), p.b_key.clone()]);
        let t = &self.overlay.tensors;
        let overlay = [&t.embed, &t.lm_head]
            .into_iter()
            .flat_map(|table| [table.delta.clone(), table.base_table().map(str::to_string)])
            .flatten();
        pairs.chain(experts).chain(overlay).collect()
    }

    /// Add a refusal (the adapter is then not servable), keeping `refused`
    /// sorted by (code, subject) as the audit leaves it. For paths that
    /// find a problem after the audit, e.g. a non-finite value in landed
    /// tensor bytes ([`Refusal::non_finite`]); return the report as
    /// [`AuditError::Refused`](crate::AuditError::Refused).
    pub fn refuse(&mut self, refusal: Refusal) {
        let at = self
            .refused
            .partition_point(|r| (r.code, &r.subject) <= (refusal.code, &refusal.subject));
        self.refused.insert(at, refusal);
    }
}

impl AuditReport {
    /// The readable table `lora-audit check` prints: placed pairs, expert
    /// pairs, token overlays, skips and refusals, and the pool bytes.
    pub fn to_text(&self, cfg: &ModelConfig) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let verdict = if self.is_servable() { "SERVABLE" } else { "REFUSED" };
        let _ = writeln!(s, "{} ({}): {verdict}", self.adapter, cfg.family.model_type());
        if !self.placed.is_empty() {
            let _ = writeln!(s, "placed dense pairs ({}):", self.placed.len());
            let _ = writeln!(s, "  {:>5}  {:<32} {:>4}  {:>10}", "layer", "module", "rank", "scale");
            for p in &self.placed {
                let _ = writeln!(
                    s,
                    "  {:>5}  {:<32} {:>4}  {:>10.6}{}",
                    p.layer,
                    p.module.path(cfg.family),
                    p.rank,
                    p.scale,
                    if p.magnitude_key.is_some() { "  dora" } else { "" }
                );
            }
        }
        if !self.experts.is_empty() {
            // Group experts sharing (layer, projection, rank, scale) into one line.
            let mut groups: BTreeMap<(usize, String, usize, u32), Vec<usize>> = BTreeMap::new();
            for p in &self.experts {
                let (name, expert) = match p.site {
                    ExpertSite::Expert { expert, proj } => (proj.name().to_string(), Some(expert)),
                    ExpertSite::Router => ("router".to_string(), None),
                };
                let e = groups.entry((p.layer, name, p.rank, p.scale.to_bits())).or_default();
                e.extend(expert);
            }
            let _ = writeln!(s, "placed expert/router pairs ({}):", self.experts.len());
            for ((layer, name, rank, scale), experts) in groups {
                let who = if experts.is_empty() {
                    String::new()
                } else {
                    format!(" experts {experts:?}")
                };
                let _ = writeln!(
                    s,
                    "  layer {layer:>3}  {name:<10} rank {rank:>3}  scale {:.6}{who}",
                    f32::from_bits(scale)
                );
            }
        }
        if let Some(e) = &self.embedding {
            let _ = writeln!(s, "embedding LoRA: rank {}  scale {:.6}", e.rank, e.scale);
        }
        if let Some(e) = &self.lm_head {
            let _ = writeln!(s, "lm_head LoRA: rank {}  scale {:.6}", e.rank, e.scale);
        }
        let t = &self.overlay.tensors;
        if !self.overlay.is_empty() {
            let _ = writeln!(s, "token overlays:");
            if !self.overlay.embed_ids.is_empty() {
                let _ = writeln!(s, "  embed_tokens trainable ids {:?}", self.overlay.embed_ids);
            }
            if let Some(table) = t.embed.base_table() {
                let _ = writeln!(s, "  embed_tokens table {table}");
            }
            if !self.overlay.lm_head_ids.is_empty() {
                let _ = writeln!(s, "  lm_head trainable ids {:?}", self.overlay.lm_head_ids);
            }
            if let Some(table) = t.lm_head.base_table() {
                let _ = writeln!(s, "  lm_head table {table}");
            }
            let _ = writeln!(s, "  lm_head: {}", self.overlay.lm_head.as_str());
        }
        for (title, items) in [("skipped", &self.skipped), ("refused", &self.refused)] {
            if !items.is_empty() {
                let _ = writeln!(s, "{title} ({}):", items.len());
                for r in items {
                    let _ = writeln!(s, "  {r}");
                }
            }
        }
        let _ = writeln!(
            s,
            "pool: {} bytes per dense slot at max rank {}; {} expert-pool bytes at expert rank {}",
            self.slot_bytes, self.max_rank, self.expert_bytes, self.expert_rank
        );
        s
    }
}

impl LmHeadMode {
    /// The mode's name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            LmHeadMode::None => "none",
            LmHeadMode::TiedTrainableRows => "tied-trainable-rows",
            LmHeadMode::Own => "own",
        }
    }
}
