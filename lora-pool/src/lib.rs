//! `lora-pool`: the fixed-address slot pool at the heart of serving.
//!
//! [`LoraPool`] holds `max_loras` equal slots padded to `max_rank` in one
//! device allocation, per-(layer, module) `[max_loras]` PairEntry tables
//! (addresses of each slot's A and B, the pair's own scale and rank) and,
//! for MoE models, an [`ExpertPool`]. It loads adapters at startup, swaps
//! them from disk at runtime, promotes on-demand adapters through an LRU
//! cache with pinned slots, publishes peer-landed images, and gives the
//! engine one apply call per (layer, modules) for decode, mixed prefill and
//! one-adapter prefill.
//!
//! What it must never do: move (the pool, tables and routing buffers keep
//! their device addresses for the pool's life, so captured CUDA graphs stay
//! valid across swaps); overwrite a slot a request holds ([`SlotLease`]);
//! publish anything before it was audited, converted and staged (a failed
//! load or swap leaves every slot as it was); let a batch row name an empty
//! slot.

mod companion;
mod error;
mod expert;
pub mod image;
mod lease;
mod pool;
mod registry;
mod staging;
mod streaming;

pub use companion::{NoCompanion, SlotCompanion};
pub use error::PoolError;
pub use expert::ExpertPool;
pub use lease::{SlotLease, SlotUse};
pub use lora_audit::LoraOptions;
pub use pool::{AdapterSource, BatchCapacity, LoraPool, ModuleTarget, SwapReport, SwapRoute};
pub use registry::{AdapterSlot, SlotRegistry};
pub use staging::StagingTuning;

/// The README's engine example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExample;
