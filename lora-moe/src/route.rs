//! Route resolution: which expert-pool slot, if any, folds each request's
//! MoE deltas, decided from the pool's slot state and its `experts` option.
//!
//! A request resolves to `Fold` (its adapter's expert and router pairs are
//! resident), `Skip` (the base model, or an adapter without expert or router
//! deltas) or `Refuse` (deltas that cannot be applied). Resolution itself
//! never fails on a `Refuse`; the batch setters of [`crate::MoeLora`] turn one
//! into an error before anything is written or launched.

use lora_layout::{MoeAdapterState, MoeLoraRoute, resolve_moe_lora_route};
use lora_pool::{LoraPool, SlotCompanion, SlotId};

use crate::error::MoeError;

/// A request's adapter, as the MoE layer is told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeRequest<'a> {
    /// The base model: nothing to fold.
    Base,
    /// A resident adapter's slot (the request's `SlotLease::slot`).
    Slot(SlotId),
    /// An adapter by name. A name no slot holds resolves to
    /// `Refuse(NotResident)`: its expert deltas, if it has any, are not
    /// resident, and the request must not run as the base model.
    Adapter(&'a str),
}

/// Whether the pool folds expert and router deltas at all: the `experts`
/// option is on and the pool has an expert pool (an MoE model).
pub fn experts_enabled<C: SlotCompanion>(pool: &LoraPool<C>) -> bool {
    pool.options().experts && pool.experts().is_some()
}

/// The route of request `row`. An error only for a slot that does not
/// exist or holds no adapter; a `Refuse` is returned as a route.
pub fn resolve_request_route<C: SlotCompanion>(
    pool: &LoraPool<C>,
    row: usize,
    request: MoeRequest<'_>,
) -> Result<MoeLoraRoute, MoeError> {
    let enabled = experts_enabled(pool);
    let slot = match request {
        MoeRequest::Base => return Ok(resolve_moe_lora_route(None, enabled)),
        MoeRequest::Slot(slot) => slot,
        MoeRequest::Adapter(name) => match pool.slot_of(name) {
            Some(slot) => slot,
            None => {
                // Not resident: assume the worst, so it is refused rather
                // than served without deltas it may have.
                let unknown = MoeAdapterState {
                    has_expert_deltas: true,
                    expert_slot: None,
                };
                return Ok(resolve_moe_lora_route(Some(unknown), enabled));
            }
        },
    };
    let max_loras = pool.options().max_loras;
    if slot.index() >= max_loras {
        return Err(MoeError::NoSuchSlot {
            row,
            slot: slot.index(),
            max_loras,
        });
    }
    let state = pool.moe_state(slot).ok_or(MoeError::EmptySlot {
        row,
        slot: slot.index(),
    })?;
    Ok(resolve_moe_lora_route(Some(state), enabled))
}

/// The route of every request, in order (see [`resolve_request_route`]).
pub fn resolve_routes<C: SlotCompanion>(
    pool: &LoraPool<C>,
    requests: &[MoeRequest<'_>],
) -> Result<Vec<MoeLoraRoute>, MoeError> {
    requests
        .iter()
        .enumerate()
        .map(|(row, &request)| resolve_request_route(pool, row, request))
        .collect()
}
