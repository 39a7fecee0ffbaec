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
    /// DoRA (`use_dora`, `lora_magnitude_vector`): needs base-weight norms.
    Dora,
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
    /// LoRA on the embedding (`lora_embedding_A/B`), not supported yet.
    EmbeddingLora,
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
    /// A `rank_pattern` / `alpha_pattern` key the Rust `regex` crate cannot
    /// express with Python's exact meaning.
    PatternRegex,
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
    /// Nothing in the adapter can be served.
    Empty,
}

impl RejectCode {
    /// Every code, in declaration order.
    pub const ALL: [RejectCode; 31] = [
        RejectCode::PeftType,
        RejectCode::Pickle,
        RejectCode::Dora,
        RejectCode::LoraBias,
        RejectCode::Bias,
        RejectCode::InitMutatesBase,
        RejectCode::Alora,
        RejectCode::LayerReplication,
        RejectCode::Qalora,
        RejectCode::Bdlora,
        RejectCode::LoraVariant,
        RejectCode::EmbeddingLora,
        RejectCode::ModulesToSave,
        RejectCode::TrainableTokens,
        RejectCode::DuplicateTokenId,
        RejectCode::TokenOutOfVocab,
        RejectCode::TiedHead,
        RejectCode::PatternRegex,
        RejectCode::RankMismatch,
        RejectCode::RankExceedsMax,
        RejectCode::ExpertRank,
        RejectCode::ExpertsDisabled,
        RejectCode::GdnTarget,
        RejectCode::UnsupportedTarget,
        RejectCode::ModelMismatch,
        RejectCode::UnknownKey,
        RejectCode::Shape,
        RejectCode::Unpaired,
        RejectCode::DuplicateTensor,
        RejectCode::Dtype,
        RejectCode::Empty,
    ];

    /// The stable string form, e.g. `REJECT[gdn-target]`.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectCode::PeftType => "REJECT[peft-type]",
            RejectCode::Pickle => "REJECT[pickle]",
            RejectCode::Dora => "REJECT[dora]",
            RejectCode::LoraBias => "REJECT[lora-bias]",
            RejectCode::Bias => "REJECT[bias]",
            RejectCode::InitMutatesBase => "REJECT[init-mutates-base]",
            RejectCode::Alora => "REJECT[alora]",
            RejectCode::LayerReplication => "REJECT[layer-replication]",
            RejectCode::Qalora => "REJECT[qalora]",
            RejectCode::Bdlora => "REJECT[bdlora]",
            RejectCode::LoraVariant => "REJECT[lora-variant]",
            RejectCode::EmbeddingLora => "REJECT[embedding-lora]",
            RejectCode::ModulesToSave => "REJECT[modules-to-save]",
            RejectCode::TrainableTokens => "REJECT[trainable-tokens]",
            RejectCode::DuplicateTokenId => "REJECT[duplicate-token-id]",
            RejectCode::TokenOutOfVocab => "REJECT[token-out-of-vocab]",
            RejectCode::TiedHead => "REJECT[tied-head]",
            RejectCode::PatternRegex => "REJECT[pattern-regex]",
            RejectCode::RankMismatch => "REJECT[rank-mismatch]",
            RejectCode::RankExceedsMax => "REJECT[rank-exceeds-max]",
            RejectCode::ExpertRank => "REJECT[expert-rank]",
            RejectCode::ExpertsDisabled => "REJECT[experts-disabled]",
            RejectCode::GdnTarget => "REJECT[gdn-target]",
            RejectCode::UnsupportedTarget => "REJECT[unsupported-target]",
            RejectCode::ModelMismatch => "REJECT[model-mismatch]",
            RejectCode::UnknownKey => "REJECT[unknown-key]",
            RejectCode::Shape => "REJECT[shape]",
            RejectCode::Unpaired => "REJECT[unpaired]",
            RejectCode::DuplicateTensor => "REJECT[duplicate-tensor]",
            RejectCode::Dtype => "REJECT[dtype]",
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
    #[error("adapter_config.json is not valid JSON: {reason}")]
    ConfigJson {
        /// The parser's message.
        reason: String,
    },
    /// A field of `adapter_config.json` has a type or value that cannot be read.
    #[error("adapter_config.json field `{field}`: {reason}")]
    ConfigField {
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
            field: field.into(),
            reason: reason.into(),
        }
    }
}
