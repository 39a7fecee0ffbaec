//! The `lora-audit` tool on inputs that once aborted or were served wrong
//! (issue 42): it must answer with an exit status and a message naming the
//! field or tensor, never abort.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("lora-audit-bounds-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn f32_safetensors(tensors: &[(&str, Vec<usize>, f32)]) -> Vec<u8> {
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            let count: usize = s.iter().product();
            (
                n.to_string(),
                s.clone(),
                std::iter::repeat_n(*v, count).flat_map(f32::to_le_bytes).collect(),
            )
        })
        .collect();
    let views: Vec<_> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// A Llama of hidden 64 with the given MLP width, and an attention-only adapter.
fn model_and_adapter(root: &Path, intermediate_size: usize, b_value: f32) -> (PathBuf, PathBuf) {
    let model = root.join("config.json");
    std::fs::write(
        &model,
        format!(
            r#"{{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": {intermediate_size}, "vocab_size": 256}}"#
        ),
    )
    .unwrap();
    let adapter = root.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    std::fs::write(adapter.join("adapter_config.json"), r#"{"r": 4}"#).unwrap();
    let weights = f32_safetensors(&[
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            vec![4, 64],
            0.5,
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
            vec![64, 4],
            b_value,
        ),
    ]);
    std::fs::write(adapter.join("adapter_model.safetensors"), weights).unwrap();
    (model, adapter)
}

#[test]
fn probe_with_a_huge_intermediate_size_exits_2_with_a_message() {
    let scratch = Scratch::new("probe");
    let (model, adapter) = model_and_adapter(&scratch.0, 1 << 24, 0.25);
    let probes = scratch.0.join("probes.safetensors");
    std::fs::write(
        &probes,
        f32_safetensors(&[("probe_in::model.layers.0.mlp.gate_proj.weight", vec![1000, 64], 1.0)]),
    )
    .unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_lora-audit"))
        .arg("probe")
        .arg(&adapter)
        .arg("--model")
        .arg(&model)
        .arg("--probes")
        .arg(&probes)
        .arg("--out")
        .arg(scratch.0.join("out.safetensors"))
        .env_remove("LORA_MAX_RANK")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("intermediate_size") && stderr.contains("MAX_PROBE_OUTPUT_BYTES"),
        "{stderr}"
    );
}

#[test]
fn check_refuses_a_non_finite_weight_with_exit_1_naming_it() {
    let scratch = Scratch::new("check");
    let (model, adapter) = model_and_adapter(&scratch.0, 128, f32::NAN);
    let run = Command::new(env!("CARGO_BIN_EXE_lora-audit"))
        .arg("check")
        .arg(&adapter)
        .arg("--model")
        .arg(&model)
        .env_remove("LORA_MAX_RANK")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert_eq!(run.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("REJECT[non-finite] base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"),
        "{stdout}"
    );
}
