//! [`MoeLora`]: the persistent, fixed-address scratch of the MoE folds (the
//! per-token adapter map and the per-row expert entry index) and the batch
//! state that fills it.
//!
//! A batch is set from a pool step, whose routes the pool resolved when it
//! built the step (a step with a `Refuse` route is never built); setting it
//! is the only call that copies from the host, and it records the step,
//! which every index and fold call must then pass. The index builders and the folds (`fold.rs`) then
//! only launch kernels on buffers whose addresses never change, so one
//! layer's `index → gate_up fold → down fold` (and the router fold) can be
//! captured in a CUDA graph and replayed with new batch contents.

use lora_kernels::{Device, DeviceBuffer};
use lora_layout::{MoeLoraRoute, build_moe_row_adapter_decode, build_moe_row_adapter_host, ensure_batch_servable};
use lora_pool::{DecodeStep, LoraPool, PrefillStep, SlotCompanion, Step, StepId};

use crate::error::MoeError;

/// The largest batch an [`MoeLora`] serves; its scratch is sized from this
/// once, up front.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeCapacity {
    /// Most tokens in one batch (decode: padded sequences; prefill: packed
    /// tokens).
    pub max_tokens: usize,
    /// Most expert-sorted rows, padding included, in one sorted fold.
    pub max_sorted_rows: usize,
}

impl MoeCapacity {
    /// Room for `max_tokens` tokens routed to `top_k` experts each, sorted
    /// without padding.
    pub fn for_tokens(max_tokens: usize, top_k: usize) -> MoeCapacity {
        MoeCapacity {
            max_tokens,
            max_sorted_rows: max_tokens.saturating_mul(top_k),
        }
    }
}

/// The expert geometry the scratch was sized for, checked against the pool
/// on every call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) num_experts: usize,
    pub(crate) top_k: usize,
    pub(crate) max_loras: usize,
    /// The expert pool's rank stride; `None` when the pool serves no experts.
    pub(crate) stride: Option<usize>,
    pub(crate) pool_addr: u64,
}

impl Geometry {
    pub(crate) fn of<C: SlotCompanion>(pool: &LoraPool<C>) -> Result<Geometry, MoeError> {
        let cfg = pool.config();
        let moe = cfg.moe.as_ref().ok_or(MoeError::NotMoe {
            model_type: cfg.family.model_type(),
        })?;
        Ok(Geometry {
            num_experts: moe.num_experts,
            top_k: moe.top_k,
            max_loras: pool.options().max_loras,
            stride: pool.experts().map(|e| e.stride()),
            pool_addr: pool.pool_addr(),
        })
    }
}

/// Which rows the expert entry index currently describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertRows {
    /// None since the last batch was set.
    Unset,
    /// The `n_tokens * top_k` expanded rows of the batch, token major.
    Expanded(usize),
    /// `n` expert-sorted rows.
    Sorted(usize),
}

/// The MoE LoRA apply layer: persistent scratch plus the current batch,
/// over a [`LoraPool`] and its expert pool.
///
/// Per batch: [`set_decode_step`](MoeLora::set_decode_step) or
/// [`set_prefill_step`](MoeLora::set_prefill_step), from the pool's step.
/// Per MoE layer: the
/// router fold before top-k, then, after the engine routes and sorts,
/// the index of the expert rows and the gate_up and down folds.
pub struct MoeLora {
    pub(crate) device: Device,
    pub(crate) geometry: Geometry,
    pub(crate) capacity: MoeCapacity,
    /// `i32[max_tokens]`: each token's expert-pool slot, or -1.
    pub(crate) row_adapter: DeviceBuffer<i32>,
    /// Tokens of the current batch; `None` before the first one.
    pub(crate) n_tokens: Option<usize>,
    /// The step the batch was set from; every index and fold call must
    /// pass that same step.
    pub(crate) step: Option<StepId>,
    /// `i32[max(max_tokens * top_k, max_sorted_rows)]`: each expert row's
    /// entry `expert * max_loras + slot`, or -1.
    pub(crate) expert_idx: DeviceBuffer<i32>,
    pub(crate) expert_rows: ExpertRows,
}

impl MoeLora {
    /// Scratch for `pool`'s model and expert pool, sized for `capacity`.
    pub fn new<C: SlotCompanion>(pool: &LoraPool<C>, capacity: MoeCapacity) -> Result<MoeLora, MoeError> {
        let geometry = Geometry::of(pool)?;
        let expanded = capacity
            .max_tokens
            .checked_mul(geometry.top_k)
            .ok_or_else(|| MoeError::shape("capacity", "max_tokens * top_k overflows"))?;
        let idx_len = expanded.max(capacity.max_sorted_rows);
        if i32::try_from(idx_len).is_err() {
            return Err(MoeError::BatchTooLarge {
                what: "expert rows",
                got: idx_len,
                capacity: i32::MAX as usize,
            });
        }
        let device = pool.device().clone();
        Ok(MoeLora {
            row_adapter: device.upload(&vec![-1i32; capacity.max_tokens.max(1)])?,
            expert_idx: device.upload(&vec![-1i32; idx_len.max(1)])?,
            device,
            geometry,
            capacity,
            n_tokens: None,
            step: None,
            expert_rows: ExpertRows::Unset,
        })
    }

    /// What the scratch was sized for.
    pub fn capacity(&self) -> MoeCapacity {
        self.capacity
    }

    /// Experts each token is routed to (the model's `num_experts_per_tok`).
    pub fn top_k(&self) -> usize {
        self.geometry.top_k
    }

    /// Tokens of the current batch (`None` before the first batch).
    pub fn n_tokens(&self) -> Option<usize> {
        self.n_tokens
    }

    /// The current per-token adapter map (`i32`, -1 = nothing to fold); its
    /// address never changes.
    pub fn row_adapter(&self) -> &DeviceBuffer<i32> {
        &self.row_adapter
    }

    /// Expert parallelism, sending side: the buffer the engine sends
    /// alongside its token dispatch (all-to-all), `i32[n_tokens]`, token
    /// `t`'s expert-pool slot or -1, in the batch's token order; returns
    /// the buffer and `n_tokens`. The engine sends entry `t` wherever it
    /// sends token `t` (once per destination rank, as it sends the
    /// token's activations), and lands what it receives with
    /// [`MoeLora::receive_dispatch_map`]. Slot numbers mean the same
    /// adapter on every rank only if the ranks' pools hold the same
    /// adapters in the same slots: the engine loads, swaps and evicts them
    /// in lockstep across the expert-parallel group.
    ///
    /// Errors: [`MoeError::NotRouted`] before a batch is set.
    pub fn dispatch_map(&self) -> Result<(&DeviceBuffer<i32>, usize), MoeError> {
        let n = self.n_tokens.ok_or_else(|| MoeError::NotRouted {
            call: "dispatch_map",
            reason: "no batch is set (set_decode_step / set_prefill_step)".into(),
        })?;
        Ok((&self.row_adapter, n))
    }

    /// Expert parallelism, receiving side: make the batch of this rank's
    /// expert folds the `n_tokens` tokens the engine's dispatch brought
    /// here, under `step` (this rank's pool's current step, which the
    /// index and fold calls must then pass), and return the per-token map
    /// buffer, `i32[max_tokens]`, into whose first `n_tokens` entries the
    /// engine lands the map entries that travelled with those tokens
    /// ([`MoeLora::dispatch_map`] on the sending ranks), before the index
    /// calls. The buffer's address never changes; nothing is copied here
    /// (a device-to-device landing stays graph-capturable).
    ///
    /// Errors: another pool, a stale step, or more tokens than the scratch
    /// holds; nothing changes.
    pub fn receive_dispatch_map<C: SlotCompanion, S: lora_pool::Step>(
        &mut self,
        pool: &LoraPool<C>,
        step: &S,
        n_tokens: usize,
    ) -> Result<&mut DeviceBuffer<i32>, MoeError> {
        self.check_pool(pool)?;
        pool.check_step(step)?;
        self.check_tokens(n_tokens)?;
        self.n_tokens = Some(n_tokens);
        self.step = Some(step.id());
        self.expert_rows = ExpertRows::Unset;
        Ok(&mut self.row_adapter)
    }

    /// The current per-row expert entry index (`i32`); its address never
    /// changes.
    pub fn expert_index(&self) -> &DeviceBuffer<i32> {
        &self.expert_idx
    }

    /// An error unless `pool` is the pool the scratch was made for, shaped
    /// as it was then.
    pub(crate) fn check_pool<C: SlotCompanion>(&self, pool: &LoraPool<C>) -> Result<(), MoeError> {
        if !pool.device().same_as(&self.device) {
            return Err(MoeError::PoolMismatch("the pool lives on another device".into()));
        }
        let now = Geometry::of(pool)?;
        if now != self.geometry {
            return Err(MoeError::PoolMismatch(format!(
                "the scratch was made for {:?}, the pool is {now:?}",
                self.geometry
            )));
        }
        Ok(())
    }

    /// Set a decode batch from the pool's current decode `step`: one token
    /// per request, the step's padded rows in all (padding rows fold
    /// nothing). The routes are the step's own (a step with a `Refuse`
    /// route is never built); returns them.
    pub fn set_decode_step<C: SlotCompanion>(
        &mut self,
        pool: &LoraPool<C>,
        step: &DecodeStep,
    ) -> Result<Vec<MoeLoraRoute>, MoeError> {
        self.check_pool(pool)?;
        pool.check_step(step)?;
        self.check_tokens(step.padded_rows())?;
        let routes = step.moe_routes().to_vec();
        ensure_batch_servable(&routes)?;
        let rows = build_moe_row_adapter_decode(&routes, step.padded_rows());
        self.publish_rows(&rows, step.id())?;
        Ok(routes)
    }

    /// Set a packed prefill batch from the pool's current prefill `step`:
    /// sequence `b` is rows `cu_seqlens[b] .. cu_seqlens[b + 1]` and runs
    /// the step's route `b`; returns the routes.
    pub fn set_prefill_step<C: SlotCompanion>(
        &mut self,
        pool: &LoraPool<C>,
        step: &PrefillStep,
    ) -> Result<Vec<MoeLoraRoute>, MoeError> {
        self.check_pool(pool)?;
        pool.check_step(step)?;
        let routes = step.moe_routes().to_vec();
        ensure_batch_servable(&routes)?;
        let slots: Vec<i32> = build_moe_row_adapter_decode(&routes, routes.len());
        let rows = build_moe_row_adapter_host(step.cu_seqlens(), &slots)?;
        self.check_tokens(rows.len())?;
        self.publish_rows(&rows, step.id())?;
        Ok(routes)
    }

    fn check_tokens(&self, n: usize) -> Result<(), MoeError> {
        if n > self.capacity.max_tokens {
            return Err(MoeError::BatchTooLarge {
                what: "tokens",
                got: n,
                capacity: self.capacity.max_tokens,
            });
        }
        Ok(())
    }

    fn publish_rows(&mut self, rows: &[i32], step: StepId) -> Result<(), MoeError> {
        self.n_tokens = None;
        self.step = None;
        self.row_adapter.write(0, rows)?;
        self.n_tokens = Some(rows.len());
        self.step = Some(step);
        self.expert_rows = ExpertRows::Unset;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
