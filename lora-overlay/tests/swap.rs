//! Overlays follow the pool through swaps: a swap rebuilds the slot's
//! overlay (and one without overlays empties it) while other slots keep
//! theirs; a failed swap — a refused adapter, a slot a step still holds, or
//! running out of device memory at any allocation of the overlay's staging
//! — leaves every entry table and every served row as it was; the entry
//! tables and the step row map never move, so a CUDA graph captured before
//! a swap serves the new overlay after it, from the next step on.

#![allow(clippy::unwrap_used)]

mod common;

use common::{
    CAPACITY, OverriddenLogits, base_table, base_tables, fixtures, logits, model_config, options, oracle, oracle_rows,
    rel_error, token_overlays, widen,
};
use half::bf16;
use lora_audit::OverlayModule;
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{Device, EmbedOverlayEntry, KernelError, LmHeadOverlayEntry, Rows, RowsMut};
use lora_overlay::TokenOverlays;
use lora_pool::{AdapterSlot, AdapterSource, LoraPool, PoolError, SlotId, StepRow};

const MODEL: &str = "llama";

/// Everything a swap may change on the overlay side, and the pool's slots.
#[derive(Debug, PartialEq)]
struct Snapshot {
    embed_entries: Vec<EmbedOverlayEntry>,
    head_entries: Vec<LmHeadOverlayEntry>,
    /// Per slot: every id's served embedding row and lm_head row.
    rows: Vec<(Vec<bf16>, Vec<bf16>)>,
    slots: Vec<AdapterSlot>,
}

fn snapshot(pool: &LoraPool<TokenOverlays>) -> Snapshot {
    let overlays = pool.companion();
    let all: Vec<u32> = (0..overlays.tables().vocab() as u32).collect();
    let rows = (0..overlays.max_loras())
        .map(|s| {
            (
                overlays.served_rows(Some(s), OverlayModule::Embed, &all).unwrap(),
                overlays.served_rows(Some(s), OverlayModule::LmHead, &all).unwrap(),
            )
        })
        .collect();
    Snapshot {
        embed_entries: overlays.embed_entries().download().unwrap(),
        head_entries: overlays.lm_head_entries().download().unwrap(),
        rows,
        slots: pool.slots().to_vec(),
    }
}

fn load(device: &Device, adapters: &[(&str, &str)]) -> LoraPool<TokenOverlays> {
    common::pool(device, MODEL, 3, adapters)
}

/// Slot `slot` serves exactly `adapter`'s overlay: PEFT's rows where it
/// changed them, the base elsewhere (`None`: no overlay at all).
fn assert_serves(pool: &LoraPool<TokenOverlays>, slot: usize, adapter: Option<&str>) {
    let cfg = model_config(MODEL);
    let hidden = cfg.hidden_size;
    let tables = base_tables(MODEL);
    let peft = adapter.map(|a| oracle(MODEL, a));
    let all: Vec<u32> = (0..cfg.vocab_size as u32).collect();
    for module in [OverlayModule::Embed, OverlayModule::LmHead] {
        let served = widen(&pool.companion().served_rows(Some(slot), module, &all).unwrap());
        let (changed, merged) = peft.as_ref().map(|o| oracle_rows(o, module)).unwrap_or_default();
        let base = base_table(&tables, module);
        for v in 0..cfg.vocab_size {
            let row = &served[v * hidden..(v + 1) * hidden];
            match changed.iter().position(|&c| c == v) {
                Some(k) => assert!(rel_error(row, &merged[k * hidden..(k + 1) * hidden]) < 1e-2),
                None => assert_eq!(
                    row,
                    widen(&base[v * hidden..(v + 1) * hidden]),
                    "slot {slot} {module:?} id {v}"
                ),
            }
        }
    }
    assert_eq!(pool.companion().slot(slot).is_some(), adapter.is_some(), "slot {slot}");
}

fn swaps_rebuild_overlays_and_failures_change_nothing(device: &Device) {
    let mut pool = load(
        device,
        &[("dict", "trainable_tokens_untied_dict"), ("plain", "demo_r4_plain")],
    );
    assert_serves(&pool, 0, Some("trainable_tokens_untied_dict"));
    assert_serves(&pool, 1, None);
    let addrs = (
        pool.companion().embed_entries().device_addr(),
        pool.companion().lm_head_entries().device_addr(),
    );
    let before = snapshot(&pool);

    // Into an adapter without overlays' slot: the overlay appears, slot 0 is untouched.
    let dir = |a: &str| fixtures().join(MODEL).join(a);
    pool.swap_from_disk(SlotId::new(1), "saved", &dir("modules_to_save_embed_lm_head"))
        .unwrap();
    assert_serves(&pool, 1, Some("modules_to_save_embed_lm_head"));
    let after = snapshot(&pool);
    assert_eq!(after.rows[0], before.rows[0]);
    assert_eq!(after.embed_entries[0], before.embed_entries[0]);
    assert_ne!(after.embed_entries[1], before.embed_entries[1]);

    // Overlay over overlay, then no overlay: rebuilt, then emptied.
    pool.swap_from_disk(SlotId::new(0), "list", &dir("trainable_tokens_untied_list"))
        .unwrap();
    assert_serves(&pool, 0, Some("trainable_tokens_untied_list"));
    assert_serves(&pool, 1, Some("modules_to_save_embed_lm_head"));
    pool.swap_from_disk(SlotId::new(0), "rslora", &dir("rslora")).unwrap();
    assert_serves(&pool, 0, None);
    assert_eq!(
        pool.companion().embed_entries().download().unwrap()[0],
        EmbedOverlayEntry::default()
    );
    assert_eq!(
        pool.companion().lm_head_entries().download().unwrap()[0],
        LmHeadOverlayEntry::default()
    );
    pool.swap_from_disk(SlotId::new(2), "dict", &dir("trainable_tokens_untied_dict"))
        .unwrap();

    // Refused adapters change nothing.
    let before = snapshot(&pool);
    for (adapter, code) in [
        ("embedding_lora", "REJECT[embedding-lora-disabled]"),
        ("dora", "REJECT[dora]"),
    ] {
        for slot in (0..3).map(SlotId::new) {
            let err = pool.swap_from_disk(slot, "new", &dir(adapter)).unwrap_err();
            assert!(err.refusal_codes().contains(&code), "{adapter}: {err}");
            assert_eq!(
                snapshot(&pool),
                before,
                "refused {adapter} into slot {slot} changed something"
            );
        }
    }
    // A slot a step holds is refused to swaps and evictions alike, changing
    // nothing, even once the request's own lease is gone.
    let lease = pool.acquire("dict").unwrap();
    let held = lease.slot();
    assert_eq!(held, SlotId::new(2));
    let step = pool.decode_step(&[StepRow::Adapter(&lease), StepRow::Base], 2).unwrap();
    drop(lease);
    let refused = [
        pool.swap_from_disk(held, "new", &dir("trainable_tokens_untied_list"))
            .unwrap_err(),
        pool.evict(held).unwrap_err(),
    ];
    for err in refused {
        assert!(
            matches!(err, PoolError::SlotInUse { slot, leases: 1 } if slot == held),
            "{err}"
        );
    }
    assert_eq!(
        snapshot(&pool),
        before,
        "a refused swap into a held slot changed something"
    );
    drop(step);
    // Evicting empties the slot's overlay.
    pool.evict(SlotId::new(2)).unwrap();
    assert_serves(&pool, 2, None);
    assert!(pool.companion().any_active());
    assert_eq!(
        addrs,
        (
            pool.companion().embed_entries().device_addr(),
            pool.companion().lm_head_entries().device_addr()
        ),
        "the entry tables never move"
    );
}

#[test]
fn swaps_rebuild_overlays_and_refused_swaps_change_nothing() {
    swaps_rebuild_overlays_and_failures_change_nothing(&Device::cpu());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_swaps_rebuild_overlays_and_refused_swaps_change_nothing() {
    let Some(device) = cuda_or_skip("gpu_swaps_rebuild_overlays_and_refused_swaps_change_nothing") else {
        return;
    };
    swaps_rebuild_overlays_and_failures_change_nothing(&device);
}

/// Swap `adapter` into slot 1 with `headroom`, `headroom + step`, ...
/// bytes of device memory free, until it succeeds: each attempt that runs
/// out must fail typed and change nothing. Returns the failed attempts.
fn swap_with_growing_headroom(
    device: &Device,
    pool: &mut LoraPool<TokenOverlays>,
    adapter: &str,
    step: usize,
) -> usize {
    let before = snapshot(pool);
    let dir = fixtures().join(MODEL).join(adapter);
    let mut failures = 0;
    for headroom in (0..1 << 20).step_by(step) {
        let (free, _) = device.memory_info().unwrap();
        let ballast = device.alloc_zeros::<u8>(free - headroom).unwrap();
        let result = pool.swap_from_disk(SlotId::new(1), "new", &dir);
        drop(ballast);
        match result {
            Ok(_) => return failures,
            Err(PoolError::Kernel(KernelError::OutOfMemory { .. })) => {
                failures += 1;
                assert_eq!(
                    snapshot(pool),
                    before,
                    "{adapter}: out of memory with {headroom} bytes free"
                );
            }
            Err(e) => panic!("{adapter}: expected out of memory with {headroom} bytes free, got {e}"),
        }
    }
    panic!("{adapter}: the swap never succeeded")
}

/// Out of memory at each allocation the overlay's staging makes (the
/// uploads of a trainable-tokens overlay, the adapter's table a
/// modules_to_save row diff needs): nothing changes until it fits.
#[test]
fn running_out_of_memory_while_staging_changes_nothing() {
    let device = Device::cpu_with_memory_limit(64 << 20);
    let mut pool = load(
        &device,
        &[("dict", "trainable_tokens_untied_dict"), ("plain", "demo_r4_plain")],
    );
    // Five uploads (the head's ids and rows, the embedding's ids, rows and slot_map), 8 B to 1 KiB.
    let failures = swap_with_growing_headroom(&device, &mut pool, "trainable_tokens_untied_dict", 64);
    assert!(failures >= 5, "{failures} failing attempts");
    assert_serves(&pool, 1, Some("trainable_tokens_untied_dict"));
    // The row diff uploads the adapter's 32 KiB table first.
    let failures = swap_with_growing_headroom(&device, &mut pool, "modules_to_save_embed_lm_head", 4096);
    assert!(failures >= 8, "{failures} failing attempts");
    assert_serves(&pool, 1, Some("modules_to_save_embed_lm_head"));
    assert_serves(&pool, 0, Some("trainable_tokens_untied_dict"));
}

/// A CUDA graph of both overlay calls, captured before a swap, serves the
/// swapped-in overlay after it: the entry tables and the step row map keep
/// their addresses. The swap waits for the step that names the slot; a
/// replay between the swap and the next step serves the base model, never
/// the slot's new adapter under the old step.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_a_graph_captured_before_a_swap_serves_the_new_overlay() {
    let Some(device) = cuda_or_skip("gpu_a_graph_captured_before_a_swap_serves_the_new_overlay") else {
        return;
    };
    let cfg = model_config(MODEL);
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let mut pool = load(
        &device,
        &[("dict", "trainable_tokens_untied_dict"), ("plain", "demo_r4_plain")],
    );
    let ids: Vec<u32> = (0..vocab as u32).collect();
    let n = ids.len();
    // Every id in slot 1, which holds an adapter without overlays.
    let lease = pool.acquire("plain").unwrap();
    assert_eq!(lease.slot(), SlotId::new(1));
    let step = pool.decode_step(&vec![StepRow::Adapter(&lease); n], n).unwrap();
    let ids_dev = device.upload(&ids).unwrap();
    let mut rows = device.alloc_zeros::<bf16>(n * hidden).unwrap();
    let tables = base_tables(MODEL);
    let embed = widen(base_table(&tables, OverlayModule::Embed));
    let hidden_rows = Rng::new(0x6a9).bf16_vec(n * hidden, 1.0);
    let base_logits = logits(
        &hidden_rows,
        base_table(&tables, OverlayModule::LmHead),
        n,
        vocab,
        hidden,
    );
    let hidden_dev = device.upload(&hidden_rows).unwrap();
    let mut logits_dev = device.alloc_zeros::<f32>(n * vocab).unwrap();
    device.preload_kernels().unwrap();
    let row_map = pool.step_slots(&step).unwrap().buffer().device_addr();
    let graph = {
        let (pool, rows, logits_dev) = (&pool, &mut rows, &mut logits_dev);
        let slots = pool.step_slots(&step).unwrap();
        let as_kernel_error = |e: lora_overlay::OverlayError| KernelError::InvalidArgument {
            arg: "overlays",
            reason: e.to_string(),
        };
        device
            .capture_graph(|| {
                let overlays = pool.companion();
                overlays
                    .embed(&ids_dev, Some(slots), RowsMut::dense(rows, n, hidden))
                    .map_err(as_kernel_error)?;
                overlays
                    .lm_head(
                        Rows::dense(&hidden_dev, n, hidden),
                        slots,
                        RowsMut::dense(logits_dev, n, vocab),
                    )
                    .map_err(as_kernel_error)
            })
            .unwrap()
    };
    logits_dev.write(0, &base_logits).unwrap();
    graph.replay().unwrap();
    device.check_faults().unwrap();
    assert_eq!(
        widen(&rows.download().unwrap()),
        embed,
        "slot 1 has no overlay: base rows"
    );
    assert_eq!(
        logits_dev.download().unwrap(),
        base_logits,
        "slot 1 has no overlay: base logits"
    );

    let adapter = "modules_to_save_embed_lm_head";
    let dir = fixtures().join(MODEL).join(adapter);
    // The step still holds slot 1: the swap must wait for it.
    let err = pool.swap_from_disk(SlotId::new(1), "saved", &dir).unwrap_err();
    assert!(matches!(err, PoolError::SlotInUse { .. }), "{err}");
    drop((step, lease));
    pool.swap_from_disk(SlotId::new(1), "saved", &dir).unwrap();
    // Replayed before the next step, the graph reads a row map reset to the
    // base model: the dropped step's rows never serve the slot's new adapter.
    rows.zero_range(0, rows.len()).unwrap();
    logits_dev.write(0, &base_logits).unwrap();
    graph.replay().unwrap();
    device.check_faults().unwrap();
    assert_eq!(
        widen(&rows.download().unwrap()),
        embed,
        "no step names slot 1: base rows"
    );
    assert_eq!(
        logits_dev.download().unwrap(),
        base_logits,
        "no step names slot 1: base logits"
    );
    // The next step names the new adapter: the same graph serves its overlay.
    let lease = pool.acquire("saved").unwrap();
    let step = pool.decode_step(&vec![StepRow::Adapter(&lease); n], n).unwrap();
    assert_eq!(pool.step_slots(&step).unwrap().buffer().device_addr(), row_map);
    logits_dev.write(0, &base_logits).unwrap();
    graph.replay().unwrap();
    device.check_faults().unwrap();
    let got = widen(&rows.download().unwrap());
    let peft = oracle(MODEL, adapter);
    let (changed, merged) = oracle_rows(&peft, OverlayModule::Embed);
    assert!(!changed.is_empty());
    for v in 0..vocab {
        let row = &got[v * hidden..(v + 1) * hidden];
        match changed.iter().position(|&c| c == v) {
            Some(k) => assert!(rel_error(row, &merged[k * hidden..(k + 1) * hidden]) < 1e-2, "id {v}"),
            None => assert_eq!(row, &embed[v * hidden..(v + 1) * hidden], "id {v}"),
        }
    }
    let got = logits_dev.download().unwrap();
    let (changed, merged) = oracle_rows(&peft, OverlayModule::LmHead);
    assert!(!changed.is_empty());
    let mut overridden = OverriddenLogits::default();
    for i in 0..n {
        for v in 0..vocab {
            match changed.iter().position(|&c| c == v) {
                Some(k) => overridden.push(
                    got[i * vocab + v],
                    &hidden_rows[i * hidden..(i + 1) * hidden],
                    &merged[k * hidden..(k + 1) * hidden],
                ),
                None => assert_eq!(got[i * vocab + v], base_logits[i * vocab + v], "row {i} id {v}"),
            }
        }
    }
    overridden.check("graph replay after the swap", 0.0);
}

#[test]
fn an_overlay_adapter_needs_the_overlay_companion() {
    // The same adapter loads into a pool with TokenOverlays, and is refused by one without.
    let dir = fixtures().join(MODEL).join("trainable_tokens_untied_list");
    let sources = [AdapterSource {
        name: "list",
        dir: &dir,
    }];
    let plain = LoraPool::load(&Device::cpu(), model_config(MODEL), options(2), CAPACITY, &sources);
    assert!(matches!(plain, Err(PoolError::Companion { .. })));
    let device = Device::cpu();
    let overlays = token_overlays(&device, MODEL, 2);
    let pool = LoraPool::load_with_companion(&device, model_config(MODEL), options(2), CAPACITY, &sources, overlays);
    assert!(pool.unwrap().companion().any_active());
}
