//! Mixed batches through the MoE folds, against PEFT's merged weights: on
//! every MoE fixture model, one pool holding all its servable adapters and
//! one batch of tokens of every adapter plus base-model tokens, routed so
//! that every adapter's probe rows reach every expert (so several adapters
//! share each expert, and each token's experts differ from its neighbours').
//! The batch runs the decode path (expanded rows, padding rows with expert
//! ids no layer has) and the sorted prefill path (expert blocks with
//! padding rows) for every MoE layer and projection, and the router fold on
//! f32 and bf16 logits. Every token's adapter reaches the folds only
//! through the pool's step: each adapter is leased by name, and every batch
//! is set from the step its rows were built into. For each adapter and
//! oracle tensor,
//! ‖out − ref‖/‖ref‖ over all its elements must be below 1e-2 (the oracle's
//! own measure: single rows of a BF16 adapter stray further, even on the
//! pure host path); every other row must be left exactly as it was. A
//! request for an adapter that is not resident never gets a lease, and a
//! batch set from a step the pool has moved past is an error before
//! anything is written or launched.
//!
//! Each probe row is served as two tokens of the same adapter and experts,
//! `hi = bf16(x)` and `lo = bf16(x - hi)`, whose deltas are summed: the
//! oracle's probe rows are f32, and BF16 rows alone move small, cancelling
//! outputs by more than the tolerance (the fold is linear in x; see
//! `probe_expert_lora`).

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::{MOE_MODELS, Oracle, ProbeRows, load_model, moe_layers, rel_error, to_bf16};
use half::bf16;
use lora_kernels::testing::{Rng, cuda_or_skip};
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::{ExpertProj, ModelConfig, MoeLoraRoute};
use lora_moe::{ExpertTarget, MoeCapacity, MoeError, MoeLora, SortedRouting, SortedRows};
use lora_pool::{LoraPool, PoolError, PrefillSeq, SlotId, SlotLease, StepKind, StepRow};

/// Base-model tokens in each batch.
const BASE_TOKENS: usize = 3;
/// Decode padding tokens past the requests (even: tokens come in pairs).
const PADDING: usize = 2;

/// One token of the batch: its adapter slot (`None`: base model), its
/// probe row, the experts it is routed to, and whether it carries the `lo`
/// part of the row (tokens come in `hi`, `lo` pairs).
#[derive(Debug, Clone)]
struct Token {
    slot: Option<usize>,
    row: usize,
    experts: Vec<usize>,
    lo: bool,
}

/// For each adapter and probe row, a random permutation of the experts
/// dealt out `top_k` per token, so every (expert, row) of every adapter is
/// served once; then base-model tokens at random.
fn tokens(rng: &mut Rng, adapters: usize, probe_rows: usize, num_experts: usize, top_k: usize) -> Vec<Token> {
    let mut out = Vec::new();
    let mut push = |slot, row, experts: Vec<usize>| {
        for lo in [false, true] {
            let experts = experts.clone();
            out.push(Token { slot, row, experts, lo });
        }
    };
    for slot in 0..adapters {
        for row in 0..probe_rows {
            let mut perm: Vec<usize> = (0..num_experts).collect();
            for i in (1..perm.len()).rev() {
                perm.swap(i, rng.below(i + 1));
            }
            for group in perm.chunks(top_k) {
                let mut experts = group.to_vec();
                // A short last group takes other experts (served twice).
                while experts.len() < top_k {
                    let e = rng.below(num_experts);
                    if !experts.contains(&e) {
                        experts.push(e);
                    }
                }
                push(Some(slot), row, experts);
            }
        }
    }
    for row in 0..BASE_TOKENS {
        let mut experts = Vec::new();
        while experts.len() < top_k {
            let e = rng.below(num_experts);
            if !experts.contains(&e) {
                experts.push(e);
            }
        }
        push(None, row, experts);
    }
    out
}

/// Each token's step row: the lease of its adapter, or the base model.
fn rows<'l>(tokens: &[Token], leases: &'l [SlotLease]) -> Vec<StepRow<'l>> {
    tokens
        .iter()
        .map(|t| match t.slot {
            Some(s) => StepRow::Adapter(&leases[s]),
            None => StepRow::Base,
        })
        .collect()
}

/// What one served item (an expanded row, or a token for the router) must
/// add: its adapter, the oracle tensor and the reference values, or
/// nothing (`None`).
#[derive(Debug, Clone)]
struct Expect {
    slot: usize,
    weight: String,
    tensor_len: usize,
    reference: Vec<f32>,
}

/// Served delta elements, reference elements and the oracle tensor's size.
type Group = (Vec<f32>, Vec<f32>, usize);

/// Per (path, slot, oracle weight): a [`Group`], compared as a whole tensor
/// once every batch has run.
#[derive(Default)]
struct Tally {
    groups: BTreeMap<(&'static str, usize, String), Group>,
}

impl Tally {
    fn add(&mut self, path: &'static str, e: &Expect, delta: &[f32]) {
        let entry = self
            .groups
            .entry((path, e.slot, e.weight.clone()))
            .or_insert_with(|| (Vec::new(), Vec::new(), e.tensor_len));
        entry.0.extend_from_slice(delta);
        entry.1.extend_from_slice(&e.reference);
    }

    /// Every group matches its oracle tensor and covers all of it (the
    /// router sees each probe row once per token carrying it, so its
    /// groups cover the tensor a whole number of times).
    fn check(&self, model: &str, names: &[String]) {
        assert!(!self.groups.is_empty(), "{model}: nothing was checked");
        for ((path, slot, weight), (served, reference, tensor_len)) in &self.groups {
            let what = format!("{model}/{} {path} {weight}", names[*slot]);
            let whole = reference.len() >= *tensor_len && reference.len().is_multiple_of(*tensor_len);
            assert!(whole, "{what}: {} of {tensor_len} elements checked", reference.len());
            let err = rel_error(served, reference);
            assert!(err < 1e-2, "{what}: relative error {err}");
        }
    }
}

fn expect(slot: usize, p: &ProbeRows, j: usize) -> Expect {
    Expect {
        slot,
        weight: p.weight.clone(),
        tensor_len: p.tensor_len,
        reference: p.out_row(j).to_vec(),
    }
}

/// The `hi` (`bf16(x)`) or `lo` (`x - bf16(x)`, rounded to BF16 on
/// upload) part of an f32 row.
fn split_part(x: &[f32], lo: bool) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            let hi = bf16::from_f32(v).to_f32();
            if lo { v - hi } else { hi }
        })
        .collect()
}

/// The inputs of a batch's items and what each must add.
struct Case {
    in_dim: usize,
    out_dim: usize,
    x: Vec<f32>,
    expected: Vec<Option<Expect>>,
}

/// Items (`per_token` per token, `padded` tokens) of width `in_dim`: where
/// `probe(token, k)` finds the oracle of the token's adapter, its probe row
/// (the token's `hi` or `lo` part) and reference; elsewhere random inputs
/// that must add nothing.
fn case(
    rng: &mut Rng,
    tokens: &[Token],
    padded: usize,
    per_token: usize,
    (in_dim, out_dim): (usize, usize),
    probe: impl Fn(&Token, usize) -> Option<ProbeRows>,
) -> Case {
    let mut x = Vec::new();
    let mut expected = Vec::new();
    for t in 0..padded {
        for k in 0..per_token {
            let token = tokens.get(t);
            let found = token.and_then(|tok| Some((tok.slot?, probe(tok, k)?, tok.row)));
            let row: Vec<f32> = match found {
                Some((slot, p, j)) => {
                    expected.push(Some(expect(slot, &p, j)));
                    p.x_row(j, in_dim).to_vec()
                }
                None => {
                    expected.push(None);
                    (0..in_dim).map(|_| rng.uniform()).collect()
                }
            };
            x.extend(split_part(&row, token.is_some_and(|tok| tok.lo)));
        }
    }
    Case {
        in_dim,
        out_dim,
        x,
        expected,
    }
}

/// The expanded rows `token * top_k + k` of `padded` tokens for (layer, proj).
fn expanded_case(
    rng: &mut Rng,
    cfg: &ModelConfig,
    oracles: &[Oracle],
    tokens: &[Token],
    padded: usize,
    layer: usize,
    proj: ExpertProj,
) -> Case {
    let (out_dim, in_dim) = proj.dims(cfg).unwrap();
    let top_k = cfg.moe.as_ref().unwrap().top_k;
    case(rng, tokens, padded, top_k, (in_dim, out_dim), |tok, k| {
        oracles[tok.slot?].expert(cfg, layer, tok.experts[k], proj)
    })
}

/// The router inputs of `padded` tokens at `layer`.
fn router_case(
    rng: &mut Rng,
    cfg: &ModelConfig,
    oracles: &[Oracle],
    tokens: &[Token],
    padded: usize,
    layer: usize,
) -> Case {
    let dims = (cfg.hidden_size, cfg.moe.as_ref().unwrap().num_experts);
    case(rng, tokens, padded, 1, dims, |tok, _| {
        oracles[tok.slot?].router(cfg, layer)
    })
}

/// Gate and Up are folded together (transformers' gate_up order); Down
/// alone. Returns the targets, y's width and the checked column.
fn targets(cfg: &ModelConfig, proj: ExpertProj) -> (Vec<ExpertTarget>, usize, usize) {
    let inter = cfg.moe.as_ref().unwrap().expert_intermediate_size;
    match proj {
        ExpertProj::Gate => (ExpertTarget::gate_up(inter).to_vec(), 2 * inter, 0),
        ExpertProj::Up => (ExpertTarget::gate_up(inter).to_vec(), 2 * inter, inter),
        ExpertProj::Down => (ExpertTarget::down().to_vec(), cfg.hidden_size, 0),
    }
}

/// The delta `y - y0` on columns `col..col + out` of y row `r` (width
/// `width`), and whether the row was left exactly as it was.
fn delta_at(y: &[f32], y0: &[f32], r: usize, width: usize, col: usize, out: usize) -> (Vec<f32>, bool) {
    let span = r * width + col..r * width + col + out;
    let (after, before) = (&y[span.clone()], &y0[span]);
    (after.iter().zip(before).map(|(a, b)| a - b).collect(), after == before)
}

/// Tally each item's delta: items come in `hi`, `lo` pairs of tokens, each
/// token `per_token` items; the pair's deltas sum to the served delta.
/// Items without an expectation must be left alone. `delta(i)` is item
/// `i`'s delta and whether it was left alone.
fn tally_pairs(
    tally: &mut Tally,
    path: &'static str,
    what: &str,
    expected: &[Option<Expect>],
    per_token: usize,
    delta: impl Fn(usize) -> (Vec<f32>, bool),
) {
    let tokens = expected.len() / per_token;
    for t in (0..tokens).step_by(2) {
        for k in 0..per_token {
            let (hi, lo) = (t * per_token + k, (t + 1) * per_token + k);
            let ((d_hi, same_hi), (d_lo, same_lo)) = (delta(hi), delta(lo));
            match &expected[hi] {
                Some(e) => {
                    let sum: Vec<f32> = d_hi.iter().zip(&d_lo).map(|(a, b)| a + b).collect();
                    tally.add(path, e, &sum);
                }
                None => assert!(same_hi && same_lo, "{what}: token {t} copy {k} must be left alone"),
            }
        }
    }
}

struct Model<'a> {
    name: &'a str,
    oracles: &'a [Oracle],
    tokens: &'a [Token],
    /// Adapter `k`'s lease, taken by name (it is in slot `k`).
    leases: &'a [SlotLease],
}

fn run(device: &Device) {
    let mut rng = Rng::fresh("mixed_batch");
    for model in MOE_MODELS {
        let (mut pool, names, oracles) = load_model(device, model);
        let cfg = pool.config().clone();
        let leases: Vec<SlotLease> = names.iter().map(|n| pool.acquire(n).unwrap()).collect();
        for (k, lease) in leases.iter().enumerate() {
            assert_eq!(lease.slot(), SlotId::new(k), "{model}: {}", names[k]);
        }
        let moe_dims = cfg.moe.clone().unwrap();
        let toks = tokens(&mut rng, names.len(), 4, moe_dims.num_experts, moe_dims.top_k);
        let padded = toks.len() + PADDING;
        // Sorted rows: every expanded row plus one padding row per expert.
        let capacity = MoeCapacity {
            max_tokens: padded,
            max_sorted_rows: toks.len() * moe_dims.top_k + moe_dims.num_experts,
        };
        let mut moe = MoeLora::new(&pool, capacity).unwrap();
        let m = Model {
            name: model,
            oracles: &oracles,
            tokens: &toks,
            leases: &leases,
        };
        let mut tally = Tally::default();
        for layer in moe_layers(&cfg) {
            router(&mut rng, &mut pool, &m, &mut moe, layer, &mut tally);
            for proj in ExpertProj::ALL {
                decode(&mut rng, &mut pool, &m, &mut moe, layer, proj, &mut tally);
                sorted(&mut rng, &mut pool, &m, &mut moe, layer, proj, &mut tally);
            }
        }
        tally.check(model, &names);
        refused_batch_is_an_error_before_launch(&mut pool, &m, &mut moe);
    }
}

fn decode(
    rng: &mut Rng,
    pool: &mut LoraPool,
    m: &Model<'_>,
    moe: &mut MoeLora,
    layer: usize,
    proj: ExpertProj,
    tally: &mut Tally,
) {
    let top_k = moe.top_k();
    let padded = m.tokens.len() + PADDING;
    let step = pool.decode_step(&rows(m.tokens, m.leases), padded).unwrap();
    let (pool, cfg) = (&*pool, pool.config());
    let device = pool.device();
    let routes = moe.set_decode_step(pool, &step).unwrap();
    for (t, route) in m.tokens.iter().zip(&routes) {
        match t.slot {
            Some(s) => assert_eq!(*route, MoeLoraRoute::Fold { slot: s }),
            None => assert_eq!(*route, MoeLoraRoute::Skip),
        }
    }
    // Padding rows get expert ids no layer has: they must not be read.
    let mut topk: Vec<i32> = m
        .tokens
        .iter()
        .flat_map(|t| t.experts.iter().map(|&e| e as i32))
        .collect();
    topk.extend(std::iter::repeat_n(-7, PADDING * top_k));
    let case = expanded_case(rng, cfg, m.oracles, m.tokens, padded, layer, proj);
    let (targets, width, col) = targets(cfg, proj);
    let rows = padded * top_k;
    let y0: Vec<f32> = (0..rows * width).map(|_| rng.uniform()).collect();
    let topk_ids = device.upload(&topk).unwrap();
    let x = device.upload(&to_bf16(&case.x)).unwrap();
    let mut y = device.upload(&y0).unwrap();
    moe.index_decode_rows(pool, &step, &topk_ids).unwrap();
    moe.apply_expert_lora_decode(
        pool,
        &step,
        layer,
        &targets,
        Rows::dense(&x, rows, case.in_dim),
        RowsMut::dense(&mut y, rows, width),
    )
    .unwrap();
    device.check_faults().unwrap();
    let y = y.download().unwrap();
    let what = format!("{} decode layer {layer} {proj}", m.name);
    tally_pairs(tally, "decode", &what, &case.expected, top_k, |r| {
        delta_at(&y, &y0, r, width, col, case.out_dim)
    });
}

fn sorted(
    rng: &mut Rng,
    pool: &mut LoraPool,
    m: &Model<'_>,
    moe: &mut MoeLora,
    layer: usize,
    proj: ExpertProj,
    tally: &mut Tally,
) {
    let top_k = moe.top_k();
    // One sequence per run of tokens of one adapter (and of the base model).
    let all = rows(m.tokens, m.leases);
    let mut cu = vec![0usize];
    let mut seq_rows = Vec::new();
    for (i, t) in m.tokens.iter().enumerate() {
        if i > 0 && m.tokens[i - 1].slot != t.slot {
            cu.push(i);
        }
        if i == 0 || m.tokens[i - 1].slot != t.slot {
            seq_rows.push(all[i]);
        }
    }
    cu.push(m.tokens.len());
    let seqs: Vec<PrefillSeq<'_>> = seq_rows
        .iter()
        .zip(cu.windows(2))
        .map(|(&row, w)| PrefillSeq { row, len: w[1] - w[0] })
        .collect();
    let step = pool.prefill_step(&seqs).unwrap();
    assert_eq!(step.cu_seqlens(), cu, "{}", m.name);
    let (pool, cfg) = (&*pool, pool.config());
    let device = pool.device();
    let num_experts = cfg.moe.as_ref().unwrap().num_experts;
    moe.set_prefill_step(pool, &step).unwrap();
    let topk: Vec<i32> = m
        .tokens
        .iter()
        .flat_map(|t| t.experts.iter().map(|&e| e as i32))
        .collect();
    let sorted = SortedRouting::from_topk(&topk, top_k, num_experts).unwrap();
    // Pad every expert's block by one row, as block-aligned sorts do.
    let n_expanded = topk.len();
    let offsets = sorted.offsets();
    let mut sorted_token = Vec::new();
    let mut padded_offsets = vec![0i32];
    for e in 0..num_experts {
        sorted_token.extend_from_slice(&sorted.sorted_token[offsets[e]..offsets[e + 1]]);
        sorted_token.push(n_expanded as i32);
        padded_offsets.push(sorted_token.len() as i32);
    }
    let n_sorted = sorted_token.len();
    let case = expanded_case(rng, cfg, m.oracles, m.tokens, m.tokens.len(), layer, proj);
    let mut x = Vec::with_capacity(n_sorted * case.in_dim);
    let mut position = vec![usize::MAX; n_expanded];
    for (i, &src) in sorted_token.iter().enumerate() {
        match position.get_mut(src as usize) {
            Some(p) => {
                *p = i;
                let s = src as usize;
                x.extend_from_slice(&case.x[s * case.in_dim..(s + 1) * case.in_dim]);
            }
            None => x.extend((0..case.in_dim).map(|_| rng.uniform())),
        }
    }
    let (targets, width, col) = targets(cfg, proj);
    let y0: Vec<f32> = (0..n_sorted * width).map(|_| rng.uniform()).collect();
    let st = device.upload(&sorted_token).unwrap();
    let off = device.upload(&padded_offsets).unwrap();
    let xb = device.upload(&to_bf16(&x)).unwrap();
    let mut y = device.upload(&y0).unwrap();
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
        Rows::dense(&xb, n_sorted, case.in_dim),
        RowsMut::dense(&mut y, n_sorted, width),
    )
    .unwrap();
    device.check_faults().unwrap();
    let y = y.download().unwrap();
    for (i, &src) in sorted_token.iter().enumerate() {
        if src as usize >= n_expanded {
            assert!(
                delta_at(&y, &y0, i, width, 0, width).1,
                "{}: padding row {i} was written",
                m.name
            );
        }
    }
    let what = format!("{} sorted layer {layer} {proj}", m.name);
    tally_pairs(tally, "sorted", &what, &case.expected, top_k, |r| {
        delta_at(&y, &y0, position[r], width, col, case.out_dim)
    });
}

fn router(rng: &mut Rng, pool: &mut LoraPool, m: &Model<'_>, moe: &mut MoeLora, layer: usize, tally: &mut Tally) {
    let padded = m.tokens.len() + PADDING;
    let step = pool.decode_step(&rows(m.tokens, m.leases), padded).unwrap();
    let (pool, cfg) = (&*pool, pool.config());
    let device = pool.device();
    let case = router_case(rng, cfg, m.oracles, m.tokens, padded, layer);
    let (hidden, num_experts) = (case.in_dim, case.out_dim);
    moe.set_decode_step(pool, &step).unwrap();
    let xb = device.upload(&to_bf16(&case.x)).unwrap();
    // f32 logits over random values, then bf16 logits from zero.
    let y0: Vec<f32> = (0..padded * num_experts).map(|_| rng.uniform()).collect();
    let mut y = device.upload(&y0).unwrap();
    moe.apply_router_lora(
        pool,
        &step,
        layer,
        Rows::dense(&xb, padded, hidden),
        RowsMut::dense(&mut y, padded, num_experts),
    )
    .unwrap();
    let mut y16 = device.alloc_zeros::<bf16>(padded * num_experts).unwrap();
    moe.apply_router_lora(
        pool,
        &step,
        layer,
        Rows::dense(&xb, padded, hidden),
        RowsMut::dense(&mut y16, padded, num_experts),
    )
    .unwrap();
    device.check_faults().unwrap();
    let y = y.download().unwrap();
    let y16: Vec<f32> = y16.download().unwrap().iter().map(|v| v.to_f32()).collect();
    let zeros = vec![0f32; y16.len()];
    let what = format!("{} router layer {layer}", m.name);
    tally_pairs(tally, "router f32", &what, &case.expected, 1, |r| {
        delta_at(&y, &y0, r, num_experts, 0, num_experts)
    });
    tally_pairs(tally, "router bf16", &what, &case.expected, 1, |r| {
        delta_at(&y16, &zeros, r, num_experts, 0, num_experts)
    });
}

fn refused_batch_is_an_error_before_launch(pool: &mut LoraPool, m: &Model<'_>, moe: &mut MoeLora) {
    let model = m.name;
    let mut rows = rows(m.tokens, m.leases);
    let good = rows.len();
    let step = pool.decode_step(&rows, good).unwrap();
    moe.set_decode_step(pool, &step).unwrap();
    let map_before = moe.row_adapter().download().unwrap();
    // An adapter that was never loaded gets no lease: it cannot join a step.
    let err = pool.acquire("never-loaded").unwrap_err();
    assert!(
        matches!(&err, PoolError::NotResident(name) if name == "never-loaded"),
        "{model}: {err}"
    );
    // A batch set from a step the pool has moved past is refused, of
    // either kind, however its rows look.
    rows.insert(1, StepRow::Base);
    let stale = pool.decode_step(&rows, rows.len()).unwrap();
    let _current = pool.decode_step(&rows[..1], 1).unwrap();
    let err = moe.set_decode_step(pool, &stale).unwrap_err();
    assert!(
        matches!(err, MoeError::Pool(PoolError::StaleStep { kind: StepKind::Decode })),
        "{model}: {err}"
    );
    let seqs = [
        PrefillSeq {
            row: StepRow::Base,
            len: 2,
        },
        PrefillSeq { row: rows[0], len: 3 },
    ];
    let stale = pool.prefill_step(&seqs).unwrap();
    let _current = pool.prefill_step(&seqs[..1]).unwrap();
    let err = moe.set_prefill_step(pool, &stale).unwrap_err();
    assert!(
        matches!(
            err,
            MoeError::Pool(PoolError::StaleStep {
                kind: StepKind::Prefill
            })
        ),
        "{model}: {err}"
    );
    // Nothing was written: the batch in force is the last good one.
    assert_eq!(moe.n_tokens(), Some(good), "{model}");
    assert_eq!(moe.row_adapter().download().unwrap(), map_before, "{model}");
}

#[test]
fn mixed_batches_match_the_peft_oracle_on_cpu() {
    run(&Device::cpu());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn mixed_batches_match_the_peft_oracle_on_cuda() {
    if let Some(device) = cuda_or_skip("mixed_batches_match_the_peft_oracle_on_cuda") {
        run(&device);
    }
}
