//! `lora-moe`: routed-expert and router LoRA deltas, folded onto an MoE
//! layer's grouped-GEMM outputs and gate logits for batches that mix
//! adapters.
//!
//! The expert and router pairs live in the pool's expert pool
//! ([`lora_pool::ExpertPool`]: one PairEntry per (layer, projection,
//! expert, slot), padded to the expert stride); both PEFT formats arrive
//! there as per-(expert, Gate | Up | Down) pairs. This crate applies them:
//!
//! - [`resolve_routes`]: each request's [`MoeLoraRoute`] (Fold, Skip,
//!   Refuse) from the pool's slot state and its `experts` option.
//! - [`MoeLora`]: persistent, fixed-address scratch sized up front
//!   ([`MoeCapacity`]) and the current batch. [`MoeLora::set_decode_step`]
//!   and [`MoeLora::set_prefill_step`] write the per-token adapter map from
//!   the pool's current [`DecodeStep`](lora_pool::DecodeStep) or
//!   [`PrefillStep`](lora_pool::PrefillStep), whose routes the pool resolved
//!   when it built the step (a request whose route is `Refuse` never makes
//!   one). Every index and fold call takes that same step: another one is
//!   refused before launch with `MoeError::Pool(PoolError::StaleStep)`.
//! - Per MoE layer: [`MoeLora::apply_router_lora`] (router delta onto the
//!   gate logits, f32 or bf16, before top-k); [`MoeLora::index_decode_rows`]
//!   / [`MoeLora::index_sorted_rows`] (each expert row's table entry from
//!   `topk_ids`, or from the grouped GEMM's `sorted_token` and
//!   `expert_offsets`); [`MoeLora::apply_expert_lora_decode`] /
//!   [`MoeLora::apply_expert_lora_sorted`] (the gate_up and down deltas, see
//!   [`ExpertTarget`]). These only launch kernels on fixed buffers, so they
//!   can be captured in a CUDA graph.
//! - [`SortedRouting`]: the expert-sorted order of a batch built on the
//!   host; [`ExpertLoraLayer`]: which experts a slot adapts at a layer, and
//!   the row blocks of a sort that fold them.
//! - Expert parallelism (`LoraOptions::placement`'s `ep_rank` / `ep_world`):
//!   a rank's expert pool holds its block of experts and the replicated
//!   router; [`MoeLora::dispatch_map`] is the per-token adapter map the
//!   engine sends alongside its token dispatch (all-to-all), and
//!   [`MoeLora::receive_dispatch_map`] where it lands on the rank that
//!   folds the dispatched tokens.
//! - [`probe_expert_lora`]: expert and router `probe_in::` probes answered
//!   through the pool and the kernels (`cargo xtask probe`).
//!
//! What it must never do: run a request without its adapter (a `Refuse` is
//! an error before launch, never a `-1` row); allocate device memory, copy
//! from the host or synchronise inside an index or fold call; name a cudarc
//! type (kernels come from `lora-kernels`); hold expert weights of its own
//! (they belong to the pool, which may swap them between batches).
//!
//! ```
//! use lora_kernels::{Device, Rows, RowsMut};
//! use lora_layout::{ModelConfig, MoeLoraRoute};
//! use lora_moe::{MoeCapacity, MoeError, MoeLora};
//! use lora_pool::{BatchCapacity, LoraOptions, LoraPool, PoolError, StepRow};
//!
//! let cfg = ModelConfig::from_hf_config(r#"{
//!     "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 1,
//!     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
//!     "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4,
//!     "num_experts_per_tok": 2, "vocab_size": 64 }"#)?;
//! let opts = LoraOptions { experts: true, ..LoraOptions::default() };
//! let device = Device::cpu();
//! let capacity = BatchCapacity { max_rows: 16, max_segments: 4 };
//! let mut pool = LoraPool::new(&device, cfg, opts, capacity)?;
//! let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(8, 2))?;
//! // Two base-model requests, padded to four rows: nothing to fold.
//! let step = pool.decode_step(&[StepRow::Base, StepRow::Base], 4)?;
//! let routes = moe.set_decode_step(&pool, &step)?;
//! assert_eq!(routes, [MoeLoraRoute::Skip, MoeLoraRoute::Skip]);
//! // An adapter that is not resident gets no lease, so it never joins a step.
//! assert!(matches!(pool.acquire("absent"), Err(PoolError::NotResident(_))));
//! let x = device.alloc_zeros(4 * 32)?;
//! let mut logits = device.alloc_zeros::<f32>(4 * 4)?;
//! moe.apply_router_lora(&pool, &step, 0, Rows::dense(&x, 4, 32), RowsMut::dense(&mut logits, 4, 4))?;
//! // The folds take the step the batch was set from, and no other.
//! let next = pool.decode_step(&[StepRow::Base], 4)?;
//! let err = moe.apply_router_lora(&pool, &next, 0, Rows::dense(&x, 4, 32), RowsMut::dense(&mut logits, 4, 4));
//! assert!(matches!(err, Err(MoeError::Pool(PoolError::StaleStep { .. }))));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod expert_layer;
mod fold;
mod layer;
mod probe;
mod route;
mod sorted;
mod target;
#[cfg(test)]
mod test_support;

pub use error::MoeError;
pub use expert_layer::ExpertLoraLayer;
pub use fold::SortedRows;
pub use layer::{MoeCapacity, MoeLora};
pub use lora_layout::{ExpertWork, MoeLoraRoute, RefuseReason, RouteRefused};
pub use probe::{ExpertProbeOutputs, probe_expert_lora};
pub use route::{MoeRequest, experts_enabled, resolve_request_route, resolve_routes};
pub use sorted::SortedRouting;
pub use target::ExpertTarget;
