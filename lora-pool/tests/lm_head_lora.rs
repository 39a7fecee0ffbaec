//! LoRA on the output head through the pool: a pool whose slots have the
//! head place (`LoraOptions::lm_head_lora`) adds each row's head delta
//! `scale · B (A h)` over the whole vocabulary, in a mixed decode batch and
//! over prefill segments, against the f64 math of the prepared pair and
//! PEFT's own probe of the head's delta (`probe_out::lm_head.weight`);
//! other rows' logits stay bit-identical. CPU here; the same body on CUDA.

#![allow(clippy::unwrap_used)]

mod common;

use common::{dir, model_config, options, oracle, pool_with, rel_error, slot, to_bf16};
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{DecodeOptions, Device, Rows, RowsMut};
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool, PrefillSeq, StepRow};

/// Slot k holds `ADAPTERS[k]`: a head pair, then an adapter without one.
const ADAPTERS: [&str; 2] = ["lm_head_lora_no_table", "rslora"];
const HEAD: &str = "lm_head.weight";

fn head_options() -> LoraOptions {
    LoraOptions {
        lm_head_lora: true,
        ..options(4, 0)
    }
}

fn pool(device: &Device) -> LoraPool {
    let dirs: Vec<_> = ADAPTERS.iter().map(|a| dir(a)).collect();
    let sources: Vec<AdapterSource<'_>> = ADAPTERS
        .iter()
        .zip(&dirs)
        .map(|(name, dir)| AdapterSource { name, dir })
        .collect();
    let capacity = BatchCapacity {
        max_rows: 64,
        max_segments: 8,
    };
    LoraPool::load(device, model_config("llama"), head_options(), capacity, &sources).unwrap()
}

/// `y + scale · B (A x)` of the prepared head pair, f64, for one row.
fn reference_row(x: &[f32], y: &[f32]) -> Vec<f32> {
    let cfg = model_config("llama");
    let prepared = lora_audit::prepare_adapter(&dir(ADAPTERS[0]), &cfg, &head_options()).unwrap();
    let p = prepared.lm_head.unwrap();
    let (r, hidden) = (p.rank, cfg.hidden_size);
    let t: Vec<f64> = (0..r)
        .map(|k| {
            (0..hidden)
                .map(|i| f64::from(p.a[k * hidden + i].to_f32()) * f64::from(x[i]))
                .sum()
        })
        .collect();
    y.iter()
        .enumerate()
        .map(|(o, &base)| {
            let d: f64 = (0..r).map(|k| f64::from(p.b[o * r + k].to_f32()) * t[k]).sum();
            (f64::from(base) + f64::from(p.scale) * d) as f32
        })
        .collect()
}

/// Rows of slot 0 gain the head delta; rows of slot 1 (no head pair) and
/// base rows keep their logits bit for bit.
fn check_rows(
    label: &str,
    x: &[f32],
    y0: &[f32],
    got: &[f32],
    who: &[Option<usize>],
    (hidden, vocab): (usize, usize),
    tol: f64,
) {
    for (i, k) in who.iter().enumerate() {
        let row = &got[i * vocab..(i + 1) * vocab];
        let before = &y0[i * vocab..(i + 1) * vocab];
        if *k == Some(0) {
            let want = reference_row(&x[i * hidden..(i + 1) * hidden], before);
            let err = rel_error(row, &want);
            assert!(err < tol, "{label} row {i}: relative error {err}");
            assert_ne!(row, before, "{label} row {i}: no delta");
        } else {
            assert_eq!(row, before, "{label} row {i} ({k:?}) changed");
        }
    }
}

fn mixed_batches(device: &Device) {
    let mut pool = pool(device);
    let cfg = pool.config().clone();
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let leases: Vec<_> = ADAPTERS.iter().map(|a| pool.acquire(a).unwrap()).collect();
    assert!(pool.lm_head_entry(leases[0].slot()).unwrap().rank > 0);
    assert_eq!(pool.lm_head_entry(leases[1].slot()).unwrap().rank, 0);
    let mut rng = Rng::fresh("lm_head_lora_mixed_batches");
    let n = 24;
    let who: Vec<Option<usize>> = (0..n).map(|i| [Some(0), None, Some(1)][i % 3]).collect();
    // BF16-exact inputs, so the reference sees what the kernels see.
    let x: Vec<f32> = to_bf16(&(0..n * hidden).map(|_| rng.uniform() - 0.5).collect::<Vec<_>>())
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let y0: Vec<f32> = (0..n * vocab).map(|_| rng.uniform()).collect();
    let xb = device.upload(&to_bf16(&x)).unwrap();
    // Decode: every row its own slot.
    let rows: Vec<StepRow<'_>> = who
        .iter()
        .map(|k| k.map_or(StepRow::Base, |k| StepRow::Adapter(&leases[k])))
        .collect();
    let step = pool.decode_step(&rows, n).unwrap();
    let mut y = device.upload(&y0).unwrap();
    pool.apply_lm_head_decode(
        &step,
        Rows::dense(&xb, n, hidden),
        RowsMut::dense(&mut y, n, vocab),
        DecodeOptions::default(),
    )
    .unwrap();
    device.check_faults().unwrap();
    // The CPU reference accumulates in f32 as the f64 math up to rounding;
    // the CUDA kernels carry the rank vector in about 16 bits.
    let tol = if device.is_cuda() { 2e-3 } else { 1e-5 };
    check_rows("decode", &x, &y0, &y.download().unwrap(), &who, (hidden, vocab), tol);
    // Prefill: segments of 1-5 tokens, cycling through the same slots.
    let lens = [3usize, 5, 1, 4, 2, 5, 4];
    assert_eq!(lens.iter().sum::<usize>(), n);
    let seq_who: Vec<Option<usize>> = (0..lens.len()).map(|s| [Some(0), None, Some(1)][s % 3]).collect();
    let seqs: Vec<PrefillSeq<'_>> = lens
        .iter()
        .zip(&seq_who)
        .map(|(&len, k)| PrefillSeq {
            row: k.map_or(StepRow::Base, |k| StepRow::Adapter(&leases[k])),
            len,
        })
        .collect();
    let token_who: Vec<Option<usize>> = lens
        .iter()
        .zip(&seq_who)
        .flat_map(|(&len, &k)| std::iter::repeat_n(k, len))
        .collect();
    let step = pool.prefill_step(&seqs).unwrap();
    let mut y = device.upload(&y0).unwrap();
    pool.apply_lm_head_prefill(&step, Rows::dense(&xb, n, hidden), RowsMut::dense(&mut y, n, vocab))
        .unwrap();
    device.check_faults().unwrap();
    check_rows(
        "prefill",
        &x,
        &y0,
        &y.download().unwrap(),
        &token_who,
        (hidden, vocab),
        tol,
    );
    // x of the wrong width or row count is refused, naming the step.
    let err = pool
        .apply_lm_head_prefill(&step, Rows::dense(&xb, n - 1, hidden), RowsMut::dense(&mut y, n, vocab))
        .unwrap_err();
    assert!(err.to_string().contains("lm_head x"), "{err}");
}

/// The served delta of PEFT's own probe rows equals PEFT's
/// `probe_out::lm_head.weight` (each f32 row served as BF16 hi + lo).
fn peft_probe(device: &Device) {
    let mut pool = pool(device);
    let cfg = pool.config().clone();
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let lease = pool.acquire(ADAPTERS[0]).unwrap();
    let oracle = oracle("llama", ADAPTERS[0]);
    let x = &oracle.inputs.inputs[HEAD];
    let want = &oracle.expected[&format!("probe_out::{HEAD}")];
    let n = x.shape[0];
    let hi = to_bf16(&x.data);
    let lo: Vec<f32> = x.data.iter().zip(&hi).map(|(v, h)| v - h.to_f32()).collect();
    let xb = device.upload(&[hi, to_bf16(&lo)].concat()).unwrap();
    let step = pool.decode_step(&vec![StepRow::Adapter(&lease); 2 * n], 2 * n).unwrap();
    let mut y = device.alloc_zeros::<f32>(2 * n * vocab).unwrap();
    pool.apply_lm_head_decode(
        &step,
        Rows::dense(&xb, 2 * n, hidden),
        RowsMut::dense(&mut y, 2 * n, vocab),
        DecodeOptions::default(),
    )
    .unwrap();
    let y = y.download().unwrap();
    let got: Vec<f32> = y[..n * vocab].iter().zip(&y[n * vocab..]).map(|(a, b)| a + b).collect();
    let err = rel_error(&got, &want.data);
    assert!(err < 1e-2, "relative error {err} against PEFT");
}

#[test]
fn head_deltas_equal_the_pair_math_in_decode_and_prefill_on_cpu() {
    mixed_batches(&Device::cpu());
}

#[test]
fn head_delta_equals_peft_on_cpu() {
    peft_probe(&Device::cpu());
}

#[test]
fn a_pool_without_the_head_place_adds_nothing_and_refuses_head_lora() {
    let mut pool = pool_with(options(2, 0), &[("r", "rslora")]);
    assert!(pool.lm_head_table_offset().is_none() && pool.layout().lm_head().is_none());
    let device = pool.device().clone();
    let (vocab, hidden) = (pool.config().vocab_size, pool.config().hidden_size);
    let lease = pool.acquire("r").unwrap();
    let step = pool.decode_step(&[StepRow::Adapter(&lease)], 1).unwrap();
    let xb = device.upload(&vec![half::bf16::ONE; hidden]).unwrap();
    let y0 = vec![0.5f32; vocab];
    let mut y = device.upload(&y0).unwrap();
    pool.apply_lm_head_decode(
        &step,
        Rows::dense(&xb, 1, hidden),
        RowsMut::dense(&mut y, 1, vocab),
        DecodeOptions::default(),
    )
    .unwrap();
    assert_eq!(y.download().unwrap(), y0);
    drop(step);
    drop(lease);
    let err = pool
        .swap_from_disk(slot(1), "h", &dir("lm_head_lora_no_table"))
        .unwrap_err();
    assert!(err.to_string().contains("REJECT[lm-head-lora-disabled]"), "{err}");
    assert!(!pool.slots()[1].is_filled(), "nothing published");
}

#[test]
fn a_head_pair_is_promoted_from_the_host_tier_like_a_disk_swap() {
    let with_tier = |images: usize| {
        let opts = head_options();
        let bytes = opts.slot_layout(&model_config("llama")).unwrap().slot_bytes();
        LoraOptions {
            host_tier_bytes: images * bytes,
            ..opts
        }
    };
    let mut pool = pool_with(with_tier(2), &[]);
    let a = dir("lm_head_lora_no_table");
    pool.prefetch("a", &a).unwrap();
    pool.wait_for_prefetch();
    assert_eq!(pool.host_tier().unwrap().names, ["a"]);
    let report = pool.swap_from_disk(slot(1), "a", &a).unwrap();
    assert_eq!(report.route, lora_pool::SwapRoute::HostTier);
    let mut reference = pool_with(with_tier(0), &[]);
    reference.swap_from_disk(slot(1), "a", &a).unwrap();
    assert!(reference.lm_head_entry(slot(1)).unwrap().rank > 0);
    assert_eq!(common::snapshot(&pool), common::snapshot(&reference));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_lm_head_lora_equals_the_pair_math_and_peft() {
    let Some(device) = cuda_or_skip("gpu_lm_head_lora_equals_the_pair_math_and_peft") else {
        return;
    };
    mixed_batches(&device);
    peft_probe(&device);
}
