//! End to end on real PEFT fixtures: load four adapters into a pool, run a
//! mixed decode batch and a mixed prefill through every adapted (layer,
//! module), and compare each row's delta with its adapter's PEFT oracle. Runs
//! on the CPU backend (CI) and on CUDA when present (GPU bundle).

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use common::{model_config, oracle, rel_error, to_bf16};
use lora_audit::Oracle;
use lora_audit::{WeightRef, parse_weight_name};
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::ModelConfig;
use lora_pool::{
    AdapterSource, BatchCapacity, FusedTargets, LoraOptions, LoraPool, PrefillSeq, RowSlot, SlotLease, Step, StepRow,
};

const MODEL: &str = "llama";
const ADAPTERS: [&str; 4] = [
    "demo_r4_plain",
    "demo_r8_rslora",
    "demo_r16_alpha_pattern",
    "rank_alpha_pattern",
];

fn options() -> LoraOptions {
    LoraOptions {
        max_loras: 6,
        max_rank: 16,
        rotatable: true,
        ..LoraOptions::default()
    }
}

fn load(device: &Device) -> (LoraPool, Vec<Oracle>) {
    let root = common::fixtures().join(MODEL);
    let dirs: Vec<_> = ADAPTERS.iter().map(|a| root.join(a)).collect();
    let sources: Vec<_> = ADAPTERS
        .iter()
        .zip(&dirs)
        .map(|(name, dir)| AdapterSource { name, dir })
        .collect();
    let pool = LoraPool::load(
        device,
        model_config(MODEL),
        options(),
        BatchCapacity::default(),
        &sources,
    )
    .unwrap();
    let oracles = ADAPTERS.iter().map(|a| oracle(MODEL, a)).collect();
    (pool, oracles)
}

/// Every dense weight any adapter changes, with its (layer, module).
fn weights(cfg: &ModelConfig, oracles: &[Oracle]) -> Vec<(String, usize, lora_layout::LoraModule)> {
    let names: BTreeSet<&String> = oracles.iter().flat_map(|o| o.inputs.inputs.keys()).collect();
    names
        .into_iter()
        .map(|w| match parse_weight_name(w, cfg).unwrap() {
            WeightRef::Dense { layer, module } => (w.clone(), layer, module),
            other => panic!("{w}: unexpected {other:?}"),
        })
        .collect()
}

/// A row's expected delta (`None`: exactly zero).
type Expected = Option<Vec<f32>>;

/// One batch for weight `w`: for each adapter, its 4 probe rows (or 4 random
/// rows when it leaves `w` alone: their delta must be exactly 0), then 3
/// random rows of the base model. Returns x, per-row adapter (its index in
/// `oracles`; `None`: the base model), the expected delta rows (`None`:
/// exactly zero).
fn batch(
    rng: &mut Rng,
    w: &str,
    in_dim: usize,
    out_dim: usize,
    oracles: &[Oracle],
) -> (Vec<f32>, Vec<Option<usize>>, Vec<Expected>) {
    let mut x = Vec::new();
    let mut adapters = Vec::new();
    let mut expected = Vec::new();
    for (k, o) in oracles.iter().enumerate() {
        match (o.inputs.inputs.get(w), o.expected.get(&format!("probe_out::{w}"))) {
            (Some(pin), Some(pout)) => {
                assert_eq!(pin.shape, [4, in_dim]);
                assert_eq!(pout.shape, [4, out_dim]);
                x.extend_from_slice(&pin.data);
                for r in 0..4 {
                    expected.push(Some(pout.data[r * out_dim..(r + 1) * out_dim].to_vec()));
                }
            }
            _ => {
                x.extend((0..4 * in_dim).map(|_| rng.uniform() * 2.0 - 1.0));
                expected.extend(std::iter::repeat_n(None, 4));
            }
        }
        adapters.extend([Some(k); 4]);
    }
    x.extend((0..3 * in_dim).map(|_| rng.uniform() * 2.0 - 1.0));
    adapters.extend([None; 3]);
    expected.extend(std::iter::repeat_n(None, 3));
    (x, adapters, expected)
}

fn check_rows(w: &str, y: &[f32], y0: &[f32], out_dim: usize, expected: &[Expected], rows: &[RowSlot]) {
    for (r, want) in expected.iter().enumerate() {
        let delta: Vec<f32> = (0..out_dim).map(|c| y[r * out_dim + c] - y0[r * out_dim + c]).collect();
        match want {
            Some(reference) => {
                let err = rel_error(&delta, reference);
                assert!(err < 1e-2, "{w} row {r} ({:?}): relative error {err}", rows[r]);
            }
            None => assert!(
                delta.iter().all(|d| *d == 0.0),
                "{w} row {r} ({:?}) must be untouched",
                rows[r]
            ),
        }
    }
}

enum Mode {
    Decode,
    Prefill,
}

/// The step row of each batch row: its adapter's lease, or the base model.
fn step_rows<'l>(adapters: &[Option<usize>], leases: &'l [SlotLease]) -> Vec<StepRow<'l>> {
    adapters
        .iter()
        .map(|a| a.map_or(StepRow::Base, |k| StepRow::Adapter(&leases[k])))
        .collect()
}

fn run(device: &Device, mode: Mode) {
    let (mut pool, oracles) = load(device);
    let cfg = pool.config().clone();
    let leases: Vec<SlotLease> = ADAPTERS.iter().map(|a| pool.acquire(a).unwrap()).collect();
    let mut rng = Rng::fresh("serve_fixtures");
    for (w, layer, module) in weights(&cfg, &oracles) {
        let (out_dim, in_dim) = module.dims(&cfg);
        let (x, adapters, expected) = batch(&mut rng, &w, in_dim, out_dim, &oracles);
        let n = adapters.len();
        let y0: Vec<f32> = (0..n * out_dim).map(|_| rng.uniform() - 0.5).collect();
        let xb = device.upload(&to_bf16(&x)).unwrap();
        let mut yb = device.upload(&y0).unwrap();
        let target = FusedTargets::single(&cfg, module);
        let rows = step_rows(&adapters, &leases);
        let want: Vec<RowSlot> = adapters
            .iter()
            .map(|a| a.map_or(RowSlot::Base, |k| RowSlot::Slot(leases[k].slot())))
            .collect();
        match mode {
            Mode::Decode => {
                let step = pool.decode_step(&rows, n).unwrap();
                assert_eq!(step.requests(), want.as_slice());
                pool.apply_decode(
                    &step,
                    layer,
                    &target,
                    Rows::dense(&xb, n, in_dim),
                    RowsMut::dense(&mut yb, n, out_dim),
                )
                .unwrap();
            }
            Mode::Prefill => {
                // One segment per adapter (4 rows) and one of the base model.
                let seqs: Vec<PrefillSeq<'_>> = rows
                    .chunks(4)
                    .map(|c| PrefillSeq {
                        row: c[0],
                        len: c.len(),
                    })
                    .collect();
                let step = pool.prefill_step(&seqs).unwrap();
                let seg_want: Vec<RowSlot> = want.chunks(4).map(|c| c[0]).collect();
                assert_eq!(step.requests(), seg_want.as_slice());
                assert_eq!(step.kernel_rows(), n);
                pool.apply_prefill(
                    &step,
                    layer,
                    &target,
                    Rows::dense(&xb, n, in_dim),
                    RowsMut::dense(&mut yb, n, out_dim),
                )
                .unwrap();
            }
        }
        device.check_faults().unwrap();
        let y = yb.download().unwrap();
        check_rows(&w, &y, &y0, out_dim, &expected, &want);
    }
}

#[test]
fn mixed_decode_matches_the_peft_oracle_on_cpu() {
    run(&Device::cpu(), Mode::Decode);
}

#[test]
fn mixed_prefill_matches_the_peft_oracle_on_cpu() {
    run(&Device::cpu(), Mode::Prefill);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn mixed_decode_matches_the_peft_oracle_on_cuda() {
    if let Some(device) = cuda_or_skip("mixed_decode_matches_the_peft_oracle_on_cuda") {
        run(&device, Mode::Decode);
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn mixed_prefill_matches_the_peft_oracle_on_cuda() {
    if let Some(device) = cuda_or_skip("mixed_prefill_matches_the_peft_oracle_on_cuda") {
        run(&device, Mode::Prefill);
    }
}
