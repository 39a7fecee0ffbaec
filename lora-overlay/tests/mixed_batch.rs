//! A mixed batch through a real `LoraPool<TokenOverlays>`: rows of several
//! overlay adapters (trainable tokens, modules_to_save tables), of an
//! adapter without overlays and of the base model, one launch each for the
//! embedding lookup and the lm_head overlay (f32 and bf16 logits), over the
//! row map of the pool's decode step (each adapter row holding its lease).
//! Every row equals PEFT's merged table for the ids its adapter changed and
//! the base exactly for the rest; calls whose rows are not the step's, and
//! a step the pool has moved past, are refused. CPU here; the same body on
//! CUDA.

#![allow(clippy::unwrap_used)]

mod common;

use common::{
    OverriddenLogits, base_table, base_tables, logits, model_config, oracle, oracle_rows, pool, rel_error, widen,
};
use half::bf16;
use lora_audit::{Oracle, OverlayModule};
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{Device, OutputElem, Rows, RowsMut};
use lora_overlay::{OverlayError, TokenOverlays};
use lora_pool::{PoolError, SlotLease, StepKind, StepRow, StepSlots};

const MODEL: &str = "llama";
const ADAPTERS: [(&str, &str); 4] = [
    ("dict", "trainable_tokens_untied_dict"),
    ("saved", "modules_to_save_embed_lm_head"),
    ("list", "trainable_tokens_untied_list"),
    ("plain", "demo_r4_plain"),
];

/// The merged row PEFT serves for `id` in `module` under `oracle`, if its merge changed it.
fn merged_row(oracle: Option<&Oracle>, module: OverlayModule, id: usize, hidden: usize) -> Option<Vec<f32>> {
    let (changed, merged) = oracle_rows(oracle?, module);
    let k = changed.iter().position(|&c| c == id)?;
    Some(merged[k * hidden..(k + 1) * hidden].to_vec())
}

/// Run the lm_head overlay on base logits of type `Y` and check every row.
fn check_logits<Y: OutputElem + Into<f32> + PartialEq>(
    device: &Device,
    overlays: &TokenOverlays,
    row_slot: StepSlots<'_>,
    batch: &[(u32, i32)],
    oracles: &[Oracle],
    to_y: impl Fn(f32) -> Y,
    out_rel: f64,
) {
    let cfg = model_config(MODEL);
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let n = batch.len();
    let tables = base_tables(MODEL);
    let hidden_rows = Rng::new(0xba7c).bf16_vec(n * hidden, 1.0);
    let base: Vec<Y> = logits(
        &hidden_rows,
        base_table(&tables, OverlayModule::LmHead),
        n,
        vocab,
        hidden,
    )
    .into_iter()
    .map(&to_y)
    .collect();
    let hidden_dev = device.upload(&hidden_rows).unwrap();
    let mut logits_dev = device.upload(&base).unwrap();
    overlays
        .lm_head(
            Rows::dense(&hidden_dev, n, hidden),
            row_slot,
            RowsMut::dense(&mut logits_dev, n, vocab),
        )
        .unwrap();
    device.check_faults().unwrap();
    let got = logits_dev.download().unwrap();
    let mut per_slot: Vec<OverriddenLogits> = oracles.iter().map(|_| OverriddenLogits::default()).collect();
    for (i, &(_, slot)) in batch.iter().enumerate() {
        let oracle = usize::try_from(slot).ok().map(|s| &oracles[s]);
        let h = &hidden_rows[i * hidden..(i + 1) * hidden];
        for v in 0..vocab {
            let g = got[i * vocab + v];
            match merged_row(oracle, OverlayModule::LmHead, v, hidden) {
                Some(row) => per_slot[slot as usize].push(g.into(), h, &row),
                None => assert_eq!(
                    g,
                    base[i * vocab + v],
                    "row {i} (slot {slot}) id {v} keeps its base logit"
                ),
            }
        }
    }
    for (slot, logits) in per_slot.iter().enumerate() {
        logits.check(&format!("slot {slot} ({})", std::any::type_name::<Y>()), out_rel);
    }
}

fn mixed_batch(device: &Device) {
    let cfg = model_config(MODEL);
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let mut pool = pool(device, MODEL, ADAPTERS.len() + 1, &ADAPTERS);
    let oracles: Vec<Oracle> = ADAPTERS.iter().map(|(_, a)| oracle(MODEL, a)).collect();
    // Every id some adapter changes, plus ids none does, each under every slot and the base.
    let mut ids: Vec<usize> = vec![0, 100, 255];
    for o in &oracles {
        for module in [OverlayModule::Embed, OverlayModule::LmHead] {
            ids.extend(oracle_rows(o, module).0);
        }
    }
    ids.sort_unstable();
    ids.dedup();
    let slots: Vec<i32> = (-1..ADAPTERS.len() as i32).collect();
    let batch: Vec<(u32, i32)> = ids
        .iter()
        .flat_map(|&id| slots.iter().map(move |&s| (id as u32, s)))
        .collect();
    let n = batch.len();
    let (token_ids, row_slots): (Vec<u32>, Vec<i32>) = batch.iter().copied().unzip();
    // Adapter `s` is in slot `s`; each of its rows holds its lease.
    let leases: Vec<SlotLease> = ADAPTERS.iter().map(|(name, _)| pool.acquire(name).unwrap()).collect();
    for (s, lease) in leases.iter().enumerate() {
        assert_eq!(lease.slot().index(), s, "{}", ADAPTERS[s].0);
    }
    let rows: Vec<StepRow<'_>> = row_slots
        .iter()
        .map(|&s| usize::try_from(s).map_or(StepRow::Base, |s| StepRow::Adapter(&leases[s])))
        .collect();
    let step = pool.decode_step(&rows, n).unwrap();
    let overlays = pool.companion();
    let step_slots = pool.step_slots(&step).unwrap();
    assert_eq!(step_slots.rows(), n);

    let ids_dev = device.upload(&token_ids).unwrap();
    let mut out = device.alloc_zeros::<bf16>(n * hidden).unwrap();
    overlays
        .embed(&ids_dev, Some(step_slots), RowsMut::dense(&mut out, n, hidden))
        .unwrap();
    device.check_faults().unwrap();
    let out = widen(&out.download().unwrap());
    let tables = base_tables(MODEL);
    let embed = base_table(&tables, OverlayModule::Embed);
    for (i, &(id, slot)) in batch.iter().enumerate() {
        let id = id as usize;
        let row = &out[i * hidden..(i + 1) * hidden];
        let oracle = usize::try_from(slot).ok().map(|s| &oracles[s]);
        match merged_row(oracle, OverlayModule::Embed, id, hidden) {
            Some(merged) => {
                let err = rel_error(row, &merged);
                assert!(err < 1e-2, "row {i}: id {id} in slot {slot}: rel error {err}");
            }
            None => assert_eq!(
                row,
                widen(&embed[id * hidden..(id + 1) * hidden]),
                "row {i}: id {id} slot {slot}"
            ),
        }
    }
    assert!(vocab > 255);

    check_logits(device, overlays, step_slots, &batch, &oracles, |v| v, 0.0);
    check_logits(
        device,
        overlays,
        step_slots,
        &batch,
        &oracles,
        bf16::from_f32,
        2f64.powi(-8),
    );

    // The calls serve the step's rows, all of them: other row counts are
    // refused before launch, writing nothing.
    let short = n - 1;
    let mut out = device.upload(&vec![bf16::ONE; short * hidden]).unwrap();
    let r = overlays.embed(&ids_dev, Some(step_slots), RowsMut::dense(&mut out, short, hidden));
    assert!(matches!(r, Err(OverlayError::Argument { arg: "ids", .. })), "{r:?}");
    assert!(out.download().unwrap().iter().all(|v| *v == bf16::ONE));
    let hidden_dev = device.upload(&vec![bf16::ONE; short * hidden]).unwrap();
    let mut logits = device.upload(&vec![0.5f32; short * vocab]).unwrap();
    let r = overlays.lm_head(
        Rows::dense(&hidden_dev, short, hidden),
        step_slots,
        RowsMut::dense(&mut logits, short, vocab),
    );
    assert!(matches!(r, Err(OverlayError::Argument { arg: "hidden", .. })), "{r:?}");
    assert!(logits.download().unwrap().iter().all(|v| *v == 0.5));
    // A step the pool has moved past has no row map to hand out.
    let next = pool.decode_step(&[StepRow::Base], 1).unwrap();
    assert!(matches!(
        pool.step_slots(&step),
        Err(PoolError::StaleStep { kind: StepKind::Decode })
    ));
    assert_eq!(pool.step_slots(&next).unwrap().rows(), 1);
}

#[test]
fn a_mixed_batch_serves_each_row_its_adapters_tokens() {
    mixed_batch(&Device::cpu());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_a_mixed_batch_serves_each_row_its_adapters_tokens() {
    let Some(device) = cuda_or_skip("gpu_a_mixed_batch_serves_each_row_its_adapters_tokens") else {
        return;
    };
    mixed_batch(&device);
}
