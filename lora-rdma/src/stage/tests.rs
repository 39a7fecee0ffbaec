use lora_audit::LoraOptions;
use lora_layout::{ExpertLayout, PairLayout, SlotLayout};
use lora_pool::image::{PairMeta, SlotImage};

use super::*;
use crate::test_support::{config, disk_images, opts};

/// Copy the staged parts of `metas` into a zeroed image the way a lander does.
fn land(staging: &Staging, layout: &impl PairLayout, metas: &[PairMeta]) -> SlotImage {
    let mut image = SlotImage::zeroed(layout);
    for m in metas {
        image.declare(layout, *m).unwrap();
    }
    for p in staging.parts.iter().filter(|p| metas.iter().any(|m| m.key == p.key)) {
        let dst = image.region_mut(layout, p.key, p.part.pair_part().unwrap()).unwrap();
        dst.copy_from_slice(&staging.bytes[p.offset..p.offset + p.len]);
    }
    image
}

#[test]
fn staged_dense_pairs_land_as_the_packed_slot() {
    for (adapter, max_rank) in [("demo_r4_plain", 8), ("demo_r8_rslora", 8), ("rank_alpha_pattern", 32)] {
        let (p, packed, _) = disk_images("llama", adapter, &opts(max_rank, 16));
        let layout = SlotLayout::new(&config("llama"), max_rank).unwrap();
        let staging = stage_adapter(&p, &config("llama"), &opts(max_rank, 16), usize::MAX).unwrap();
        assert_eq!(
            land(&staging, &layout, packed.pairs()).as_bytes(),
            packed.as_bytes(),
            "{adapter}"
        );
        for part in &staging.parts {
            assert_eq!(
                part.checksum,
                xxh64(&staging.bytes[part.offset..part.offset + part.len])
            );
        }
    }
}

#[test]
fn staged_expert_pairs_land_as_the_packed_expert_image() {
    let (p, _, packed) = disk_images("qwen3_moe", "experts_fused_router", &opts(16, 12));
    assert!(!p.experts.is_empty());
    let cfg = config("qwen3_moe");
    let layout = ExpertLayout::new(&cfg, 12, p.experts.iter().map(|e| (e.layer, e.site))).unwrap();
    let staging = stage_adapter(&p, &cfg, &opts(16, 12), usize::MAX).unwrap();
    assert_eq!(land(&staging, &layout, packed.pairs()).as_bytes(), packed.as_bytes());
    // B of an expert pair is staged at the packed stride (12 rounds to 16).
    let first = packed.pairs()[0];
    let b = staging
        .parts
        .iter()
        .find(|s| s.part == WirePart::B && s.key == first.key)
        .unwrap();
    let place = PairLayout::place(&layout, PairLayout::position(&layout, first.key).unwrap()).unwrap();
    assert_eq!(b.len, place.out_dim * 16 * 2);
}

#[test]
fn a_rank_over_the_stride_and_an_oversized_staging_are_refused() {
    let (p, _, _) = disk_images("llama", "demo_r8_rslora", &opts(8, 16));
    let cfg = config("llama");
    assert!(matches!(
        stage_adapter(&p, &cfg, &opts(4, 16), usize::MAX),
        Err(StageError::Rank { rank: 8, stride: 4, .. })
    ));
    let full = stage_adapter(&p, &cfg, &opts(8, 16), usize::MAX).unwrap().bytes.len();
    assert_eq!(
        stage_adapter(&p, &cfg, &opts(8, 16), full - 1).unwrap_err(),
        StageError::Budget {
            needed: full,
            budget: full - 1
        }
    );
    assert_eq!(stage_adapter(&p, &cfg, &opts(8, 16), full).unwrap().bytes.len(), full);
}

/// A tensor-parallel rank's staging lands as that rank's packed slot: the
/// cut of every pair is the rank's layout's, the one the disk swap packs.
#[test]
fn a_ranks_staging_lands_as_its_packed_slot() {
    let cfg = config("llama");
    for world in [2, 4] {
        for rank in 0..world {
            let placed = LoraOptions {
                placement: lora_layout::Placement::new(rank, world).unwrap(),
                ..opts(8, 16)
            };
            let (p, packed, _) = disk_images("llama", "dense_all_linear_f32", &placed);
            let layout = placed.slot_layout(&cfg).unwrap();
            let staging = stage_adapter(&p, &cfg, &placed, usize::MAX).unwrap();
            assert_eq!(
                land(&staging, &layout, packed.pairs()).as_bytes(),
                packed.as_bytes(),
                "rank {rank} of {world}"
            );
        }
    }
}
