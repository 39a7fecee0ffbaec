use std::sync::Arc;

use half::bf16;
use lora_audit::{CompiledOverlay, LmHeadOverlay as HostHead, TableOverlay};
use lora_kernels::testing::Rng;

use super::*;
use crate::served::ServedHead;
use crate::test_support::random_untied_tables;

const VOCAB: usize = 12;
const HIDDEN: usize = 8;

struct Setup {
    dev: Device,
    embed: Vec<bf16>,
    head: Vec<bf16>,
    overlays: TokenOverlays,
}

fn setup(max_loras: usize) -> Setup {
    let dev = Device::cpu();
    let (embed, head, tables) = random_untied_tables(&dev, &mut Rng::new(11), VOCAB, HIDDEN);
    let overlays = TokenOverlays::new(&dev, tables, max_loras).unwrap();
    Setup {
        dev,
        embed,
        head,
        overlays,
    }
}

/// A random overlay with trainable rows and a saved table on both tables.
fn random_host(rng: &mut Rng, s: &Setup) -> HostOverlay {
    let table = |rng: &mut Rng, base: &[bf16]| {
        let mut t = base.to_vec();
        t[rng.below(VOCAB) * HIDDEN + rng.below(HIDDEN)] = bf16::from_f32(7.0);
        let ids = vec![rng.below(VOCAB) as u32];
        TableOverlay {
            rows: rng.bf16_vec(HIDDEN, 1.0),
            ids,
            table: Some(t),
        }
    };
    HostOverlay {
        hidden: HIDDEN,
        embed: Some(table(rng, &s.embed)),
        lm_head: HostHead::Own(table(rng, &s.head)),
    }
}

#[test]
fn construction_checks_its_inputs() {
    let dev = Device::cpu();
    let embed = Arc::new(dev.upload(&[bf16::ZERO; VOCAB * HIDDEN]).unwrap());
    let tables = ServedTables::new(&dev, embed, ServedHead::SharesEmbedding, VOCAB, HIDDEN).unwrap();
    assert!(matches!(
        TokenOverlays::new(&dev, tables.clone(), 0),
        Err(OverlayError::NoSlots)
    ));
    assert!(matches!(
        TokenOverlays::new(&Device::cpu(), tables, 2),
        Err(OverlayError::DeviceMismatch { .. })
    ));
}

#[test]
fn commits_and_clears_change_entry_contents_never_addresses() {
    let mut s = setup(3);
    let addrs = (
        s.overlays.embed_entries().device_addr(),
        s.overlays.lm_head_entries().device_addr(),
    );
    assert!(!s.overlays.any_active());
    let mut rng = Rng::new(12);
    let staged = s.overlays.stage_overlay(&random_host(&mut rng, &s)).unwrap();
    assert!(!s.overlays.any_active(), "staging changes nothing live");
    let expected = staged.as_ref().map(|o| (o.embed_entry(), o.head_entry())).unwrap();
    s.overlays.install(1, staged).unwrap();
    assert!(s.overlays.any_active());
    let embed = s.overlays.embed_entries().download().unwrap();
    let head = s.overlays.lm_head_entries().download().unwrap();
    assert_eq!((embed[1], head[1]), expected);
    assert_eq!((embed[0], head[0]), Default::default());
    assert_eq!((embed[2], head[2]), Default::default());
    // A swap rewrites the entry to the new buffers.
    let staged = s.overlays.stage_overlay(&random_host(&mut rng, &s)).unwrap();
    let next = staged.as_ref().map(|o| (o.embed_entry(), o.head_entry())).unwrap();
    assert_ne!(next, expected);
    s.overlays.install(1, staged).unwrap();
    assert_eq!(s.overlays.embed_entries().download().unwrap()[1], next.0);
    s.overlays.install(1, None).unwrap();
    assert!(!s.overlays.any_active());
    assert!(s.overlays.slot(1).is_none());
    assert_eq!(s.overlays.embed_entries().download().unwrap()[1], Default::default());
    assert_eq!(s.overlays.lm_head_entries().download().unwrap()[1], Default::default());
    assert!(matches!(
        s.overlays.install(3, None),
        Err(OverlayError::NoSuchSlot { slot: 3, max_loras: 3 })
    ));
    assert_eq!(
        addrs,
        (
            s.overlays.embed_entries().device_addr(),
            s.overlays.lm_head_entries().device_addr()
        )
    );
}

#[test]
fn embed_and_lm_head_apply_each_rows_slot() {
    let mut s = setup(3);
    let mut rng = Rng::new(13);
    let mut compiled: Vec<(CompiledOverlay, CompiledOverlay)> = Vec::new();
    for slot in 0..2 {
        let host = random_host(&mut rng, &s);
        let embed = host.embed.as_ref().unwrap().compile(&s.embed, VOCAB, HIDDEN).unwrap();
        let head = host.lm_head_table().unwrap().compile(&s.head, VOCAB, HIDDEN).unwrap();
        compiled.push((embed, head));
        let staged = s.overlays.stage_overlay(&host).unwrap();
        s.overlays.install(slot, staged).unwrap();
    }
    // Every (id, slot) pair, slot 2 empty and -1 the base model, through the
    // raw row map (a pool step never names an empty slot; the public calls,
    // over a step's map, are checked with a real pool in tests/mixed_batch.rs).
    let (ids, slots): (Vec<u32>, Vec<i32>) = (0..VOCAB as u32).flat_map(|id| [-1, 0, 1, 2].map(|s| (id, s))).unzip();
    let n = ids.len();
    let ids_dev = s.dev.upload(&ids).unwrap();
    let slots_dev = s.dev.upload(&slots).unwrap();
    let mut out = s.dev.alloc_zeros::<bf16>(n * HIDDEN).unwrap();
    s.overlays
        .embed_rows(&ids_dev, Some(&slots_dev), RowsMut::dense(&mut out, n, HIDDEN))
        .unwrap();
    let out = out.download().unwrap();
    let hidden = rng.bf16_vec(n * HIDDEN, 1.0);
    let base_logits: Vec<f32> = (0..n * VOCAB).map(|_| rng.uniform()).collect();
    let hidden_dev = s.dev.upload(&hidden).unwrap();
    let mut logits = s.dev.upload(&base_logits).unwrap();
    s.overlays
        .lm_head_rows(
            Rows::dense(&hidden_dev, n, HIDDEN),
            &slots_dev,
            RowsMut::dense(&mut logits, n, VOCAB),
        )
        .unwrap();
    let logits = logits.download().unwrap();
    for (i, (&id, &slot)) in ids.iter().zip(&slots).enumerate() {
        let id = id as usize;
        let row = &out[i * HIDDEN..(i + 1) * HIDDEN];
        let overlay = usize::try_from(slot).ok().and_then(|s| compiled.get(s));
        let want = match overlay {
            Some((e, _)) => e.served_row(id, &s.embed, HIDDEN).unwrap(),
            None => &s.embed[id * HIDDEN..(id + 1) * HIDDEN],
        };
        assert_eq!(row, want, "row {i}: id {id} slot {slot}");
        let h = &hidden[i * HIDDEN..(i + 1) * HIDDEN];
        for v in 0..VOCAB {
            let got = logits[i * VOCAB + v];
            match overlay.and_then(|(_, head)| head.ids.iter().position(|&x| x as usize == v)) {
                Some(k) => {
                    let w = &overlay.unwrap().1.rows[k * HIDDEN..(k + 1) * HIDDEN];
                    let dot: f32 = w.iter().zip(h).map(|(a, b)| a.to_f32() * b.to_f32()).sum();
                    assert!(
                        (got - dot).abs() <= 1e-5 * (1.0 + dot.abs()),
                        "row {i} id {v}: {got} vs {dot}"
                    );
                }
                None => assert_eq!(got, base_logits[i * VOCAB + v], "row {i} id {v} untouched"),
            }
        }
    }
    // Arguments that do not fit are errors.
    let mut narrow = s.dev.alloc_zeros::<f32>(n * (VOCAB - 1)).unwrap();
    let r = s.overlays.lm_head_rows(
        Rows::dense(&hidden_dev, n, HIDDEN),
        &slots_dev,
        RowsMut::dense(&mut narrow, n, VOCAB - 1),
    );
    assert!(matches!(r, Err(OverlayError::Argument { arg: "logits", .. })), "{r:?}");
}

#[test]
fn an_overlay_staged_for_other_tables_is_not_installed() {
    let mut s = setup(2);
    let mut rng = Rng::new(14);
    let host = random_host(&mut rng, &s);
    // Same shapes on another device, and another vocabulary on this one.
    let other_dev = Device::cpu();
    let (_, _, other_tables) = random_untied_tables(&other_dev, &mut Rng::new(15), VOCAB, HIDDEN);
    let foreign = TokenOverlays::new(&other_dev, other_tables, 2).unwrap();
    let (_, _, bigger) = random_untied_tables(&s.dev, &mut Rng::new(16), VOCAB + 1, HIDDEN);
    let bigger = TokenOverlays::new(&s.dev, bigger, 2).unwrap();
    let wide_host = HostOverlay {
        embed: host.embed.as_ref().map(|t| TableOverlay {
            table: t
                .table
                .as_ref()
                .map(|_| vec![bf16::from_f32(3.0); (VOCAB + 1) * HIDDEN]),
            ..t.clone()
        }),
        lm_head: HostHead::None,
        ..host.clone()
    };
    for staged in [foreign.stage_overlay(&host), bigger.stage_overlay(&wide_host)] {
        let staged = staged.unwrap();
        assert!(staged.is_some());
        let r = s.overlays.install(0, staged);
        assert!(
            matches!(
                r,
                Err(OverlayError::Argument {
                    arg: "staged overlay",
                    ..
                })
            ),
            "{r:?}"
        );
        assert!(!s.overlays.any_active());
        assert_eq!(s.overlays.embed_entries().download().unwrap()[0], Default::default());
    }
}

#[test]
fn the_pool_sees_device_failures_typed_and_the_rest_as_companion_errors() {
    let e: PoolError = OverlayError::Kernel(lora_kernels::KernelError::OutOfMemory { requested: 9, free: 1 }).into();
    assert!(matches!(
        e,
        PoolError::Kernel(lora_kernels::KernelError::OutOfMemory { .. })
    ));
    let e: PoolError = OverlayError::NoSlots.into();
    assert!(
        matches!(
            e,
            PoolError::Companion {
                companion: COMPANION_NAME,
                ..
            }
        ),
        "{e}"
    );
}
