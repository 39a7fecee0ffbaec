use lora_kernels::Device;
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions};

use super::*;
use crate::test_support::{config, fixtures};

/// Slot 0: the 4.x adapter of experts 0 and 2 plus the router; slot 1: the
/// 5.x gate_up-only adapter (every expert's Gate and Up, no Down, no router).
fn pool() -> LoraPool {
    let model = "qwen3_moe_v4";
    let cfg = config(model);
    let per_expert = fixtures().join(model).join("experts_per_expert_router");
    let gate_up_only = fixtures().join("qwen3_moe/experts_fused_gate_up_only");
    let opts = LoraOptions {
        max_loras: 3,
        experts: true,
        ..LoraOptions::default()
    };
    let sources = [
        AdapterSource {
            name: "per-expert",
            dir: &per_expert,
        },
        AdapterSource {
            name: "gate-up-only",
            dir: &gate_up_only,
        },
    ];
    LoraPool::load(&Device::cpu(), cfg, opts, BatchCapacity::default(), &sources).unwrap()
}

#[test]
fn only_adapted_experts_have_entries() {
    let pool = pool();
    let per_expert = ExpertLoraLayer::of(&pool, 0, 1).unwrap();
    for proj in ExpertProj::ALL {
        assert_eq!(per_expert.adapted_experts(proj), [0, 2], "{proj}");
    }
    assert_eq!(per_expert.pairs.len(), 6);
    assert!(per_expert.router.is_some_and(|r| r.rank == 4));
    let gate_up = ExpertLoraLayer::of(&pool, 1, 1).unwrap();
    assert_eq!(gate_up.adapted_experts(ExpertProj::Gate), [0, 1, 2, 3]);
    assert_eq!(gate_up.adapted_experts(ExpertProj::Up), [0, 1, 2, 3]);
    assert!(gate_up.adapted_experts(ExpertProj::Down).is_empty());
    assert!(gate_up.router.is_none());
    let empty = ExpertLoraLayer::of(&pool, 2, 1).unwrap();
    assert!(empty.pairs.is_empty() && empty.router.is_none());
}

#[test]
fn work_items_are_the_adapted_experts_row_blocks() {
    let pool = pool();
    let layer = ExpertLoraLayer::of(&pool, 0, 1).unwrap();
    // Tokens routed to (0, 1), (2, 3), (1, 0): expert 0 has rows 0..2,
    // expert 2 row 4.
    let routing = SortedRouting::from_topk(&[0, 1, 2, 3, 1, 0], 2, 4).unwrap();
    let items: Vec<(usize, usize, usize)> = layer
        .work_items(ExpertProj::Down, &routing)
        .iter()
        .map(|w| (w.expert, w.row_start, w.rows))
        .collect();
    assert_eq!(items, [(0, 0, 2), (2, 4, 1)]);
}

#[test]
fn dense_layers_and_missing_slots_are_errors() {
    let pool = pool();
    assert!(matches!(
        ExpertLoraLayer::of(&pool, 0, 0),
        Err(MoeError::NotMoeLayer { layer: 0 })
    ));
    assert!(matches!(
        ExpertLoraLayer::of(&pool, 3, 1),
        Err(MoeError::NoSuchSlot { slot: 3, .. })
    ));
}
