//! The base projections on CUDA (cuBLAS SGEMM over f32 weights uploaded
//! once) against the host model, for every engine fixture family: the same
//! logits within 1e-4 relative error per token, over a packed prefill of
//! several prompts and a decode step after it. On the CPU backend
//! `Model::load_on` is the host model, bit for bit.

mod common;

use common::family_dir;

use lora_engine::{KvCache, Model, NoDeltas, SeqChunk, parse_requests};
use lora_kernels::Device;
use lora_kernels::testing::{cuda_or_skip, rel_error};

const FAMILIES: [&str; 7] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_untied",
    "qwen3_moe",
    "mixtral",
];

/// The family's distinct request prompts (at most four).
fn prompts(family: &str) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(family_dir(family).join("requests.json")).expect("requests.json");
    let mut out: Vec<Vec<u32>> = Vec::new();
    for r in parse_requests(&text).expect("valid requests") {
        if !out.contains(&r.prompt) && out.len() < 4 {
            out.push(r.prompt);
        }
    }
    out
}

/// Logits of one packed prefill of `prompts`, then of one decode step
/// feeding each sequence token `7`.
fn run(model: &Model, prompts: &[Vec<u32>]) -> (Vec<f32>, Vec<f32>) {
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| KvCache::new(model)).collect();
    let chunks: Vec<SeqChunk<'_>> = prompts
        .iter()
        .enumerate()
        .map(|(cache, tokens)| SeqChunk { cache, tokens })
        .collect();
    let prefill = model.forward(&chunks, &mut caches, &mut NoDeltas).expect("prefill");
    let next = [7u32];
    let decode: Vec<SeqChunk<'_>> = (0..prompts.len())
        .map(|cache| SeqChunk { cache, tokens: &next })
        .collect();
    let step = model.forward(&decode, &mut caches, &mut NoDeltas).expect("decode");
    (prefill, step)
}

/// The largest per-token relative error of `got` against `want`.
fn worst_row(got: &[f32], want: &[f32], vocab: usize) -> f64 {
    assert_eq!(got.len(), want.len());
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| rel_error(g, w))
        .fold(0.0, f64::max)
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn cuda_base_projections_match_the_host_model() {
    let Some(device) = cuda_or_skip("cuda_base_projections_match_the_host_model") else {
        return;
    };
    for family in FAMILIES {
        let dir = family_dir(family).join("model");
        let host = Model::load(&dir).unwrap_or_else(|e| panic!("{family}: {e}"));
        let cuda = Model::load_on(&dir, &device).unwrap_or_else(|e| panic!("{family}: {e}"));
        assert!(
            cuda.device().is_some_and(|d| d.same_as(&device)),
            "{family}: not on the device"
        );
        assert!(host.device().is_none());
        let vocab = host.config().vocab;
        let prompts = prompts(family);
        let (host_prefill, host_step) = run(&host, &prompts);
        let (cuda_prefill, cuda_step) = run(&cuda, &prompts);
        let prefill_err = worst_row(&cuda_prefill, &host_prefill, vocab);
        let step_err = worst_row(&cuda_step, &host_step, vocab);
        eprintln!("{family}: prefill rel err {prefill_err:.2e}, decode {step_err:.2e}");
        assert!(
            prefill_err <= 1e-4,
            "{family}: prefill logits rel err {prefill_err:.3e}"
        );
        assert!(step_err <= 1e-4, "{family}: decode logits rel err {step_err:.3e}");
        // Back on the CPU backend the model is the host model again.
        let back = cuda.on_device(&Device::cpu()).expect("to the host");
        assert!(back.device().is_none());
        assert_eq!(run(&back, &prompts), (host_prefill, host_step), "{family}");
    }
}

#[test]
fn the_cpu_backend_runs_the_host_model_unchanged() {
    for family in ["llama", "qwen3", "qwen3_moe"] {
        let dir = family_dir(family).join("model");
        let host = Model::load(&dir).unwrap_or_else(|e| panic!("{family}: {e}"));
        let cpu = Model::load_on(&dir, &Device::cpu()).unwrap_or_else(|e| panic!("{family}: {e}"));
        assert!(cpu.device().is_none(), "{family}");
        let prompts = prompts(family);
        assert_eq!(run(&cpu, &prompts), run(&host, &prompts), "{family}");
    }
}
