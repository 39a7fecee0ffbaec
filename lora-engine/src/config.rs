//! The base model's geometry, read from a Hugging Face `config.json`.
//!
//! [`BaseConfig`] is what transformers 5 would build from the same file for the
//! six supported families: every default is the family's own (`rms_norm_eps`
//! 1e-5 for Mixtral, `num_key_value_heads` 8 for Mistral, `head_dim` 128 for
//! Qwen3, ...), the RoPE base comes from `rope_parameters` (transformers 5),
//! `rope_scaling` or a top-level `rope_theta`, and the per-layer structure
//! (dense MLP or MoE block, sliding window) is resolved here once.
//!
//! This module must never read tensors or guess: a field of the wrong type, a
//! value out of range, an activation other than SiLU or a RoPE type other than
//! `default` is a typed error naming the field.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::EngineError;

/// A supported model family (`model_type` in `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `llama`: optional `attention_bias` (q, k, v, o) and `mlp_bias`.
    Llama,
    /// `mistral`: no biases; `sliding_window` on every layer.
    Mistral,
    /// `qwen2`: q/k/v biases always, no o bias; optional sliding layers.
    Qwen2,
    /// `qwen3`: per-head `q_norm`/`k_norm` before RoPE; optional `attention_bias`.
    Qwen3,
    /// `qwen3_moe`: Qwen3 attention, sparse MoE blocks on some layers.
    Qwen3Moe,
    /// `mixtral`: Mistral attention, an MoE block on every layer.
    Mixtral,
}

impl Family {
    /// The `model_type` string of the family.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mixtral => "mixtral",
        }
    }

    fn from_model_type(model_type: &str) -> Option<Self> {
        Some(match model_type {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "qwen3_moe" => Family::Qwen3Moe,
            "mixtral" => Family::Mixtral,
            _ => return None,
        })
    }

    /// Whether the family's layers can hold sparse MoE blocks.
    pub fn is_moe(self) -> bool {
        matches!(self, Family::Qwen3Moe | Family::Mixtral)
    }
}

/// What a decoder layer's feed-forward part is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MlpKind {
    /// `down(silu(gate(x)) * up(x))` with `intermediate_size`; hooks `gate_up` and `down`.
    Dense,
    /// Router plus routed experts with `moe_inter`; hooks `router`, `expert_gate_up`, `expert_down`.
    Moe,
}

/// The routed-expert geometry of an MoE model.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_experts` / `num_local_experts`).
    pub num_experts: usize,
    /// Experts chosen per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's intermediate size (`moe_intermediate_size`; Mixtral: `intermediate_size`).
    pub moe_inter: usize,
    /// Whether the top-k probabilities are renormalized to sum to one
    /// (`norm_topk_prob` for Qwen3-MoE; always for Mixtral).
    pub norm_topk_prob: bool,
}

/// One decoder layer's structure.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LayerConfig {
    /// Dense MLP or MoE block.
    pub mlp: MlpKind,
    /// `Some(w)`: a query at position `p` sees keys at positions `> p - w` only.
    pub sliding_window: Option<usize>,
}

/// The geometry and numerics of a base model, as transformers resolves them.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BaseConfig {
    /// The family.
    pub family: Family,
    /// `vocab_size`.
    pub vocab: usize,
    /// `hidden_size`.
    pub hidden: usize,
    /// `num_attention_heads`.
    pub n_heads: usize,
    /// `num_key_value_heads` (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head width (explicit `head_dim` or `hidden / n_heads`).
    pub head_dim: usize,
    /// Dense MLP `intermediate_size`.
    pub inter: usize,
    /// `num_hidden_layers` (the length of `layers`).
    pub n_layers: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// The RoPE base.
    pub rope_theta: f64,
    /// `tie_word_embeddings`: the lm_head may be the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q, k and v projections carry a bias.
    pub qkv_bias: bool,
    /// Whether the o projection carries a bias.
    pub o_bias: bool,
    /// Whether the dense MLP projections carry a bias (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// Whether attention applies per-head RMSNorm (`q_norm`, `k_norm`) before RoPE.
    pub qk_norm: bool,
    /// Routed-expert geometry; `Some` iff at least one layer is [`MlpKind::Moe`].
    pub moe: Option<MoeConfig>,
    /// Per-layer structure, `n_layers` long.
    pub layers: Vec<LayerConfig>,
}

impl BaseConfig {
    /// Reads and resolves `path` (a `config.json`).
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Resolves a `config.json` text; `path` only labels errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self, EngineError> {
        let value: Value = serde_json::from_str(text).map_err(|source| EngineError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Some(obj) = value.as_object() else {
            return Err(field_err(path, "<root>", "config.json is not a JSON object"));
        };
        resolve(&Fields { obj, path }, path)
    }

    /// Width of the fused q columns (`n_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of the k (and of the v) columns (`n_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Width of the fused q|k|v output the `qkv` hook sees.
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// The feed-forward kind of `layer`; `None` past the last layer.
    pub fn mlp_kind(&self, layer: usize) -> Option<MlpKind> {
        self.layers.get(layer).map(|l| l.mlp)
    }

    /// Indices of the MoE layers, ascending.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&i| self.layers[i].mlp == MlpKind::Moe)
            .collect()
    }
}

fn field_err(path: &Path, field: &str, reason: impl Into<String>) -> EngineError {
    EngineError::ConfigField {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// Typed access to the fields of one JSON object; `null` reads as absent,
/// as transformers treats it for every field used here.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn err(&self, name: &str, reason: impl Into<String>) -> EngineError {
        field_err(self.path, name, reason)
    }

    fn usize_opt(&self, name: &str) -> Result<Option<usize>, EngineError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => as_usize(v)
                .map(Some)
                .ok_or_else(|| self.err(name, format!("expected a non-negative integer, found {v}"))),
        }
    }

    fn usize_req(&self, name: &str) -> Result<usize, EngineError> {
        self.usize_opt(name)?.ok_or_else(|| self.err(name, "missing"))
    }

    fn positive(&self, name: &str, value: usize) -> Result<usize, EngineError> {
        if value == 0 {
            return Err(self.err(name, "must be at least 1"));
        }
        Ok(value)
    }

    fn f64_opt(&self, name: &str) -> Result<Option<f64>, EngineError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(name, format!("expected a number, found {v}"))),
        }
    }

    fn bool_opt(&self, name: &str) -> Result<Option<bool>, EngineError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(name, format!("expected true or false, found {v}"))),
        }
    }

    fn str_opt(&self, name: &str) -> Result<Option<&str>, EngineError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(name, format!("expected a string, found {v}"))),
        }
    }

    fn usize_list_opt(&self, name: &str) -> Result<Option<Vec<usize>>, EngineError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let Some(items) = v.as_array() else {
            return Err(self.err(name, format!("expected a list of integers, found {v}")));
        };
        items
            .iter()
            .map(|item| {
                as_usize(item).ok_or_else(|| self.err(name, format!("expected non-negative integers, found {item}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    fn str_list_opt(&self, name: &str) -> Result<Option<Vec<&str>>, EngineError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let Some(items) = v.as_array() else {
            return Err(self.err(name, format!("expected a list of strings, found {v}")));
        };
        items
            .iter()
            .map(|item| {
                item.as_str()
                    .ok_or_else(|| self.err(name, format!("expected strings, found {item}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|u| usize::try_from(u).ok())
}

/// The class defaults of one family's transformers config.
struct Defaults {
    n_kv_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: f64,
    rope_theta: f64,
}

fn defaults(family: Family) -> Defaults {
    match family {
        Family::Llama => Defaults {
            n_kv_heads: None,
            head_dim: None,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
        },
        Family::Mistral => Defaults {
            n_kv_heads: Some(8),
            head_dim: None,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
        },
        Family::Qwen2 | Family::Qwen3 => Defaults {
            n_kv_heads: Some(32),
            head_dim: if family == Family::Qwen3 { Some(128) } else { None },
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
        },
        Family::Qwen3Moe => Defaults {
            n_kv_heads: Some(4),
            head_dim: None,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
        },
        Family::Mixtral => Defaults {
            n_kv_heads: Some(8),
            head_dim: None,
            rms_norm_eps: 1e-5,
            rope_theta: 1_000_000.0,
        },
    }
}

fn resolve(f: &Fields<'_>, path: &Path) -> Result<BaseConfig, EngineError> {
    let model_type = f.str_opt("model_type")?.ok_or_else(|| f.err("model_type", "missing"))?;
    let family = Family::from_model_type(model_type).ok_or_else(|| EngineError::UnsupportedFamily {
        path: path.to_path_buf(),
        model_type: model_type.to_string(),
    })?;
    let d = defaults(family);

    let vocab = f.positive("vocab_size", f.usize_req("vocab_size")?)?;
    let hidden = f.positive("hidden_size", f.usize_req("hidden_size")?)?;
    let inter = f.positive("intermediate_size", f.usize_req("intermediate_size")?)?;
    let n_layers = f.positive("num_hidden_layers", f.usize_req("num_hidden_layers")?)?;
    let n_heads = f.positive("num_attention_heads", f.usize_req("num_attention_heads")?)?;
    // A missing key takes the class default; an explicit null means "as many as heads".
    let n_kv_heads = match f.obj.get("num_key_value_heads") {
        Some(Value::Null) => n_heads,
        Some(_) => f.usize_req("num_key_value_heads")?,
        None => d.n_kv_heads.unwrap_or(n_heads),
    };
    let n_kv_heads = f.positive("num_key_value_heads", n_kv_heads)?;
    if n_heads % n_kv_heads != 0 {
        return Err(f.err(
            "num_key_value_heads",
            format!("{n_kv_heads} does not divide num_attention_heads {n_heads}"),
        ));
    }
    let head_dim = match f.usize_opt("head_dim")? {
        Some(0) | None => match (f.obj.contains_key("head_dim"), d.head_dim) {
            (false, Some(default)) => default,
            _ => hidden / n_heads,
        },
        Some(explicit) => explicit,
    };
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(f.err(
            "head_dim",
            format!("{head_dim} is not a positive even width (RoPE rotates halves)"),
        ));
    }

    let hidden_act = f.str_opt("hidden_act")?.unwrap_or("silu");
    if hidden_act != "silu" {
        return Err(f.err("hidden_act", format!("`{hidden_act}` is not supported (only silu)")));
    }
    let rms_norm_eps = f.f64_opt("rms_norm_eps")?.unwrap_or(d.rms_norm_eps);
    if !(rms_norm_eps.is_finite() && rms_norm_eps >= 0.0) {
        return Err(f.err(
            "rms_norm_eps",
            format!("{rms_norm_eps} is not a finite non-negative number"),
        ));
    }
    let rope_theta = rope_theta(f, path, d.rope_theta)?;
    let tie_word_embeddings = f.bool_opt("tie_word_embeddings")?.unwrap_or(false);

    let attention_bias = f.bool_opt("attention_bias")?.unwrap_or(false);
    let (qkv_bias, o_bias, mlp_bias) = match family {
        Family::Llama => (attention_bias, attention_bias, f.bool_opt("mlp_bias")?.unwrap_or(false)),
        Family::Qwen3 | Family::Qwen3Moe => (attention_bias, attention_bias, false),
        Family::Qwen2 => (true, false, false),
        Family::Mistral | Family::Mixtral => (false, false, false),
    };
    let qk_norm = matches!(family, Family::Qwen3 | Family::Qwen3Moe);

    let windows = sliding_windows(f, family, n_layers)?;
    let (moe, kinds) = moe_layout(f, family, n_layers, inter)?;
    let layers = kinds
        .into_iter()
        .zip(windows)
        .map(|(mlp, sliding_window)| LayerConfig { mlp, sliding_window })
        .collect();

    let cfg = BaseConfig {
        family,
        vocab,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        inter,
        n_layers,
        rms_norm_eps,
        rope_theta,
        tie_word_embeddings,
        qkv_bias,
        o_bias,
        mlp_bias,
        qk_norm,
        moe,
        layers,
    };
    check_sizes(f, &cfg)?;
    Ok(cfg)
}

/// The RoPE base, with transformers 5's precedence: `rope_scaling`, then
/// `rope_parameters` (their `rope_theta`), then a top-level `rope_theta`, then
/// the family default. Only `rope_type` `default` is accepted.
fn rope_theta(f: &Fields<'_>, path: &Path, default_theta: f64) -> Result<f64, EngineError> {
    let mut dict_field = "rope_parameters";
    let mut dict = None;
    for name in ["rope_scaling", "rope_parameters"] {
        if let Some(v) = f.get(name) {
            let Some(obj) = v.as_object() else {
                return Err(f.err(name, format!("expected an object, found {v}")));
            };
            if !obj.is_empty() {
                dict_field = name;
                dict = Some(obj);
                break;
            }
        }
    }
    let top_level = f.f64_opt("rope_theta")?;
    let theta = match dict {
        None => top_level.unwrap_or(default_theta),
        Some(obj) => {
            if obj.contains_key("full_attention") || obj.contains_key("sliding_attention") {
                return Err(f.err(dict_field, "RoPE parameters per layer type are not supported"));
            }
            let sub = Fields { obj, path: f.path };
            let rope_type = match sub.str_opt("rope_type")? {
                Some(t) => Some(t),
                None => sub.str_opt("type")?,
            };
            let rope_type = rope_type.unwrap_or("default");
            if rope_type != "default" {
                return Err(EngineError::UnsupportedRope {
                    path: path.to_path_buf(),
                    rope_type: rope_type.to_string(),
                });
            }
            match sub.get("rope_theta") {
                None => top_level.unwrap_or(default_theta),
                Some(v) => v.as_f64().ok_or_else(|| {
                    f.err(
                        &format!("{dict_field}.rope_theta"),
                        format!("expected a number, found {v}"),
                    )
                })?,
            }
        }
    };
    if !(theta.is_finite() && theta > 0.0) {
        return Err(f.err("rope_theta", format!("{theta} is not a finite positive number")));
    }
    Ok(theta)
}

/// Per-layer sliding windows, as each family's modeling code decides them.
fn sliding_windows(f: &Fields<'_>, family: Family, n_layers: usize) -> Result<Vec<Option<usize>>, EngineError> {
    // `sliding_window` as the config object holds it after `__post_init__`.
    let window = |default: Option<usize>| -> Result<Option<usize>, EngineError> {
        if f.obj.contains_key("sliding_window") {
            f.usize_opt("sliding_window")
        } else {
            Ok(default)
        }
    };
    let gated = |default: Option<usize>| -> Result<Option<usize>, EngineError> {
        if f.bool_opt("use_sliding_window")?.unwrap_or(false) {
            window(default)
        } else {
            Ok(None)
        }
    };
    let all = |w: Option<usize>| vec![w; n_layers];
    let windows = match family {
        Family::Llama => all(None),
        Family::Mistral => all(window(Some(4096))?),
        Family::Mixtral => all(window(None)?),
        Family::Qwen3Moe => all(gated(Some(4096))?),
        Family::Qwen2 | Family::Qwen3 => {
            let w = gated(Some(4096))?;
            match f.str_list_opt("layer_types")? {
                Some(types) => {
                    if types.len() != n_layers {
                        return Err(f.err("layer_types", format!("{} entries for {n_layers} layers", types.len())));
                    }
                    types
                        .iter()
                        .map(|t| match *t {
                            "full_attention" => Ok(None),
                            "sliding_attention" => Ok(w),
                            other => Err(f.err(
                                "layer_types",
                                format!("`{other}` is not full_attention or sliding_attention"),
                            )),
                        })
                        .collect::<Result<Vec<_>, _>>()?
                }
                None => {
                    let max_window_layers = f.usize_opt("max_window_layers")?.unwrap_or(28);
                    (0..n_layers)
                        .map(|i| if i >= max_window_layers { w } else { None })
                        .collect()
                }
            }
        }
    };
    if windows.contains(&Some(0)) {
        return Err(f.err("sliding_window", "must be at least 1"));
    }
    Ok(windows)
}

/// The MoE geometry and which layers hold MoE blocks.
fn moe_layout(
    f: &Fields<'_>,
    family: Family,
    n_layers: usize,
    inter: usize,
) -> Result<(Option<MoeConfig>, Vec<MlpKind>), EngineError> {
    let dense = || (None, vec![MlpKind::Dense; n_layers]);
    // Both names are one attribute in transformers (`attribute_map`); the
    // config class of each family saves `num_local_experts`.
    let num_experts = |default: usize| -> Result<(&'static str, usize), EngineError> {
        for name in ["num_experts", "num_local_experts"] {
            if let Some(n) = f.usize_opt(name)? {
                return Ok((name, n));
            }
        }
        Ok(("num_experts", default))
    };
    let (kinds, num_experts_field, num_experts, top_k, moe_inter, norm_topk_prob) = match family {
        Family::Qwen3Moe => {
            let (field, num_experts) = num_experts(128)?;
            if num_experts == 0 {
                return Ok(dense());
            }
            let step = f.usize_opt("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(f.err("decoder_sparse_step", "must be at least 1"));
            }
            let mlp_only = f.usize_list_opt("mlp_only_layers")?.unwrap_or_default();
            if let Some(bad) = mlp_only.iter().find(|&&l| l >= n_layers) {
                return Err(f.err(
                    "mlp_only_layers",
                    format!("layer {bad} is past num_hidden_layers {n_layers}"),
                ));
            }
            let kinds = (0..n_layers)
                .map(|i| {
                    if !mlp_only.contains(&i) && (i + 1) % step == 0 {
                        MlpKind::Moe
                    } else {
                        MlpKind::Dense
                    }
                })
                .collect::<Vec<_>>();
            let top_k = f.usize_opt("num_experts_per_tok")?.unwrap_or(8);
            let moe_inter = f.usize_opt("moe_intermediate_size")?.unwrap_or(768);
            f.positive("moe_intermediate_size", moe_inter)?;
            let norm = f.bool_opt("norm_topk_prob")?.unwrap_or(false);
            (kinds, field, num_experts, top_k, moe_inter, norm)
        }
        Family::Mixtral => {
            let (field, num_experts) = num_experts(8)?;
            f.positive(field, num_experts)?;
            let top_k = f.usize_opt("num_experts_per_tok")?.unwrap_or(2);
            (vec![MlpKind::Moe; n_layers], field, num_experts, top_k, inter, true)
        }
        _ => return Ok(dense()),
    };
    if top_k == 0 || top_k > num_experts {
        return Err(f.err(
            "num_experts_per_tok",
            format!("{top_k} is not between 1 and {num_experts_field} {num_experts}"),
        ));
    }
    if !kinds.contains(&MlpKind::Moe) {
        return Ok(dense());
    }
    Ok((
        Some(MoeConfig {
            num_experts,
            top_k,
            moe_inter,
            norm_topk_prob,
        }),
        kinds,
    ))
}

/// Every tensor size the model will allocate fits in `usize`.
fn check_sizes(f: &Fields<'_>, cfg: &BaseConfig) -> Result<(), EngineError> {
    let fits = |dims: &[usize]| dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_some();
    let checks: [(&str, Vec<usize>); 4] = [
        ("vocab_size", vec![cfg.vocab, cfg.hidden, 4]),
        (
            "head_dim",
            vec![cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim, cfg.hidden, 4],
        ),
        ("intermediate_size", vec![cfg.inter, 2, cfg.hidden, 4]),
        (
            "moe_intermediate_size",
            match &cfg.moe {
                Some(m) => vec![m.num_experts, m.moe_inter, 2, cfg.hidden, 4],
                None => vec![],
            },
        ),
    ];
    for (field, dims) in checks {
        if !fits(&dims) {
            return Err(f.err(field, format!("tensor of shape {dims:?} overflows")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<BaseConfig, EngineError> {
        BaseConfig::from_json_str(json, Path::new("test/config.json"))
    }

    const BASE: &str = r#""vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4"#;

    fn cfg(model_type: &str, extra: &str) -> Result<BaseConfig, EngineError> {
        let sep = if extra.is_empty() { "" } else { "," };
        parse(&format!(r#"{{"model_type": "{model_type}", {BASE}{sep} {extra}}}"#))
    }

    fn field_of(err: EngineError) -> String {
        match err {
            EngineError::ConfigField { field, .. } => field,
            other => format!("not a field error: {other}"),
        }
    }

    #[test]
    fn family_defaults_follow_transformers() -> Result<(), EngineError> {
        let llama = cfg("llama", "")?;
        assert_eq!((llama.n_kv_heads, llama.head_dim, llama.rope_theta), (4, 8, 10_000.0));
        assert!(!llama.qkv_bias && !llama.tie_word_embeddings);
        let mixtral = cfg("mixtral", r#""num_key_value_heads": 2"#)?;
        assert_eq!(mixtral.rms_norm_eps, 1e-5);
        assert_eq!(mixtral.rope_theta, 1_000_000.0);
        let moe = mixtral.moe.as_ref().map(|m| (m.num_experts, m.top_k, m.moe_inter));
        assert_eq!(moe, Some((8, 2, 48)));
        let qwen3 = cfg("qwen3", r#""num_key_value_heads": 2"#)?;
        assert_eq!(qwen3.head_dim, 128);
        assert!(qwen3.qk_norm);
        let qwen2 = cfg("qwen2", r#""num_key_value_heads": 2"#)?;
        assert!(qwen2.qkv_bias && !qwen2.o_bias);
        let mistral = cfg("mistral", r#""num_key_value_heads": 2"#)?;
        assert_eq!(mistral.layers[0].sliding_window, Some(4096));
        Ok(())
    }

    #[test]
    fn qwen3_moe_layer_selection() -> Result<(), EngineError> {
        let c = cfg(
            "qwen3_moe",
            r#""num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 16, "decoder_sparse_step": 2, "mlp_only_layers": [3]"#,
        )?;
        let kinds: Vec<_> = (0..4).map(|l| c.mlp_kind(l)).collect();
        use MlpKind::{Dense, Moe};
        assert_eq!(kinds, vec![Some(Dense), Some(Moe), Some(Dense), Some(Dense)]);
        assert_eq!(c.moe_layers(), vec![1]);
        assert_eq!(c.mlp_kind(4), None);
        // the saved name of the same attribute
        let saved = cfg(
            "qwen3_moe",
            r#""num_key_value_heads": 2, "num_local_experts": 6, "num_experts_per_tok": 2"#,
        )?;
        assert_eq!(saved.moe.map(|m| m.num_experts), Some(6));
        Ok(())
    }

    #[test]
    fn rope_sources_and_precedence() -> Result<(), EngineError> {
        let top = cfg("llama", r#""rope_theta": 500000.0"#)?;
        assert_eq!(top.rope_theta, 500_000.0);
        let nested = cfg(
            "llama",
            r#""rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}"#,
        )?;
        assert_eq!(nested.rope_theta, 20_000.0);
        let no_theta = cfg(
            "llama",
            r#""rope_theta": 3000.0, "rope_parameters": {"rope_type": "default"}"#,
        )?;
        assert_eq!(no_theta.rope_theta, 3000.0);
        let err = cfg(
            "llama",
            r#""rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}"#,
        );
        assert!(matches!(err, Err(EngineError::UnsupportedRope { rope_type, .. }) if rope_type == "llama3"));
        let legacy = cfg("llama", r#""rope_scaling": {"type": "linear", "factor": 2.0}"#);
        assert!(matches!(legacy, Err(EngineError::UnsupportedRope { rope_type, .. }) if rope_type == "linear"));
        Ok(())
    }

    #[test]
    fn qwen_sliding_layers() -> Result<(), EngineError> {
        let c = cfg(
            "qwen2",
            r#""num_key_value_heads": 2, "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 2"#,
        )?;
        let w: Vec<_> = c.layers.iter().map(|l| l.sliding_window).collect();
        assert_eq!(w, vec![None, None, Some(16), Some(16)]);
        let off = cfg(
            "qwen3",
            r#""num_key_value_heads": 2, "sliding_window": 16, "max_window_layers": 0"#,
        )?;
        assert!(off.layers.iter().all(|l| l.sliding_window.is_none()));
        Ok(())
    }

    #[test]
    fn bad_fields_are_named() {
        let cases: [(&str, &str, &str); 10] = [
            ("llama", r#""num_key_value_heads": 3"#, "num_key_value_heads"),
            ("llama", r#""hidden_act": "gelu""#, "hidden_act"),
            ("llama", r#""rms_norm_eps": "tiny""#, "rms_norm_eps"),
            ("llama", r#""head_dim": 7"#, "head_dim"),
            ("llama", r#""tie_word_embeddings": 1"#, "tie_word_embeddings"),
            (
                "mixtral",
                r#""num_key_value_heads": 2, "num_experts_per_tok": 9"#,
                "num_experts_per_tok",
            ),
            (
                "qwen3_moe",
                r#""num_key_value_heads": 2, "decoder_sparse_step": 0"#,
                "decoder_sparse_step",
            ),
            (
                "qwen3_moe",
                r#""num_key_value_heads": 2, "mlp_only_layers": [9]"#,
                "mlp_only_layers",
            ),
            (
                "mistral",
                r#""num_key_value_heads": 2, "sliding_window": 0"#,
                "sliding_window",
            ),
            ("llama", r#""vocab_size": -1"#, "vocab_size"),
        ];
        for (family, extra, field) in cases {
            // later keys win in serde_json maps, so `extra` may override BASE
            let json = format!(r#"{{"model_type": "{family}", {BASE}, {extra}}}"#);
            match parse(&json) {
                Err(e) => assert_eq!(field_of(e), field, "{json}"),
                Ok(_) => panic!("accepted {json}"),
            }
        }
        let missing = parse(r#"{"model_type": "llama", "hidden_size": 8}"#);
        assert!(matches!(missing, Err(EngineError::ConfigField { field, .. }) if field == "vocab_size"));
        let family = parse(r#"{"model_type": "gpt2"}"#);
        assert!(matches!(family, Err(EngineError::UnsupportedFamily { model_type, .. }) if model_type == "gpt2"));
        assert!(matches!(parse("[1]"), Err(EngineError::ConfigField { .. })));
        assert!(matches!(parse("{"), Err(EngineError::Json { .. })));
    }

    /// Families whose adapters lora-layout and lora-audit place, but whose
    /// forward this engine does not have: their configs (the PEFT
    /// fixtures' own, as transformers 5.17 wrote them) are refused with a
    /// typed error before any weight is read, so `Engine::load`, which
    /// loads the model first, never serves them.
    #[test]
    fn families_without_a_forward_are_refused() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
        for (model, model_type) in [
            ("qwen3_next", "qwen3_next"),
            ("deepseek_v3", "deepseek_v3"),
            ("glm4_moe", "glm4_moe"),
            ("phi3", "phi3"),
            ("gpt_oss", "gpt_oss"),
            ("gemma2", "gemma2"),
            ("gemma3_text", "gemma3_text"),
            ("gemma3", "gemma3"),
        ] {
            let dir = fixtures.join(model);
            let path = dir.join("config.json");
            assert!(
                lora_layout::ModelConfig::from_file(&path).is_ok(),
                "{model}: lora-layout reads it"
            );
            let err = BaseConfig::from_file(&path).expect_err(model);
            assert!(
                matches!(&err, EngineError::UnsupportedFamily { model_type: t, .. } if t == model_type),
                "{model}: {err}"
            );
            let err = crate::Model::load(&dir)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains("is not supported"), "{model}: {err}");
        }
    }
}
