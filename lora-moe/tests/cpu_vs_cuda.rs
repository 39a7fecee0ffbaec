//! Random batches at production-like width (hidden 512, 16 experts, top-4,
//! three synthetic adapters of ranks 5, 8 and 16 written by the test and
//! loaded through the real audit and pool): the router, decode and sorted
//! folds against an f64 host reference computed from the audited pairs, by
//! one test body on the CPU reference and on CUDA; on CUDA the two backends
//! must also agree with each other, and a captured graph replayed on a new
//! batch must give what eager calls give.

#![allow(clippy::unwrap_used)]

mod common;

use common::synthetic;
use half::bf16;
use lora_audit::{PreparedAdapter, prepare_adapter};
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{Device, DeviceBuffer, Rows, RowsMut};
use lora_layout::{ExpertSite, ModelConfig};
use lora_moe::{ExpertTarget, MoeCapacity, MoeLora, SortedRouting, SortedRows};
use lora_pool::{LoraPool, PrefillSeq, SlotLease, StepRow};

/// The f64 reference: `scale · B (A x)` of each adapter's audited pair.
struct Reference {
    cfg: ModelConfig,
    adapters: Vec<PreparedAdapter>,
}

impl Reference {
    fn new(pool: &LoraPool, dirs: &[std::path::PathBuf]) -> Reference {
        let cfg = pool.config().clone();
        let adapters = dirs
            .iter()
            .map(|d| prepare_adapter(d, &cfg, pool.options()).unwrap())
            .collect();
        Reference { cfg, adapters }
    }

    /// Add slot `slot`'s delta at (layer, site) for input `x` to `y`.
    fn add(&self, slot: Option<usize>, layer: usize, site: ExpertSite, x: &[f32], y: &mut [f64]) {
        let Some(p) = slot.and_then(|s| self.adapters[s].expert_pair(layer, site)) else {
            return;
        };
        let inp = x.len();
        let t: Vec<f64> = (0..p.rank)
            .map(|k| {
                let a = &p.a[k * inp..(k + 1) * inp];
                a.iter()
                    .zip(x)
                    .map(|(a, x)| f64::from(a.to_f32()) * f64::from(*x))
                    .sum()
            })
            .collect();
        for (o, yo) in y.iter_mut().enumerate() {
            let b = &p.b[o * p.rank..(o + 1) * p.rank];
            let dot: f64 = b.iter().zip(&t).map(|(b, t)| f64::from(b.to_f32()) * t).sum();
            *yo += f64::from(p.scale) * dot;
        }
    }
}

/// Rows of random BF16 inputs, as the device sees them (f32 copies).
fn random_rows(rng: &mut Rng, rows: usize, width: usize) -> (Vec<bf16>, Vec<f32>) {
    let b = rng.bf16_vec(rows * width, 1.0);
    let f = b.iter().map(|v| v.to_f32()).collect();
    (b, f)
}

/// `n` distinct random experts of `num_experts`.
fn distinct(rng: &mut Rng, n: usize, num_experts: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let e = rng.below(num_experts);
        if !out.contains(&e) {
            out.push(e);
        }
    }
    out
}

/// Two leases per adapter, each taken by name: `k` and `n + k` hold
/// adapter `k` (in slot `k`), so a step often holds several leases of one
/// slot.
fn leases(pool: &LoraPool, names: &[&str]) -> Vec<SlotLease> {
    let leases: Vec<SlotLease> = names.iter().chain(names).map(|n| pool.acquire(n).unwrap()).collect();
    for (i, lease) in leases.iter().enumerate() {
        assert_eq!(lease.slot().index(), i % names.len(), "{}", names[i % names.len()]);
    }
    leases
}

/// A random request: the base model, or one of `leases` (of adapter
/// `i % (leases.len() / 2)`).
fn random_request<'l>(rng: &mut Rng, leases: &'l [SlotLease]) -> (StepRow<'l>, Option<usize>) {
    match rng.below(leases.len() + 1) {
        0 => (StepRow::Base, None),
        i => (StepRow::Adapter(&leases[i - 1]), Some((i - 1) % (leases.len() / 2))),
    }
}

/// What one run of the body produced, for comparing backends.
#[derive(Default)]
struct Outputs {
    tensors: Vec<(String, Vec<f32>)>,
}

/// Check `y` (f32, `[rows, width]`) against `y0 + expected`: relative error
/// below 1e-3 over the whole output, and rows without a delta untouched.
fn check(what: &str, y: &[f32], y0: &[f32], expected: &[f64], touched: &[bool], width: usize, out: &mut Outputs) {
    let delta: Vec<f32> = y.iter().zip(y0).map(|(a, b)| a - b).collect();
    let want_delta: Vec<f32> = expected.iter().map(|&d| d as f32).collect();
    let err = lora_kernels::testing::rel_error(&delta, &want_delta);
    assert!(err < 1e-3, "{what}: relative error {err}");
    for (r, &t) in touched.iter().enumerate() {
        if !t {
            assert_eq!(
                y[r * width..(r + 1) * width],
                y0[r * width..(r + 1) * width],
                "{what}: row {r} was written"
            );
        }
    }
    out.tensors.push((what.to_string(), y.to_vec()));
}

/// Fold `targets` over `x` (f32 copy `xf`) into a random `y0`, through
/// `apply`; check against the reference, where row `r` is token
/// `slot_of(r)`'s expert `expert_of(r)` (`None`: no delta).
#[allow(clippy::too_many_arguments)]
fn fold_and_check(
    what: &str,
    rng: &mut Rng,
    pool: &LoraPool,
    reference: &Reference,
    layer: usize,
    targets: &[ExpertTarget],
    rows: usize,
    row_of: &dyn Fn(usize) -> Option<(Option<usize>, usize)>,
    apply: &dyn Fn(Rows<'_, bf16>, RowsMut<'_, f32>),
    out: &mut Outputs,
) {
    let cfg = &reference.cfg;
    let (_, in_dim) = targets[0].proj.dims(cfg).unwrap();
    let width: usize = targets.iter().map(|t| t.proj.dims(cfg).unwrap().0).sum();
    let (xb, xf) = random_rows(rng, rows, in_dim);
    let y0: Vec<f32> = (0..rows * width).map(|_| rng.uniform()).collect();
    let mut expected = vec![0f64; rows * width];
    let mut touched = vec![false; rows];
    for r in 0..rows {
        let Some((slot, expert)) = row_of(r) else { continue };
        for t in targets {
            let out_dim = t.proj.dims(cfg).unwrap().0;
            let site = ExpertSite::Expert { expert, proj: t.proj };
            let x = &xf[r * in_dim..(r + 1) * in_dim];
            let y = &mut expected[r * width + t.y_col_offset..r * width + t.y_col_offset + out_dim];
            reference.add(slot, layer, site, x, y);
            touched[r] |= slot.is_some_and(|s| reference.adapters[s].expert_pair(layer, site).is_some());
        }
    }
    let device = pool.device();
    let x = device.upload(&xb).unwrap();
    let mut y = device.upload(&y0).unwrap();
    apply(Rows::dense(&x, rows, in_dim), RowsMut::dense(&mut y, rows, width));
    device.check_faults().unwrap();
    check(what, &y.download().unwrap(), &y0, &expected, &touched, width, out);
}

fn gate_up(cfg: &ModelConfig) -> Vec<ExpertTarget> {
    ExpertTarget::gate_up(cfg.moe.as_ref().unwrap().expert_intermediate_size).to_vec()
}

fn body(device: &Device, seed: u64) -> Outputs {
    let (mut pool, names, dirs, _tmp) = synthetic::load(device, "random");
    let reference = Reference::new(&pool, &dirs);
    let leases = leases(&pool, &names);
    let cfg = pool.config().clone();
    let moe_dims = cfg.moe.clone().unwrap();
    let (top_k, num_experts, hidden) = (moe_dims.top_k, moe_dims.num_experts, cfg.hidden_size);
    let mut rng = Rng::new(seed);
    let mut out = Outputs::default();
    let capacity = MoeCapacity {
        max_tokens: 512,
        max_sorted_rows: 512 * top_k + num_experts * 8,
    };
    let mut moe = MoeLora::new(&pool, capacity).unwrap();

    // Decode: 37 requests padded to 40.
    let (n, padded) = (37, 40);
    let (requests, slots): (Vec<StepRow<'_>>, Vec<Option<usize>>) =
        (0..n).map(|_| random_request(&mut rng, &leases)).unzip();
    let experts: Vec<Vec<usize>> = (0..padded).map(|_| distinct(&mut rng, top_k, num_experts)).collect();
    let topk: Vec<i32> = experts.iter().flatten().map(|&e| e as i32).collect();
    let topk_ids = device.upload(&topk).unwrap();
    let token_of = |t: usize| slots.get(t).copied().flatten();
    for layer in 0..cfg.num_hidden_layers {
        let step = pool.decode_step(&requests, padded).unwrap();
        moe.set_decode_step(&pool, &step).unwrap();
        // Router on f32 logits.
        let (xb, xf) = random_rows(&mut rng, padded, hidden);
        let y0: Vec<f32> = (0..padded * num_experts).map(|_| rng.uniform()).collect();
        let mut expected = vec![0f64; padded * num_experts];
        let mut touched = vec![false; padded];
        for t in 0..padded {
            let y = &mut expected[t * num_experts..(t + 1) * num_experts];
            reference.add(
                token_of(t),
                layer,
                ExpertSite::Router,
                &xf[t * hidden..(t + 1) * hidden],
                y,
            );
            touched[t] =
                token_of(t).is_some_and(|s| reference.adapters[s].expert_pair(layer, ExpertSite::Router).is_some());
        }
        let x = device.upload(&xb).unwrap();
        let mut y = device.upload(&y0).unwrap();
        moe.apply_router_lora(
            &pool,
            &step,
            layer,
            Rows::dense(&x, padded, hidden),
            RowsMut::dense(&mut y, padded, num_experts),
        )
        .unwrap();
        let what = format!("router layer {layer}");
        check(
            &what,
            &y.download().unwrap(),
            &y0,
            &expected,
            &touched,
            num_experts,
            &mut out,
        );

        moe.index_decode_rows(&pool, &step, &topk_ids).unwrap();
        let row_of = |r: usize| Some((token_of(r / top_k), experts[r / top_k][r % top_k]));
        for (name, targets) in [("gate_up", gate_up(&cfg)), ("down", ExpertTarget::down().to_vec())] {
            let what = format!("decode layer {layer} {name}");
            let apply = |x: Rows<'_, bf16>, y: RowsMut<'_, f32>| {
                moe.apply_expert_lora_decode(&pool, &step, layer, &targets, x, y)
                    .unwrap()
            };
            let rows = padded * top_k;
            fold_and_check(
                &what, &mut rng, &pool, &reference, layer, &targets, rows, &row_of, &apply, &mut out,
            );
        }
    }

    // Prefill: five sequences, 300 tokens; expert blocks padded to 8 rows.
    let lens = [1usize, 120, 7, 150, 22];
    let mut cu = vec![0usize];
    for l in lens {
        cu.push(cu.last().unwrap() + l);
    }
    let n_tokens = *cu.last().unwrap();
    let (seq_requests, seq_slots): (Vec<StepRow<'_>>, Vec<Option<usize>>) =
        lens.iter().map(|_| random_request(&mut rng, &leases)).unzip();
    let seqs: Vec<PrefillSeq<'_>> = seq_requests
        .iter()
        .zip(lens)
        .map(|(&row, len)| PrefillSeq { row, len })
        .collect();
    let slot_of_token = |t: usize| seq_slots[cu.iter().rposition(|&c| c <= t).unwrap().min(lens.len() - 1)];
    let experts: Vec<Vec<usize>> = (0..n_tokens).map(|_| distinct(&mut rng, top_k, num_experts)).collect();
    let topk: Vec<i32> = experts.iter().flatten().map(|&e| e as i32).collect();
    let sorted = SortedRouting::from_topk(&topk, top_k, num_experts).unwrap();
    let offsets = sorted.offsets();
    let mut sorted_token = Vec::new();
    let mut padded_offsets = vec![0i32];
    for e in 0..num_experts {
        sorted_token.extend_from_slice(&sorted.sorted_token[offsets[e]..offsets[e + 1]]);
        while !sorted_token.len().is_multiple_of(8) {
            sorted_token.push(-1);
        }
        padded_offsets.push(sorted_token.len() as i32);
    }
    let n_sorted = sorted_token.len();
    let st = device.upload(&sorted_token).unwrap();
    let off = device.upload(&padded_offsets).unwrap();
    let expert_of_row = |i: usize| padded_offsets.iter().rposition(|&o| o as usize <= i).unwrap();
    let row_of = |i: usize| {
        let src = usize::try_from(sorted_token[i]).ok()?;
        Some((slot_of_token(src / top_k), expert_of_row(i)))
    };
    for layer in 0..cfg.num_hidden_layers {
        let step = pool.prefill_step(&seqs).unwrap();
        assert_eq!(step.cu_seqlens(), cu);
        moe.set_prefill_step(&pool, &step).unwrap();
        let rows = SortedRows {
            sorted_token: &st,
            n_sorted,
            expert_offsets: &off,
        };
        moe.index_sorted_rows(&pool, &step, rows).unwrap();
        for (name, targets) in [("gate_up", gate_up(&cfg)), ("down", ExpertTarget::down().to_vec())] {
            let what = format!("sorted layer {layer} {name}");
            let apply = |x: Rows<'_, bf16>, y: RowsMut<'_, f32>| {
                moe.apply_expert_lora_sorted(&pool, &step, layer, &targets, x, y)
                    .unwrap()
            };
            fold_and_check(
                &what, &mut rng, &pool, &reference, layer, &targets, n_sorted, &row_of, &apply, &mut out,
            );
        }
    }
    out
}

#[test]
fn random_batches_match_the_host_reference_on_cpu() {
    body(&Device::cpu(), 0x00c0_ffee);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn random_batches_match_the_host_reference_and_the_cpu_on_cuda() {
    let Some(device) = cuda_or_skip("random_batches_match_the_host_reference_and_the_cpu_on_cuda") else {
        return;
    };
    let seed = Rng::fresh("cpu_vs_cuda").next_u64();
    let on_cuda = body(&device, seed);
    let on_cpu = body(&Device::cpu(), seed);
    assert_eq!(on_cuda.tensors.len(), on_cpu.tensors.len());
    for ((what, a), (_, b)) in on_cuda.tensors.iter().zip(&on_cpu.tensors) {
        let err = lora_kernels::testing::rel_error(a, b);
        assert!(err < 1e-4, "{what}: CUDA and CPU differ by {err}");
    }
}

/// Capture one layer's decode MoE LoRA work (router fold, index, gate_up
/// and down folds) in a CUDA graph, then change every buffer's contents
/// (new requests, routing, inputs) and replay: the graph must give what the
/// same calls give eagerly.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn a_captured_decode_layer_replays_new_batches_on_cuda() {
    let Some(device) = cuda_or_skip("a_captured_decode_layer_replays_new_batches_on_cuda") else {
        return;
    };
    let (mut pool, names, _, _tmp) = synthetic::load(&device, "graph");
    let leases = leases(&pool, &names);
    let cfg = pool.config().clone();
    let moe_dims = cfg.moe.clone().unwrap();
    let (top_k, num_experts, hidden, inter) = (
        moe_dims.top_k,
        moe_dims.num_experts,
        cfg.hidden_size,
        moe_dims.expert_intermediate_size,
    );
    let padded = 32;
    let rows = padded * top_k;
    let mut rng = Rng::fresh("graph");
    let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(padded, top_k)).unwrap();
    let zeros = |len: usize| device.alloc_zeros::<f32>(len).unwrap();
    let bufs = |rng: &mut Rng| -> (
        DeviceBuffer<i32>,
        DeviceBuffer<bf16>,
        DeviceBuffer<bf16>,
        DeviceBuffer<bf16>,
    ) {
        let topk: Vec<i32> = (0..padded)
            .flat_map(|_| distinct(rng, top_k, num_experts))
            .map(|e| e as i32)
            .collect();
        (
            device.upload(&topk).unwrap(),
            device.upload(&rng.bf16_vec(padded * hidden, 1.0)).unwrap(),
            device.upload(&rng.bf16_vec(rows * hidden, 1.0)).unwrap(),
            device.upload(&rng.bf16_vec(rows * inter, 1.0)).unwrap(),
        )
    };
    let batch = |rng: &mut Rng| -> Vec<StepRow<'_>> { (0..padded).map(|_| random_request(rng, &leases).0).collect() };
    let (topk_ids, router_in, x_gu, x_dn) = bufs(&mut rng);
    let (mut logits, mut y_gu, mut y_dn) = (
        zeros(padded * num_experts),
        zeros(rows * 2 * inter),
        zeros(rows * hidden),
    );
    let layer = 1;
    let (gu, dn) = (gate_up(&cfg), ExpertTarget::down());
    device.preload_kernels().unwrap();
    let first = pool.decode_step(&batch(&mut rng), padded).unwrap();
    moe.set_decode_step(&pool, &first).unwrap();
    let mut failure = None;
    let graph = device
        .capture_graph(|| {
            let mut step = || -> Result<(), lora_moe::MoeError> {
                moe.apply_router_lora(
                    &pool,
                    &first,
                    layer,
                    Rows::dense(&router_in, padded, hidden),
                    RowsMut::dense(&mut logits, padded, num_experts),
                )?;
                moe.index_decode_rows(&pool, &first, &topk_ids)?;
                moe.apply_expert_lora_decode(
                    &pool,
                    &first,
                    layer,
                    &gu,
                    Rows::dense(&x_gu, rows, hidden),
                    RowsMut::dense(&mut y_gu, rows, 2 * inter),
                )?;
                moe.apply_expert_lora_decode(
                    &pool,
                    &first,
                    layer,
                    &dn,
                    Rows::dense(&x_dn, rows, inter),
                    RowsMut::dense(&mut y_dn, rows, hidden),
                )
            };
            failure = step().err();
            Ok(())
        })
        .unwrap();
    assert!(failure.is_none(), "capture: {failure:?}");
    // A new batch in the same buffers, from the pool's next step.
    let second = pool.decode_step(&batch(&mut rng), padded).unwrap();
    moe.set_decode_step(&pool, &second).unwrap();
    let (t2, r2, g2, d2) = bufs(&mut rng);
    let (mut topk_ids, mut router_in, mut x_gu, mut x_dn) = (topk_ids, router_in, x_gu, x_dn);
    for (dst, src) in [(&mut router_in, &r2), (&mut x_gu, &g2), (&mut x_dn, &d2)] {
        dst.write(0, &src.download().unwrap()).unwrap();
    }
    topk_ids.write(0, &t2.download().unwrap()).unwrap();
    for buf in [&mut logits, &mut y_gu, &mut y_dn] {
        buf.zero_range(0, buf.len()).unwrap();
    }
    graph.replay().unwrap();
    device.synchronize().unwrap();
    device.check_faults().unwrap();
    let replayed = [
        logits.download().unwrap(),
        y_gu.download().unwrap(),
        y_dn.download().unwrap(),
    ];
    // The same batch, eagerly.
    let (mut l2, mut yg2, mut yd2) = (
        zeros(padded * num_experts),
        zeros(rows * 2 * inter),
        zeros(rows * hidden),
    );
    moe.apply_router_lora(
        &pool,
        &second,
        layer,
        Rows::dense(&r2, padded, hidden),
        RowsMut::dense(&mut l2, padded, num_experts),
    )
    .unwrap();
    moe.index_decode_rows(&pool, &second, &t2).unwrap();
    moe.apply_expert_lora_decode(
        &pool,
        &second,
        layer,
        &gu,
        Rows::dense(&g2, rows, hidden),
        RowsMut::dense(&mut yg2, rows, 2 * inter),
    )
    .unwrap();
    moe.apply_expert_lora_decode(
        &pool,
        &second,
        layer,
        &dn,
        Rows::dense(&d2, rows, inter),
        RowsMut::dense(&mut yd2, rows, hidden),
    )
    .unwrap();
    device.check_faults().unwrap();
    let eager = [l2.download().unwrap(), yg2.download().unwrap(), yd2.download().unwrap()];
    for (what, (a, b)) in ["router", "gate_up", "down"].iter().zip(replayed.iter().zip(&eager)) {
        assert!(b.iter().any(|v| *v != 0.0), "{what}: the new batch folds nothing");
        assert_eq!(a, b, "{what}: graph replay differs from eager calls");
    }
}
