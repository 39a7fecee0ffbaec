//! The reference engine against PEFT itself: every family's mixed request
//! batch (base rows, several adapters, more adapters than slots) served by
//! continuous batching on the CPU backend, each request's prompt logits,
//! greedy tokens and step logits compared with PEFT's (fixtures made by
//! `fixtures/make_engine_fixtures.py`: real `peft` on tiny random models,
//! fp32 full forwards).

mod common;

use common::{adapters, family_dir, requests};

use lora_audit::LoraOptions;
use lora_engine::{
    ANSWER_TOLERANCE, AdapterDir, Answers, Engine, EngineError, EngineEvent, EngineOptions, Request, RequestOutput,
    TokenMatch, compare, rel_error,
};
use lora_kernels::Device;
use lora_kernels::testing::cuda_or_skip;
use lora_pool::PoolError;

fn oracle(family: &str) -> Answers {
    Answers::read(&family_dir(family).join("peft.safetensors")).expect("peft.safetensors")
}

fn options(family: &str, max_loras: usize) -> LoraOptions {
    LoraOptions {
        max_loras,
        max_rank: 16,
        experts: matches!(family, "qwen3_moe" | "mixtral"),
        dora: family == "qwen2_dora",
        embedding_lora: family == "llama_embed",
        lm_head_lora: family == "llama_lm_head",
        ..LoraOptions::default()
    }
}

fn engine(family: &str, max_loras: usize) -> Engine {
    engine_on(&Device::cpu(), family, max_loras)
}

fn engine_on(device: &Device, family: &str, max_loras: usize) -> Engine {
    Engine::load(
        &family_dir(family).join("model"),
        &adapters(family),
        device,
        options(family, max_loras),
        EngineOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{family}: {e}"))
}

/// Compare request `i`'s output with PEFT's; returns the prompt logits'
/// relative error.
fn check(family: &str, oracle: &Answers, i: usize, out: &RequestOutput, vocab: usize) -> f64 {
    let reference = oracle.request(i).expect("PEFT answered every request");
    assert_eq!(
        out.tokens.len(),
        reference.tokens.len(),
        "{family} request {i}: token count"
    );
    let c = compare(out, &reference, vocab);
    assert!(
        c.prompt_err <= ANSWER_TOLERANCE,
        "{family} request {i}: prompt logits rel err {:.3e} > {ANSWER_TOLERANCE}",
        c.prompt_err
    );
    assert!(
        c.step_err <= ANSWER_TOLERANCE,
        "{family} request {i}: step logits rel err {:.3e} > {ANSWER_TOLERANCE}",
        c.step_err
    );
    assert!(
        !matches!(c.tokens, TokenMatch::Differ(_)),
        "{family} request {i}: greedy tokens {:?} differ from PEFT's {:?} ({:?})",
        out.tokens,
        reference.tokens,
        c.tokens
    );
    c.prompt_err
}

/// Serve `family`'s batch with fewer slots than adapters, and each adapted
/// request once more without its adapter (the check's teeth).
fn serve_family(family: &str) {
    serve_family_on(&Device::cpu(), family);
}

fn serve_family_on(device: &Device, family: &str) {
    let adapters = adapters(family);
    let max_loras = adapters.len().saturating_sub(1).max(1);
    let mut engine = engine_on(device, family, max_loras);
    let reqs = requests(family);
    let oracle = oracle(family);
    let vocab = engine.model().config().vocab;
    for r in &reqs {
        engine.submit(r.clone()).expect("submit");
    }
    let mut unadapted = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        if r.adapter.is_some() {
            let bare = Request {
                adapter: None,
                ..r.clone()
            };
            unadapted.push((i, engine.submit(bare).expect("submit")));
        }
    }
    engine.run().unwrap_or_else(|e| panic!("{family}: {e}"));
    for (i, r) in reqs.iter().enumerate() {
        let out = engine.output(i).expect("finished");
        let err = check(family, &oracle, i, out, vocab);
        eprintln!("{family} request {i} ({:?}): rel err {err:.2e}", r.adapter);
    }
    assert!(!unadapted.is_empty(), "{family}: no adapted request");
    for (i, j) in unadapted {
        let out = engine.output(j).expect("finished");
        let miss = rel_error(&out.logits_prompt, oracle.request(i).expect("answered").logits_prompt);
        assert!(
            miss > 5.0 * ANSWER_TOLERANCE,
            "{family} request {i}: served without its adapter it misses PEFT by only {miss:.3e}"
        );
    }
    if adapters.len() > max_loras {
        assert!(
            engine
                .events()
                .iter()
                .any(|e| matches!(e, EngineEvent::Promoted { replaced: Some(_), .. })),
            "{family}: {} adapters in {max_loras} slots, but nothing was evicted",
            adapters.len()
        );
    }
}

#[test]
fn llama_batch_matches_peft() {
    serve_family("llama");
}

/// LoRA on the input embedding beside trainable tokens and base rows, in
/// fewer slots than adapters.
#[test]
fn llama_embedding_lora_batch_matches_peft() {
    serve_family("llama_embed");
}

/// LoRA on the output head beside head trainable tokens (in one adapter
/// and in other slots) and base rows, in fewer slots than adapters.
#[test]
fn llama_lm_head_lora_batch_matches_peft() {
    serve_family("llama_lm_head");
}

#[test]
fn mistral_batch_matches_peft() {
    serve_family("mistral");
}

#[test]
fn qwen2_batch_matches_peft() {
    serve_family("qwen2");
}

/// DoRA adapters (every projection, biased q/k/v; rsLoRA with
/// alpha_pattern) and a plain adapter in one mixed batch with base rows,
/// on a pool built for DoRA that holds the model's projections.
#[test]
fn qwen2_dora_batch_matches_peft() {
    serve_family("qwen2_dora");
}

/// An engine whose pool is not built for DoRA refuses a DoRA adapter
/// before serving anything.
#[test]
fn dora_adapters_need_a_pool_built_for_dora() {
    let family = "qwen2_dora";
    let mut opts = options(family, 2);
    opts.dora = false;
    let err = Engine::load(
        &family_dir(family).join("model"),
        &adapters(family),
        &Device::cpu(),
        opts,
        EngineOptions::default(),
    )
    .expect_err("a DoRA adapter on a pool without DoRA");
    assert!(err.to_string().contains("REJECT[dora]"), "{err}");
}

#[test]
fn qwen3_tied_batch_matches_peft() {
    serve_family("qwen3");
}

#[test]
fn qwen3_untied_batch_matches_peft() {
    serve_family("qwen3_untied");
}

#[test]
fn qwen3_moe_batch_matches_peft() {
    serve_family("qwen3_moe");
}

#[test]
fn mixtral_batch_matches_peft() {
    serve_family("mixtral");
}

/// Every family on CUDA: the base projections through cuBLAS, the deltas,
/// overlays and MoE folds through the project's CUDA kernels.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn every_family_matches_peft_on_cuda() {
    let Some(device) = cuda_or_skip("every_family_matches_peft_on_cuda") else {
        return;
    };
    for family in [
        "llama",
        "llama_embed",
        "llama_lm_head",
        "mistral",
        "qwen2",
        "qwen2_dora",
        "qwen3",
        "qwen3_untied",
        "qwen3_moe",
        "mixtral",
    ] {
        serve_family_on(&device, family);
    }
}

/// The same prompt with the same adapter reuses its KV; the same prompt on
/// the base model does not.
#[test]
fn prefix_cache_is_keyed_by_adapter_identity() {
    let family = "qwen3_moe";
    let reqs = requests(family);
    let mut engine = engine(family, 2);
    for r in &reqs {
        engine.submit(r.clone()).expect("submit");
    }
    engine.run().expect("run");
    let hits: Vec<usize> = engine
        .events()
        .iter()
        .filter_map(|e| match e {
            EngineEvent::PrefixHit { request } => Some(*request),
            _ => None,
        })
        .collect();
    for &h in &hits {
        let same = reqs[..h]
            .iter()
            .any(|r| r.prompt == reqs[h].prompt && r.adapter == reqs[h].adapter);
        assert!(same, "request {h} hit the prefix cache without an earlier twin");
    }
    assert!(!hits.is_empty(), "no request reused a prefix: {:?}", engine.events());
    let oracle = oracle(family);
    let vocab = engine.model().config().vocab;
    for &h in &hits {
        check(family, &oracle, h, engine.output(h).expect("finished"), vocab);
    }
}

/// Mid-run: swaps and evictions of held slots are refused and change
/// nothing; a refused adapter's swap changes nothing; an idle slot's
/// eviction and swap go through; every output still equals PEFT's.
#[test]
fn swaps_and_evictions_mid_run() {
    let family = "llama";
    let reqs = requests(family);
    let oracle = oracle(family);
    let mut engine = engine(family, 3);
    let vocab = engine.model().config().vocab;
    for r in &reqs {
        engine.submit(r.clone()).expect("submit");
    }
    engine.step().expect("step 0");
    engine.step().expect("step 1");
    let held: Vec<_> = engine
        .pool()
        .slot_ids()
        .filter(|&s| engine.pool().ref_count(s) > 0)
        .collect();
    assert!(!held.is_empty(), "no slot is held after two steps");
    let refused = family_dir(family).join("refused").join("dora");
    let adapter = adapters(family)[0].clone();
    for &slot in &held {
        let before = engine.pool().slot_contents(slot).expect("contents");
        assert!(matches!(
            engine.pool_mut().evict(slot),
            Err(PoolError::SlotInUse { .. })
        ));
        assert!(matches!(
            engine.pool_mut().swap_from_disk(slot, "other", &adapter.dir),
            Err(PoolError::SlotInUse { .. })
        ));
        assert_eq!(engine.pool().slot_contents(slot).expect("contents"), before);
    }
    // Requests 0-3 run rslora_all_linear, the base and tokens_dict_untied:
    // modules_to_save_tables' slot is idle.
    let idle = engine
        .pool()
        .slot_ids()
        .find(|&s| engine.pool().ref_count(s) == 0)
        .expect("an idle slot after two steps");
    let name = engine.pool().slots()[idle.index()].name.clone();
    let dir = adapters(family)
        .into_iter()
        .find(|a| a.name == name)
        .expect("the idle slot holds a library adapter")
        .dir;
    let before = engine.pool().slot_contents(idle).expect("contents");
    assert!(engine.pool_mut().swap_from_disk(idle, "dora", &refused).is_err());
    assert_eq!(engine.pool().slot_contents(idle).expect("contents"), before);
    engine.pool_mut().evict(idle).expect("an idle slot evicts");
    // Swapped back in between steps: the later requests for it serve these bytes.
    let swapped = engine.pool_mut().swap_from_disk(idle, &name, &dir).expect("swap");
    assert_eq!(engine.pool().slot_contents(idle).expect("contents"), before);
    assert!(swapped.generation > 0);
    engine.run().expect("run");
    for i in 0..reqs.len() {
        check(family, &oracle, i, engine.output(i).expect("finished"), vocab);
    }
}

#[test]
fn a_refused_adapter_is_named() {
    let family = "llama";
    let mut all = adapters(family);
    all.push(AdapterDir {
        name: "dora".into(),
        dir: family_dir(family).join("refused").join("dora"),
    });
    let err = Engine::load(
        &family_dir(family).join("model"),
        &all,
        &Device::cpu(),
        options(family, 2),
        EngineOptions::default(),
    )
    .expect_err("refused");
    assert!(
        matches!(&err, EngineError::AdapterRefused { name, .. } if name == "dora"),
        "{err}"
    );
}

#[test]
fn bad_requests_are_refused_and_queue_nothing() {
    let family = "llama";
    let mut engine = engine(family, 2);
    let vocab = engine.model().config().vocab as u32;
    for bad in [
        Request {
            prompt: vec![vocab],
            adapter: None,
            max_new_tokens: 1,
        },
        Request {
            prompt: vec![],
            adapter: None,
            max_new_tokens: 1,
        },
        Request {
            prompt: vec![1],
            adapter: Some("nope".into()),
            max_new_tokens: 1,
        },
    ] {
        assert!(matches!(engine.submit(bad), Err(EngineError::Request { .. })));
    }
    assert!(engine.is_idle());
}
