//! `cargo xtask serve`, through its command contract: every engine fixture
//! family served with fewer slots than adapters equals PEFT's answers; a
//! refused adapter exits 1 naming it; unreadable or invalid input exits 2
//! with a message, never a panic.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lora_engine::{ANSWER_TOLERANCE, Answers, RequestOutput, compare};

fn family_dir(family: &str) -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
        .join("engine")
        .join(family)
}

fn xtask() -> Command {
    Command::new(std::env::var_os("LORA_XTASK_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_xtask").into()))
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtask-serve-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn adapter_args(family: &str, sub: &str) -> Vec<String> {
    let dir = family_dir(family).join(sub);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .iter()
        .flat_map(|n| ["--adapter".to_string(), format!("{n}={}", dir.join(n).display())])
        .collect()
}

fn serve(family: &str, adapters: &[String], requests: &Path, out: &Path, max_loras: usize) -> Output {
    xtask()
        .arg("serve")
        .arg("--model")
        .arg(family_dir(family).join("model"))
        .args(adapters)
        .arg("--requests")
        .arg(requests)
        .arg("--out")
        .arg(out)
        .args([
            "--device",
            "cpu",
            "--max-rank",
            "16",
            "--experts",
            "--embedding-lora",
            "--lm-head-lora",
        ])
        .args(["--max-loras", &max_loras.to_string()])
        .output()
        .unwrap()
}

#[test]
fn every_family_equals_peft_through_the_command() {
    for family in [
        "llama",
        "llama_embed",
        "llama_lm_head",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_untied",
        "qwen3_moe",
        "mixtral",
    ] {
        let dir = scratch(family);
        let out = dir.join("out.safetensors");
        let adapters = adapter_args(family, "adapters");
        let max_loras = (adapters.len() / 2 - 1).max(1);
        let run = serve(
            family,
            &adapters,
            &family_dir(family).join("requests.json"),
            &out,
            max_loras,
        );
        assert_eq!(
            run.status.code(),
            Some(0),
            "{family}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let ours = Answers::read(&out).unwrap();
        let peft = Answers::read(&family_dir(family).join("peft.safetensors")).unwrap();
        let vocab = {
            let r = peft.request(0).unwrap();
            r.logits_step.len() / r.tokens.len().max(1)
        };
        let mut i = 0;
        while let Some(reference) = peft.request(i) {
            let served = ours
                .request(i)
                .unwrap_or_else(|| panic!("{family}: request {i} missing"));
            let served = RequestOutput {
                logits_prompt: served.logits_prompt.to_vec(),
                tokens: served.tokens.iter().map(|&t| t as u32).collect(),
                logits_step: served.logits_step.to_vec(),
            };
            let c = compare(&served, &reference, vocab);
            assert!(c.within(ANSWER_TOLERANCE), "{family} request {i}: {c:?}");
            i += 1;
        }
        assert!(i > 0, "{family}: no requests");
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn a_refused_adapter_exits_1_naming_it() {
    let dir = scratch("refused");
    let family = "qwen3_moe";
    let mut adapters = adapter_args(family, "adapters");
    adapters.extend(adapter_args(family, "refused"));
    let run = serve(
        family,
        &adapters,
        &family_dir(family).join("requests.json"),
        &dir.join("o"),
        2,
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("`dora` is refused") && stderr.contains("REJECT[dora]"),
        "{stderr}"
    );
    assert!(!dir.join("o").exists(), "nothing is written for a refused run");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_exits_2_with_a_message() {
    let dir = scratch("bad");
    let family = "llama";
    let adapters = adapter_args(family, "adapters");
    let cases: [(&str, &str); 6] = [
        ("not json", "["),
        (
            "empty prompt",
            r#"[{"prompt": [], "adapter": null, "max_new_tokens": 1}]"#,
        ),
        (
            "id past the vocabulary",
            r#"[{"prompt": [4000000000], "adapter": null, "max_new_tokens": 1}]"#,
        ),
        (
            "unknown adapter",
            r#"[{"prompt": [1], "adapter": "nope", "max_new_tokens": 1}]"#,
        ),
        (
            "huge generation",
            r#"[{"prompt": [1], "adapter": null, "max_new_tokens": 1000000000}]"#,
        ),
        (
            "negative id",
            r#"[{"prompt": [-3], "adapter": null, "max_new_tokens": 1}]"#,
        ),
    ];
    for (what, text) in cases {
        let requests = dir.join("requests.json");
        std::fs::write(&requests, text).unwrap();
        let run = serve(family, &adapters, &requests, &dir.join("o"), 2);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{what}: {stderr}");
        assert!(
            stderr.starts_with("xtask serve: ") && !stderr.contains("panicked"),
            "{what}: {stderr}"
        );
    }
    let run = serve(family, &adapters, &dir.join("missing.json"), &dir.join("o"), 2);
    assert_eq!(run.status.code(), Some(2));
    let run = serve("no_such_family", &[], &dir.join("missing.json"), &dir.join("o"), 2);
    assert_eq!(run.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).ok();
}
