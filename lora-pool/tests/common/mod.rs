//! Fixture access shared by the pool's integration tests: the PEFT fixtures
//! under `fixtures/` and their oracles (PEFT's own merged weights).

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use half::bf16;
use lora_audit::Oracle;
use lora_layout::ModelConfig;

/// `fixtures/` at the workspace root.
/// (`LORA_FIXTURES_DIR` when set: the GPU bundle carries them elsewhere.)
pub fn fixtures() -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
}

/// The base model config of fixture model `model`.
pub fn model_config(model: &str) -> ModelConfig {
    ModelConfig::from_file(&fixtures().join(model).join("config.json")).unwrap()
}

/// `fixtures/<model>/<adapter>/oracle.safetensors`.
pub fn oracle(model: &str, adapter: &str) -> Oracle {
    lora_audit::read_oracle(&fixtures().join(model).join(adapter).join("oracle.safetensors")).unwrap()
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// ‖out − ref‖ / ‖ref‖, infinite on NaN or length mismatch.
pub fn rel_error(out: &[f32], reference: &[f32]) -> f64 {
    lora_kernels::testing::rel_error(out, reference)
}
