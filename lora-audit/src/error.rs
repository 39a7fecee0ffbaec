//! Refusal codes, refusals and the crate's error type.
//!
//! A [`Refusal`] is a verdict about an adapter that was read correctly: its
//! code is stable ([`RejectCode::as_str`]) so tools and tests can match on it.
//! An [`AuditError`] means the input could not be read or is corrupt.

use std::fmt;

use crate::report::AuditReport;

/// Why an adapter (or one of its tensors) cannot be served exactly.
///
/// The string form (`REJECT[dora]`, ...) is stable; see the crate docs for
/// the full list with what each code means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RejectCode {
    /// `peft_type` is not `LORA`.
    PeftType,
    /// The weights are a pickle (`adapter_model.bin`), which is never read.
    Pickle,
    /// DoRA (`use_dora`, `lora_magnitude_vector`) on a pool not built for
    /// it ([`LoraOptions::dora`](crate::LoraOptions::dora) off), or on a
    /// site the pool serves no DoRA for (routed experts, routers).
    Dora,
    /// A DoRA adapter offered to a pool that was given no base weights: the
    /// magnitude rescale `m / ‖W + s·B A‖` needs each adapted projection's
    /// base weight.
    DoraNeedsBaseWeights,
    /// `lora_bias` / `lora_B.bias`: the pool has no bias space.
    LoraBias,
    /// Absolute base biases saved by `bias != "none"`.
    Bias,
    /// An `init_lora_weights` that rewrites the base weights (PiSSA, OLoRA,
    /// CorDA, LoftQ, LoRA-GA) or that this crate does not know.
    InitMutatesBase,
    /// Activated LoRA (`alora_invocation_tokens`).
    Alora,
    /// `layer_replication`: changes the layer structure.
    LayerReplication,
    /// `use_qalora`: pooled inputs.
    Qalora,
    /// `use_bdlora`: block-diagonal factors.
    Bdlora,
    /// Another LoRA variant (VeLoRA, MonteCLoRA, Arrow, KaSA, MiCA).
    LoraVariant,
    /// LoRA on an embedding in a form that is not served: on an embedding
    /// other than the input embedding, on a model whose head is tied to it
    /// (PEFT's merge writes the delta into the shared table, so the head
    /// would change too, while its unmerged forward leaves the head alone),
    /// or beside trainable tokens on the same table (PEFT refuses that).
    EmbeddingLora,
    /// LoRA on the input embedding while the pool has no place for it
    /// (`LoraOptions::embedding_lora`, `LORA_EMBEDDING_LORA`).
    EmbeddingLoraDisabled,
    /// LoRA on the output head (`lm_head.lora_A/B`) while the pool has no
    /// place for it (`LoraOptions::lm_head_lora`, `LORA_LM_HEAD_LORA`).
    LmHeadLoraDisabled,
    /// `modules_to_save` names a module other than `embed_tokens` / `lm_head`.
    ModulesToSave,
    /// `trainable_token_indices` or a `trainable_tokens_delta` that cannot be
    /// served (a module other than embed_tokens / lm_head, ids without rows).
    TrainableTokens,
    /// A trainable token id repeated in one module's list.
    DuplicateTokenId,
    /// A trainable token id at or past the served vocabulary.
    TokenOutOfVocab,
    /// An overlay the tied lm_head cannot serve as PEFT merges it.
    TiedHead,
    /// A `rank_pattern` / `alpha_pattern` key outside the subset of Python's
    /// `re` syntax this crate translates exactly (see [`peft_pattern_regex`]):
    /// one Python cannot compile (PEFT would never apply it), or one whose
    /// meaning the Rust `regex` crate cannot reproduce.
    ///
    /// [`peft_pattern_regex`]: crate::peft_pattern_regex
    PatternRegex,
    /// A pair's scale is not finite as served (`f32`): its alpha, from
    /// `lora_alpha` or an `alpha_pattern` key (the subject names the field,
    /// the reason the key), divided by r or sqrt(r), overflows `f32` (e.g.
    /// `lora_alpha = 1e40`, which JSON's `f64` holds).
    NonFiniteScale,
    /// The rank the config gives a module differs from its tensor shapes.
    RankMismatch,
    /// A dense pair's rank exceeds the pool's `max_rank`.
    RankExceedsMax,
    /// An expert or router pair's rank exceeds the expert pool rank.
    ExpertRank,
    /// Expert or router tensors while expert LoRA is disabled.
    ExpertsDisabled,
    /// A gated-delta-net input projection (`linear_attn.in_proj_*`, `conv1d`).
    GdnTarget,
    /// A well-formed LoRA target the engine does not apply (`lm_head`, norms, ...).
    UnsupportedTarget,
    /// A module of a multimodal wrapper's vision (or other non-text) tower
    /// or projector (`model.vision_tower.*`, `model.multi_modal_projector.*`):
    /// only the text decoder takes deltas.
    VisionTower,
    /// A target the base model does not have (layer, expert or module out of
    /// range): the adapter was made for another model.
    ModelMismatch,
    /// A tensor name of no known PEFT form.
    UnknownKey,
    /// A tensor whose shape does not fit its projection.
    Shape,
    /// A `lora_A` without its `lora_B`, or the reverse.
    Unpaired,
    /// Two tensors for one place.
    DuplicateTensor,
    /// A tensor dtype other than F32, F16, BF16.
    Dtype,
    /// A served tensor holds a NaN or an infinity as served (BF16, after
    /// conversion: a finite F32 above the BF16 range rounds to infinity).
    NonFinite,
    /// Nothing in the adapter can be served.
    Empty,
}

impl RejectCode {
    /// Every code, in declaration order.
    pub const ALL: [RejectCode; 37] = [
        RejectCode::PeftType,
        RejectCode::Pickle,
        RejectCode::Dora,
        RejectCode::DoraNeedsBaseWeights,
        RejectCode::LoraBias,
        RejectCode::Bias,
        RejectCode::InitMutatesBase,
        RejectCode::Alora,
        RejectCode::LayerReplication,
        RejectCode::Qalora,
        RejectCode::Bdlora,
        RejectCode::LoraVariant,
        RejectCode::EmbeddingLora,
        RejectCode::EmbeddingLoraDisabled,
        RejectCode::LmHeadLoraDisabled,
        RejectCode::ModulesToSave,
        RejectCode::TrainableTokens,
        RejectCode::DuplicateTokenId,
        RejectCode::TokenOutOfVocab,
        RejectCode::TiedHead,
        RejectCode::PatternRegex,
        RejectCode::NonFiniteScale,
        RejectCode::RankMismatch,
        RejectCode::RankExceedsMax,
        RejectCode::ExpertRank,
        RejectCode::ExpertsDisabled,
        RejectCode::GdnTarget,
        RejectCode::UnsupportedTarget,
        RejectCode::VisionTower,
        RejectCode::ModelMismatch,
        RejectCode::UnknownKey,
        RejectCode::Shape,
        RejectCode::Unpaired,
        RejectCode::DuplicateTensor,
        RejectCode::Dtype,
        RejectCode::NonFinite,
        RejectCode::Empty,
    ];

    /// The stable string form, e.g. `REJECT[gdn-target]`.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectCode::PeftType => "REJECT[peft-type]",
            RejectCode::Pickle => "REJECT[pickle]",
            RejectCode::Dora => "REJECT[dora]",
            RejectCode::DoraNeedsBaseWeights => "REJECT[dora-needs-base-weights]",
            RejectCode::LoraBias => "REJECT[lora-bias]",
            RejectCode::Bias => "REJECT[bias]",
            RejectCode::InitMutatesBase => "REJECT[init-mutates-base]",
            RejectCode::Alora => "REJECT[alora]",
            RejectCode::LayerReplication => "REJECT[layer-replication]",
            RejectCode::Qalora => "REJECT[qalora]",
            RejectCode::Bdlora => "REJECT[bdlora]",
            RejectCode::LoraVariant => "REJECT[lora-variant]",
            RejectCode::EmbeddingLora => "REJECT[embedding-lora]",
            RejectCode::EmbeddingLoraDisabled => "REJECT[embedding-lora-disabled]",
            RejectCode::LmHeadLoraDisabled => "REJECT[lm-head-lora-disabled]",
            RejectCode::ModulesToSave => "REJECT[modules-to-save]",
            RejectCode::TrainableTokens => "REJECT[trainable-tokens]",
            RejectCode::DuplicateTokenId => "REJECT[duplicate-token-id]",
            RejectCode::TokenOutOfVocab => "REJECT[token-out-of-vocab]",
            RejectCode::TiedHead => "REJECT[tied-head]",
            RejectCode::PatternRegex => "REJECT[pattern-regex]",
            RejectCode::NonFiniteScale => "REJECT[non-finite-scale]",
            RejectCode::RankMismatch => "REJECT[rank-mismatch]",
            RejectCode::RankExceedsMax => "REJECT[rank-exceeds-max]",
            RejectCode::ExpertRank => "REJECT[expert-rank]",
            RejectCode::ExpertsDisabled => "REJECT[experts-disabled]",
            RejectCode::GdnTarget => "REJECT[gdn-target]",
            RejectCode::UnsupportedTarget => "REJECT[unsupported-target]",
            RejectCode::VisionTower => "REJECT[vision-tower]",
            RejectCode::ModelMismatch => "REJECT[model-mismatch]",
            RejectCode::UnknownKey => "REJECT[unknown-key]",
            RejectCode::Shape => "REJECT[shape]",
            RejectCode::Unpaired => "REJECT[unpaired]",
            RejectCode::DuplicateTensor => "REJECT[duplicate-tensor]",
            RejectCode::Dtype => "REJECT[dtype]",
            RejectCode::NonFinite => "REJECT[non-finite]",
            RejectCode::Empty => "REJECT[empty]",
        }
    }

    /// The code whose [`as_str`](RejectCode::as_str) is `s`.
    pub fn parse(s: &str) -> Option<RejectCode> {
        RejectCode::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// Whether `allow_partial` turns this refusal into a listed skip: only
    /// targets the engine cannot apply (or, with experts disabled, does not
    /// apply) and token ids it cannot serve. Everything that would change the
    /// math of what is served stays a refusal.
    pub fn skippable(self) -> bool {
        matches!(
            self,
            RejectCode::GdnTarget
                | RejectCode::UnsupportedTarget
                | RejectCode::VisionTower
                | RejectCode::ExpertsDisabled
                | RejectCode::TokenOutOfVocab
        )
    }
}

impl fmt::Display for RejectCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One refused (or, under `allow_partial`, skipped) item: its code, what it
/// names (a tensor key or a config field) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The stable code.
    pub code: RejectCode,
    /// The tensor key or config field at fault.
    pub subject: String,
    /// A sentence saying why.
    pub reason: String,
}

impl Refusal {
    /// A refusal of `subject` for `reason`.
    pub fn new(code: RejectCode, subject: impl Into<String>, reason: impl Into<String>) -> Refusal {
        Refusal {
            code,
            subject: subject.into(),
            reason: reason.into(),
        }
    }
}

impl Refusal {
    /// The refusal of a served tensor holding a non-finite value
    /// (`REJECT[non-finite]`), naming the tensor: element `index` (row-major)
    /// is `stored` as stored in the file (exactly, as `f32`), which is NaN or
    /// an infinity once served as BF16. Use it with
    /// [`first_non_finite`](crate::first_non_finite) or
    /// [`first_non_finite_raw`](crate::first_non_finite_raw) on every path
    /// that serves tensor data the audit did not read itself.
    pub fn non_finite(tensor: impl Into<String>, index: usize, stored: f32) -> Refusal {
        let reason = if stored.is_finite() {
            let served = if stored > 0.0 { "+inf" } else { "-inf" };
            format!(
                "element {index} is {stored:e}, which rounds to {served} in BF16, the served type; \
                 every served value must be finite"
            )
        } else {
            format!("element {index} is {stored}; every served value must be finite")
        };
        Refusal::new(RejectCode::NonFinite, tensor, reason)
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.code, self.subject, self.reason)
    }
}

/// An input that could not be read, or an adapter refused where a servable
/// one was required.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// `adapter_config.json` is not a JSON object.
    #[error("{path} is not valid JSON: {reason}")]
    ConfigJson {
        /// The config file (`adapter_config.json` where only its text was given).
        path: String,
        /// The parser's message.
        reason: String,
    },
    /// A field of `adapter_config.json` has a type or value that cannot be read.
    #[error("{path} field `{field}`: {reason}")]
    ConfigField {
        /// The config file (`adapter_config.json` where only its text was given).
        path: String,
        /// The field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The config alone proves the adapter unservable.
    #[error("adapter_config.json is refused: {}", join_refusals(.0))]
    ConfigRefused(Vec<Refusal>),
    /// A safetensors file is truncated or corrupt.
    #[error("{path}: corrupt safetensors file: {reason}")]
    Safetensors {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor cannot be used as asked (dtype, size).
    #[error("tensor `{name}`: {reason}")]
    Tensor {
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The base model's `config.json` cannot be read.
    #[error("model config: {0}")]
    Model(#[from] lora_layout::ConfigError),
    /// A pool size cannot be represented.
    #[error("pool layout: {0}")]
    Layout(#[from] lora_layout::LayoutError),
    /// The adapter was audited and is not servable.
    #[error("adapter refused: {}", join_refusals(&.0.refused))]
    Refused(Box<AuditReport>),
    /// A probe file holds no `probe_in::` or `rows_idx::` tensor.
    #[error("{path}: holds no probe_in:: or rows_idx:: tensor, so nothing is probed")]
    NoProbes {
        /// The probe file.
        path: String,
    },
    /// No probe names a weight or table the adapter serves: nothing to write.
    #[error("no probe names a weight this adapter serves (not served: {})", .unserved.join(", "))]
    NothingProbed {
        /// The probed weights the adapter does not serve.
        unserved: Vec<String>,
    },
    /// An output file could not be written.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// `adapter_config.json` is larger than
    /// [`MAX_ADAPTER_CONFIG_BYTES`](crate::MAX_ADAPTER_CONFIG_BYTES): it is
    /// not parsed.
    #[error("adapter_config.json is {bytes} bytes, over the limit of {limit} (MAX_ADAPTER_CONFIG_BYTES)")]
    ConfigTooLarge {
        /// Its size (at least; reading stops past the limit).
        bytes: u64,
        /// The limit.
        limit: usize,
    },
    /// `rank_pattern` or `alpha_pattern` has more keys than
    /// [`MAX_PATTERN_KEYS`](crate::MAX_PATTERN_KEYS): none is compiled.
    #[error("adapter_config.json field `{field}` has {keys} keys, over the limit of {limit} (MAX_PATTERN_KEYS)")]
    PatternLimit {
        /// `rank_pattern` or `alpha_pattern`.
        field: &'static str,
        /// How many distinct keys it has.
        keys: usize,
        /// The limit.
        limit: usize,
    },
    /// A probe would produce more output than
    /// [`MAX_PROBE_OUTPUT_BYTES`](crate::MAX_PROBE_OUTPUT_BYTES) (for the
    /// whole run), or an output the host cannot allocate: the geometry
    /// named by `field` is too large for the rows asked.
    #[error(
        "probe `{name}`: {rows} rows x {width} outputs ({field}) of f32 are {bytes} bytes, \
         over the {limit} bytes left of the probe output limit (MAX_PROBE_OUTPUT_BYTES) or the host's memory"
    )]
    ProbeTooLarge {
        /// The probe tensor.
        name: String,
        /// The model-config field(s) the output width comes from.
        field: &'static str,
        /// Rows asked (for a fused experts probe: experts x rows).
        rows: usize,
        /// Output width.
        width: usize,
        /// The bytes the output needs (saturating).
        bytes: u128,
        /// The bytes the run had left.
        limit: usize,
    },
    /// A probe input cannot be answered.
    #[error("probe `{name}`: {reason}")]
    Probe {
        /// The probe tensor.
        name: String,
        /// Why.
        reason: String,
    },
}

fn join_refusals(refusals: &[Refusal]) -> String {
    refusals.iter().map(Refusal::to_string).collect::<Vec<_>>().join("; ")
}

impl AuditError {
    /// An I/O error on `path`.
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> AuditError {
        AuditError::Io {
            path: path.display().to_string(),
            source,
        }
    }

    /// A malformed config field.
    pub(crate) fn field(field: impl Into<String>, reason: impl Into<String>) -> AuditError {
        AuditError::ConfigField {
            path: crate::ADAPTER_CONFIG.to_string(),
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The error with the config file it is about named by its full path.
    pub(crate) fn in_config_file(self, path: &std::path::Path) -> AuditError {
        match self {
            AuditError::ConfigJson { reason, .. } => AuditError::ConfigJson {
                path: path.display().to_string(),
                reason,
            },
            AuditError::ConfigField { field, reason, .. } => AuditError::ConfigField {
                path: path.display().to_string(),
                field,
                reason,
            },
            other => other,
        }
    }
}
