//! Runtime swaps on real PEFT fixtures: swaps while other slots serve,
//! failed swaps of every kind leave the pool bit for bit as it was, victim
//! choice, pinning, `PoolFull`, generation bumps.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use common::{dir, model_config, options, pool_with, slot, snapshot};
use lora_kernels::Device;
use lora_pool::{
    AdapterSource, BatchCapacity, LoraOptions, LoraPool, PoolError, PrefillSeq, RowSlot, StagingTuning, Step, StepRow,
    SwapRoute,
};

/// A temp folder removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of fixture `adapter` in a temp dir, for breaking it.
fn broken_copy(adapter: &str, tag: &str, breaker: impl FnOnce(&Path)) -> TempDir {
    let dst = std::env::temp_dir().join(format!("lora-pool-swap-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for f in std::fs::read_dir(dir(adapter)).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
    }
    breaker(&dst);
    TempDir(dst)
}

#[test]
fn a_swap_writes_only_its_slot_while_others_serve() {
    let mut pool = pool_with(options(4, 0), &[("a", "demo_r4_plain"), ("b", "demo_r8_rslora")]);
    let lease_a = pool.acquire("a").unwrap();
    let lease_b = pool.acquire("b").unwrap();
    let before = snapshot(&pool);
    let report = pool
        .swap_from_disk(slot(2), "c", &dir("demo_r16_alpha_pattern"))
        .unwrap();
    assert_eq!((report.slot, report.generation), (slot(2), 1));
    let after = snapshot(&pool);
    assert_eq!(before.bytes[0], after.bytes[0]);
    assert_eq!(before.bytes[1], after.bytes[1]);
    assert_ne!(before.bytes[2], after.bytes[2]);
    assert_eq!(before.bytes[3], after.bytes[3]);
    assert_eq!(&after.slots[..2], &before.slots[..2]);
    // A slot in use cannot be overwritten.
    let err = pool.swap_from_disk(slot(0), "d", &dir("rslora")).unwrap_err();
    assert!(
        matches!(err, PoolError::SlotInUse { slot: s, leases: 1 } if s == slot(0)),
        "{err}"
    );
    drop((lease_a, lease_b));
    pool.swap_from_disk(slot(0), "d", &dir("rslora")).unwrap();
    assert_eq!(pool.slot_of("d"), Some(slot(0)));
    assert_eq!(pool.slot_of("a"), None);
}

#[test]
fn failed_swaps_leave_the_pool_bit_for_bit() {
    let mut pool = pool_with(
        LoraOptions {
            max_rank: 8,
            ..options(3, 0)
        },
        &[("a", "demo_r4_plain"), ("b", "demo_r8_rslora")],
    );
    let before = snapshot(&pool);
    let missing = PathBuf::from("/nonexistent/adapter");
    let truncated = broken_copy("demo_r4_plain", "truncated", |d| {
        let f = d.join("adapter_model.safetensors");
        let len = std::fs::metadata(&f).unwrap().len();
        let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
        file.set_len(len / 2).unwrap();
    });
    let bad_json = broken_copy("demo_r4_plain", "badjson", |d| {
        std::fs::write(d.join("adapter_config.json"), b"{\"r\": ").unwrap();
    });
    let cases: [(&str, &Path, &[&str]); 5] = [
        ("unreadable", &missing, &[]),
        ("truncated weights", &truncated.0, &[]),
        ("corrupt config", &bad_json.0, &[]),
        ("refused adapter", &dir("dora"), &["REJECT[dora]"]),
        (
            "rank over max_rank",
            &dir("demo_r16_alpha_pattern"),
            &["REJECT[rank-exceeds-max]"],
        ),
    ];
    for (what, path, codes) in cases {
        for s in [1, 2] {
            let err = pool.swap_from_disk(slot(s), "new", path).unwrap_err();
            assert!(matches!(err, PoolError::Audit { .. }), "{what}: {err}");
            for code in codes {
                assert!(
                    err.refusal_codes().contains(code),
                    "{what}: {:?} lacks {code}",
                    err.refusal_codes()
                );
            }
            assert_eq!(snapshot(&pool), before, "{what} changed the pool");
        }
    }
    // Names must stay unique and non-empty.
    assert!(matches!(
        pool.swap_from_disk(slot(2), "a", &dir("rslora")),
        Err(PoolError::DuplicateName(_))
    ));
    assert!(matches!(
        pool.swap_from_disk(slot(2), "", &dir("rslora")),
        Err(PoolError::EmptyName)
    ));
    assert!(matches!(
        pool.swap_from_disk(slot(9), "z", &dir("rslora")),
        Err(PoolError::NoSuchSlot { slot: 9, .. })
    ));
    assert_eq!(snapshot(&pool), before);
}

#[test]
fn every_write_bumps_the_generation_and_the_identity() {
    let mut pool = pool_with(options(2, 0), &[("a", "demo_r4_plain")]);
    let first = pool.slots()[0].adapter_id();
    assert_eq!(pool.slots()[0].generation, 1);
    let report = pool.swap_from_disk(slot(0), "a", &dir("demo_r4_plain")).unwrap();
    assert_eq!(report.generation, 2);
    assert_ne!(report.adapter_id, first, "same name, new generation: a new identity");
    assert_eq!(pool.acquire("a").unwrap().adapter_id(), report.adapter_id);
    pool.evict(slot(0)).unwrap();
    assert_eq!(pool.slots()[0].adapter_id(), 0);
    assert!(pool.slot_contents(slot(0)).unwrap().iter().all(|v| v.to_f32() == 0.0));
    assert!(matches!(pool.acquire("a"), Err(PoolError::NotResident(_))));
}

#[test]
fn promotion_picks_empty_then_lru_skips_pinned_and_fails_when_all_in_use() {
    let mut pool = pool_with(options(3, 1), &[("pinned", "demo_r4_plain")]);
    let b = pool.promote("b", &dir("demo_r8_rslora")).unwrap();
    assert_eq!(b.slot(), slot(1), "first empty promotion slot");
    let c = pool.promote("c", &dir("rslora")).unwrap();
    assert_eq!(c.slot(), slot(2));
    drop((b, c));
    // Use c again: b is now the least recently used; the pinned slot, older
    // still, is never a candidate.
    drop(pool.acquire("c").unwrap());
    let d = pool.promote("d", &dir("layer_subset")).unwrap();
    assert_eq!(d.slot(), slot(1));
    assert_eq!(pool.slot_of("b"), None);
    assert_eq!(pool.slot_of("pinned"), Some(slot(0)));
    // Promoting a resident adapter just leases it.
    let c = pool.promote("c", &dir("rslora")).unwrap();
    assert_eq!(c.slot(), slot(2));
    // Both promotion slots are held: nothing can be evicted.
    let err = pool.promote("e", &dir("regex_targets")).unwrap_err();
    assert!(matches!(err, PoolError::PoolFull { .. }), "{err}");
    drop((c, d));
    assert_eq!(
        pool.promote("e", &dir("regex_targets")).unwrap().slot(),
        slot(1),
        "d was used before c"
    );
}

#[test]
fn swaps_need_a_rotatable_pool() {
    let mut pool = pool_with(
        LoraOptions {
            rotatable: false,
            ..options(2, 0)
        },
        &[("a", "demo_r4_plain")],
    );
    assert!(matches!(
        pool.swap_from_disk(slot(1), "b", &dir("rslora")),
        Err(PoolError::NotRotatable)
    ));
    assert!(matches!(
        pool.promote("b", &dir("rslora")),
        Err(PoolError::NotRotatable)
    ));
}

/// Rows name adapters only through leases, so a row naming an empty slot,
/// or a slot that is not one (`-2`), can no longer be written; what is left
/// to refuse, each with its typed error: a lease on a name that is not
/// resident, emptying a slot a step names, a lease of another pool, and a
/// prefill sequence of no tokens.
#[test]
fn batch_rows_must_name_resident_adapters() {
    let mut pool = pool_with(options(3, 0), &[("a", "demo_r4_plain")]);
    let a = pool.acquire("a").unwrap();
    let step = pool
        .decode_step(&[StepRow::Adapter(&a), StepRow::Base, StepRow::Adapter(&a)], 4)
        .unwrap();
    assert_eq!(
        step.requests(),
        &[RowSlot::Slot(slot(0)), RowSlot::Base, RowSlot::Slot(slot(0))]
    );
    assert_eq!(step.kernel_rows(), 4);
    // Slots 1 and 2 hold nothing: no lease, so no row, can name them.
    assert!(matches!(pool.acquire("b"), Err(PoolError::NotResident(n)) if n == "b"));
    assert!(matches!(pool.acquire(""), Err(PoolError::NotResident(_))));
    // Nor can the slot a row names be emptied under it.
    drop(a);
    assert!(matches!(
        pool.evict(slot(0)),
        Err(PoolError::SlotInUse { slot: s, leases: 1 }) if s == slot(0)
    ));
    assert_eq!(pool.slot_of("a"), Some(slot(0)));
    drop(step);
    let a = pool.acquire("a").unwrap();
    let other = pool_with(options(3, 0), &[("a", "demo_r4_plain")]);
    let foreign = other.acquire("a").unwrap();
    assert!(matches!(
        pool.decode_step(&[StepRow::Adapter(&a), StepRow::Adapter(&foreign)], 2),
        Err(PoolError::ForeignLease { row: 1, .. })
    ));
    assert!(matches!(
        pool.prefill_step(&[
            PrefillSeq {
                row: StepRow::Base,
                len: 3
            },
            PrefillSeq {
                row: StepRow::Adapter(&foreign),
                len: 2
            },
        ]),
        Err(PoolError::ForeignLease { row: 1, .. })
    ));
    assert!(matches!(
        pool.prefill_step(&[
            PrefillSeq {
                row: StepRow::Adapter(&a),
                len: 3
            },
            PrefillSeq {
                row: StepRow::Base,
                len: 0
            },
        ]),
        Err(PoolError::Batch(_))
    ));
}

#[test]
fn startup_load_checks_names_and_slot_count() {
    let opts = options(1, 0);
    let d = dir("demo_r4_plain");
    let two = [
        AdapterSource { name: "a", dir: &d },
        AdapterSource { name: "b", dir: &d },
    ];
    let err = LoraPool::load(
        &Device::cpu(),
        model_config("llama"),
        opts.clone(),
        BatchCapacity::default(),
        &two,
    )
    .err()
    .unwrap();
    assert!(matches!(
        err,
        PoolError::TooManyAdapters {
            adapters: 2,
            max_loras: 1
        }
    ));
    let dup = [
        AdapterSource { name: "a", dir: &d },
        AdapterSource { name: "a", dir: &d },
    ];
    let err = LoraPool::load(
        &Device::cpu(),
        model_config("llama"),
        options(2, 0),
        BatchCapacity::default(),
        &dup,
    )
    .err()
    .unwrap();
    assert!(matches!(err, PoolError::DuplicateName(_)));
}

#[test]
fn every_route_from_a_file_writes_the_bytes_of_the_converted_adapter() {
    let cfg = model_config("llama");
    // A stride of 64 lets even the F32 files fit the device staging slot.
    let opts = LoraOptions {
        max_rank: 64,
        ..options(2, 0)
    };
    let host_pack = StagingTuning {
        device_repack: false,
        ..StagingTuning::default()
    };
    let tiny_chunks = StagingTuning {
        chunk_bytes: 1,
        ..StagingTuning::default()
    };
    let streaming = StagingTuning {
        streaming_stores: true,
        read_threads: 3,
        ..StagingTuning::default()
    };
    for adapter in [
        "dense_all_linear_f32",
        "dense_all_linear_f16",
        "dense_all_linear_bf16",
        "rank_alpha_pattern",
    ] {
        for (tuning, route) in [
            (StagingTuning::default(), SwapRoute::DeviceRepack),
            (tiny_chunks, SwapRoute::DeviceRepack),
            (streaming, SwapRoute::DeviceRepack),
            (host_pack, SwapRoute::HostPack),
        ] {
            let mut pool = pool_with(opts.clone(), &[]);
            pool.tune_staging(tuning).unwrap();
            let report = pool.swap_from_disk(slot(0), "direct", &dir(adapter)).unwrap();
            assert_eq!(report.route, route, "{adapter} {tuning:?}");
            let prepared = lora_audit::prepare_adapter(&dir(adapter), &cfg, pool.options()).unwrap();
            let report = pool.swap_prepared(slot(1), "converted", &prepared).unwrap();
            assert_eq!(report.route, SwapRoute::Prepared);
            assert_eq!(
                pool.slot_contents(slot(0)).unwrap(),
                pool.slot_contents(slot(1)).unwrap(),
                "{adapter} {tuning:?}"
            );
            assert_eq!(pool.slots()[0].pairs, pool.slots()[1].pairs, "{adapter}");
        }
    }
}

/// The A rows and B columns a slot image holds at `(a_offset, b_offset)`
/// (bytes) for a pair of `rank` at rank stride `stride` are `a` (`[rank,
/// a_cols]`) and `b` (`[b_rows, rank]`), the padding zero.
fn assert_padded_pair(
    image: &[half::bf16],
    (a_offset, b_offset): (usize, usize),
    stride: usize,
    (a_cols, b_rows): (usize, usize),
    (rank, a, b): (usize, &[half::bf16], &[half::bf16]),
) {
    let a_place = &image[a_offset / 2..a_offset / 2 + stride * a_cols];
    assert_eq!(&a_place[..rank * a_cols], a);
    assert!(a_place[rank * a_cols..].iter().all(|v| v.to_f32() == 0.0));
    let b_place = &image[b_offset / 2..b_offset / 2 + b_rows * stride];
    for o in 0..b_rows {
        let row = &b_place[o * stride..(o + 1) * stride];
        assert_eq!(&row[..rank], &b[o * rank..(o + 1) * rank]);
        assert!(row[rank..].iter().all(|v| v.to_f32() == 0.0));
    }
}

#[test]
fn every_route_places_the_embedding_pair_like_the_prepared_adapter() {
    let cfg = model_config("llama");
    let opts = LoraOptions {
        max_rank: 16,
        embedding_lora: true,
        ..options(2, 0)
    };
    let host_pack = StagingTuning {
        device_repack: false,
        ..StagingTuning::default()
    };
    // Saved without its base table: dense pairs only, so the direct routes take it.
    for adapter in ["embedding_lora_no_table"] {
        let plain = dir(adapter);
        for (tuning, route) in [
            (StagingTuning::default(), SwapRoute::DeviceRepack),
            (host_pack, SwapRoute::HostPack),
        ] {
            let mut pool = pool_with(opts.clone(), &[]);
            pool.tune_staging(tuning).unwrap();
            let report = pool.swap_from_disk(slot(0), "direct", &plain).unwrap();
            assert_eq!(report.route, route, "{adapter} {tuning:?}");
            let prepared = lora_audit::prepare_adapter(&plain, &cfg, pool.options()).unwrap();
            let embedding = prepared.embedding.as_ref().unwrap();
            pool.swap_prepared(slot(1), "converted", &prepared).unwrap();
            assert_eq!(
                pool.slot_contents(slot(0)).unwrap(),
                pool.slot_contents(slot(1)).unwrap(),
                "{adapter} {tuning:?}"
            );
            // The embedding pair's entry: its place in each slot, its rank and scale.
            let place = *pool.layout().embedding().unwrap();
            let slot_bytes = pool.layout().slot_bytes() as u64;
            for s in 0..2 {
                let e = pool.embedding_entry(slot(s)).unwrap();
                assert_eq!((e.rank as usize, e.scale), (embedding.rank, embedding.scale));
                let base = pool.pool_addr() + s as u64 * slot_bytes;
                assert_eq!((e.a, e.b), (base + place.a_offset as u64, base + place.b_offset as u64));
            }
            let bytes = pool.slot_contents(slot(0)).unwrap();
            let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
            assert_padded_pair(
                &bytes,
                (place.a_offset, place.b_offset),
                16,
                (vocab, hidden),
                (embedding.rank, &embedding.a, &embedding.b),
            );
        }
    }
}

#[test]
fn every_route_places_the_head_pair_like_the_prepared_adapter() {
    let cfg = model_config("llama");
    let opts = LoraOptions {
        max_rank: 16,
        embedding_lora: true,
        lm_head_lora: true,
        ..options(2, 0)
    };
    let host_pack = StagingTuning {
        device_repack: false,
        ..StagingTuning::default()
    };
    // Saved without its head table: dense pairs only, so the direct routes take it.
    let adapter = "lm_head_lora_no_table";
    let plain = dir(adapter);
    for (tuning, route) in [
        (StagingTuning::default(), SwapRoute::DeviceRepack),
        (host_pack, SwapRoute::HostPack),
    ] {
        let mut pool = pool_with(opts.clone(), &[]);
        pool.tune_staging(tuning).unwrap();
        let report = pool.swap_from_disk(slot(0), "direct", &plain).unwrap();
        assert_eq!(report.route, route, "{tuning:?}");
        let prepared = lora_audit::prepare_adapter(&plain, &cfg, pool.options()).unwrap();
        let head = prepared.lm_head.as_ref().unwrap();
        assert!(prepared.embedding.is_none());
        pool.swap_prepared(slot(1), "converted", &prepared).unwrap();
        assert_eq!(
            pool.slot_contents(slot(0)).unwrap(),
            pool.slot_contents(slot(1)).unwrap(),
            "{tuning:?}"
        );
        // The head pair's entry: its place (after the embedding's) in each
        // slot, its rank and scale; the embedding's entry stays empty.
        let place = *pool.layout().lm_head().unwrap();
        assert!(place.a_offset >= pool.layout().embedding().unwrap().b_offset);
        assert_eq!(
            pool.lm_head_table_offset(),
            pool.embedding_table_offset().map(|o| o + 2),
            "the head's table follows the embedding's"
        );
        let slot_bytes = pool.layout().slot_bytes() as u64;
        for s in 0..2 {
            let e = pool.lm_head_entry(slot(s)).unwrap();
            assert_eq!((e.rank as usize, e.scale), (head.rank, head.scale));
            let base = pool.pool_addr() + s as u64 * slot_bytes;
            assert_eq!((e.a, e.b), (base + place.a_offset as u64, base + place.b_offset as u64));
            assert_eq!(pool.embedding_entry(slot(s)).unwrap().rank, 0);
        }
        let bytes = pool.slot_contents(slot(0)).unwrap();
        let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
        assert_padded_pair(
            &bytes,
            (place.a_offset, place.b_offset),
            16,
            (hidden, vocab),
            (head.rank, &head.a, &head.b),
        );
        // Evicted, the head entry is empty again.
        pool.evict(slot(0)).unwrap();
        assert_eq!(pool.lm_head_entry(slot(0)).unwrap().rank, 0);
    }
    // A pool without the head place refuses it, naming the switch.
    let mut pool = pool_with(options(2, 0), &[]);
    let err = pool.swap_from_disk(slot(0), "direct", &plain).unwrap_err();
    assert!(err.to_string().contains("REJECT[lm-head-lora-disabled]"), "{err}");
}

#[test]
fn a_data_section_larger_than_the_staging_slot_is_packed_on_the_host() {
    let weights = dir("dense_all_linear_f32").join(lora_audit::ADAPTER_WEIGHTS);
    let data = lora_audit::UnparsedSafetensors::open(&weights).unwrap().data_len() as usize;
    // At a stride of the adapter's rank, F32 data is twice the BF16 slot.
    let opts = LoraOptions {
        max_rank: 8,
        ..options(2, 0)
    };
    let mut pool = pool_with(opts, &[]);
    assert!(
        data > pool.layout().slot_bytes(),
        "{data} data bytes fit a {}-byte slot",
        pool.layout().slot_bytes()
    );
    let report = pool
        .swap_from_disk(slot(0), "f32", &dir("dense_all_linear_f32"))
        .unwrap();
    assert_eq!(report.route, SwapRoute::HostPack);
}
