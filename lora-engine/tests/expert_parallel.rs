//! The reference engine expert-parallel on the CPU backend: every MoE
//! engine family's mixed request batch (base rows, adapters with expert,
//! router and attention LoRA, more adapters than slots) served by 2 and 4
//! ranks run as threads — each rank a base model holding its block of the
//! routed experts and the whole router (`Model::shard`), a pool holding
//! only its experts' deltas and the router's, each MoE layer's tokens
//! dispatched to the ranks holding their experts with the per-token
//! adapter map (`MoeLora::dispatch_map` / `receive_dispatch_map`) and
//! combined back on the host (`HostCollective`) — gives every rank the
//! one-rank run's outputs: the same greedy tokens and the same logits
//! within 1e-3 relative, and the ranks agree with each other exactly.
//! Both ways of running the dense parts are served: replicated
//! (`tp_world` 1) and tensor-parallel over the same ranks (`tp_world =
//! ep_world`). The per-expert checkpoint layouts (`*_legacy`) are checked
//! on the base model alone.

mod common;

use common::{adapters, check_rank_output, family_dir, requests, serve};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use lora_audit::LoraOptions;
use lora_engine::{
    Collective, Engine, EngineError, EngineOptions, HostCollective, KvCache, Model, NoDeltas, RequestOutput, SeqChunk,
    rel_error,
};
use lora_kernels::Device;
use lora_layout::{ExpertProj, ExpertSite, ModelConfig, Placement};

const EP_TOL: f64 = 1e-3;
const FAMILIES: [&str; 2] = ["qwen3_moe", "mixtral"];

fn options(max_loras: usize, placement: Placement) -> LoraOptions {
    LoraOptions {
        max_loras,
        max_rank: 16,
        experts: true,
        placement,
        ..LoraOptions::default()
    }
}

/// Rank `rank` of `world`: expert-parallel, with the dense parts
/// tensor-parallel over the same ranks (`tp`) or replicated.
fn placement(rank: usize, world: usize, tp: bool) -> Placement {
    let base = if tp {
        Placement::new(rank, world).expect("tp placement")
    } else {
        Placement::SINGLE
    };
    base.with_experts(rank, world).expect("ep placement")
}

/// Every rank's outputs for `family` served by `world` ranks on `device`.
fn serve_ranks(device: &Device, family: &str, world: usize, tp: bool) -> Vec<Vec<RequestOutput>> {
    let dir = family_dir(family).join("model");
    let adapters = adapters(family);
    let max_loras = adapters.len().saturating_sub(1).max(1);
    let reqs = requests(family);
    let group = HostCollective::group(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, c)| {
                let (dir, adapters, reqs) = (&dir, &adapters, &reqs);
                s.spawn(move || {
                    let what = format!("{family} rank {rank} of {world} (tp {tp})");
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let p = placement(rank, world, tp);
                    let engine = Engine::load_rank(
                        dir,
                        adapters,
                        device,
                        options(max_loras, p),
                        EngineOptions::default(),
                        c,
                    );
                    if let Ok(engine) = &engine {
                        holds_only_its_experts(engine, p, &what);
                    }
                    serve(engine, reqs, &what)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// The rank's expert pool holds pairs of its experts only (some), and
/// the router's where an adapter adapts it.
fn holds_only_its_experts(engine: &Engine, p: Placement, what: &str) {
    let pool = engine.pool();
    let cfg = pool.config();
    let experts = pool.experts().expect("an expert pool");
    let mine = p.expert_range(experts.num_experts()).expect("divides");
    let (mut held, mut routers) = (0, 0);
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        for slot in 0..pool.options().max_loras {
            for expert in 0..experts.num_experts() {
                for proj in ExpertProj::ALL {
                    let site = ExpertSite::Expert { expert, proj };
                    let rank = experts.entry(layer, site, slot).map_or(0, |e| e.rank);
                    assert!(rank == 0 || mine.contains(&expert), "{what}: holds expert {expert}");
                    held += usize::from(rank > 0);
                }
            }
            routers += usize::from(
                experts
                    .entry(layer, ExpertSite::Router, slot)
                    .is_some_and(|e| e.rank > 0),
            );
        }
    }
    assert!(held > 0, "{what}: no expert pair of its block");
    assert!(routers > 0, "{what}: no router pair");
}

/// The one-rank run of `family` on `device`.
fn serve_one(device: &Device, family: &str) -> Vec<RequestOutput> {
    let adapters = adapters(family);
    let max_loras = adapters.len().saturating_sub(1).max(1);
    serve(
        Engine::load(
            &family_dir(family).join("model"),
            &adapters,
            device,
            options(max_loras, Placement::SINGLE),
            EngineOptions::default(),
        ),
        &requests(family),
        family,
    )
}

fn check_ranks(family: &str, what: &str, ranks: &[Vec<RequestOutput>], one: &[RequestOutput]) {
    let reqs = requests(family);
    assert!(reqs.iter().any(|r| r.adapter.is_some()), "{family}: no adapted request");
    assert!(reqs.iter().any(|r| r.adapter.is_none()), "{family}: no base request");
    for (r, outs) in ranks.iter().enumerate() {
        assert_eq!(outs.len(), one.len());
        for (i, (got, want)) in outs.iter().zip(one).enumerate() {
            let what = format!("{family} {what} rank {r} request {i} ({:?})", reqs[i].adapter);
            check_rank_output(&what, got, want, &ranks[0][i], EP_TOL);
        }
    }
}

#[test]
fn moe_families_served_expert_parallel_equal_the_one_rank_run() {
    let cpu = Device::cpu();
    for family in FAMILIES {
        let one = serve_one(&cpu, family);
        for world in [2, 4] {
            for tp in [false, true] {
                let ranks = serve_ranks(&cpu, family, world, tp);
                check_ranks(family, &format!("ep x{world} tp {tp}"), &ranks, &one);
            }
        }
    }
}

/// The same on one GPU: two expert-parallel ranks as two engines on one
/// device (pools, folds and base projections through CUDA; the dispatch
/// through the host collective), against the one-rank run on the device.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn two_expert_parallel_ranks_on_one_gpu_equal_the_one_rank_run() {
    let Some(device) =
        lora_kernels::testing::cuda_or_skip("two_expert_parallel_ranks_on_one_gpu_equal_the_one_rank_run")
    else {
        return;
    };
    for family in FAMILIES {
        let one = serve_one(&device, family);
        for tp in [false, true] {
            let ranks = serve_ranks(&device, family, 2, tp);
            check_ranks(family, &format!("cuda ep x2 tp {tp}"), &ranks, &one);
        }
    }
}

fn load_rank_err(family: &str, p: Placement, c: HostCollective) -> EngineError {
    let c: Arc<dyn Collective> = Arc::new(c);
    Engine::load_rank(
        &family_dir(family).join("model"),
        &adapters(family),
        &Device::cpu(),
        options(1, p),
        EngineOptions::default(),
        c,
    )
    .expect_err("refused")
}

#[test]
fn placements_that_are_not_served_are_refused_by_name() {
    // 3 ranks cannot split 4 experts: named.
    let p3 = Placement::SINGLE.with_experts(1, 3).expect("placement");
    let err = load_rank_err("qwen3_moe", p3, HostCollective::group(3)[1].clone());
    assert!(
        matches!(&err, EngineError::Placement(_)) && err.to_string().contains("num_experts"),
        "{err}"
    );
    // Experts under tensor parallelism alone are not cut.
    let tp = Placement::new(0, 2).expect("placement");
    let err = load_rank_err("mixtral", tp, HostCollective::group(2)[0].clone());
    assert!(
        matches!(&err, EngineError::NotTensorParallel { what } if what.contains("ep_world 1")),
        "{err}"
    );
    // Expert parallelism over other ranks than the tensor-parallel ones.
    let crossed = tp.with_experts(1, 2).expect("placement");
    let err = load_rank_err("qwen3_moe", crossed, HostCollective::group(2)[0].clone());
    assert!(matches!(&err, EngineError::NotTensorParallel { .. }), "{err}");
    // A collective of another world than the expert-parallel one.
    let ep = Placement::SINGLE.with_experts(0, 2).expect("placement");
    let err = load_rank_err("qwen3_moe", ep, HostCollective::group(4)[0].clone());
    assert!(matches!(&err, EngineError::Collective(_)), "{err}");
    // Without a collective at all.
    let err = Engine::load(
        &family_dir("qwen3_moe").join("model"),
        &adapters("qwen3_moe"),
        &Device::cpu(),
        options(1, ep),
        EngineOptions::default(),
    )
    .expect_err("refused");
    assert!(matches!(&err, EngineError::NotTensorParallel { .. }), "{err}");
}

fn data_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// Logits of a packed prefill of two prompts, then a decode step.
fn run(model: &Model) -> Vec<f32> {
    let (a, b) = ([1u32, 5, 7, 2, 9], [3u32, 4]);
    let mut caches = vec![KvCache::new(model), KvCache::new(model)];
    let chunks = [SeqChunk { cache: 0, tokens: &a }, SeqChunk { cache: 1, tokens: &b }];
    let mut out = model.forward(&chunks, &mut caches, &mut NoDeltas).expect("prefill");
    let next = [6u32];
    let decode = [
        SeqChunk {
            cache: 0,
            tokens: &next,
        },
        SeqChunk {
            cache: 1,
            tokens: &next,
        },
    ];
    out.extend(model.forward(&decode, &mut caches, &mut NoDeltas).expect("decode"));
    out
}

/// Both on-disk expert layouts (fused and per-expert) of both MoE
/// families, base model alone: every expert-parallel rank's logits equal
/// the whole model's (the per-token sums run in the same order, so
/// exactly with replicated dense parts).
#[test]
fn every_expert_layout_runs_expert_parallel_as_the_whole_model() {
    let dirs = [
        family_dir("qwen3_moe").join("model"),
        family_dir("mixtral").join("model"),
        data_dir("qwen3_moe_legacy"),
        data_dir("mixtral_legacy"),
    ];
    for dir in dirs {
        let whole = Model::load(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("config");
        let want = run(&whole);
        for world in [2usize, 4] {
            for tp in [false, true] {
                let group = HostCollective::group(world);
                let got: Vec<Vec<f32>> = std::thread::scope(|s| {
                    let handles: Vec<_> = group
                        .into_iter()
                        .enumerate()
                        .map(|(rank, c)| {
                            let m = whole
                                .shard(&cfg, placement(rank, world, tp))
                                .expect("divides")
                                .with_collective(Arc::new(c));
                            s.spawn(move || run(&m))
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().expect("rank")).collect()
                });
                for (r, logits) in got.iter().enumerate() {
                    let what = format!("{} x{world} tp {tp} rank {r}", dir.display());
                    let err = rel_error(logits, &want);
                    assert!(err < 1e-5, "{what}: {err}");
                    if !tp {
                        assert_eq!(logits, &want, "{what}: replicated dense parts are exact");
                    }
                    assert_eq!(logits, &got[0], "{what}: ranks agree");
                }
            }
        }
    }
}

/// The dispatch's all-to-all through NCCL (gathers of the lengths and the
/// padded buffers) on a one-rank communicator: what was sent comes back
/// bit for bit, an empty buffer included.
#[test]
#[ignore = "needs a GPU with libnccl: run with --include-ignored where CUDA is usable"]
fn a_one_rank_nccl_all_to_all_returns_what_was_sent() {
    use lora_engine::NcclCollective;
    use lora_kernels::{KernelError, NcclComm};
    let Some(device) = lora_kernels::testing::cuda_or_skip("a_one_rank_nccl_all_to_all_returns_what_was_sent") else {
        return;
    };
    let comm = match NcclComm::one_rank(&device) {
        Err(KernelError::NcclMissing) if std::env::var_os("LORA_REQUIRE_GPU").is_none() => {
            eprintln!("SKIPPED: libnccl is not present");
            return;
        }
        other => other.expect("one-rank communicator"),
    };
    let c = NcclCollective::new(comm, &device);
    let sent: Vec<f32> = (0..70_001).map(|i| i as f32 * 0.37 - 5.0).collect();
    let got = c.all_to_all_v(std::slice::from_ref(&sent)).expect("all_to_all_v");
    assert_eq!(got, [sent]);
    let empty = c.all_to_all_v(&[Vec::new()]).expect("all_to_all_v");
    assert_eq!(empty, [Vec::<f32>::new()]);
}
