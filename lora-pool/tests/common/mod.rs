//! Fixture access shared by the pool's integration tests: the PEFT fixtures
//! under `fixtures/` and their oracles (PEFT's own merged weights).

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use half::bf16;
use lora_layout::ModelConfig;
use safetensors::{Dtype, SafeTensors};

/// `fixtures/` at the workspace root.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// The base model config of fixture model `model`.
pub fn model_config(model: &str) -> ModelConfig {
    ModelConfig::from_file(&fixtures().join(model).join("config.json")).unwrap()
}

/// An f32 tensor of an oracle: shape and values.
#[derive(Debug, Clone)]
pub struct Probe {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// `probe_in::W` and `probe_out::W` of one adapter's oracle, by weight name.
#[derive(Debug, Clone, Default)]
pub struct Oracle {
    pub probes: BTreeMap<String, (Probe, Probe)>,
}

fn f32_tensor(st: &SafeTensors<'_>, name: &str) -> Probe {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    let data = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Probe {
        shape: t.shape().to_vec(),
        data,
    }
}

/// Read `fixtures/<model>/<adapter>/oracle.safetensors`.
pub fn oracle(model: &str, adapter: &str) -> Oracle {
    let bytes = std::fs::read(fixtures().join(model).join(adapter).join("oracle.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut probes = BTreeMap::new();
    for name in st.names() {
        if let Some(w) = name.strip_prefix("probe_in::") {
            let out = format!("probe_out::{w}");
            probes.insert(w.to_string(), (f32_tensor(&st, name), f32_tensor(&st, &out)));
        }
    }
    Oracle { probes }
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// ‖out − ref‖ / ‖ref‖, infinite on NaN or length mismatch.
pub fn rel_error(out: &[f32], reference: &[f32]) -> f64 {
    lora_kernels::testing::rel_error(out, reference)
}
