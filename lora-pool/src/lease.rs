//! Per-slot use counts: a request holds a [`SlotLease`] for as long as it
//! runs, and a slot with a live lease is never overwritten.
//!
//! Counts are atomics behind an `Arc`, so a lease outlives any borrow of the
//! pool and can be dropped from any thread; the pool reads them when it
//! picks a victim or publishes into a slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::slot::SlotId;

/// Use counts and recency of every slot.
#[derive(Debug)]
pub struct SlotUse {
    ref_counts: Vec<AtomicU32>,
    last_used: Vec<AtomicU64>,
    clock: AtomicU64,
}

impl SlotUse {
    /// Counters for `n_slots` slots, all idle.
    pub fn new(n_slots: usize) -> Arc<SlotUse> {
        Arc::new(SlotUse {
            ref_counts: (0..n_slots).map(|_| AtomicU32::new(0)).collect(),
            last_used: (0..n_slots).map(|_| AtomicU64::new(0)).collect(),
            clock: AtomicU64::new(0),
        })
    }

    /// Live leases on `slot` (0 for a slot out of range).
    pub fn ref_count(&self, slot: usize) -> u32 {
        self.ref_counts.get(slot).map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Logical time of `slot`'s last lease (0: never leased).
    pub fn last_used(&self, slot: usize) -> u64 {
        self.last_used.get(slot).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Record a use of `slot` without holding it (e.g. a load).
    pub fn touch(&self, slot: usize) {
        if let Some(t) = self.last_used.get(slot) {
            let now = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
            t.store(now, Ordering::Relaxed);
        }
    }
}

/// A request's hold on one slot. Dropping it releases the slot.
#[derive(Debug)]
pub struct SlotLease {
    uses: Arc<SlotUse>,
    slot: SlotId,
    adapter_id: u64,
}

impl SlotLease {
    /// Take a lease on `slot` (the caller checked it is in range and filled).
    pub(crate) fn take(uses: &Arc<SlotUse>, slot: SlotId, adapter_id: u64) -> SlotLease {
        if let Some(c) = uses.ref_counts.get(slot.index()) {
            c.fetch_add(1, Ordering::AcqRel);
        }
        uses.touch(slot.index());
        SlotLease {
            uses: Arc::clone(uses),
            slot,
            adapter_id,
        }
    }

    /// The slot the request runs with.
    pub fn slot(&self) -> SlotId {
        self.slot
    }

    /// Whether the lease was taken from the pool whose counters are `uses`.
    pub(crate) fn is_of(&self, uses: &Arc<SlotUse>) -> bool {
        Arc::ptr_eq(&self.uses, uses)
    }

    /// The adapter's identity hash at the time of the lease, for prefix and
    /// KV cache keys.
    pub fn adapter_id(&self) -> u64 {
        self.adapter_id
    }
}

impl Clone for SlotLease {
    fn clone(&self) -> SlotLease {
        SlotLease::take(&self.uses, self.slot, self.adapter_id)
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if let Some(c) = self.uses.ref_counts.get(self.slot.index()) {
            c.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_count_and_release() {
        let uses = SlotUse::new(3);
        let a = SlotLease::take(&uses, SlotId::new(1), 42);
        let b = a.clone();
        assert_eq!(uses.ref_count(1), 2);
        assert_eq!((b.slot(), b.adapter_id()), (SlotId::new(1), 42));
        drop(a);
        assert_eq!(uses.ref_count(1), 1);
        drop(b);
        assert_eq!(uses.ref_count(1), 0);
        assert_eq!(uses.ref_count(9), 0);
    }

    #[test]
    fn recency_grows_with_each_use() {
        let uses = SlotUse::new(2);
        uses.touch(0);
        let _l = SlotLease::take(&uses, SlotId::new(1), 1);
        assert!(uses.last_used(1) > uses.last_used(0));
        assert!(uses.last_used(0) > 0);
    }

    #[test]
    fn leases_release_from_other_threads() {
        let uses = SlotUse::new(1);
        let leases: Vec<_> = (0..8).map(|_| SlotLease::take(&uses, SlotId::new(0), 7)).collect();
        std::thread::scope(|s| {
            for l in leases {
                s.spawn(move || drop(l));
            }
        });
        assert_eq!(uses.ref_count(0), 0);
    }
}
