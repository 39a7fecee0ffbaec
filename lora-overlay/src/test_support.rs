//! Shared setup of the unit tests: random served tables on a CPU device.

use std::sync::Arc;

use half::bf16;
use lora_kernels::Device;
use lora_kernels::testing::Rng;
use lora_layout::ModelConfig;

use crate::served::{ServedHead, ServedTables};

/// Random embedding and untied head tables `[vocab, hidden]`, and the
/// served tables holding them on `dev`.
pub(crate) fn random_untied_tables(
    dev: &Device,
    rng: &mut Rng,
    vocab: usize,
    hidden: usize,
) -> (Vec<bf16>, Vec<bf16>, ServedTables) {
    let embed = rng.bf16_vec(vocab * hidden, 1.0);
    let head = rng.bf16_vec(vocab * hidden, 1.0);
    let tables = ServedTables::new(
        dev,
        Arc::new(dev.upload(&embed).unwrap()),
        ServedHead::Own(Arc::new(dev.upload(&head).unwrap())),
        vocab,
        hidden,
    )
    .unwrap();
    (embed, head, tables)
}

/// A one-layer llama config with this vocabulary and width.
pub(crate) fn llama_like(vocab: usize, hidden: usize, tied: bool) -> ModelConfig {
    let json = format!(
        r#"{{"model_type": "llama", "hidden_size": {hidden}, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": {hidden}, "vocab_size": {vocab},
        "tie_word_embeddings": {tied}}}"#
    );
    ModelConfig::from_hf_config(&json).unwrap()
}
