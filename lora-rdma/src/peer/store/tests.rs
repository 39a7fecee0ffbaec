use super::*;
use crate::manifest::{WirePart, WirePlacement};
use lora_layout::PairKey;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(path)
}

fn llama_store(options: StoreOptions) -> PeerStore {
    let cfg = ModelConfig::from_file(&fixture("llama/config.json")).unwrap();
    let mut store = PeerStore::new(cfg, options);
    store.add_adapter("r8", &fixture("llama/demo_r8_rslora")).unwrap();
    store.add_adapter("r4", &fixture("llama/demo_r4_plain")).unwrap();
    store
}

fn region_of(m: &Manifest) -> u32 {
    match m.entries[0].location {
        Location::Tcp { region, .. } => region,
        other => panic!("{other:?}"),
    }
}

#[test]
fn refused_adapters_are_reported_and_never_served() {
    let mut store = llama_store(StoreOptions::default());
    let loha = store.add_adapter("loha", &fixture("llama/loha")).unwrap_err();
    assert!(loha.reason.contains("refused"), "{}", loha.reason);
    let tokens = store
        .add_adapter("tokens", &fixture("llama/trainable_tokens_untied_list"))
        .unwrap_err();
    assert!(tokens.reason.contains("overlays"), "{}", tokens.reason);
    let twice = store.add_adapter("r8", &fixture("llama/rslora")).unwrap_err();
    assert!(twice.reason.contains("second"), "{}", twice.reason);
    let missing = store
        .add_adapter("missing", &fixture("llama/no_such_adapter"))
        .unwrap_err();
    assert_eq!(missing.name, "missing");
    assert_eq!(store.served().collect::<Vec<_>>(), ["r4", "r8"]);
    assert_eq!(store.refused().len(), 4);
    let err = store
        .manifest("loha", 16, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap_err();
    assert_eq!(err.code, RefusalCode::UnknownAdapter);
}

/// A DoRA adapter is served: its manifest lists each DoRA pair's magnitude
/// (`out * 4` bytes) after its A and B, for an unplaced engine; a placed
/// engine (which serves no DoRA) is refused the staging.
#[test]
fn dora_adapters_are_staged_with_their_magnitudes() {
    let mut store = llama_store(StoreOptions::default());
    store.add_adapter("dora", &fixture("llama/dora")).unwrap();
    let m = store
        .manifest("dora", 16, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    let magnitudes: Vec<&ManifestEntry> = m.entries.iter().filter(|e| e.part == WirePart::Magnitude).collect();
    assert!(!magnitudes.is_empty());
    for e in &magnitudes {
        let Some(PairKey::Dense { module, .. }) = e.key.to_key() else {
            panic!("{e:?}")
        };
        assert_eq!(e.len, 4 * module.dims(&store.cfg).0 as u64, "{e:?}");
    }
    let placed = WirePlacement {
        tp_rank: 0,
        tp_world: 2,
        ..WirePlacement::SINGLE
    };
    let err = store.manifest("dora", 16, 16, placed, TransportKind::Tcp).unwrap_err();
    assert_eq!(err.code, RefusalCode::Staging, "{err}");
}

/// A placement that names no rank, carries unknown flag bits, or whose cut
/// does not divide the model, is refused `Placement` before anything is
/// staged.
#[test]
fn placements_that_name_no_rank_or_do_not_divide_are_refused() {
    let store = llama_store(StoreOptions::default());
    for placement in [
        WirePlacement {
            tp_world: 0,
            ..WirePlacement::SINGLE
        },
        WirePlacement {
            tp_rank: 2,
            tp_world: 2,
            ..WirePlacement::SINGLE
        },
        WirePlacement {
            ep_rank: 0,
            ep_world: 0,
            ..WirePlacement::SINGLE
        },
        WirePlacement {
            tp_rank: 0,
            tp_world: 7,
            ..WirePlacement::SINGLE
        },
        WirePlacement {
            flags: 0x80,
            ..WirePlacement::SINGLE
        },
        WirePlacement {
            tp_world: 2,
            flags: WirePlacement::KNOWN_FLAGS | 0x04,
            ..WirePlacement::SINGLE
        },
    ] {
        let err = store.manifest("r8", 16, 16, placement, TransportKind::Tcp).unwrap_err();
        assert_eq!(err.code, RefusalCode::Placement, "{placement}: {err}");
    }
    assert_eq!(store.cache_usage().0, 0, "nothing was staged");
}

#[test]
fn expert_adapters_are_refused_when_experts_are_off() {
    let cfg = ModelConfig::from_file(&fixture("qwen3_moe/config.json")).unwrap();
    let options = StoreOptions {
        experts: false,
        ..StoreOptions::default()
    };
    let mut store = PeerStore::new(cfg, options);
    assert!(
        store
            .add_adapter("e", &fixture("qwen3_moe/experts_fused_router"))
            .is_err()
    );
}

#[test]
fn ranks_outside_the_adapter_and_the_peer_limits_are_refused() {
    let store = llama_store(StoreOptions::default());
    for (max_rank, expert_rank) in [(4, 16), (0, 16), (MAX_STAGED_RANK + 1, 16), (16, 0)] {
        let err = store
            .manifest("r8", max_rank, expert_rank, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap_err();
        assert_eq!(err.code, RefusalCode::Rank, "{max_rank}/{expert_rank}: {err}");
    }
    assert!(
        store
            .manifest("r8", 8, 1, WirePlacement::SINGLE, TransportKind::Tcp)
            .is_ok()
    );
}

#[test]
fn rdma_manifests_need_a_device() {
    let store = llama_store(StoreOptions::default());
    let err = store
        .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Rdma)
        .unwrap_err();
    assert_eq!(err.code, RefusalCode::NoRdma);
}

#[test]
fn a_geometry_is_staged_once_and_reads_stay_inside_staged_regions() {
    let store = llama_store(StoreOptions::default());
    let a = store
        .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    let again = store
        .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    assert_eq!(a, again);
    let wider = store
        .manifest("r8", 16, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    assert_ne!(region_of(&a), region_of(&wider));
    assert_eq!(a.model, store.fingerprint());

    let region = region_of(&a);
    let total: u64 = a.entries.iter().map(|e| e.len).sum();
    let ok = store
        .resolve(&[ReadRange {
            region,
            offset: 0,
            len: total,
        }])
        .unwrap();
    assert_eq!(ok[0].1, 0..total as usize);
    let past = ReadRange {
        region,
        offset: 1,
        len: total,
    };
    assert_eq!(store.resolve(&[past]).unwrap_err().code, RefusalCode::BadRead);
    let unknown = ReadRange {
        region: 999,
        offset: 0,
        len: 1,
    };
    let fine = ReadRange {
        region,
        offset: 0,
        len: 1,
    };
    // One bad range refuses the whole request.
    assert_eq!(store.resolve(&[fine, unknown]).unwrap_err().code, RefusalCode::BadRead);
}

#[test]
fn the_oldest_staging_is_dropped_past_the_limit() {
    let options = StoreOptions {
        max_staged: 1,
        ..StoreOptions::default()
    };
    let store = llama_store(options);
    let first = region_of(
        &store
            .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap(),
    );
    let second = region_of(
        &store
            .manifest("r4", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap(),
    );
    let read = |region| ReadRange {
        region,
        offset: 0,
        len: 1,
    };
    assert_eq!(store.resolve(&[read(first)]).unwrap_err().code, RefusalCode::BadRead);
    assert!(store.resolve(&[read(second)]).is_ok());
}

#[test]
fn staging_over_the_budget_is_refused() {
    let options = StoreOptions {
        max_stage_bytes: 1024,
        ..StoreOptions::default()
    };
    let store = llama_store(options);
    // Refused, and not remembered: the next request stages (and fails) again.
    for _ in 0..2 {
        assert_eq!(
            store
                .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
                .unwrap_err()
                .code,
            RefusalCode::Staging
        );
    }
}

#[test]
fn concurrent_requests_for_one_geometry_stage_it_once() {
    let store = llama_store(StoreOptions::default());
    let regions: Vec<u32> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    region_of(
                        &store
                            .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
                            .unwrap(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(regions.iter().all(|&r| r == regions[0]), "{regions:?}");
}

/// Bytes of adapter `r4` staged at `max_rank`.
fn staged_bytes_of_r4(max_rank: u32) -> usize {
    let m = llama_store(StoreOptions::default())
        .manifest("r4", max_rank, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    m.entries.iter().map(|e| e.len as usize).sum::<usize>()
}

/// `(stagings, bytes, pinned)` of the store's cache.
fn usage(store: &PeerStore) -> (usize, usize, usize) {
    store.cache_usage()
}

#[test]
fn geometries_that_do_not_change_the_staged_bytes_share_one_staging() {
    // No expert pairs: expert_rank changes nothing staged.
    let store = llama_store(StoreOptions::default());
    let regions: Vec<u32> = (1..=40)
        .map(|expert_rank| {
            region_of(
                &store
                    .manifest("r4", 8, expert_rank, WirePlacement::SINGLE, TransportKind::Tcp)
                    .unwrap(),
            )
        })
        .collect();
    assert!(regions.iter().all(|&r| r == regions[0]), "{regions:?}");
    assert_eq!(usage(&store).0, 1);
    // The manifest still names the geometry asked for.
    assert_eq!(
        store
            .manifest("r4", 8, 33, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap()
            .expert_rank,
        33
    );
    // max_rank is the dense stride: it does change the bytes.
    let wider = region_of(
        &store
            .manifest("r4", 16, 1, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap(),
    );
    assert_ne!(wider, regions[0]);
    assert_eq!(usage(&store).0, 2);

    // With expert pairs, expert ranks of one packed stride share a staging.
    let cfg = ModelConfig::from_file(&fixture("qwen3_moe/config.json")).unwrap();
    let mut moe = PeerStore::new(cfg, StoreOptions::default());
    moe.add_adapter("e", &fixture("qwen3_moe/experts_fused_router"))
        .unwrap();
    let strided: Vec<u32> = (4..=8)
        .map(|expert_rank| {
            region_of(
                &moe.manifest("e", 8, expert_rank, WirePlacement::SINGLE, TransportKind::Tcp)
                    .unwrap(),
            )
        })
        .collect();
    assert!(strided.iter().all(|&r| r == strided[0]), "{strided:?}");
    let wide = moe
        .manifest("e", 8, 9, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    assert_ne!(region_of(&wide), strided[0]);
    assert_eq!(usage(&moe).0, 2);
}

#[test]
fn the_cache_stays_within_its_memory_budget_dropping_the_least_recently_used() {
    let bytes_at = staged_bytes_of_r4;
    // Room for the two largest stagings below, not three.
    let budget = bytes_at(64) + bytes_at(60);
    let store = llama_store(StoreOptions {
        max_cache_bytes: budget,
        ..StoreOptions::default()
    });
    let mut asked = 0;
    for max_rank in (8..=64).step_by(4) {
        store
            .manifest("r4", max_rank, 16, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap();
        asked += bytes_at(max_rank);
        let (_, bytes, pinned) = usage(&store);
        assert!(bytes <= budget, "{bytes} bytes kept, budget {budget}");
        assert_eq!(pinned, 0);
    }
    assert!(asked > 4 * budget, "the test must stage well past the budget");
    // Least recently used, not oldest: a staging asked for again stays.
    let a = region_of(
        &store
            .manifest("r4", 40, 16, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap(),
    );
    let b = region_of(
        &store
            .manifest("r4", 44, 16, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap(),
    );
    assert_eq!(
        region_of(
            &store
                .manifest("r4", 40, 16, WirePlacement::SINGLE, TransportKind::Tcp)
                .unwrap()
        ),
        a
    );
    store
        .manifest("r4", 48, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    let read = |region| ReadRange {
        region,
        offset: 0,
        len: 1,
    };
    assert!(store.resolve(&[read(a)]).is_ok());
    assert_eq!(store.resolve(&[read(b)]).unwrap_err().code, RefusalCode::BadRead);
    // A staging larger than the whole budget is refused outright.
    let small = llama_store(StoreOptions {
        max_cache_bytes: bytes_at(8) - 1,
        ..StoreOptions::default()
    });
    let err = small
        .manifest("r4", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap_err();
    assert_eq!(err.code, RefusalCode::Staging, "{err}");
}

#[test]
fn stagings_in_progress_reserve_their_bytes_in_the_budget() {
    let bytes_at = staged_bytes_of_r4;
    let (big, small) = (bytes_at(64), bytes_at(8));
    let budget = big + small;
    let store = llama_store(StoreOptions {
        max_cache_bytes: budget,
        ..StoreOptions::default()
    });
    // A staging of `big` bytes in progress elsewhere: a second one does not
    // fit beside it, a small one does.
    let held = store.reserve(big).unwrap();
    assert_eq!(store.reserved_bytes(), big);
    assert!(bytes_at(60) > small);
    let err = store
        .manifest("r4", 60, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap_err();
    assert_eq!(err.code, RefusalCode::Busy, "{err}");
    store
        .manifest("r4", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    assert_eq!(usage(&store), (1, small, 0));
    // A staging that fails (here: dropped) gives its bytes back.
    drop(held);
    assert_eq!(store.reserved_bytes(), 0);
    store
        .manifest("r4", 64, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    assert_eq!(usage(&store).1, budget);
    assert_eq!(store.reserved_bytes(), 0, "a kept staging holds no reservation");
    // A reservation drops unpinned stagings, least recently used first, to
    // fit: kept and reserved bytes never pass the budget.
    let held = store.reserve(small).unwrap();
    let (_, kept, _) = usage(&store);
    assert!(
        kept + store.reserved_bytes() <= budget,
        "{kept} kept + {small} reserved"
    );
    assert_eq!(kept, big, "the small staging, used least recently, was dropped");
    // Pinned stagings are never dropped for a reservation.
    drop(held);
    let (_, pin) = store
        .pinned_manifest("r4", 64, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    let err = store.reserve(big).map(|_| ()).unwrap_err();
    assert_eq!(err.code, RefusalCode::Busy, "{err}");
    assert_eq!(store.reserved_bytes(), 0);
    drop(pin);
}

#[test]
fn a_pinned_staging_is_never_dropped_and_a_full_pinned_cache_refuses_busy() {
    let store = llama_store(StoreOptions {
        max_staged: 1,
        ..StoreOptions::default()
    });
    let (m, pin) = store
        .pinned_manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    let region = region_of(&m);
    assert_eq!(pin.region(), region);
    let err = store
        .manifest("r4", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap_err();
    assert_eq!(err.code, RefusalCode::Busy, "{err}");
    // The pinned staging is still served, to its own landing and to others.
    let whole = ReadRange {
        region,
        offset: 0,
        len: pin.len() as u64,
    };
    assert!(store.resolve(&[whole]).is_ok());
    assert_eq!(
        region_of(
            &store
                .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
                .unwrap()
        ),
        region
    );
    assert_eq!(usage(&store), (1, pin.len(), 1));
    drop(pin);
    let other = region_of(
        &store
            .manifest("r4", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap(),
    );
    assert_ne!(other, region);
    assert_eq!(store.resolve(&[whole]).unwrap_err().code, RefusalCode::BadRead);
}

#[test]
fn a_read_asking_for_more_bytes_than_its_regions_hold_is_refused() {
    let store = llama_store(StoreOptions::default());
    let m = store
        .manifest("r4", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    let region = region_of(&m);
    let total: u64 = m.entries.iter().map(|e| e.len).sum();
    let whole = ReadRange {
        region,
        offset: 0,
        len: total,
    };
    assert!(store.resolve(&[whole]).is_ok());
    // The same bytes twice, or a small request asking for the whole region
    // over and over: refused, whole.
    let err = store.resolve(&[whole, whole]).unwrap_err();
    assert_eq!(err.code, RefusalCode::TooManyBytes, "{err}");
    let flood = vec![whole; crate::protocol::MAX_READ_RANGES];
    assert_eq!(store.resolve(&flood).unwrap_err().code, RefusalCode::TooManyBytes);
    // Two regions named: each may be read once.
    let other = store
        .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    let other_whole = ReadRange {
        region: region_of(&other),
        offset: 0,
        len: other.entries.iter().map(|e| e.len).sum(),
    };
    assert!(store.resolve(&[whole, other_whole]).is_ok());
}

/// A copy of fixture adapter `from` in a fresh directory.
fn scratch_adapter(tag: &str, from: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lora-peer-store-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    overwrite_adapter(&dir, from);
    dir
}

fn overwrite_adapter(dir: &Path, from: &str) {
    for file in [ADAPTER_CONFIG, ADAPTER_WEIGHTS] {
        std::fs::copy(fixture(from).join(file), dir.join(file)).unwrap();
    }
}

#[test]
fn a_served_adapter_whose_files_change_is_audited_again() {
    let dir = scratch_adapter("reaudit", "llama/demo_r4_plain");
    let cfg = ModelConfig::from_file(&fixture("llama/config.json")).unwrap();
    let mut store = PeerStore::new(cfg, StoreOptions::default());
    store.add_adapter("a", &dir).unwrap();
    let first = store
        .manifest("a", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();

    // Rewritten in place with what the startup audit refuses: refused now.
    overwrite_adapter(&dir, "llama/trainable_tokens_untied_list");
    let err = store
        .manifest("a", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap_err();
    assert_eq!(err.code, RefusalCode::UnknownAdapter, "{err}");
    assert!(err.message.contains("overlays"), "{err}");

    // Rewritten with another servable adapter: audited, staged afresh from
    // the new files, never from the old staging.
    overwrite_adapter(&dir, "llama/demo_r8_rslora");
    let err = store
        .manifest("a", 4, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap_err();
    assert_eq!(err.code, RefusalCode::Rank, "the new adapter's rank 8 applies: {err}");
    let second = store
        .manifest("a", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    assert_ne!(region_of(&second), region_of(&first));
    assert_ne!(second.adapter_config, first.adapter_config);
    let fresh = llama_store(StoreOptions::default())
        .manifest("r8", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap();
    let checksums = |m: &Manifest| m.entries.iter().map(|e| e.checksum).collect::<Vec<_>>();
    assert_eq!(checksums(&second), checksums(&fresh));

    // Gone: refused with the reason, not served from memory.
    std::fs::remove_file(dir.join(ADAPTER_WEIGHTS)).unwrap();
    assert_eq!(
        store
            .manifest("a", 8, 16, WirePlacement::SINGLE, TransportKind::Tcp)
            .unwrap_err()
            .code,
        RefusalCode::Staging
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The cut options are part of a staging's key: the same rank under each
/// combination of the vocab-parallel and fully-sharded options is staged
/// once each (its own region, its own bytes where the cut differs), and
/// each manifest names the placement it was staged for.
#[test]
fn each_cut_of_a_rank_is_staged_on_its_own() {
    let store = llama_store(StoreOptions::default());
    let rank = WirePlacement {
        tp_rank: 1,
        tp_world: 2,
        ..WirePlacement::SINGLE
    };
    let mut regions = Vec::new();
    for flags in 0..=WirePlacement::KNOWN_FLAGS {
        let placement = WirePlacement { flags, ..rank };
        let m = store.manifest("r8", 16, 16, placement, TransportKind::Tcp).unwrap();
        assert_eq!(m.placement, placement);
        // Asked again: the same staging.
        let again = store.manifest("r8", 16, 16, placement, TransportKind::Tcp).unwrap();
        assert_eq!(again, m);
        regions.push(region_of(&m));
        let a_bytes: u64 = m.entries.iter().filter(|e| e.part == WirePart::A).map(|e| e.len).sum();
        let whole = store.manifest("r8", 16, 16, rank, TransportKind::Tcp).unwrap();
        let whole_a: u64 = whole
            .entries
            .iter()
            .filter(|e| e.part == WirePart::A)
            .map(|e| e.len)
            .sum();
        // Rank 1 of 2 under the fully-sharded option holds rows 8..16 of a
        // rank-8 column-parallel A: none of them.
        if flags & WirePlacement::FULLY_SHARDED != 0 {
            assert!(a_bytes < whole_a, "{placement}");
        } else {
            assert_eq!(a_bytes, whole_a, "{placement}");
        }
    }
    regions.sort_unstable();
    regions.dedup();
    assert_eq!(regions.len(), 4, "one staging per cut");
    assert_eq!(store.cache_usage().0, 4);
}
