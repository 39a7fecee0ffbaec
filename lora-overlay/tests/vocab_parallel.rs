//! Token overlays under the vocab-parallel cut (`Placement::vocab_parallel`):
//! for every trainable-tokens and modules_to_save fixture (tied and untied
//! heads) and world sizes 1, 2 and 4, each rank's overlays are staged over
//! its rows of the served tables (`ServedTables::upload_at`); a rank serves
//! the embedding row of a token of its block (overlay or base) and a zero
//! row for any other token, so the ranks' rows summed equal the unsharded
//! overlays' rows for every id; and each rank's head overlay writes its
//! logit columns, which side by side in rank order equal the unsharded
//! logits. CPU here; the same body on CUDA.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::{
    CAPACITY, OVERLAY_FIXTURES, OVERLAY_MODULES, base_table, base_tables, fixtures, logits, model_config, table_name,
};
use lora_audit::{OverlayModule, ROWS_MERGED};
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::Placement;
use lora_overlay::{ServedTables, TokenOverlays, probe_token_rows};
use lora_pool::{AdapterSource, LoraOptions, LoraPool, SlotId, StepRow};

const ROWS: usize = 4;

/// One rank's served rows of every id of both tables, and the logits its
/// head overlay writes onto its base logit columns for `ROWS` fixed hidden
/// rows of the adapter's slot.
fn rank_answers(device: &Device, model: &str, adapter: &str, p: Placement) -> (BTreeMap<String, Vec<f32>>, Vec<f32>) {
    let cfg = model_config(model);
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let tables = base_tables(model);
    let served = ServedTables::upload_at(device, &tables, &cfg, p).unwrap();
    let held = p.vocab_range(vocab).unwrap();
    assert_eq!(served.held(), held, "{p:?}");
    let overlays = TokenOverlays::new(device, served, 2).unwrap();
    let opts = LoraOptions {
        max_loras: 2,
        max_rank: 16,
        rotatable: true,
        placement: p,
        ..LoraOptions::default()
    };
    let dir = fixtures().join(model).join(adapter);
    let sources = [AdapterSource {
        name: "a",
        dir: dir.as_path(),
    }];
    let mut pool = LoraPool::load_with_companion(device, cfg.clone(), opts, CAPACITY, &sources, overlays).unwrap();
    pool.swap_from_disk(SlotId::new(1), "b", &dir).unwrap();
    let lease = pool.acquire("b").unwrap();
    let overlays = pool.companion();
    // An overlay holds only the rank's ids (table rows of its block).
    let slot = overlays.slot(1);
    for ids in [
        slot.and_then(|s| s.embed()).map_or(&[][..], |e| e.overrides().ids()),
        slot.map_or(&[][..], |s| s.head_ids()),
    ] {
        assert!(ids.iter().all(|&i| (i as usize) < held.len()), "{p:?}: {ids:?}");
    }
    let all: Vec<i64> = (0..vocab as i64).collect();
    let probes: BTreeMap<String, Vec<i64>> = OVERLAY_MODULES
        .iter()
        .map(|&m| (table_name(m).to_string(), all.clone()))
        .collect();
    let rows = probe_token_rows(overlays, Some(1), &cfg, &probes)
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.data))
        .collect();
    // The rank's base logit columns, then its head overlay.
    let step = pool.decode_step(&[StepRow::Adapter(&lease); ROWS], ROWS).unwrap();
    let hidden_rows = Rng::new(0x70cab).bf16_vec(ROWS * hidden, 1.0);
    let head = base_table(&tables, OverlayModule::LmHead);
    let part = held.len();
    let base = logits(
        &hidden_rows,
        &head[held.start * hidden..held.end * hidden],
        ROWS,
        part,
        hidden,
    );
    let hidden_dev = device.upload(&hidden_rows).unwrap();
    let mut logits_dev = device.upload(&base).unwrap();
    pool.companion()
        .lm_head(
            Rows::dense(&hidden_dev, ROWS, hidden),
            pool.step_slots(&step).unwrap(),
            RowsMut::dense(&mut logits_dev, ROWS, part),
        )
        .unwrap();
    device.check_faults().unwrap();
    (rows, logits_dev.download().unwrap())
}

fn ranks_reassemble(device: &Device) {
    for (model, adapter) in OVERLAY_FIXTURES {
        let cfg = model_config(model);
        let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
        let (whole_rows, whole_logits) = rank_answers(device, model, adapter, Placement::SINGLE);
        for world in [1usize, 2, 4] {
            let what = format!("{model}/{adapter} x{world} on {}", device.name());
            let part = vocab / world;
            let mut sums: BTreeMap<String, Vec<f32>> = BTreeMap::new();
            let mut logits = vec![0f32; ROWS * vocab];
            for p in Placement::new(0, world).unwrap().with_vocab_parallel(true).ranks() {
                let held = p.vocab_range(vocab).unwrap();
                let (rows, rank_logits) = rank_answers(device, model, adapter, p);
                for (key, data) in rows {
                    for v in (0..vocab).filter(|v| !held.contains(v)) {
                        assert!(
                            data[v * hidden..(v + 1) * hidden].iter().all(|&x| x == 0.0),
                            "{what} rank {} {key}: id {v} is another rank's",
                            p.tp_rank()
                        );
                    }
                    let sum = sums.entry(key).or_insert_with(|| vec![0.0; vocab * hidden]);
                    sum.iter_mut().zip(&data).for_each(|(s, x)| *s += x);
                }
                for t in 0..ROWS {
                    logits[t * vocab + held.start..t * vocab + held.end]
                        .copy_from_slice(&rank_logits[t * part..(t + 1) * part]);
                }
            }
            for module in OVERLAY_MODULES {
                let key = format!("{ROWS_MERGED}{}", table_name(module));
                assert_eq!(sums[&key], whole_rows[&key], "{what} {module:?}: ranks summed");
            }
            assert_eq!(logits, whole_logits, "{what}: logit columns side by side");
        }
    }
}

#[test]
fn vocab_parallel_overlay_ranks_reassemble_the_unsharded_rows_and_logits() {
    ranks_reassemble(&Device::cpu());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_vocab_parallel_overlay_ranks_reassemble_the_unsharded_rows_and_logits() {
    let Some(device) = cuda_or_skip("gpu_vocab_parallel_overlay_ranks_reassemble_the_unsharded_rows_and_logits") else {
        return;
    };
    ranks_reassemble(&device);
}
