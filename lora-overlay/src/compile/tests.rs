use std::sync::Arc;

use half::bf16;
use lora_audit::{HostOverlay, LmHeadOverlay as HostHead, TableOverlay, id_in_vocab};
use lora_kernels::Device;
use lora_kernels::testing::Rng;
use proptest::prelude::*;

use super::*;
use crate::served::{ServedHead, ServedTables};

fn tables(dev: &Device, base: &[bf16], head: ServedHead, vocab: usize, hidden: usize) -> ServedTables {
    ServedTables::new(dev, Arc::new(dev.upload(base).unwrap()), head, vocab, hidden).unwrap()
}

/// A random overlay: trainable ids (unique, some past the vocabulary) with
/// rows, and optionally a saved table equal to `base` except for some rows.
fn random_overlay(rng: &mut Rng, base: &[bf16], vocab: usize, hidden: usize, with_table: bool) -> TableOverlay {
    let mut ids: Vec<u32> = (0..vocab as u32 + 3).filter(|_| rng.below(4) == 0).collect();
    // Config order is not id order.
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let rows = rng.bf16_vec(ids.len() * hidden, 1.0);
    let table = with_table.then(|| {
        let mut t = base.to_vec();
        for v in 0..vocab {
            if rng.below(3) == 0 {
                let j = rng.below(hidden);
                t[v * hidden + j] = bf16::from_f32(t[v * hidden + j].to_f32() + 0.5);
            }
        }
        t
    });
    TableOverlay { ids, rows, table }
}

/// The pure reference: lora-audit's host compile of the overlay clamped to the vocabulary.
fn reference(overlay: &TableOverlay, base: &[bf16], vocab: usize, hidden: usize) -> CompiledOverlay {
    let mut clamped = TableOverlay {
        ids: Vec::new(),
        rows: Vec::new(),
        table: overlay.table.clone(),
    };
    for (k, &id) in overlay.ids.iter().enumerate() {
        if id_in_vocab(id, vocab) {
            clamped.ids.push(id);
            clamped
                .rows
                .extend_from_slice(&overlay.rows[k * hidden..(k + 1) * hidden]);
        }
    }
    clamped.compile(base, vocab, hidden).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_device_compile_equals_the_host_reference(
        seed in any::<u64>(),
        vocab in 1usize..48,
        hidden in 1usize..20,
        with_table in any::<bool>(),
    ) {
        let mut rng = Rng::new(seed);
        let dev = Device::cpu();
        let base = rng.bf16_vec(vocab * hidden, 1.0);
        let overlay = random_overlay(&mut rng, &base, vocab, hidden, with_table);
        let base_dev = dev.upload(&base).unwrap();
        let got = compile_table(&dev, &overlay, Some(&base_dev), TableName::Embed, vocab, hidden).unwrap();
        prop_assert_eq!(&got, &reference(&overlay, &base, vocab, hidden));
        // Layout invariants: ascending unique ids, slot_map the inverse of ids.
        prop_assert!(got.ids.windows(2).all(|w| w[0] < w[1]));
        prop_assert_eq!(got.rows.len(), got.ids.len() * hidden);
        prop_assert_eq!(got.slot_map.len(), vocab);
        for (v, &m) in got.slot_map.iter().enumerate() {
            match got.ids.iter().position(|&id| id as usize == v) {
                Some(n) => prop_assert_eq!(m, n as i32),
                None => prop_assert_eq!(m, -1),
            }
        }
    }
}

#[test]
fn a_trainable_row_wins_over_a_differing_table_row() {
    let dev = Device::cpu();
    let (vocab, hidden) = (4, 2);
    let base = vec![bf16::ZERO; vocab * hidden];
    let mut table = base.clone();
    table[2 * hidden] = bf16::ONE;
    table[3 * hidden] = bf16::ONE;
    let overlay = TableOverlay {
        ids: vec![3],
        rows: vec![bf16::from_f32(5.0); hidden],
        table: Some(table),
    };
    let base_dev = dev.upload(&base).unwrap();
    let got = compile_table(&dev, &overlay, Some(&base_dev), TableName::Embed, vocab, hidden).unwrap();
    assert_eq!(got, reference(&overlay, &base, vocab, hidden));
    assert_eq!(got.ids, [2, 3]);
    assert_eq!(got.slot_map, [-1, -1, 0, 1]);
    assert_eq!(got.rows[2..], [bf16::from_f32(5.0); 2]);
}

#[test]
fn bad_overlays_are_errors_not_panics() {
    let dev = Device::cpu();
    let (vocab, hidden) = (4, 2);
    let base = dev.upload(&vec![bf16::ZERO; vocab * hidden]).unwrap();
    let short_rows = TableOverlay {
        ids: vec![1, 2],
        rows: vec![bf16::ONE; 3],
        table: None,
    };
    let r = compile_table(&dev, &short_rows, Some(&base), TableName::Embed, vocab, hidden);
    assert!(
        matches!(r, Err(OverlayError::RowCount { rows: 3, ids: 2, .. })),
        "{r:?}"
    );
    let short_table = TableOverlay {
        ids: vec![],
        rows: vec![],
        table: Some(vec![bf16::ONE; 7]),
    };
    let r = compile_table(&dev, &short_table, Some(&base), TableName::LmHead, vocab, hidden);
    assert!(matches!(r, Err(OverlayError::TableSize { len: 7, .. })), "{r:?}");
    let table = TableOverlay {
        ids: vec![],
        rows: vec![],
        table: Some(vec![bf16::ONE; 8]),
    };
    let r = compile_table(&dev, &table, None, TableName::LmHead, vocab, hidden);
    assert!(matches!(r, Err(OverlayError::QuantizedHead { .. })), "{r:?}");
}

#[test]
fn a_tied_head_with_trainable_tokens_points_at_the_embed_rows() {
    let dev = Device::cpu();
    let (vocab, hidden) = (6, 3);
    let base = Rng::new(1).bf16_vec(vocab * hidden, 1.0);
    let t = tables(&dev, &base, ServedHead::SharesEmbedding, vocab, hidden);
    let host = HostOverlay {
        hidden,
        embed: Some(TableOverlay {
            ids: vec![4, 1],
            rows: Rng::new(2).bf16_vec(2 * hidden, 1.0),
            table: None,
        }),
        lm_head: HostHead::TiedTrainableRows,
    };
    let slot = build_overlay(&dev, &t, &host).unwrap().unwrap();
    assert!(matches!(slot.head(), HeadRows::SharesEmbed));
    let (e, h) = (slot.embed_entry(), slot.head_entry());
    let embed = slot.embed().unwrap();
    assert_eq!(embed.overrides().ids(), [1, 4]);
    assert_eq!((h.rows, h.count), (e.rows, 2));
    assert_eq!(h.ids, embed.overrides().ids_dev().device_addr());
    assert_eq!(e.slot_map, embed.slot_map().device_addr());
    assert_eq!(slot.head_ids(), [1, 4]);
}

#[test]
fn an_untied_head_gets_rows_of_its_own() {
    let dev = Device::cpu();
    let (vocab, hidden) = (6, 3);
    let base = Rng::new(3).bf16_vec(vocab * hidden, 1.0);
    let head = Arc::new(dev.upload(&Rng::new(4).bf16_vec(vocab * hidden, 1.0)).unwrap());
    let t = tables(&dev, &base, ServedHead::Own(head), vocab, hidden);
    let trainable = |ids: Vec<u32>, seed| TableOverlay {
        rows: Rng::new(seed).bf16_vec(ids.len() * hidden, 1.0),
        ids,
        table: None,
    };
    let host = HostOverlay {
        hidden,
        embed: Some(trainable(vec![2], 5)),
        lm_head: HostHead::Own(trainable(vec![5, 0], 6)),
    };
    let slot = build_overlay(&dev, &t, &host).unwrap().unwrap();
    let HeadRows::Own(own) = slot.head() else {
        panic!("expected own head rows, got {:?}", slot.head());
    };
    assert_eq!(own.ids(), [0, 5]);
    assert_eq!(slot.head_entry().rows, own.rows().device_addr());
    assert_ne!(slot.head_entry().rows, slot.embed_entry().rows);
    // A head-only overlay has no embed entry.
    let head_only = HostOverlay {
        hidden,
        embed: None,
        lm_head: HostHead::Own(trainable(vec![1], 7)),
    };
    let slot = build_overlay(&dev, &t, &head_only).unwrap().unwrap();
    assert_eq!(slot.embed_entry(), EmbedOverlayEntry::default());
    assert_eq!(slot.head_entry().count, 1);
}

#[test]
fn a_table_equal_to_the_base_overrides_nothing() {
    let dev = Device::cpu();
    let (vocab, hidden) = (5, 2);
    let base = Rng::new(8).bf16_vec(vocab * hidden, 1.0);
    let t = tables(&dev, &base, ServedHead::SharesEmbedding, vocab, hidden);
    let host = HostOverlay {
        hidden,
        embed: Some(TableOverlay {
            ids: vec![],
            rows: vec![],
            table: Some(base.clone()),
        }),
        lm_head: HostHead::None,
    };
    assert!(build_overlay(&dev, &t, &host).unwrap().is_none());
    assert!(build_overlay(&dev, &t, &HostOverlay::none(hidden)).unwrap().is_none());
    let wide = HostOverlay { hidden: 3, ..host };
    assert!(matches!(
        build_overlay(&dev, &t, &wide),
        Err(OverlayError::Hidden { got: 3, hidden: 2 })
    ));
}

#[test]
fn a_quantized_head_serves_trainable_rows_and_refuses_a_saved_table() {
    let dev = Device::cpu();
    let (vocab, hidden) = (4, 2);
    let base = Rng::new(9).bf16_vec(vocab * hidden, 1.0);
    let t = tables(&dev, &base, ServedHead::Quantized, vocab, hidden);
    let rows = TableOverlay {
        ids: vec![3],
        rows: vec![bf16::ONE; hidden],
        table: None,
    };
    let host = HostOverlay {
        hidden,
        embed: None,
        lm_head: HostHead::Own(rows.clone()),
    };
    assert_eq!(build_overlay(&dev, &t, &host).unwrap().unwrap().head_ids(), [3]);
    let saved = HostOverlay {
        lm_head: HostHead::Own(TableOverlay {
            table: Some(vec![bf16::ONE; vocab * hidden]),
            ..rows
        }),
        ..host
    };
    assert!(matches!(
        build_overlay(&dev, &t, &saved),
        Err(OverlayError::QuantizedHead { .. })
    ));
}
