//! `lora-engine`: the reference engine — a minimal decoder that serves
//! mixed-adapter batches through the adapter layer's public API only, as an
//! engine author would, and proves the parts together against PEFT.
//!
//! # Brief overview
//!
//! * [`Engine`] is the serving loop: continuous batching of [`Request`]s
//!   (prefill and decode steps, requests arriving and finishing at
//!   different steps), one [`lora_pool::SlotLease`] per adapted request for
//!   its whole life, more adapters than slots (promotion evicts the least
//!   recently used idle adapter), a prefix cache keyed by the adapter
//!   identity hash, and the pool open to swaps between steps
//!   ([`Engine::pool_mut`]). `cargo xtask serve` is its command line.
//! * Every delta reaches the forward through a pool step: per step the
//!   engine builds a [`lora_pool::DecodeStep`] or [`lora_pool::PrefillStep`]
//!   from the requests' leases, sets the MoE rows from it, and the hooks
//!   apply q/k/v onto the fused qkv output, o, gate/up, down, the router
//!   fold before top-k, the expert folds (expanded rows in decode, expert
//!   sorted rows in prefill), and the token overlays of the embedding and
//!   the lm_head, each with that step.
//! * [`Model`] is the base: a Hugging Face folder (`config.json` +
//!   `model.safetensors`, F32 or BF16) of a llama, mistral, qwen2, qwen3,
//!   qwen3_moe or mixtral model, run in f32 ([`Model::forward`] over
//!   packed [`SeqChunk`]s with [`KvCache`]s); it matches transformers 5's
//!   fp32 forward of each family. [`Model::load_on`] (what [`Engine::load`]
//!   uses) puts the base projections on a CUDA device: f32 weights uploaded
//!   once, each projection a cuBLAS SGEMM; on the CPU backend the model runs
//!   on the host. [`DeltaHooks`] is the seam where deltas enter;
//!   [`NoDeltas`] runs the base alone.
//! * Ranks: [`Engine::load_rank`] serves one rank of a group over a
//!   [`Collective`] ([`HostCollective`] for ranks as threads,
//!   [`NcclCollective`] on a rank's GPU). Dense families run
//!   tensor-parallel ([`Model::shard`] cuts the base as the pool cuts the
//!   pairs; o_proj and down_proj outputs are all-reduced). MoE families
//!   run expert-parallel: each rank holds its block of experts (base and
//!   deltas) and the router, and each MoE layer dispatches tokens to the
//!   ranks holding their experts with the per-token adapter map
//!   ([`Collective::all_to_all_v`], `lora_moe::MoeLora::dispatch_map`),
//!   with the attention and dense layers replicated or tensor-parallel
//!   over the same ranks.
//!
//! ```no_run
//! use lora_engine::{AdapterDir, Engine, EngineOptions, Request};
//! use lora_kernels::Device;
//! use lora_pool::LoraOptions;
//! # fn main() -> Result<(), lora_engine::EngineError> {
//! let adapters = [AdapterDir { name: "sql".into(), dir: "adapters/sql".into() }];
//! let lora = LoraOptions { max_loras: 1, max_rank: 16, ..LoraOptions::default() };
//! let mut engine = Engine::load("model".as_ref(), &adapters, &Device::cpu(), lora, EngineOptions::default())?;
//! let sql = engine.submit(Request { prompt: vec![1, 2, 3], adapter: Some("sql".into()), max_new_tokens: 4 })?;
//! let base = engine.submit(Request { prompt: vec![7], adapter: None, max_new_tokens: 2 })?;
//! engine.run()?;
//! assert_eq!(engine.output(sql).map(|o| o.tokens.len()), Some(4));
//! assert_eq!(engine.output(base).map(|o| o.tokens.len()), Some(2));
//! # Ok(()) }
//! ```
//!
//! **Architecture invariants:** the engine never computes a delta or
//! builds a kernel row itself — every number added to the base comes from
//! the library's kernels, every row from a pool step built from leases;
//! the base model ([`Model`], `forward`, `hooks`) knows nothing of
//! adapters. The base runs in f32 on every backend: on the CPU backend
//! wholly on the host; on CUDA its projections (q|k|v, o, gate|up, down,
//! router, experts, lm_head) run through cuBLAS SGEMM on the device and the
//! rest (embedding, norms, RoPE, attention, routing, KV caches) on the
//! host, while the deltas, overlays and MoE folds run on the device
//! through the library's kernels.
#![deny(missing_docs)]

mod adapted;
mod answers;
mod base_weights;
mod collective;
mod config;
mod engine;
mod error;
mod expert_parallel;
mod forward;
mod hooks;
mod kv_cache;
mod math;
mod model;
mod prefix;
mod projection;
mod request;
mod shard;
mod tensors;
#[cfg(test)]
mod test_support;

pub use answers::{
    ANSWER_TOLERANCE, Answer, Answers, Comparison, NEAR_TIE, TokenMatch, compare, rel_error, steps_before_near_tie,
    write_answers,
};
pub use collective::{Collective, CollectiveGather, HostCollective, NcclCollective};
pub use config::{BaseConfig, Family, LayerConfig, MlpKind, MoeConfig};
pub use engine::{AdapterDir, Engine, EngineOptions};
pub use error::{BoxError, EngineError};
pub use forward::SeqChunk;
pub use hooks::{DeltaHooks, NoDeltas};
pub use kv_cache::KvCache;
pub use model::Model;
pub use request::{
    EngineEvent, MAX_REQUESTS, MAX_REQUESTS_BYTES, MAX_SEQUENCE_TOKENS, Request, RequestOutput, parse_requests,
};
