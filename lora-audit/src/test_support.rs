//! Test helpers: tiny model configs (the shapes of the fixtures' bases) and scratch directories.

use lora_layout::ModelConfig;

fn cfg(json: &str) -> ModelConfig {
    ModelConfig::from_hf_config(json).expect("test config parses")
}

/// Llama: hidden 64, 3 layers, 4 heads (2 kv) of 16, inter 128, vocab 256.
pub fn llama(tied: bool) -> ModelConfig {
    cfg(&format!(
        r#"{{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
            "tie_word_embeddings": {tied}}}"#
    ))
}

/// Qwen3-MoE: hidden 32, layer 0 dense (inter 64), layer 1 with 4 experts of 16.
pub fn qwen3_moe() -> ModelConfig {
    cfg(
        r#"{"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 128,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "mlp_only_layers": [0], "decoder_sparse_step": 1}"#,
    )
}

/// Mixtral: hidden 32, 2 layers of 4 experts of 16.
pub fn mixtral() -> ModelConfig {
    cfg(
        r#"{"model_type": "mixtral", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 16, "vocab_size": 128,
            "num_local_experts": 4, "num_experts_per_tok": 2}"#,
    )
}

/// Qwen3-Next: layer 0 gated-delta-net, layer 1 full attention; 4 experts, shared expert 24.
pub fn qwen3_next() -> ModelConfig {
    cfg(
        r#"{"model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 128,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24, "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 4, "linear_value_head_dim": 8}"#,
    )
}

/// DeepSeek-V3: layer 0 dense, layers 1-2 with 4 experts and a shared expert; MLA.
pub fn deepseek_v3(q_lora_rank: Option<usize>) -> ModelConfig {
    let q = q_lora_rank.map_or("null".to_string(), |r| r.to_string());
    cfg(&format!(
        r#"{{"model_type": "deepseek_v3", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 128, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "q_lora_rank": {q}, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "first_k_dense_replace": 1,
            "n_shared_experts": 1}}"#
    ))
}

/// Gemma 3 (the text tower of the multimodal wrapper): hidden 32, 2 layers,
/// 4 heads (2 kv) of 16 (q/k/v/o widths 64/32/32, not hidden), inter 64, tied.
pub fn gemma3() -> ModelConfig {
    cfg(r#"{"model_type": "gemma3", "tie_word_embeddings": true,
            "text_config": {"model_type": "gemma3_text", "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
            "vocab_size": 128},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16}}"#)
}

/// Phi-3: hidden 32, 2 layers, 4 heads (2 kv) of 8: fused qkv_proj (64 wide)
/// and gate_up_proj (2 x 64).
pub fn phi3() -> ModelConfig {
    cfg(
        r#"{"model_type": "phi3", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128}"#,
    )
}

/// A fresh scratch directory under the system temp dir, removed on drop.
pub struct ScratchDir(pub std::path::PathBuf);

impl ScratchDir {
    /// A new empty directory named after `tag`.
    pub fn new(tag: &str) -> ScratchDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("lora-audit-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        ScratchDir(dir)
    }

    /// A path inside the directory.
    pub fn join(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One tensor to write: name, dtype, shape, raw little-endian bytes.
pub type RawTensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// An F32 tensor from values.
pub fn f32_tensor(name: &str, shape: &[usize], values: &[f32]) -> RawTensor {
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    (name.to_string(), safetensors::Dtype::F32, shape.to_vec(), bytes)
}

/// Serialize tensors into safetensors bytes.
pub fn safetensors_bytes(tensors: &[RawTensor]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("valid test tensor");
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).expect("serialize test tensors")
}

/// gpt_oss: hidden 32, 2 layers of 4 experts of 16 (gate and up interleaved),
/// router `mlp.router`; 4 heads (2 kv) of 8.
pub fn gpt_oss() -> ModelConfig {
    cfg(
        r#"{"model_type": "gpt_oss", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 16, "vocab_size": 128,
            "num_local_experts": 4, "num_experts_per_tok": 2}"#,
    )
}
