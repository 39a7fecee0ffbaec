//! The expert-sorted order of a batch's expanded rows, built on the host:
//! what a grouped-GEMM MoE sorts on the device before its GEMMs, for
//! engines that route on the host, for the probe path and for tests.
//!
//! Expanded row `token * top_k + k` is token `token`'s `k`-th routed copy;
//! sorted row `i` is expanded row `sorted_token[i]`; expert `e`'s sorted rows
//! are `expert_offsets[e] .. expert_offsets[e + 1]`, in expanded-row order
//! (a stable sort).

use lora_layout::{ExpertWork, expert_delta_workitems};

use crate::error::MoeError;

/// An expert-sorted order of expanded rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SortedRouting {
    /// `[n_sorted]`: the expanded row of each sorted row.
    pub sorted_token: Vec<i32>,
    /// `[num_experts + 1]` prefix sum of the rows routed to each expert.
    pub expert_offsets: Vec<i32>,
}

impl SortedRouting {
    /// Sort the expanded rows of `topk_ids` (`[n_tokens * top_k]`, token
    /// major: the experts each token is routed to) by expert, stably.
    pub fn from_topk(topk_ids: &[i32], top_k: usize, num_experts: usize) -> Result<SortedRouting, MoeError> {
        if top_k == 0 || num_experts == 0 {
            return Err(MoeError::shape(
                "routing",
                format!("top_k {top_k} and num_experts {num_experts} must be at least 1"),
            ));
        }
        if !topk_ids.len().is_multiple_of(top_k) {
            return Err(MoeError::shape(
                "topk_ids",
                format!(
                    "{} ids is not a whole number of tokens of top_k {top_k}",
                    topk_ids.len()
                ),
            ));
        }
        if i32::try_from(topk_ids.len()).is_err() {
            return Err(MoeError::BatchTooLarge {
                what: "expanded rows",
                got: topk_ids.len(),
                capacity: i32::MAX as usize,
            });
        }
        let mut counts = vec![0usize; num_experts];
        for (position, &e) in topk_ids.iter().enumerate() {
            let expert = usize::try_from(e)
                .ok()
                .filter(|&e| e < num_experts)
                .ok_or(MoeError::Routing {
                    arg: "topk_ids",
                    position,
                    value: i64::from(e),
                    reason: "not an expert of the layer",
                })?;
            counts[expert] += 1;
        }
        let mut expert_offsets = Vec::with_capacity(num_experts + 1);
        let mut next = Vec::with_capacity(num_experts);
        let mut total = 0usize;
        expert_offsets.push(0);
        for &c in &counts {
            next.push(total);
            total += c;
            // total <= topk_ids.len(), which fits i32 (checked above).
            expert_offsets.push(total as i32);
        }
        let mut sorted_token = vec![0i32; total];
        for (row, &e) in topk_ids.iter().enumerate() {
            let slot = &mut next[e as usize];
            sorted_token[*slot] = row as i32;
            *slot += 1;
        }
        Ok(SortedRouting {
            sorted_token,
            expert_offsets,
        })
    }

    /// Sorted rows.
    pub fn n_sorted(&self) -> usize {
        self.sorted_token.len()
    }

    /// `expert_offsets` as `usize` (the form [`expert_delta_workitems`] takes).
    pub fn offsets(&self) -> Vec<usize> {
        self.expert_offsets.iter().map(|&o| o.max(0) as usize).collect()
    }

    /// The non-empty row blocks of the `adapted` experts, in `adapted` order.
    pub fn work_items(&self, adapted: &[usize]) -> Vec<ExpertWork> {
        expert_delta_workitems(&self.offsets(), adapted)
    }
}

#[cfg(test)]
mod tests;
