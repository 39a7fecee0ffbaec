//! Synthetic PEFT adapters of production-like width, written to disk in
//! the transformers 4.x per-expert format and loaded through the real audit
//! and pool: random inputs at shapes the tiny fixtures do not reach (many
//! experts, wide rows, several row windows per launch).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use lora_kernels::Device;
use lora_kernels::testing::Rng;
use lora_layout::{ExpertProj, ModelConfig};
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, serialize_to_file};

/// A Qwen3-MoE config: hidden 512, 16 experts of width 256, top-4, two
/// MoE layers.
pub const CONFIG: &str = r#"{
    "model_type": "qwen3_moe", "hidden_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 16,
    "num_experts_per_tok": 4, "mlp_only_layers": [], "decoder_sparse_step": 1,
    "vocab_size": 128 }"#;

/// What one synthetic adapter adapts.
#[derive(Debug, Clone)]
pub struct Spec {
    pub name: &'static str,
    pub rank: usize,
    pub alpha: f32,
    /// (expert, projection) pairs adapted in every MoE layer.
    pub sites: Vec<(usize, ExpertProj)>,
    pub router: bool,
}

/// Three adapters: every expert and the router at rank 8; the Down of
/// experts 0..8 and the router at rank 16; Gate and Up of odd experts at
/// rank 5 with no router.
pub fn specs() -> Vec<Spec> {
    let all = |projs: &[ExpertProj], experts: &mut dyn Iterator<Item = usize>| -> Vec<(usize, ExpertProj)> {
        experts.flat_map(|e| projs.iter().map(move |&p| (e, p))).collect()
    };
    vec![
        Spec {
            name: "every-expert-r8",
            rank: 8,
            alpha: 16.0,
            sites: all(&ExpertProj::ALL, &mut (0..16)),
            router: true,
        },
        Spec {
            name: "down-r16",
            rank: 16,
            alpha: 8.0,
            sites: all(&[ExpertProj::Down], &mut (0..8)),
            router: true,
        },
        Spec {
            name: "odd-gate-up-r5",
            rank: 5,
            alpha: 10.0,
            sites: all(&[ExpertProj::Gate, ExpertProj::Up], &mut (1..16).step_by(2)),
            router: false,
        },
    ]
}

fn f32_bytes(rng: &mut Rng, len: usize, amp: f32) -> Vec<u8> {
    (0..len).flat_map(|_| (rng.uniform() * amp).to_le_bytes()).collect()
}

/// Write `spec` as a PEFT adapter directory under `root`.
pub fn write_adapter(root: &Path, cfg: &ModelConfig, spec: &Spec, seed: u64) -> PathBuf {
    let dir = root.join(spec.name);
    std::fs::create_dir_all(&dir).unwrap();
    let config = format!(
        r#"{{"peft_type": "LORA", "r": {}, "lora_alpha": {}, "target_modules": ["gate_proj", "up_proj", "down_proj", "gate"]}}"#,
        spec.rank, spec.alpha
    );
    std::fs::write(dir.join("adapter_config.json"), config).unwrap();
    let mut rng = Rng::new(seed);
    let r = spec.rank;
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut pair = |prefix: String, out: usize, inp: usize| {
        let a = f32_bytes(&mut rng, r * inp, 1.0 / (inp as f32).sqrt());
        let b = f32_bytes(&mut rng, out * r, 1.0 / (r as f32).sqrt());
        tensors.push((format!("{prefix}.lora_A.weight"), vec![r, inp], a));
        tensors.push((format!("{prefix}.lora_B.weight"), vec![out, r], b));
    };
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        let base = format!("base_model.model.model.layers.{layer}.mlp");
        for &(e, proj) in &spec.sites {
            let (out, inp) = proj.dims(cfg).unwrap();
            pair(format!("{base}.experts.{e}.{}", proj.name()), out, inp);
        }
        if spec.router {
            let (out, inp) = lora_layout::router_dims(cfg).unwrap();
            pair(format!("{base}.gate"), out, inp);
        }
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, data)| (name.clone(), TensorView::new(Dtype::F32, shape.clone(), data).unwrap()))
        .collect();
    serialize_to_file(views, None, &dir.join("adapter_model.safetensors")).unwrap();
    dir
}

/// A directory of its own under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("lora-moe-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Best effort: a leftover temp dir is not a test failure.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The synthetic model, its adapters written to a temp dir (kept while the
/// returned [`TempDir`] lives), and a pool on `device` holding them in slots
/// 0..3 (slot 3 empty).
pub fn load(device: &Device, tag: &str) -> (LoraPool, Vec<&'static str>, Vec<PathBuf>, TempDir) {
    let cfg = ModelConfig::from_hf_config(CONFIG).unwrap();
    let root = TempDir::new(tag);
    let specs = specs();
    let dirs: Vec<PathBuf> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| write_adapter(&root.0, &cfg, s, 0x5eed + i as u64))
        .collect();
    let names: Vec<&'static str> = specs.iter().map(|s| s.name).collect();
    let sources: Vec<AdapterSource<'_>> = names
        .iter()
        .zip(&dirs)
        .map(|(name, dir)| AdapterSource { name, dir })
        .collect();
    let opts = LoraOptions {
        max_loras: specs.len() + 1,
        max_rank: 16,
        experts: true,
        ..LoraOptions::default()
    };
    let capacity = BatchCapacity {
        max_rows: 2048,
        max_segments: 16,
    };
    let pool = LoraPool::load(device, cfg, opts, capacity, &sources).unwrap();
    (pool, names, dirs, root)
}
