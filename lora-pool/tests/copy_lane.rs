//! Swaps on the copy lane: `begin_swap` queues a slot's bytes beside the
//! compute lane and returns; until `finish_swap` the slot is unservable,
//! steps over the other slots run, and every other writer is refused. On
//! CUDA the copy lane waits for compute work queued before it, so a kernel
//! of a dropped step still reading the slot sees its old bytes whole.

#![allow(clippy::unwrap_used)]

mod common;

use common::{dir, model_config, oracle, queue_busy_work, rel_error, slot, to_bf16};
use lora_kernels::testing::cuda_or_skip;
use lora_kernels::{Device, DeviceBuffer, Rows, RowsMut};
use lora_layout::LoraModule;
use lora_pool::{AdapterSource, BatchCapacity, FusedTargets, LoraOptions, LoraPool, PoolError, StepRow, SwapRoute};

const WEIGHT: &str = "model.layers.1.self_attn.q_proj.weight";

fn input(adapter: &str) -> Vec<f32> {
    oracle("llama", adapter).inputs.inputs[WEIGHT].data.clone()
}

fn output(adapter: &str) -> Vec<f32> {
    oracle("llama", adapter).expected[&format!("probe_out::{WEIGHT}")]
        .data
        .clone()
}

fn pool_of(device: &Device, max_loras: usize, adapters: &[(&str, &str)]) -> LoraPool {
    pool_with_tier(device, max_loras, 0, adapters)
}

fn pool_with_tier(device: &Device, max_loras: usize, host_tier_bytes: usize, adapters: &[(&str, &str)]) -> LoraPool {
    let dirs: Vec<_> = adapters.iter().map(|(_, a)| dir(a)).collect();
    let sources: Vec<AdapterSource<'_>> = adapters
        .iter()
        .zip(&dirs)
        .map(|((name, _), dir)| AdapterSource { name, dir })
        .collect();
    let opts = LoraOptions {
        max_loras,
        max_rank: 16,
        rotatable: true,
        host_tier_bytes,
        ..LoraOptions::default()
    };
    LoraPool::load(device, model_config("llama"), opts, BatchCapacity::default(), &sources).unwrap()
}

/// q_proj of layer 1 through a decode step of 4 rows of `name`, against
/// the probe input of fixture `adapter`: the output, downloaded.
fn q_proj_rows(pool: &mut LoraPool, name: &str, adapter: &str) -> Vec<f32> {
    queue_q_proj(pool, name, adapter, |_| {}).download().unwrap()
}

/// Queue an apply of q_proj for four rows of `name` on `adapter`'s probe
/// input, after `before` queued its work; the step and lease are dropped
/// once the apply is queued. Returns its output buffer.
fn queue_q_proj(pool: &mut LoraPool, name: &str, adapter: &str, before: impl FnOnce(&Device)) -> DeviceBuffer<f32> {
    let device = pool.device().clone();
    let (out_dim, in_dim) = LoraModule::QProj.dims(pool.config());
    let lease = pool.acquire(name).unwrap();
    let step = pool.decode_step(&[StepRow::Adapter(&lease); 4], 4).unwrap();
    let x = device.upload(&to_bf16(&input(adapter))).unwrap();
    let mut y = device.alloc_zeros::<f32>(4 * out_dim).unwrap();
    let target = FusedTargets::single(pool.config(), LoraModule::QProj);
    before(&device);
    pool.apply_decode(
        &step,
        1,
        &target,
        Rows::dense(&x, 4, in_dim),
        RowsMut::dense(&mut y, 4, out_dim),
    )
    .unwrap();
    y
}

/// The contract of a begun swap, on `device`.
fn a_begun_swap_is_unservable_until_finished(device: &Device) {
    let mut pool = pool_of(device, 3, &[("a", "demo_r4_plain"), ("b", "demo_r8_rslora")]);
    assert_eq!(pool.swap_landed().unwrap(), None);
    assert!(matches!(pool.finish_swap(), Err(PoolError::NoPendingSwap)));

    pool.begin_swap(slot(2), "c", &dir("demo_r16_alpha_pattern")).unwrap();
    assert!(pool.swap_landed().unwrap().is_some());
    assert!(
        matches!(pool.acquire("c"), Err(PoolError::NotResident(_))),
        "a begun swap serves nothing yet"
    );
    // Steps over the other slots go on.
    let got = q_proj_rows(&mut pool, "a", "demo_r4_plain");
    assert!(rel_error(&got, &output("demo_r4_plain")) < 1e-2);
    // Every other writer waits for the pending swap.
    let pending = |r: Result<(), PoolError>| matches!(r, Err(PoolError::SwapPending { slot: s }) if s == slot(2));
    assert!(pending(pool.begin_swap(slot(1), "d", &dir("rslora")).map(|_| ())));
    assert!(pending(pool.swap_from_disk(slot(1), "d", &dir("rslora")).map(|_| ())));
    assert!(pending(pool.evict(slot(1))));
    assert!(pending(pool.tune_staging(lora_pool::StagingTuning::default())));
    assert_eq!(pool.slot_of("b"), Some(slot(1)), "refused writers changed nothing");

    let report = pool.finish_swap().unwrap();
    assert_eq!((report.slot, report.name.as_str()), (slot(2), "c"));
    assert_eq!(pool.swap_landed().unwrap(), None);
    assert!(matches!(pool.finish_swap(), Err(PoolError::NoPendingSwap)));
    let got = q_proj_rows(&mut pool, "c", "demo_r16_alpha_pattern");
    let err = rel_error(&got, &output("demo_r16_alpha_pattern"));
    assert!(err < 1e-2, "the finished swap serves its adapter: {err}");
    // And the next swap goes through.
    pool.swap_from_disk(slot(1), "d", &dir("rslora")).unwrap();
}

#[test]
fn a_begun_swap_is_unservable_until_finished_on_the_cpu() {
    a_begun_swap_is_unservable_until_finished(&Device::cpu());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn a_begun_swap_is_unservable_until_finished_on_cuda() {
    let Some(device) = cuda_or_skip("a_begun_swap_is_unservable_until_finished_on_cuda") else {
        return;
    };
    a_begun_swap_is_unservable_until_finished(&device);
}

#[test]
fn a_refused_begin_leaves_nothing_pending() {
    let device = Device::cpu();
    let mut pool = pool_of(&device, 2, &[("a", "demo_r4_plain")]);
    let before = pool.slot_contents(slot(1)).unwrap();
    assert!(pool.begin_swap(slot(1), "x", &dir("loha")).is_err());
    assert_eq!(pool.swap_landed().unwrap(), None);
    assert_eq!(pool.slot_contents(slot(1)).unwrap(), before);
    pool.begin_swap(slot(1), "b", &dir("rslora")).unwrap();
    pool.finish_swap().unwrap();
    assert_eq!(pool.slot_of("b"), Some(slot(1)));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn the_copy_lane_waits_for_a_dropped_steps_kernel_still_reading_the_slot_on_cuda() {
    let Some(device) = cuda_or_skip("the_copy_lane_waits_for_a_dropped_steps_kernel_still_reading_the_slot_on_cuda")
    else {
        return;
    };
    // No module is compiled while the apply waits (a compile on the host
    // would let the busy work finish before the swap is queued).
    device.preload_kernels().unwrap();
    // Each route into the slot: the host pack (F32 data), the device repack
    // (BF16 data that fits the staging slot) and the host tier.
    for (new, tier_bytes, want_route) in [
        ("demo_r16_alpha_pattern", 0, SwapRoute::HostPack),
        ("dense_all_linear_bf16", 0, SwapRoute::DeviceRepack),
        ("demo_r16_alpha_pattern", 1 << 30, SwapRoute::HostTier),
    ] {
        // The case this test is for: the swap queued while the apply still
        // waits. Where the host was slower than the busy work, again with
        // four times the work.
        let exercised = [4, 16, 64]
            .into_iter()
            .any(|busy| swap_behind_a_waiting_apply(&device, new, tier_bytes, want_route, busy));
        assert!(
            exercised,
            "{want_route:?}: every apply ran before its swap was queued; the ordering was not exercised"
        );
    }
}

/// Queue `busy` rounds of busy work, an apply of adapter `a` in slot 0, drop
/// its step and lease, swap `new` into slot 0 by `want_route`, and check
/// that the apply read the old adapter whole and the slot holds the new
/// one. Returns whether the swap was queued while the apply still waited.
fn swap_behind_a_waiting_apply(
    device: &Device,
    new: &str,
    tier_bytes: usize,
    want_route: SwapRoute,
    busy: usize,
) -> bool {
    let want_c = pool_of(&Device::cpu(), 2, &[("c", new)])
        .slot_contents(slot(0))
        .unwrap();
    let mut pool = pool_with_tier(
        device,
        2,
        tier_bytes,
        &[("a", "demo_r4_plain"), ("b", "demo_r8_rslora")],
    );
    if tier_bytes > 0 {
        pool.prefetch("c", &dir(new)).unwrap();
        pool.wait_for_prefetch();
    }
    // The apply waits behind long work on the compute lane; its step and
    // lease are dropped before it ran.
    let y = queue_q_proj(&mut pool, "a", "demo_r4_plain", |device| {
        for _ in 0..busy {
            queue_busy_work(device);
        }
    });
    let applied = device.record_event().unwrap();
    let route = pool.begin_swap(slot(0), "c", &dir(new)).unwrap();
    // Asked before the finish, which waits for a device repack's value scan
    // (behind the apply) on the host.
    let queued_behind = !applied.is_done().unwrap();
    assert_eq!(route, want_route);
    pool.finish_swap().unwrap();
    device.check_faults().unwrap();
    let err = rel_error(&y.download().unwrap(), &output("demo_r4_plain"));
    eprintln!(
        "{route:?}, {busy} rounds of busy work: swap queued while the apply waited: {queued_behind}; relative error {err:.2e}"
    );
    assert!(
        err < 1e-2,
        "{route:?}: the queued apply read the slot's old adapter whole: {err}"
    );
    assert!(
        pool.slot_contents(slot(0)).unwrap() == want_c,
        "{route:?}: the slot holds the new adapter, bit for bit"
    );
    queued_behind
}
