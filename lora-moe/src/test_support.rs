//! Fixture access for the unit tests.

use std::path::PathBuf;

use lora_layout::ModelConfig;

/// `fixtures/` at the workspace root, or `LORA_FIXTURES_DIR` (the GPU bundle).
pub(crate) fn fixtures() -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
}

/// The base model config of fixture model `model`.
pub(crate) fn config(model: &str) -> ModelConfig {
    ModelConfig::from_file(&fixtures().join(model).join("config.json")).unwrap_or_else(|e| panic!("{model}: {e}"))
}
