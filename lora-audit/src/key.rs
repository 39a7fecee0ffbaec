//! PEFT tensor names → (layer, target, A or B), for both transformers
//! expert formats; and the base model's own weight names, which the probe
//! reads, through the same in-layer path resolution.
//!
//! Whatever precedes `layers.{i}.` is ignored, so `model.layers.{i}.*`,
//! `model.language_model.layers.{i}.*` and keys without the
//! `base_model.model.` prefix all parse — unless a component of the path
//! names another tower of a multimodal wrapper ([`non_text_tower`]): the
//! Gemma 3 wrapper's vision encoder is `model.vision_tower.encoder.layers.{i}`
//! with its own `self_attn.q_proj`, which must never be taken for the text
//! decoder's layer `i` (`REJECT[vision-tower]`).

use lora_layout::{ExpertProj, LayerKind, LoraModule, ModelConfig, ModelFamily};

use crate::error::{Refusal, RejectCode};

/// Which factor of a pair a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AdapterAb {
    /// `lora_A`: `[r, in]`.
    A,
    /// `lora_B`: `[out, r]`.
    B,
}

/// Which wrapper of a transformers 5.x fused experts module a key belongs
/// to. PEFT nests one `ParamWrapper` per targeted parameter; the one
/// registered first is innermost (`experts.base_layer.lora_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FusedWrapper {
    /// `…experts.lora_A.weight`.
    Outer,
    /// `…experts.base_layer.lora_A.weight`.
    Inner,
    /// `…experts.base_layer.base_layer….lora_A.weight`: a wrapper `depth`
    /// (2 or 3) `base_layer`s deep, when three or four parameters of
    /// gpt_oss's experts are targeted (its expert biases too); other
    /// families' experts have two parameters.
    Nested {
        /// The number of `base_layer`s.
        depth: usize,
    },
}

/// The decoded target of one PEFT LoRA tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraTarget {
    /// A dense projection of the slot pool.
    Dense(LoraModule),
    /// One routed expert's projection (transformers 4.x per-expert modules,
    /// Mixtral `w1`/`w3`/`w2`).
    Expert {
        /// The expert index.
        expert: usize,
        /// The projection.
        proj: ExpertProj,
    },
    /// A transformers 5.x fused experts parameter (`gate_up_proj` or
    /// `down_proj`, decided from the pair's shapes).
    FusedExperts(FusedWrapper),
    /// The router (`mlp.gate`, Mixtral `block_sparse_moe.gate`).
    Router,
}

impl LoraTarget {
    /// Whether the pair lives in the expert/router pool.
    pub fn is_expert(self) -> bool {
        !matches!(self, LoraTarget::Dense(_))
    }
}

/// A classified LoRA pair tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraKey {
    /// Global layer index.
    pub layer: usize,
    /// What it adapts.
    pub target: LoraTarget,
    /// A or B.
    pub ab: AdapterAb,
    /// The module path PEFT matched patterns against: the key without the
    /// `base_model.model.` prefix and the `.lora_X.weight` suffix (for fused
    /// experts, the container path; the parameter name is added once the
    /// shapes tell which parameter it is).
    pub module_path: String,
}

/// Split `path` at its layer list: `(prefix, layer, rest)` for
/// `prefix.layers.{i}.rest` or `layers.{i}.rest`. `None` without a layer
/// index, or with one that does not fit `usize`.
pub fn split_layer_path(path: &str) -> Option<(&str, usize, &str)> {
    // A walk over the dot-separated segments (no substring searcher: this
    // runs for every tensor of every swap).
    let bytes = path.as_bytes();
    let mut start = 0;
    loop {
        let end = bytes[start..]
            .iter()
            .position(|&b| b == b'.')
            .map_or(bytes.len(), |i| start + i);
        if end == bytes.len() {
            return None;
        }
        if &bytes[start..end] == b"layers" {
            let after = &path[end + 1..];
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            if digits > 0 && after.as_bytes().get(digits) == Some(&b'.') {
                let layer = after[..digits].parse::<usize>().ok()?;
                let prefix = path[..start].strip_suffix('.').unwrap_or("");
                return Some((prefix, layer, &after[digits + 1..]));
            }
        }
        start = end + 1;
    }
}

/// Name fragments of the towers of multimodal wrappers other than the text
/// decoder, as transformers 5.17 names their modules: Gemma 3
/// `model.vision_tower`, `model.multi_modal_projector`; LLaVA
/// `vision_tower`; Qwen-VL `visual`; audio / video encoders.
const NON_TEXT_TOWER_FRAGMENTS: [&str; 7] = [
    "vision",
    "visual",
    "image",
    "audio",
    "video",
    "multi_modal",
    "mm_projector",
];

/// The first dot-separated component of a module path that names a tower of
/// a multimodal wrapper other than its text decoder (`vision_tower`,
/// `multi_modal_projector`, `visual`, ...), if any. No text-decoder module of
/// a supported family has such a component.
pub fn non_text_tower(path: &str) -> Option<&str> {
    path.split('.')
        .find(|c| NON_TEXT_TOWER_FRAGMENTS.iter().any(|f| c.contains(f)))
}

/// Whether `key` names a `linear_attn.*` tensor other than
/// `linear_attn.out_proj`: the gated-delta-net inputs, which cannot take a
/// delta (`REJECT[gdn-target]`; skipped under `allow_partial`).
pub fn is_gdn_key(key: &str) -> bool {
    split_layer_path(key).is_some_and(|(_, _, rest)| {
        rest.strip_prefix("linear_attn.")
            .is_some_and(|r| !r.starts_with("out_proj.") && r != "out_proj")
    })
}

/// What an in-layer module path (`self_attn.q_proj`, `mlp.experts.3.w1`, ...)
/// names in a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerModule {
    Dense(LoraModule),
    Expert {
        expert: usize,
        proj: ExpertProj,
    },
    /// The fused experts container (`mlp.experts`).
    ExpertsContainer,
    Router,
}

/// The MoE block paths of a family, `(experts container, router)`, one per
/// transformers generation that names them differently: Mixtral's block is
/// `block_sparse_moe` in 4.x and `mlp` in 5.x.
fn moe_blocks(family: ModelFamily) -> &'static [(&'static str, &'static str)] {
    match family {
        ModelFamily::Mixtral => &[
            ("block_sparse_moe.experts", "block_sparse_moe.gate"),
            ("mlp.experts", "mlp.gate"),
        ],
        // gpt_oss's router is `mlp.router` (weight and bias parameters).
        ModelFamily::GptOss => &[("mlp.experts", "mlp.router")],
        _ => &[("mlp.experts", "mlp.gate")],
    }
}

/// Whether `path` is an experts container of `family`.
fn is_experts_container(family: ModelFamily, path: &str) -> bool {
    moe_blocks(family).iter().any(|(experts, _)| *experts == path)
}

/// The per-expert projection names of a family (transformers 4.x).
fn expert_proj_of(family: ModelFamily, name: &str) -> Option<ExpertProj> {
    match (family, name) {
        (ModelFamily::Mixtral, "w1") => Some(ExpertProj::Gate),
        (ModelFamily::Mixtral, "w3") => Some(ExpertProj::Up),
        (ModelFamily::Mixtral, "w2") => Some(ExpertProj::Down),
        (ModelFamily::Mixtral, _) => None,
        (_, "gate_proj") => Some(ExpertProj::Gate),
        (_, "up_proj") => Some(ExpertProj::Up),
        (_, "down_proj") => Some(ExpertProj::Down),
        _ => None,
    }
}

/// Resolve an in-layer module path for layer `layer`, checking that the
/// model has it there. `subject` names the tensor in refusals.
pub(crate) fn resolve_layer_module(
    cfg: &ModelConfig,
    layer: usize,
    rest: &str,
    subject: &str,
) -> Result<LayerModule, Refusal> {
    let mismatch = |why: String| Refusal::new(RejectCode::ModelMismatch, subject, why);
    if layer >= cfg.num_hidden_layers {
        return Err(mismatch(format!(
            "layer {layer} does not exist (the model has {} layers)",
            cfg.num_hidden_layers
        )));
    }
    if let Some(module) = LoraModule::from_path(cfg.family, rest) {
        if !module.applies_to_layer(cfg, layer) {
            return Err(mismatch(format!(
                "layer {layer} ({}) of this {} model has no {rest}",
                layer_kind_name(cfg, layer),
                cfg.family.model_type()
            )));
        }
        return Ok(LayerModule::Dense(module));
    }
    if rest.starts_with("linear_attn.") {
        return Err(Refusal::new(
            RejectCode::GdnTarget,
            subject,
            format!("{rest} is a gated-delta-net input projection; only linear_attn.out_proj can take a delta"),
        ));
    }
    let blocks = moe_blocks(cfg.family);
    let is_moe = cfg.family.is_moe();
    let moe_layer = || {
        if cfg.is_moe_layer(layer) {
            Ok(())
        } else {
            Err(mismatch(format!("layer {layer} of this model has no routed experts")))
        }
    };
    if is_moe && blocks.iter().any(|(_, router)| rest == *router) {
        moe_layer()?;
        return Ok(LayerModule::Router);
    }
    if is_moe && is_experts_container(cfg.family, rest) {
        moe_layer()?;
        return Ok(LayerModule::ExpertsContainer);
    }
    let per_expert = blocks.iter().find_map(|(experts, _)| {
        let (index, name) = rest.strip_prefix(experts)?.strip_prefix('.')?.split_once('.')?;
        Some((index.parse::<usize>().ok()?, expert_proj_of(cfg.family, name)?))
    });
    if let (true, Some((expert, proj))) = (is_moe, per_expert) {
        moe_layer()?;
        let n = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
        if expert >= n {
            return Err(mismatch(format!("expert {expert} does not exist (the model has {n})")));
        }
        return Ok(LayerModule::Expert { expert, proj });
    }
    Err(Refusal::new(
        RejectCode::UnsupportedTarget,
        subject,
        format!("{rest} is not a projection the engine applies LoRA to"),
    ))
}

/// PEFT tensor name → (layer, target, A or B). Every name it cannot place is
/// a refusal naming the tensor and the reason (`REJECT[...]`), never a skip;
/// the audit decides which refusals `allow_partial` may skip. Overlay tensors
/// are classified by [`classify_overlay_key`](crate::classify_overlay_key)
/// first; here they are not LoRA pairs.
pub fn classify_key(key: &str, cfg: &ModelConfig) -> Result<LoraKey, Refusal> {
    let refuse = |code, why: &str| Refusal::new(code, key, why);
    if key.chars().any(char::is_control) {
        return Err(refuse(RejectCode::UnknownKey, "the name contains a control character"));
    }
    let path = key.strip_prefix("base_model.model.").unwrap_or(key);
    let (module_path, ab) = if let Some(p) = path.strip_suffix(".lora_A.weight") {
        (p, AdapterAb::A)
    } else if let Some(p) = path.strip_suffix(".lora_B.weight") {
        (p, AdapterAb::B)
    } else {
        return Err(non_pair_refusal(key, path));
    };
    let layered = split_layer_path(module_path);
    // A tower is named before its layer list (the whole path where it has
    // none): only that part is searched, once per tensor of every swap.
    let outside_layers = layered.map_or(module_path, |(prefix, _, _)| prefix);
    if let Some(tower) = non_text_tower(outside_layers) {
        return Err(refuse(
            RejectCode::VisionTower,
            &format!(
                "`{module_path}` is in the wrapper's `{tower}`, not its text decoder; only the text decoder takes deltas"
            ),
        ));
    }
    let Some((_, layer, rest)) = layered else {
        return Err(refuse(
            RejectCode::UnsupportedTarget,
            &format!("`{module_path}` is not inside a decoder layer; only layer projections take a LoRA pair"),
        ));
    };
    // 5.x fused experts: the container, or a wrapper nested in it (one
    // deep: the experts have two parameters; gpt_oss's have four, its
    // biases included).
    let (container, depth) = strip_base_layers(rest);
    let max_depth = if cfg.family == ModelFamily::GptOss { 3 } else { 1 };
    let inner = (depth > 0 && depth <= max_depth && is_experts_container(cfg.family, container)).then_some(container);
    let target = match resolve_layer_module(cfg, layer, inner.unwrap_or(rest), key)? {
        LayerModule::Dense(m) if inner.is_none() => LoraTarget::Dense(m),
        LayerModule::Expert { expert, proj } if inner.is_none() => LoraTarget::Expert { expert, proj },
        LayerModule::Router if inner.is_none() => LoraTarget::Router,
        LayerModule::ExpertsContainer if inner.is_some() => LoraTarget::FusedExperts(match depth {
            1 => FusedWrapper::Inner,
            depth => FusedWrapper::Nested { depth },
        }),
        LayerModule::ExpertsContainer => LoraTarget::FusedExperts(FusedWrapper::Outer),
        _ => {
            return Err(refuse(
                RejectCode::UnsupportedTarget,
                &format!("`{rest}` is not a projection the engine applies LoRA to"),
            ));
        }
    };
    Ok(LoraKey {
        layer,
        target,
        ab,
        module_path: module_path.to_string(),
    })
}

/// `path` without its trailing `.base_layer`s, and how many there were.
pub(crate) fn strip_base_layers(path: &str) -> (&str, usize) {
    let (mut path, mut depth) = (path, 0);
    while let Some(inner) = path.strip_suffix(".base_layer") {
        path = inner;
        depth += 1;
    }
    (path, depth)
}

/// The refusal for a tensor that is not a `lora_A/B.weight`.
fn non_pair_refusal(key: &str, path: &str) -> Refusal {
    let refuse = |code, why: &str| Refusal::new(code, key, why);
    if path.ends_with(".lora_B.bias") || path.ends_with(".lora_A.bias") {
        refuse(RejectCode::LoraBias, "a LoRA bias term; the pool has no bias space")
    } else if path.ends_with(".lora_magnitude_vector") || path.contains(".lora_magnitude_vector.") {
        refuse(
            RejectCode::Dora,
            "a DoRA magnitude vector; DoRA needs the base weight's norms",
        )
    } else if path.ends_with(".lora_embedding_A") || path.ends_with(".lora_embedding_B") {
        refuse(
            RejectCode::EmbeddingLora,
            "LoRA on an embedding other than the input embedding (embed_tokens)",
        )
    } else if path.ends_with(".bias") || path.ends_with("_bias") {
        // `_bias`: gpt_oss's expert bias parameters (`gate_up_proj_bias`).
        refuse(RejectCode::Bias, "an absolute base bias saved by `bias != \"none\"`")
    } else {
        refuse(RejectCode::UnknownKey, "not a PEFT LoRA tensor name")
    }
}

/// The layer kind, for messages that explain a missing module.
fn layer_kind_name(cfg: &ModelConfig, layer: usize) -> &'static str {
    match cfg.layer_kind(layer) {
        LayerKind::FullAttention => "full-attention",
        LayerKind::LinearAttention => "linear-attention",
    }
}

#[cfg(test)]
mod tests;
