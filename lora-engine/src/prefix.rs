//! The prefix cache: a prompt's KV cache and logits, keyed by the adapter
//! identity hash that served it and the prompt's tokens.
//!
//! The key is the step's identity hash ([`lora_pool::Step::adapter_id`]),
//! which changes whenever a slot's contents change (a swap, a promotion,
//! a reload of the same name), so an entry is never reused for another
//! adapter, or for the same name after its bytes were replaced; the base
//! model's hash is 0. This module must never key by slot or name.

use std::collections::VecDeque;

use crate::kv_cache::KvCache;

/// One cached prompt.
#[derive(Debug, Clone)]
pub(crate) struct CachedPrompt {
    pub(crate) cache: KvCache,
    pub(crate) logits: Vec<f32>,
}

/// A small least-recently-inserted cache of whole prompts.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    capacity: usize,
    entries: VecDeque<((u64, Vec<u32>), CachedPrompt)>,
}

impl PrefixCache {
    pub(crate) fn new(capacity: usize) -> PrefixCache {
        PrefixCache {
            capacity,
            entries: VecDeque::new(),
        }
    }

    pub(crate) fn get(&self, adapter_id: u64, prompt: &[u32]) -> Option<&CachedPrompt> {
        self.entries
            .iter()
            .find(|((id, p), _)| *id == adapter_id && p == prompt)
            .map(|(_, c)| c)
    }

    pub(crate) fn insert(&mut self, adapter_id: u64, prompt: &[u32], entry: CachedPrompt) {
        if self.capacity == 0 || self.get(adapter_id, prompt).is_some() {
            return;
        }
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back(((adapter_id, prompt.to_vec()), entry));
    }
}
