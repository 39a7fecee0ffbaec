//! Property: for any batch (requests of any adapter or none, any routing,
//! any block padding of the sort), the sorted prefill fold and the decode
//! fold give every expanded row the same delta, and the router fold is the
//! same whichever way the batch was set. Qwen3-MoE fixture pool (four
//! adapters, both expert formats' 5.x forms), CPU reference.

#![allow(clippy::unwrap_used)]

mod common;

use std::cell::RefCell;

use common::{load_model, to_bf16};
use half::bf16;
use lora_kernels::testing::Rng;
use lora_kernels::{Device, DeviceBuffer, Rows, RowsMut};
use lora_moe::{ExpertTarget, MoeCapacity, MoeLora, SortedRouting, SortedRows};
use lora_pool::{LoraPool, PrefillSeq, SlotLease, Step, StepRow};
use proptest::prelude::*;

/// A random batch: per token, its request (0 = base, `s + 1` = slot `s`),
/// a seed for its experts, and per expert the sort's padding rows.
fn batches() -> impl Strategy<Value = (Vec<(usize, u64)>, Vec<usize>, u64)> {
    (
        proptest::collection::vec((0usize..6, any::<u64>()), 1..12),
        proptest::collection::vec(0usize..3, 4),
        any::<u64>(),
    )
}

fn topk_of(seeds: &[(usize, u64)], top_k: usize, num_experts: usize) -> Vec<i32> {
    seeds
        .iter()
        .flat_map(|&(_, seed)| {
            let mut rng = Rng::new(seed);
            let mut experts: Vec<i32> = (0..num_experts as i32).collect();
            for i in (1..experts.len()).rev() {
                experts.swap(i, rng.below(i + 1));
            }
            experts.truncate(top_k);
            experts
        })
        .collect()
}

/// The router deltas of the batch set from `step` on `n` rows `x`.
fn router<S: Step>(
    pool: &LoraPool,
    moe: &MoeLora,
    step: &S,
    layer: usize,
    x: &DeviceBuffer<bf16>,
    n: usize,
) -> Vec<f32> {
    let (hidden, num_experts) = (
        pool.config().hidden_size,
        pool.config().moe.as_ref().unwrap().num_experts,
    );
    let mut logits = pool.device().alloc_zeros::<f32>(n * num_experts).unwrap();
    moe.apply_router_lora(
        pool,
        step,
        layer,
        Rows::dense(x, n, hidden),
        RowsMut::dense(&mut logits, n, num_experts),
    )
    .unwrap();
    logits.download().unwrap()
}

/// The decode fold's and the sorted fold's deltas, per expanded row, for
/// gate_up at `layer`, and the router deltas after each way of setting the
/// batch. `leases[s]` is the lease of slot `s`'s adapter.
#[allow(clippy::type_complexity)]
fn both_paths(
    pool: &mut LoraPool,
    leases: &[SlotLease],
    moe: &mut MoeLora,
    layer: usize,
    batch: &(Vec<(usize, u64)>, Vec<usize>, u64),
) -> ((Vec<f32>, Vec<f32>), (Vec<f32>, Vec<f32>)) {
    let (tokens, padding, seed) = batch;
    let cfg = pool.config().clone();
    let device = pool.device().clone();
    let moe_dims = cfg.moe.as_ref().unwrap();
    let (top_k, num_experts, hidden) = (moe_dims.top_k, moe_dims.num_experts, cfg.hidden_size);
    let width = 2 * moe_dims.expert_intermediate_size;
    let targets = ExpertTarget::gate_up(moe_dims.expert_intermediate_size);
    let requests: Vec<StepRow<'_>> = tokens
        .iter()
        .map(|&(r, _)| {
            if r == 0 {
                StepRow::Base
            } else {
                StepRow::Adapter(&leases[(r - 1) % 4])
            }
        })
        .collect();
    let n = tokens.len();
    let rows = n * top_k;
    let topk = topk_of(tokens, top_k, num_experts);
    let mut rng = Rng::new(*seed);
    let x: Vec<bf16> = to_bf16(&(0..rows * hidden).map(|_| rng.uniform()).collect::<Vec<_>>());
    let router_x = device.upload(&x[..n * hidden]).unwrap();

    // Decode: one token per request.
    let step = pool.decode_step(&requests, n).unwrap();
    moe.set_decode_step(pool, &step).unwrap();
    let router_decode = router(pool, moe, &step, layer, &router_x, n);
    let xb = device.upload(&x).unwrap();
    let mut y = device.alloc_zeros::<f32>(rows * width).unwrap();
    moe.index_decode_rows(pool, &step, &device.upload(&topk).unwrap())
        .unwrap();
    moe.apply_expert_lora_decode(
        pool,
        &step,
        layer,
        &targets,
        Rows::dense(&xb, rows, hidden),
        RowsMut::dense(&mut y, rows, width),
    )
    .unwrap();
    let decode = y.download().unwrap();

    // Prefill: every token its own sequence; rows sorted by expert, padded.
    let cu: Vec<usize> = (0..=n).collect();
    let seqs: Vec<PrefillSeq<'_>> = requests.iter().map(|&row| PrefillSeq { row, len: 1 }).collect();
    let step = pool.prefill_step(&seqs).unwrap();
    assert_eq!(step.cu_seqlens(), cu);
    moe.set_prefill_step(pool, &step).unwrap();
    let router_prefill = router(pool, moe, &step, layer, &router_x, n);
    let sorted = SortedRouting::from_topk(&topk, top_k, num_experts).unwrap();
    let offsets = sorted.offsets();
    let mut sorted_token = Vec::new();
    let mut padded_offsets = vec![0i32];
    for e in 0..num_experts {
        sorted_token.extend_from_slice(&sorted.sorted_token[offsets[e]..offsets[e + 1]]);
        sorted_token.extend(std::iter::repeat_n(rows as i32 + 3, padding[e]));
        padded_offsets.push(sorted_token.len() as i32);
    }
    let n_sorted = sorted_token.len();
    let x_sorted: Vec<bf16> = sorted_token
        .iter()
        .flat_map(|&src| {
            let src = (src as usize).min(rows - 1);
            x[src * hidden..(src + 1) * hidden].to_vec()
        })
        .collect();
    let xs = device.upload(&x_sorted).unwrap();
    let mut ys = device.alloc_zeros::<f32>(n_sorted * width).unwrap();
    let st = device.upload(&sorted_token).unwrap();
    let off = device.upload(&padded_offsets).unwrap();
    moe.index_sorted_rows(
        pool,
        &step,
        SortedRows {
            sorted_token: &st,
            n_sorted,
            expert_offsets: &off,
        },
    )
    .unwrap();
    moe.apply_expert_lora_sorted(
        pool,
        &step,
        layer,
        &targets,
        Rows::dense(&xs, n_sorted, hidden),
        RowsMut::dense(&mut ys, n_sorted, width),
    )
    .unwrap();
    let ys = ys.download().unwrap();
    // Back to expanded order; padding rows must have stayed zero.
    let mut unsorted = vec![f32::NAN; rows * width];
    for (i, &src) in sorted_token.iter().enumerate() {
        let row = &ys[i * width..(i + 1) * width];
        match usize::try_from(src).ok().filter(|&s| s < rows) {
            Some(s) => unsorted[s * width..(s + 1) * width].copy_from_slice(row),
            None => assert!(row.iter().all(|v| *v == 0.0), "padding row {i} was written"),
        }
    }
    ((decode, unsorted), (router_decode, router_prefill))
}

#[test]
fn decode_and_sorted_folds_agree_on_any_batch() {
    let device = Device::cpu();
    let (pool, names, _) = load_model(&device, "qwen3_moe");
    let top_k = pool.config().moe.as_ref().unwrap().top_k;
    // Adapter `s` is in slot `s`.
    let leases: Vec<SlotLease> = names.iter().map(|n| pool.acquire(n).unwrap()).collect();
    assert_eq!(leases.len(), 4);
    for (s, lease) in leases.iter().enumerate() {
        assert_eq!(lease.slot().index(), s);
    }
    // Each case builds its steps: the runner's closure borrows the pool through a cell.
    let pool = RefCell::new(pool);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(24));
    runner
        .run(&batches(), |batch| {
            let mut pool = pool.borrow_mut();
            let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(16, top_k + 1)).unwrap();
            let ((decode, sorted), (router_decode, router_prefill)) =
                both_paths(&mut pool, &leases, &mut moe, 1, &batch);
            // Every adapter of the pool adapts gate_up: a batch with one folds something.
            let adapted = batch.0.iter().any(|&(r, _)| r != 0);
            prop_assert_eq!(adapted, decode.iter().any(|v| *v != 0.0));
            prop_assert_eq!(decode, sorted);
            prop_assert_eq!(router_decode, router_prefill);
            Ok(())
        })
        .unwrap();
}
