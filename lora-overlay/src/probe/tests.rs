use std::sync::Arc;

use half::bf16;
use lora_audit::{HostOverlay, LmHeadOverlay as HostHead, TableOverlay};
use lora_kernels::Device;
use lora_kernels::testing::Rng;

use super::*;
use crate::served::{ServedHead, ServedTables};
use crate::test_support::{llama_like, random_untied_tables};

const HIDDEN: usize = 70; // more than one probe chunk

#[test]
fn served_rows_read_back_through_the_kernels_equal_the_compiled_overlay() {
    let vocab = 9;
    let dev = Device::cpu();
    let mut rng = Rng::new(21);
    let (embed, head, tables) = random_untied_tables(&dev, &mut rng, vocab, HIDDEN);
    let mut overlays = TokenOverlays::new(&dev, tables, 2).unwrap();
    let mut saved = head.clone();
    saved[7 * HIDDEN + 3] = bf16::from_f32(9.0);
    let host = HostOverlay {
        hidden: HIDDEN,
        embed: Some(TableOverlay {
            ids: vec![8, 2],
            rows: rng.bf16_vec(2 * HIDDEN, 1.0),
            table: None,
        }),
        lm_head: HostHead::Own(TableOverlay {
            ids: vec![1],
            rows: rng.bf16_vec(HIDDEN, 1.0),
            table: Some(saved),
        }),
    };
    let compiled_embed = host.embed.as_ref().unwrap().compile(&embed, vocab, HIDDEN).unwrap();
    let compiled_head = host.lm_head_table().unwrap().compile(&head, vocab, HIDDEN).unwrap();
    overlays.install(1, overlays.stage_overlay(&host).unwrap()).unwrap();
    let ids: Vec<u32> = (0..vocab as u32).rev().collect();
    for (module, base, compiled) in [
        (OverlayModule::Embed, &embed, &compiled_embed),
        (OverlayModule::LmHead, &head, &compiled_head),
    ] {
        let served = overlays.served_rows(Some(1), module, &ids).unwrap();
        let base_only = overlays.served_rows(None, module, &ids).unwrap();
        let empty_slot = overlays.served_rows(Some(0), module, &ids).unwrap();
        for (k, &id) in ids.iter().enumerate() {
            let id = id as usize;
            let row = &served[k * HIDDEN..(k + 1) * HIDDEN];
            assert_eq!(
                row,
                compiled.served_row(id, base, HIDDEN).unwrap(),
                "{module:?} id {id}"
            );
            assert_eq!(
                &base_only[k * HIDDEN..(k + 1) * HIDDEN],
                &base[id * HIDDEN..(id + 1) * HIDDEN]
            );
            assert_eq!(
                &empty_slot[k * HIDDEN..(k + 1) * HIDDEN],
                &base[id * HIDDEN..(id + 1) * HIDDEN]
            );
        }
    }
    assert_eq!(compiled_head.ids, [1, 7]);

    let cfg = llama_like(vocab, HIDDEN, false);
    let probes = BTreeMap::from([
        ("model.embed_tokens.weight".to_string(), vec![2i64, 3]),
        ("lm_head.weight".to_string(), vec![7i64]),
    ]);
    let out = probe_token_rows(&overlays, Some(1), &cfg, &probes).unwrap();
    let rows = &out["rows_merged::model.embed_tokens.weight"];
    assert_eq!(rows.shape, [2, HIDDEN]);
    let head_rows = &out["rows_merged::lm_head.weight"];
    let want: Vec<f32> = compiled_head.rows[HIDDEN..].iter().map(|v| v.to_f32()).collect();
    assert_eq!(head_rows.data, want);

    // Hostile probes are errors.
    assert!(matches!(
        overlays.served_rows(Some(2), OverlayModule::Embed, &[0]),
        Err(OverlayError::NoSuchSlot { slot: 2, .. })
    ));
    assert!(matches!(
        overlays.served_rows(Some(1), OverlayModule::LmHead, &[vocab as u32]),
        Err(OverlayError::Argument { arg: "ids", .. })
    ));
    for (table, ids) in [
        ("model.embed_tokens.weight", vec![-1i64]),
        ("model.layers.0.self_attn.q_proj.weight", vec![0]),
        ("nonsense", vec![0]),
    ] {
        let probes = BTreeMap::from([(table.to_string(), ids)]);
        let r = probe_token_rows(&overlays, Some(1), &cfg, &probes);
        assert!(matches!(r, Err(OverlayError::Probe { .. })), "{table}: {r:?}");
    }
}

#[test]
fn a_quantized_head_cannot_be_probed() {
    let dev = Device::cpu();
    let embed = Arc::new(dev.upload(&vec![bf16::ONE; 4 * HIDDEN]).unwrap());
    let tables = ServedTables::new(&dev, embed, ServedHead::Quantized, 4, HIDDEN).unwrap();
    let overlays = TokenOverlays::new(&dev, tables, 1).unwrap();
    assert!(matches!(
        overlays.served_rows(None, OverlayModule::LmHead, &[0]),
        Err(OverlayError::QuantizedHead { .. })
    ));
    assert_eq!(overlays.served_rows(None, OverlayModule::Embed, &[]).unwrap(), []);
}
