use super::*;
use crate::layout::{BF16_BYTES, LayoutError, SlotLayout};
use crate::pair::PairLayout;
use proptest::prelude::*;

/// A random config of any supported family whose dims are small products,
/// so some world sizes divide them and some do not.
fn any_config() -> impl Strategy<Value = ModelConfig> {
    let families = prop::sample::select(vec![
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "mixtral",
        "qwen3_next",
        "deepseek_v3",
        "glm4_moe",
        "gemma2",
        "gemma3_text",
        "phi3",
        "gpt_oss",
    ]);
    let dim = || prop::sample::select(vec![1usize, 2, 3, 4, 6, 8, 12, 16, 24, 32]);
    (
        families,
        1usize..4,
        prop::sample::select(vec![1usize, 2, 3, 4, 8, 16]),
        prop::sample::select(vec![1usize, 2, 4, 8]),
        prop::sample::select(vec![2usize, 4, 8]),
        (dim(), dim(), dim(), dim(), dim()),
        any::<bool>(),
    )
        .prop_map(
            |(mt, layers, heads, kv_div, head_dim, (inter, moe_inter, shared, lin_heads, kv_rank), q_lora)| {
                let kv = (heads / kv_div).max(1);
                let mut v = serde_json::json!({
                    "model_type": mt, "hidden_size": 8 * heads, "num_hidden_layers": layers,
                    "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
                    "intermediate_size": 8 * inter, "vocab_size": 64,
                    "num_experts": 2, "num_local_experts": 2, "n_routed_experts": 2,
                    "num_experts_per_tok": 1, "moe_intermediate_size": 4 * moe_inter,
                    "shared_expert_intermediate_size": 4 * shared, "decoder_sparse_step": 2,
                    "full_attention_interval": 2, "first_k_dense_replace": 1, "n_shared_experts": 1,
                    "linear_num_value_heads": lin_heads, "linear_value_head_dim": 4,
                    "kv_lora_rank": 4 * kv_rank, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                });
                v["q_lora_rank"] = if q_lora {
                    serde_json::json!(12)
                } else {
                    serde_json::Value::Null
                };
                ModelConfig::from_hf_value(&v).expect("strategy builds valid configs")
            },
        )
}

/// Ranks holding each A column / B row of a pair, and the ranks' total
/// bytes, counted by rule from the module's kind and the config alone
/// (not from `ModuleShard`): a cut factor is held once per row or column,
/// except key / value rows when heads are fewer than ranks, which
/// `world / kv_heads` ranks hold; a whole factor is held by every rank.
fn expected_holders(module: LoraModule, cfg: &ModelConfig, world: usize) -> (usize, Vec<usize>) {
    let (out, _) = module.dims(cfg);
    let kv_replicas = (world / cfg.num_key_value_heads).max(1);
    match module.shard_kind() {
        ShardKind::Column => {
            let rows = match module {
                LoraModule::KProj | LoraModule::VProj => vec![kv_replicas; out],
                LoraModule::QkvProj => {
                    let q = cfg.num_attention_heads * cfg.head_dim;
                    (0..out).map(|r| if r < q { 1 } else { kv_replicas }).collect()
                }
                _ => vec![1; out],
            };
            (world, rows)
        }
        ShardKind::Row => (1, vec![world; out]),
        ShardKind::Replicated => (world, vec![world; out]),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// For every world size, either no rank's layout builds (the same typed
    /// refusal from each) or every rank's does, and then: the same pairs in
    /// the same order as the unsharded walk; each slot tiled exactly; the
    /// ranks' A columns and B rows cover the unsharded pair, each held by
    /// exactly the ranks the rule says; and the slot bytes add up:
    /// sum over ranks = sum over pairs of (A bytes x ranks holding each A
    /// column + B bytes per row x ranks holding that row).
    #[test]
    fn the_ranks_shards_tile_the_unsharded_pairs(
        cfg in any_config(),
        max_rank in 1usize..20,
        world in prop::sample::select(vec![1usize, 2, 4, 8]),
    ) {
        let whole = SlotLayout::new(&cfg, max_rank).unwrap();
        let group = Placement::new(0, world).unwrap();
        let layouts: Vec<_> = group.ranks().map(|p| SlotLayout::with_placement(&cfg, max_rank, p)).collect();
        if let Err(first) = &layouts[0] {
            let refused = matches!(first, LayoutError::Placement(PlacementError::Indivisible { .. }));
            prop_assert!(refused, "{}", first);
            for l in &layouts {
                prop_assert_eq!(l.as_ref().err(), Some(first));
            }
            prop_assert!(world > 1);
            return Ok(());
        }
        let layouts: Vec<SlotLayout> = layouts.into_iter().map(Result::unwrap).collect();
        if world == 1 {
            prop_assert_eq!(&layouts[0], &whole);
        }
        let mut expected_total = 0usize;
        for (i, e) in whole.entries().iter().enumerate() {
            let (out, inp) = e.module.dims(&cfg);
            let mut a_cols = vec![0usize; inp];
            let mut b_rows = vec![0usize; out];
            for l in &layouts {
                let le = l.entries()[i];
                prop_assert_eq!((le.layer, le.module), (e.layer, e.module));
                let s = l.shard(i).unwrap();
                prop_assert_eq!(s.full_dims, (out, inp));
                prop_assert_eq!(s.dims(), (le.out_dim, le.in_dim));
                for held in &mut a_cols[s.in_start..s.in_start + s.in_len] {
                    *held += 1;
                }
                for row in 0..le.out_dim {
                    b_rows[s.src_row(row).unwrap()] += 1;
                }
                prop_assert_eq!(s.src_row(le.out_dim), None);
            }
            let (a_holders, row_holders) = expected_holders(e.module, &cfg, world);
            prop_assert_eq!(a_cols, vec![a_holders; inp], "{} A columns", e.module);
            prop_assert_eq!(&b_rows, &row_holders, "{} B rows", e.module);
            expected_total += BF16_BYTES * max_rank * (inp * a_holders + row_holders.iter().sum::<usize>());
        }
        for l in &layouts {
            let mut cursor = 0;
            for e in l.entries() {
                prop_assert_eq!(e.a_offset, cursor);
                prop_assert_eq!(e.b_offset - e.a_offset, max_rank * e.in_dim * BF16_BYTES);
                cursor = e.end_offset(max_rank);
            }
            prop_assert_eq!(cursor, l.slot_bytes());
        }
        prop_assert_eq!(layouts.iter().map(SlotLayout::slot_bytes).sum::<usize>(), expected_total);
    }
}

fn config(v: serde_json::Value) -> ModelConfig {
    ModelConfig::from_hf_value(&v).unwrap()
}

fn llama(heads: usize, kv: usize, inter: usize) -> ModelConfig {
    config(serde_json::json!({
        "model_type": "llama", "hidden_size": 16 * heads, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": 8
    }))
}

#[test]
fn a_placement_needs_a_rank_below_a_positive_world() {
    assert_eq!(Placement::new(0, 0), Err(PlacementError::ZeroWorld));
    assert_eq!(
        Placement::new(2, 2),
        Err(PlacementError::RankOutOfRange {
            tp_rank: 2,
            tp_world: 2
        })
    );
    assert_eq!(Placement::new(0, 1), Ok(Placement::SINGLE));
    assert_eq!(Placement::default(), Placement::SINGLE);
}

#[test]
fn a_cut_that_does_not_divide_names_the_dimension() {
    let at = |cfg: &ModelConfig, world| SlotLayout::with_placement(cfg, 4, Placement::new(world - 1, world).unwrap());
    let err = at(&llama(4, 2, 64), 8).unwrap_err();
    assert_eq!(
        err,
        LayoutError::Placement(PlacementError::Indivisible {
            module: LoraModule::QProj,
            dimension: "num_attention_heads",
            size: 4,
            rule: "is not a multiple of",
            tp_world: 8,
        })
    );
    assert!(err.to_string().contains("num_attention_heads = 4"), "{err}");
    let err = at(&llama(6, 3, 64), 2).unwrap_err();
    assert!(
        matches!(
            err,
            LayoutError::Placement(PlacementError::Indivisible {
                module: LoraModule::KProj,
                dimension: "num_key_value_heads",
                size: 3,
                ..
            })
        ),
        "{err}"
    );
    let err = at(&llama(4, 4, 6), 4).unwrap_err();
    assert!(
        matches!(
            err,
            LayoutError::Placement(PlacementError::Indivisible {
                module: LoraModule::GateProj,
                dimension: "intermediate_size",
                size: 6,
                ..
            })
        ),
        "{err}"
    );
}

#[test]
fn key_value_heads_fewer_than_ranks_are_replicated_as_vllm_does() {
    // 2 kv heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    // (vLLM QKVParallelLinear: head = rank / (world / kv_heads)).
    let cfg = llama(4, 2, 64);
    let starts: Vec<_> = Placement::new(0, 4)
        .unwrap()
        .ranks()
        .map(|p| {
            let s = ModuleShard::of(LoraModule::KProj, &cfg, p).unwrap();
            (s.segments()[0].start, s.segments()[0].len, s.segments()[0].replicas)
        })
        .collect();
    assert_eq!(starts, [(0, 16, 2), (0, 16, 2), (16, 16, 2), (16, 16, 2)]);
}

#[test]
fn each_family_cuts_by_its_own_units() {
    let next = config(serde_json::json!({
        "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 8,
        "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "full_attention_interval": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 8
    }));
    let rank1 = Placement::new(1, 2).unwrap();
    // Query and gate per head: rank 1 holds heads 2, 3 = rows 32..64.
    let q = ModuleShard::of(LoraModule::QProj, &next, rank1).unwrap();
    assert_eq!(
        q.segments(),
        [OutSegment {
            start: 32,
            len: 32,
            replicas: 1
        }]
    );
    assert_eq!((q.in_start, q.in_len), (0, 32));
    let out = ModuleShard::of(LoraModule::LinearAttnOutProj, &next, rank1).unwrap();
    assert_eq!(
        (out.kind, out.in_start, out.in_len, out.dims()),
        (ShardKind::Row, 16, 16, (32, 16))
    );
    let gate = ModuleShard::of(LoraModule::SharedExpertGate, &next, rank1).unwrap();
    assert!(gate.is_whole() && gate.kind == ShardKind::Replicated);

    let phi = config(serde_json::json!({
        "model_type": "phi3", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 8
    }));
    // Fused q | k | v: the rank's block of each part, in fused order.
    let qkv = ModuleShard::of(LoraModule::QkvProj, &phi, rank1).unwrap();
    let segs: Vec<_> = qkv.segments().iter().map(|s| (s.start, s.len)).collect();
    assert_eq!(segs, [(16, 16), (40, 8), (56, 8)]);
    let gate_up = ModuleShard::of(LoraModule::GateUpProj, &phi, rank1).unwrap();
    let segs: Vec<_> = gate_up.segments().iter().map(|s| (s.start, s.len)).collect();
    assert_eq!(segs, [(32, 32), (96, 32)]);

    let mla = config(serde_json::json!({
        "model_type": "deepseek_v3", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "vocab_size": 8, "n_routed_experts": 2, "num_experts_per_tok": 1,
        "moe_intermediate_size": 16, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8
    }));
    for (module, kind) in [
        (LoraModule::QAProj, ShardKind::Replicated),
        (LoraModule::KvAProjWithMqa, ShardKind::Replicated),
        (LoraModule::QBProj, ShardKind::Column),
        (LoraModule::KvBProj, ShardKind::Column),
        (LoraModule::OProj, ShardKind::Row),
        (LoraModule::SharedDownProj, ShardKind::Row),
    ] {
        let s = ModuleShard::of(module, &mla, rank1).unwrap();
        assert_eq!(s.kind, kind, "{module}");
    }
    // kv_b_proj: per head qk_nope + v = 16 rows; rank 1 holds heads 2, 3.
    let kv_b = ModuleShard::of(LoraModule::KvBProj, &mla, rank1).unwrap();
    assert_eq!(
        kv_b.segments(),
        [OutSegment {
            start: 32,
            len: 32,
            replicas: 1
        }]
    );
}

proptest! {
    /// Every expert is held by exactly one expert-parallel rank, in
    /// contiguous blocks in rank order; the router by every rank; a count
    /// that does not divide is refused naming `num_experts` on every rank.
    #[test]
    fn expert_parallel_ranks_cover_every_expert_exactly_once(
        num_experts in 1usize..65,
        ep_world in 1usize..9,
        tp_world in 1usize..3,
    ) {
        let tp = Placement::new(0, tp_world).expect("placement");
        let group = tp.with_experts(0, ep_world).expect("placement");
        let mut holders = vec![0usize; num_experts];
        let mut next = 0;
        for rank in group.expert_ranks() {
            prop_assert_eq!(rank.tp_world(), tp_world);
            match rank.expert_range(num_experts) {
                Ok(range) => {
                    prop_assert!(num_experts.is_multiple_of(ep_world));
                    prop_assert_eq!(range.start, next);
                    prop_assert_eq!(range.len(), num_experts / ep_world);
                    next = range.end;
                    for (e, count) in holders.iter_mut().enumerate() {
                        let site = ExpertSite::Expert { expert: e, proj: crate::ExpertProj::Down };
                        let held = rank.holds_expert_site(site, num_experts).expect("divides");
                        prop_assert_eq!(held, range.contains(&e));
                        *count += usize::from(held);
                    }
                    prop_assert!(rank.holds_expert_site(ExpertSite::Router, num_experts).expect("divides"));
                }
                Err(e) => {
                    prop_assert!(!num_experts.is_multiple_of(ep_world));
                    prop_assert_eq!(e.clone(), PlacementError::IndivisibleExperts { num_experts, ep_world });
                    prop_assert!(e.to_string().contains("num_experts"));
                }
            }
        }
        if num_experts.is_multiple_of(ep_world) {
            prop_assert!(holders.iter().all(|&h| h == 1), "{:?}", holders);
        }
    }
}

#[test]
fn an_expert_placement_needs_a_rank_below_a_positive_world() {
    let tp = Placement::new(1, 2).expect("placement");
    assert_eq!(tp.with_experts(0, 0), Err(PlacementError::ZeroExpertWorld));
    assert_eq!(
        tp.with_experts(4, 4),
        Err(PlacementError::ExpertRankOutOfRange {
            ep_rank: 4,
            ep_world: 4
        })
    );
    let p = tp.with_experts(3, 4).expect("placement");
    assert_eq!((p.tp_rank(), p.tp_world(), p.ep_rank(), p.ep_world()), (1, 2, 3, 4));
    assert_eq!(p.expert_range(8), Ok(6..8));
    // The expert axis changes no dense shard.
    let cfg = llama(4, 2, 32);
    for m in LoraModule::ALL.into_iter().filter(|m| m.applies_to_layer(&cfg, 0)) {
        assert_eq!(ModuleShard::of(m, &cfg, p), ModuleShard::of(m, &cfg, tp));
    }
    assert_eq!(Placement::SINGLE.expert_range(5), Ok(0..5));
}

#[test]
fn the_embedding_pair_is_replicated_whole_after_every_ranks_dense_shards() {
    use crate::pair::{PairKey, PairLayout};
    let cfg = llama(4, 2, 64);
    for world in [1, 2, 4] {
        for p in Placement::new(0, world).unwrap().ranks() {
            let dense = SlotLayout::with_placement(&cfg, 4, p).unwrap();
            let places = crate::layout::ModelPlaces {
                embedding: true,
                lm_head: false,
            };
            let with = SlotLayout::walk(&cfg, 4, p, places).unwrap();
            assert_eq!(with.entries(), dense.entries(), "{p:?}: the dense places are unmoved");
            let e = with.embedding().unwrap();
            assert_eq!(
                (e.vocab, e.hidden, e.a_offset),
                (cfg.vocab_size, cfg.hidden_size, dense.slot_bytes())
            );
            let i = PairLayout::position(&with, PairKey::Embedding).unwrap();
            let place = with.place(i).unwrap();
            assert_eq!(place.key, PairKey::Embedding);
            assert_eq!((place.out_dim, place.in_dim), (cfg.hidden_size, cfg.vocab_size));
            assert_eq!(place.shard, ModuleShard::embedding(&cfg, p).unwrap());
            assert!(place.shard.is_whole() && place.shard.kind == ShardKind::Replicated);
            assert_eq!(place.shard.in_replicas, world);
            assert_eq!(place.shard.segments()[0].replicas, world);
            assert_eq!(
                with.slot_bytes() - dense.slot_bytes(),
                SlotLayout::with_embedding(&cfg, 4).unwrap().slot_bytes()
                    - SlotLayout::new(&cfg, 4).unwrap().slot_bytes(),
                "{p:?}: every rank pays the whole pair"
            );
            assert!(with.place(i + 1).is_none());
        }
    }
}

#[test]
fn the_head_pair_is_replicated_whole_after_the_embedding_pair_on_every_rank() {
    use crate::layout::ModelPlaces;
    use crate::pair::{PairKey, PairLayout};
    let cfg = llama(4, 2, 64);
    let head_bytes = |embedding| {
        let one = |lm_head| {
            SlotLayout::walk(&cfg, 4, Placement::SINGLE, ModelPlaces { embedding, lm_head })
                .unwrap()
                .slot_bytes()
        };
        one(true) - one(false)
    };
    for world in [1, 2, 4] {
        for p in Placement::new(0, world).unwrap().ranks() {
            for embedding in [false, true] {
                let before = SlotLayout::walk(
                    &cfg,
                    4,
                    p,
                    ModelPlaces {
                        embedding,
                        lm_head: false,
                    },
                )
                .unwrap();
                let with = SlotLayout::walk(
                    &cfg,
                    4,
                    p,
                    ModelPlaces {
                        embedding,
                        lm_head: true,
                    },
                )
                .unwrap();
                assert_eq!(with.entries(), before.entries(), "{p:?}: the dense places are unmoved");
                assert_eq!(
                    with.embedding(),
                    before.embedding(),
                    "{p:?}: the embedding place is unmoved"
                );
                let h = with.lm_head().unwrap();
                assert_eq!(
                    (h.vocab, h.hidden, h.a_offset),
                    (cfg.vocab_size, cfg.hidden_size, before.slot_bytes())
                );
                let i = PairLayout::position(&with, PairKey::LmHead).unwrap();
                assert_eq!(i, with.entries().len() + usize::from(embedding));
                let place = with.place(i).unwrap();
                assert_eq!(place.key, PairKey::LmHead);
                assert_eq!((place.out_dim, place.in_dim), (cfg.vocab_size, cfg.hidden_size));
                assert_eq!(place.shard, ModuleShard::lm_head(&cfg, p).unwrap());
                assert!(place.shard.is_whole() && place.shard.kind == ShardKind::Replicated);
                assert_eq!(place.shard.in_replicas, world);
                assert_eq!(place.shard.segments()[0].replicas, world);
                if embedding {
                    let e = with.place(i - 1).unwrap();
                    assert_eq!(e.key, PairKey::Embedding);
                    assert_eq!(e.shard, ModuleShard::embedding(&cfg, p).unwrap());
                }
                assert_eq!(
                    with.slot_bytes() - before.slot_bytes(),
                    head_bytes(embedding),
                    "{p:?}: every rank pays the whole head pair"
                );
                assert!(with.place(i + 1).is_none());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Under the fully-sharded option: a `max_rank` the world does not
    /// divide is refused naming `max_rank` by every rank (where the
    /// geometry itself divides); otherwise every pair keeps the half-sharded
    /// layout's output rows and input columns, a column-parallel pair's A
    /// rank rows are cut into `world` blocks held once each in rank order
    /// (the ranks' A parts concatenate to the padded A), every other pair's
    /// A is whole, and the slot bytes add up: the half-sharded ranks' bytes
    /// less `(world - 1) / world` of each column-parallel A held by every
    /// rank.
    #[test]
    fn fully_sharded_ranks_cut_column_a_by_rank_rows(
        cfg in any_config(),
        max_rank in 1usize..20,
        world in prop::sample::select(vec![1usize, 2, 4, 8]),
    ) {
        let group = Placement::new(0, world).unwrap();
        let half: Vec<_> = group.ranks().map(|p| SlotLayout::with_placement(&cfg, max_rank, p)).collect();
        let full: Vec<_> = group
            .ranks()
            .map(|p| SlotLayout::with_placement(&cfg, max_rank, p.with_fully_sharded(true)))
            .collect();
        let Ok(half) = half.into_iter().collect::<Result<Vec<_>, _>>() else {
            // The geometry does not divide: refused before the rank cut.
            prop_assert!(full.iter().all(Result::is_err));
            return Ok(());
        };
        let has_column = half[0].entries().iter().any(|e| e.module.shard_kind() == ShardKind::Column);
        if !max_rank.is_multiple_of(world) && has_column {
            for l in &full {
                prop_assert_eq!(
                    l.as_ref().err(),
                    Some(&LayoutError::Placement(PlacementError::IndivisibleRank { max_rank, tp_world: world }))
                );
            }
            return Ok(());
        }
        let full: Vec<SlotLayout> = full.into_iter().map(Result::unwrap).collect();
        let mut saved = 0usize;
        for (i, e) in half[0].entries().iter().enumerate() {
            let column = e.module.shard_kind() == ShardKind::Column && world > 1;
            let mut rows_held = vec![0usize; max_rank];
            let mut order = Vec::new();
            for (h, f) in half.iter().zip(&full) {
                let (he, fe) = (h.entries()[i], f.entries()[i]);
                prop_assert_eq!((fe.layer, fe.module, fe.out_dim, fe.in_dim), (he.layer, he.module, he.out_dim, he.in_dim));
                prop_assert_eq!(he.a_rows, max_rank);
                let rows = f.shard(i).unwrap().rank_rows(max_rank).unwrap();
                prop_assert_eq!(fe.a_rows, rows.len());
                prop_assert_eq!(fe.b_offset - fe.a_offset, fe.a_rows * fe.in_dim * BF16_BYTES);
                for held in &mut rows_held[rows.clone()] {
                    *held += 1;
                }
                order.push(rows.start);
            }
            if column {
                prop_assert_eq!(&rows_held, &vec![1; max_rank], "{} A rank rows", e.module);
                prop_assert!(order.windows(2).all(|w| w[0] < w[1]), "rank order");
                saved += (world - 1) * max_rank * e.in_dim * BF16_BYTES;
            } else {
                prop_assert_eq!(&rows_held, &vec![world; max_rank], "{} A whole", e.module);
            }
        }
        for l in &full {
            let mut cursor = 0;
            for e in l.entries() {
                prop_assert_eq!(e.a_offset, cursor);
                cursor = e.end_offset(max_rank);
            }
            prop_assert_eq!(cursor, l.slot_bytes());
        }
        let half_total: usize = half.iter().map(SlotLayout::slot_bytes).sum();
        let full_total: usize = full.iter().map(SlotLayout::slot_bytes).sum();
        prop_assert_eq!(full_total + saved, half_total);
        if world == 1 {
            prop_assert_eq!(&full[0].entries(), &half[0].entries());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The rows of a rank-`r` pair's A each fully-sharded rank holds with
    /// data ([`PairPlace::a_used_rows`]) lie in its block, and the ranks'
    /// rows concatenate, in rank order, to the pair's `0..r`: what the peer
    /// stages and the packer copies, once each.
    #[test]
    fn fully_sharded_ranks_hold_a_pairs_true_rank_rows_once(
        cfg in any_config(),
        max_rank in prop::sample::select(vec![8usize, 16]),
        world in prop::sample::select(vec![1usize, 2, 4, 8]),
        rank_seed in 0usize..64,
    ) {
        let rank = 1 + rank_seed % max_rank;
        let group = Placement::new(0, world).unwrap().with_fully_sharded(true);
        let Ok(layouts) = group
            .ranks()
            .map(|p| SlotLayout::with_placement(&cfg, max_rank, p))
            .collect::<Result<Vec<_>, _>>()
        else {
            return Ok(());
        };
        for i in 0..PairLayout::len(&layouts[0]) {
            let mut rows = Vec::new();
            for l in &layouts {
                let place = PairLayout::place(l, i).unwrap();
                let used = place.a_used_rows(max_rank, rank);
                let block = place.a_rows(max_rank);
                prop_assert!(used.is_empty() || (block.start <= used.start && used.end <= block.end));
                prop_assert_eq!(used.start, block.start.min(rank));
                rows.extend(used);
            }
            // A cut A: the ranks' rows are `0..rank` once, in rank order;
            // a whole A: every rank holds `0..rank`.
            let want: Vec<usize> = if place_is_cut(&layouts[0], i, max_rank) {
                (0..rank).collect()
            } else {
                (0..world).flat_map(|_| 0..rank).collect()
            };
            prop_assert_eq!(rows, want);
        }
    }
}

/// Whether place `i` of `layout` holds a block of A's rank rows (cut by
/// the fully-sharded option), not all of them.
fn place_is_cut(layout: &SlotLayout, i: usize, stride: usize) -> bool {
    PairLayout::place(layout, i).is_some_and(|p| p.a_rows(stride).len() < stride)
}
