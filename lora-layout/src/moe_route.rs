//! MoE LoRA routing: per-request fold decisions, per-row adapter maps of
//! decode and prefill batches, and the expert work items of a sorted batch.
//!
//! A request never runs without its adapter silently: a [`MoeLoraRoute::Refuse`]
//! is an error before launch ([`ensure_decode_route_servable`],
//! [`ensure_batch_servable`]), never a `-1` row.

/// Why a request's MoE LoRA cannot be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefuseReason {
    /// The adapter has expert or router deltas but expert LoRA is disabled
    /// (`LORA_EXPERTS` unset).
    ExpertsDisabled,
    /// The adapter has expert or router deltas that are not resident in the
    /// expert pool.
    NotResident,
}

impl std::fmt::Display for RefuseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RefuseReason::ExpertsDisabled => "the adapter has expert/router deltas and expert LoRA is disabled",
            RefuseReason::NotResident => "the adapter's expert/router deltas are not resident in the expert pool",
        })
    }
}

/// The MoE LoRA fold decision for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeLoraRoute {
    /// Fold the expert and router deltas of expert-pool slot `slot`.
    Fold {
        /// The expert-pool slot.
        slot: usize,
    },
    /// Nothing to fold: the base model, or an adapter without expert or
    /// router deltas.
    Skip,
    /// The request needs expert deltas that cannot be applied.
    Refuse {
        /// Why.
        reason: RefuseReason,
    },
}

/// What the pool knows about a request's adapter, for [`resolve_moe_lora_route`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeAdapterState {
    /// The adapter has routed-expert or router deltas.
    pub has_expert_deltas: bool,
    /// The expert-pool slot holding those deltas, when resident.
    pub expert_slot: Option<usize>,
}

/// The MoE LoRA fold decision for one request:
/// - no adapter (`None`), or an adapter without expert deltas: `Skip`;
/// - expert deltas with expert LoRA disabled: `Refuse(ExpertsDisabled)`;
/// - expert deltas not resident: `Refuse(NotResident)`;
/// - otherwise `Fold` from the resident slot.
pub fn resolve_moe_lora_route(adapter: Option<MoeAdapterState>, experts_enabled: bool) -> MoeLoraRoute {
    let Some(state) = adapter else {
        return MoeLoraRoute::Skip;
    };
    if !state.has_expert_deltas {
        return MoeLoraRoute::Skip;
    }
    if !experts_enabled {
        return MoeLoraRoute::Refuse {
            reason: RefuseReason::ExpertsDisabled,
        };
    }
    match state.expert_slot {
        Some(slot) => MoeLoraRoute::Fold { slot },
        None => MoeLoraRoute::Refuse {
            reason: RefuseReason::NotResident,
        },
    }
}

/// A request whose MoE LoRA route is `Refuse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("row {row}: {reason}; refusing the batch rather than running it without its adapter")]
pub struct RouteRefused {
    /// The batch row (request index).
    pub row: usize,
    /// Why.
    pub reason: RefuseReason,
}

/// An error when `route` is `Refuse`. Decode entries call it before launch:
/// [`build_moe_row_adapter_decode`] writes a `Refuse` row as `-1`, so the
/// batch would otherwise run that request without its adapter.
pub fn ensure_decode_route_servable(route: MoeLoraRoute, row: usize) -> Result<(), RouteRefused> {
    match route {
        MoeLoraRoute::Refuse { reason } => Err(RouteRefused { row, reason }),
        MoeLoraRoute::Fold { .. } | MoeLoraRoute::Skip => Ok(()),
    }
}

/// [`ensure_decode_route_servable`] over a batch; the error names the first
/// refused row.
pub fn ensure_batch_servable(routes: &[MoeLoraRoute]) -> Result<(), RouteRefused> {
    routes
        .iter()
        .enumerate()
        .try_for_each(|(row, &route)| ensure_decode_route_servable(route, row))
}

/// The `[padded_n]` per-row adapter map of a decode batch (one token per
/// sequence), which the expert gather kernel reads as
/// `row_adapter[expanded_row / top_k]` and skips when negative. Row `i` is
/// its `Fold` slot, else `-1`: `Skip`, `Refuse` and padding rows
/// (`i >= routes.len()`) are all `-1` — which is why callers run
/// [`ensure_batch_servable`] first. Unlike the attention `seq_slot`, `-1`
/// here never means the active adapter.
pub fn build_moe_row_adapter_decode(routes: &[MoeLoraRoute], padded_n: usize) -> Vec<i32> {
    (0..padded_n)
        .map(|i| match routes.get(i) {
            Some(MoeLoraRoute::Fold { slot }) => i32::try_from(*slot).unwrap_or(-1),
            _ => -1,
        })
        .collect()
}

/// A malformed prefix sum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeqLensError {
    /// `cu_seqlens` does not have `batch + 1` entries.
    #[error("cu_seqlens has {got} entries for {batch} sequences (expected {})", batch + 1)]
    Length {
        /// Entries given.
        got: usize,
        /// Sequences given.
        batch: usize,
    },
    /// `cu_seqlens` does not start at 0 or decreases.
    #[error("cu_seqlens is not a prefix sum from 0 at entry {index}")]
    NotPrefixSum {
        /// First offending entry.
        index: usize,
    },
}

/// The `[total_tokens]` per-row adapter map of a packed prefill batch.
/// `cu_seqlens` is the `[batch + 1]` prefix sum of per-sequence token
/// counts; sequence `b`'s `adapter_slots[b]` is written, unchanged, over rows
/// `cu_seqlens[b]..cu_seqlens[b + 1]`.
pub fn build_moe_row_adapter_host(cu_seqlens: &[usize], adapter_slots: &[i32]) -> Result<Vec<i32>, SeqLensError> {
    if cu_seqlens.len() != adapter_slots.len() + 1 {
        return Err(SeqLensError::Length {
            got: cu_seqlens.len(),
            batch: adapter_slots.len(),
        });
    }
    if cu_seqlens[0] != 0 {
        return Err(SeqLensError::NotPrefixSum { index: 0 });
    }
    if let Some(i) = cu_seqlens.windows(2).position(|w| w[1] < w[0]) {
        return Err(SeqLensError::NotPrefixSum { index: i + 1 });
    }
    let total = cu_seqlens[adapter_slots.len()];
    let mut rows = Vec::with_capacity(total);
    for (b, &slot) in adapter_slots.iter().enumerate() {
        rows.extend(std::iter::repeat_n(slot, cu_seqlens[b + 1] - cu_seqlens[b]));
    }
    Ok(rows)
}

/// One expert's contiguous block of expert-sorted rows. The planner,
/// [`expert_delta_workitems`], emits none with `rows == 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertWork {
    /// The expert.
    pub expert: usize,
    /// First sorted row of the block.
    pub row_start: usize,
    /// Rows in the block (`> 0`).
    pub rows: usize,
}

/// Work items for the adapted experts, from the `expert_offsets` prefix sum
/// (`[num_experts + 1]`; expert `e`'s sorted rows are
/// `expert_offsets[e]..expert_offsets[e + 1]`). An expert index past the
/// table, or with `end <= start`, is skipped. Items come in `adapted` order.
pub fn expert_delta_workitems(expert_offsets: &[usize], adapted: &[usize]) -> Vec<ExpertWork> {
    adapted
        .iter()
        .filter_map(|&expert| {
            let start = *expert_offsets.get(expert)?;
            let end = *expert_offsets.get(expert.checked_add(1)?)?;
            (end > start).then(|| ExpertWork {
                expert,
                row_start: start,
                rows: end - start,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
