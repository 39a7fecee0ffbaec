//! Model geometry read from a Hugging Face `config.json`.
//!
//! Only the fields that decide which projections exist and how wide they are
//! are kept. Fields Hugging Face derives when absent (`head_dim`,
//! `num_key_value_heads`, `layer_types`, ...) are derived the same way here,
//! and fields its config class defaults are defaulted the same way (Gemma:
//! `head_dim` 256, 4 kv heads, tied embeddings; GLM-4.5: 8 kv heads, one
//! dense first layer, one shared expert; gpt-oss: `head_dim` 64, 8 kv
//! heads); every other missing field is an error naming it.
//!
//! A multimodal wrapper is read through its `text_config` (the text tower's
//! geometry); the Gemma 3 wrapper (`gemma3`) also ties its head by its own
//! top-level `tie_word_embeddings`, as transformers does.

use std::path::Path;

use serde_json::{Map, Value};

/// The model families whose geometry this crate knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// `llama`
    Llama,
    /// `mistral`
    Mistral,
    /// `qwen2`
    Qwen2,
    /// `qwen3`
    Qwen3,
    /// `qwen2_moe`: routed experts, a shared expert and its sigmoid gate.
    Qwen2Moe,
    /// `qwen3_moe`: routed experts, no shared expert.
    Qwen3Moe,
    /// `mixtral`: every layer's MLP is routed experts (`block_sparse_moe`).
    Mixtral,
    /// `qwen3_next`: hybrid full attention / gated-delta-net layers, routed
    /// experts with a shared expert.
    Qwen3Next,
    /// `deepseek_v3`: multi-head latent attention, dense first layers, routed
    /// plus shared experts after.
    DeepseekV3,
    /// `glm4_moe` (GLM-4.5): dense first layers (`first_k_dense_replace`),
    /// then routed experts (transformers 5.x fused), shared experts
    /// (`mlp.shared_experts`) and DeepSeek's scored router (sigmoid scores
    /// plus `e_score_correction_bias`, a buffer that takes no delta).
    Glm4Moe,
    /// `phi3` (Phi-3, Phi-4): the attention's q, k and v are one fused
    /// `qkv_proj` and the MLP's gate and up one fused `gate_up_proj`, each a
    /// single `nn.Linear` and a single PEFT target.
    Phi3,
    /// `gpt_oss`: every layer routes to experts in its own fused format
    /// (`gate_up_proj` `[E, hidden, 2·inter]` with gate and up interleaved
    /// along the output, expert biases) through a router with a bias
    /// (`mlp.router`); attention with biases and sinks.
    GptOss,
    /// `gemma2`: llama-like projections with an explicit `head_dim` (q/k/v/o
    /// widths are `heads · head_dim`, not `hidden_size`); tied embeddings by
    /// default.
    Gemma2,
    /// `gemma3_text`, also the text tower of the Gemma 3 multimodal wrapper
    /// (`gemma3`, read through its `text_config`): as Gemma 2, plus per-head
    /// `q_norm` / `k_norm` (which take no delta).
    Gemma3Text,
}

impl ModelFamily {
    /// The family of a `model_type` string, including the text towers of the
    /// multimodal wrappers that share a family's projections.
    pub fn from_model_type(model_type: &str) -> Option<ModelFamily> {
        Some(match model_type {
            "llama" => ModelFamily::Llama,
            "mistral" => ModelFamily::Mistral,
            "qwen2" | "qwen2_vl_text" | "qwen2_5_vl_text" => ModelFamily::Qwen2,
            "qwen3" | "qwen3_vl_text" => ModelFamily::Qwen3,
            "qwen2_moe" => ModelFamily::Qwen2Moe,
            "qwen3_moe" | "qwen3_vl_moe_text" => ModelFamily::Qwen3Moe,
            "mixtral" => ModelFamily::Mixtral,
            "qwen3_next" => ModelFamily::Qwen3Next,
            "deepseek_v3" => ModelFamily::DeepseekV3,
            "glm4_moe" => ModelFamily::Glm4Moe,
            "phi3" => ModelFamily::Phi3,
            "gpt_oss" => ModelFamily::GptOss,
            "gemma2" => ModelFamily::Gemma2,
            // `gemma3` is the multimodal wrapper: its `text_config` (model_type
            // `gemma3_text`) is read when present.
            "gemma3_text" | "gemma3" => ModelFamily::Gemma3Text,
            _ => return None,
        })
    }

    /// The canonical `model_type` of the family.
    pub fn model_type(self) -> &'static str {
        match self {
            ModelFamily::Llama => "llama",
            ModelFamily::Mistral => "mistral",
            ModelFamily::Qwen2 => "qwen2",
            ModelFamily::Qwen3 => "qwen3",
            ModelFamily::Qwen2Moe => "qwen2_moe",
            ModelFamily::Qwen3Moe => "qwen3_moe",
            ModelFamily::Mixtral => "mixtral",
            ModelFamily::Qwen3Next => "qwen3_next",
            ModelFamily::DeepseekV3 => "deepseek_v3",
            ModelFamily::Glm4Moe => "glm4_moe",
            ModelFamily::Phi3 => "phi3",
            ModelFamily::GptOss => "gpt_oss",
            ModelFamily::Gemma2 => "gemma2",
            ModelFamily::Gemma3Text => "gemma3_text",
        }
    }

    /// Whether the family has routed experts at all.
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            ModelFamily::Qwen2Moe
                | ModelFamily::Qwen3Moe
                | ModelFamily::Mixtral
                | ModelFamily::Qwen3Next
                | ModelFamily::DeepseekV3
                | ModelFamily::Glm4Moe
                | ModelFamily::GptOss
        )
    }
}

/// The attention kind of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Softmax attention (`self_attn`).
    FullAttention,
    /// Gated delta net (`linear_attn`, Qwen3-Next).
    LinearAttention,
}

/// Multi-head latent attention dimensions (DeepSeek-V3). These are attention
/// ranks, unrelated to adapter ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlaDims {
    /// `q_lora_rank`; `None` means the model has a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`
    pub kv_lora_rank: usize,
    /// `qk_rope_head_dim`
    pub qk_rope_head_dim: usize,
    /// `qk_nope_head_dim`
    pub qk_nope_head_dim: usize,
    /// `v_head_dim`
    pub v_head_dim: usize,
}

impl MlaDims {
    /// Per-head query/key width: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// Routed-expert geometry of an MoE model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeDims {
    /// Routed experts per MoE layer (`num_experts`, `num_local_experts` or
    /// `n_routed_experts`).
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Intermediate width of one routed expert.
    pub expert_intermediate_size: usize,
    /// Intermediate width of the shared-expert MLP, when the model has one.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Whether the shared expert has a sigmoid gate (`shared_expert_gate`).
    pub shared_expert_gate: bool,
    /// Layers whose MLP is dense even though the model is MoE.
    pub dense_layers: Vec<bool>,
}

/// Gated-delta-net geometry (Qwen3-Next `linear_attn`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearAttnDims {
    /// `linear_num_value_heads`
    pub num_value_heads: usize,
    /// `linear_value_head_dim`
    pub value_head_dim: usize,
}

/// The geometry of a served base model, as far as LoRA needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// Which family's module names and dims apply.
    pub family: ModelFamily,
    /// `hidden_size`
    pub hidden_size: usize,
    /// `num_hidden_layers`
    pub num_hidden_layers: usize,
    /// `num_attention_heads`
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (defaults to `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// `head_dim` (defaults to `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// `intermediate_size` of the dense MLP.
    pub intermediate_size: usize,
    /// `vocab_size`
    pub vocab_size: usize,
    /// `tie_word_embeddings` (defaults to false).
    pub tie_word_embeddings: bool,
    /// Per layer: full or linear attention.
    pub layer_types: Vec<LayerKind>,
    /// Routed experts, for MoE families.
    pub moe: Option<MoeDims>,
    /// MLA dims, for DeepSeek-V3.
    pub mla: Option<MlaDims>,
    /// Gated-delta-net dims, for Qwen3-Next.
    pub linear_attn: Option<LinearAttnDims>,
}

/// Why a `config.json` could not be turned into a [`ModelConfig`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The text is not JSON, or not a JSON object.
    #[error("config is not a JSON object: {0}")]
    Json(String),
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A `config.json` file that does not parse: the file, and why.
    #[error("{path}: {source}")]
    InFile {
        /// The file.
        path: String,
        /// What is wrong with its text.
        source: Box<ConfigError>,
    },
    /// `model_type` is absent.
    #[error("config has no `model_type`")]
    MissingModelType,
    /// `model_type` names a family this crate does not know.
    #[error("unsupported model_type `{0}`")]
    UnknownModelType(String),
    /// A field the family needs is absent or null.
    #[error("{model_type} config is missing field `{field}`")]
    MissingField {
        /// The family's `model_type`.
        model_type: &'static str,
        /// The absent field.
        field: &'static str,
    },
    /// A field is present but has the wrong type or an impossible value.
    #[error("{model_type} config field `{field}`: {reason}")]
    InvalidField {
        /// The family's `model_type`.
        model_type: &'static str,
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// Upper bound on any single dimension; larger values are refused so that
/// byte sizes computed from them stay meaningful.
const MAX_DIM: u64 = 1 << 24;
/// Upper bound on the layer count.
const MAX_LAYERS: u64 = 1 << 12;
/// Upper bound on the expert count.
const MAX_EXPERTS: u64 = 1 << 14;

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    model_type: &'static str,
}

impl<'a> Fields<'a> {
    fn raw(&self, field: &'static str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    /// Whether `field` is absent (not even null).
    fn absent(&self, field: &'static str) -> bool {
        !self.obj.contains_key(field)
    }

    fn invalid(&self, field: &'static str, reason: impl Into<String>) -> ConfigError {
        ConfigError::InvalidField {
            model_type: self.model_type,
            field,
            reason: reason.into(),
        }
    }

    fn opt_uint(&self, field: &'static str, max: u64) -> Result<Option<usize>, ConfigError> {
        let Some(v) = self.raw(field) else {
            return Ok(None);
        };
        let n = v
            .as_u64()
            .ok_or_else(|| self.invalid(field, format!("expected a non-negative integer, got {v}")))?;
        if n > max {
            return Err(self.invalid(field, format!("{n} exceeds the limit {max}")));
        }
        usize::try_from(n)
            .map(Some)
            .map_err(|_| self.invalid(field, "does not fit in usize"))
    }

    fn uint(&self, field: &'static str, max: u64) -> Result<usize, ConfigError> {
        self.opt_uint(field, max)?.ok_or(ConfigError::MissingField {
            model_type: self.model_type,
            field,
        })
    }

    /// A positive dimension.
    fn dim(&self, field: &'static str) -> Result<usize, ConfigError> {
        let n = self.uint(field, MAX_DIM)?;
        if n == 0 {
            return Err(self.invalid(field, "must be positive"));
        }
        Ok(n)
    }

    fn opt_dim(&self, field: &'static str) -> Result<Option<usize>, ConfigError> {
        match self.opt_uint(field, MAX_DIM)? {
            Some(0) => Err(self.invalid(field, "must be positive")),
            other => Ok(other),
        }
    }

    fn opt_bool(&self, field: &'static str) -> Result<Option<bool>, ConfigError> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.invalid(field, format!("expected a boolean, got {v}"))),
        }
    }

    fn opt_uint_list(&self, field: &'static str) -> Result<Option<Vec<usize>>, ConfigError> {
        let Some(v) = self.raw(field) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.invalid(field, format!("expected a list, got {v}")))?;
        arr.iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.invalid(field, format!("expected integers, got {x}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

impl ModelConfig {
    /// Parse a Hugging Face `config.json` text. A multimodal wrapper's nested
    /// `text_config` is read when present.
    pub fn from_hf_config(json: &str) -> Result<ModelConfig, ConfigError> {
        let value: Value = serde_json::from_str(json).map_err(|e| ConfigError::Json(e.to_string()))?;
        ModelConfig::from_hf_value(&value)
    }

    /// Read and parse a `config.json` file.
    pub fn from_file(path: &Path) -> Result<ModelConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        ModelConfig::from_hf_config(&text).map_err(|e| ConfigError::InFile {
            path: path.display().to_string(),
            source: Box::new(e),
        })
    }

    /// Parse an already-decoded `config.json` value.
    pub fn from_hf_value(value: &Value) -> Result<ModelConfig, ConfigError> {
        let top = value
            .as_object()
            .ok_or_else(|| ConfigError::Json("top level is not an object".into()))?;
        let (obj, wrapped) = match top.get("text_config") {
            Some(Value::Object(text)) => (text, true),
            _ => (top, false),
        };
        let model_type = obj
            .get("model_type")
            .or_else(|| top.get("model_type"))
            .and_then(Value::as_str)
            .ok_or(ConfigError::MissingModelType)?;
        let family = ModelFamily::from_model_type(model_type)
            .ok_or_else(|| ConfigError::UnknownModelType(model_type.to_string()))?;
        let f = Fields {
            obj,
            model_type: family.model_type(),
        };
        let mut cfg = parse_family(&f, family)?;
        // The Gemma 3 wrapper ties its head by its own top-level field
        // (transformers reads `tie_word_embeddings` of the model's config,
        // the wrapper's), default true; an explicit null is false.
        if wrapped && top.get("model_type").and_then(Value::as_str) == Some("gemma3") {
            cfg.tie_word_embeddings = match top.get("tie_word_embeddings") {
                None => true,
                Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(ConfigError::InvalidField {
                        model_type: "gemma3",
                        field: "tie_word_embeddings",
                        reason: format!("expected a boolean, got {v}"),
                    });
                }
            };
        }
        Ok(cfg)
    }

    /// Whether `layer` runs routed experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match &self.moe {
            Some(moe) => layer < self.num_hidden_layers && !moe.dense_layers.get(layer).copied().unwrap_or(true),
            None => false,
        }
    }

    /// The attention kind of `layer` (full attention past the last layer,
    /// where no module applies anyway).
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        self.layer_types.get(layer).copied().unwrap_or(LayerKind::FullAttention)
    }
}

/// transformers' class defaults for the fields a family's config may omit,
/// where they are not derived from other fields. An explicit null always
/// derives (`head_dim`: `hidden_size / num_attention_heads`,
/// `num_key_value_heads`: `num_attention_heads`), as transformers does where
/// it accepts one.
struct Defaults {
    /// `head_dim` when absent; `None`: derived.
    head_dim: Option<usize>,
    /// `num_key_value_heads` when absent; `None`: derived.
    num_key_value_heads: Option<usize>,
    /// `tie_word_embeddings` when absent.
    tie_word_embeddings: bool,
}

fn defaults(family: ModelFamily) -> Defaults {
    match family {
        // Gemma2Config / Gemma3TextConfig: head_dim 256, 4 kv heads, tied.
        ModelFamily::Gemma2 | ModelFamily::Gemma3Text => Defaults {
            head_dim: Some(256),
            num_key_value_heads: Some(4),
            tie_word_embeddings: true,
        },
        // Glm4MoeConfig: 8 kv heads; `head_dim` is not a field of the class,
        // and its attention derives it as Llama's does.
        ModelFamily::Glm4Moe => Defaults {
            head_dim: None,
            num_key_value_heads: Some(8),
            tie_word_embeddings: false,
        },
        // GptOssConfig: head_dim 64 and 8 kv heads when absent, derived when
        // null.
        ModelFamily::GptOss => Defaults {
            head_dim: Some(64),
            num_key_value_heads: Some(8),
            tie_word_embeddings: false,
        },
        _ => Defaults {
            head_dim: None,
            num_key_value_heads: None,
            tie_word_embeddings: false,
        },
    }
}

fn parse_family(f: &Fields<'_>, family: ModelFamily) -> Result<ModelConfig, ConfigError> {
    let defaults = defaults(family);
    let hidden_size = f.dim("hidden_size")?;
    let num_hidden_layers = f.uint("num_hidden_layers", MAX_LAYERS)?;
    if num_hidden_layers == 0 {
        return Err(f.invalid("num_hidden_layers", "must be positive"));
    }
    let num_attention_heads = f.dim("num_attention_heads")?;
    let num_key_value_heads = f
        .opt_dim("num_key_value_heads")?
        .or(f
            .absent("num_key_value_heads")
            .then_some(defaults.num_key_value_heads)
            .flatten())
        .unwrap_or(num_attention_heads);
    let head_dim = match f
        .opt_dim("head_dim")?
        .or(f.absent("head_dim").then_some(defaults.head_dim).flatten())
    {
        Some(d) => d,
        None => {
            if hidden_size % num_attention_heads != 0 {
                return Err(f.invalid(
                    "head_dim",
                    format!("absent, and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"),
                ));
            }
            hidden_size / num_attention_heads
        }
    };
    let vocab_size = f.dim("vocab_size")?;
    let tie_word_embeddings = f
        .opt_bool("tie_word_embeddings")?
        .unwrap_or(defaults.tie_word_embeddings);

    let layer_types = if family == ModelFamily::Qwen3Next {
        qwen3_next_layer_types(f, num_hidden_layers)?
    } else {
        vec![LayerKind::FullAttention; num_hidden_layers]
    };

    let (intermediate_size, moe) = match family {
        ModelFamily::Llama
        | ModelFamily::Mistral
        | ModelFamily::Qwen2
        | ModelFamily::Qwen3
        | ModelFamily::Phi3
        | ModelFamily::Gemma2
        | ModelFamily::Gemma3Text => (f.dim("intermediate_size")?, None),
        ModelFamily::Mixtral | ModelFamily::GptOss => {
            // Every layer an MoE block of experts of width
            // `intermediate_size`, without shared experts. Mixtral saves
            // `num_local_experts`; GptOssConfig too, or its alias
            // `num_experts`.
            let num_experts = match f.raw("num_local_experts") {
                None if family == ModelFamily::GptOss && f.raw("num_experts").is_some() => {
                    experts_field(f, "num_experts")?
                }
                _ => experts_field(f, "num_local_experts")?,
            };
            let inter = f.dim("intermediate_size")?;
            let moe = MoeDims {
                num_experts,
                top_k: f.dim("num_experts_per_tok")?,
                expert_intermediate_size: inter,
                shared_expert_intermediate_size: None,
                shared_expert_gate: false,
                dense_layers: vec![false; num_hidden_layers],
            };
            (inter, Some(moe))
        }
        ModelFamily::Qwen2Moe | ModelFamily::Qwen3Moe | ModelFamily::Qwen3Next => {
            // transformers 5.x saves `num_local_experts` for qwen3_moe; 4.x
            // and the other Qwen families save `num_experts`.
            let num_experts = match f.raw("num_experts") {
                Some(_) => experts_field(f, "num_experts")?,
                None if f.raw("num_local_experts").is_some() => experts_field(f, "num_local_experts")?,
                None => experts_field(f, "num_experts")?,
            };
            let step = f.opt_uint("decoder_sparse_step", MAX_LAYERS)?.unwrap_or(1);
            let mlp_only = f.opt_uint_list("mlp_only_layers")?.unwrap_or_default();
            // Transformers: a layer is sparse when it is not in
            // `mlp_only_layers` and `(layer + 1) % decoder_sparse_step == 0`.
            let dense_layers = (0..num_hidden_layers)
                .map(|l| mlp_only.contains(&l) || step == 0 || (l + 1) % step != 0)
                .collect::<Vec<_>>();
            let any_dense = dense_layers.iter().any(|&d| d);
            let inter = if any_dense {
                f.dim("intermediate_size")?
            } else {
                f.opt_dim("intermediate_size")?.unwrap_or(0)
            };
            let has_shared = family != ModelFamily::Qwen3Moe;
            let shared = if has_shared {
                Some(f.dim("shared_expert_intermediate_size")?)
            } else {
                None
            };
            let moe = MoeDims {
                num_experts,
                top_k: f.dim("num_experts_per_tok")?,
                expert_intermediate_size: f.dim("moe_intermediate_size")?,
                shared_expert_intermediate_size: shared,
                shared_expert_gate: has_shared,
                dense_layers,
            };
            (inter, Some(moe))
        }
        ModelFamily::DeepseekV3 => {
            let num_experts = experts_field(f, "n_routed_experts")?;
            let first_dense = f.opt_uint("first_k_dense_replace", MAX_LAYERS)?.unwrap_or(0);
            let freq = f.opt_uint("moe_layer_freq", MAX_LAYERS)?.unwrap_or(1);
            if freq == 0 {
                return Err(f.invalid("moe_layer_freq", "must be positive"));
            }
            let dense_layers = (0..num_hidden_layers)
                .map(|l| l < first_dense || l % freq != 0)
                .collect::<Vec<_>>();
            let expert_inter = f.dim("moe_intermediate_size")?;
            let n_shared = f.opt_uint("n_shared_experts", MAX_EXPERTS)?.unwrap_or(0);
            let shared = shared_width(f, expert_inter, n_shared)?;
            let moe = MoeDims {
                num_experts,
                top_k: f.dim("num_experts_per_tok")?,
                expert_intermediate_size: expert_inter,
                shared_expert_intermediate_size: shared,
                shared_expert_gate: false,
                dense_layers,
            };
            (f.dim("intermediate_size")?, Some(moe))
        }
        ModelFamily::Glm4Moe => {
            // Glm4MoeConfig saves `n_routed_experts` (`num_local_experts` is
            // its attribute alias). Layer l is dense when
            // l < first_k_dense_replace (class default 1); the others are
            // MoE blocks whose `n_shared_experts` (default 1) shared experts
            // are one MLP of n_shared · moe_intermediate_size.
            let num_experts = match f.raw("n_routed_experts") {
                None if f.raw("num_local_experts").is_some() => experts_field(f, "num_local_experts")?,
                _ => experts_field(f, "n_routed_experts")?,
            };
            let first_dense = f.opt_uint("first_k_dense_replace", MAX_LAYERS)?.unwrap_or(1);
            let dense_layers = (0..num_hidden_layers).map(|l| l < first_dense).collect::<Vec<_>>();
            let expert_inter = f.dim("moe_intermediate_size")?;
            let n_shared = f.opt_uint("n_shared_experts", MAX_EXPERTS)?.unwrap_or(1);
            let inter = if dense_layers.iter().any(|&d| d) {
                f.dim("intermediate_size")?
            } else {
                f.opt_dim("intermediate_size")?.unwrap_or(0)
            };
            let moe = MoeDims {
                num_experts,
                top_k: f.dim("num_experts_per_tok")?,
                expert_intermediate_size: expert_inter,
                shared_expert_intermediate_size: shared_width(f, expert_inter, n_shared)?,
                shared_expert_gate: false,
                dense_layers,
            };
            (inter, Some(moe))
        }
    };

    let mla = if family == ModelFamily::DeepseekV3 {
        Some(MlaDims {
            q_lora_rank: f.opt_dim("q_lora_rank")?,
            kv_lora_rank: f.dim("kv_lora_rank")?,
            qk_rope_head_dim: f.dim("qk_rope_head_dim")?,
            qk_nope_head_dim: f.uint("qk_nope_head_dim", MAX_DIM)?,
            v_head_dim: f.dim("v_head_dim")?,
        })
    } else {
        None
    };

    let linear_attn = if family == ModelFamily::Qwen3Next {
        Some(LinearAttnDims {
            num_value_heads: f.dim("linear_num_value_heads")?,
            value_head_dim: f.dim("linear_value_head_dim")?,
        })
    } else {
        None
    };

    let cfg = ModelConfig {
        family,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        intermediate_size,
        vocab_size,
        tie_word_embeddings,
        layer_types,
        moe,
        mla,
        linear_attn,
    };
    check_widths(f, &cfg)?;
    Ok(cfg)
}

/// The width of `n_shared` shared experts of `expert_inter` fused into one
/// MLP (DeepSeek-V3, GLM-4.5); `None` without shared experts.
fn shared_width(f: &Fields<'_>, expert_inter: usize, n_shared: usize) -> Result<Option<usize>, ConfigError> {
    if n_shared == 0 {
        return Ok(None);
    }
    expert_inter
        .checked_mul(n_shared)
        .filter(|&w| w as u64 <= MAX_DIM)
        .map(Some)
        .ok_or_else(|| f.invalid("n_shared_experts", "shared expert width overflows"))
}

fn experts_field(f: &Fields<'_>, field: &'static str) -> Result<usize, ConfigError> {
    let n = f.uint(field, MAX_EXPERTS)?;
    if n == 0 {
        return Err(f.invalid(field, "an MoE model needs at least one expert"));
    }
    Ok(n)
}

fn qwen3_next_layer_types(f: &Fields<'_>, num_layers: usize) -> Result<Vec<LayerKind>, ConfigError> {
    if let Some(v) = f.raw("layer_types") {
        let arr = v
            .as_array()
            .ok_or_else(|| f.invalid("layer_types", format!("expected a list, got {v}")))?;
        if arr.len() != num_layers {
            return Err(f.invalid(
                "layer_types",
                format!("has {} entries for {num_layers} layers", arr.len()),
            ));
        }
        return arr
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(LayerKind::FullAttention),
                Some("linear_attention") => Ok(LayerKind::LinearAttention),
                _ => Err(f.invalid("layer_types", format!("unknown layer type {t}"))),
            })
            .collect();
    }
    let interval = f.uint("full_attention_interval", MAX_LAYERS)?;
    if interval == 0 {
        return Err(f.invalid("full_attention_interval", "must be positive"));
    }
    // Transformers: layer i is full attention when (i + 1) % interval == 0.
    Ok((0..num_layers)
        .map(|i| {
            if (i + 1) % interval == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect())
}

/// Every projection width derived from the fields must itself be a sane
/// dimension; this keeps later byte arithmetic far from overflow.
fn check_widths(f: &Fields<'_>, cfg: &ModelConfig) -> Result<(), ConfigError> {
    let products: [(&'static str, Option<u64>); 3] = [
        (
            "num_attention_heads",
            (cfg.num_attention_heads as u64).checked_mul(2 * cfg.head_dim as u64),
        ),
        (
            "num_key_value_heads",
            (cfg.num_key_value_heads as u64).checked_mul(cfg.head_dim as u64),
        ),
        (
            "linear_num_value_heads",
            cfg.linear_attn.as_ref().map_or(Some(0), |l| {
                (l.num_value_heads as u64).checked_mul(l.value_head_dim as u64)
            }),
        ),
    ];
    for (field, p) in products {
        match p {
            Some(w) if w <= MAX_DIM => {}
            _ => return Err(f.invalid(field, "projection width exceeds the supported limit")),
        }
    }
    if let Some(mla) = &cfg.mla {
        let w = (cfg.num_attention_heads as u64).saturating_mul((mla.qk_head_dim() + mla.v_head_dim) as u64);
        if w > MAX_DIM {
            return Err(f.invalid(
                "num_attention_heads",
                "MLA projection width exceeds the supported limit",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
