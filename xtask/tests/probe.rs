//! `cargo xtask probe` on every servable fixture: the serving path (pool,
//! overlays, MoE folds, kernels) answers the PEFT oracle's probes within
//! BF16 tolerance — on the CPU backend here, and on CUDA when present.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use lora_audit::read_oracle;
use lora_kernels::testing::{cuda_or_skip, rel_error};

fn fixtures() -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
}

/// Every servable fixture adapter: (model dir, adapter dir).
fn servable() -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    for model in std::fs::read_dir(fixtures()).unwrap() {
        let model = model.unwrap().path();
        if !model.join("config.json").is_file() {
            continue;
        }
        for adapter in std::fs::read_dir(&model).unwrap() {
            let adapter = adapter.unwrap().path();
            let Ok(text) = std::fs::read_to_string(adapter.join("expected.json")) else {
                continue;
            };
            let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
            if expected["servable"] == true {
                out.push((model.clone(), adapter));
            }
        }
    }
    out.sort();
    assert!(out.len() >= 20, "the fixture set shrank: {}", out.len());
    out
}

/// The xtask binary: the one cargo built beside this test, or `LORA_XTASK_BIN`
/// (the GPU bundle carries it elsewhere).
fn xtask() -> Command {
    Command::new(std::env::var_os("LORA_XTASK_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_xtask").into()))
}

fn probe(model: &Path, adapter: &Path, device: &str, out: &Path) -> std::process::Output {
    let mut cmd = xtask();
    cmd.arg("probe")
        .arg(adapter)
        .arg("--model")
        .arg(model.join("config.json"))
        .arg("--probes")
        .arg(adapter.join("oracle.safetensors"))
        .arg("--out")
        .arg(out)
        .args([
            "--device",
            device,
            "--max-rank",
            "16",
            "--experts",
            "--embedding-lora",
            "--lm-head-lora",
        ]);
    if model.join("tables.safetensors").is_file() {
        cmd.arg("--base").arg(model.join("tables.safetensors"));
    }
    cmd.output().unwrap()
}

fn check_all(device: &str) {
    let tmp = std::env::temp_dir().join(format!("xtask-probe-{device}-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut checked = 0;
    for (i, (model, adapter)) in servable().iter().enumerate() {
        let out = tmp.join(format!("{i}.safetensors"));
        let run = probe(model, adapter, device, &out);
        let name = adapter.strip_prefix(fixtures()).unwrap().display().to_string();
        assert!(
            run.status.success(),
            "{name}: {}\n{}",
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
        let oracle = read_oracle(&adapter.join("oracle.safetensors")).unwrap();
        let served = read_oracle(&out).unwrap();
        for (key, want) in &oracle.expected {
            let got = served
                .expected
                .get(key)
                .unwrap_or_else(|| panic!("{name}: no {key} served"));
            assert_eq!(got.shape, want.shape, "{name} {key}");
            let err = rel_error(&got.data, &want.data);
            assert!(err < 1e-2, "{name} {key} on {device}: relative error {err}");
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} tensors checked");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn every_servable_fixture_matches_peft_through_the_cpu_serving_path() {
    check_all("cpu");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn every_servable_fixture_matches_peft_through_the_cuda_serving_path() {
    if cuda_or_skip("every_servable_fixture_matches_peft_through_the_cuda_serving_path").is_some() {
        check_all("cuda");
    }
}

#[test]
fn a_refused_adapter_exits_1_and_bad_usage_exits_2() {
    let model = fixtures().join("llama");
    let out = std::env::temp_dir().join(format!("xtask-probe-refused-{}.safetensors", std::process::id()));
    let run = probe(&model, &model.join("dora"), "cpu", &out);
    assert_eq!(run.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&run.stdout).contains("REJECT[dora]"));
    let run = xtask().args(["probe", "--model"]).output().unwrap();
    assert_eq!(run.status.code(), Some(2));
}
