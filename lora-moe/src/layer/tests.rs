use half::bf16;
use lora_kernels::testing::Rng;
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::{RefuseReason, RouteRefused};
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, PoolError, PrefillSeq, SlotId, Step, StepKind, StepRow};

use super::*;
use crate::fold::SortedRows;
use crate::route::{MoeRequest, resolve_request_route, resolve_routes};
use crate::target::ExpertTarget;
use crate::test_support::{config, fixtures};

fn options() -> LoraOptions {
    LoraOptions {
        max_loras: 3,
        experts: true,
        ..LoraOptions::default()
    }
}

/// A qwen3_moe_v4 pool: slot 0 the 4.x expert adapter, slots 1 and 2 empty.
fn pool(device: &Device) -> LoraPool {
    let dir = fixtures().join("qwen3_moe_v4/experts_per_expert_router");
    LoraPool::load(
        device,
        config("qwen3_moe_v4"),
        options(),
        BatchCapacity::default(),
        &[AdapterSource {
            name: "experts",
            dir: &dir,
        }],
    )
    .unwrap()
}

#[test]
fn a_dense_model_has_no_moe_layer() {
    let pool = LoraPool::new(&Device::cpu(), config("llama"), options(), BatchCapacity::default()).unwrap();
    assert!(matches!(
        MoeLora::new(&pool, MoeCapacity::for_tokens(4, 2)),
        Err(MoeError::NotMoe { model_type: "llama" })
    ));
}

#[test]
fn decode_batch_maps_fold_rows_to_their_slot_and_the_rest_to_minus_one() {
    let device = Device::cpu();
    let mut pool = pool(&device);
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(8, 2)).unwrap();
    // Two requests of the adapter, each with its own lease, around a base row.
    let (a, b) = (pool.acquire("experts").unwrap(), pool.acquire("experts").unwrap());
    assert_eq!(a.slot(), SlotId::new(0));
    let step = pool
        .decode_step(&[StepRow::Adapter(&a), StepRow::Base, StepRow::Adapter(&b)], 5)
        .unwrap();
    let routes = moe.set_decode_step(&pool, &step).unwrap();
    assert_eq!(
        routes,
        [
            MoeLoraRoute::Fold { slot: 0 },
            MoeLoraRoute::Skip,
            MoeLoraRoute::Fold { slot: 0 }
        ]
    );
    assert_eq!(moe.n_tokens(), Some(5));
    assert_eq!(moe.row_adapter().download_range(0, 5).unwrap(), [0, -1, 0, -1, -1]);
}

#[test]
fn prefill_batch_spreads_each_sequence_slot_over_its_tokens() {
    let device = Device::cpu();
    let mut pool = pool(&device);
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(8, 2)).unwrap();
    let lease = pool.acquire("experts").unwrap();
    let seq = |row, len| PrefillSeq { row, len };
    let step = pool
        .prefill_step(&[
            seq(StepRow::Base, 2),
            seq(StepRow::Adapter(&lease), 1),
            seq(StepRow::Adapter(&lease), 2),
        ])
        .unwrap();
    assert_eq!(step.cu_seqlens(), [0, 2, 3, 5]);
    moe.set_prefill_step(&pool, &step).unwrap();
    assert_eq!(moe.n_tokens(), Some(5));
    assert_eq!(moe.row_adapter().download_range(0, 5).unwrap(), [-1, -1, 0, 0, 0]);
    // A sequence without tokens never makes a step.
    let err = pool
        .prefill_step(&[seq(StepRow::Base, 2), seq(StepRow::Adapter(&lease), 0)])
        .unwrap_err();
    assert!(matches!(err, PoolError::Batch(_)), "{err}");
}

#[test]
fn a_refused_request_fails_the_batch_and_writes_nothing() {
    let device = Device::cpu();
    let mut pool = pool(&device);
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(8, 2)).unwrap();
    let lease = pool.acquire("experts").unwrap();
    let good = pool
        .decode_step(&[StepRow::Adapter(&lease), StepRow::Adapter(&lease)], 2)
        .unwrap();
    moe.set_decode_step(&pool, &good).unwrap();
    // An adapter that is not resident gets no lease, so it never joins a step.
    assert!(matches!(
        pool.acquire("not-loaded"),
        Err(PoolError::NotResident(name)) if name == "not-loaded"
    ));
    // A step the pool no longer holds (a newer one of its kind was built) is
    // refused, of either kind.
    let stale = pool.decode_step(&[StepRow::Base, StepRow::Base], 2).unwrap();
    let _newer = pool.decode_step(&[StepRow::Base], 1).unwrap();
    let err = moe.set_decode_step(&pool, &stale).unwrap_err();
    assert!(
        matches!(err, MoeError::Pool(PoolError::StaleStep { kind: StepKind::Decode })),
        "{err}"
    );
    let stale = pool
        .prefill_step(&[PrefillSeq {
            row: StepRow::Base,
            len: 3,
        }])
        .unwrap();
    let _newer = pool
        .prefill_step(&[PrefillSeq {
            row: StepRow::Adapter(&lease),
            len: 1,
        }])
        .unwrap();
    let err = moe.set_prefill_step(&pool, &stale).unwrap_err();
    assert!(
        matches!(
            err,
            MoeError::Pool(PoolError::StaleStep {
                kind: StepKind::Prefill
            })
        ),
        "{err}"
    );
    // So is a step of another pool, even one shaped like this one.
    let mut other = self::pool(&device);
    let foreign = other.decode_step(&[StepRow::Base, StepRow::Base], 2).unwrap();
    let err = moe.set_decode_step(&pool, &foreign).unwrap_err();
    assert!(matches!(err, MoeError::Pool(PoolError::StaleStep { .. })), "{err}");
    // The previous batch is still the batch.
    assert_eq!(moe.n_tokens(), Some(2));
    assert_eq!(moe.row_adapter().download_range(0, 2).unwrap(), [0, 0]);
}

#[test]
fn expert_deltas_with_experts_disabled_are_refused_not_skipped() {
    // A pool without expert pool cannot hold the expert adapter, so a request
    // naming it resolves from "not resident" with experts disabled.
    let device = Device::cpu();
    let opts = LoraOptions {
        experts: false,
        ..options()
    };
    let pool = LoraPool::new(&device, config("qwen3_moe_v4"), opts, BatchCapacity::default()).unwrap();
    assert!(!crate::route::experts_enabled(&pool));
    let route = resolve_request_route(&pool, 0, MoeRequest::Adapter("experts")).unwrap();
    assert_eq!(
        route,
        MoeLoraRoute::Refuse {
            reason: RefuseReason::ExpertsDisabled
        }
    );
    let route = resolve_request_route(&pool, 0, MoeRequest::Base).unwrap();
    assert_eq!(route, MoeLoraRoute::Skip);
    // With experts enabled, a name no slot holds is refused as not resident.
    let pool = self::pool(&device);
    let route = resolve_request_route(&pool, 0, MoeRequest::Adapter("not-loaded")).unwrap();
    assert_eq!(
        route,
        MoeLoraRoute::Refuse {
            reason: RefuseReason::NotResident
        }
    );
    assert!(matches!(
        ensure_batch_servable(&[MoeLoraRoute::Skip, route]),
        Err(RouteRefused {
            row: 1,
            reason: RefuseReason::NotResident
        })
    ));
}

#[test]
fn malformed_batches_are_errors() {
    let device = Device::cpu();
    let mut pool = pool(&device);
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(4, 2)).unwrap();
    // Requests by raw slot only resolve routes; an empty or missing slot is
    // an error there (a step names slots through leases only).
    assert!(matches!(
        resolve_request_route(&pool, 0, MoeRequest::Slot(SlotId::new(1))),
        Err(MoeError::EmptySlot { row: 0, slot: 1 })
    ));
    assert!(matches!(
        resolve_routes(&pool, &[MoeRequest::Base, MoeRequest::Slot(SlotId::new(9))]),
        Err(MoeError::NoSuchSlot { row: 1, slot: 9, .. })
    ));
    // More requests than padded rows never makes a step.
    assert!(matches!(
        pool.decode_step(&[StepRow::Base; 3], 2),
        Err(PoolError::Batch(m)) if m.contains("3 rows do not fit the 2 padded rows")
    ));
    // A step the pool serves, but more tokens than the scratch holds.
    let step = pool.decode_step(&[StepRow::Base], 5).unwrap();
    assert!(matches!(
        moe.set_decode_step(&pool, &step),
        Err(MoeError::BatchTooLarge {
            what: "tokens",
            got: 5,
            capacity: 4
        })
    ));
    let step = pool
        .prefill_step(&[PrefillSeq {
            row: StepRow::Base,
            len: 5,
        }])
        .unwrap();
    assert!(matches!(
        moe.set_prefill_step(&pool, &step),
        Err(MoeError::BatchTooLarge { what: "tokens", .. })
    ));
    assert_eq!(moe.n_tokens(), None);
}

#[test]
fn scratch_serves_only_the_pool_it_was_made_for() {
    let device = Device::cpu();
    let pool_a = pool(&device);
    let mut pool_b = pool(&device);
    let mut moe = MoeLora::new(&pool_a, MoeCapacity::for_tokens(4, 2)).unwrap();
    let step_b = pool_b.decode_step(&[StepRow::Base], 1).unwrap();
    assert!(matches!(
        moe.set_decode_step(&pool_b, &step_b),
        Err(MoeError::PoolMismatch(_))
    ));
    let mut other_device = pool(&Device::cpu());
    let step = other_device.decode_step(&[StepRow::Base], 1).unwrap();
    assert!(matches!(
        moe.set_decode_step(&other_device, &step),
        Err(MoeError::PoolMismatch(_))
    ));
}

/// The router fold of `step` at `layer` over `n` rows `x`, onto a copy of
/// `logits0`: the call's result and the logits after it.
fn router_fold<S: Step>(
    moe: &MoeLora,
    pool: &LoraPool,
    step: &S,
    layer: usize,
    (x, n): (&DeviceBuffer<bf16>, usize),
    logits0: &[f32],
) -> (Result<(), MoeError>, Vec<f32>) {
    let (hidden, num_experts) = (pool.config().hidden_size, logits0.len() / n);
    let mut logits = pool.device().upload(logits0).unwrap();
    let result = moe.apply_router_lora(
        pool,
        step,
        layer,
        Rows::dense(x, n, hidden),
        RowsMut::dense(&mut logits, n, num_experts),
    );
    (result, logits.download().unwrap())
}

/// The gate_up fold of `step` at `layer` over the `rows` indexed expert
/// rows `x`, onto a copy of `y0`: the call's result and y after it.
fn gate_up_fold<S: Step>(
    moe: &MoeLora,
    pool: &LoraPool,
    step: &S,
    layer: usize,
    (x, rows): (&DeviceBuffer<bf16>, usize),
    y0: &[f32],
) -> (Result<(), MoeError>, Vec<f32>) {
    let (hidden, width) = (pool.config().hidden_size, y0.len() / rows);
    let mut y = pool.device().upload(y0).unwrap();
    let result = moe.apply_expert_lora_decode(
        pool,
        step,
        layer,
        &ExpertTarget::gate_up(width / 2),
        Rows::dense(x, rows, hidden),
        RowsMut::dense(&mut y, rows, width),
    );
    (result, y.download().unwrap())
}

fn assert_stale(result: Result<(), MoeError>, kind: StepKind, what: &str) {
    assert!(
        matches!(result, Err(MoeError::Pool(PoolError::StaleStep { kind: k })) if k == kind),
        "{what}: {result:?}"
    );
}

/// Every fold and index takes the step the batch was set from: another
/// step (a newer one of the pool, the pool's prefill step, or the batch's
/// own step once the pool has moved on) is refused as stale before any
/// launch, and the output is left as it was.
#[test]
fn a_fold_with_another_step_than_the_batchs_is_refused_and_writes_nothing() {
    let device = Device::cpu();
    let mut pool = pool(&device);
    let cfg = pool.config().clone();
    let dims = cfg.moe.clone().unwrap();
    let (hidden, num_experts, top_k, inter) = (
        cfg.hidden_size,
        dims.num_experts,
        dims.top_k,
        dims.expert_intermediate_size,
    );
    let layer = (0..cfg.num_hidden_layers).find(|&l| cfg.is_moe_layer(l)).unwrap();
    let (n, rows) = (2, 2 * top_k);
    let mut rng = Rng::new(0x57a1e);
    let lease = pool.acquire("experts").unwrap();
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(4, top_k)).unwrap();
    let set = pool
        .decode_step(&[StepRow::Adapter(&lease), StepRow::Adapter(&lease)], n)
        .unwrap();
    moe.set_decode_step(&pool, &set).unwrap();
    // Every token routed to experts 0 and 2, which the adapter adapts.
    let topk: Vec<i32> = (0..n).flat_map(|_| [0, 2]).collect();
    let topk_ids = device.upload(&topk).unwrap();
    let router_x = device.upload(&rng.bf16_vec(n * hidden, 1.0)).unwrap();
    let expert_x = device.upload(&rng.bf16_vec(rows * hidden, 1.0)).unwrap();
    let logits0: Vec<f32> = (0..n * num_experts).map(|_| rng.uniform()).collect();
    let y0: Vec<f32> = (0..rows * 2 * inter).map(|_| rng.uniform()).collect();
    let router = (&router_x, n);
    let experts = (&expert_x, rows);

    // With the batch's own step, both folds write.
    let (result, logits) = router_fold(&moe, &pool, &set, layer, router, &logits0);
    result.unwrap();
    assert_ne!(logits, logits0, "the batch's own step folds the router delta");
    moe.index_decode_rows(&pool, &set, &topk_ids).unwrap();
    let (result, y) = gate_up_fold(&moe, &pool, &set, layer, experts, &y0);
    result.unwrap();
    assert_ne!(y, y0, "the batch's own step folds the expert deltas");

    // The pool moves on: a newer decode step and a prefill step, neither
    // the batch's; the batch's own step is now stale in the pool.
    let newer = pool.decode_step(&[StepRow::Adapter(&lease), StepRow::Base], n).unwrap();
    let prefill = pool
        .prefill_step(&[PrefillSeq {
            row: StepRow::Adapter(&lease),
            len: n,
        }])
        .unwrap();
    let checks = [
        ("newer decode step", StepKind::Decode, {
            let router = router_fold(&moe, &pool, &newer, layer, router, &logits0);
            (router, gate_up_fold(&moe, &pool, &newer, layer, experts, &y0))
        }),
        ("prefill step", StepKind::Prefill, {
            let router = router_fold(&moe, &pool, &prefill, layer, router, &logits0);
            (router, gate_up_fold(&moe, &pool, &prefill, layer, experts, &y0))
        }),
        ("the batch's stale step", StepKind::Decode, {
            let router = router_fold(&moe, &pool, &set, layer, router, &logits0);
            (router, gate_up_fold(&moe, &pool, &set, layer, experts, &y0))
        }),
    ];
    for (what, kind, ((router_result, logits), (expert_result, y))) in checks {
        assert_stale(router_result, kind, &format!("router fold, {what}"));
        assert_eq!(
            logits, logits0,
            "router fold, {what}: the refused fold wrote the logits"
        );
        assert_stale(expert_result, kind, &format!("expert fold, {what}"));
        assert_eq!(y, y0, "expert fold, {what}: the refused fold wrote y");
    }
    // The index builders too, leaving the index as it was.
    let index_before = moe.expert_index().download().unwrap();
    assert_stale(
        moe.index_decode_rows(&pool, &newer, &topk_ids),
        StepKind::Decode,
        "decode index, newer step",
    );
    let sorted_token = device.upload(&(0..rows as i32).collect::<Vec<_>>()).unwrap();
    let offsets = device.upload(&vec![0i32; num_experts + 1]).unwrap();
    let sorted = SortedRows {
        sorted_token: &sorted_token,
        n_sorted: rows,
        expert_offsets: &offsets,
    };
    assert_stale(
        moe.index_sorted_rows(&pool, &prefill, sorted),
        StepKind::Prefill,
        "sorted index, prefill step",
    );
    assert_eq!(moe.expert_index().download().unwrap(), index_before);

    // Set from the newer step, the batch is the newer step's: its adapter
    // row folds again, its base row adds nothing.
    moe.set_decode_step(&pool, &newer).unwrap();
    let (result, logits) = router_fold(&moe, &pool, &newer, layer, router, &logits0);
    result.unwrap();
    assert_ne!(logits[..num_experts], logits0[..num_experts]);
    assert_eq!(logits[num_experts..], logits0[num_experts..]);
}
