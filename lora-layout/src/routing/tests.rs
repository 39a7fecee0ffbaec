use super::*;

#[test]
fn seq_slot_resolves_negative_rows_and_pads_with_minus_one() {
    assert_eq!(build_seq_slot_host(&[2, -1, 0, -7], 6, 3), [2, 3, 0, 3, -1, -1]);
    assert_eq!(build_seq_slot_host(&[], 3, 1), [-1, -1, -1]);
    assert_eq!(build_seq_slot_host(&[1, 2, 3], 2, 0), [1, 2], "truncates to padded_n");
    // With no active adapter (-1), a negative row stays -1: no delta.
    assert_eq!(build_seq_slot_host(&[-1, 4], 2, -1), [-1, 4]);
}

#[test]
fn uniform_seq_slots_uses_the_pair_only_for_the_active_adapter_on_fallback_sites() {
    assert_eq!(uniform_seq_slots(2, 2, 3, LoraSites::PairFallback), None);
    assert_eq!(uniform_seq_slots(-1, 2, 3, LoraSites::PairFallback), None);
    assert_eq!(uniform_seq_slots(1, 2, 3, LoraSites::PairFallback), Some(vec![1, 1, 1]));
    // Multi-sequence sites always get rows, even for the active adapter.
    assert_eq!(uniform_seq_slots(2, 2, 2, LoraSites::MultiSeq), Some(vec![2, 2]));
    assert_eq!(uniform_seq_slots(-1, 2, 2, LoraSites::MultiSeq), Some(vec![2, 2]));
    assert_eq!(uniform_seq_slots(0, 2, 0, LoraSites::MultiSeq), Some(vec![]));
}

#[test]
fn routed_prefill_slot_excludes_active_and_out_of_range() {
    assert_eq!(routed_prefill_slot_of(3, 0, 4), Some(3));
    assert_eq!(
        routed_prefill_slot_of(0, 0, 4),
        None,
        "the active adapter takes the pair path"
    );
    assert_eq!(routed_prefill_slot_of(-1, 0, 4), None, "negative resolves to active");
    assert_eq!(routed_prefill_slot_of(4, 0, 4), None, "past the pool");
    assert_eq!(routed_prefill_slot_of(-5, 9, 4), None, "active itself past the pool");
}

fn view(filled: bool, ref_count: u32, last_used: u64) -> SlotView {
    SlotView {
        filled,
        ref_count,
        last_used,
    }
}

#[test]
fn victim_prefers_the_first_empty_slot() {
    let cache = [(2, view(true, 0, 1)), (3, view(false, 0, 9)), (4, view(false, 0, 0))];
    assert_eq!(select_victim_slot(&cache), Ok(3));
}

#[test]
fn victim_is_the_least_recently_used_idle_slot() {
    let cache = [
        (1, view(true, 0, 50)),
        (2, view(true, 1, 3)),
        (3, view(true, 0, 7)),
        (4, view(true, 0, 7)),
    ];
    assert_eq!(
        select_victim_slot(&cache),
        Ok(3),
        "slot 2 is older but in use; ties keep cache order"
    );
}

#[test]
fn victim_fails_when_every_slot_is_in_use_or_there_are_none() {
    let cache = [(1, view(true, 2, 0)), (2, view(true, 1, 0))];
    assert_eq!(select_victim_slot(&cache), Err(VictimError::PoolFull));
    // Pinned slots are not passed in: with every slot pinned the cache is empty.
    assert_eq!(select_victim_slot(&[]), Err(VictimError::PoolFull));
}

#[test]
fn scale_table_fills_missing_pairs_and_empty_slots_with_zero() {
    assert_eq!(
        scale_table_values(&[Some(2.0), None, Some(0.5)], 5).unwrap(),
        [2.0, 0.0, 0.5, 0.0, 0.0]
    );
    assert_eq!(scale_table_values(&[], 2).unwrap(), [0.0, 0.0]);
    assert_eq!(
        scale_table_values(&[Some(1.0); 3], 2),
        Err(TooManyAdapters {
            adapters: 3,
            max_loras: 2
        })
    );
}

/// 64-bit FNV-1a written out independently of the implementation.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(14695981039346656037u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(1099511628211)
    })
}

#[test]
fn adapter_id_hash_is_fnv1a_of_name_then_generation() {
    // Published FNV-1a 64 test vectors.
    assert_eq!(adapter_id_hash("", 0), 0xcbf29ce484222325);
    assert_eq!(adapter_id_hash("a", 0), 0xaf63dc4c8601ec8c);
    assert_eq!(adapter_id_hash("foobar", 0), 0x85944171f73967e8);
    let mut bytes = b"sql-lora".to_vec();
    bytes.extend_from_slice(&7u64.to_le_bytes());
    assert_eq!(adapter_id_hash("sql-lora", 7), fnv1a(&bytes));
    assert_ne!(
        adapter_id_hash("sql-lora", 7),
        adapter_id_hash("sql-lora", 8),
        "a swap changes the id"
    );
    assert_eq!(
        adapter_id_hash("sql-lora", 0),
        fnv1a(b"sql-lora"),
        "generation 0 adds nothing"
    );
}

#[test]
fn a_zero_hash_becomes_one() {
    assert_eq!(reserve_base_model_id(0), 1);
    assert_eq!(reserve_base_model_id(1), 1);
    assert_eq!(reserve_base_model_id(u64::MAX), u64::MAX);
}
