//! What the audit concludes about an adapter: placed dense and expert
//! pairs, token overlays, skips and refusals, and the pool bytes it needs.

use std::collections::BTreeSet;
use std::ops::Range;

use lora_layout::{ExpertSite, LoraModule};

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
    /// Token overlays.
    pub overlay: AuditedOverlay,
    /// Items left out under `allow_partial`, each with its reason.
    pub skipped: Vec<Refusal>,
    /// Items that make the adapter unservable.
    pub refused: Vec<Refusal>,
    /// Whether the adapter has routed-expert or router tensors at all
    /// (placed or skipped): a request for it must fold them or be refused.
    pub has_expert_deltas: bool,
    /// Bytes of one slot of the dense pool at `max_rank`
    /// (`lora_layout::pool_slot_bytes`).
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
    /// Whether the adapter can be served: nothing was refused.
    pub fn is_servable(&self) -> bool {
        self.refused.is_empty()
    }

    /// The distinct refusal codes, sorted.
    pub fn refused_codes(&self) -> BTreeSet<RejectCode> {
        self.refused.iter().map(|r| r.code).collect()
    }
}
