//! The one error type of the engine.
//!
//! Every way a model folder, a batch or a hook can be wrong is a variant here,
//! naming the offending file, tensor, field, chunk or position. Nothing in this
//! crate panics or unwraps on input-dependent paths; it returns one of these.
//! This module must never grow variants that carry no location ("invalid
//! input") or that stringify an error it could keep as a source.

use std::path::PathBuf;

/// A boxed error from code outside the engine (a delta hook).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong loading a base model or running a forward.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (`config.json`, a shard index) is not valid JSON or not an object.
    #[error("{path}: not a JSON object: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// A `config.json` field is missing, of the wrong type, or out of range.
    #[error("{path}: field `{field}`: {reason}")]
    ConfigField {
        /// The config file (or the label given to [`crate::BaseConfig::from_json_str`]).
        path: PathBuf,
        /// The field, as written in `config.json` (`rope_parameters.rope_theta` for nested ones).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `model_type` names a family this engine does not implement.
    #[error("{path}: model_type `{model_type}` is not supported (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral)")]
    UnsupportedFamily {
        /// The config file.
        path: PathBuf,
        /// The `model_type` found.
        model_type: String,
    },
    /// The RoPE variant is not the default one.
    #[error("{path}: rope_type `{rope_type}` is not supported (only `default`)")]
    UnsupportedRope {
        /// The config file.
        path: PathBuf,
        /// The `rope_type` (or legacy `type`) found.
        rope_type: String,
    },
    /// A safetensors file is malformed (header, offsets, length).
    #[error("{file}: bad safetensors file: {source}")]
    Safetensors {
        /// The file.
        file: PathBuf,
        /// The safetensors crate's error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A tensor the config requires is not in the checkpoint.
    #[error("{file}: tensor `{tensor}` is missing")]
    MissingTensor {
        /// The checkpoint file (or shard index) that should hold it.
        file: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor is stored in a dtype other than F32 or BF16.
    #[error("{file}: tensor `{tensor}` has dtype {dtype}; only F32 and BF16 are supported")]
    UnsupportedDtype {
        /// The file holding the tensor.
        file: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype found, as safetensors names it.
        dtype: String,
    },
    /// A tensor's shape disagrees with the config.
    #[error("{file}: tensor `{tensor}` has shape {found:?}, the config implies {expected:?}")]
    TensorShape {
        /// The file holding the tensor.
        file: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A token id is not below the vocabulary size.
    #[error("chunk {chunk}, token {position}: id {token} is not below vocab_size {vocab}")]
    TokenOutOfRange {
        /// Index of the chunk in the batch.
        chunk: usize,
        /// Index of the token within the chunk.
        position: usize,
        /// The id.
        token: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// Two chunks of one batch name the same cache.
    #[error("chunks {first} and {second} both name cache {cache}")]
    DuplicateCache {
        /// The cache index.
        cache: usize,
        /// The first chunk naming it.
        first: usize,
        /// The second chunk naming it.
        second: usize,
    },
    /// A chunk names a cache index past the caches given.
    #[error("chunk {chunk} names cache {cache}, but only {n_caches} caches were given")]
    CacheIndex {
        /// Index of the chunk in the batch.
        chunk: usize,
        /// The cache index it names.
        cache: usize,
        /// How many caches were passed.
        n_caches: usize,
    },
    /// A cache was built for a model of another geometry.
    #[error(
        "cache {cache} holds {cache_layers} layers of width {cache_kv_dim}; the model has {model_layers} of width {model_kv_dim}"
    )]
    CacheGeometry {
        /// The cache index.
        cache: usize,
        /// Layers in the cache.
        cache_layers: usize,
        /// Key/value row width in the cache.
        cache_kv_dim: usize,
        /// Layers in the model.
        model_layers: usize,
        /// Key/value row width of the model.
        model_kv_dim: usize,
    },
    /// A position does not fit the arithmetic (a cache longer than `u32::MAX` tokens).
    #[error("cache {cache}: position {position} is too large")]
    PositionOverflow {
        /// The cache index.
        cache: usize,
        /// The position.
        position: usize,
    },
    /// A delta hook reported a failure; the forward was abandoned and the caches restored.
    #[error("delta hook `{hook}` failed: {source}")]
    Hook {
        /// The hook method (`qkv`, `expert_down`, ...).
        hook: &'static str,
        /// The hook's own error.
        #[source]
        source: BoxError,
    },
    /// A base projection on the model's CUDA device failed: uploading its
    /// weight or input, the cuBLAS call, or downloading its output.
    #[error("base projection {site} on the device: {source}")]
    BaseProjection {
        /// The projection (`layer 3 qkv`, `layer 1 expert 5 gate_up`, `lm_head`).
        site: String,
        /// The device layer's error.
        #[source]
        source: lora_kernels::KernelError,
    },
    /// An answer file that is not one (see `answers.rs`).
    #[error("{path}: {reason}")]
    Answers {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The request file is not a valid request list.
    #[error("requests: {reason}")]
    Requests {
        /// What is wrong with it.
        reason: String,
    },
    /// One request cannot be served as asked.
    #[error("request {index}: {reason}")]
    Request {
        /// Its index in submission order.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The model's `config.json` is not one the adapter layer serves.
    #[error("{path}: {source}")]
    LoraConfig {
        /// The config file.
        path: PathBuf,
        /// Why.
        #[source]
        source: lora_layout::ConfigError,
    },
    /// The model's token tables could not be read for the overlays.
    #[error("{path}: {source}")]
    BaseTables {
        /// The weights file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<lora_audit::AuditError>,
    },
    /// Two adapters given under one name.
    #[error("adapter `{name}` is named twice")]
    DuplicateAdapter {
        /// The name.
        name: String,
    },
    /// An adapter the audit refuses: nothing of it would be served right.
    #[error("adapter `{name}` is refused:\n{report}")]
    AdapterRefused {
        /// The adapter.
        name: String,
        /// The audit's reasons.
        report: String,
    },
    /// An adapter that could not be read.
    #[error("adapter `{name}`: {source}")]
    Adapter {
        /// The adapter.
        name: String,
        /// Why.
        #[source]
        source: Box<lora_audit::AuditError>,
    },
    /// The pool refused a call (a swap onto a held slot, a full pool, ...).
    #[error(transparent)]
    Pool(#[from] lora_pool::PoolError),
    /// A tensor-parallel placement that does not divide the model's
    /// geometry, naming the dimension.
    #[error(transparent)]
    Placement(#[from] lora_layout::PlacementError),
    /// Something the reference engine does not run tensor-parallel.
    #[error("not served tensor-parallel: {what}")]
    NotTensorParallel {
        /// What.
        what: String,
    },
    /// A collective of the tensor-parallel group failed.
    #[error("collective: {0}")]
    Collective(String),
    /// The MoE folds refused a call.
    #[error(transparent)]
    Moe(#[from] lora_moe::MoeError),
    /// The token overlays refused a call.
    #[error(transparent)]
    Overlay(#[from] lora_overlay::OverlayError),
}
