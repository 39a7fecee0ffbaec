//! The reference engine tensor-parallel on the CPU backend: every dense
//! engine family's mixed request batch (base rows, several adapters, more
//! adapters than slots) served by 2 and 4 ranks run as threads — each rank
//! a base model cut by `Model::shard`, a pool holding its shard of every
//! adapter, the row-parallel outputs all-reduced on the host
//! (`HostCollective`) — gives every rank the one-rank run's outputs: the
//! same greedy tokens and the same logits within 1e-3 relative (summation
//! order and the BF16 rounding of the ranks' partial shrink outputs are
//! all that differ), and the ranks agree with each other exactly.
//! 4 ranks cut the fixtures' 2 key/value heads by replication, as the
//! base model replicates them. `llama_embed` (embedding-LoRA adapters
//! beside trainable tokens, `LoraOptions::embedding_lora`) is served the
//! same way: the embedding pair is replicated, whole on every rank, as the
//! cut base model keeps the embedding table whole. `llama_lm_head`
//! (head-LoRA adapters, `LoraOptions::lm_head_lora`) likewise: the head
//! pair is replicated, whole on every rank, and the logits hook adds its
//! whole delta to the whole logits, as the cut base model keeps lm_head
//! whole. With the vocab-parallel cut on (`Placement::vocab_parallel`,
//! `LORA_VOCAB_PARALLEL`) every family is served again by 2 and 4 ranks
//! whose base embedding and lm_head hold the rank's vocabulary rows (a tied
//! head the same rows): the embedding pairs, the head pairs and the token
//! overlays (trainable tokens, `modules_to_save` tables, tied and untied)
//! hold the rank's block, the embedding rows are all-reduced and the
//! logits all-gathered, and the outputs equal the one-rank run's.
//!
//! The same runs under the placement's fully-sharded option
//! (`LORA_FULLY_SHARDED`, vLLM's `fully_sharded_loras`): each rank's pool
//! holds only its block of rank rows of every column-parallel A, and its
//! column-parallel deltas all-gather the ranks' shrink outputs through the
//! rank's collective (`Collective::all_gather`) before the expand; the
//! outputs equal the one-rank run's by the same bounds, alone and together
//! with the vocab-parallel cut.

mod common;

use common::{adapters, check_rank_output, family_dir, requests, serve};
use std::sync::Arc;

use lora_audit::LoraOptions;
use lora_engine::{Collective, Engine, EngineError, EngineOptions, HostCollective, RequestOutput, rel_error};
use lora_kernels::Device;
use lora_layout::Placement;

const TP_TOL: f64 = 1e-3;

fn options(family: &str, max_loras: usize, placement: Placement) -> LoraOptions {
    LoraOptions {
        max_loras,
        max_rank: 16,
        placement,
        embedding_lora: family == "llama_embed",
        lm_head_lora: family == "llama_lm_head",
        ..LoraOptions::default()
    }
}

fn serve_ranks(family: &str, world: usize, vocab_parallel: bool, fully_sharded: bool) {
    let dir = family_dir(family).join("model");
    let adapters = adapters(family);
    let max_loras = adapters.len().saturating_sub(1).max(1);
    let reqs = requests(family);
    let one = serve(
        Engine::load(
            &dir,
            &adapters,
            &Device::cpu(),
            options(family, max_loras, Placement::SINGLE),
            EngineOptions::default(),
        ),
        &reqs,
        family,
    );
    let group = HostCollective::group(world);
    let ranks: Vec<Vec<RequestOutput>> = std::thread::scope(|s| {
        let handles: Vec<_> = Placement::new(0, world)
            .expect("placement")
            .with_vocab_parallel(vocab_parallel)
            .ranks()
            .zip(group)
            .map(|(p, c)| {
                let (dir, adapters, reqs) = (&dir, &adapters, &reqs);
                s.spawn(move || {
                    let what = format!("{family} rank {} of {world}", p.tp_rank());
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let engine = Engine::load_rank(
                        dir,
                        adapters,
                        &Device::cpu(),
                        options(family, max_loras, p.with_fully_sharded(fully_sharded)),
                        EngineOptions::default(),
                        c,
                    );
                    // The rank's pool holds its block of q's rank rows only
                    // under the option.
                    let q_rows = engine.as_ref().ok().and_then(|e| {
                        let layout = e.pool().layout();
                        layout.entry(0, lora_layout::LoraModule::QProj).map(|q| q.a_rows)
                    });
                    assert_eq!(q_rows, Some(if fully_sharded { 16 / world } else { 16 }), "{what}");
                    serve(engine, reqs, &what)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    for (r, outs) in ranks.iter().enumerate() {
        for (i, (got, want)) in outs.iter().zip(&one).enumerate() {
            let what = format!(
                "{family} x{world} (vocab-parallel {vocab_parallel}, fully sharded {fully_sharded}) rank {r} request {i} ({:?})",
                reqs[i].adapter
            );
            check_rank_output(&what, got, want, &ranks[0][i], TP_TOL);
        }
    }
    assert!(reqs.iter().any(|r| r.adapter.is_some()), "{family}: no adapted request");
}

/// The dense fixture families (the embedding's and the head's places
/// included), each served by 2 and by 4 ranks.
fn serve_dense_families(vocab_parallel: bool, fully_sharded: bool) {
    for family in [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_untied",
        "llama_embed",
        "llama_lm_head",
    ] {
        for world in [2, 4] {
            serve_ranks(family, world, vocab_parallel, fully_sharded);
        }
    }
}

#[test]
fn dense_families_served_by_ranks_as_threads_equal_the_one_rank_run() {
    serve_dense_families(false, false);
}

#[test]
fn dense_families_served_by_vocab_parallel_ranks_equal_the_one_rank_run() {
    serve_dense_families(true, false);
}

#[test]
fn dense_families_served_fully_sharded_by_ranks_as_threads_equal_the_one_rank_run() {
    serve_dense_families(false, true);
}

#[test]
fn fully_sharded_vocab_parallel_ranks_equal_the_one_rank_run() {
    for family in ["qwen3_untied", "llama_embed", "llama_lm_head"] {
        serve_ranks(family, 2, true, true);
    }
}

#[test]
fn a_tensor_parallel_engine_needs_its_collective_and_a_dense_model() {
    let dir = family_dir("llama").join("model");
    let adapters = adapters("llama");
    let p = Placement::new(1, 2).expect("placement");
    let err = Engine::load(
        &dir,
        &adapters,
        &Device::cpu(),
        options("llama", 1, p),
        EngineOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, EngineError::NotTensorParallel { .. }), "{err}");
    // A collective of another rank.
    let group = HostCollective::group(2);
    let c: Arc<dyn Collective> = Arc::new(group[0].clone());
    let err = Engine::load_rank(
        &dir,
        &adapters,
        &Device::cpu(),
        options("llama", 1, p),
        EngineOptions::default(),
        c,
    )
    .unwrap_err();
    assert!(matches!(err, EngineError::Collective(_)), "{err}");
    // 8 ranks cannot cut 4 attention heads: named.
    let group = HostCollective::group(8);
    let p8 = Placement::new(0, 8).expect("placement");
    let c: Arc<dyn Collective> = Arc::new(group[0].clone());
    let err = Engine::load_rank(
        &dir,
        &adapters,
        &Device::cpu(),
        options("llama", 1, p8),
        EngineOptions::default(),
        c,
    )
    .unwrap_err();
    assert!(err.to_string().contains("num_attention_heads"), "{err}");
    // The routed experts of an MoE model are not cut.
    let moe = family_dir("qwen3_moe").join("model");
    let group = HostCollective::group(2);
    let c: Arc<dyn Collective> = Arc::new(group[1].clone());
    let err = Engine::load_rank(
        &moe,
        &[],
        &Device::cpu(),
        options("llama", 1, p),
        EngineOptions::default(),
        c,
    )
    .unwrap_err();
    assert!(matches!(err, EngineError::NotTensorParallel { .. }), "{err}");
}

/// A tensor-parallel rank refuses a pool built for DoRA, naming it: the
/// rescale divides by the norm of each whole weight row, which a
/// row-parallel rank's shard does not hold. The one-rank engine serves
/// the same family (`peft_engine`'s qwen2_dora).
#[test]
fn a_tensor_parallel_engine_refuses_dora() {
    let dir = family_dir("qwen2_dora").join("model");
    let adapters = adapters("qwen2_dora");
    let p = Placement::new(0, 2).expect("placement");
    let group = HostCollective::group(2);
    let c: Arc<dyn Collective> = Arc::new(group[0].clone());
    let lora = LoraOptions {
        dora: true,
        ..options("qwen2_dora", 2, p)
    };
    let err = Engine::load_rank(&dir, &adapters, &Device::cpu(), lora, EngineOptions::default(), c).unwrap_err();
    assert!(
        matches!(&err, EngineError::NotTensorParallel { what } if what.contains("DoRA")),
        "{err}"
    );
}

/// The engine as rank 0 of a one-rank NCCL group on one GPU: every
/// all-reduce goes through NCCL, and the outputs equal `Engine::load`'s on
/// the same device.
#[test]
#[ignore = "needs a GPU with libnccl: run with --include-ignored where CUDA is usable"]
fn a_one_rank_nccl_group_serves_as_the_engine_does_on_one_gpu() {
    use lora_engine::NcclCollective;
    use lora_kernels::{KernelError, NcclComm};
    let Some(device) =
        lora_kernels::testing::cuda_or_skip("a_one_rank_nccl_group_serves_as_the_engine_does_on_one_gpu")
    else {
        return;
    };
    let comm = match NcclComm::one_rank(&device) {
        Err(KernelError::NcclMissing) if std::env::var_os("LORA_REQUIRE_GPU").is_none() => {
            eprintln!("SKIPPED: libnccl is not present");
            return;
        }
        other => other.expect("one-rank communicator"),
    };
    let family = "llama";
    let dir = family_dir(family).join("model");
    let adapters = adapters(family);
    let reqs = requests(family);
    let max_loras = adapters.len();
    let lora = || options(family, max_loras, Placement::SINGLE);
    let one = serve(
        Engine::load(&dir, &adapters, &device, lora(), EngineOptions::default()),
        &reqs,
        family,
    );
    let c: Arc<dyn Collective> = Arc::new(NcclCollective::new(comm, &device));
    let nccl = serve(
        Engine::load_rank(&dir, &adapters, &device, lora(), EngineOptions::default(), c),
        &reqs,
        "nccl",
    );
    for (i, (got, want)) in nccl.iter().zip(&one).enumerate() {
        assert_eq!(got.tokens, want.tokens, "request {i}");
        let err = rel_error(&got.logits_prompt, &want.logits_prompt);
        assert!(err < TP_TOL, "request {i}: {err}");
    }
}
