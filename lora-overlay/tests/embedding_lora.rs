//! LoRA on the input embedding against PEFT itself: a pool whose slots have
//! the embedding place (`LoraOptions::embedding_lora`) serves the
//! embedding-LoRA fixtures beside a trainable-tokens adapter and the base
//! model in one mixed decode batch; each row, the overlay lookup then the
//! pool's embedding LoRA (PEFT's order), equals PEFT's merged row. The
//! probe through the pool equals PEFT and the pure host probe. CPU here;
//! the same body on CUDA.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::{
    CAPACITY, base_table, base_tables, fixtures, model_config, oracle, oracle_rows, rel_error, token_overlays,
};
use lora_audit::{OverlayModule, ProbeInputs, ROWS_MERGED, prepare_adapter, probe_adapter};
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{Device, RowsMut};
use lora_overlay::{TokenOverlays, probe_served_rows};
use lora_pool::{AdapterSource, LoraOptions, LoraPool, StepRow};

const MODEL: &str = "llama";
/// Slot k holds `ADAPTERS[k]`.
const ADAPTERS: [&str; 3] = [
    "embedding_lora",
    "embedding_lora_rslora_pattern",
    "trainable_tokens_untied_list",
];
const EMBED: &str = "model.embed_tokens.weight";

fn options() -> LoraOptions {
    LoraOptions {
        max_loras: 4,
        max_rank: 16,
        rotatable: true,
        embedding_lora: true,
        ..LoraOptions::default()
    }
}

fn pool(device: &Device) -> LoraPool<TokenOverlays> {
    let dirs: Vec<_> = ADAPTERS.iter().map(|a| fixtures().join(MODEL).join(a)).collect();
    let sources: Vec<AdapterSource<'_>> = ADAPTERS
        .iter()
        .zip(&dirs)
        .map(|(name, dir)| AdapterSource { name, dir })
        .collect();
    let overlays = token_overlays(device, MODEL, 4);
    LoraPool::load_with_companion(device, model_config(MODEL), options(), CAPACITY, &sources, overlays).unwrap()
}

/// PEFT's merged embedding row of `id` for adapter `k` (`None`: the base).
fn peft_row(k: Option<usize>, id: usize, hidden: usize) -> Vec<f32> {
    let tables = base_tables(MODEL);
    let base = base_table(&tables, OverlayModule::Embed);
    let base_row = || {
        base[id * hidden..(id + 1) * hidden]
            .iter()
            .map(|v| v.to_f32())
            .collect()
    };
    let Some(k) = k else {
        return base_row();
    };
    let (changed, merged) = oracle_rows(&oracle(MODEL, ADAPTERS[k]), OverlayModule::Embed);
    match changed.iter().position(|&c| c == id) {
        Some(r) => merged[r * hidden..(r + 1) * hidden].to_vec(),
        None => base_row(),
    }
}

fn mixed_batch(device: &Device) {
    let mut pool = pool(device);
    let cfg = pool.config().clone();
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let leases: Vec<_> = ADAPTERS.iter().map(|a| pool.acquire(a).unwrap()).collect();
    for (k, lease) in leases.iter().enumerate() {
        let has = pool.embedding_entry(lease.slot()).unwrap().rank > 0;
        assert_eq!(has, k < 2, "{}: embedding pair published", ADAPTERS[k]);
    }
    let mut rng = Rng::fresh("embedding_lora_mixed_batch");
    let n = 40;
    // Every adapter and the base model; ids include the trainable ones.
    let adapters: Vec<Option<usize>> = (0..n).map(|i| [Some(0), None, Some(1), Some(2)][i % 4]).collect();
    let ids: Vec<u32> = (0..n)
        .map(|i| {
            if i % 5 == 3 {
                [9u32, 2, 77][i % 3]
            } else {
                rng.below(vocab) as u32
            }
        })
        .collect();
    let rows: Vec<StepRow<'_>> = adapters
        .iter()
        .map(|a| a.map_or(StepRow::Base, |k| StepRow::Adapter(&leases[k])))
        .collect();
    let step = pool.decode_step(&rows, n).unwrap();
    let ids_dev = device.upload(&ids).unwrap();
    // The lookup with overlays (BF16 rows), then the embedding LoRA in f32.
    let mut looked_up = device.alloc_zeros::<half::bf16>(n * hidden).unwrap();
    pool.companion()
        .embed(
            &ids_dev,
            Some(pool.step_slots(&step).unwrap()),
            RowsMut::dense(&mut looked_up, n, hidden),
        )
        .unwrap();
    let rows_f32: Vec<f32> = looked_up.download().unwrap().iter().map(|v| v.to_f32()).collect();
    let mut out = device.upload(&rows_f32).unwrap();
    pool.apply_embedding(&step, &ids_dev, RowsMut::dense(&mut out, n, hidden))
        .unwrap();
    device.check_faults().unwrap();
    let got = out.download().unwrap();
    for (i, (&id, &k)) in ids.iter().zip(&adapters).enumerate() {
        let row = &got[i * hidden..(i + 1) * hidden];
        let want = peft_row(k, id as usize, hidden);
        if k.is_none_or(|k| k == 2) {
            // No embedding LoRA: the lookup's row untouched.
            assert_eq!(row, &rows_f32[i * hidden..(i + 1) * hidden], "row {i} ({k:?}) changed");
        }
        let err = rel_error(row, &want);
        assert!(
            err < 1e-2,
            "row {i} (adapter {k:?}, id {id}): relative error {err} against PEFT"
        );
    }
    // A stale step is refused.
    let _newer = pool.decode_step(&rows, n).unwrap();
    assert!(
        pool.apply_embedding(&step, &ids_dev, RowsMut::dense(&mut out, n, hidden))
            .is_err()
    );
}

fn probes(device: &Device) {
    let mut pool = pool(device);
    let cfg = pool.config().clone();
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let all: BTreeMap<String, Vec<i64>> = BTreeMap::from([(EMBED.to_string(), (0..vocab as i64).collect())]);
    for (k, adapter) in ADAPTERS.iter().enumerate() {
        let lease = pool.acquire(adapter).unwrap();
        let served = probe_served_rows(&mut pool, &lease, &all).unwrap();
        let got = &served[&format!("{ROWS_MERGED}{EMBED}")].data;
        let prepared = prepare_adapter(&fixtures().join(MODEL).join(adapter), &cfg, &options()).unwrap();
        let inputs = ProbeInputs {
            rows: all.clone(),
            ..ProbeInputs::default()
        };
        let pure = probe_adapter(&prepared, &cfg, &inputs, Some(&base_tables(MODEL))).unwrap();
        let err = rel_error(got, &pure.tensors[&format!("{ROWS_MERGED}{EMBED}")].data);
        assert!(err < 1e-6, "{adapter}: kernel path vs pure path {err}");
        for v in 0..vocab {
            let err = rel_error(&got[v * hidden..(v + 1) * hidden], &peft_row(Some(k), v, hidden));
            assert!(err < 1e-2, "{adapter} id {v}: relative error {err} against PEFT");
        }
    }
}

#[test]
fn mixed_batch_equals_peft_on_cpu() {
    mixed_batch(&Device::cpu());
}

#[test]
fn probes_equal_peft_and_the_pure_probe_on_cpu() {
    probes(&Device::cpu());
}

#[test]
fn a_pool_without_the_embedding_place_refuses_embedding_lora() {
    let device = Device::cpu();
    let overlays = token_overlays(&device, MODEL, 2);
    let opts = LoraOptions {
        embedding_lora: false,
        ..options()
    };
    let mut pool = LoraPool::with_companion(&device, model_config(MODEL), opts, CAPACITY, overlays, 0).unwrap();
    assert!(pool.embedding_table_offset().is_none());
    let err = pool
        .swap_from_disk(
            lora_pool::SlotId::new(0),
            "e",
            &fixtures().join(MODEL).join("embedding_lora"),
        )
        .unwrap_err();
    assert!(err.to_string().contains("REJECT[embedding-lora-disabled]"), "{err}");
    assert!(!pool.slots()[0].is_filled(), "nothing published");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_embedding_lora_equals_peft() {
    let Some(device) = cuda_or_skip("gpu_embedding_lora_equals_peft") else {
        return;
    };
    mixed_batch(&device);
    probes(&device);
}
