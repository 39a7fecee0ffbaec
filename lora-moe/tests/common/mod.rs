//! Shared by the integration tests: the PEFT fixtures and their oracles
//! (PEFT's own merged weights), looked up per (layer, expert, projection)
//! whatever the adapter's format, and pools loaded from them.

#![allow(dead_code, clippy::unwrap_used)]

pub mod synthetic;

use std::collections::BTreeMap;
use std::path::PathBuf;

use half::bf16;
use lora_audit::{FusedParam, PROBE_OUT, ProbeTensor, WeightRef, parse_weight_name, read_oracle};
use lora_kernels::Device;
use lora_layout::{ExpertProj, GateUpLayout, ModelConfig};
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool};

/// The MoE fixture models and the oracle tests' adapters on each (every
/// servable adapter with an oracle).
pub const MOE_MODELS: [&str; 10] = [
    "qwen3_moe",
    "qwen3_moe_v4",
    "mixtral",
    "mixtral_v4",
    "deepseek_v3",
    "deepseek_v3_v4",
    "qwen3_next",
    "qwen3_next_v4",
    "glm4_moe",
    "gpt_oss",
];

/// `fixtures/` at the workspace root, or `LORA_FIXTURES_DIR` (the GPU bundle).
pub fn fixtures() -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
}

/// The base model config of fixture model `model`.
pub fn model_config(model: &str) -> ModelConfig {
    ModelConfig::from_file(&fixtures().join(model).join("config.json")).unwrap()
}

/// The adapters of `model` that `expected.json` marks servable and that
/// have an oracle, sorted by name.
pub fn servable_adapters(model: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(fixtures().join(model)).unwrap() {
        let dir = entry.unwrap().path();
        let expected = dir.join("expected.json");
        if !expected.exists() || !dir.join("oracle.safetensors").exists() {
            continue;
        }
        let text = std::fs::read_to_string(&expected).unwrap();
        let servable = text.replace(char::is_whitespace, "").contains("\"servable\":true");
        if servable {
            out.push(dir.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    out.sort();
    out
}

/// `probe_in::W` and `probe_out::W` of one adapter's oracle, by weight name.
#[derive(Debug, Clone, Default)]
pub struct Oracle {
    pub probes: BTreeMap<String, (ProbeTensor, ProbeTensor)>,
}

/// Read `fixtures/<model>/<adapter>/oracle.safetensors`.
pub fn oracle(model: &str, adapter: &str) -> Oracle {
    let path = fixtures().join(model).join(adapter).join("oracle.safetensors");
    let mut oracle = read_oracle(&path).unwrap();
    let probes = oracle
        .inputs
        .inputs
        .into_iter()
        .map(|(w, pin)| {
            let pout = oracle.expected.remove(&format!("{PROBE_OUT}{w}")).unwrap();
            (w, (pin, pout))
        })
        .collect();
    Oracle { probes }
}

/// PEFT's delta on `n` probe rows: the inputs `[n, in]` and outputs `[n, out]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeRows {
    /// The oracle's weight name.
    pub weight: String,
    /// Elements of the oracle's whole `probe_out::` tensor.
    pub tensor_len: usize,
    pub n: usize,
    pub x: Vec<f32>,
    pub out: Vec<f32>,
    pub out_dim: usize,
}

impl ProbeRows {
    pub fn x_row(&self, j: usize, in_dim: usize) -> &[f32] {
        &self.x[j * in_dim..(j + 1) * in_dim]
    }

    pub fn out_row(&self, j: usize) -> &[f32] {
        &self.out[j * self.out_dim..(j + 1) * self.out_dim]
    }
}

impl Oracle {
    /// The oracle of expert `expert`'s `proj` at `layer`, in either format
    /// (a 4.x per-expert weight, or the expert's slice of a 5.x fused
    /// parameter); `None` when PEFT's merge left that weight unchanged.
    pub fn expert(&self, cfg: &ModelConfig, layer: usize, expert: usize, proj: ExpertProj) -> Option<ProbeRows> {
        let inter = cfg.moe.as_ref().unwrap().expert_intermediate_size;
        for (name, (pin, pout)) in &self.probes {
            match parse_weight_name(name, cfg).unwrap() {
                WeightRef::Expert {
                    layer: l,
                    expert: e,
                    proj: p,
                } if (l, e, p) == (layer, expert, proj) => {
                    return Some(ProbeRows {
                        weight: name.clone(),
                        tensor_len: pout.data.len(),
                        n: pin.shape[0],
                        x: pin.data.clone(),
                        out: pout.data.clone(),
                        out_dim: pout.shape[1],
                    });
                }
                WeightRef::Fused { layer: l, param } if l == layer => {
                    // The projection's columns of the parameter's output, in
                    // the family's gate_up layout (gpt_oss: interleaved).
                    let layout = GateUpLayout::of(cfg.family);
                    let cols: Vec<usize> = match (param, proj) {
                        (FusedParam::GateUp, ExpertProj::Gate | ExpertProj::Up) => {
                            (0..inter).map(|j| layout.column(proj, j, inter)).collect()
                        }
                        (FusedParam::Down, ExpertProj::Down) => (0..cfg.hidden_size).collect(),
                        _ => continue,
                    };
                    // [E, n, out]
                    let (n, width) = (pout.shape[1], pout.shape[2]);
                    let mut out = Vec::with_capacity(n * cols.len());
                    for j in 0..n {
                        let row = &pout.data[(expert * n + j) * width..(expert * n + j + 1) * width];
                        out.extend(cols.iter().map(|&c| row[c]));
                    }
                    return Some(ProbeRows {
                        weight: name.clone(),
                        tensor_len: pout.data.len(),
                        n,
                        x: pin.data.clone(),
                        out,
                        out_dim: cols.len(),
                    });
                }
                _ => {}
            }
        }
        None
    }

    /// The oracle of the router at `layer`.
    pub fn router(&self, cfg: &ModelConfig, layer: usize) -> Option<ProbeRows> {
        self.probes.iter().find_map(|(name, (pin, pout))| {
            matches!(parse_weight_name(name, cfg).unwrap(), WeightRef::Router { layer: l } if l == layer).then(|| {
                ProbeRows {
                    weight: name.clone(),
                    tensor_len: pout.data.len(),
                    n: pin.shape[0],
                    x: pin.data.clone(),
                    out: pout.data.clone(),
                    out_dim: pout.shape[1],
                }
            })
        })
    }
}

/// Pool options for the fixtures: experts on, expert rank 16 (the fixtures'
/// `expected.json` setting), a spare slot.
pub fn options(adapters: usize) -> LoraOptions {
    LoraOptions {
        max_loras: adapters + 1,
        max_rank: 16,
        experts: true,
        ..LoraOptions::default()
    }
}

/// A pool on `device` holding every servable adapter of `model` (adapter
/// `k` in slot `k`), and their oracles.
pub fn load_model(device: &Device, model: &str) -> (LoraPool, Vec<String>, Vec<Oracle>) {
    let names = servable_adapters(model);
    assert!(!names.is_empty(), "{model} has no servable fixture");
    let dirs: Vec<PathBuf> = names.iter().map(|a| fixtures().join(model).join(a)).collect();
    let sources: Vec<AdapterSource<'_>> = names
        .iter()
        .zip(&dirs)
        .map(|(name, dir)| AdapterSource { name, dir })
        .collect();
    let pool = LoraPool::load(
        device,
        model_config(model),
        options(names.len()),
        BatchCapacity::default(),
        &sources,
    )
    .unwrap();
    let oracles = names.iter().map(|a| oracle(model, a)).collect();
    (pool, names, oracles)
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// ‖out − ref‖ / ‖ref‖, infinite on NaN or length mismatch.
pub fn rel_error(out: &[f32], reference: &[f32]) -> f64 {
    lora_kernels::testing::rel_error(out, reference)
}

/// The MoE layers of `cfg`.
pub fn moe_layers(cfg: &ModelConfig) -> Vec<usize> {
    (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)).collect()
}
