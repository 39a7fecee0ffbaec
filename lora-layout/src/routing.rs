//! Per-row slot buffers, the routed-prefill predicate, victim selection for
//! the promotion cache, and scale-table values.

/// The host `seq_slot[padded_n]` buffer the decode kernel reads, one entry
/// per row:
/// - row `i < n`: `adapter_slots[i]` if `>= 0`, else `active` (a negative
///   slot means the active adapter);
/// - row `i >= n` (padding): `-1`, which the kernels treat as no delta.
///
/// `padded_n < adapter_slots.len()` truncates to `padded_n` rows.
pub fn build_seq_slot_host(adapter_slots: &[i32], padded_n: usize, active: i32) -> Vec<i32> {
    (0..padded_n)
        .map(|i| match adapter_slots.get(i) {
            Some(&s) if s >= 0 => s,
            Some(_) => active,
            None => -1,
        })
        .collect()
}

/// Which attention LoRA sites a step of one sequence runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraSites {
    /// Sites that fold the installed (active) pair when no slot buffer is
    /// given: one-sequence decode and prefill.
    PairFallback,
    /// Multi-sequence sites (e.g. a speculative verify's K rows): they have
    /// no pair fallback and fold nothing without a slot buffer.
    MultiSeq,
}

/// The `count`-row slot buffer a step of one sequence uploads, or `None` for
/// the installed-pair path: only a request that resolves to the active
/// adapter, on sites with a pair fallback, takes the pair. Multi-sequence
/// sites always get their rows' slots, or they would run without the adapter.
pub fn uniform_seq_slots(adapter_slot: i32, active: i32, count: usize, sites: LoraSites) -> Option<Vec<i32>> {
    let resolved = if adapter_slot >= 0 { adapter_slot } else { active };
    if sites == LoraSites::PairFallback && resolved == active {
        return None;
    }
    Some(vec![resolved; count])
}

/// The predicate behind routed prefill: resolves `adapter_slot` (`>= 0` is
/// that slot, negative is `active`) and returns it only when it is not
/// `active` and is `< num_slots`; otherwise `None`.
pub fn routed_prefill_slot_of(adapter_slot: i32, active: usize, num_slots: usize) -> Option<usize> {
    let resolved = usize::try_from(adapter_slot).unwrap_or(active);
    (resolved != active && resolved < num_slots).then_some(resolved)
}

/// A promotion-cache slot's state, as [`select_victim_slot`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotView {
    /// The slot holds an adapter.
    pub filled: bool,
    /// Requests currently holding the slot.
    pub ref_count: u32,
    /// Logical time of the slot's last use (larger is more recent).
    pub last_used: u64,
}

/// Why a promotion found no victim slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VictimError {
    /// Every candidate slot is filled and in use.
    #[error("every promotion slot is filled and in use")]
    PoolFull,
}

/// Pick the slot a promotion overwrites, from `cache`, the
/// `(slot_index, view)` pairs of the promotion slots `[pinned, max_loras)`:
/// 1. the first unfilled slot;
/// 2. else the `ref_count == 0` slot with the smallest `last_used` (the first
///    such in `cache` order on a tie);
/// 3. else [`VictimError::PoolFull`].
pub fn select_victim_slot(cache: &[(usize, SlotView)]) -> Result<usize, VictimError> {
    if let Some((idx, _)) = cache.iter().find(|(_, v)| !v.filled) {
        return Ok(*idx);
    }
    cache
        .iter()
        .filter(|(_, v)| v.ref_count == 0)
        .min_by_key(|(_, v)| v.last_used)
        .map(|(idx, _)| *idx)
        .ok_or(VictimError::PoolFull)
}

/// More adapters than scale-table entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{adapters} adapters do not fit a table of {max_loras} slots")]
pub struct TooManyAdapters {
    /// Adapters given.
    pub adapters: usize,
    /// Table length.
    pub max_loras: usize,
}

/// Values of a `[max_loras]` f32 scale table: entry `k` is adapter `k`'s
/// scaling for the table's (layer, module) (`alpha / r`, or `alpha / sqrt(r)`
/// under rsLoRA; `None` when adapter `k` has no pair there), 0.0 for `None`
/// and for `k >= scalings.len()`.
pub fn scale_table_values(scalings: &[Option<f32>], max_loras: usize) -> Result<Vec<f32>, TooManyAdapters> {
    if scalings.len() > max_loras {
        return Err(TooManyAdapters {
            adapters: scalings.len(),
            max_loras,
        });
    }
    let mut table = vec![0.0f32; max_loras];
    for (entry, s) in table.iter_mut().zip(scalings) {
        *entry = s.unwrap_or(0.0);
    }
    Ok(table)
}

/// The adapter's cache-identity key, which keeps prefix and KV reuse within
/// one adapter: 64-bit FNV-1a over the name's bytes, then over
/// `generation.to_le_bytes()` when `generation != 0`. It never depends on the
/// pool slot; a swap into a slot bumps that slot's generation, which changes
/// the key. `0` is reserved for the base model, so a hash of 0 becomes 1.
pub fn adapter_id_hash(name: &str, generation: u64) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(PRIME);
    };
    name.bytes().for_each(&mut eat);
    if generation != 0 {
        generation.to_le_bytes().into_iter().for_each(&mut eat);
    }
    reserve_base_model_id(h)
}

/// `0` names the base model; an adapter whose hash is 0 takes 1 instead.
fn reserve_base_model_id(h: u64) -> u64 {
    if h == 0 { 1 } else { h }
}

#[cfg(test)]
mod tests;
