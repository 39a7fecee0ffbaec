use super::*;
use lora_layout::{ModelConfig, SlotLayout};
use proptest::prelude::*;

fn layout() -> SlotLayout {
    let cfg = ModelConfig::from_hf_config(
        r#"{"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 24, "vocab_size": 16}"#,
    )
    .unwrap();
    SlotLayout::new(&cfg, 8).unwrap()
}

const Q1: PairKey = PairKey::Dense {
    layer: 1,
    module: LoraModule::QProj,
};
const K0: PairKey = PairKey::Dense {
    layer: 0,
    module: LoraModule::KProj,
};

const IDENTITY: Identity = Identity {
    model: 7,
    max_rank: 8,
    expert_rank: 16,
    placement: WirePlacement::SINGLE,
};

fn plan() -> Vec<ExpectedPart> {
    let pairs = [
        PairMeta {
            key: Q1,
            rank: 4,
            scale: 1.0,
        },
        PairMeta {
            key: K0,
            rank: 8,
            scale: 2.0,
        },
    ];
    expected_parts(&layout(), &pairs).unwrap()
}

fn manifest_for(parts: &[ExpectedPart]) -> Manifest {
    Manifest {
        adapter: "a".into(),
        model: 7,
        max_rank: 8,
        expert_rank: 16,
        placement: WirePlacement::SINGLE,
        adapter_config: "{}".into(),
        tensors: vec![],
        entries: parts
            .iter()
            .enumerate()
            .map(|(i, p)| ManifestEntry {
                key: WireKey::from_key(p.key),
                part: p.part,
                len: p.len,
                checksum: i as u64,
                location: Location::Tcp {
                    region: 0,
                    offset: 100 * i as u64,
                },
            })
            .collect(),
    }
}

#[test]
fn expected_lengths_follow_the_local_layout() {
    let parts = plan();
    // q_proj of layer 1: in 16, out 16: A = 4 rows · 16 · 2, B = 16 · 8 · 2.
    assert!(parts.contains(&ExpectedPart {
        key: Q1,
        part: WirePart::A,
        len: 4 * 16 * 2
    }));
    assert!(parts.contains(&ExpectedPart {
        key: Q1,
        part: WirePart::B,
        len: 16 * 8 * 2
    }));
    // k_proj: out 8.
    assert!(parts.contains(&ExpectedPart {
        key: K0,
        part: WirePart::B,
        len: 8 * 8 * 2
    }));
    let bad = PairMeta {
        key: PairKey::Dense {
            layer: 5,
            module: LoraModule::QProj,
        },
        rank: 1,
        scale: 1.0,
    };
    assert_eq!(expected_parts(&layout(), &[bad]), Err(bad.key));
}

#[test]
fn a_matching_manifest_gives_one_op_per_part() {
    let parts = plan();
    let ops = match_manifest(&manifest_for(&parts), &IDENTITY, &parts).unwrap();
    assert_eq!(ops.len(), 4);
    assert!(ops.iter().all(|op| {
        parts
            .iter()
            .any(|p| (p.key, p.part, p.len) == (op.key, op.part, op.len as u64))
    }));
}

#[test]
fn every_mismatch_refuses_the_whole_manifest() {
    let parts = plan();
    let good = manifest_for(&parts);
    let check = |m: &Manifest| match_manifest(m, &IDENTITY, &parts).unwrap_err();

    let mut m = good.clone();
    m.model = 8;
    assert!(matches!(
        check(&m),
        ManifestError::ModelMismatch { expected: 7, got: 8 }
    ));
    let mut m = good.clone();
    m.max_rank = 16;
    assert!(matches!(
        check(&m),
        ManifestError::RankMismatch { what: "max_rank", .. }
    ));
    let mut m = good.clone();
    m.placement.tp_world = 2;
    assert!(matches!(
        check(&m),
        ManifestError::PlacementMismatch {
            expected: WirePlacement::SINGLE,
            ..
        }
    ));
    let mut m = good.clone();
    m.entries[0].part = WirePart::Magnitude;
    assert!(matches!(check(&m), ManifestError::Unexpected { index: 0, .. }));
    let mut m = good.clone();
    m.entries[0].len += 2;
    assert!(matches!(check(&m), ManifestError::Length { index: 0, .. }));
    let mut m = good.clone();
    m.entries.pop();
    assert!(matches!(check(&m), ManifestError::Missing { .. }));
    let mut m = good.clone();
    m.entries.push(m.entries[1]);
    assert!(matches!(check(&m), ManifestError::Duplicate { index: 4, .. }));
    let mut m = good.clone();
    m.entries[2].key = WireKey::Dense { layer: 0, module: 200 };
    assert!(matches!(check(&m), ManifestError::UnknownKey { index: 2, .. }));
    let mut m = good.clone();
    m.entries[3].key = WireKey::from_key(PairKey::Dense {
        layer: 0,
        module: LoraModule::VProj,
    });
    assert!(matches!(check(&m), ManifestError::Unexpected { index: 3, .. }));
    let mut m = good;
    m.entries[0].key = WireKey::Router { layer: 0 };
    assert!(matches!(check(&m), ManifestError::Unexpected { .. }));
}

fn any_key() -> impl Strategy<Value = PairKey> {
    prop_oneof![
        (0usize..100, 0usize..LoraModule::ALL.len()).prop_map(|(layer, m)| PairKey::Dense {
            layer,
            module: LoraModule::ALL[m]
        }),
        (0usize..100, 0usize..512, 0usize..3).prop_map(|(layer, expert, p)| PairKey::Expert {
            layer,
            site: ExpertSite::Expert {
                expert,
                proj: ExpertProj::ALL[p]
            }
        }),
        (0usize..100).prop_map(|layer| PairKey::Expert {
            layer,
            site: ExpertSite::Router
        }),
        Just(PairKey::Embedding),
        Just(PairKey::LmHead),
    ]
}

proptest! {
    #[test]
    fn wire_placements_round_trip(
        tp_world in 1usize..16,
        tp in 0usize..16,
        ep_world in 1usize..16,
        ep in 0usize..16,
        vocab_parallel in any::<bool>(),
        fully_sharded in any::<bool>(),
    ) {
        let p = Placement::new(tp % tp_world, tp_world)
            .and_then(|p| p.with_experts(ep % ep_world, ep_world))
            .unwrap()
            .with_vocab_parallel(vocab_parallel)
            .with_fully_sharded(fully_sharded);
        let wire = WirePlacement::from_placement(p);
        prop_assert_eq!(wire.flags & WirePlacement::VOCAB_PARALLEL != 0, vocab_parallel);
        prop_assert_eq!(wire.flags & WirePlacement::FULLY_SHARDED != 0, fully_sharded);
        let json = serde_json::to_string(&wire).unwrap();
        let back: WirePlacement = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(back, wire);
        prop_assert_eq!(back.to_placement(), Ok(p));
    }

    /// A wire placement names a placement exactly when its ranks are below
    /// their worlds and its flags are known bits; unknown bits are refused
    /// naming them, before the ranks are looked at.
    #[test]
    fn wire_placements_naming_no_rank_are_errors(
        tp_rank in 0u32..8,
        tp_world in 0u32..8,
        ep_rank in 0u32..8,
        ep_world in 0u32..8,
        flags in any::<u8>(),
    ) {
        let wire = WirePlacement { tp_rank, tp_world, ep_rank, ep_world, flags };
        let unknown = flags & !WirePlacement::KNOWN_FLAGS;
        let names_a_rank = tp_rank < tp_world && ep_rank < ep_world;
        match wire.to_placement() {
            Ok(p) => {
                prop_assert!(names_a_rank && unknown == 0);
                prop_assert_eq!(WirePlacement::from_placement(p), wire);
            }
            Err(WirePlacementError::UnknownFlags { flags: f, unknown: u }) => {
                prop_assert_eq!((f, u), (flags, unknown));
                prop_assert!(unknown != 0);
            }
            Err(WirePlacementError::Placement(_)) => prop_assert!(unknown == 0 && !names_a_rank),
        }
    }

    /// A manifest staged for the engine's ranks under any other cut (flags)
    /// is refused `PlacementMismatch` naming both.
    #[test]
    fn a_manifest_for_another_cut_is_a_placement_mismatch(engine in 0u8..4, staged in 0u8..4) {
        let placed = |flags| WirePlacement { tp_rank: 1, tp_world: 2, flags, ..WirePlacement::SINGLE };
        let identity = Identity { placement: placed(engine), ..IDENTITY };
        let mut m = manifest_for(&plan());
        m.placement = placed(staged);
        let got = check_identity(&m, &identity);
        if engine == staged {
            prop_assert_eq!(got, Ok(()));
        } else {
            prop_assert_eq!(got, Err(ManifestError::PlacementMismatch { expected: placed(engine), got: placed(staged) }));
        }
    }

    #[test]
    fn wire_keys_round_trip(key in any_key()) {
        let wire = WireKey::from_key(key);
        let json = serde_json::to_string(&wire).unwrap();
        let back: WireKey = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(back.to_key(), Some(key));
    }
}

/// The largest manifest the bundled configs allow: every routed expert's
/// three projections of every MoE layer of DeepSeek-V3, with a per-expert
/// tensor header, fits one response frame.
#[test]
fn a_manifest_of_every_expert_of_deepseek_v3_fits_a_response_frame() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../lora-layout/testdata/deepseek-v3.json");
    let cfg = ModelConfig::from_file(&path).unwrap();
    let moe = cfg.moe.as_ref().unwrap();
    let mut entries = Vec::new();
    let mut tensors = Vec::new();
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        for expert in 0..moe.num_experts {
            for proj in ExpertProj::ALL {
                let key = PairKey::Expert {
                    layer,
                    site: ExpertSite::Expert { expert, proj },
                };
                for (part, ab) in [(WirePart::A, "lora_A"), (WirePart::B, "lora_B")] {
                    entries.push(ManifestEntry {
                        key: WireKey::from_key(key),
                        part,
                        len: u64::MAX,
                        checksum: u64::MAX,
                        location: Location::Rdma {
                            addr: u64::MAX,
                            rkey: u32::MAX,
                        },
                    });
                    tensors.push(WireTensor {
                        name: format!("base_model.model.model.layers.{layer}.mlp.experts.{expert}.{proj}.{ab}.weight"),
                        dtype: "BF16".into(),
                        shape: vec![u64::from(u32::MAX), u64::from(u32::MAX)],
                    });
                }
            }
        }
    }
    let m = Manifest {
        adapter: "all-experts".into(),
        model: u64::MAX,
        max_rank: u32::MAX,
        expert_rank: u32::MAX,
        placement: WirePlacement::SINGLE,
        adapter_config: "{}".into(),
        tensors,
        entries,
    };
    assert!(m.entries.len() < MAX_MANIFEST_ENTRIES);
    let bytes = serde_json::to_vec(&crate::protocol::Response::Manifest(Box::new(m))).unwrap();
    assert!(
        bytes.len() < crate::wire::MAX_RESPONSE_BYTES as usize,
        "{} bytes",
        bytes.len()
    );
}
