//! Every fixture under `fixtures/` (made by real PEFT, see
//! `fixtures/make_fixtures.py`) against its `expected.json` and PEFT's own
//! merged weights (`oracle.safetensors`).
//!
//! Expected outcomes hold for `--max-rank 16 --experts --embedding-lora
//! --lm-head-lora` (expert rank 16).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use lora_audit::{
    AuditReport, LmHeadMode, LoadedSafetensors, LoraOptions, PROBE_IN, PROBE_OUT, ProbeInputs, ROWS_IDX, ROWS_MERGED,
    RejectCode, WeightRef, audit_adapter, parse_weight_name, prepare_adapter, probe_adapter, probe_adapter_at,
    read_base_tables, read_probe_inputs,
};
use lora_layout::{ExpertProj, ExpertSite, LoraModule, ModelConfig};

/// The dense (layer, module) and expert-pool (layer, site) places of an adapter.
type Sites = (BTreeSet<(usize, LoraModule)>, BTreeSet<(usize, ExpertSite)>);

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

struct Fixture {
    name: String,
    dir: PathBuf,
    model: PathBuf,
    expected: serde_json::Value,
}

impl Fixture {
    fn cfg(&self) -> ModelConfig {
        ModelConfig::from_file(&self.model.join("config.json")).unwrap()
    }
    fn servable(&self) -> bool {
        self.expected["servable"].as_bool().unwrap()
    }
    fn oracle(&self) -> Option<PathBuf> {
        Some(self.dir.join("oracle.safetensors")).filter(|p| p.exists())
    }
    fn tables(&self) -> Option<PathBuf> {
        Some(self.model.join("tables.safetensors")).filter(|p| p.exists())
    }
}

fn fixtures() -> Vec<Fixture> {
    let mut out = Vec::new();
    let mut models: Vec<_> = std::fs::read_dir(fixtures_root())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    models.sort();
    for model in models.into_iter().filter(|m| m.join("config.json").exists()) {
        let mut adapters: Vec<_> = std::fs::read_dir(&model).unwrap().flatten().map(|e| e.path()).collect();
        adapters.sort();
        for dir in adapters.into_iter().filter(|d| d.join("expected.json").exists()) {
            let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
            out.push(Fixture {
                name: format!(
                    "{}/{}",
                    model.file_name().unwrap().to_string_lossy(),
                    dir.file_name().unwrap().to_string_lossy()
                ),
                dir,
                model: model.clone(),
                expected: serde_json::from_str(&text).unwrap(),
            });
        }
    }
    assert!(out.len() >= 30, "the fixtures are missing: found {}", out.len());
    out
}

/// The options the expected outcomes are written for.
fn fixture_options() -> LoraOptions {
    LoraOptions {
        max_rank: 16,
        experts: true,
        dora: true,
        embedding_lora: true,
        lm_head_lora: true,
        ..LoraOptions::default()
    }
}

fn expected_codes(f: &Fixture) -> BTreeSet<RejectCode> {
    f.expected["codes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| RejectCode::parse(c.as_str().unwrap()).unwrap_or_else(|| panic!("{}: unknown code {c}", f.name)))
        .collect()
}

#[test]
fn every_fixture_audits_to_its_expected_outcome() {
    let mut failures = Vec::new();
    for f in fixtures() {
        let report = audit_adapter(&f.dir, &f.cfg(), &fixture_options()).unwrap();
        if report.is_servable() != f.servable() {
            failures.push(format!(
                "{}: servable {} but expected {}: {:?}",
                f.name,
                report.is_servable(),
                f.servable(),
                report.refused
            ));
        }
        if report.refused_codes() != expected_codes(&f) {
            failures.push(format!(
                "{}: codes {:?}, expected {:?}",
                f.name,
                report.refused_codes(),
                expected_codes(&f)
            ));
        }
        for r in &report.refused {
            let message = r.to_string();
            if r.subject.is_empty()
                || r.reason.is_empty()
                || !message.starts_with(r.code.as_str())
                || !message.contains(&r.subject)
            {
                failures.push(format!(
                    "{}: refusal without code, subject or reason: {message:?}",
                    f.name
                ));
            }
        }
        if let Some(partial) = f.expected.get("allow_partial_servable").and_then(|v| v.as_bool()) {
            let opts = LoraOptions {
                allow_partial: true,
                ..fixture_options()
            };
            let report = audit_adapter(&f.dir, &f.cfg(), &opts).unwrap();
            if report.is_servable() != partial || (partial && report.skipped.is_empty()) {
                failures.push(format!(
                    "{}: with allow_partial servable {} (expected {partial}), skipped {:?}",
                    f.name,
                    report.is_servable(),
                    report.skipped
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn expert_fixtures_are_refused_with_experts_disabled() {
    for f in fixtures().into_iter().filter(|f| f.servable()) {
        let report = audit_adapter(
            &f.dir,
            &f.cfg(),
            &LoraOptions {
                experts: false,
                ..fixture_options()
            },
        )
        .unwrap();
        if report.has_expert_deltas {
            assert_eq!(
                report.refused_codes(),
                BTreeSet::from([RejectCode::ExpertsDisabled]),
                "{}",
                f.name
            );
        } else {
            assert!(report.is_servable(), "{}", f.name);
        }
    }
}

/// The expert-pool sites and dense modules PEFT's merge changed, from the
/// oracle's weight names.
fn changed_sites(f: &Fixture, cfg: &ModelConfig, oracle: &ProbeInputs) -> Sites {
    let (mut dense, mut experts) = (BTreeSet::new(), BTreeSet::new());
    let n_experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    for weight in oracle.inputs.keys() {
        match parse_weight_name(weight, cfg).unwrap_or_else(|e| panic!("{}: {e}", f.name)) {
            WeightRef::Dense { layer, module } => {
                dense.insert((layer, module));
            }
            WeightRef::Expert { layer, expert, proj } => {
                experts.insert((layer, ExpertSite::Expert { expert, proj }));
            }
            WeightRef::Router { layer } => {
                experts.insert((layer, ExpertSite::Router));
            }
            WeightRef::Fused { layer, param } => {
                let projs: &[ExpertProj] = match param {
                    lora_audit::FusedParam::GateUp => &[ExpertProj::Gate, ExpertProj::Up],
                    lora_audit::FusedParam::Down => &[ExpertProj::Down],
                };
                for expert in 0..n_experts {
                    for &proj in projs {
                        experts.insert((layer, ExpertSite::Expert { expert, proj }));
                    }
                }
            }
            // The output head's LoRA delta, checked against the report's head pair.
            WeightRef::Table(lora_audit::OverlayModule::LmHead) => {}
            other => panic!("{}: oracle weight {weight} is {other:?}", f.name),
        }
    }
    (dense, experts)
}

fn placed_sites(report: &AuditReport) -> Sites {
    (
        report.placed.iter().map(|p| (p.layer, p.module)).collect(),
        report.experts.iter().map(|p| (p.layer, p.site)).collect(),
    )
}

/// Oracle tensors: (key, shape, values) for the outputs.
fn oracle_outputs(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mapped = LoadedSafetensors::open(path).unwrap();
    let meta = mapped.metadata().unwrap();
    assert!(
        meta.contains_key("peft") && meta.contains_key("transformers"),
        "{}: versions missing",
        path.display()
    );
    let view = mapped.view().unwrap();
    let mut out = Vec::new();
    for (name, t) in view.tensors() {
        if name.starts_with(PROBE_OUT) || name.starts_with(ROWS_MERGED) {
            assert_eq!(t.dtype(), safetensors::Dtype::F32);
            let values = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            out.push((name, t.shape().to_vec(), values));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - f64::from(*w)).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| f64::from(*w).powi(2)).sum();
    (diff / norm).sqrt()
}

/// Every servable fixture audited with `off` (the fixture options less one
/// opt-in place): those that use the place (`uses`, under the fixture
/// options) are refused with `code` alone, every other one stays
/// servable. Returns how many used it.
fn refused_without_the_place(
    off: impl Fn(LoraOptions) -> LoraOptions,
    uses: impl Fn(&AuditReport) -> bool,
    code: RejectCode,
) -> usize {
    let mut seen = 0;
    for f in fixtures().into_iter().filter(|f| f.servable()) {
        let on = audit_adapter(&f.dir, &f.cfg(), &fixture_options()).unwrap();
        let report = audit_adapter(&f.dir, &f.cfg(), &off(fixture_options())).unwrap();
        if uses(&on) {
            seen += 1;
            assert_eq!(report.refused_codes(), BTreeSet::from([code]), "{}", f.name);
        } else {
            assert!(report.is_servable(), "{}", f.name);
        }
    }
    seen
}

#[test]
fn embedding_lora_fixtures_are_refused_without_the_embedding_place() {
    let seen = refused_without_the_place(
        |o| LoraOptions {
            embedding_lora: false,
            ..o
        },
        |r| r.embedding.is_some(),
        RejectCode::EmbeddingLoraDisabled,
    );
    assert!(seen >= 2, "{seen} embedding-LoRA fixtures");
}

#[test]
fn lm_head_lora_fixtures_are_refused_without_the_head_place() {
    let seen = refused_without_the_place(
        |o| LoraOptions {
            lm_head_lora: false,
            ..o
        },
        |r| r.lm_head.is_some(),
        RejectCode::LmHeadLoraDisabled,
    );
    assert!(seen >= 1, "{seen} lm_head-LoRA fixtures");
}

#[test]
fn every_servable_fixture_probes_equal_to_peft() {
    let mut checked = 0;
    let mut failures = Vec::new();
    for f in fixtures().into_iter().filter(|f| f.servable()) {
        let oracle_path = f
            .oracle()
            .unwrap_or_else(|| panic!("{}: a servable fixture needs an oracle", f.name));
        let cfg = f.cfg();
        let adapter = prepare_adapter(&f.dir, &cfg, &fixture_options()).unwrap();
        let inputs = read_probe_inputs(&oracle_path).unwrap();
        // Exactly the weights PEFT changed are placed.
        let (dense, experts) = changed_sites(&f, &cfg, &inputs);
        let (placed_dense, placed_experts) = placed_sites(&adapter.report);
        if dense != placed_dense || experts != placed_experts {
            failures.push(format!(
                "{}: placed {placed_dense:?} / {placed_experts:?} but PEFT changed {dense:?} / {experts:?}",
                f.name
            ));
        }
        let head_probed = inputs.inputs.contains_key("lm_head.weight");
        if head_probed != adapter.lm_head.is_some() {
            failures.push(format!(
                "{}: PEFT changed the head by a LoRA: {head_probed}; placed: {}",
                f.name,
                adapter.lm_head.is_some()
            ));
        }
        let overlaid = !inputs.rows.is_empty();
        // With a LoRA on the head, the oracle probes the head's delta and not
        // its table's rows (the head table saved beside it is the base's).
        let overlay_rows = !adapter.overlay.is_empty() && adapter.lm_head.is_none();
        if overlaid != (overlay_rows || adapter.embedding.is_some()) {
            failures.push(format!(
                "{}: PEFT changed token rows: {overlaid}; overlay: {:?}",
                f.name, adapter.report.overlay.lm_head
            ));
        }
        let base = f.tables().map(|p| read_base_tables(&p).unwrap());
        let outputs = probe_adapter(&adapter, &cfg, &inputs, base.as_ref()).unwrap();
        assert!(outputs.unserved.is_empty(), "{}: {:?}", f.name, outputs.unserved);
        for (key, shape, want) in oracle_outputs(&oracle_path) {
            let Some(got) = outputs.tensors.get(&key) else {
                failures.push(format!("{}: no answer for {key}", f.name));
                continue;
            };
            let err = relative_error(&got.data, &want);
            // NaN fails too.
            if got.shape != shape || err.is_nan() || err >= 1e-2 {
                failures.push(format!(
                    "{}: {key}: shape {:?} vs {shape:?}, relative error {err:.3e}",
                    f.name, got.shape
                ));
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked > 150, "only {checked} oracle tensors checked");
}

#[test]
fn token_overlays_follow_peft_for_tied_and_untied_heads() {
    let cases = [
        ("llama_tied/trainable_tokens_tied_list", LmHeadMode::TiedTrainableRows),
        ("llama_tied/trainable_tokens_tied_dict", LmHeadMode::TiedTrainableRows),
        ("llama/trainable_tokens_untied_list", LmHeadMode::None),
        ("llama/trainable_tokens_untied_dict", LmHeadMode::Own),
        ("llama/modules_to_save_embed_lm_head", LmHeadMode::Own),
        ("llama_tied/modules_to_save_embed_tied", LmHeadMode::None),
    ];
    for (name, mode) in cases {
        let f = fixtures().into_iter().find(|f| f.name == name).unwrap();
        let report = audit_adapter(&f.dir, &f.cfg(), &fixture_options()).unwrap();
        assert_eq!(report.overlay.lm_head, mode, "{name}");
    }
}

#[test]
fn untouched_rows_are_the_base_rows() {
    // A tied head under a modules_to_save embed copy: PEFT leaves the head as it
    // was, so its rows for the ids whose embedding changed are the base's.
    let f = fixture("llama_tied/modules_to_save_embed_tied");
    let cfg = f.cfg();
    let adapter = prepare_adapter(&f.dir, &cfg, &fixture_options()).unwrap();
    let oracle = read_probe_inputs(&f.oracle().unwrap()).unwrap();
    let changed = oracle.rows["model.embed_tokens.weight"].clone();
    assert!(!changed.is_empty());
    let unchanged: Vec<i64> = (0..cfg.vocab_size as i64)
        .filter(|i| !changed.contains(i))
        .take(16)
        .collect();
    let mut inputs = ProbeInputs::default();
    inputs.rows.insert("lm_head.weight".into(), changed.clone());
    inputs
        .rows
        .insert("model.embed_tokens.weight".into(), unchanged.clone());
    let base = read_base_tables(&f.tables().unwrap()).unwrap();
    let out = probe_adapter(&adapter, &cfg, &inputs, Some(&base)).unwrap();
    let embed = base.embed.as_ref().unwrap();
    let h = cfg.hidden_size;
    for (table, ids) in [("lm_head.weight", &changed), ("model.embed_tokens.weight", &unchanged)] {
        let got = &out.tensors[&format!("{ROWS_MERGED}{table}")].data;
        for (n, &id) in ids.iter().enumerate() {
            let id = id as usize;
            let want: Vec<f32> = embed[id * h..(id + 1) * h].iter().map(|v| v.to_f32()).collect();
            assert_eq!(&got[n * h..(n + 1) * h], &want[..], "{table} id {id}");
        }
    }
}

fn lora_audit() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lora-audit"))
}

/// `lora-audit probe` of fixture `f` against its model and oracle, into
/// `out` (further flags to add).
fn probe_command(f: &Fixture, out: &Path) -> Command {
    let mut cmd = lora_audit();
    cmd.arg("probe")
        .arg(&f.dir)
        .arg("--model")
        .arg(f.model.join("config.json"))
        .arg("--probes")
        .arg(f.oracle().unwrap())
        .arg("--out")
        .arg(out);
    cmd
}

fn fixture(name: &str) -> Fixture {
    fixtures().into_iter().find(|f| f.name == name).unwrap()
}

#[test]
fn check_exit_codes() {
    let ok = fixture("qwen3_moe/experts_fused_router");
    let refused = fixture("llama/dora");
    let run = |f: &Fixture, extra: &[&str]| {
        lora_audit()
            .arg("check")
            .arg(&f.dir)
            .arg("--model")
            .arg(f.model.join("config.json"))
            .args(extra)
            .env_remove("LORA_EXPERTS")
            .env_remove("LORA_MAX_RANK")
            .env_remove("LORA_ALLOW_PARTIAL")
            .env_remove("LORA_DORA")
            .output()
            .unwrap()
    };
    assert_eq!(run(&ok, &["--experts"]).status.code(), Some(0));
    assert_eq!(run(&ok, &[]).status.code(), Some(1), "experts are off by default");
    let out = run(&refused, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("REJECT[dora]"));
    assert_eq!(run(&refused, &["--dora"]).status.code(), Some(0), "DoRA on a DoRA pool");
    let partial = fixture("qwen3_next/gdn_in_proj");
    assert_eq!(run(&partial, &["--experts"]).status.code(), Some(1));
    let out = run(&partial, &["--experts", "--allow-partial"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("skipped"));
    // --json is JSON with the verdict.
    let out = run(&ok, &["--experts", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["servable"], true);
    assert!(json["experts"].as_array().unwrap().len() > 1);
    // Bad usage and unreadable input: 2.
    assert_eq!(run(&ok, &["--max-rank", "x"]).status.code(), Some(2));
    assert_eq!(lora_audit().arg("check").output().unwrap().status.code(), Some(2));
    let missing = lora_audit()
        .args(["check", "/nonexistent/adapter", "--model"])
        .arg(ok.model.join("config.json"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    let bad_model = lora_audit()
        .arg("check")
        .arg(&ok.dir)
        .args(["--model", "/nonexistent/config.json"])
        .output()
        .unwrap();
    assert_eq!(bad_model.status.code(), Some(2));
}

/// Unreadable input: exit 2, an error naming the file or directory, and
/// with `--json` a JSON error object on stdout.
#[test]
fn every_error_names_its_file_and_json_mode_prints_an_error_object() {
    let ok = fixture("llama/rslora");
    let config = ok.model.join("config.json");
    let scratch = std::env::temp_dir().join(format!("lora-audit-errors-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let run = |args: &[&std::ffi::OsStr]| {
        let out = lora_audit().args(args).env_remove("LORA_MAX_RANK").output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let os = |s: &str| std::ffi::OsString::from(s);
    // A missing directory is named as the directory, not as its config.
    let (code, stdout, stderr) = run(&[
        &os("check"),
        &os("/nonexistent/adapter"),
        &os("--model"),
        config.as_os_str(),
        &os("--json"),
    ]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("/nonexistent/adapter: no such adapter directory"),
        "{stderr}"
    );
    let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json["exit"], 2);
    assert!(
        json["error"].as_str().unwrap().contains("/nonexistent/adapter"),
        "{json}"
    );
    // An adapter config that is not JSON, a model config without model_type.
    let bad = scratch.join("bad-json");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("adapter_config.json"), "{not json").unwrap();
    let (code, _, stderr) = run(&[&os("check"), bad.as_os_str(), &os("--model"), config.as_os_str()]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains(&bad.join("adapter_config.json").display().to_string()),
        "{stderr}"
    );
    let no_type = scratch.join("config.json");
    std::fs::write(&no_type, r#"{"hidden_size": 64}"#).unwrap();
    let (code, _, stderr) = run(&[&os("check"), ok.dir.as_os_str(), &os("--model"), no_type.as_os_str()]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains(&no_type.display().to_string()) && stderr.contains("model_type"),
        "{stderr}"
    );
    // A probe file with no probe tensor, and probes of weights the adapter
    // does not serve: errors, never an empty output file.
    let out = scratch.join("out.safetensors");
    let probe = |probes: &Path| {
        run(&[
            &os("probe"),
            ok.dir.as_os_str(),
            &os("--model"),
            config.as_os_str(),
            &os("--probes"),
            probes.as_os_str(),
            &os("--out"),
            out.as_os_str(),
        ])
    };
    let (code, _, stderr) = probe(&ok.model.join("tables.safetensors"));
    assert_eq!(code, Some(2));
    assert!(stderr.contains("holds no probe_in:: or rows_idx:: tensor"), "{stderr}");
    let unserved = scratch.join("unserved.safetensors");
    let values = vec![0u8; 4 * 64 * 4];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4, 64], &values).unwrap();
    safetensors::serialize_to_file(
        [("probe_in::model.layers.0.input_layernorm.weight", view)],
        None,
        &unserved,
    )
    .unwrap();
    let (code, _, stderr) = probe(&unserved);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("no probe names a weight this adapter serves"),
        "{stderr}"
    );
    assert!(!out.exists(), "no output file is written");
    // A write that fails is a write error, not a corrupt file.
    let (code, _, stderr) = run(&[
        &os("probe"),
        ok.dir.as_os_str(),
        &os("--model"),
        config.as_os_str(),
        &os("--probes"),
        ok.oracle().unwrap().as_os_str(),
        &os("--out"),
        &os("/nonexistent/dir/out.safetensors"),
    ]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("cannot write /nonexistent/dir/out.safetensors"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&scratch).ok();
}

#[test]
fn probe_command_answers_the_oracle() {
    for name in [
        "llama/trainable_tokens_untied_dict",
        "llama/embedding_lora",
        "llama/lm_head_lora",
        "qwen3_moe/experts_fused_router",
        "mixtral_v4/experts_w1_w2_w3_router",
    ] {
        let f = fixture(name);
        let out_dir = std::env::temp_dir().join(format!("lora-audit-probe-{}", std::process::id()));
        std::fs::create_dir_all(&out_dir).unwrap();
        let out = out_dir.join(format!("{}.safetensors", name.replace('/', "_")));
        let mut cmd = lora_audit();
        cmd.arg("probe")
            .arg(&f.dir)
            .arg("--model")
            .arg(f.model.join("config.json"))
            .arg("--experts")
            .arg("--embedding-lora")
            .arg("--lm-head-lora")
            .arg("--probes")
            .arg(f.oracle().unwrap())
            .arg("--out")
            .arg(&out);
        if let Some(t) = f.tables() {
            cmd.arg("--base").arg(t);
        }
        let status = cmd.output().unwrap();
        assert_eq!(
            status.status.code(),
            Some(0),
            "{name}: {}",
            String::from_utf8_lossy(&status.stderr)
        );
        let got: std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> =
            oracle_like(&out).into_iter().map(|(k, s, v)| (k, (s, v))).collect();
        for (key, shape, want) in oracle_outputs(&f.oracle().unwrap()) {
            let (s, v) = &got[&key];
            assert_eq!(s, &shape, "{name} {key}");
            assert!(relative_error(v, &want) < 1e-2, "{name} {key}");
        }
        // Only answers: no probe inputs or row ids are echoed.
        assert!(got.keys().all(|k| !k.starts_with(PROBE_IN) && !k.starts_with(ROWS_IDX)));
        let _ = std::fs::remove_dir_all(&out_dir);
    }
}

fn oracle_like(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let view = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    view.tensors()
        .into_iter()
        .map(|(k, t)| {
            let v = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (k, t.shape().to_vec(), v)
        })
        .collect()
}

#[test]
fn probing_a_refused_adapter_exits_1() {
    let f = fixture("llama/dora");
    let out = probe_command(&f, &std::env::temp_dir().join("lora-audit-never-written.safetensors"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}

/// DoRA fixtures: refused on a pool without DoRA, servable on one built for
/// it; their module-output probes equal PEFT's forward closely (the bias
/// outside the rescale included: qwen2's q/k/v have one), and a probe
/// without the base weight is refused with the code that says so.
#[test]
fn dora_fixtures_follow_peft_module_outputs() {
    let names = ["llama/dora", "llama/dora_rslora_alpha_pattern", "qwen2/dora_bias_qkv"];
    let mut biased = 0;
    for name in names {
        let f = fixture(name);
        let cfg = f.cfg();
        let plain = LoraOptions {
            dora: false,
            ..fixture_options()
        };
        let report = audit_adapter(&f.dir, &cfg, &plain).unwrap();
        assert_eq!(report.refused_codes(), BTreeSet::from([RejectCode::Dora]), "{name}");
        let adapter = prepare_adapter(&f.dir, &cfg, &fixture_options()).unwrap();
        assert!(adapter.report.is_dora(), "{name}");
        assert!(adapter.dense.iter().all(|p| p.magnitude.is_some()), "{name}");
        let oracle = f.oracle().unwrap();
        let inputs = read_probe_inputs(&oracle).unwrap();
        assert_eq!(
            inputs.base.len(),
            inputs.inputs.len(),
            "{name}: a base weight per probe"
        );
        biased += inputs.base.values().filter(|b| b.bias.is_some()).count();
        let outputs = probe_adapter(&adapter, &cfg, &inputs, None).unwrap();
        for (key, shape, want) in oracle_outputs(&oracle) {
            let got = &outputs.tensors[&key];
            let err = relative_error(&got.data, &want);
            // A and B are served in BF16 (2^-9 relative rounding each); PEFT used them in f32.
            assert!(
                got.shape == shape && err < 5e-3,
                "{name}: {key}: relative error {err:.3e}"
            );
        }
        // Under tensor parallelism a DoRA probe is refused, naming DoRA:
        // its row norm spans the input columns a row-parallel rank lacks.
        let tp = lora_layout::Placement::new(0, 2).unwrap();
        match probe_adapter_at(&adapter, &cfg, &inputs, None, tp) {
            Err(lora_audit::AuditError::Probe { reason, .. }) => assert!(reason.contains("DoRA"), "{name}: {reason}"),
            other => panic!("{name}: a DoRA probe under tensor parallelism gave {other:?}"),
        }
        let mut no_base = inputs.clone();
        no_base.base.clear();
        match probe_adapter(&adapter, &cfg, &no_base, None) {
            Err(lora_audit::AuditError::Refused(report)) => assert!(
                report.refused_codes().contains(&RejectCode::DoraNeedsBaseWeights),
                "{name}: {:?}",
                report.refused
            ),
            other => panic!("{name}: a DoRA probe without base weights gave {other:?}"),
        }
    }
    assert!(biased >= 6, "qwen2's q/k/v biases are in the oracle: {biased}");
}

/// `lora-audit probe --tp-rank R --tp-world W` for every rank: each rank's
/// file holds its part of every dense delta (column-parallel: its output
/// columns; row-parallel: the partial delta of its input slice), and the
/// parts reassemble PEFT's oracle. A world size the model's 4 heads do not
/// divide, or a rank outside its world, is bad usage (exit 2) naming why.
#[test]
fn probe_command_writes_each_tensor_parallel_ranks_part() {
    use lora_layout::{ModuleShard, Placement, ShardKind};
    let f = fixture("llama/dense_all_linear_f32");
    let cfg = ModelConfig::from_file(&f.model.join("config.json")).unwrap();
    let out_dir = std::env::temp_dir().join(format!("lora-audit-probe-tp-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    let probe = |extra: &[&str], out: &Path| probe_command(&f, out).args(extra).output().unwrap();
    let oracle = oracle_outputs(&f.oracle().unwrap());
    for world in [2usize, 4] {
        let mut parts = Vec::new();
        for rank in 0..world {
            let out = out_dir.join(format!("x{world}-r{rank}.safetensors"));
            let run = probe(
                &["--tp-rank", &rank.to_string(), "--tp-world", &world.to_string()],
                &out,
            );
            assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
            let got: std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> =
                oracle_like(&out).into_iter().map(|(k, s, v)| (k, (s, v))).collect();
            parts.push((Placement::new(rank, world).unwrap(), got));
        }
        for (key, shape, want) in &oracle {
            let weight = key.strip_prefix(PROBE_OUT).unwrap();
            let module = LoraModule::ALL
                .into_iter()
                .find(|m| weight.ends_with(&format!("{}.weight", m.path(cfg.family))))
                .unwrap();
            let (n, out) = (shape[0], shape[1]);
            let mut full = vec![0.0f32; n * out];
            for (p, got) in &parts {
                let shard = ModuleShard::of(module, &cfg, *p).unwrap();
                let (s, v) = &got[key];
                if shard.kind == ShardKind::Row {
                    assert_eq!(s, &[n, out], "{key}");
                    full.iter_mut().zip(v).for_each(|(f, x)| *f += x);
                } else {
                    let (out_r, _) = shard.dims();
                    assert_eq!(s, &[n, out_r], "{key}");
                    for j in 0..out_r {
                        let col = shard.src_row(j).unwrap();
                        for t in 0..n {
                            full[t * out + col] = v[t * out_r + j];
                        }
                    }
                }
            }
            assert!(relative_error(&full, want) < 1e-2, "x{world} {key}");
        }
    }
    let out = out_dir.join("never.safetensors");
    let run = probe(&["--tp-rank", "0", "--tp-world", "8"], &out);
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("num_attention_heads"));
    let run = probe(&["--tp-rank", "2", "--tp-world", "2"], &out);
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("tp_rank=\"2\": must be below tp_world"));
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// `lora-audit probe --experts --ep-rank R --ep-world W`: an expert the
/// rank does not hold answers zeros, the router the whole delta on every
/// rank, and the ranks' answers summed (the router's taken once)
/// reassemble PEFT's oracle; `check` places the rank's experts only. A
/// world the model's 4 experts do not divide is exit 2 naming
/// `num_experts`.
#[test]
fn probe_command_writes_each_expert_parallel_ranks_part() {
    let f = fixture("qwen3_moe/experts_fused_router");
    let out_dir = std::env::temp_dir().join(format!("lora-audit-probe-ep-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    let probe = |extra: &[&str], out: &Path| {
        probe_command(&f, out)
            .args(["--max-rank", "16", "--experts"])
            .args(extra)
            .output()
            .unwrap()
    };
    let oracle = oracle_outputs(&f.oracle().unwrap());
    let mut fused = 0;
    for world in [2usize, 4] {
        let mut sum: std::collections::BTreeMap<String, Vec<f32>> = std::collections::BTreeMap::new();
        for rank in 0..world {
            let out = out_dir.join(format!("x{world}-r{rank}.safetensors"));
            let run = probe(
                &["--ep-rank", &rank.to_string(), "--ep-world", &world.to_string()],
                &out,
            );
            assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
            for (key, shape, v) in oracle_like(&out) {
                if key.contains(".experts.") {
                    // `[E, n, out]`: the rank's block of experts only.
                    let per = v.len() / shape[0];
                    let held = rank * shape[0] / world..(rank + 1) * shape[0] / world;
                    for e in (0..shape[0]).filter(|e| !held.contains(e)) {
                        assert!(v[e * per..(e + 1) * per].iter().all(|x| *x == 0.0), "{key} expert {e}");
                    }
                    fused += 1;
                    let s = sum.entry(key).or_insert_with(|| vec![0.0; v.len()]);
                    s.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
                } else {
                    match sum.get(&key) {
                        Some(s) => assert_eq!(s, &v, "{key}: the same on every rank"),
                        None => {
                            sum.insert(key, v);
                        }
                    }
                }
            }
        }
        for (key, _, want) in &oracle {
            assert!(relative_error(&sum[key], want) < 1e-2, "x{world} {key}");
        }
    }
    assert!(fused > 0, "no fused expert probe");
    let out = out_dir.join("never.safetensors");
    let run = probe(&["--ep-rank", "0", "--ep-world", "8"], &out);
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("num_experts"));
    let run = probe(&["--ep-rank", "2", "--ep-world", "2"], &out);
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("ep_rank=\"2\": must be below ep_world"));
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// `lora-audit check --tp-rank R --tp-world W --fully-sharded`: the
/// report's slot is the rank's fully-sharded layout (each column-parallel
/// A cut to the rank's block of rank rows), smaller than the half-sharded
/// rank's; a `--max-rank` the world does not divide is bad usage naming
/// `max_rank`.
#[test]
fn check_command_sizes_the_fully_sharded_ranks_slot() {
    use lora_layout::{Placement, SlotLayout};
    let f = fixture("llama/dense_all_linear_f32");
    let cfg = ModelConfig::from_file(&f.model.join("config.json")).unwrap();
    let check = |extra: &[&str]| {
        let max_rank = if extra.contains(&"--max-rank") {
            &[][..]
        } else {
            &["--max-rank", "16"][..]
        };
        lora_audit()
            .arg("check")
            .arg(&f.dir)
            .arg("--model")
            .arg(f.model.join("config.json"))
            .args(["--json", "--tp-rank", "1", "--tp-world", "2"])
            .args(max_rank)
            .args(extra)
            .env_remove("LORA_FULLY_SHARDED")
            .output()
            .unwrap()
    };
    let slot = |out: std::process::Output| {
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json["slot_bytes"].as_u64().unwrap() as usize
    };
    let p = Placement::new(1, 2).unwrap();
    let half = slot(check(&[]));
    let full = slot(check(&["--fully-sharded"]));
    assert_eq!(half, SlotLayout::with_placement(&cfg, 16, p).unwrap().slot_bytes());
    assert_eq!(
        full,
        SlotLayout::with_placement(&cfg, 16, p.with_fully_sharded(true))
            .unwrap()
            .slot_bytes()
    );
    assert!(full < half);
    let out = check(&["--fully-sharded", "--max-rank", "15"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("max_rank = 15"), "{said}");
}

/// `lora-audit probe --lm-head-lora --tp-rank R --tp-world W
/// --vocab-parallel` on the head-LoRA fixture: each rank's lm_head probe is
/// its logit columns `[n, V/W]` (the vocabulary block `R·V/W ..
/// (R+1)·V/W`), which side by side in rank order reassemble PEFT's oracle;
/// without `--vocab-parallel` every rank answers the whole `[n, V]`.
#[test]
fn probe_command_writes_each_vocab_parallel_ranks_logit_columns() {
    let f = fixture("llama/lm_head_lora_no_table");
    let cfg = ModelConfig::from_file(&f.model.join("config.json")).unwrap();
    let vocab = cfg.vocab_size;
    let out_dir = std::env::temp_dir().join(format!("lora-audit-probe-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    let probe = |extra: &[&str], out: &Path| {
        probe_command(&f, out)
            .args(["--max-rank", "16", "--lm-head-lora"])
            .args(extra)
            .env_remove("LORA_VOCAB_PARALLEL")
            .output()
            .unwrap()
    };
    let key = format!("{PROBE_OUT}lm_head.weight");
    let oracle = oracle_outputs(&f.oracle().unwrap());
    let (_, shape, want) = oracle.iter().find(|(k, _, _)| k == &key).unwrap();
    let n = shape[0];
    for world in [2usize, 4] {
        let part = vocab / world;
        let mut full = vec![0f32; n * vocab];
        for rank in 0..world {
            let (r, w) = (rank.to_string(), world.to_string());
            let out = out_dir.join(format!("x{world}-r{rank}.safetensors"));
            let run = probe(&["--tp-rank", &r, "--tp-world", &w, "--vocab-parallel"], &out);
            assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
            let (_, s, v) = oracle_like(&out).into_iter().find(|(k, _, _)| k == &key).unwrap();
            assert_eq!(s, [n, part], "x{world} rank {rank}");
            for t in 0..n {
                full[t * vocab + rank * part..t * vocab + (rank + 1) * part]
                    .copy_from_slice(&v[t * part..(t + 1) * part]);
            }
            let whole = out_dir.join(format!("x{world}-r{rank}-whole.safetensors"));
            let run = probe(&["--tp-rank", &r, "--tp-world", &w], &whole);
            assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
            let (_, s, _) = oracle_like(&whole).into_iter().find(|(k, _, _)| k == &key).unwrap();
            assert_eq!(s, [n, vocab], "x{world} rank {rank}: replicated without the cut");
        }
        assert!(relative_error(&full, want) < 1e-2, "x{world} {key}");
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}
