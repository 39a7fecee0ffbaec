use lora_kernels::Device;
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, PoolError};

use super::*;
use crate::test_support::{config, fixtures};

/// Slot 0: the 4.x Qwen3-MoE adapter (experts 0 and 2, router, dense parts).
fn pool() -> LoraPool {
    let dir = fixtures().join("qwen3_moe_v4/experts_per_expert_router");
    let opts = LoraOptions {
        max_loras: 2,
        experts: true,
        ..LoraOptions::default()
    };
    let source = AdapterSource {
        name: "experts",
        dir: &dir,
    };
    LoraPool::load(
        &Device::cpu(),
        config("qwen3_moe_v4"),
        opts,
        BatchCapacity::default(),
        &[source],
    )
    .unwrap()
}

fn inputs(probes: &[(&str, Vec<usize>)]) -> ProbeInputs {
    let mut out = ProbeInputs::default();
    for (name, shape) in probes {
        let len = shape.iter().product();
        let data = (0..len).map(|i| (i % 7) as f32 / 7.0 - 0.5).collect();
        out.inputs.insert(
            name.to_string(),
            ProbeTensor {
                shape: shape.clone(),
                data,
            },
        );
    }
    out
}

#[test]
fn answers_expert_and_router_probes_and_leaves_the_rest() {
    let mut pool = pool();
    let lease = pool.acquire("experts").unwrap();
    let probes = inputs(&[
        ("model.layers.1.mlp.experts.2.up_proj.weight", vec![3, 32]),
        ("model.layers.1.mlp.experts.1.down_proj.weight", vec![3, 16]),
        ("model.layers.1.mlp.gate.weight", vec![3, 32]),
        ("model.layers.1.mlp.experts.gate_up_proj", vec![3, 32]),
        ("model.layers.0.self_attn.q_proj.weight", vec![3, 32]),
    ]);
    let out = probe_expert_lora(&mut pool, &lease, &probes).unwrap();
    // The probe's steps are gone with it: only the caller's lease holds the slot.
    assert_eq!(pool.ref_count(lease.slot()), 1);
    assert_eq!(out.not_expert, ["model.layers.0.self_attn.q_proj.weight"]);
    let shape = |k: &str| out.tensors[&format!("{PROBE_OUT}{k}")].shape.clone();
    assert_eq!(shape("model.layers.1.mlp.experts.2.up_proj.weight"), [3, 16]);
    assert_eq!(shape("model.layers.1.mlp.gate.weight"), [3, 4]);
    assert_eq!(shape("model.layers.1.mlp.experts.gate_up_proj"), [4, 3, 32]);
    let data = |k: &str| out.tensors[&format!("{PROBE_OUT}{k}")].data.clone();
    assert!(
        data("model.layers.1.mlp.experts.2.up_proj.weight")
            .iter()
            .any(|v| *v != 0.0)
    );
    // Expert 1 is not adapted: its served delta is zero.
    assert!(
        data("model.layers.1.mlp.experts.1.down_proj.weight")
            .iter()
            .all(|v| *v == 0.0)
    );
    // The fused view: experts 0 and 2 carry deltas, 1 and 3 none.
    let fused = data("model.layers.1.mlp.experts.gate_up_proj");
    let per_expert: Vec<bool> = fused.chunks(3 * 32).map(|e| e.iter().any(|v| *v != 0.0)).collect();
    assert_eq!(per_expert, [true, false, true, false]);
}

#[test]
fn malformed_probes_are_errors() {
    let mut pool = pool();
    let lease = pool.acquire("experts").unwrap();
    for (name, shape) in [
        ("model.layers.1.mlp.gate.weight", vec![3, 31]),
        ("model.layers.1.mlp.experts.0.down_proj.weight", vec![3, 32]),
        ("model.layers.1.mlp.experts.9.down_proj.weight", vec![3, 16]),
        ("model.layers.1.mlp.gate.weight", vec![2, 3, 32]),
    ] {
        let err = probe_expert_lora(&mut pool, &lease, &inputs(&[(name, shape.clone())])).unwrap_err();
        assert!(
            matches!(err, MoeError::Probe { .. } | MoeError::Audit(_)),
            "{name} {shape:?}: {err}"
        );
    }
    let mut bad_len = inputs(&[("model.layers.1.mlp.gate.weight", vec![3, 32])]);
    if let Some(t) = bad_len.inputs.values_mut().next() {
        t.data.pop();
    }
    assert!(matches!(
        probe_expert_lora(&mut pool, &lease, &bad_len),
        Err(MoeError::Probe { .. })
    ));
    // An empty slot cannot be probed: no lease names it (only a resident
    // adapter is leased), and a lease of another pool is refused.
    assert!(matches!(pool.acquire("absent"), Err(PoolError::NotResident(_))));
    let other = self::pool();
    let foreign = other.acquire("experts").unwrap();
    let probes = inputs(&[("model.layers.1.mlp.gate.weight", vec![3, 32])]);
    assert!(matches!(
        probe_expert_lora(&mut pool, &foreign, &probes),
        Err(MoeError::Pool(PoolError::ForeignLease { row: 0, .. }))
    ));
}
