use lora_kernels::Device;
use lora_layout::{RefuseReason, RouteRefused};
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions};

use super::*;
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
    let pool = pool(&device);
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(8, 2)).unwrap();
    let routes = moe
        .set_decode_batch(
            &pool,
            &[MoeRequest::Slot(0), MoeRequest::Base, MoeRequest::Adapter("experts")],
            5,
        )
        .unwrap();
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
    let pool = pool(&device);
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(8, 2)).unwrap();
    moe.set_prefill_batch(
        &pool,
        &[0, 2, 2, 5],
        &[MoeRequest::Base, MoeRequest::Slot(0), MoeRequest::Slot(0)],
    )
    .unwrap();
    assert_eq!(moe.n_tokens(), Some(5));
    assert_eq!(moe.row_adapter().download_range(0, 5).unwrap(), [-1, -1, 0, 0, 0]);
}

#[test]
fn a_refused_request_fails_the_batch_and_writes_nothing() {
    let device = Device::cpu();
    let pool = pool(&device);
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(8, 2)).unwrap();
    moe.set_decode_batch(&pool, &[MoeRequest::Slot(0), MoeRequest::Slot(0)], 2)
        .unwrap();
    let err = moe
        .set_decode_batch(&pool, &[MoeRequest::Base, MoeRequest::Adapter("not-loaded")], 2)
        .unwrap_err();
    assert!(matches!(
        err,
        MoeError::Refused(RouteRefused {
            row: 1,
            reason: RefuseReason::NotResident
        })
    ));
    let err = moe
        .set_prefill_batch(
            &pool,
            &[0, 1, 3],
            &[MoeRequest::Adapter("not-loaded"), MoeRequest::Base],
        )
        .unwrap_err();
    assert!(matches!(err, MoeError::Refused(RouteRefused { row: 0, .. })));
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
    let route = crate::route::resolve_request_route(&pool, 0, MoeRequest::Adapter("experts")).unwrap();
    assert_eq!(
        route,
        MoeLoraRoute::Refuse {
            reason: RefuseReason::ExpertsDisabled
        }
    );
    let route = crate::route::resolve_request_route(&pool, 0, MoeRequest::Base).unwrap();
    assert_eq!(route, MoeLoraRoute::Skip);
}

#[test]
fn malformed_batches_are_errors() {
    let device = Device::cpu();
    let pool = pool(&device);
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(4, 2)).unwrap();
    assert!(matches!(
        moe.set_decode_batch(&pool, &[MoeRequest::Slot(1)], 1),
        Err(MoeError::EmptySlot { row: 0, slot: 1 })
    ));
    assert!(matches!(
        moe.set_decode_batch(&pool, &[MoeRequest::Base, MoeRequest::Slot(9)], 2),
        Err(MoeError::NoSuchSlot { row: 1, slot: 9, .. })
    ));
    assert!(matches!(
        moe.set_decode_batch(&pool, &[MoeRequest::Base; 3], 2),
        Err(MoeError::Shape {
            arg: "padded_tokens",
            ..
        })
    ));
    assert!(matches!(
        moe.set_decode_batch(&pool, &[MoeRequest::Base], 5),
        Err(MoeError::BatchTooLarge {
            what: "tokens",
            got: 5,
            capacity: 4
        })
    ));
    assert!(matches!(
        moe.set_prefill_batch(&pool, &[0, 3, 2], &[MoeRequest::Base, MoeRequest::Base]),
        Err(MoeError::SeqLens(_))
    ));
    assert!(matches!(
        moe.set_prefill_batch(&pool, &[0, 5], &[MoeRequest::Base]),
        Err(MoeError::BatchTooLarge { what: "tokens", .. })
    ));
    assert_eq!(moe.n_tokens(), None);
}

#[test]
fn scratch_serves_only_the_pool_it_was_made_for() {
    let device = Device::cpu();
    let pool_a = pool(&device);
    let pool_b = pool(&device);
    let mut moe = MoeLora::new(&pool_a, MoeCapacity::for_tokens(4, 2)).unwrap();
    assert!(matches!(
        moe.set_decode_batch(&pool_b, &[MoeRequest::Base], 1),
        Err(MoeError::PoolMismatch(_))
    ));
    let other_device = pool(&Device::cpu());
    assert!(matches!(
        moe.set_decode_batch(&other_device, &[MoeRequest::Base], 1),
        Err(MoeError::PoolMismatch(_))
    ));
}
