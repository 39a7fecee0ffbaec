use std::collections::HashSet;
use std::path::Path;

use lora_layout::ModelFamily;

use super::*;

fn testdata(name: &str) -> ModelConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../lora-layout/testdata")
        .join(name);
    ModelConfig::from_file(&path).unwrap()
}

const CONFIGS: [&str; 6] = [
    "llama-3.1-8b.json",
    "qwen3-8b.json",
    "mixtral-8x7b.json",
    "qwen3-30b-a3b.json",
    "qwen3-next-80b-a3b.json",
    "deepseek-v3.json",
];

#[test]
fn equal_geometry_gives_equal_fingerprints() {
    for name in CONFIGS {
        assert_eq!(
            model_fingerprint(&testdata(name)),
            model_fingerprint(&testdata(name)),
            "{name}"
        );
    }
}

#[test]
fn the_bundled_models_all_differ() {
    let prints: HashSet<u64> = CONFIGS.iter().map(|n| model_fingerprint(&testdata(n))).collect();
    assert_eq!(prints.len(), CONFIGS.len());
}

/// One change per field (and per nested field); each must move the
/// fingerprint away from the original and from every other change.
#[test]
fn every_field_changes_the_fingerprint() {
    type Edit = Box<dyn Fn(&mut ModelConfig)>;
    let edits: Vec<(&str, ModelConfig, Edit)> = vec![
        (
            "family",
            testdata("qwen3-8b.json"),
            Box::new(|c| c.family = ModelFamily::Qwen2),
        ),
        (
            "hidden_size",
            testdata("llama-3.1-8b.json"),
            Box::new(|c| c.hidden_size += 1),
        ),
        (
            "num_hidden_layers",
            testdata("llama-3.1-8b.json"),
            Box::new(|c| c.num_hidden_layers += 1),
        ),
        (
            "num_attention_heads",
            testdata("llama-3.1-8b.json"),
            Box::new(|c| c.num_attention_heads += 1),
        ),
        (
            "num_key_value_heads",
            testdata("llama-3.1-8b.json"),
            Box::new(|c| c.num_key_value_heads += 1),
        ),
        ("head_dim", testdata("llama-3.1-8b.json"), Box::new(|c| c.head_dim += 1)),
        (
            "intermediate_size",
            testdata("llama-3.1-8b.json"),
            Box::new(|c| c.intermediate_size += 1),
        ),
        (
            "vocab_size",
            testdata("llama-3.1-8b.json"),
            Box::new(|c| c.vocab_size += 1),
        ),
        (
            "tie_word_embeddings",
            testdata("llama-3.1-8b.json"),
            Box::new(|c| c.tie_word_embeddings ^= true),
        ),
        (
            "layer_types",
            testdata("qwen3-next-80b-a3b.json"),
            Box::new(|c| c.layer_types.swap(0, 3)),
        ),
        (
            "moe.num_experts",
            testdata("mixtral-8x7b.json"),
            Box::new(|c| edit_moe(c, |m| m.num_experts += 1)),
        ),
        (
            "moe.top_k",
            testdata("mixtral-8x7b.json"),
            Box::new(|c| edit_moe(c, |m| m.top_k += 1)),
        ),
        (
            "moe.expert_intermediate_size",
            testdata("mixtral-8x7b.json"),
            Box::new(|c| edit_moe(c, |m| m.expert_intermediate_size += 1)),
        ),
        (
            "moe.shared_expert_intermediate_size",
            testdata("mixtral-8x7b.json"),
            Box::new(|c| edit_moe(c, |m| m.shared_expert_intermediate_size = Some(8))),
        ),
        (
            "moe.shared_expert_gate",
            testdata("mixtral-8x7b.json"),
            Box::new(|c| edit_moe(c, |m| m.shared_expert_gate ^= true)),
        ),
        (
            "moe.dense_layers",
            testdata("mixtral-8x7b.json"),
            Box::new(|c| edit_moe(c, |m| m.dense_layers[0] ^= true)),
        ),
        (
            "moe (absent)",
            testdata("mixtral-8x7b.json"),
            Box::new(|c| c.moe = None),
        ),
        (
            "mla.q_lora_rank",
            testdata("deepseek-v3.json"),
            Box::new(|c| edit_mla(c, |m| m.q_lora_rank = None)),
        ),
        (
            "mla.kv_lora_rank",
            testdata("deepseek-v3.json"),
            Box::new(|c| edit_mla(c, |m| m.kv_lora_rank += 1)),
        ),
        (
            "mla.qk_rope_head_dim",
            testdata("deepseek-v3.json"),
            Box::new(|c| edit_mla(c, |m| m.qk_rope_head_dim += 1)),
        ),
        (
            "mla.qk_nope_head_dim",
            testdata("deepseek-v3.json"),
            Box::new(|c| edit_mla(c, |m| m.qk_nope_head_dim += 1)),
        ),
        (
            "mla.v_head_dim",
            testdata("deepseek-v3.json"),
            Box::new(|c| edit_mla(c, |m| m.v_head_dim += 1)),
        ),
        ("mla (absent)", testdata("deepseek-v3.json"), Box::new(|c| c.mla = None)),
        (
            "linear_attn.num_value_heads",
            testdata("qwen3-next-80b-a3b.json"),
            Box::new(|c| edit_linear(c, |l| l.num_value_heads += 1)),
        ),
        (
            "linear_attn.value_head_dim",
            testdata("qwen3-next-80b-a3b.json"),
            Box::new(|c| edit_linear(c, |l| l.value_head_dim += 1)),
        ),
        (
            "linear_attn (absent)",
            testdata("qwen3-next-80b-a3b.json"),
            Box::new(|c| c.linear_attn = None),
        ),
    ];
    let mut seen = HashSet::new();
    for (field, base, edit) in &edits {
        let mut changed = base.clone();
        edit(&mut changed);
        assert_ne!(changed, *base, "{field}: the edit must change the config");
        let print = model_fingerprint(&changed);
        assert_ne!(print, model_fingerprint(base), "{field} does not reach the fingerprint");
        assert!(seen.insert(print), "{field} collides with another edit");
    }
}

fn edit_moe(c: &mut ModelConfig, f: impl Fn(&mut MoeDims)) {
    f(c.moe.as_mut().unwrap());
}

fn edit_mla(c: &mut ModelConfig, f: impl Fn(&mut MlaDims)) {
    f(c.mla.as_mut().unwrap());
}

fn edit_linear(c: &mut ModelConfig, f: impl Fn(&mut LinearAttnDims)) {
    f(c.linear_attn.as_mut().unwrap());
}

#[test]
fn sequence_lengths_keep_neighbouring_fields_apart() {
    // A layer moved from `layer_types` into the MoE dense list must not
    // encode to the same bytes: lengths prefix every sequence.
    let base = testdata("mixtral-8x7b.json");
    let mut shorter = base.clone();
    shorter.layer_types.pop();
    let mut longer = base.clone();
    edit_moe(&mut longer, |m| m.dense_layers.push(false));
    assert_ne!(canonical_encoding(&shorter), canonical_encoding(&longer));
}
