//! `lora-pool`: the fixed-address slot pool at the heart of serving.
//!
//! [`LoraPool`] holds `max_loras` equal slots padded to `max_rank` in one
//! device allocation, per-(layer, module) `[max_loras]` PairEntry tables
//! (addresses of each slot's A and B, the pair's own scale and rank) and,
//! for MoE models, an [`ExpertPool`]. It loads adapters at startup, swaps
//! them from disk at runtime, promotes on-demand adapters through an LRU
//! cache with pinned slots, keeps a host tier of packed images in pinned
//! host memory that a prefetch worker fills (a promotion from it is one
//! copy: [`LoraPool::prefetch`]), publishes peer-landed images, and gives the
//! engine one apply call per (layer, modules) for decode, mixed prefill and
//! one-adapter prefill, each taking the step whose rows it runs.
//!
//! A pool built for DoRA ([`LoraOptions::dora`]) takes the engine's
//! [`BaseWeights`] ([`LoraPool::set_base_weights`]), computes each DoRA
//! adapter's per-row rescale when it is staged, and every apply's expand
//! rescales the rows of DoRA slots in its epilogue (the mixed batch stays
//! one launch); without
//! the base weights a DoRA adapter is refused,
//! `REJECT[dora-needs-base-weights]`. Every route carries a DoRA adapter:
//! the host tier and a peer landing keep its magnitudes beside the packed
//! pairs ([`DoraMagnitudes`]), and its rescale is computed when it is
//! promoted, as a disk swap computes it.
//!
//! Under a tensor-parallel placement (`LoraOptions::placement`,
//! `LORA_TP_RANK` / `LORA_TP_WORLD`) a pool holds only its rank's shard of
//! each pair (`lora_layout::ModuleShard`): the packer cuts the whole
//! tensors it is given, its slots shrink accordingly, and an apply takes the
//! rank's input (its input columns, for a row-parallel module) and writes
//! the rank's output ([`FusedTargets::single_at`], [`FusedTargets::qkv_at`],
//! [`FusedTargets::gate_up_at`]). With the vocab-parallel cut
//! (`lora_layout::Placement::vocab_parallel`, `LORA_VOCAB_PARALLEL`) the
//! embedding pair holds A's columns of the rank's vocabulary block
//! ([`LoraPool::apply_embedding`] adds nothing to another rank's tokens)
//! and the head pair B's rows of it (the head applies write the rank's
//! logit columns). Routed experts are placed by expert
//! parallelism (`LORA_EP_RANK` / `LORA_EP_WORLD`): the audit keeps the
//! rank's block of experts and the replicated router, so its expert slots
//! hold only those; without it, a tensor-parallel pool serves no
//! routed-expert or router deltas
//! ([`PoolError::ExpertsUnderTensorParallel`]). DoRA is not served on a
//! placed pool ([`PoolError::DoraPlaced`]): its rescale divides by the norm
//! of each whole weight row, which a row-parallel rank does not hold.
//! Under the placement's fully-sharded option a column-parallel pair's A
//! holds only the rank's block of rank rows too, and its deltas are served
//! by [`LoraPool::apply_fully_sharded`] (shrink, the caller's
//! [`RankGather`] all-gather of the ranks' shrink outputs, expand); the
//! other apply calls refuse such a module ([`PoolError::RankSplit`]). The
//! fully-sharded apply has no DoRA epilogue and refuses a DoRA pool (DoRA
//! is served at world 1 only, where the fused applies serve every module).
//!
//! What it must never do: move (the pool, tables and routing buffers keep
//! their device addresses for the pool's life, so captured CUDA graphs stay
//! valid across swaps); overwrite a slot a request or a step holds
//! ([`SlotLease`]); publish anything before it was audited, converted and
//! staged (a failed load or swap leaves every slot as it was); let a step
//! row name a slot that cannot serve.
//!
//! # Steps
//!
//! Rows reach the kernels only through steps. A request holds a
//! [`SlotLease`] on its adapter for its life ([`LoraPool::acquire`], or
//! [`LoraPool::promote`]); each forward pass builds a [`DecodeStep`]
//! ([`LoraPool::decode_step`]) or a [`PrefillStep`]
//! ([`LoraPool::prefill_step`]) from its requests' leases, or
//! [`StepRow::Base`] for a request on the base model, and passes that step
//! to every apply call. Nothing else writes the device row buffers.
//!
//! - A step holds a lease on every slot it names until it is dropped: an
//!   eviction, disk swap or peer landing into such a slot is refused with
//!   [`PoolError::SlotInUse`] and promotion never picks it, so every slot
//!   serves the adapter the step was built against for as long as the step
//!   lives.
//! - Building a step makes the previous step of its kind stale: an apply
//!   call or [`LoraPool::step_slots`] with it is refused with
//!   [`PoolError::StaleStep`] (as is another pool's step), so the row
//!   buffers always hold the rows of the step passed in. A lease of another
//!   pool is refused with [`PoolError::ForeignLease`].
//! - A step carries each request's adapter identity ([`Step::adapter_id`],
//!   0 for the base model) for prefix and KV cache keys, and its MoE route
//!   ([`Step::moe_routes`]), so no other part of the forward pass needs to
//!   know slots.
//! - Before a slot is written, the rows of a dropped step that named it are
//!   reset to the base model, so a captured graph replayed without a new
//!   step never serves the slot's next adapter.
//!
//! # Example
//!
//! An engine's whole use of the pool (the README's example; the bundled
//! fixtures and the CPU backend):
//!
//! ```rust
//! use std::path::Path;
//! use half::bf16;
//! use lora_audit::audit_adapter;
//! use lora_kernels::{Device, Rows, RowsMut};
//! use lora_layout::ModelConfig;
//! use lora_pool::{AdapterSource, BatchCapacity, FusedTargets, LoraOptions, LoraPool, PoolError, StepRow};
//!
//! let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
//! let cfg = ModelConfig::from_file(&fixtures.join("config.json"))?;
//! let opts = LoraOptions { max_loras: 4, max_rank: 16, rotatable: true, ..LoraOptions::default() };
//!
//! // 1. Audit: every tensor placed, or refused with a reason.
//! let report = audit_adapter(&fixtures.join("demo_r8_rslora"), &cfg, &opts)?;
//! assert!(report.is_servable(), "{}", report.to_text(&cfg));
//!
//! // 2. Load the pool (one fixed allocation; slots past the adapters stay empty).
//! let device = Device::cpu();
//! let (a, b) = (fixtures.join("demo_r4_plain"), fixtures.join("demo_r8_rslora"));
//! let adapters = [AdapterSource { name: "sql", dir: &a }, AdapterSource { name: "chat", dir: &b }];
//! let mut pool = LoraPool::load(&device, cfg.clone(), opts, BatchCapacity::default(), &adapters)?;
//!
//! // 3. Each request leases its adapter for its life; each decode step names
//! //    one row per request (a lease, or the base model) and holds those slots.
//! //    Then the deltas of q/k/v onto the fused qkv output, in one launch.
//! let (sql, chat) = (pool.acquire("sql")?, pool.acquire("chat")?);
//! let step = pool.decode_step(&[StepRow::Adapter(&sql), StepRow::Base, StepRow::Adapter(&chat)], 3)?;
//! let qkv = FusedTargets::qkv(&cfg); // q | k | v columns, from the config
//! let w = qkv.width();
//! let x = device.upload(&vec![bf16::from_f32(0.5); 3 * cfg.hidden_size])?;
//! let mut y = device.alloc_zeros::<bf16>(3 * w)?; // the base projection's output
//! pool.apply_decode(&step, 0, &qkv, Rows::dense(&x, 3, cfg.hidden_size), RowsMut::dense(&mut y, 3, w))?;
//! let out = y.download()?;
//! assert!(out[w..2 * w].iter().all(|v| v.to_f32() == 0.0)); // the base row got no delta
//!
//! // 4. Swap between steps: a slot a step or lease holds is never overwritten.
//! let (slot, tools) = (sql.slot(), fixtures.join("rslora"));
//! assert!(matches!(pool.evict(slot), Err(PoolError::SlotInUse { .. })));
//! assert!(matches!(pool.swap_from_disk(slot, "tools", &tools), Err(PoolError::SlotInUse { .. })));
//! drop((step, sql));
//! let swapped = pool.swap_from_disk(slot, "tools", &tools)?;
//! println!("slot {slot} now serves `tools`, identity {:#x}", swapped.adapter_id);
//!
//! // 5. Or land it beside the steps: begin_swap queues the slot's bytes on the
//! //    device's copy lane and returns; steps over the other slots go on.
//! pool.evict(slot)?;
//! pool.begin_swap(slot, "tools", &tools)?;
//! let _step = pool.decode_step(&[StepRow::Adapter(&chat)], 1)?;
//! while pool.swap_landed()? == Some(false) {} // an engine steps here instead
//! pool.finish_swap()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod companion;
mod dora;
mod error;
mod expert;
mod gather;
mod host_tier;
pub mod image;
mod lease;
mod pool;
mod prefetch;
mod registry;
mod slot;
mod staging;
mod step;
mod streaming;
mod target;

pub use companion::{NoCompanion, SlotCompanion};
pub use dora::{BaseWeights, DeviceProjection, DoraMagnitude, DoraMagnitudes};
pub use error::PoolError;
pub use expert::ExpertPool;
pub use gather::RankGather;
pub use host_tier::{HostTierView, TierError};
pub use lease::{SlotLease, SlotUse};
pub use lora_audit::LoraOptions;
pub use lora_audit::dora::BaseProjection;
pub use pool::{AdapterSource, BatchCapacity, LandedImages, LoraPool, SwapReport, SwapRoute};
pub use prefetch::PrefetchEvent;
pub use registry::{AdapterSlot, SlotRegistry};
pub use slot::{RowSlot, SlotId};
pub use staging::StagingTuning;
pub use step::{DecodeStep, PrefillSeq, PrefillStep, Step, StepId, StepKind, StepRow, StepSlots};
pub use target::{FusedTargets, ModuleTarget};

/// The README's engine example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExample;

#[cfg(test)]
mod tests {
    /// The lines of the first Rust code block of `text`, read from the
    /// lines that start with `prefix` (less the prefix and one space).
    fn first_rust_block(text: &str, prefix: &str) -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .map(|l| l.strip_prefix(' ').unwrap_or(l).to_string())
            .skip_while(|l| l != "```rust")
            .skip(1)
            .take_while(|l| l != "```")
            .collect()
    }

    #[test]
    fn the_crate_docs_show_the_readme_example() {
        let readme = first_rust_block(include_str!("../../README.md"), "");
        let docs = first_rust_block(include_str!("lib.rs"), "//!");
        assert!(readme.len() > 10, "the README's example was not found");
        assert_eq!(docs, readme, "the crate docs' example is not the README's");
    }
}
