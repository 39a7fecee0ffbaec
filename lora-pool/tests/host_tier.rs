//! The host tier: prefetched (or disk-swapped) adapters kept as packed
//! images in pinned host memory, promoted by one copy; LRU by bytes with
//! pins, stale images never served, refusals reported once.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use common::{dir, model_config, options, queue_busy_work, slot, snapshot};
use lora_audit::AuditError;
use lora_kernels::Device;
use lora_layout::SlotLayout;
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool, PoolError, SwapRoute, TierError};

/// Bytes of one slot image of the llama fixtures at rank 16.
fn slot_bytes() -> usize {
    SlotLayout::new(&model_config("llama"), 16).unwrap().slot_bytes()
}

/// A CPU pool of 3 slots holding `x` in slot 0, with a host tier of
/// `tier_images` slot images (none for 0).
fn pool(tier_images: usize) -> LoraPool {
    let opts = LoraOptions {
        host_tier_bytes: tier_images * slot_bytes(),
        ..options(3, 0)
    };
    let seed = dir("demo_r8_rslora");
    let sources = [AdapterSource { name: "x", dir: &seed }];
    LoraPool::load(
        &Device::cpu(),
        model_config("llama"),
        opts,
        BatchCapacity::default(),
        &sources,
    )
    .unwrap()
}

/// The events of every prefetch queued so far, as (name, outcome).
fn events(pool: &LoraPool) -> Vec<(String, Result<usize, String>)> {
    pool.wait_for_prefetch();
    pool.prefetch_events()
        .into_iter()
        .map(|e| (e.name, e.outcome.map_err(|err| err.to_string())))
        .collect()
}

/// A copy of fixture adapter `adapter` in a directory of its own.
fn copy_of(adapter: &str, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("lora-pool-host-tier-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(dir(adapter).join(f), dst.join(f)).unwrap();
    }
    dst
}

/// Slot 1 of a pool without a tier after a disk swap of `adapter` there.
fn disk_swapped(adapter: &Path) -> LoraPool {
    let mut reference = pool(0);
    reference.swap_from_disk(slot(1), "a", adapter).unwrap();
    reference
}

#[test]
fn a_prefetched_adapter_is_promoted_by_one_copy_equal_to_a_disk_swap() {
    let mut pool = pool(4);
    let a = dir("demo_r4_plain");
    pool.prefetch("a", &a).unwrap();
    assert_eq!(events(&pool), [("a".to_string(), Ok(slot_bytes()))]);
    assert!(pool.prefetch_events().is_empty(), "each event is given once");
    assert_eq!(pool.host_tier().unwrap().names, ["a"]);
    let report = pool.swap_from_disk(slot(1), "a", &a).unwrap();
    assert_eq!(report.route, SwapRoute::HostTier);
    assert_eq!(report.audit_us, 0.0, "no audit on the way");
    let reference = disk_swapped(&a);
    assert_eq!(
        snapshot(&pool),
        snapshot(&reference),
        "bytes, tables and registry as a disk swap leaves them"
    );
    // The slot serves it like any other.
    let lease = pool.acquire("a").unwrap();
    drop(pool.decode_step(&[lora_pool::StepRow::Adapter(&lease)], 1).unwrap());
}

#[test]
fn a_refused_prefetch_is_reported_once_and_nothing_enters_the_tier() {
    let pool = pool(4);
    pool.prefetch("d", &dir("dora")).unwrap();
    pool.wait_for_prefetch();
    let events = pool.prefetch_events();
    assert_eq!(events.len(), 1);
    match &events[0].outcome {
        Err(PoolError::Audit { adapter, source }) => {
            assert_eq!(adapter, "d");
            assert!(matches!(source.as_ref(), AuditError::Refused(_)), "{source}");
            assert!(source.to_string().contains("REJECT[dora]"), "{source}");
        }
        other => panic!("expected the audit's refusal, got {other:?}"),
    }
    assert!(pool.prefetch_events().is_empty(), "reported once");
    assert!(pool.host_tier().unwrap().names.is_empty());
    let missing = events_of(&pool, "m", Path::new("/nonexistent/adapter"));
    assert!(missing.is_err(), "an unreadable directory is an event too");
}

fn events_of(pool: &LoraPool, name: &str, dir: &Path) -> Result<usize, String> {
    pool.prefetch(name, dir).unwrap();
    let mut got = events(pool);
    assert_eq!(got.len(), 1);
    got.remove(0).1
}

#[test]
fn a_disk_swap_fills_the_tier_on_the_way_and_the_next_promotion_is_a_copy() {
    let mut pool = pool(4);
    let a = dir("demo_r4_plain");
    let first = pool.swap_from_disk(slot(1), "a", &a).unwrap();
    assert_ne!(first.route, SwapRoute::HostTier);
    assert_eq!(events(&pool), [("a".to_string(), Ok(slot_bytes()))]);
    pool.evict(slot(1)).unwrap();
    let again = pool.swap_from_disk(slot(2), "a", &a).unwrap();
    assert_eq!(again.route, SwapRoute::HostTier);
    assert_eq!(
        pool.slot_contents(slot(2)).unwrap(),
        disk_swapped(&a).slot_contents(slot(1)).unwrap()
    );
}

#[test]
fn an_image_whose_files_changed_is_never_served() {
    let mut pool = pool(4);
    let a = copy_of("demo_r4_plain", "stale");
    pool.prefetch("a", &a).unwrap();
    assert!(events(&pool)[0].1.is_ok());
    // The adapter is replaced on disk by another one under the same name.
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(dir("rslora").join(f), a.join(f)).unwrap();
    }
    let report = pool.swap_from_disk(slot(1), "a", &a).unwrap();
    assert_ne!(report.route, SwapRoute::HostTier, "stale: read from disk again");
    assert_eq!(
        pool.slot_contents(slot(1)).unwrap(),
        disk_swapped(&a).slot_contents(slot(1)).unwrap()
    );
    // Nor is an image of another directory.
    let other = copy_of("demo_r4_plain", "other-dir");
    let mut pool = self::pool(4);
    pool.prefetch("b", &dir("demo_r4_plain")).unwrap();
    events(&pool);
    let report = pool.swap_from_disk(slot(1), "b", &other).unwrap();
    assert_ne!(report.route, SwapRoute::HostTier);
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&other).ok();
}

#[test]
fn the_tier_keeps_within_its_bytes_evicting_the_least_recently_used_and_never_a_pinned_one() {
    let pool = pool(2);
    let view = pool.host_tier().unwrap();
    assert_eq!((view.used, view.budget), (0, 2 * slot_bytes()));
    for name in ["a", "b", "c"] {
        pool.prefetch(name, &dir("demo_r4_plain")).unwrap();
    }
    assert!(events(&pool).iter().all(|(_, o)| o.is_ok()));
    let view = pool.host_tier().unwrap();
    assert_eq!(view.names, ["b", "c"], "a, the least recently used, left");
    assert_eq!(view.used, 2 * slot_bytes());
    pool.pin_in_host_tier("b", true).unwrap();
    pool.pin_in_host_tier("c", true).unwrap();
    pool.prefetch("d", &dir("rslora")).unwrap();
    let got = events(&pool);
    let err = got[0].1.as_ref().unwrap_err();
    assert!(
        err.contains("pinned") && err.contains(&slot_bytes().to_string()),
        "{err}"
    );
    assert_eq!(pool.host_tier().unwrap().names, ["b", "c"]);
    pool.pin_in_host_tier("b", false).unwrap();
    pool.prefetch("d", &dir("rslora")).unwrap();
    assert!(events(&pool)[0].1.is_ok());
    assert_eq!(pool.host_tier().unwrap().names, ["c", "d"]);
    assert_eq!(pool.host_tier().unwrap().pinned, ["c"]);
}

#[test]
fn without_a_tier_prefetch_and_pins_are_refused() {
    let pool = pool(0);
    assert!(pool.host_tier().is_none());
    assert!(matches!(
        pool.prefetch("a", &dir("demo_r4_plain")),
        Err(PoolError::HostTier(TierError::Disabled))
    ));
    assert!(matches!(
        pool.pin_in_host_tier("a", true),
        Err(PoolError::HostTier(TierError::Disabled))
    ));
    assert!(pool.prefetch_events().is_empty());
    assert!(matches!(
        pool.prefetch("", &dir("demo_r4_plain")),
        Err(PoolError::EmptyName)
    ));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn on_cuda_a_promotion_behind_a_busy_stream_lands_exactly_even_when_its_image_is_evicted_at_once() {
    let Some(device) = lora_kernels::testing::cuda_or_skip(
        "on_cuda_a_promotion_behind_a_busy_stream_lands_exactly_even_when_its_image_is_evicted_at_once",
    ) else {
        return;
    };
    // A tier of one image: the next prefetch evicts (and frees) the image
    // whose copy the promotion just queued behind a second of busy work.
    let opts = LoraOptions {
        host_tier_bytes: slot_bytes(),
        ..options(3, 0)
    };
    let seed = dir("demo_r8_rslora");
    let sources = [AdapterSource { name: "x", dir: &seed }];
    let mut pool = LoraPool::load(&device, model_config("llama"), opts, BatchCapacity::default(), &sources).unwrap();
    let a = dir("demo_r4_plain");
    pool.prefetch("a", &a).unwrap();
    assert!(events(&pool)[0].1.is_ok());
    queue_busy_work(&device);
    let report = pool.swap_from_disk(slot(1), "a", &a).unwrap();
    assert_eq!(report.route, SwapRoute::HostTier);
    pool.prefetch("b", &dir("rslora")).unwrap();
    assert!(events(&pool)[0].1.is_ok());
    assert_eq!(pool.host_tier().unwrap().names, ["b"], "a's image left the tier");
    let reference = disk_swapped(&a);
    for s in [0, 1] {
        assert_eq!(
            pool.slot_contents(slot(s)).unwrap(),
            reference.slot_contents(slot(s)).unwrap(),
            "slot {s} equals a CPU pool's"
        );
    }
}
