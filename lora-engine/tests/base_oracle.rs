//! The base forward against transformers 5 itself.
//!
//! `tests/data/<name>/` holds tiny random models saved by transformers
//! (`make_base_oracle.py`) and `base_logits.safetensors`, transformers' fp32
//! logits of two prompts (and, for MoE layers, the experts its router chose).
//! Every prompt is run four ways — one prefill chunk, token by token through
//! the KV cache, both prompts packed in one batch, and a chunked prefill mixed
//! with the other sequence — and each must match with
//! `‖ours − hf‖ / ‖hf‖ < 1e-4`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lora_engine::{DeltaHooks, EngineError, KvCache, Model, NoDeltas, SeqChunk};
use safetensors::{Dtype, SafeTensors};

const TOL: f64 = 1e-4;

struct Oracle {
    prompts: Vec<Vec<u32>>,
    logits: Vec<Vec<f32>>,
    /// (prompt, layer) -> experts chosen per token, best first, `[len * k]`.
    topk: BTreeMap<(usize, usize), Vec<u32>>,
}

fn data_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn read_oracle(dir: &Path) -> Oracle {
    let bytes = std::fs::read(dir.join("base_logits.safetensors")).expect("oracle file");
    let st = SafeTensors::deserialize(&bytes).expect("oracle safetensors");
    let ints = |name: &str| -> Vec<u32> {
        let t = st.tensor(name).expect(name);
        assert_eq!(t.dtype(), Dtype::I32, "{name}");
        t.data()
            .chunks_exact(4)
            .map(|b| u32::try_from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])).expect("id"))
            .collect()
    };
    let floats = |name: &str| -> Vec<f32> {
        let t = st.tensor(name).expect(name);
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let mut oracle = Oracle {
        prompts: vec![],
        logits: vec![],
        topk: BTreeMap::new(),
    };
    for p in 0.. {
        if st.tensor(&format!("prompt{p}.ids")).is_err() {
            break;
        }
        oracle.prompts.push(ints(&format!("prompt{p}.ids")));
        oracle.logits.push(floats(&format!("prompt{p}.logits")));
    }
    for name in st.names() {
        if let Some(rest) = name.split_once(".topk.layer") {
            let p: usize = rest.0.trim_start_matches("prompt").parse().expect("prompt index");
            let l: usize = rest.1.parse().expect("layer index");
            oracle.topk.insert((p, l), ints(name));
        }
    }
    assert_eq!(oracle.prompts.len(), 2, "{}", dir.display());
    oracle
}

fn rel_err(ours: &[f32], hf: &[f32]) -> f64 {
    assert_eq!(ours.len(), hf.len());
    let diff: f64 = ours
        .iter()
        .zip(hf)
        .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
        .sum();
    let norm: f64 = hf.iter().map(|b| f64::from(*b).powi(2)).sum();
    (diff / norm).sqrt()
}

/// Records the experts each MoE layer chose (no deltas).
#[derive(Default)]
struct RouteRecorder {
    topk: BTreeMap<usize, Vec<u32>>,
}

impl DeltaHooks for RouteRecorder {
    fn embed(&mut self, _: &[u32], _: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn qkv(&mut self, _: usize, _: &[f32], _: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn o(&mut self, _: usize, _: &[f32], _: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn gate_up(&mut self, _: usize, _: &[f32], _: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn down(&mut self, _: usize, _: &[f32], _: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn router(&mut self, _: usize, _: &[f32], _: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn expert_gate_up(&mut self, layer: usize, _: &[f32], topk: &[u32], _: &mut [f32]) -> Result<(), EngineError> {
        self.topk.insert(layer, topk.to_vec());
        Ok(())
    }
    fn expert_down(&mut self, _: usize, _: &[f32], _: &[u32], _: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn lm_head(&mut self, _: &[f32], _: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
}

fn check_family(name: &str) {
    let dir = data_dir(name);
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let oracle = read_oracle(&dir);
    let vocab = model.config().vocab;
    let fresh = || KvCache::new(&model);
    let mut report = Vec::new();

    for (p, (ids, hf)) in oracle.prompts.iter().zip(&oracle.logits).enumerate() {
        // 1. one prefill chunk, recording the routing
        let mut caches = vec![fresh()];
        let mut rec = RouteRecorder::default();
        let prefill = model
            .forward(&[SeqChunk { cache: 0, tokens: ids }], &mut caches, &mut rec)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(caches[0].len(), ids.len());
        let e1 = rel_err(&prefill, hf);
        assert!(e1 < TOL, "{name} prompt {p} prefill: rel err {e1:e}");
        for layer in model.config().moe_layers() {
            let want = oracle
                .topk
                .get(&(p, layer))
                .unwrap_or_else(|| panic!("{name}: no topk for layer {layer}"));
            assert_eq!(
                rec.topk.get(&layer),
                Some(want),
                "{name} prompt {p} layer {layer}: routing differs"
            );
            let k = model.config().moe.as_ref().map_or(1, |m| m.top_k);
            let mut sets: Vec<Vec<u32>> = want
                .chunks(k)
                .map(|c| {
                    let mut c = c.to_vec();
                    c.sort_unstable();
                    c
                })
                .collect();
            sets.sort();
            sets.dedup();
            assert!(sets.len() >= 3, "{name} layer {layer}: routing too uniform to test");
        }

        // 2. token by token through the cache
        let mut caches = vec![fresh()];
        let mut stepped = Vec::with_capacity(ids.len() * vocab);
        for t in ids {
            let out = model
                .forward(
                    &[SeqChunk {
                        cache: 0,
                        tokens: std::slice::from_ref(t),
                    }],
                    &mut caches,
                    &mut NoDeltas,
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            stepped.extend(out);
        }
        let e2 = rel_err(&stepped, hf);
        assert!(e2 < TOL, "{name} prompt {p} decode: rel err {e2:e}");
        report.push((p, e1, e2));
    }

    // 3. both prompts packed in one batch (cache order reversed, to decouple
    //    cache index from chunk order)
    let (a, b) = (&oracle.prompts[0], &oracle.prompts[1]);
    let mut caches = vec![fresh(), fresh()];
    let packed = model
        .forward(
            &[SeqChunk { cache: 1, tokens: a }, SeqChunk { cache: 0, tokens: b }],
            &mut caches,
            &mut NoDeltas,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let (pa, pb) = packed.split_at(a.len() * vocab);
    for (p, ours) in [(0, pa), (1, pb)] {
        let e = rel_err(ours, &oracle.logits[p]);
        assert!(e < TOL, "{name} prompt {p} packed: rel err {e:e}");
    }
    assert_eq!((caches[1].len(), caches[0].len()), (a.len(), b.len()));

    // 4. chunked prefill of A mixed with B: [A[..4], B[..2]] then [B[2..], A[4..]]
    let mut caches = vec![fresh(), fresh()];
    let first = model
        .forward(
            &[
                SeqChunk {
                    cache: 0,
                    tokens: &a[..4],
                },
                SeqChunk {
                    cache: 1,
                    tokens: &b[..2],
                },
            ],
            &mut caches,
            &mut NoDeltas,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let second = model
        .forward(
            &[
                SeqChunk {
                    cache: 1,
                    tokens: &b[2..],
                },
                SeqChunk {
                    cache: 0,
                    tokens: &a[4..],
                },
            ],
            &mut caches,
            &mut NoDeltas,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let (fa, fb) = first.split_at(4 * vocab);
    let (sb, sa) = second.split_at((b.len() - 2) * vocab);
    let ours_a: Vec<f32> = fa.iter().chain(sa).copied().collect();
    let ours_b: Vec<f32> = fb.iter().chain(sb).copied().collect();
    for (p, ours) in [(0, &ours_a), (1, &ours_b)] {
        let e = rel_err(ours, &oracle.logits[p]);
        assert!(e < TOL, "{name} prompt {p} chunked: rel err {e:e}");
    }
    for (p, e1, e2) in report {
        println!("{name} prompt {p}: prefill rel err {e1:.2e}, decode rel err {e2:.2e}");
    }
}

#[test]
fn llama_matches_transformers() {
    check_family("llama");
}

#[test]
fn mistral_sliding_window_matches_transformers() {
    check_family("mistral");
}

#[test]
fn qwen2_matches_transformers() {
    check_family("qwen2");
}

#[test]
fn qwen3_untied_matches_transformers() {
    check_family("qwen3");
}

#[test]
fn qwen3_tied_bf16_matches_transformers() {
    check_family("qwen3_tied");
}

#[test]
fn qwen3_moe_fused_matches_transformers() {
    check_family("qwen3_moe");
}

#[test]
fn qwen3_moe_legacy_matches_transformers() {
    check_family("qwen3_moe_legacy");
}

#[test]
fn mixtral_fused_matches_transformers() {
    check_family("mixtral");
}

#[test]
fn mixtral_legacy_matches_transformers() {
    check_family("mixtral_legacy");
}
