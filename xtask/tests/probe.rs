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

/// `xtask probe <adapter> --model <config> --probes <probes> --out <out>`,
/// for the caller's flags.
fn probe_cmd(
    adapter: impl AsRef<std::ffi::OsStr>,
    config: impl AsRef<std::ffi::OsStr>,
    probes: impl AsRef<std::ffi::OsStr>,
    out: impl AsRef<std::ffi::OsStr>,
) -> Command {
    let mut cmd = xtask();
    cmd.arg("probe")
        .arg(adapter)
        .arg("--model")
        .arg(config)
        .arg("--probes")
        .arg(probes)
        .arg("--out")
        .arg(out);
    cmd
}

fn probe(model: &Path, adapter: &Path, device: &str, out: &Path) -> std::process::Output {
    probe_with(model, adapter, device, out, &["--dora"])
}

fn probe_with(model: &Path, adapter: &Path, device: &str, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = probe_cmd(
        adapter,
        model.join("config.json"),
        adapter.join("oracle.safetensors"),
        out,
    );
    cmd.args([
        "--device",
        device,
        "--max-rank",
        "16",
        "--experts",
        "--embedding-lora",
        "--lm-head-lora",
    ])
    .args(extra)
    .env_remove("LORA_DORA");
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
    // DoRA on a pool not built for it.
    let run = probe_with(&model, &model.join("dora"), "cpu", &out, &[]);
    assert_eq!(run.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&run.stdout).contains("REJECT[dora]"));
    // DoRA without the base weights (a probe file with none).
    let no_base = fixtures().join("llama/demo_r4_plain/oracle.safetensors");
    let run = probe_cmd(model.join("dora"), model.join("config.json"), &no_base, &out)
        .args(["--device", "cpu", "--dora"])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&run.stdout).contains("REJECT[dora-needs-base-weights]"));
    // DoRA on a tensor- or expert-parallel rank's pool: bad usage, named.
    for placed in [
        ["--tp-rank", "0", "--tp-world", "2"],
        ["--ep-rank", "0", "--ep-world", "2"],
    ] {
        let run = probe_with(
            &model,
            &model.join("dora"),
            "cpu",
            &out,
            &[&["--dora"][..], &placed[..]].concat(),
        );
        assert_eq!(run.status.code(), Some(2), "{placed:?}");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(stderr.contains("dora") && stderr.contains("parallelism"), "{stderr}");
        assert!(!out.exists());
    }
    let run = xtask().args(["probe", "--model"]).output().unwrap();
    assert_eq!(run.status.code(), Some(2));
}

/// The tensors of a probe output file by name: (shape, values).
fn outputs(path: &Path) -> std::collections::BTreeMap<String, lora_audit::ProbeTensor> {
    read_oracle(path).unwrap().expected
}

/// `cargo xtask probe --tp-rank R --tp-world W` on the dense fixtures of
/// llama (and Phi-3's fused projections): each rank's file equals the pure
/// path's part for that rank (`lora_audit::probe_adapter_at`), and the
/// ranks' parts reassemble PEFT's oracle (column-parallel side by side,
/// row-parallel summed); the output head's LoRA pair, replicated, answers
/// the whole delta on every rank. A world size the 4 heads do not divide is exit 2
/// naming the dimension.
#[test]
fn each_tensor_parallel_ranks_part_reassembles_peft_through_the_cpu_serving_path() {
    use lora_audit::{LoraOptions, PROBE_OUT, prepare_adapter, probe_adapter_at};
    use lora_layout::{LoraModule, ModelConfig, ModuleShard, Placement, ShardKind};
    let tmp = std::env::temp_dir().join(format!("xtask-probe-tp-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let cases = [
        ("llama", "dense_all_linear_f32"),
        ("llama", "rank_alpha_pattern"),
        ("phi3", "all_linear"),
        ("llama", "lm_head_lora_no_table"),
    ];
    for (family, name) in cases {
        let model = fixtures().join(family);
        let adapter = model.join(name);
        let cfg = ModelConfig::from_file(&model.join("config.json")).unwrap();
        let oracle = read_oracle(&adapter.join("oracle.safetensors")).unwrap();
        for world in [2usize, 4] {
            let mut full: std::collections::BTreeMap<String, Vec<f32>> = std::collections::BTreeMap::new();
            for placement in Placement::new(0, world).unwrap().ranks() {
                let out = tmp.join(format!("{family}-{name}-{world}-{}.safetensors", placement.tp_rank()));
                let rank = placement.tp_rank().to_string();
                let run = probe_cmd(
                    &adapter,
                    model.join("config.json"),
                    adapter.join("oracle.safetensors"),
                    &out,
                )
                .args(["--device", "cpu", "--max-rank", "16", "--lm-head-lora"])
                .args(["--tp-rank", &rank, "--tp-world", &world.to_string()])
                .output()
                .unwrap();
                assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
                let served = outputs(&out);
                let opts = LoraOptions {
                    placement,
                    lm_head_lora: true,
                    ..LoraOptions::default()
                };
                let pure = probe_adapter_at(
                    &prepare_adapter(&adapter, &cfg, &opts).unwrap(),
                    &cfg,
                    &oracle.inputs,
                    None,
                    placement,
                )
                .unwrap();
                for (weight, x) in &oracle.inputs.inputs {
                    let key = format!("{PROBE_OUT}{weight}");
                    let what = format!("{family}/{name} x{world} rank {rank} {weight}");
                    let part = &served[&key];
                    assert_eq!(part.shape, pure.tensors[&key].shape, "{what}");
                    let err = rel_error(&part.data, &pure.tensors[&key].data);
                    assert!(err < 1e-3, "{what}: {err} against the pure path's part");
                    if weight == "lm_head.weight" {
                        // The head pair is replicated: every rank answers
                        // the whole delta.
                        let err = rel_error(&part.data, &oracle.expected[&key].data);
                        assert!(err < 1e-2, "{what}: {err} against PEFT");
                        continue;
                    }
                    let module = LoraModule::ALL
                        .into_iter()
                        .find(|m| weight.ends_with(&format!("{}.weight", m.path(cfg.family))))
                        .unwrap();
                    let shard = ModuleShard::of(module, &cfg, placement).unwrap();
                    let (n, out_full) = (x.shape[0], module.dims(&cfg).0);
                    let whole = full.entry(key).or_insert_with(|| vec![0.0; n * out_full]);
                    if shard.kind == ShardKind::Row {
                        whole.iter_mut().zip(&part.data).for_each(|(w, v)| *w += v);
                    } else {
                        let (out_r, _) = shard.dims();
                        for j in 0..out_r {
                            let col = shard.src_row(j).unwrap();
                            for t in 0..n {
                                whole[t * out_full + col] = part.data[t * out_r + j];
                            }
                        }
                    }
                }
            }
            for (key, whole) in &full {
                let err = rel_error(whole, &oracle.expected[key].data);
                assert!(err < 1e-2, "{family}/{name} x{world} {key}: {err} against PEFT");
            }
        }
    }
    let model = fixtures().join("llama");
    let run = probe_cmd(
        model.join("rslora"),
        model.join("config.json"),
        model.join("rslora/oracle.safetensors"),
        tmp.join("never.safetensors"),
    )
    .args(["--device", "cpu", "--tp-rank", "1", "--tp-world", "8"])
    .output()
    .unwrap();
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("num_attention_heads"));
    let _ = std::fs::remove_dir_all(&tmp);
}

/// `cargo xtask probe --tp-rank R --tp-world W --fully-sharded`: the
/// output contract is unchanged (each rank writes its part), and every
/// rank's part equals the half-sharded (default) rank's within 1e-3
/// relative: the column-parallel probes through the fully-sharded apply
/// (every rank's pool loaded, their shrink outputs all-gathered on the
/// host), the others as before.
#[test]
fn a_fully_sharded_ranks_probe_equals_the_half_sharded_ranks_part() {
    let tmp = std::env::temp_dir().join(format!("xtask-probe-fsh-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for (family, name, world) in [
        ("llama", "dense_all_linear_f32", 2usize),
        ("phi3", "all_linear", 2),
        ("llama", "rank_alpha_pattern", 4),
    ] {
        let model = fixtures().join(family);
        let adapter = model.join(name);
        for rank in 0..world {
            let run = |extra: &[&str], tag: &str| {
                let out = tmp.join(format!("{family}-{name}-{world}-{rank}-{tag}.safetensors"));
                let run = probe_cmd(
                    &adapter,
                    model.join("config.json"),
                    adapter.join("oracle.safetensors"),
                    &out,
                )
                .args(["--device", "cpu", "--max-rank", "16"])
                .args(["--tp-rank", &rank.to_string(), "--tp-world", &world.to_string()])
                .args(extra)
                .output()
                .unwrap();
                assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
                outputs(&out)
            };
            let half = run(&[], "half");
            let full = run(&["--fully-sharded"], "full");
            assert_eq!(half.keys().collect::<Vec<_>>(), full.keys().collect::<Vec<_>>());
            for (key, want) in &half {
                let got = &full[key];
                let what = format!("{family}/{name} x{world} rank {rank} {key}");
                assert_eq!(got.shape, want.shape, "{what}");
                let err = rel_error(&got.data, &want.data);
                assert!(err < 1e-3, "{what}: {err} against the half-sharded rank");
            }
        }
    }
    // The option reaches the rank's layout: a max_rank the world does not
    // divide is bad usage naming max_rank.
    let model = fixtures().join("llama");
    let run = probe_cmd(
        model.join("rslora"),
        model.join("config.json"),
        model.join("rslora/oracle.safetensors"),
        tmp.join("never.safetensors"),
    )
    .args([
        "--device",
        "cpu",
        "--max-rank",
        "15",
        "--tp-rank",
        "1",
        "--tp-world",
        "2",
        "--fully-sharded",
    ])
    .output()
    .unwrap();
    assert_eq!(run.status.code(), Some(2), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stderr).contains("max_rank = 15"));
    let _ = std::fs::remove_dir_all(&tmp);
}

/// `cargo xtask probe --ep-rank R --ep-world W` on every servable MoE
/// fixture: each rank's file equals the pure path's answer for that rank
/// (`lora_audit::probe_adapter_at`); an expert the rank does not hold
/// answers zeros, the router and the dense weights answer the same on
/// every rank, and the ranks' expert answers summed reassemble PEFT's
/// oracle. An expert-parallel world the 4 experts do not divide is exit 2
/// naming `num_experts`.
#[test]
fn each_expert_parallel_ranks_part_reassembles_peft_through_the_cpu_serving_path() {
    use lora_audit::{LoraOptions, PROBE_OUT, WeightRef, parse_weight_name, prepare_adapter, probe_adapter_at};
    use lora_layout::{ModelConfig, Placement};
    let tmp = std::env::temp_dir().join(format!("xtask-probe-ep-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut expert_keys = 0;
    let moe: Vec<_> = servable()
        .into_iter()
        .filter(|(model, _)| {
            ModelConfig::from_file(&model.join("config.json"))
                .unwrap()
                .moe
                .is_some()
        })
        .collect();
    assert!(moe.len() >= 10, "the MoE fixture set shrank: {}", moe.len());
    for (i, (model, adapter)) in moe.iter().enumerate() {
        let name = adapter.strip_prefix(fixtures()).unwrap().display().to_string();
        let cfg = ModelConfig::from_file(&model.join("config.json")).unwrap();
        let num_experts = cfg.moe.as_ref().unwrap().num_experts;
        let oracle = read_oracle(&adapter.join("oracle.safetensors")).unwrap();
        for world in [2usize, 4] {
            let mut sum: std::collections::BTreeMap<String, Vec<f32>> = std::collections::BTreeMap::new();
            for placement in Placement::SINGLE.with_experts(0, world).unwrap().expert_ranks() {
                let rank = placement.ep_rank();
                let out = tmp.join(format!("{i}-{world}-{rank}.safetensors"));
                let mut cmd = xtask();
                cmd.arg("probe")
                    .arg(adapter)
                    .arg("--model")
                    .arg(model.join("config.json"))
                    .arg("--probes")
                    .arg(adapter.join("oracle.safetensors"))
                    .arg("--out")
                    .arg(&out)
                    .args(["--device", "cpu", "--max-rank", "16", "--experts"])
                    .args(["--ep-rank", &rank.to_string(), "--ep-world", &world.to_string()]);
                let run = cmd.output().unwrap();
                assert!(run.status.success(), "{name}: {}", String::from_utf8_lossy(&run.stderr));
                let served = outputs(&out);
                let opts = LoraOptions {
                    placement,
                    experts: true,
                    max_rank: 16,
                    ..LoraOptions::default()
                };
                let prepared = prepare_adapter(adapter, &cfg, &opts).unwrap();
                let pure = probe_adapter_at(&prepared, &cfg, &oracle.inputs, None, placement).unwrap();
                let held = placement.expert_range(num_experts).unwrap();
                for (key, want) in &oracle.expected {
                    let what = format!("{name} x{world} rank {rank} {key}");
                    let part = &served[key];
                    assert_eq!(part.shape, want.shape, "{what}");
                    let err = rel_error(&part.data, &pure.tensors[key].data);
                    assert!(
                        err < 1e-3 || part.data == pure.tensors[key].data,
                        "{what}: {err} against the pure path"
                    );
                    let weight = key.strip_prefix(PROBE_OUT).unwrap();
                    let summed = match parse_weight_name(weight, &cfg).unwrap() {
                        WeightRef::Expert { expert, .. } => {
                            if !held.contains(&expert) {
                                assert!(part.data.iter().all(|v| *v == 0.0), "{what}: another rank's expert");
                            }
                            true
                        }
                        WeightRef::Fused { .. } => {
                            let per = part.data.len() / num_experts;
                            for e in (0..num_experts).filter(|e| !held.contains(e)) {
                                let block = &part.data[e * per..(e + 1) * per];
                                assert!(block.iter().all(|v| *v == 0.0), "{what}: expert {e} is another rank's");
                            }
                            true
                        }
                        _ => false,
                    };
                    match sum.get_mut(key) {
                        Some(s) if summed => s.iter_mut().zip(&part.data).for_each(|(a, b)| *a += b),
                        Some(s) => assert_eq!(s, &part.data, "{what}: the same on every rank"),
                        None => {
                            sum.insert(key.clone(), part.data.clone());
                        }
                    }
                    expert_keys += usize::from(summed);
                }
            }
            for (key, got) in &sum {
                let err = rel_error(got, &oracle.expected[key].data);
                assert!(err < 1e-2, "{name} x{world} {key}: {err} against PEFT");
            }
        }
    }
    assert!(expert_keys > 0, "no expert probe was reassembled");
    let model = fixtures().join("qwen3_moe");
    let adapter = model.join("experts_fused_router");
    let run = probe_cmd(
        &adapter,
        model.join("config.json"),
        adapter.join("oracle.safetensors"),
        tmp.join("never.safetensors"),
    )
    .args(["--device", "cpu", "--experts", "--ep-rank", "0", "--ep-world", "8"])
    .output()
    .unwrap();
    assert_eq!(run.status.code(), Some(2), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stderr).contains("num_experts"));
    assert!(!tmp.join("never.safetensors").exists());
    let _ = std::fs::remove_dir_all(&tmp);
}

/// `cargo xtask probe --tp-rank R --tp-world W --vocab-parallel` on the
/// embedding-LoRA, head-LoRA and token-overlay fixtures (tied and untied):
/// an embedding or head `rows_idx::` probe answers the rank's partial rows
/// `[n, hidden]` (zeros for a token outside the rank's vocabulary block),
/// which summed over the ranks reassemble PEFT's oracle; an lm_head LoRA
/// probe answers the rank's logit columns `[n, V/W]`, which side by side in
/// rank order reassemble it, and equal the pure path's part
/// (`lora_audit::probe_adapter_at`).
#[test]
fn each_vocab_parallel_ranks_part_reassembles_peft_through_the_cpu_serving_path() {
    use lora_audit::{LoraOptions, PROBE_OUT, ROWS_IDX, ROWS_MERGED, prepare_adapter, probe_adapter_at};
    use lora_layout::{ModelConfig, Placement};
    let tmp = std::env::temp_dir().join(format!("xtask-probe-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let cases = [
        ("llama", "embedding_lora"),
        ("llama", "lm_head_lora"),
        ("llama", "modules_to_save_embed_lm_head"),
        ("llama", "trainable_tokens_untied_dict"),
        ("llama_tied", "trainable_tokens_tied_list"),
        ("llama_tied", "modules_to_save_embed_tied"),
    ];
    let mut checked = 0;
    for (family, name) in cases {
        let model = fixtures().join(family);
        let adapter = model.join(name);
        let cfg = ModelConfig::from_file(&model.join("config.json")).unwrap();
        let oracle = read_oracle(&adapter.join("oracle.safetensors")).unwrap();
        let hidden = cfg.hidden_size;
        for world in [1usize, 2, 4] {
            let part_v = cfg.vocab_size / world;
            let mut whole: std::collections::BTreeMap<String, Vec<f32>> = std::collections::BTreeMap::new();
            for placement in Placement::new(0, world).unwrap().with_vocab_parallel(true).ranks() {
                let held = placement.vocab_range(cfg.vocab_size).unwrap();
                let out = tmp.join(format!("{family}-{name}-{world}-{}.safetensors", placement.tp_rank()));
                let rank = placement.tp_rank().to_string();
                let run = probe_cmd(
                    &adapter,
                    model.join("config.json"),
                    adapter.join("oracle.safetensors"),
                    &out,
                )
                .args([
                    "--device",
                    "cpu",
                    "--max-rank",
                    "16",
                    "--embedding-lora",
                    "--lm-head-lora",
                ])
                .args(["--tp-rank", &rank, "--tp-world", &world.to_string(), "--vocab-parallel"])
                .arg("--base")
                .arg(model.join("tables.safetensors"))
                .env_remove("LORA_VOCAB_PARALLEL")
                .output()
                .unwrap();
                assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
                let served = outputs(&out);
                let what = |key: &str| format!("{family}/{name} x{world} rank {rank} {key}");
                for (table, ids) in &oracle.inputs.rows {
                    let key = format!("{ROWS_MERGED}{table}");
                    let part = &served[&key];
                    assert_eq!(part.shape, vec![ids.len(), hidden], "{}", what(&key));
                    let sum = whole
                        .entry(key.clone())
                        .or_insert_with(|| vec![0.0; ids.len() * hidden]);
                    for (t, &id) in ids.iter().enumerate() {
                        let row = &part.data[t * hidden..(t + 1) * hidden];
                        if !held.contains(&(id as usize)) {
                            assert!(
                                row.iter().all(|&v| v == 0.0),
                                "{}: id {id} is another rank's",
                                what(&key)
                            );
                        }
                        sum[t * hidden..(t + 1) * hidden]
                            .iter_mut()
                            .zip(row)
                            .for_each(|(s, v)| *s += v);
                    }
                    assert!(oracle.inputs.rows.contains_key(table), "{ROWS_IDX}{table}");
                }
                if oracle.inputs.inputs.contains_key("lm_head.weight") {
                    let key = format!("{PROBE_OUT}lm_head.weight");
                    let part = &served[&key];
                    let n = oracle.inputs.inputs["lm_head.weight"].shape[0];
                    assert_eq!(part.shape, vec![n, part_v], "{}", what(&key));
                    let opts = LoraOptions {
                        placement,
                        lm_head_lora: true,
                        embedding_lora: true,
                        ..LoraOptions::default()
                    };
                    let pure = probe_adapter_at(
                        &prepare_adapter(&adapter, &cfg, &opts).unwrap(),
                        &cfg,
                        &lora_audit::ProbeInputs {
                            rows: Default::default(),
                            ..oracle.inputs.clone()
                        },
                        None,
                        placement,
                    )
                    .unwrap();
                    assert_eq!(pure.tensors[&key].shape, part.shape, "{}", what(&key));
                    let err = rel_error(&part.data, &pure.tensors[&key].data);
                    assert!(err < 1e-3, "{}: {err} against the pure path's part", what(&key));
                    let cols = whole.entry(key).or_insert_with(|| vec![0.0; n * cfg.vocab_size]);
                    for t in 0..n {
                        cols[t * cfg.vocab_size + held.start..t * cfg.vocab_size + held.end]
                            .copy_from_slice(&part.data[t * part_v..(t + 1) * part_v]);
                    }
                }
            }
            assert!(!whole.is_empty(), "{family}/{name}: nothing probed");
            for (key, got) in &whole {
                let err = rel_error(got, &oracle.expected[key].data);
                assert!(err < 1e-2, "{family}/{name} x{world} {key}: {err} against PEFT");
                checked += 1;
            }
        }
    }
    assert!(checked >= 24, "only {checked} reassembled tensors");
    let _ = std::fs::remove_dir_all(&tmp);
}
