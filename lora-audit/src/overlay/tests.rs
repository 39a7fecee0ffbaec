use super::*;
use proptest::prelude::*;

fn bf(values: &[f32]) -> Vec<bf16> {
    values.iter().copied().map(bf16::from_f32).collect()
}

#[test]
fn overlay_keys_of_every_form() {
    use OverlayModule::{Embed, LmHead};
    use OverlayTensorKind::*;
    for (key, module, kind) in [
        (
            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta",
            Embed,
            TrainableDelta,
        ),
        (
            "base_model.model.lm_head.token_adapter.trainable_tokens_delta",
            LmHead,
            TrainableDelta,
        ),
        (
            "base_model.model.model.embed_tokens.token_adapter.base_layer.weight",
            Embed,
            TokenAdapterBase,
        ),
        ("base_model.model.model.embed_tokens.weight", Embed, FullTable),
        ("base_model.model.lm_head.weight", LmHead, FullTable),
        ("model.language_model.embed_tokens.weight", Embed, FullTable),
        (
            "base_model.model.model.embed_tokens.lora_embedding_A",
            Embed,
            LoraEmbeddingA,
        ),
        (
            "base_model.model.model.embed_tokens.lora_embedding_B",
            Embed,
            LoraEmbeddingB,
        ),
        (
            "base_model.model.model.embed_tokens.base_layer.weight",
            Embed,
            EmbeddingBaseCopy,
        ),
        // The head's table saved beside a LoRA on lm_head.
        ("base_model.model.lm_head.base_layer.weight", LmHead, EmbeddingBaseCopy),
    ] {
        assert_eq!(classify_overlay_key(key), Some(OverlayTensor { module, kind }), "{key}");
    }
    for key in [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.lm_head.lora_embedding_A",
        "base_model.model.model.norm.weight",
        "base_model.model.model.my_embed_tokens.weight",
        "embed_tokens",
    ] {
        assert_eq!(classify_overlay_key(key), None, "{key}");
    }
}

#[test]
fn each_role_is_set_at_most_once() {
    let mut t = OverlayTensors::default();
    let table = OverlayTensor {
        module: OverlayModule::Embed,
        kind: OverlayTensorKind::FullTable,
    };
    t.insert("base_model.model.model.embed_tokens.weight", table).unwrap();
    let dup = t.insert("model.embed_tokens.weight", table).unwrap_err();
    assert_eq!(dup.code, RejectCode::DuplicateTensor);
    assert_eq!(dup.subject, "model.embed_tokens.weight");
    let base = OverlayTensor {
        module: OverlayModule::Embed,
        kind: OverlayTensorKind::TokenAdapterBase,
    };
    let both = t.insert(
        "base_model.model.model.embed_tokens.token_adapter.base_layer.weight",
        base,
    );
    assert_eq!(both.unwrap_err().code, RejectCode::DuplicateTensor);
}

#[test]
fn embedding_lora_tensors_take_their_roles() {
    let mut t = OverlayTensors::default();
    for key in [
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "base_model.model.model.embed_tokens.lora_embedding_B",
        "base_model.model.model.embed_tokens.base_layer.weight",
    ] {
        t.insert(key, classify_overlay_key(key).unwrap()).unwrap();
    }
    assert_eq!(
        t.embed.lora_a.as_deref(),
        Some("base_model.model.model.embed_tokens.lora_embedding_A")
    );
    assert_eq!(
        t.embed.lora_b.as_deref(),
        Some("base_model.model.model.embed_tokens.lora_embedding_B")
    );
    // The saved base copy is the table's full copy, like a modules_to_save table.
    assert_eq!(
        t.embed.base_table(),
        Some("base_model.model.model.embed_tokens.base_layer.weight")
    );
    let table = "base_model.model.model.embed_tokens.weight";
    let dup = t.insert(table, classify_overlay_key(table).unwrap()).unwrap_err();
    assert_eq!(dup.code, RejectCode::DuplicateTensor);
}

#[test]
fn row_diff_is_exact_in_bf16() {
    let base = bf(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let mut adapter = base.clone();
    assert_eq!(row_diff_bf16(&base, &adapter, 2), [false, false, false]);
    // The smallest BF16 step of one element is a difference.
    adapter[3] = bf16::from_bits(adapter[3].to_bits() + 1);
    assert_eq!(row_diff_bf16(&base, &adapter, 2), [false, true, false]);
    adapter[4] = bf16::NAN;
    assert_eq!(row_diff_bf16(&base, &adapter, 2), [false, true, true]);
    // -0 and +0 are the same value.
    assert_eq!(row_diff_bf16(&bf(&[0.0]), &bf(&[-0.0]), 1), [false]);
}

#[test]
fn trainable_ids_are_clamped_keeping_order() {
    assert_eq!(
        clamp_trainable_to_vocab(&[5, 300, 2, 256, 255], 256),
        (vec![5, 2, 255], 2)
    );
    assert_eq!(clamp_trainable_to_vocab(&[], 8), (vec![], 0));
}

#[test]
fn override_set_is_sorted_and_unique() {
    let diff = [false, true, false, true, false];
    assert_eq!(build_override_set(&diff, &[4, 1, 0]), [0, 1, 3, 4]);
    assert_eq!(build_override_set(&[], &[9, 9, 2]), [2, 9]);
}

#[test]
fn a_trainable_row_wins_over_a_table_row() {
    assert_eq!(override_source(7, &[3, 7, 9]), Some(1));
    assert_eq!(override_source(4, &[3, 7, 9]), None);
    assert_eq!(
        override_source(3, &[3, 5, 3]),
        Some(2),
        "the last write wins, as in index_copy"
    );
}

#[test]
fn compile_builds_rows_and_slot_map() {
    let (vocab, hidden) = (4, 2);
    let base = bf(&[0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    let mut table = base.clone();
    table[2] = bf16::from_f32(10.0); // row 1 differs
    table[6] = bf16::from_f32(30.0); // row 3 differs, but is trainable
    let overlay = TableOverlay {
        ids: vec![3, 0],
        rows: bf(&[33.0, 33.0, 0.5, 0.5]),
        table: Some(table.clone()),
    };
    let c = overlay.compile(&base, vocab, hidden).unwrap();
    assert_eq!(c.ids, [0, 1, 3]);
    assert_eq!(c.slot_map, [0, 1, -1, 2]);
    assert_eq!(c.rows[0..2], overlay.rows[2..4]); // id 0: delta row 1
    assert_eq!(c.rows[2..4], table[2..4]); // id 1: table row
    assert_eq!(c.rows[4..6], overlay.rows[0..2]); // id 3: delta row 0 wins
    assert_eq!(c.served_row(2, &base, hidden), Some(&base[4..6]));
    assert_eq!(c.served_row(4, &base, hidden), None);
}

#[test]
fn compile_checks_every_size() {
    let base = bf(&[0.0; 8]);
    let ok = TableOverlay {
        ids: vec![1],
        rows: bf(&[1.0, 1.0]),
        table: None,
    };
    assert!(ok.compile(&base, 4, 2).is_ok());
    assert!(matches!(ok.compile(&base, 3, 2), Err(OverlayError::TableSize { .. })));
    let short_rows = TableOverlay {
        rows: bf(&[1.0]),
        ..ok.clone()
    };
    assert!(matches!(
        short_rows.compile(&base, 4, 2),
        Err(OverlayError::RowCount { .. })
    ));
    let outside = TableOverlay {
        ids: vec![4],
        ..ok.clone()
    };
    assert!(matches!(
        outside.compile(&base, 4, 2),
        Err(OverlayError::IdOutOfVocab { id: 4, .. })
    ));
    let short_table = TableOverlay {
        table: Some(bf(&[0.0; 6])),
        ..ok
    };
    assert!(matches!(
        short_table.compile(&base, 4, 2),
        Err(OverlayError::TableSize { .. })
    ));
}

#[test]
fn a_tied_head_takes_the_embed_trainable_rows_only() {
    let embed = TableOverlay {
        ids: vec![2],
        rows: bf(&[1.0, 2.0]),
        table: Some(bf(&[0.0; 8])),
    };
    let overlay = HostOverlay {
        hidden: 2,
        embed: Some(embed.clone()),
        lm_head: LmHeadOverlay::TiedTrainableRows,
    };
    let head = overlay.lm_head_table().unwrap();
    assert_eq!(
        (head.ids.as_slice(), head.rows.as_slice()),
        (&embed.ids[..], &embed.rows[..])
    );
    assert_eq!(head.table, None);
    assert!(HostOverlay::none(2).lm_head_table().is_none());
}

fn overlay_case() -> impl Strategy<Value = (usize, usize, Vec<f32>, Vec<f32>, Vec<u32>)> {
    (1usize..12, 1usize..4).prop_flat_map(|(vocab, hidden)| {
        let n = vocab * hidden;
        (
            Just(vocab),
            Just(hidden),
            prop::collection::vec(-2.0f32..2.0, n),
            prop::collection::vec(prop_oneof![Just(None), (-2.0f32..2.0).prop_map(Some)], n),
            prop::collection::vec(0..vocab as u32, 0..vocab),
        )
            .prop_map(|(v, h, base, edits, ids)| {
                // The adapter table equals the base except where an edit is drawn.
                let table = base.iter().zip(&edits).map(|(b, e)| e.unwrap_or(*b)).collect();
                (v, h, base, table, ids)
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn compiled_overlays_serve_the_right_row_for_every_id((vocab, hidden, base, table, ids) in overlay_case()) {
        let base = bf(&base);
        let table = bf(&table);
        let rows: Vec<bf16> = (0..ids.len() * hidden).map(|i| bf16::from_f32(100.0 + i as f32)).collect();
        let overlay = TableOverlay { ids: ids.clone(), rows: rows.clone(), table: Some(table.clone()) };
        let c = overlay.compile(&base, vocab, hidden).unwrap();
        prop_assert!(c.ids.windows(2).all(|w| w[0] < w[1]));
        prop_assert_eq!(c.rows.len(), c.ids.len() * hidden);
        let diff = row_diff_bf16(&base, &table, hidden);
        for id in 0..vocab {
            let served = c.served_row(id, &base, hidden).unwrap();
            let want = match override_source(id as u32, &ids) {
                Some(k) => &rows[k * hidden..(k + 1) * hidden],
                None if diff[id] => &table[id * hidden..(id + 1) * hidden],
                None => &base[id * hidden..(id + 1) * hidden],
            };
            prop_assert_eq!(served, want);
            prop_assert_eq!(c.slot_map[id] >= 0, c.ids.contains(&(id as u32)));
        }
    }
}
