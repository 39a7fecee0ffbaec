//! Token overlays against PEFT itself: for every trainable-tokens and
//! modules_to_save fixture (tied and untied heads), the embedding rows and
//! lm_head logits a `LoraPool<TokenOverlays>` serves through the overlay
//! kernels equal PEFT's merged tables (BF16 tolerance) for the ids PEFT
//! changed, and the base exactly for every other id. The kernel-path probe
//! also equals the pure host probe of `lora-audit` bit for bit. CPU here;
//! the same body on CUDA.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::{
    OVERLAY_FIXTURES, OVERLAY_MODULES, OverriddenLogits, base_table, base_tables, fixtures, logits, model_config,
    options, oracle, oracle_rows, pool, rel_error, table_name, to_bf16, widen,
};
use lora_audit::{OverlayModule, ProbeInputs, ROWS_MERGED, prepare_adapter, probe_adapter};
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{Device, Rows, RowsMut};
use lora_overlay::probe_token_rows;
use lora_pool::{SlotId, StepRow};

/// One fixture, served from slot 1 of a two-slot pool (slot 0 empty).
fn check_fixture(device: &Device, model: &str, adapter: &str) {
    let what = format!("{model}/{adapter} on {}", device.name());
    let cfg = model_config(model);
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let mut pool = pool(device, model, 2, &[]);
    pool.swap_from_disk(SlotId::new(1), "a", &fixtures().join(model).join(adapter))
        .unwrap();
    let lease = pool.acquire("a").unwrap();
    assert_eq!(lease.slot(), SlotId::new(1));
    // The decode rows: slot 1's adapter, or the base model (-1).
    let row_slots = [1, -1, 1, 1, -1, 1];
    let n = row_slots.len();
    let rows = row_slots.map(|s| {
        if s == 1 {
            StepRow::Adapter(&lease)
        } else {
            StepRow::Base
        }
    });
    let step = pool.decode_step(&rows, n).unwrap();
    let overlays = pool.companion();
    let slot = overlays.slot(1).unwrap();
    let peft = oracle(model, adapter);
    let tables = base_tables(model);
    assert!(
        !oracle_rows(&peft, OverlayModule::Embed).0.is_empty(),
        "{what}: every overlay fixture changes embedding rows"
    );

    // Rows: every id of both tables, through the kernels.
    let all: Vec<i64> = (0..vocab as i64).collect();
    let probes: BTreeMap<String, Vec<i64>> = OVERLAY_MODULES
        .iter()
        .map(|&m| (table_name(m).to_string(), all.clone()))
        .collect();
    let served = probe_token_rows(overlays, Some(1), &cfg, &probes).unwrap();
    let prepared = prepare_adapter(&fixtures().join(model).join(adapter), &cfg, &options(2)).unwrap();
    let inputs = ProbeInputs {
        rows: probes,
        ..ProbeInputs::default()
    };
    let pure = probe_adapter(&prepared, &cfg, &inputs, Some(&tables)).unwrap();
    for module in OVERLAY_MODULES {
        let key = format!("{ROWS_MERGED}{}", table_name(module));
        let got = &served[&key].data;
        assert_eq!(
            got, &pure.tensors[&key].data,
            "{what} {module:?}: kernel path != pure path"
        );
        let (changed, merged) = oracle_rows(&peft, module);
        let base = base_table(&tables, module);
        for v in 0..vocab {
            let row = &got[v * hidden..(v + 1) * hidden];
            match changed.iter().position(|&c| c == v) {
                Some(k) => {
                    let merged = &merged[k * hidden..(k + 1) * hidden];
                    let err = rel_error(row, merged);
                    assert!(
                        err < 1e-2,
                        "{what} {module:?} id {v}: rel error {err} against PEFT's merged row"
                    );
                    // The adapter stores PEFT's rows in F32: served in BF16, they are PEFT's rows rounded once.
                    assert_eq!(
                        row,
                        widen(&to_bf16(merged)),
                        "{what} {module:?} id {v}: not bf16(merged)"
                    );
                }
                None => assert_eq!(
                    row,
                    widen(&base[v * hidden..(v + 1) * hidden]),
                    "{what} {module:?} id {v}"
                ),
            }
        }
        let overridden = match module {
            OverlayModule::Embed => slot.embed().map_or(&[][..], |e| e.overrides().ids()),
            OverlayModule::LmHead => slot.head_ids(),
        };
        assert!(
            overridden.iter().all(|&id| changed.contains(&(id as usize))),
            "{what} {module:?}: overrides {overridden:?}, PEFT changed {changed:?}"
        );
        assert_eq!(overridden.is_empty(), changed.is_empty(), "{what} {module:?}");
    }

    // Logits: base head GEMM, then the overlay on the rows of slot 1.
    let hidden_rows = Rng::new(0x10a7).bf16_vec(n * hidden, 1.0);
    let head = base_table(&tables, OverlayModule::LmHead);
    let base_logits = logits(&hidden_rows, head, n, vocab, hidden);
    let hidden_dev = device.upload(&hidden_rows).unwrap();
    let mut logits_dev = device.upload(&base_logits).unwrap();
    overlays
        .lm_head(
            Rows::dense(&hidden_dev, n, hidden),
            pool.step_slots(&step).unwrap(),
            RowsMut::dense(&mut logits_dev, n, vocab),
        )
        .unwrap();
    device.check_faults().unwrap();
    let got = logits_dev.download().unwrap();
    let (changed, merged) = oracle_rows(&peft, OverlayModule::LmHead);
    let mut overridden = OverriddenLogits::default();
    for (i, slot) in row_slots.into_iter().enumerate() {
        let h = &hidden_rows[i * hidden..(i + 1) * hidden];
        for v in 0..vocab {
            let (g, b) = (got[i * vocab + v], base_logits[i * vocab + v]);
            match changed.iter().position(|&c| c == v).filter(|_| slot == 1) {
                Some(k) => overridden.push(g, h, &merged[k * hidden..(k + 1) * hidden]),
                None => assert_eq!(g, b, "{what}: row {i} (slot {slot}) id {v} must keep its base logit"),
            }
        }
    }
    overridden.check(&what, 0.0);
}

#[test]
fn served_rows_and_logits_equal_pefts_merged_tables() {
    for (model, adapter) in OVERLAY_FIXTURES {
        check_fixture(&Device::cpu(), model, adapter);
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_served_rows_and_logits_equal_pefts_merged_tables() {
    let Some(device) = cuda_or_skip("gpu_served_rows_and_logits_equal_pefts_merged_tables") else {
        return;
    };
    for (model, adapter) in OVERLAY_FIXTURES {
        check_fixture(&device, model, adapter);
    }
}
