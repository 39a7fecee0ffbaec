//! The projections a LoRA delta can target, their `(out, in)` dims and the
//! layers they exist in.

use crate::config::{LayerKind, ModelConfig, ModelFamily};

/// A dense projection of a decoder layer that takes a pool-slot LoRA pair.
///
/// Routed experts and the router live in the expert pool instead
/// ([`ExpertProj`], [`router_dims`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraModule {
    /// `self_attn.q_proj` (Qwen3-Next: query and gate, 2·heads·head_dim).
    QProj,
    /// `self_attn.k_proj`
    KProj,
    /// `self_attn.v_proj`
    VProj,
    /// `self_attn.o_proj`
    OProj,
    /// MLA `self_attn.q_a_proj` (DeepSeek-V3 with a `q_lora_rank`).
    QAProj,
    /// MLA `self_attn.q_b_proj`
    QBProj,
    /// MLA `self_attn.kv_a_proj_with_mqa`
    KvAProjWithMqa,
    /// MLA `self_attn.kv_b_proj`
    KvBProj,
    /// Gated-delta-net `linear_attn.out_proj` (Qwen3-Next linear layers).
    LinearAttnOutProj,
    /// Dense MLP `mlp.gate_proj`
    GateProj,
    /// Dense MLP `mlp.up_proj`
    UpProj,
    /// Dense MLP `mlp.down_proj`
    DownProj,
    /// Shared-expert `gate_proj` (`mlp.shared_expert.`, or DeepSeek's and
    /// GLM-4.5's `mlp.shared_experts.`).
    SharedGateProj,
    /// Shared-expert `up_proj`
    SharedUpProj,
    /// Shared-expert `down_proj`
    SharedDownProj,
    /// `mlp.shared_expert_gate`, the shared expert's sigmoid gate `[1, hidden]`.
    SharedExpertGate,
    /// Phi-3's fused `self_attn.qkv_proj`: one projection onto the whole
    /// `q | k | v` output, `(heads·head_dim + 2·kv_heads·head_dim, hidden)`;
    /// its pair is one delta over the fused width.
    QkvProj,
    /// Phi-3's fused `mlp.gate_up_proj`: `(2·intermediate, hidden)`, gate
    /// rows then up rows (its `chunk(2)`); one delta over the fused width.
    GateUpProj,
}

impl LoraModule {
    /// Every module, in the order the slot layout walks them.
    ///
    /// The fused modules come last, so every other module keeps the index
    /// it had before them (the peer protocol names modules by index).
    pub const ALL: [LoraModule; 18] = [
        LoraModule::QProj,
        LoraModule::KProj,
        LoraModule::VProj,
        LoraModule::OProj,
        LoraModule::QAProj,
        LoraModule::QBProj,
        LoraModule::KvAProjWithMqa,
        LoraModule::KvBProj,
        LoraModule::LinearAttnOutProj,
        LoraModule::GateProj,
        LoraModule::UpProj,
        LoraModule::DownProj,
        LoraModule::SharedGateProj,
        LoraModule::SharedUpProj,
        LoraModule::SharedDownProj,
        LoraModule::SharedExpertGate,
        LoraModule::QkvProj,
        LoraModule::GateUpProj,
    ];

    /// Position in [`LoraModule::ALL`]; dense indices for per-module tables.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The module's path inside a decoder layer for `family`, e.g.
    /// `self_attn.q_proj` or `mlp.shared_experts.down_proj`.
    pub fn path(self, family: ModelFamily) -> &'static str {
        let plural = matches!(family, ModelFamily::DeepseekV3 | ModelFamily::Glm4Moe);
        match self {
            LoraModule::QProj => "self_attn.q_proj",
            LoraModule::KProj => "self_attn.k_proj",
            LoraModule::VProj => "self_attn.v_proj",
            LoraModule::OProj => "self_attn.o_proj",
            LoraModule::QAProj => "self_attn.q_a_proj",
            LoraModule::QBProj => "self_attn.q_b_proj",
            LoraModule::KvAProjWithMqa => "self_attn.kv_a_proj_with_mqa",
            LoraModule::KvBProj => "self_attn.kv_b_proj",
            LoraModule::LinearAttnOutProj => "linear_attn.out_proj",
            LoraModule::GateProj => "mlp.gate_proj",
            LoraModule::UpProj => "mlp.up_proj",
            LoraModule::DownProj => "mlp.down_proj",
            LoraModule::SharedGateProj if plural => "mlp.shared_experts.gate_proj",
            LoraModule::SharedUpProj if plural => "mlp.shared_experts.up_proj",
            LoraModule::SharedDownProj if plural => "mlp.shared_experts.down_proj",
            LoraModule::SharedGateProj => "mlp.shared_expert.gate_proj",
            LoraModule::SharedUpProj => "mlp.shared_expert.up_proj",
            LoraModule::SharedDownProj => "mlp.shared_expert.down_proj",
            LoraModule::SharedExpertGate => "mlp.shared_expert_gate",
            LoraModule::QkvProj => "self_attn.qkv_proj",
            LoraModule::GateUpProj => "mlp.gate_up_proj",
        }
    }

    /// The module whose [`LoraModule::path`] for `family` is `path`.
    pub fn from_path(family: ModelFamily, path: &str) -> Option<LoraModule> {
        LoraModule::ALL.into_iter().find(|m| m.path(family) == path)
    }

    /// The last component of the module path (`q_proj`, `out_proj`,
    /// `shared_expert_gate`), which PEFT `target_modules` lists name.
    pub fn short_name(self) -> &'static str {
        let path = self.path(ModelFamily::Llama);
        path.rsplit('.').next().unwrap_or(path)
    }

    /// `(out, in)` of the projection's weight for `cfg`. Zero dims for a
    /// module the model family does not have (see [`applies_to_layer`]).
    ///
    /// [`applies_to_layer`]: LoraModule::applies_to_layer
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let h = cfg.hidden_size;
        let heads = cfg.num_attention_heads;
        let q_width = heads * cfg.head_dim;
        let kv_width = cfg.num_key_value_heads * cfg.head_dim;
        let mla = cfg.mla.as_ref();
        let shared = cfg
            .moe
            .as_ref()
            .and_then(|m| m.shared_expert_intermediate_size)
            .unwrap_or(0);
        match self {
            LoraModule::QProj => match (cfg.family, mla) {
                (ModelFamily::Qwen3Next, _) => (2 * q_width, h),
                (_, Some(m)) => (heads * m.qk_head_dim(), h),
                _ => (q_width, h),
            },
            LoraModule::KProj | LoraModule::VProj => (kv_width, h),
            LoraModule::OProj => match mla {
                Some(m) => (h, heads * m.v_head_dim),
                None => (h, q_width),
            },
            LoraModule::QAProj => (mla.and_then(|m| m.q_lora_rank).unwrap_or(0), h),
            LoraModule::QBProj => match mla {
                Some(m) => (heads * m.qk_head_dim(), m.q_lora_rank.unwrap_or(0)),
                None => (0, 0),
            },
            LoraModule::KvAProjWithMqa => match mla {
                Some(m) => (m.kv_lora_rank + m.qk_rope_head_dim, h),
                None => (0, 0),
            },
            LoraModule::KvBProj => match mla {
                Some(m) => (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                None => (0, 0),
            },
            LoraModule::LinearAttnOutProj => match &cfg.linear_attn {
                Some(l) => (h, l.num_value_heads * l.value_head_dim),
                None => (0, 0),
            },
            LoraModule::GateProj | LoraModule::UpProj => (cfg.intermediate_size, h),
            LoraModule::DownProj => (h, cfg.intermediate_size),
            LoraModule::SharedGateProj | LoraModule::SharedUpProj => (shared, h),
            LoraModule::SharedDownProj => (h, shared),
            LoraModule::SharedExpertGate => (1, h),
            LoraModule::QkvProj => (q_width + 2 * kv_width, h),
            LoraModule::GateUpProj => (2 * cfg.intermediate_size, h),
        }
    }

    /// Whether layer `layer` of `cfg` has this projection.
    pub fn applies_to_layer(self, cfg: &ModelConfig, layer: usize) -> bool {
        if layer >= cfg.num_hidden_layers {
            return false;
        }
        let full_attn = cfg.layer_kind(layer) == LayerKind::FullAttention;
        let mla = cfg.mla.as_ref();
        let moe_layer = cfg.is_moe_layer(layer);
        let has_shared = cfg
            .moe
            .as_ref()
            .is_some_and(|m| m.shared_expert_intermediate_size.is_some());
        let fused = fuses_qkv_and_gate_up(cfg.family);
        match self {
            LoraModule::QProj => full_attn && !fused && mla.is_none_or(|m| m.q_lora_rank.is_none()),
            LoraModule::KProj | LoraModule::VProj => full_attn && !fused && mla.is_none(),
            LoraModule::OProj => full_attn,
            LoraModule::QAProj | LoraModule::QBProj => mla.is_some_and(|m| m.q_lora_rank.is_some()),
            LoraModule::KvAProjWithMqa | LoraModule::KvBProj => mla.is_some(),
            LoraModule::LinearAttnOutProj => cfg.linear_attn.is_some() && !full_attn,
            LoraModule::GateProj | LoraModule::UpProj => !moe_layer && !fused,
            LoraModule::DownProj => !moe_layer,
            LoraModule::SharedGateProj | LoraModule::SharedUpProj | LoraModule::SharedDownProj => {
                moe_layer && has_shared
            }
            LoraModule::SharedExpertGate => moe_layer && cfg.moe.as_ref().is_some_and(|m| m.shared_expert_gate),
            LoraModule::QkvProj => full_attn && fused,
            LoraModule::GateUpProj => !moe_layer && fused,
        }
    }

    /// The modules whose deltas make up an attention layer's fused
    /// `q | k | v` output, in column order: `[QkvProj]` for a family whose
    /// checkpoint fuses them (Phi-3), else `[QProj, KProj, VProj]`. Every
    /// apply of the qkv site (the pool's `FusedTargets::qkv`, the engines)
    /// reads it from here.
    pub fn qkv(family: ModelFamily) -> &'static [LoraModule] {
        if fuses_qkv_and_gate_up(family) {
            &[LoraModule::QkvProj]
        } else {
            &[LoraModule::QProj, LoraModule::KProj, LoraModule::VProj]
        }
    }

    /// The modules whose deltas make up a dense MLP's fused `gate | up`
    /// output, in column order: `[GateUpProj]` for Phi-3, else
    /// `[GateProj, UpProj]`.
    pub fn gate_up(family: ModelFamily) -> &'static [LoraModule] {
        if fuses_qkv_and_gate_up(family) {
            &[LoraModule::GateUpProj]
        } else {
            &[LoraModule::GateProj, LoraModule::UpProj]
        }
    }
}

/// Whether the family's checkpoints fuse q/k/v into `qkv_proj` and gate/up
/// into `gate_up_proj` (Phi-3 / Phi-4).
fn fuses_qkv_and_gate_up(family: ModelFamily) -> bool {
    family == ModelFamily::Phi3
}

impl std::fmt::Display for LoraModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.short_name())
    }
}

/// The global indices of the full-attention layers.
pub fn full_attention_layers(cfg: &ModelConfig) -> Vec<usize> {
    (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.layer_kind(l) == LayerKind::FullAttention)
        .collect()
}

/// `(out, in)` of the router (`mlp.gate`, Mixtral `block_sparse_moe.gate`,
/// gpt_oss `mlp.router`):
/// `(num_experts, hidden)`. `None` for a dense model. Its delta is added to
/// the routing logits before top-k.
pub fn router_dims(cfg: &ModelConfig) -> Option<(usize, usize)> {
    cfg.moe.as_ref().map(|m| (m.num_experts, cfg.hidden_size))
}

/// A routed-expert projection. The transformers 5.x fused `gate_up_proj`
/// parameter holds both Gate and Up outputs, in the family's
/// [`GateUpLayout`]; lora-audit splits its deltas into a `Gate` and an `Up`
/// pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertProj {
    /// `gate_proj` (Mixtral `w1`): `(expert_inter, hidden)`.
    Gate,
    /// `up_proj` (Mixtral `w3`): `(expert_inter, hidden)`.
    Up,
    /// `down_proj` (Mixtral `w2`): `(hidden, expert_inter)`.
    Down,
}

impl ExpertProj {
    /// Every expert projection, in pool order.
    pub const ALL: [ExpertProj; 3] = [ExpertProj::Gate, ExpertProj::Up, ExpertProj::Down];

    /// Position in [`ExpertProj::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// `(out, in)` of one expert's projection weight. `None` for a dense model.
    pub fn dims(self, cfg: &ModelConfig) -> Option<(usize, usize)> {
        let moe = cfg.moe.as_ref()?;
        let inter = moe.expert_intermediate_size;
        Some(match self {
            ExpertProj::Gate | ExpertProj::Up => (inter, cfg.hidden_size),
            ExpertProj::Down => (cfg.hidden_size, inter),
        })
    }

    /// The projection's name in transformers 4.x per-expert modules.
    pub fn name(self) -> &'static str {
        match self {
            ExpertProj::Gate => "gate_proj",
            ExpertProj::Up => "up_proj",
            ExpertProj::Down => "down_proj",
        }
    }
}

/// How a family's transformers 5.x fused expert `gate_up_proj` parameter
/// orders the Gate and Up outputs along its output dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GateUpLayout {
    /// Gate outputs `0..inter`, then Up outputs `inter..2·inter` (the
    /// forward's `chunk(2)`): every family but gpt_oss.
    Halves,
    /// gpt_oss: Gate output `j` at `2j`, Up output `j` at `2j + 1` (the
    /// forward's `gate_up[..., ::2]` and `gate_up[..., 1::2]`).
    Interleaved,
}

impl GateUpLayout {
    /// The layout of `family`'s fused `gate_up_proj`.
    pub fn of(family: ModelFamily) -> GateUpLayout {
        match family {
            ModelFamily::GptOss => GateUpLayout::Interleaved,
            _ => GateUpLayout::Halves,
        }
    }

    /// The output index within the fused `gate_up_proj` of `proj`'s output
    /// `j` (`j < inter`). `Down` has a parameter of its own: `j`.
    pub fn column(self, proj: ExpertProj, j: usize, inter: usize) -> usize {
        match (self, proj) {
            (_, ExpertProj::Down) => j,
            (GateUpLayout::Halves, ExpertProj::Gate) => j,
            (GateUpLayout::Halves, ExpertProj::Up) => inter + j,
            (GateUpLayout::Interleaved, ExpertProj::Gate) => 2 * j,
            (GateUpLayout::Interleaved, ExpertProj::Up) => 2 * j + 1,
        }
    }
}

impl std::fmt::Display for ExpertProj {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where an expert-pool pair acts: one routed expert's projection, or the
/// router of an MoE layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertSite {
    /// Routed expert `expert`'s projection `proj`.
    Expert {
        /// The expert index, `< num_experts`.
        expert: usize,
        /// Which projection.
        proj: ExpertProj,
    },
    /// The router (`mlp.gate`).
    Router,
}

impl ExpertSite {
    /// `(out, in)` of the site's weight, or `None` when the model has no such
    /// site (dense model, expert index out of range).
    pub fn dims(self, cfg: &ModelConfig) -> Option<(usize, usize)> {
        match self {
            ExpertSite::Expert { expert, proj } => {
                let moe = cfg.moe.as_ref()?;
                (expert < moe.num_experts).then(|| proj.dims(cfg)).flatten()
            }
            ExpertSite::Router => router_dims(cfg),
        }
    }
}

#[cfg(test)]
mod tests;
