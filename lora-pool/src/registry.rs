//! Who is in which slot: names, generations, pair lists, and the views the
//! promotion cache reads. Pure bookkeeping; the pool keeps it in step with
//! the device tables.

use lora_layout::{SlotView, adapter_id_hash};

use crate::image::PairMeta;
use crate::lease::SlotUse;

/// One pool slot's resident adapter. An empty `name` marks a placeholder
/// that holds no adapter.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdapterSlot {
    /// The adapter's name ("" for a placeholder).
    pub name: String,
    /// Bumped by every write into the slot; part of the adapter's identity.
    pub generation: u64,
    /// Dense pairs the slot serves, sorted by key.
    pub pairs: Vec<PairMeta>,
    /// Expert and router pairs the slot serves, sorted by key.
    pub expert_pairs: Vec<PairMeta>,
    /// The adapter has expert or router pairs on some rank of the
    /// expert-parallel group, maybe none of them this rank's (at
    /// `ep_world` 1: `!expert_pairs.is_empty()`).
    pub group_expert_deltas: bool,
    /// The adapter has token overlays (trainable tokens, saved tables).
    pub has_overlay: bool,
    /// A write into the slot failed part way: it holds no adapter and
    /// nothing may name it until a later swap into it succeeds.
    pub unservable: bool,
}

impl AdapterSlot {
    /// Whether the slot holds an adapter.
    pub fn is_filled(&self) -> bool {
        !self.name.is_empty()
    }

    /// Whether rows may run with the slot: it holds an adapter and its
    /// last write completed.
    pub fn is_servable(&self) -> bool {
        self.is_filled() && !self.unservable
    }

    /// The adapter's cache identity ([`adapter_id_hash`] of its name and
    /// generation); 0 for a placeholder, which serves the base model.
    pub fn adapter_id(&self) -> u64 {
        if self.is_filled() {
            adapter_id_hash(&self.name, self.generation)
        } else {
            0
        }
    }

    /// Whether the adapter has expert or router deltas, on this rank or
    /// on another rank of the expert-parallel group (its tokens' map
    /// entries name the slot on every rank, so the rank they are
    /// dispatched to folds them).
    pub fn has_expert_deltas(&self) -> bool {
        !self.expert_pairs.is_empty() || self.group_expert_deltas
    }
}

/// The slots of a pool, by index.
#[derive(Debug, Clone)]
pub struct SlotRegistry {
    slots: Vec<AdapterSlot>,
    pinned: usize,
}

impl SlotRegistry {
    /// `max_loras` placeholders; slots `[0, pinned)` are never promotion
    /// victims.
    pub fn new(max_loras: usize, pinned: usize) -> SlotRegistry {
        SlotRegistry {
            slots: vec![AdapterSlot::default(); max_loras],
            pinned: pinned.min(max_loras),
        }
    }

    /// Every slot, by index.
    pub fn slots(&self) -> &[AdapterSlot] {
        &self.slots
    }

    /// One slot.
    pub fn get(&self, slot: usize) -> Option<&AdapterSlot> {
        self.slots.get(slot)
    }

    /// The number of pinned slots.
    pub fn pinned(&self) -> usize {
        self.pinned
    }

    /// The slot holding `name`.
    pub fn slot_of(&self, name: &str) -> Option<usize> {
        if name.is_empty() {
            return None;
        }
        self.slots.iter().position(|s| s.name == name)
    }

    /// The promotion candidates `[pinned, max_loras)` as
    /// `select_victim_slot` reads them.
    pub fn cache_slot_views(&self, uses: &SlotUse) -> Vec<(usize, SlotView)> {
        (self.pinned..self.slots.len())
            .map(|i| {
                let view = SlotView {
                    filled: self.slots[i].is_filled(),
                    ref_count: uses.ref_count(i),
                    last_used: uses.last_used(i),
                };
                (i, view)
            })
            .collect()
    }

    /// Replace slot `slot`'s adapter, bumping its generation. Returns the
    /// new generation. The caller has written the slot's bytes and tables.
    pub(crate) fn publish(&mut self, slot: usize, mut next: AdapterSlot) -> Option<u64> {
        let current = self.slots.get_mut(slot)?;
        next.generation = current.generation.wrapping_add(1).max(1);
        *current = next;
        Some(current.generation)
    }

    /// Mark slot `slot` as being written: it names no adapter from here on
    /// (its identity is the placeholder's 0, so no cached identity or lease
    /// matches it) and stays unservable until [`SlotRegistry::publish`] or
    /// [`SlotRegistry::clear`] completes the write, which bumps the
    /// generation once for the write.
    pub(crate) fn mark_unservable(&mut self, slot: usize) {
        if let Some(current) = self.slots.get_mut(slot) {
            let generation = current.generation;
            *current = AdapterSlot {
                generation,
                unservable: true,
                ..AdapterSlot::default()
            };
        }
    }

    /// Undo [`SlotRegistry::mark_unservable`] when the write it announced
    /// wrote nothing: slot `slot` is `previous` again, generation included.
    pub(crate) fn restore(&mut self, slot: usize, previous: AdapterSlot) {
        if let Some(current) = self.slots.get_mut(slot) {
            *current = previous;
        }
    }

    /// Empty slot `slot` (its bytes and tables are already cleared), bumping
    /// its generation so any cached identity of the old adapter dies.
    pub(crate) fn clear(&mut self, slot: usize) -> Option<u64> {
        let current = self.slots.get_mut(slot)?;
        let generation = current.generation.wrapping_add(1).max(1);
        *current = AdapterSlot {
            generation,
            ..AdapterSlot::default()
        };
        Some(generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lora_layout::select_victim_slot;

    fn named(name: &str) -> AdapterSlot {
        AdapterSlot {
            name: name.into(),
            ..AdapterSlot::default()
        }
    }

    #[test]
    fn publish_bumps_the_generation_and_the_identity() {
        let mut reg = SlotRegistry::new(3, 1);
        assert_eq!(
            reg.get(1).map(AdapterSlot::adapter_id),
            Some(0),
            "placeholder serves the base model"
        );
        assert_eq!(reg.publish(1, named("a")), Some(1));
        let first = reg.get(1).unwrap().adapter_id();
        assert_eq!(reg.publish(1, named("a")), Some(2));
        let second = reg.get(1).unwrap().adapter_id();
        assert_ne!(first, second, "the same name swapped in again is a new identity");
        assert_eq!(first, adapter_id_hash("a", 1));
        assert_eq!(reg.slot_of("a"), Some(1));
        assert_eq!(reg.slot_of(""), None);
        assert_eq!(reg.publish(7, named("x")), None);
    }

    #[test]
    fn clear_keeps_counting_generations() {
        let mut reg = SlotRegistry::new(2, 0);
        reg.publish(0, named("a"));
        assert_eq!(reg.clear(0), Some(2));
        assert!(!reg.get(0).unwrap().is_filled());
        assert_eq!(reg.publish(0, named("b")), Some(3));
    }

    #[test]
    fn a_write_in_progress_serves_nothing_and_bumps_the_generation_once() {
        let mut reg = SlotRegistry::new(2, 0);
        reg.publish(0, named("a"));
        reg.mark_unservable(0);
        let marked = reg.get(0).unwrap();
        assert!(!marked.is_servable() && !marked.is_filled());
        assert_eq!(marked.adapter_id(), 0, "a slot being written has no identity");
        assert_eq!(reg.slot_of("a"), None);
        assert_eq!(reg.publish(0, named("a")), Some(2), "one write, one bump");
        assert!(reg.get(0).unwrap().is_servable());
        reg.mark_unservable(0);
        assert_eq!(reg.clear(0), Some(3));
        assert!(
            !reg.get(0).unwrap().unservable,
            "the write is complete: an empty slot, no longer mid-write"
        );
    }

    #[test]
    fn cache_views_skip_pinned_slots_and_feed_victim_selection() {
        let mut reg = SlotRegistry::new(4, 2);
        for (i, n) in ["p0", "p1", "c2", "c3"].iter().enumerate() {
            reg.publish(i, named(n));
        }
        let uses = SlotUse::new(4);
        uses.touch(3);
        uses.touch(2);
        let views = reg.cache_slot_views(&uses);
        assert_eq!(views.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(select_victim_slot(&views), Ok(3), "slot 3 was used longest ago");
        let _hold = crate::lease::SlotLease::take(&uses, crate::SlotId::new(3), 1);
        assert_eq!(select_victim_slot(&reg.cache_slot_views(&uses)), Ok(2));
    }

    #[test]
    fn pinned_is_capped_at_the_pool_size() {
        assert_eq!(SlotRegistry::new(2, 5).pinned(), 2);
    }
}
