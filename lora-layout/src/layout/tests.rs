use super::*;
use crate::{ExpertProj, ModelConfig};
use proptest::prelude::*;

/// A random config of any supported family, as JSON.
fn any_config() -> impl Strategy<Value = ModelConfig> {
    let families = prop_oneof![
        Just("llama"),
        Just("mistral"),
        Just("qwen2"),
        Just("qwen3"),
        Just("qwen2_moe"),
        Just("qwen3_moe"),
        Just("mixtral"),
        Just("qwen3_next"),
        Just("deepseek_v3"),
        Just("glm4_moe"),
        Just("gemma2"),
        Just("gemma3_text"),
        Just("phi3"),
        Just("gpt_oss"),
    ];
    (
        families,
        1usize..7,
        1usize..9,
        1usize..5,
        prop::sample::select(vec![4usize, 8, 12, 16]),
        8usize..200,
        prop::collection::vec(1usize..100, 12),
        prop::collection::vec(any::<bool>(), 8),
    )
        .prop_map(|(mt, layers, heads, kv_div, head_dim, inter, d, flags)| {
            let kv = (heads / kv_div).max(1);
            let mut v = serde_json::json!({
                "model_type": mt, "hidden_size": heads * head_dim + d[0], "num_hidden_layers": layers,
                "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
                "intermediate_size": inter, "vocab_size": 64,
                "num_experts": d[1] % 8 + 1, "num_local_experts": d[1] % 8 + 1, "n_routed_experts": d[1] % 8 + 1,
                "num_experts_per_tok": 1, "moe_intermediate_size": d[2],
                "shared_expert_intermediate_size": d[3], "decoder_sparse_step": d[4] % 3 + 1,
                "mlp_only_layers": if flags[0] { vec![0] } else { vec![] },
                "full_attention_interval": d[5] % 4 + 1,
                "linear_num_value_heads": d[6] % 6 + 1, "linear_value_head_dim": d[7] % 20 + 1,
                "kv_lora_rank": d[8], "qk_rope_head_dim": d[9] % 16 + 1, "qk_nope_head_dim": d[10] % 16,
                "v_head_dim": d[11] % 16 + 1, "first_k_dense_replace": d[4] % 3,
                "n_shared_experts": if flags[1] { 1 } else { 0 },
            });
            v["q_lora_rank"] = if flags[2] {
                serde_json::json!(d[3] + 3)
            } else {
                serde_json::Value::Null
            };
            ModelConfig::from_hf_value(&v).expect("strategy builds valid configs")
        })
}

/// The layout written out a second time without `SlotLayout`: every pair's
/// offsets, found by summing the sizes of every pair that precedes it.
fn independent_offsets(cfg: &ModelConfig, max_rank: usize) -> Vec<(usize, LoraModule, usize, usize)> {
    let mut pairs = Vec::new();
    for layer in 0..cfg.num_hidden_layers {
        for module in LoraModule::ALL {
            if module.applies_to_layer(cfg, layer) {
                pairs.push((layer, module, module.dims(cfg)));
            }
        }
    }
    (0..pairs.len())
        .map(|i| {
            let before: usize = pairs[..i].iter().map(|(_, _, (o, n))| 2 * max_rank * (n + o)).sum();
            let (layer, module, (_, inp)) = pairs[i];
            (layer, module, before, before + 2 * max_rank * inp)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_walk_tiles_each_slot_exactly(cfg in any_config(), max_rank in 1usize..70) {
        let layout = SlotLayout::new(&cfg, max_rank).unwrap();
        let mut cursor = 0usize;
        for e in layout.entries() {
            prop_assert_eq!(e.a_offset, cursor, "contiguous");
            prop_assert_eq!(e.b_offset - e.a_offset, max_rank * e.in_dim * BF16_BYTES);
            cursor = e.end_offset(max_rank);
            prop_assert!(cursor <= layout.slot_bytes(), "in bounds");
            prop_assert!(e.out_dim > 0 && e.in_dim > 0);
        }
        prop_assert_eq!(cursor, layout.slot_bytes(), "sums to pool_slot_bytes");
        prop_assert_eq!(pool_slot_bytes(&cfg, max_rank).unwrap(), layout.slot_bytes());
    }

    #[test]
    fn module_slot_offsets_agree_with_an_independent_enumeration(cfg in any_config(), max_rank in 1usize..70) {
        let expected = independent_offsets(&cfg, max_rank);
        for &(layer, module, a, b) in &expected {
            prop_assert_eq!(module_slot_offsets(&cfg, max_rank, layer, module).unwrap(), Some((a, b)));
        }
        // Every (layer, module) not enumerated has no offsets.
        let listed = expected.len();
        let mut found = 0;
        for layer in 0..cfg.num_hidden_layers + 1 {
            for module in LoraModule::ALL {
                if module_slot_offsets(&cfg, max_rank, layer, module).unwrap().is_some() {
                    found += 1;
                }
            }
        }
        prop_assert_eq!(found, listed);
    }

    #[test]
    fn the_embedding_place_follows_every_dense_pair(cfg in any_config(), max_rank in 1usize..70) {
        use crate::{PairKey, PairLayout};
        let dense = SlotLayout::new(&cfg, max_rank).unwrap();
        let layout = SlotLayout::with_embedding(&cfg, max_rank).unwrap();
        prop_assert_eq!(layout.entries(), dense.entries(), "the dense pairs keep their places");
        prop_assert!(dense.embedding().is_none());
        prop_assert_eq!(PairLayout::len(&dense), dense.entries().len());
        // Independently: the embedding pair starts where the dense pairs end
        // and is A [max_rank, vocab] then B [hidden, max_rank].
        let before: usize = independent_offsets(&cfg, max_rank)
            .last()
            .map_or(0, |&(_, module, _, b)| b + 2 * max_rank * module.dims(&cfg).0);
        let e = *layout.embedding().unwrap();
        prop_assert_eq!(e.a_offset, before);
        prop_assert_eq!(e.b_offset, before + 2 * max_rank * cfg.vocab_size);
        prop_assert_eq!(layout.slot_bytes(), e.b_offset + 2 * max_rank * cfg.hidden_size, "tiles the slot");
        // The pair view lists it last, under its key.
        let last = PairLayout::len(&layout) - 1;
        prop_assert_eq!(PairLayout::position(&layout, PairKey::Embedding), Some(last));
        prop_assert_eq!(PairLayout::position(&dense, PairKey::Embedding), None);
        let place = layout.place(last).unwrap();
        prop_assert_eq!(place.key, PairKey::Embedding);
        prop_assert_eq!((place.out_dim, place.in_dim), (cfg.hidden_size, cfg.vocab_size));
        prop_assert_eq!((place.a_offset, place.b_offset), (e.a_offset, e.b_offset));
        prop_assert!(layout.place(last + 1).is_none());
        // Every place of the pair view tiles the slot, in walk order.
        let mut cursor = 0usize;
        for i in 0..PairLayout::len(&layout) {
            let p = layout.place(i).unwrap();
            prop_assert_eq!(p.a_offset, cursor);
            prop_assert_eq!(p.b_offset, cursor + 2 * max_rank * p.in_dim);
            cursor = p.b_offset + 2 * max_rank * p.out_dim;
        }
        prop_assert_eq!(cursor, layout.slot_bytes());
    }

    #[test]
    fn the_head_place_follows_every_other_pair(cfg in any_config(), max_rank in 1usize..70, embedding: bool) {
        use crate::{ModelPlaces, PairKey, PairLayout};
        let before = SlotLayout::walk(&cfg, max_rank, crate::Placement::SINGLE, ModelPlaces { embedding, lm_head: false }).unwrap();
        let layout = SlotLayout::walk(&cfg, max_rank, crate::Placement::SINGLE, ModelPlaces { embedding, lm_head: true }).unwrap();
        prop_assert_eq!(layout.entries(), before.entries(), "the dense pairs keep their places");
        prop_assert_eq!(layout.embedding(), before.embedding(), "the embedding keeps its place");
        prop_assert!(before.lm_head().is_none());
        prop_assert_eq!(layout.places(), ModelPlaces { embedding, lm_head: true });
        // Independently: the head pair starts where the slot without it ends
        // and is A [max_rank, hidden] then B [vocab, max_rank].
        let h = *layout.lm_head().unwrap();
        prop_assert_eq!(h.a_offset, before.slot_bytes());
        prop_assert_eq!(h.b_offset, h.a_offset + 2 * max_rank * cfg.hidden_size);
        prop_assert_eq!(layout.slot_bytes(), h.b_offset + 2 * max_rank * cfg.vocab_size, "tiles the slot");
        let last = PairLayout::len(&layout) - 1;
        prop_assert_eq!(PairLayout::position(&layout, PairKey::LmHead), Some(last));
        prop_assert_eq!(PairLayout::position(&before, PairKey::LmHead), None);
        prop_assert_eq!(PairLayout::position(&layout, PairKey::Embedding).is_some(), embedding);
        let place = layout.place(last).unwrap();
        prop_assert_eq!(place.key, PairKey::LmHead);
        prop_assert_eq!((place.out_dim, place.in_dim), (cfg.vocab_size, cfg.hidden_size));
        prop_assert_eq!((place.a_offset, place.b_offset), (h.a_offset, h.b_offset));
        prop_assert!(layout.place(last + 1).is_none());
        let mut cursor = 0usize;
        for i in 0..PairLayout::len(&layout) {
            let p = layout.place(i).unwrap();
            prop_assert_eq!(PairLayout::position(&layout, p.key), Some(i));
            prop_assert_eq!(p.a_offset, cursor);
            prop_assert_eq!(p.b_offset, cursor + 2 * max_rank * p.in_dim);
            cursor = p.b_offset + 2 * max_rank * p.out_dim;
        }
        prop_assert_eq!(cursor, layout.slot_bytes());
    }

    #[test]
    fn slot_bases_are_multiples_of_the_slot_size(cfg in any_config(), slot in 0usize..64) {
        let bytes = pool_slot_bytes(&cfg, 16).unwrap();
        prop_assert_eq!(slot_base_offset(slot, &cfg, 16).unwrap(), slot * bytes);
    }
}

fn llama(hidden: usize, layers: usize) -> ModelConfig {
    ModelConfig::from_hf_value(&serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": 1, "head_dim": hidden, "intermediate_size": hidden, "vocab_size": 8
    }))
    .unwrap()
}

#[test]
fn overflowing_sizes_are_errors_not_wraps() {
    let cfg = llama(1 << 23, 4096);
    assert!(matches!(
        pool_slot_bytes(&cfg, usize::MAX / 4),
        Err(LayoutError::Overflow { .. })
    ));
    let cfg = llama(64, 2);
    assert!(matches!(
        SlotLayout::new(&cfg, 8).unwrap().slot_base_offset(usize::MAX),
        Err(LayoutError::Overflow { .. })
    ));
    assert!(matches!(
        pair_bytes(usize::MAX, 2, 2),
        Err(LayoutError::Overflow { .. })
    ));
}

#[test]
fn zero_rank_is_refused() {
    let cfg = llama(64, 2);
    assert_eq!(
        pool_slot_bytes(&cfg, 0),
        Err(LayoutError::ZeroRank { what: "max_rank" })
    );
    assert_eq!(
        expert_packed_stride(0),
        Err(LayoutError::ZeroRank { what: "expert_rank" })
    );
}

#[test]
fn module_offsets_are_none_outside_the_model() {
    let cfg = llama(64, 2);
    assert_eq!(module_slot_offsets(&cfg, 8, 2, LoraModule::QProj).unwrap(), None);
    assert_eq!(module_slot_offsets(&cfg, 8, 0, LoraModule::KvBProj).unwrap(), None);
    assert_eq!(
        module_slot_offsets(&cfg, 8, 0, LoraModule::QProj).unwrap(),
        Some((0, 8 * 64 * 2))
    );
}

#[test]
fn expert_stride_rounds_to_sixteen_bytes() {
    assert_eq!(expert_packed_stride(1).unwrap(), 8);
    assert_eq!(expert_packed_stride(8).unwrap(), 8);
    assert_eq!(expert_packed_stride(9).unwrap(), 16);
    assert_eq!(expert_packed_stride(16).unwrap(), 16);
}

#[test]
fn expert_router_bytes_counts_each_site_at_the_stride() {
    let cfg = ModelConfig::from_hf_value(&serde_json::json!({
        "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "mlp_only_layers": [1]
    }))
    .unwrap();
    let gate = ExpertSite::Expert {
        expert: 1,
        proj: ExpertProj::Gate,
    };
    let down = ExpertSite::Expert {
        expert: 3,
        proj: ExpertProj::Down,
    };
    // stride(12) = 16: gate (16·32 + 16·16)·2 = 1536, down (16·16 + 32·16)·2 = 1536,
    // router (16·32 + 4·16)·2 = 1152.
    let bytes = expert_router_bytes(&cfg, 12, [(0, gate), (0, down), (0, ExpertSite::Router)]).unwrap();
    assert_eq!(bytes, 1536 + 1536 + 1152);
    assert_eq!(expert_router_bytes(&cfg, 12, []).unwrap(), 0);
    // Layer 1 is dense; expert 4 does not exist.
    assert_eq!(
        expert_router_bytes(&cfg, 12, [(1, ExpertSite::Router)]),
        Err(LayoutError::NoSuchExpertSite {
            layer: 1,
            site: ExpertSite::Router
        })
    );
    let bad = ExpertSite::Expert {
        expert: 4,
        proj: ExpertProj::Up,
    };
    assert!(expert_router_bytes(&cfg, 12, [(0, bad)]).is_err());
}

#[test]
fn expert_layout_sorts_sites_and_tiles_its_bytes() {
    let cfg = ModelConfig::from_hf_value(&serde_json::json!({
        "model_type": "mixtral", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 48, "vocab_size": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2
    }))
    .unwrap();
    let up = |expert| ExpertSite::Expert {
        expert,
        proj: ExpertProj::Up,
    };
    let layout = ExpertLayout::new(&cfg, 4, [(1, up(0)), (0, ExpertSite::Router), (0, up(2))]).unwrap();
    let order: Vec<_> = layout.entries().iter().map(|e| (e.layer, e.site)).collect();
    assert_eq!(order, [(0, up(2)), (0, ExpertSite::Router), (1, up(0))]);
    let mut cursor = 0;
    for e in layout.entries() {
        assert_eq!(e.a_offset, cursor);
        assert_eq!(e.b_offset, cursor + layout.stride() * e.in_dim * BF16_BYTES);
        cursor = e.b_offset + e.out_dim * layout.stride() * BF16_BYTES;
    }
    assert_eq!(cursor, layout.bytes());
    assert_eq!(
        layout.entry(1, up(0)).map(|e| e.a_offset),
        Some(layout.entries()[2].a_offset)
    );
    assert_eq!(layout.entry(1, up(1)), None);
    assert_eq!(
        ExpertLayout::new(&cfg, 4, [(0, up(1)), (0, up(1))]),
        Err(LayoutError::DuplicateExpertSite { layer: 0, site: up(1) })
    );
}
