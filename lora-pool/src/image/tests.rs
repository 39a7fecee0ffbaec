use super::*;
use lora_layout::{LoraModule, ModelConfig, SlotLayout};
use proptest::prelude::*;

fn cfg() -> ModelConfig {
    ModelConfig::from_hf_config(
        r#"{"model_type": "llama", "hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 40, "vocab_size": 16}"#,
    )
    .unwrap()
}

/// Distinct non-zero values, so a misplaced element shows.
fn ramp(len: usize, seed: usize) -> Vec<bf16> {
    (0..len)
        .map(|i| bf16::from_f32(((i * 7 + seed * 131) % 997 + 1) as f32))
        .collect()
}

struct Owned {
    meta: PairMeta,
    a: Vec<bf16>,
    b: Vec<bf16>,
}

fn owned(cfg: &ModelConfig, layer: usize, module: LoraModule, rank: usize, seed: usize) -> Owned {
    let (out, inp) = module.dims(cfg);
    Owned {
        meta: PairMeta {
            key: PairKey::Dense { layer, module },
            rank,
            scale: 0.5,
        },
        a: ramp(rank * inp, seed),
        b: ramp(out * rank, seed + 1),
    }
}

fn sources(pairs: &[Owned]) -> Vec<PairSource<'_>> {
    pairs
        .iter()
        .map(|p| PairSource {
            meta: p.meta,
            a: Elems::Bf16(&p.a),
            b: Elems::Bf16(&p.b),
        })
        .collect()
}

fn elem(image: &SlotImage, byte_offset: usize, index: usize) -> bf16 {
    image.as_elems()[byte_offset / 2 + index]
}

#[test]
fn packed_pairs_sit_at_their_layout_offsets_with_zero_padding() {
    let cfg = cfg();
    let layout = SlotLayout::new(&cfg, 8).unwrap();
    let pairs = [
        owned(&cfg, 0, LoraModule::KProj, 3, 1),
        owned(&cfg, 1, LoraModule::DownProj, 8, 2),
    ];
    let image = SlotImage::pack(&layout, &sources(&pairs)).unwrap();
    assert_eq!(image.as_bytes().len(), layout.slot_bytes());
    for p in &pairs {
        let PairKey::Dense { layer, module } = p.meta.key else {
            unreachable!()
        };
        let e = layout.entry(layer, module).unwrap();
        let r = p.meta.rank;
        for i in 0..8 {
            for j in 0..e.in_dim {
                let want = if i < r { p.a[i * e.in_dim + j] } else { bf16::ZERO };
                assert_eq!(elem(&image, e.a_offset, i * e.in_dim + j), want);
            }
        }
        for o in 0..e.out_dim {
            for k in 0..8 {
                let want = if k < r { p.b[o * r + k] } else { bf16::ZERO };
                assert_eq!(elem(&image, e.b_offset, o * 8 + k), want);
            }
        }
    }
    // Every byte outside the two pairs is zero.
    let nonzero: usize = image.as_elems().iter().filter(|v| **v != bf16::ZERO).count();
    let adapted: usize = pairs.iter().map(|p| p.a.len() + p.b.len()).sum();
    assert_eq!(nonzero, adapted);
    assert_eq!(image.pairs().len(), 2);
}

#[test]
fn bad_pairs_are_refused_before_anything_is_written() {
    let cfg = cfg();
    let layout = SlotLayout::new(&cfg, 4).unwrap();
    let over = owned(&cfg, 0, LoraModule::QProj, 5, 0);
    assert!(matches!(
        SlotImage::pack(&layout, &sources(&[over])),
        Err(ImageError::Rank { rank: 5, stride: 4, .. })
    ));
    let mut short = owned(&cfg, 0, LoraModule::QProj, 2, 0);
    short.b.pop();
    assert!(matches!(
        SlotImage::pack(&layout, &sources(&[short])),
        Err(ImageError::Shape { part: PairPart::B, .. })
    ));
    let missing = owned(&cfg, 2, LoraModule::QProj, 2, 0);
    assert!(matches!(
        SlotImage::pack(&layout, &sources(&[missing])),
        Err(ImageError::NoSuchPair {
            key: PairKey::Dense { layer: 2, .. }
        })
    ));
    let mla = Owned {
        meta: PairMeta {
            key: PairKey::Dense {
                layer: 0,
                module: LoraModule::KvBProj,
            },
            rank: 1,
            scale: 1.0,
        },
        a: vec![],
        b: vec![],
    };
    assert!(matches!(
        SlotImage::pack(&layout, &sources(&[mla])),
        Err(ImageError::NoSuchPair { .. })
    ));
    let twice = [
        owned(&cfg, 1, LoraModule::UpProj, 2, 0),
        owned(&cfg, 1, LoraModule::UpProj, 2, 1),
    ];
    assert!(matches!(
        SlotImage::pack(&layout, &sources(&twice)),
        Err(ImageError::Duplicate { .. })
    ));
}

/// Land `pairs` the way a peer does: A as `[rank, in]`, B as the padded
/// `[out, max_rank]`.
fn land(layout: &SlotLayout, pairs: &[Owned]) -> SlotImage {
    let max_rank = layout.max_rank();
    let mut image = SlotImage::zeroed(layout);
    for p in pairs {
        image.declare(layout, p.meta).unwrap();
        let a = image.region_mut(layout, p.meta.key, PairPart::A).unwrap();
        a.copy_from_slice(bytemuck::cast_slice(&p.a));
        let r = p.meta.rank;
        let mut b_padded = vec![bf16::ZERO; p.b.len() / r * max_rank];
        for (dst, src) in b_padded.chunks_exact_mut(max_rank).zip(p.b.chunks_exact(r)) {
            dst[..r].copy_from_slice(src);
        }
        let b = image.region_mut(layout, p.meta.key, PairPart::B).unwrap();
        b.copy_from_slice(bytemuck::cast_slice(&b_padded));
    }
    image
}

const Q0: PairKey = PairKey::Dense {
    layer: 0,
    module: LoraModule::QProj,
};

#[test]
fn landing_requires_a_declaration() {
    let cfg = cfg();
    let layout = SlotLayout::new(&cfg, 4).unwrap();
    let mut image = SlotImage::zeroed(&layout);
    assert!(matches!(
        image.region_mut(&layout, Q0, PairPart::A),
        Err(ImageError::Undeclared { .. })
    ));
    let meta = PairMeta {
        key: Q0,
        rank: 2,
        scale: 1.0,
    };
    image.declare(&layout, meta).unwrap();
    assert!(matches!(
        image.declare(&layout, meta),
        Err(ImageError::Duplicate { .. })
    ));
    assert_eq!(image.region_mut(&layout, Q0, PairPart::A).unwrap().len(), 2 * 24 * 2);
}

const LLAMA_MODULES: [LoraModule; 7] = [
    LoraModule::QProj,
    LoraModule::KProj,
    LoraModule::VProj,
    LoraModule::OProj,
    LoraModule::GateProj,
    LoraModule::UpProj,
    LoraModule::DownProj,
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn landing_and_packing_give_the_same_bytes(
        max_rank in 1usize..9,
        picks in prop::collection::vec((0usize..2, 0usize..7, 1usize..9), 0..10),
    ) {
        let cfg = cfg();
        let layout = SlotLayout::new(&cfg, max_rank).unwrap();
        let mut pairs: Vec<Owned> = Vec::new();
        for (i, (layer, m, rank)) in picks.into_iter().enumerate() {
            let module = LLAMA_MODULES[m];
            if pairs.iter().any(|p| p.meta.key == PairKey::Dense { layer, module }) {
                continue;
            }
            pairs.push(owned(&cfg, layer, module, rank.min(max_rank), i));
        }
        let packed = SlotImage::pack(&layout, &sources(&pairs)).unwrap();
        let landed = land(&layout, &pairs);
        prop_assert!(packed.as_bytes() == landed.as_bytes());
        prop_assert_eq!(packed.pairs(), landed.pairs());
    }
}

#[test]
fn raw_file_bytes_convert_like_the_audit_loader() {
    let cfg = cfg();
    let layout = SlotLayout::new(&cfg, 4).unwrap();
    let p = owned(&cfg, 0, LoraModule::VProj, 3, 5);
    let as_f32: Vec<u8> = p.a.iter().flat_map(|v| v.to_f32().to_le_bytes()).collect();
    let as_f16: Vec<u8> =
        p.b.iter()
            .flat_map(|v| half::f16::from_f32(v.to_f32()).to_le_bytes())
            .collect();
    let raw_b: Vec<u8> = p.b.iter().flat_map(|v| v.to_le_bytes()).collect();
    let reference = SlotImage::pack(&layout, &sources(std::slice::from_ref(&p))).unwrap();
    // F32 and BF16 bytes of BF16 values convert back exactly.
    let src = PairSource {
        meta: p.meta,
        a: Elems::F32Bytes(&as_f32),
        b: Elems::Bf16Bytes(&raw_b),
    };
    assert_eq!(
        SlotImage::pack(&layout, &[src]).unwrap().as_bytes(),
        reference.as_bytes()
    );
    // Unaligned BF16 bytes too.
    let mut shifted = vec![0u8];
    shifted.extend_from_slice(&raw_b);
    let src = PairSource {
        meta: p.meta,
        a: Elems::F32Bytes(&as_f32),
        b: Elems::Bf16Bytes(&shifted[1..]),
    };
    assert_eq!(
        SlotImage::pack(&layout, &[src]).unwrap().as_bytes(),
        reference.as_bytes()
    );
    // F16 round-trips the ramp's small integers exactly.
    let src = PairSource {
        meta: p.meta,
        a: Elems::F32Bytes(&as_f32),
        b: Elems::F16Bytes(&as_f16),
    };
    assert_eq!(
        SlotImage::pack(&layout, &[src]).unwrap().as_bytes(),
        reference.as_bytes()
    );
}

/// A 4-head llama, 2 kv heads, so 2 ranks cut every module and 4 ranks
/// replicate the kv heads.
fn tp_cfg() -> ModelConfig {
    ModelConfig::from_hf_config(
        r#"{"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 16}"#,
    )
    .unwrap()
}

#[test]
fn a_tensor_parallel_rank_packs_its_shard_of_each_pair() {
    let cfg = tp_cfg();
    let rank = 3;
    let placement = lora_layout::Placement::new(3, 4).unwrap();
    let layout = SlotLayout::with_placement(&cfg, 4, placement).unwrap();
    let pairs = [
        owned(&cfg, 0, LoraModule::KProj, rank, 1),
        owned(&cfg, 0, LoraModule::OProj, rank, 2),
    ];
    let image = SlotImage::pack(&layout, &sources(&pairs)).unwrap();
    // k_proj, column-parallel: A whole, B rows of kv head 1 (ranks 2, 3).
    let k = layout.entry(0, LoraModule::KProj).unwrap();
    let (_, k_in) = LoraModule::KProj.dims(&cfg);
    assert_eq!((k.out_dim, k.in_dim), (4, k_in));
    for i in 0..rank * k_in {
        assert_eq!(elem(&image, k.a_offset, i), pairs[0].a[i]);
    }
    for row in 0..4 {
        for c in 0..rank {
            assert_eq!(elem(&image, k.b_offset, row * 4 + c), pairs[0].b[(4 + row) * rank + c]);
        }
        assert_eq!(elem(&image, k.b_offset, row * 4 + 3), bf16::ZERO);
    }
    // o_proj, row-parallel: A columns of head 3, B whole.
    let o = layout.entry(0, LoraModule::OProj).unwrap();
    let (o_out, o_in) = LoraModule::OProj.dims(&cfg);
    assert_eq!((o.out_dim, o.in_dim), (o_out, o_in / 4));
    for r in 0..rank {
        for c in 0..o.in_dim {
            assert_eq!(
                elem(&image, o.a_offset, r * o.in_dim + c),
                pairs[1].a[r * o_in + 3 * o.in_dim + c]
            );
        }
    }
    for row in 0..o_out {
        for c in 0..rank {
            assert_eq!(elem(&image, o.b_offset, row * 4 + c), pairs[1].b[row * rank + c]);
        }
    }
}

#[test]
fn a_non_finite_value_in_a_shard_is_named_by_its_index_in_the_whole_tensor() {
    let cfg = tp_cfg();
    let placement = lora_layout::Placement::new(1, 2).unwrap();
    let layout = SlotLayout::with_placement(&cfg, 4, placement).unwrap();
    let mut o = owned(&cfg, 0, LoraModule::OProj, 2, 1);
    let (_, o_in) = LoraModule::OProj.dims(&cfg);
    // Row 1, column 10: in rank 1's half of the input columns.
    o.a[o_in + 10] = bf16::INFINITY;
    let err = SlotImage::pack(&layout, &sources(std::slice::from_ref(&o))).unwrap_err();
    assert!(
        matches!(err, ImageError::NonFinite { part: PairPart::A, index, .. } if index == o_in + 10),
        "{err}"
    );
    // Rank 0 does not hold that column: it packs.
    let rank0 = SlotLayout::with_placement(&cfg, 4, lora_layout::Placement::new(0, 2).unwrap()).unwrap();
    assert!(SlotImage::pack(&rank0, &sources(std::slice::from_ref(&o))).is_ok());
    // A B row of rank 1's q block.
    let mut q = owned(&cfg, 0, LoraModule::QProj, 2, 3);
    q.b[9 * 2 + 1] = bf16::NAN;
    let err = SlotImage::pack(&layout, &sources(std::slice::from_ref(&q))).unwrap_err();
    assert!(
        matches!(
            err,
            ImageError::NonFinite {
                part: PairPart::B,
                index: 19,
                ..
            }
        ),
        "{err}"
    );
}
