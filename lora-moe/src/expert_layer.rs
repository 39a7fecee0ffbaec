//! [`ExpertLoraLayer`]: one slot's routed-expert and router pairs at one MoE
//! layer, as the pool last published them: which experts the adapter adapts,
//! for host-side planning (e.g. the row blocks a batch's sort gives the
//! adapted experts, [`ExpertLoraLayer::work_items`]).

use std::collections::BTreeMap;

use lora_kernels::PairEntry;
use lora_layout::{ExpertProj, ExpertSite, ExpertWork};
use lora_pool::{LoraPool, SlotCompanion};

use crate::error::MoeError;
use crate::sorted::SortedRouting;

/// One MoE layer's routed-expert pairs of one slot, keyed by (expert,
/// projection); only adapted experts have entries.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertLoraLayer {
    /// The layer.
    pub layer: usize,
    /// The slot.
    pub slot: usize,
    /// Table entries of the adapted (expert, projection) pairs.
    pub pairs: BTreeMap<(usize, ExpertProj), PairEntry>,
    /// The router's entry, when the adapter adapts it.
    pub router: Option<PairEntry>,
}

impl ExpertLoraLayer {
    /// Read `slot`'s pairs at `layer` from the pool's expert table. A pool
    /// without an expert pool, or a slot without expert deltas, gives an
    /// empty layer.
    pub fn of<C: SlotCompanion>(pool: &LoraPool<C>, slot: usize, layer: usize) -> Result<ExpertLoraLayer, MoeError> {
        let cfg = pool.config();
        let moe = cfg.moe.as_ref().ok_or(MoeError::NotMoe {
            model_type: cfg.family.model_type(),
        })?;
        if !cfg.is_moe_layer(layer) {
            return Err(MoeError::NotMoeLayer { layer });
        }
        let max_loras = pool.options().max_loras;
        if slot >= max_loras {
            return Err(MoeError::NoSuchSlot {
                row: 0,
                slot,
                max_loras,
            });
        }
        let mut out = ExpertLoraLayer {
            layer,
            slot,
            pairs: BTreeMap::new(),
            router: None,
        };
        let Some(experts) = pool.experts() else {
            return Ok(out);
        };
        let adapted = |site| experts.entry(layer, site, slot).filter(|e| e.rank > 0);
        for expert in 0..moe.num_experts {
            for proj in ExpertProj::ALL {
                if let Some(e) = adapted(ExpertSite::Expert { expert, proj }) {
                    out.pairs.insert((expert, proj), e);
                }
            }
        }
        out.router = adapted(ExpertSite::Router);
        Ok(out)
    }

    /// The experts whose `proj` the adapter adapts, ascending.
    pub fn adapted_experts(&self, proj: ExpertProj) -> Vec<usize> {
        self.pairs.keys().filter(|(_, p)| *p == proj).map(|(e, _)| *e).collect()
    }

    /// The non-empty row blocks of `routing` that fold a `proj` delta of
    /// this slot.
    pub fn work_items(&self, proj: ExpertProj, routing: &SortedRouting) -> Vec<ExpertWork> {
        routing.work_items(&self.adapted_experts(proj))
    }
}

#[cfg(test)]
mod tests;
