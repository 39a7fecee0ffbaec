//! Tensor-parallel placement end to end on the CPU backend: for world sizes
//! 1, 2, 4 and 8 and every family fixture, every rank's pool is built from
//! the same adapters; each rank serves the PEFT probes through the decode
//! kernels (a row-parallel rank on its slice of the probe input), and the
//! ranks' deltas, reassembled as the base model reassembles its outputs
//! (column-parallel: the ranks' output columns side by side; row-parallel:
//! the sum the all-reduce takes; replicated: each rank's whole delta),
//! equal the unsharded pool's delta within 1e-3 relative and PEFT's oracle
//! within the 1e-2 every served (BF16) delta is held to.
//! A world size whose cut does not divide the family's geometry is refused
//! by every rank's pool with the typed error naming the dimension.
//!
//! Slot bytes "add up" precisely as: the sum over the ranks of their slot
//! bytes equals the sum over the unsharded slot's pairs of A's bytes times
//! the ranks that hold each A column, plus B's bytes per output row times
//! the ranks that hold that row. A cut factor is held once per column or
//! row (so its shards add up to the unsharded factor exactly), except key /
//! value rows when the model has fewer key/value heads than ranks, which
//! `tp_world / num_key_value_heads` ranks hold; a factor a rank keeps whole
//! (A of a column-parallel module, B of a row-parallel one, both of a
//! replicated one) is held by every rank.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::placed::{
    MAX_RANK, ModelPair, ROUTES, dense_adapters, families, load_ranks, options, pair_pool_by_every_route, pair_rows,
    poisoned_copy, tiered_options,
};
use common::{fixtures, model_config, pool_with, rel_error};
use half::bf16;
use lora_audit::{PROBE_OUT, WeightRef, parse_weight_name, read_oracle};
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::{
    LayoutError, LoraModule, ModelConfig, ModuleShard, Placement, PlacementError, ShardKind, SlotLayout,
};
use lora_pool::{AdapterSource, BatchCapacity, FusedTargets, LoraOptions, LoraPool, PoolError, SlotLease, StepRow};

const WORLDS: [usize; 4] = [1, 2, 4, 8];
/// Reassembled ranks against the unsharded pool's delta (the bound).
const SHARD_TOL: f64 = 1e-3;
/// A served delta (BF16 pairs) against PEFT's f32 oracle: the bound every
/// pool test holds the unsharded pool to (`serve_fixtures.rs`).
const SERVED_TOL: f64 = 1e-2;

/// Ranks holding each A column and each B row of `module`, by rule from
/// the config alone (see the crate doc above).
fn holders(module: LoraModule, cfg: &ModelConfig, world: usize) -> (usize, Vec<usize>) {
    let (out, _) = module.dims(cfg);
    let kv_replicas = (world / cfg.num_key_value_heads).max(1);
    match module.shard_kind() {
        ShardKind::Column => {
            let q = cfg.num_attention_heads * cfg.head_dim;
            let rows = (0..out)
                .map(|r| match module {
                    LoraModule::KProj | LoraModule::VProj => kv_replicas,
                    LoraModule::QkvProj if r >= q => kv_replicas,
                    _ => 1,
                })
                .collect();
            (world, rows)
        }
        ShardKind::Row => (1, vec![world; out]),
        ShardKind::Replicated => (world, vec![world; out]),
    }
}

/// One rank's delta for probe rows `x` (`[n, in_r]`) through the decode
/// kernels. Each f32 row goes in as `hi = bf16(x)` and `lo = bf16(x - hi)`,
/// whose deltas add up, so the probe measures the served pairs rather than
/// the rounding of its own input.
fn served_delta(
    pool: &mut LoraPool,
    lease: &SlotLease,
    layer: usize,
    module: LoraModule,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let placement = pool.layout().placement();
    let targets = FusedTargets::single_at(pool.config(), placement, module).unwrap();
    let (out_r, in_r) = {
        let e = pool.layout().entry(layer, module).unwrap();
        (e.out_dim, e.in_dim)
    };
    assert_eq!(targets.width(), out_r);
    let hi: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let lo: Vec<bf16> = x
        .iter()
        .zip(&hi)
        .map(|(&v, h)| bf16::from_f32(v - h.to_f32()))
        .collect();
    let device = pool.device().clone();
    let xb = device.upload(&[hi, lo].concat()).unwrap();
    let mut y = device.alloc_zeros::<f32>(2 * n * out_r).unwrap();
    let step = pool.decode_step(&vec![StepRow::Adapter(lease); 2 * n], 2 * n).unwrap();
    pool.apply_decode(
        &step,
        layer,
        &targets,
        Rows::dense(&xb, 2 * n, in_r),
        RowsMut::dense(&mut y, 2 * n, out_r),
    )
    .unwrap();
    device.check_faults().unwrap();
    let y = y.download().unwrap();
    let (y_hi, y_lo) = y.split_at(n * out_r);
    y_hi.iter().zip(y_lo).map(|(a, b)| a + b).collect()
}

/// The ranks' deltas for probe rows `x` (`[n, in]`), reassembled into
/// the unsharded `[n, out]` delta as the base model reassembles its
/// outputs.
fn reassembled(
    pools: &mut [LoraPool],
    leases: &[SlotLease],
    cfg: &ModelConfig,
    (layer, module): (usize, LoraModule),
    x: &[f32],
    reference: &[f32],
    what: &str,
) -> Vec<f32> {
    let (out, inp) = module.dims(cfg);
    let n = x.len() / inp;
    let mut full = vec![0.0f32; n * out];
    let mut written = vec![false; out];
    for (pool, lease) in pools.iter_mut().zip(leases) {
        let shard = ModuleShard::of(module, cfg, pool.layout().placement()).unwrap();
        let x_r: Vec<f32> = x
            .chunks_exact(inp)
            .flat_map(|row| row[shard.in_start..shard.in_start + shard.in_len].iter().copied())
            .collect();
        let y = served_delta(pool, lease, layer, module, &x_r, n);
        let (out_r, _) = shard.dims();
        match shard.kind {
            ShardKind::Column => {
                for j in 0..out_r {
                    let col = shard.src_row(j).unwrap();
                    for t in 0..n {
                        let v = y[t * out_r + j];
                        if written[col] {
                            // A replicated key/value head: every rank holding
                            // it serves the same bytes.
                            assert_eq!(full[t * out + col], v, "{what}: replicated column {col}");
                        }
                        full[t * out + col] = v;
                    }
                    written[col] = true;
                }
            }
            ShardKind::Row => {
                for (f, v) in full.iter_mut().zip(&y) {
                    *f += v;
                }
                written.fill(true);
            }
            ShardKind::Replicated => {
                let err = rel_error(&y, reference);
                assert!(
                    err < SERVED_TOL,
                    "{what}: a replicated rank's delta, relative error {err}"
                );
                full.copy_from_slice(&y);
                written.fill(true);
            }
        }
    }
    assert!(written.iter().all(|&w| w), "{what}: every output column is some rank's");
    full
}

#[test]
fn every_ranks_shard_reassembles_the_peft_oracle_across_world_sizes() {
    ranks_reassemble_the_peft_oracle(&Device::cpu());
}

/// The same checks with every rank's pool on one GPU (`world` pools on one
/// device as `world` ranks), through the CUDA kernels.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn every_ranks_shard_reassembles_the_peft_oracle_on_one_gpu() {
    if let Some(device) =
        lora_kernels::testing::cuda_or_skip("every_ranks_shard_reassembles_the_peft_oracle_on_one_gpu")
    {
        ranks_reassemble_the_peft_oracle(&device);
    }
}

fn ranks_reassemble_the_peft_oracle(device: &Device) {
    let mut served = BTreeMap::new();
    for family in families() {
        let cfg = model_config(&family);
        let adapters = dense_adapters(&family, &cfg);
        if family == "llama" {
            // The filter must not empty the main family's set.
            assert!(adapters.len() >= 8, "llama: {adapters:?}");
        }
        if adapters.is_empty() {
            continue;
        }
        let mut whole: BTreeMap<(String, String), Vec<f32>> = BTreeMap::new();
        for world in WORLDS {
            let first = SlotLayout::with_placement(&cfg, MAX_RANK, Placement::new(0, world).unwrap());
            if let Err(expected) = first {
                // Every rank's pool refuses, naming the dimension.
                assert!(
                    matches!(expected, LayoutError::Placement(PlacementError::Indivisible { .. })),
                    "{family} x{world}: {expected}"
                );
                let Err(err) = load_ranks(device, &cfg, &family, &adapters, world, false) else {
                    panic!("{family} x{world}: a pool was built for a cut that does not divide");
                };
                // Startup load audits first, and the audit sizes the rank's
                // slot: the same typed error, under the adapter's name.
                let layout_err = match &err {
                    PoolError::Layout(e) => Some(e),
                    PoolError::Audit { source, .. } => match source.as_ref() {
                        lora_audit::AuditError::Layout(e) => Some(e),
                        _ => None,
                    },
                    _ => None,
                };
                assert_eq!(layout_err, Some(&expected), "{family} x{world}: {err}");
                served
                    .entry(family.clone())
                    .or_insert_with(Vec::new)
                    .push(format!("x{world} refused: {err}"));
                continue;
            }
            let mut pools = load_ranks(device, &cfg, &family, &adapters, world, false).unwrap();
            // Slot bytes add up (see the crate doc).
            let unsharded = SlotLayout::new(&cfg, MAX_RANK).unwrap();
            let expected_bytes: usize = unsharded
                .entries()
                .iter()
                .map(|e| {
                    let (a_holders, rows) = holders(e.module, &cfg, world);
                    2 * MAX_RANK * (e.in_dim * a_holders + rows.iter().sum::<usize>())
                })
                .sum();
            let total: usize = pools.iter().map(|p| p.layout().slot_bytes()).sum();
            assert_eq!(total, expected_bytes, "{family} x{world}: slot bytes");
            if world == 1 {
                assert_eq!(total, unsharded.slot_bytes());
            }
            for adapter in &adapters {
                let oracle = read_oracle(&fixtures().join(&family).join(adapter).join("oracle.safetensors")).unwrap();
                let leases: Vec<SlotLease> = pools.iter().map(|p| p.acquire(adapter).unwrap()).collect();
                for (weight, x) in &oracle.inputs.inputs {
                    let WeightRef::Dense { layer, module } = parse_weight_name(weight, &cfg).unwrap() else {
                        unreachable!("dense_adapters keeps dense probes only");
                    };
                    let reference = &oracle.expected[&format!("{PROBE_OUT}{weight}")].data;
                    let what = format!("{family}/{adapter} x{world} {weight}");
                    let delta = reassembled(&mut pools, &leases, &cfg, (layer, module), &x.data, reference, &what);
                    let err = rel_error(&delta, reference);
                    assert!(err < SERVED_TOL, "{what}: relative error {err} against PEFT");
                    let key = (adapter.clone(), weight.clone());
                    match whole.get(&key) {
                        None => {
                            whole.insert(key, delta);
                        }
                        Some(unsharded) => {
                            let err = rel_error(&delta, unsharded);
                            assert!(
                                err < SHARD_TOL,
                                "{what}: relative error {err} against the unsharded pool"
                            );
                        }
                    }
                }
            }
            served
                .entry(family.clone())
                .or_insert_with(Vec::new)
                .push(format!("x{world}: {} adapters", adapters.len()));
        }
    }
    eprintln!("{served:#?}");
    // Every world size that divides was served for llama; 8 ranks cannot cut
    // its 4 attention heads.
    let llama = &served["llama"];
    assert!(llama[..3].iter().all(|s| !s.contains("refused")), "{llama:?}");
    assert!(llama[3].contains("num_attention_heads"), "{llama:?}");
    assert!(served.contains_key("phi3"), "the fused family is covered: {served:?}");
}

#[test]
fn targets_of_another_rank_are_refused_before_launch() {
    let cfg = model_config("llama");
    let root = fixtures().join("llama");
    let dir = root.join("rslora");
    let sources = [AdapterSource {
        name: "rslora",
        dir: dir.as_path(),
    }];
    let rank = Placement::new(1, 2).unwrap();
    let mut pool = LoraPool::load(
        &Device::cpu(),
        cfg.clone(),
        options(1, rank),
        BatchCapacity::default(),
        &sources,
    )
    .unwrap();
    let lease = pool.acquire("rslora").unwrap();
    let step = pool.decode_step(&[StepRow::Adapter(&lease)], 1).unwrap();
    let device = pool.device().clone();
    let x = device.upload(&vec![bf16::ZERO; cfg.hidden_size]).unwrap();
    // The unsharded q | k | v offsets on a rank's pool.
    let whole = FusedTargets::qkv(&cfg);
    let mut y = device.alloc_zeros::<f32>(whole.width()).unwrap();
    let err = pool
        .apply_decode(
            &step,
            0,
            &whole,
            Rows::dense(&x, 1, cfg.hidden_size),
            RowsMut::dense(&mut y, 1, whole.width()),
        )
        .unwrap_err();
    assert!(err.to_string().contains("FusedTargets::*_at"), "{err}");
    let own = FusedTargets::qkv_at(&cfg, rank).unwrap();
    let mut y = device.alloc_zeros::<f32>(own.width()).unwrap();
    pool.apply_decode(
        &step,
        0,
        &own,
        Rows::dense(&x, 1, cfg.hidden_size),
        RowsMut::dense(&mut y, 1, own.width()),
    )
    .unwrap();
}

#[test]
fn expert_deltas_under_tensor_parallelism_are_refused_by_type() {
    let cfg = model_config("qwen3_moe");
    let opts = LoraOptions {
        experts: true,
        ..options(1, Placement::new(1, 2).unwrap())
    };
    let err = LoraPool::new(&Device::cpu(), cfg, opts, BatchCapacity::default()).err();
    assert!(
        matches!(err, Some(PoolError::ExpertsUnderTensorParallel { tp_world: 2 })),
        "{err:?}"
    );
}

/// Startup load, disk swap and the host tier read only the rank's bytes
/// (positioned reads of its shard, the header audited): a NaN in rows of a
/// column-parallel B that only rank 0 holds is refused by rank 0, naming
/// the tensor, and never seen by rank 1, which serves the adapter.
#[test]
fn a_rank_reads_only_its_own_bytes_on_disk_swap_and_into_the_host_tier() {
    use lora_pool::SlotId;
    let cfg = model_config("llama");
    // `demo_r4_plain` whose layer-0 `q_proj` B has a NaN in output row 0:
    // rank 0 of 2 holds that row, rank 1 does not.
    let tensor = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
    let bad = poisoned_copy("demo_r4_plain", "lora-pool-tp-poison-swap", tensor, |shape| {
        assert_eq!(shape[1], 4, "rank 4: element 3 is in row 0");
        3
    });
    for p in Placement::new(0, 2).unwrap().ranks() {
        let mut pool = pool_with(tiered_options(2, p), &[("clean", "rslora")]);
        let slot = SlotId::new(1);
        let swapped = pool.swap_from_disk(slot, "bad", &bad);
        pool.prefetch("bad-tier", &bad).unwrap();
        pool.wait_for_prefetch();
        let events = pool.prefetch_events();
        let tiered = events.iter().find(|e| e.name == "bad-tier").map(|e| &e.outcome);
        if p.tp_rank() == 0 {
            for err in [
                swapped.err().map(|e| e.to_string()),
                tiered.and_then(|o| o.as_ref().err()).map(|e| e.to_string()),
            ] {
                let err = err.expect("rank 0 holds the NaN row: refused");
                assert!(err.contains("non-finite") && err.contains(tensor), "{err}");
            }
        } else {
            swapped.expect("rank 1 never reads row 0");
            assert!(matches!(tiered, Some(Ok(_))), "{tiered:?}");
            assert!(pool.acquire("bad").is_ok());
        }
        // Startup load: the header audit sizes the pool, the rank's bytes
        // are read once, when staged.
        let poisoned = [AdapterSource {
            name: "bad",
            dir: bad.as_path(),
        }];
        let loaded = LoraPool::load(
            &Device::cpu(),
            cfg.clone(),
            options(1, p),
            BatchCapacity::default(),
            &poisoned,
        );
        match (p.tp_rank(), loaded) {
            (0, Err(err)) => assert!(err.to_string().contains(tensor), "{err}"),
            (0, Ok(_)) => panic!("rank 0 loaded a NaN it holds"),
            (_, loaded) => assert!(loaded.is_ok(), "rank 1 never reads row 0: {:?}", loaded.err()),
        }
    }
    let _ = std::fs::remove_dir_all(&bad);
}

/// A pool with a tensor-parallel placement AND the embedding place
/// (`LoraOptions::embedding_lora`) builds and serves: each rank's slot is
/// its dense shards then the whole embedding pair (replicated, as the base
/// model keeps the embedding table whole on every rank); every route into a
/// slot (startup load, disk swap, the host tier's rank pack, a prepared
/// adapter) puts the adapter's whole pair there, the same bytes as the
/// unsharded pool's; and the embedding LoRA every rank adds is the
/// unsharded pool's, row for row.
#[test]
fn a_placed_pool_with_the_embedding_place_holds_and_serves_the_whole_embedding_pair_on_every_rank() {
    placed_pool_serves_the_whole_pair(&Device::cpu(), ModelPair::Embedding);
}

/// The same checks with every rank's pool on one GPU, through the CUDA
/// embedding kernel.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn a_placed_pool_with_the_embedding_place_serves_the_whole_embedding_pair_on_one_gpu() {
    if let Some(device) = lora_kernels::testing::cuda_or_skip(
        "a_placed_pool_with_the_embedding_place_serves_the_whole_embedding_pair_on_one_gpu",
    ) {
        placed_pool_serves_the_whole_pair(&device, ModelPair::Embedding);
    }
}

/// A pool with a tensor-parallel placement AND the output head's place
/// (`LoraOptions::lm_head_lora`) builds and serves the same way: each
/// rank's slot is its dense shards then the whole head pair (replicated, as
/// the base model keeps lm_head whole on every rank); every route into a
/// slot puts the adapter's whole head pair there, the unsharded pool's
/// bytes; and the head LoRA every rank adds to its logits is the unsharded
/// pool's, row for row.
#[test]
fn a_placed_pool_with_the_head_place_holds_and_serves_the_whole_head_pair_on_every_rank() {
    placed_pool_serves_the_whole_pair(&Device::cpu(), ModelPair::LmHead);
}

/// The same checks with every rank's pool on one GPU, through the CUDA
/// tall-output decode kernels.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn a_placed_pool_with_the_head_place_serves_the_whole_head_pair_on_one_gpu() {
    if let Some(device) =
        lora_kernels::testing::cuda_or_skip("a_placed_pool_with_the_head_place_serves_the_whole_head_pair_on_one_gpu")
    {
        placed_pool_serves_the_whole_pair(&device, ModelPair::LmHead);
    }
}

fn placed_pool_serves_the_whole_pair(device: &Device, which: ModelPair) {
    use lora_pool::SlotId;
    let cfg = model_config("llama");
    let ids: Vec<u32> = (0..cfg.vocab_size as u32).step_by(7).collect();
    // Every route into one pool of `placement`; its pair's region of each
    // slot and the pair's rows of each adapter.
    let serve = |p: Placement| {
        let mut pool = pair_pool_by_every_route(device, which, p);
        let layout = pool.layout().clone();
        let dense = SlotLayout::with_placement(&cfg, MAX_RANK, p).unwrap().slot_bytes();
        let whole = lora_layout::pair_bytes(cfg.hidden_size, cfg.vocab_size, MAX_RANK).unwrap();
        assert_eq!(
            layout.slot_bytes(),
            dense + whole,
            "{p:?}: the rank's shards, then the whole pair"
        );
        let (a_offset, b_offset) = match which {
            ModelPair::Embedding => {
                let e = layout.embedding().expect("the embedding place");
                (e.a_offset, e.b_offset)
            }
            ModelPair::LmHead => {
                assert!(layout.embedding().is_none());
                let e = layout.lm_head().expect("the head place");
                (e.a_offset, e.b_offset)
            }
        };
        assert!(a_offset < b_offset);
        let i = layout.entries().len();
        let shard = layout.shard(i).expect("the pair's shard");
        assert!(shard.is_whole(), "{p:?}: {shard:?}");
        assert_eq!(shard.kind, ShardKind::Replicated);
        let region = a_offset / 2..layout.slot_bytes() / 2;
        let held: Vec<Vec<bf16>> = (0..4)
            .map(|s| pool.slot_contents(SlotId::new(s)).unwrap()[region.clone()].to_vec())
            .collect();
        for (s, name) in ROUTES.iter().enumerate() {
            let e = match which {
                ModelPair::Embedding => pool.embedding_entry(SlotId::new(s)),
                ModelPair::LmHead => pool.lm_head_entry(SlotId::new(s)),
            };
            assert!(e.unwrap().rank > 0, "{p:?} {name}: {which:?} pair published");
            assert_eq!(held[s], held[0], "{p:?} {name}: every route holds the same pair");
        }
        let rows = pair_rows(&mut pool, which, &ids);
        (held, rows)
    };
    let (whole_held, whole_rows) = serve(Placement::SINGLE);
    assert!(
        whole_rows[0].iter().any(|&v| v != 0.0),
        "the adapter's {which:?} LoRA adds a delta"
    );
    for world in [2, 4] {
        for p in Placement::new(0, world).unwrap().ranks() {
            let (held, rows) = serve(p);
            assert_eq!(
                held, whole_held,
                "{p:?}: the whole pair, as the unsharded pool holds it"
            );
            assert_eq!(rows, whole_rows, "{p:?}: the unsharded pool's {which:?} rows");
        }
    }
}
