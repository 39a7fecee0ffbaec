//! The pool never moves: a CUDA graph captured before a swap replays
//! correctly after it, once a new step has written its rows (GPU only;
//! skipped without one, failed under `LORA_REQUIRE_GPU=1`).

#![allow(clippy::unwrap_used)]

mod common;

use common::{fixtures, model_config, oracle, rel_error, to_bf16};
use lora_kernels::testing::cuda_or_skip;
use lora_kernels::{KernelError, Rows, RowsMut};
use lora_layout::LoraModule;
use lora_pool::{AdapterSource, BatchCapacity, FusedTargets, LoraOptions, LoraPool, PoolError, StepRow};

const WEIGHT: &str = "model.layers.1.self_attn.q_proj.weight";

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn a_graph_captured_before_a_swap_serves_the_new_adapter_after_it() {
    let Some(device) = cuda_or_skip("a_graph_captured_before_a_swap_serves_the_new_adapter_after_it") else {
        return;
    };
    let root = fixtures().join("llama");
    let (d0, d1, d2) = (
        root.join("demo_r4_plain"),
        root.join("demo_r8_rslora"),
        root.join("demo_r16_alpha_pattern"),
    );
    let sources = [
        AdapterSource { name: "a", dir: &d0 },
        AdapterSource { name: "b", dir: &d1 },
    ];
    let opts = LoraOptions {
        max_loras: 2,
        max_rank: 16,
        rotatable: true,
        ..LoraOptions::default()
    };
    let mut pool = LoraPool::load(&device, model_config("llama"), opts, BatchCapacity::default(), &sources).unwrap();
    let (o0, o1, o2) = (
        oracle("llama", "demo_r4_plain"),
        oracle("llama", "demo_r8_rslora"),
        oracle("llama", "demo_r16_alpha_pattern"),
    );
    let input = |o: &lora_audit::Oracle| o.inputs.inputs[WEIGHT].data.clone();
    let output = |o: &lora_audit::Oracle| o.expected[&format!("probe_out::{WEIGHT}")].data.clone();
    let (out_dim, in_dim) = LoraModule::QProj.dims(pool.config());
    let n = 8;
    let (lease_a, lease_b) = (pool.acquire("a").unwrap(), pool.acquire("b").unwrap());
    let rows = [[StepRow::Adapter(&lease_a); 4], [StepRow::Adapter(&lease_b); 4]].concat();
    let step = pool.decode_step(&rows, n).unwrap();
    let mut x_host = input(&o0);
    x_host.extend(input(&o1));
    let mut x = device.upload(&to_bf16(&x_host)).unwrap();
    let mut y = device.alloc_zeros::<f32>(n * out_dim).unwrap();
    let target = FusedTargets::single(pool.config(), LoraModule::QProj);
    let graph = {
        let (pool, step, x, y) = (&pool, &step, &x, &mut y);
        device
            .capture_graph(|| {
                pool.apply_decode(
                    step,
                    1,
                    &target,
                    Rows::dense(x, n, in_dim),
                    RowsMut::dense(y, n, out_dim),
                )
                .map_err(|e| KernelError::InvalidArgument {
                    arg: "pool",
                    reason: e.to_string(),
                })
            })
            .unwrap()
    };
    let pool_addr = pool.pool_addr();
    let table_addr = pool.table().device_addr();

    graph.replay().unwrap();
    device.check_faults().unwrap();
    let got = y.download().unwrap();
    assert!(rel_error(&got[..4 * out_dim], &output(&o0)) < 1e-2);
    assert!(rel_error(&got[4 * out_dim..], &output(&o1)) < 1e-2);

    // Swap slot 1 while the graph exists; only buffer contents change. The
    // step holds slot 1 until it and b's lease are dropped.
    let slot_b = lease_b.slot();
    assert!(matches!(
        pool.swap_from_disk(slot_b, "c", &d2),
        Err(PoolError::SlotInUse { slot, .. }) if slot == slot_b
    ));
    drop((step, lease_b));
    pool.swap_from_disk(slot_b, "c", &d2).unwrap();
    assert_eq!(
        (pool.pool_addr(), pool.table().device_addr()),
        (pool_addr, table_addr),
        "the pool never moves"
    );
    x.write(4 * in_dim, &to_bf16(&input(&o2))).unwrap();
    // Before a new step, the row buffer the graph reads holds base rows
    // only: the dropped step's rows never serve the slot's next adapter.
    y.zero_range(0, n * out_dim).unwrap();
    graph.replay().unwrap();
    device.check_faults().unwrap();
    assert!(
        y.download().unwrap().iter().all(|v| *v == 0.0),
        "a replay with no step adds no delta"
    );
    // The next step writes its rows where the graph reads them.
    let lease_c = pool.acquire("c").unwrap();
    let rows = [[StepRow::Adapter(&lease_a); 4], [StepRow::Adapter(&lease_c); 4]].concat();
    let _step = pool.decode_step(&rows, n).unwrap();
    graph.replay().unwrap();
    device.check_faults().unwrap();
    let got = y.download().unwrap();
    assert!(
        rel_error(&got[..4 * out_dim], &output(&o0)) < 1e-2,
        "slot 0 still serves its adapter"
    );
    let err = rel_error(&got[4 * out_dim..], &output(&o2));
    assert!(err < 1e-2, "slot 1 now serves the swapped-in adapter: {err}");
}
