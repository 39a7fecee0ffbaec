use super::*;

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
    let dora = store.add_adapter("dora", &fixture("llama/dora")).unwrap_err();
    assert!(dora.reason.contains("Dora"), "{}", dora.reason);
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
    let err = store.manifest("dora", 16, 16, TransportKind::Tcp).unwrap_err();
    assert_eq!(err.code, RefusalCode::UnknownAdapter);
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
            .manifest("r8", max_rank, expert_rank, TransportKind::Tcp)
            .unwrap_err();
        assert_eq!(err.code, RefusalCode::Rank, "{max_rank}/{expert_rank}: {err}");
    }
    assert!(store.manifest("r8", 8, 1, TransportKind::Tcp).is_ok());
}

#[test]
fn rdma_manifests_need_a_device() {
    let store = llama_store(StoreOptions::default());
    let err = store.manifest("r8", 8, 16, TransportKind::Rdma).unwrap_err();
    assert_eq!(err.code, RefusalCode::NoRdma);
}

#[test]
fn a_geometry_is_staged_once_and_reads_stay_inside_staged_regions() {
    let store = llama_store(StoreOptions::default());
    let a = store.manifest("r8", 8, 16, TransportKind::Tcp).unwrap();
    let again = store.manifest("r8", 8, 16, TransportKind::Tcp).unwrap();
    assert_eq!(a, again);
    let wider = store.manifest("r8", 16, 16, TransportKind::Tcp).unwrap();
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
    let first = region_of(&store.manifest("r8", 8, 16, TransportKind::Tcp).unwrap());
    let second = region_of(&store.manifest("r4", 8, 16, TransportKind::Tcp).unwrap());
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
            store.manifest("r8", 8, 16, TransportKind::Tcp).unwrap_err().code,
            RefusalCode::Staging
        );
    }
}

#[test]
fn concurrent_requests_for_one_geometry_stage_it_once() {
    let store = llama_store(StoreOptions::default());
    let regions: Vec<u32> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| region_of(&store.manifest("r8", 8, 16, TransportKind::Tcp).unwrap())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(regions.iter().all(|&r| r == regions[0]), "{regions:?}");
}
