//! Expert parallelism end to end on the CPU backend: for expert-parallel
//! world sizes 1, 2, 4 and 8 and every MoE fixture model, every rank's pool
//! is built from the same adapters. Checked:
//!
//! - the ranks' placed expert pairs cover every expert pair of the
//!   unsharded audit exactly once, and every rank holds the router pairs
//!   (replicated); their expert slot bytes add up to the unsharded slot's
//!   plus one router copy per extra rank;
//! - every expert and router probe of the adapter's PEFT oracle, answered
//!   through each rank's pool and the MoE folds: an expert the rank does
//!   not hold answers zeros, the router answers the same on every rank, and
//!   the ranks' outputs summed equal the unsharded pool's within 1e-3
//!   relative and PEFT's oracle within 1e-2;
//! - a world size that does not divide `num_experts` (every fixture has 4
//!   experts: 8 ranks) is refused by every rank's pool naming `num_experts`.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::{MOE_MODELS, Oracle, fixtures, model_config, oracle, rel_error, servable_adapters};
use lora_audit::{PROBE_OUT, ProbeInputs, ProbeTensor, WeightRef, audit_adapter, parse_weight_name};
use lora_kernels::Device;
use lora_layout::{ExpertSite, ModelConfig, Placement, expert_router_bytes};
use lora_moe::probe_expert_lora;
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool, PoolError};

const WORLDS: [usize; 4] = [1, 2, 4, 8];
const SHARD_TOL: f64 = 1e-3;
const SERVED_TOL: f64 = 1e-2;

fn options(adapters: usize, placement: Placement) -> LoraOptions {
    LoraOptions {
        placement,
        ..common::options(adapters)
    }
}

fn ranks(world: usize) -> Vec<Placement> {
    Placement::SINGLE
        .with_experts(0, world)
        .unwrap()
        .expert_ranks()
        .collect()
}

fn load(device: &Device, model: &str, names: &[String], placement: Placement) -> Result<LoraPool, PoolError> {
    let dirs: Vec<_> = names.iter().map(|a| fixtures().join(model).join(a)).collect();
    let sources: Vec<AdapterSource<'_>> = names
        .iter()
        .zip(&dirs)
        .map(|(name, dir)| AdapterSource { name, dir })
        .collect();
    LoraPool::load(
        device,
        model_config(model),
        options(names.len(), placement),
        BatchCapacity::default(),
        &sources,
    )
}

/// The expert, router and fused-experts probes of `oracle`.
fn expert_inputs(cfg: &ModelConfig, oracle: &Oracle) -> ProbeInputs {
    let inputs = oracle
        .probes
        .iter()
        .filter(|(w, _)| {
            matches!(
                parse_weight_name(w, cfg).unwrap(),
                WeightRef::Expert { .. } | WeightRef::Router { .. } | WeightRef::Fused { .. }
            )
        })
        .map(|(w, (pin, _))| (w.clone(), pin.clone()))
        .collect();
    ProbeInputs {
        inputs,
        rows: BTreeMap::new(),
    }
}

/// Whether every value of `t` outside the experts `held` is zero, for the
/// weight `weight` (a router always passes).
fn zero_outside(cfg: &ModelConfig, weight: &str, t: &ProbeTensor, held: &std::ops::Range<usize>) -> bool {
    match parse_weight_name(weight, cfg).unwrap() {
        WeightRef::Expert { expert, .. } => held.contains(&expert) || t.data.iter().all(|v| *v == 0.0),
        WeightRef::Fused { .. } => {
            let per = t.data.len() / t.shape[0];
            (0..t.shape[0])
                .filter(|e| !held.contains(e))
                .all(|e| t.data[e * per..(e + 1) * per].iter().all(|v| *v == 0.0))
        }
        _ => true,
    }
}

#[test]
fn expert_parallel_ranks_cover_every_expert_once_and_reassemble_the_peft_oracle() {
    ranks_reassemble_the_peft_oracle(&Device::cpu());
}

/// The same checks with every rank's pool on one GPU, through the CUDA
/// MoE kernels.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn expert_parallel_ranks_reassemble_the_peft_oracle_on_one_gpu() {
    if let Some(device) =
        lora_kernels::testing::cuda_or_skip("expert_parallel_ranks_reassemble_the_peft_oracle_on_one_gpu")
    {
        ranks_reassemble_the_peft_oracle(&device);
    }
}

fn ranks_reassemble_the_peft_oracle(device: &Device) {
    let mut checked = BTreeMap::new();
    for model in MOE_MODELS {
        let cfg = model_config(model);
        let num_experts = cfg.moe.as_ref().unwrap().num_experts;
        let names = servable_adapters(model);
        let oracles: Vec<Oracle> = names.iter().map(|a| oracle(model, a)).collect();
        // The unsharded answers: (adapter, weight) -> output.
        let mut whole: BTreeMap<(String, String), ProbeTensor> = BTreeMap::new();
        for world in WORLDS {
            if !num_experts.is_multiple_of(world) {
                for p in ranks(world) {
                    let err = load(device, model, &names, p)
                        .err()
                        .expect("a pool for experts that do not divide");
                    assert!(err.to_string().contains("num_experts"), "{model} x{world}: {err}");
                }
                checked
                    .entry(model)
                    .or_insert_with(Vec::new)
                    .push(format!("x{world} refused"));
                continue;
            }
            let mut pools: Vec<LoraPool> = ranks(world)
                .into_iter()
                .map(|p| load(device, model, &names, p).unwrap())
                .collect();
            for (name, oracle) in names.iter().zip(&oracles) {
                let what = format!("{model}/{name} x{world}");
                // Coverage and bytes, from each rank's audit.
                let dir = fixtures().join(model).join(name);
                let unsharded = audit_adapter(&dir, &cfg, &options(1, Placement::SINGLE)).unwrap();
                let mut count: BTreeMap<(usize, ExpertSite), usize> = BTreeMap::new();
                let mut bytes = 0;
                for p in ranks(world) {
                    let report = audit_adapter(&dir, &cfg, &options(1, p)).unwrap();
                    assert!(report.is_servable(), "{what}");
                    let held = p.expert_range(num_experts).unwrap();
                    for e in &report.experts {
                        if let ExpertSite::Expert { expert, .. } = e.site {
                            assert!(
                                held.contains(&expert),
                                "{what}: rank {} holds {:?}",
                                p.ep_rank(),
                                e.site
                            );
                        }
                        *count.entry((e.layer, e.site)).or_default() += 1;
                    }
                    bytes += report.expert_bytes;
                }
                let mut routers = Vec::new();
                for e in &unsharded.experts {
                    let want = if e.site == ExpertSite::Router { world } else { 1 };
                    assert_eq!(
                        count.remove(&(e.layer, e.site)),
                        Some(want),
                        "{what}: {:?}",
                        (e.layer, e.site)
                    );
                    if e.site == ExpertSite::Router {
                        routers.push((e.layer, e.site));
                    }
                }
                assert!(count.is_empty(), "{what}: sites no unsharded audit places: {count:?}");
                let router_bytes = if routers.is_empty() {
                    0
                } else {
                    expert_router_bytes(&cfg, 16, routers).unwrap()
                };
                assert_eq!(
                    bytes,
                    unsharded.expert_bytes + (world - 1) * router_bytes,
                    "{what}: expert bytes"
                );

                // Probes through each rank's pool and the folds.
                let inputs = expert_inputs(&cfg, oracle);
                let mut sum: BTreeMap<String, ProbeTensor> = BTreeMap::new();
                for pool in pools.iter_mut() {
                    let p = pool.layout().placement();
                    let held = p.expert_range(num_experts).unwrap();
                    let lease = pool.acquire(name).unwrap();
                    let answered = probe_expert_lora(pool, &lease, &inputs).unwrap();
                    drop(lease);
                    for (key, t) in answered.tensors {
                        let weight = key.strip_prefix(PROBE_OUT).unwrap().to_string();
                        assert!(
                            zero_outside(&cfg, &weight, &t, &held),
                            "{what}: rank {} answers another rank's expert in {weight}",
                            p.ep_rank()
                        );
                        if let WeightRef::Router { .. } = parse_weight_name(&weight, &cfg).unwrap()
                            && let Some(w) = whole.get(&(name.clone(), weight.clone()))
                        {
                            assert_eq!(t.data, w.data, "{what}: the router is replicated");
                            sum.insert(weight, t);
                            continue;
                        }
                        match sum.get_mut(&weight) {
                            Some(s) => s.data.iter_mut().zip(&t.data).for_each(|(a, b)| *a += b),
                            None => {
                                sum.insert(weight, t);
                            }
                        }
                    }
                }
                assert_eq!(sum.len(), inputs.inputs.len(), "{what}: every probe answered");
                for (weight, got) in sum {
                    let (_, want) = &oracle.probes[&weight];
                    assert_eq!(got.shape, want.shape, "{what}: {weight}");
                    let err = rel_error(&got.data, &want.data);
                    assert!(err < SERVED_TOL, "{what}: {weight}: relative error {err} against PEFT");
                    match whole.get(&(name.clone(), weight.clone())) {
                        Some(w) => {
                            let err = rel_error(&got.data, &w.data);
                            assert!(
                                err < SHARD_TOL,
                                "{what}: {weight}: relative error {err} against one rank"
                            );
                        }
                        None => {
                            whole.insert((name.clone(), weight), got);
                        }
                    }
                }
            }
            checked
                .entry(model)
                .or_insert_with(Vec::new)
                .push(format!("x{world}: {} adapters", names.len()));
        }
        assert!(
            whole
                .keys()
                .any(|(_, w)| !matches!(parse_weight_name(w, &cfg).unwrap(), WeightRef::Router { .. })),
            "{model}: no expert probe was checked"
        );
    }
    eprintln!("{checked:#?}");
}

/// The per-token adapter map travels with the dispatched tokens: what one
/// rank's [`lora_moe::MoeLora::dispatch_map`] holds, landed on another
/// rank with `receive_dispatch_map`, is that rank's batch.
#[test]
fn the_per_token_adapter_map_lands_on_the_receiving_rank() {
    use lora_moe::{MoeCapacity, MoeLora};
    use lora_pool::StepRow;
    let model = "qwen3_moe";
    let names = servable_adapters(model);
    let mut pools: Vec<LoraPool> = ranks(2)
        .into_iter()
        .map(|p| load(&Device::cpu(), model, &names, p).unwrap())
        .collect();
    let top_k = pools[0].config().moe.as_ref().unwrap().top_k;
    let mut moes: Vec<MoeLora> = pools
        .iter()
        .map(|p| MoeLora::new(p, MoeCapacity::for_tokens(8, top_k)).unwrap())
        .collect();
    assert!(moes[0].dispatch_map().is_err(), "no batch yet");
    let lease = pools[0].acquire(&names[0]).unwrap();
    let step = pools[0]
        .decode_step(&[StepRow::Adapter(&lease), StepRow::Base, StepRow::Adapter(&lease)], 3)
        .unwrap();
    moes[0].set_decode_step(&pools[0], &step).unwrap();
    let (buf, n) = moes[0].dispatch_map().unwrap();
    assert_eq!(n, 3);
    let sent = buf.download().unwrap()[..n].to_vec();
    let slot = lease.slot().index() as i32;
    assert_eq!(sent, [slot, -1, slot]);
    // Rank 1 receives tokens 2 and 1, in that order.
    let received = [sent[2], sent[1]];
    let pool1 = &mut pools[1];
    let lease1 = pool1.acquire(&names[0]).unwrap();
    assert_eq!(lease1.slot().index(), lease.slot().index(), "pools loaded in lockstep");
    let step1 = pool1.decode_step(&[StepRow::Base, StepRow::Base], 2).unwrap();
    let landing = moes[1].receive_dispatch_map(pool1, &step1, received.len()).unwrap();
    landing.write(0, &received).unwrap();
    assert_eq!(moes[1].n_tokens(), Some(2));
    assert_eq!(moes[1].row_adapter().download().unwrap()[..2], received);
    // More tokens than the scratch holds, or another pool's step: refused.
    assert!(moes[1].receive_dispatch_map(pool1, &step1, 9).is_err());
    assert!(moes[1].receive_dispatch_map(pool1, &step, 1).is_err());
}

/// An adapter whose experts all sit in rank 0's block, without a router
/// delta: ranks 1..3 hold none of its pairs, yet their steps fold it
/// (route `Fold`) and their per-token map names its slot, so the tokens
/// they dispatch to rank 0 carry it there.
#[test]
fn a_rank_without_the_adapters_experts_still_maps_its_tokens_to_the_slot() {
    use common::synthetic::{CONFIG, Spec, TempDir, write_adapter};
    use lora_layout::{ExpertProj, MoeLoraRoute};
    use lora_moe::{MoeCapacity, MoeLora};
    use lora_pool::{Step, StepRow};
    let cfg = ModelConfig::from_hf_config(CONFIG).unwrap();
    let tmp = TempDir::new("ep-block");
    let spec = Spec {
        name: "first-block-down",
        rank: 8,
        alpha: 16.0,
        sites: (0..4).map(|e| (e, ExpertProj::Down)).collect(),
        router: false,
    };
    let dir = write_adapter(&tmp.0, &cfg, &spec, 7);
    for p in ranks(4) {
        let opts = options(1, p);
        let report = audit_adapter(&dir, &cfg, &opts).unwrap();
        assert_eq!(
            report.group_expert_pairs,
            4 * moe_layer_count(&cfg),
            "rank {}",
            p.ep_rank()
        );
        assert_eq!(report.experts.is_empty(), p.ep_rank() != 0, "rank {}", p.ep_rank());
        let sources = [AdapterSource {
            name: spec.name,
            dir: dir.as_path(),
        }];
        let mut pool = LoraPool::load(&Device::cpu(), cfg.clone(), opts, BatchCapacity::default(), &sources).unwrap();
        let lease = pool.acquire(spec.name).unwrap();
        let slot = lease.slot().index();
        let step = pool.decode_step(&[StepRow::Adapter(&lease), StepRow::Base], 2).unwrap();
        assert_eq!(step.moe_routes(), [MoeLoraRoute::Fold { slot }, MoeLoraRoute::Skip]);
        let top_k = cfg.moe.as_ref().unwrap().top_k;
        let mut moe = MoeLora::new(&pool, MoeCapacity::for_tokens(4, top_k)).unwrap();
        moe.set_decode_step(&pool, &step).unwrap();
        let (map, n) = moe.dispatch_map().unwrap();
        assert_eq!(map.download().unwrap()[..n], [slot as i32, -1], "rank {}", p.ep_rank());
    }
}

fn moe_layer_count(cfg: &ModelConfig) -> usize {
    (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)).count()
}
