//! The expert/router pool: one fixed-address allocation of `max_loras`
//! equal expert slots, each holding only the expert and router pairs its
//! adapter adapts (in the adapter's [`ExpertLayout`], padded to the expert
//! stride), and one PairEntry table the MoE kernels index by
//! `expert * max_loras + slot`.
//!
//! Table layout (entries): for layer `l` and projection `p`, the
//! `[num_experts * max_loras]` block at `((l * 3 + p) * num_experts) *
//! max_loras`; after all of them, the routers: `[max_loras]` per layer.

use half::bf16;
use lora_kernels::{Device, DeviceBuffer, PairEntry};
use lora_layout::{ExpertLayout, ExpertProj, ExpertSite, ModelConfig, PairLayout, expert_packed_stride};

use crate::error::PoolError;
use crate::image::PairMeta;

/// The expert/router pool of a MoE model.
pub struct ExpertPool {
    stride: usize,
    slot_bytes: usize,
    num_layers: usize,
    num_experts: usize,
    max_loras: usize,
    weights: DeviceBuffer<bf16>,
    table: DeviceBuffer<PairEntry>,
    host_table: Vec<PairEntry>,
}

fn overflow(what: &'static str) -> PoolError {
    PoolError::Layout(lora_layout::LayoutError::Overflow { what })
}

impl ExpertPool {
    /// Entries of the table for a model and pool size.
    pub fn table_len(cfg: &ModelConfig, max_loras: usize) -> Result<usize, PoolError> {
        let num_experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
        let layers = cfg.num_hidden_layers;
        layers
            .checked_mul(ExpertProj::ALL.len())
            .and_then(|v| v.checked_mul(num_experts))
            .and_then(|v| v.checked_mul(max_loras))
            .and_then(|v| v.checked_add(layers.checked_mul(max_loras)?))
            .ok_or(overflow("expert table"))
    }

    /// Allocate the pool: `max_loras` slots of `slot_bytes` each (rounded up
    /// to whole elements), all empty.
    pub fn new(
        device: &Device,
        cfg: &ModelConfig,
        max_loras: usize,
        expert_rank: usize,
        slot_bytes: usize,
    ) -> Result<ExpertPool, PoolError> {
        let stride = expert_packed_stride(expert_rank)?;
        let num_experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
        let slot_bytes = slot_bytes.div_ceil(16) * 16;
        let total = (slot_bytes / 2).checked_mul(max_loras).ok_or(overflow("expert pool"))?;
        let table_len = ExpertPool::table_len(cfg, max_loras)?;
        Ok(ExpertPool {
            stride,
            slot_bytes,
            num_layers: cfg.num_hidden_layers,
            num_experts,
            max_loras,
            weights: device.alloc_zeros(total)?,
            table: device.alloc_zeros(table_len)?,
            host_table: vec![PairEntry::default(); table_len],
        })
    }

    /// The rank stride of every expert pair.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Bytes one expert slot holds.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The PairEntry table the MoE kernels read.
    pub fn table(&self) -> &DeviceBuffer<PairEntry> {
        &self.table
    }

    /// The routed experts per layer.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// First entry of (layer, proj)'s `[num_experts * max_loras]` block.
    pub fn proj_table_offset(&self, layer: usize, proj: ExpertProj) -> Option<usize> {
        (layer < self.num_layers).then(|| ((layer * 3 + proj.index()) * self.num_experts) * self.max_loras)
    }

    /// First entry of layer's router `[max_loras]` block.
    pub fn router_table_offset(&self, layer: usize) -> Option<usize> {
        (layer < self.num_layers)
            .then(|| self.num_layers * 3 * self.num_experts * self.max_loras + layer * self.max_loras)
    }

    fn entry_index(&self, layer: usize, site: ExpertSite, slot: usize) -> Option<usize> {
        match site {
            ExpertSite::Expert { expert, proj } if expert < self.num_experts => {
                Some(self.proj_table_offset(layer, proj)? + expert * self.max_loras + slot)
            }
            ExpertSite::Expert { .. } => None,
            ExpertSite::Router => Some(self.router_table_offset(layer)? + slot),
        }
    }

    /// The table entry of (layer, site) in `slot`, as last published.
    pub fn entry(&self, layer: usize, site: ExpertSite, slot: usize) -> Option<PairEntry> {
        if slot >= self.max_loras {
            return None;
        }
        self.entry_index(layer, site, slot)
            .and_then(|i| self.host_table.get(i).copied())
    }

    /// The bytes of expert slot `slot` (tests compare them across swaps).
    pub fn slot_contents(&self, slot: usize) -> Result<Vec<bf16>, PoolError> {
        let elems = self.slot_bytes / 2;
        Ok(self.weights.download_range(slot * elems, elems)?)
    }

    /// Check that an adapter's expert layout fits a slot.
    pub(crate) fn check_fits(&self, adapter: &str, layout: &ExpertLayout) -> Result<(), PoolError> {
        if layout.total_bytes() > self.slot_bytes {
            return Err(PoolError::ExpertSlotTooSmall {
                adapter: adapter.to_string(),
                needed: layout.total_bytes(),
                capacity: self.slot_bytes,
            });
        }
        Ok(())
    }

    /// Write `image` (the adapter's expert pairs in `layout`) into `slot`,
    /// zero the rest of the slot, and point the slot's table entries at it.
    pub(crate) fn publish(
        &mut self,
        slot: usize,
        layout: &ExpertLayout,
        image: &[bf16],
        pairs: &[PairMeta],
    ) -> Result<(), PoolError> {
        let elems = self.slot_bytes / 2;
        let base = slot * elems;
        self.weights.write(base, image)?;
        self.weights.zero_range(base + image.len(), elems - image.len())?;
        self.clear_entries(slot);
        let base_addr = self.weights.addr_at(base)?;
        for meta in pairs {
            let lora_layout::PairKey::Expert { layer, site } = meta.key else {
                continue;
            };
            let Some(place) = layout.entry(layer, site) else {
                continue;
            };
            let Some(i) = self.entry_index(layer, site, slot) else {
                continue;
            };
            self.host_table[i] = PairEntry {
                a: base_addr + place.a_offset as u64,
                b: base_addr + place.b_offset as u64,
                scale: meta.scale,
                rank: meta.rank as u32,
            };
        }
        self.table.write(0, &self.host_table)?;
        Ok(())
    }

    /// Empty `slot`: zero its bytes and its table entries.
    pub(crate) fn clear(&mut self, slot: usize) -> Result<(), PoolError> {
        let elems = self.slot_bytes / 2;
        self.weights.zero_range(slot * elems, elems)?;
        self.clear_entries(slot);
        self.table.write(0, &self.host_table)?;
        Ok(())
    }

    fn clear_entries(&mut self, slot: usize) {
        for i in (slot..self.host_table.len()).step_by(self.max_loras) {
            self.host_table[i] = PairEntry::default();
        }
    }
}
