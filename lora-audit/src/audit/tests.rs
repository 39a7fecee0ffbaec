use super::*;
use crate::test_support::{self, RawTensor, ScratchDir, f32_tensor, safetensors_bytes};
use lora_layout::{LoraModule, SlotLayout};

fn write_adapter(config: &str, tensors: &[RawTensor]) -> ScratchDir {
    let dir = ScratchDir::new("audit");
    std::fs::write(dir.join(ADAPTER_CONFIG), config).unwrap();
    std::fs::write(dir.join(ADAPTER_WEIGHTS), safetensors_bytes(tensors)).unwrap();
    dir
}

fn zeros(name: &str, shape: &[usize]) -> RawTensor {
    f32_tensor(name, shape, &vec![0.5; shape.iter().product()])
}

fn pair(path: &str, r: usize, out: usize, inp: usize) -> [RawTensor; 2] {
    [
        zeros(&format!("base_model.model.{path}.lora_A.weight"), &[r, inp]),
        zeros(&format!("base_model.model.{path}.lora_B.weight"), &[out, r]),
    ]
}

fn experts_on() -> LoraOptions {
    LoraOptions {
        experts: true,
        ..LoraOptions::default()
    }
}

fn codes(report: &AuditReport) -> Vec<RejectCode> {
    report.refused_codes().into_iter().collect()
}

#[test]
fn dense_pairs_get_rank_from_shapes_and_scale_from_patterns() {
    let cfg = test_support::llama(false);
    let mut t = Vec::new();
    t.extend(pair("model.layers.0.self_attn.q_proj", 4, 64, 64));
    t.extend(pair("model.layers.1.self_attn.v_proj", 8, 32, 64));
    let dir = write_adapter(
        r#"{"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 4}}"#,
        &t,
    );
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert!(report.is_servable(), "{:?}", report.refused);
    let q = &report.placed[0];
    assert_eq!(
        (q.layer, q.module, q.rank, q.scale),
        (0, LoraModule::QProj, 4, 16.0 / 4.0)
    );
    let v = &report.placed[1];
    assert_eq!(
        (v.layer, v.module, v.rank, v.scale),
        (1, LoraModule::VProj, 8, 4.0 / 8.0)
    );
    assert_eq!(report.slot_bytes, lora_layout::pool_slot_bytes(&cfg, 16).unwrap());
    assert_eq!(report.expert_bytes, 0);
}

#[test]
fn config_rank_must_match_the_shapes_and_fit_the_pool() {
    let cfg = test_support::llama(false);
    let dir = write_adapter(r#"{"r": 8}"#, &pair("model.layers.0.self_attn.q_proj", 4, 64, 64));
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::RankMismatch]);
    let reason = &report.refused[0].reason;
    assert!(reason.contains("r=8") && reason.contains("r=4"), "names both: {reason}");

    let dir = write_adapter(r#"{"r": 32}"#, &pair("model.layers.0.self_attn.q_proj", 32, 64, 64));
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::RankExceedsMax]);
    let reason = &report.refused[0].reason;
    assert!(reason.contains("32") && reason.contains("16"), "names both: {reason}");
    let wide = LoraOptions {
        max_rank: 32,
        ..LoraOptions::default()
    };
    assert!(audit_adapter(&dir.0, &cfg, &wide).unwrap().is_servable());
}

#[test]
fn fused_experts_rank_is_rows_over_experts_whatever_the_nesting() {
    let cfg = test_support::qwen3_moe();
    let (e, r, hidden, inter) = (4, 2, 32, 16);
    // Nesting reversed from what PEFT does for Qwen3-MoE: the shapes decide.
    let t = vec![
        zeros(
            "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight",
            &[e * r, inter],
        ),
        zeros(
            "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight",
            &[hidden, e * r],
        ),
        zeros(
            "base_model.model.model.layers.1.mlp.experts.lora_A.weight",
            &[e * r, hidden],
        ),
        zeros(
            "base_model.model.model.layers.1.mlp.experts.lora_B.weight",
            &[2 * inter, e * r],
        ),
    ];
    let dir = write_adapter(
        r#"{"r": 2, "lora_alpha": 8, "use_rslora": true, "alpha_pattern": {"experts.down_proj": 2}}"#,
        &t,
    );
    let report = audit_adapter(&dir.0, &cfg, &experts_on()).unwrap();
    assert!(report.is_servable(), "{:?}", report.refused);
    assert_eq!(report.experts.len(), e * 3);
    for p in &report.experts {
        let ExpertSite::Expert { proj, .. } = p.site else {
            panic!("no router here")
        };
        assert_eq!(p.rank, r);
        let alpha = if proj == ExpertProj::Down { 2.0f64 } else { 8.0 };
        assert_eq!(p.scale, (alpha / (r as f64).sqrt()) as f32, "{:?}", p.site);
        let (is_down, key) = (proj == ExpertProj::Down, p.a_key.contains("base_layer"));
        assert_eq!(is_down, key, "down_proj is the inner wrapper in this adapter");
        match &p.slice {
            ExpertSlice::Fused { num_experts, out_rows } => {
                assert_eq!(*num_experts, e);
                let want = match proj {
                    ExpertProj::Gate => 0..inter,
                    ExpertProj::Up => inter..2 * inter,
                    ExpertProj::Down => 0..hidden,
                };
                assert_eq!(*out_rows, want);
            }
            ExpertSlice::Direct | ExpertSlice::FusedInterleaved { .. } => {
                panic!("Qwen3-MoE's fused pairs are contiguous slices: {:?}", p.slice)
            }
        }
    }
    assert_eq!(
        report.expert_bytes,
        expert_router_bytes(&cfg, 16, report.experts.iter().map(|p| (p.layer, p.site))).unwrap()
    );
}

#[test]
fn fused_pairs_that_fit_neither_parameter_are_refused() {
    let cfg = test_support::qwen3_moe();
    let t = vec![
        zeros("model.layers.1.mlp.experts.lora_A.weight", &[8, 32]),
        zeros("model.layers.1.mlp.experts.lora_B.weight", &[31, 8]),
    ];
    let report = audit_adapter(&write_adapter("{}", &t).0, &cfg, &experts_on()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Shape]);
    let t = vec![
        zeros("model.layers.1.mlp.experts.lora_A.weight", &[6, 32]),
        zeros("model.layers.1.mlp.experts.lora_B.weight", &[32, 6]),
    ];
    let report = audit_adapter(&write_adapter("{}", &t).0, &cfg, &experts_on()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Shape], "6 rows are not 4 experts x r");
}

#[test]
fn expert_tensors_need_experts_enabled_and_fit_the_expert_rank() {
    let cfg = test_support::qwen3_moe();
    let mut t = Vec::new();
    t.extend(pair("model.layers.0.self_attn.q_proj", 8, 32, 32));
    t.extend(pair("model.layers.1.mlp.experts.2.down_proj", 8, 32, 16));
    t.extend(pair("model.layers.1.mlp.gate", 8, 4, 32));
    let dir = write_adapter(r#"{"r": 8}"#, &t);
    let off = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&off), [RejectCode::ExpertsDisabled]);
    assert!(off.has_expert_deltas);
    let partial = LoraOptions {
        allow_partial: true,
        ..LoraOptions::default()
    };
    let skipped = audit_adapter(&dir.0, &cfg, &partial).unwrap();
    assert!(skipped.is_servable());
    assert_eq!(skipped.skipped.len(), 2);
    assert!(skipped.has_expert_deltas, "a request must still fold or refuse them");
    assert_eq!(skipped.placed.len(), 1);

    let on = audit_adapter(&dir.0, &cfg, &experts_on()).unwrap();
    assert!(on.is_servable());
    let sites: Vec<ExpertSite> = on.experts.iter().map(|p| p.site).collect();
    assert_eq!(
        sites,
        [
            ExpertSite::Expert {
                expert: 2,
                proj: ExpertProj::Down
            },
            ExpertSite::Router
        ]
    );
    let small = LoraOptions {
        expert_rank: 4,
        ..experts_on()
    };
    let too_big = audit_adapter(&dir.0, &cfg, &small).unwrap();
    assert_eq!(codes(&too_big), [RejectCode::ExpertRank]);
    assert!(
        too_big
            .refused
            .iter()
            .all(|r| r.reason.contains('8') && r.reason.contains('4'))
    );
}

#[test]
fn a_router_targeted_as_a_parameter_is_matched_by_its_parameter_path() {
    let cfg = test_support::qwen3_moe();
    let t = pair("model.layers.1.mlp.gate", 4, 4, 32);
    let by_param = r#"{"r": 4, "lora_alpha": 8, "target_parameters": ["mlp.gate.weight"],
                       "alpha_pattern": {"gate.weight": 2, "gate": 32}}"#;
    let report = audit_adapter(&write_adapter(by_param, &t).0, &cfg, &experts_on()).unwrap();
    assert_eq!(report.experts[0].scale, 2.0 / 4.0);
    let by_module = r#"{"r": 4, "lora_alpha": 8, "target_modules": ["gate"],
                        "alpha_pattern": {"gate.weight": 2, "gate": 32}}"#;
    let report = audit_adapter(&write_adapter(by_module, &t).0, &cfg, &experts_on()).unwrap();
    assert_eq!(report.experts[0].scale, 32.0 / 4.0);
}

#[test]
fn malformed_pairs_are_refused_naming_the_tensor() {
    let cfg = test_support::llama(false);
    let a_only = [zeros(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        &[8, 64],
    )];
    let report = audit_adapter(&write_adapter("{}", &a_only).0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Unpaired]);
    assert_eq!(report.refused[0].subject, a_only[0].0);

    let wrong_in = pair("model.layers.0.self_attn.q_proj", 8, 64, 32);
    let report = audit_adapter(&write_adapter("{}", &wrong_in).0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Shape]);

    let mut twice = pair("model.layers.0.self_attn.q_proj", 8, 64, 64).to_vec();
    twice.push(zeros("model.layers.0.self_attn.q_proj.lora_A.weight", &[8, 64]));
    let report = audit_adapter(&write_adapter("{}", &twice).0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::DuplicateTensor]);

    let mut ints = pair("model.layers.0.self_attn.q_proj", 8, 64, 64).to_vec();
    ints.push((
        "model.layers.0.self_attn.k_proj.lora_A.weight".into(),
        safetensors::Dtype::I32,
        vec![1],
        vec![0; 4],
    ));
    let report = audit_adapter(&write_adapter("{}", &ints).0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Dtype]);
}

#[test]
fn nothing_to_serve_is_refused() {
    let cfg = test_support::llama(false);
    let report = audit_adapter(&write_adapter("{}", &[]).0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Empty]);
    let only_unsupported = pair("model.layers.0.input_layernorm", 4, 64, 64);
    let partial = LoraOptions {
        allow_partial: true,
        ..LoraOptions::default()
    };
    let report = audit_adapter(&write_adapter("{}", &only_unsupported).0, &cfg, &partial).unwrap();
    assert_eq!(codes(&report), [RejectCode::Empty]);
    assert_eq!(report.skipped.len(), 2);
}

#[test]
fn a_pickle_adapter_is_refused_without_reading_it() {
    let cfg = test_support::llama(false);
    let dir = ScratchDir::new("pickle");
    std::fs::write(dir.join(ADAPTER_CONFIG), "{}").unwrap();
    std::fs::write(dir.join(ADAPTER_PICKLE), b"\x80\x02").unwrap();
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Pickle]);
}

#[test]
fn unreadable_input_is_an_error_not_a_report() {
    let cfg = test_support::llama(false);
    let dir = ScratchDir::new("unreadable");
    assert!(matches!(
        audit_adapter(&dir.0, &cfg, &LoraOptions::default()),
        Err(AuditError::Io { .. })
    ));
    std::fs::write(dir.join(ADAPTER_CONFIG), "{").unwrap();
    assert!(matches!(
        audit_adapter(&dir.0, &cfg, &LoraOptions::default()),
        Err(AuditError::ConfigJson { .. })
    ));
    std::fs::write(dir.join(ADAPTER_CONFIG), "{}").unwrap();
    std::fs::write(dir.join(ADAPTER_WEIGHTS), b"\x10\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    assert!(matches!(
        audit_adapter(&dir.0, &cfg, &LoraOptions::default()),
        Err(AuditError::Safetensors { .. })
    ));
}

fn tokens(config: &str, tensors: &[RawTensor], cfg: &ModelConfig, opts: &LoraOptions) -> AuditReport {
    audit_adapter(&write_adapter(config, tensors).0, cfg, opts).unwrap()
}

const EMBED_DELTA: &str = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta";
const HEAD_DELTA: &str = "base_model.model.lm_head.token_adapter.trainable_tokens_delta";

#[test]
fn trainable_tokens_are_checked_against_config_and_vocab() {
    let cfg = test_support::llama(false);
    let opts = LoraOptions::default();
    let ok = tokens(
        r#"{"trainable_token_indices": [3, 9]}"#,
        &[zeros(EMBED_DELTA, &[2, 64])],
        &cfg,
        &opts,
    );
    assert!(ok.is_servable(), "{:?}", ok.refused);
    assert_eq!(ok.overlay.embed_ids, [3, 9]);
    assert_eq!(
        ok.overlay.lm_head,
        LmHeadMode::None,
        "an untied head is untouched by the list form"
    );

    let cases: &[(&str, Vec<RawTensor>, RejectCode)] = &[
        (
            r#"{"trainable_token_indices": [3, 9]}"#,
            vec![zeros(EMBED_DELTA, &[3, 64])],
            RejectCode::Shape,
        ),
        (
            r#"{"trainable_token_indices": [3, 3]}"#,
            vec![zeros(EMBED_DELTA, &[2, 64])],
            RejectCode::DuplicateTokenId,
        ),
        (
            r#"{"trainable_token_indices": [3, 256]}"#,
            vec![zeros(EMBED_DELTA, &[2, 64])],
            RejectCode::TokenOutOfVocab,
        ),
        (r#"{}"#, vec![zeros(EMBED_DELTA, &[2, 64])], RejectCode::TrainableTokens),
        (
            r#"{"trainable_token_indices": [3]}"#,
            pair("model.layers.0.self_attn.q_proj", 8, 64, 64).to_vec(),
            RejectCode::TrainableTokens,
        ),
    ];
    for (config, tensors, code) in cases {
        let report = tokens(config, tensors, &cfg, &opts);
        assert_eq!(codes(&report), [*code], "{config}");
    }
    let partial = LoraOptions {
        allow_partial: true,
        ..opts
    };
    let clamped = tokens(
        r#"{"trainable_token_indices": [3, 256]}"#,
        &[zeros(EMBED_DELTA, &[2, 64])],
        &cfg,
        &partial,
    );
    assert!(clamped.is_servable());
    assert_eq!(clamped.skipped[0].code, RejectCode::TokenOutOfVocab);
}

#[test]
fn tied_heads_follow_peft() {
    let tied = test_support::llama(true);
    let opts = LoraOptions::default();
    let list = tokens(
        r#"{"trainable_token_indices": [3]}"#,
        &[zeros(EMBED_DELTA, &[1, 64])],
        &tied,
        &opts,
    );
    assert_eq!(list.overlay.lm_head, LmHeadMode::TiedTrainableRows);
    let table = tokens(
        r#"{"modules_to_save": ["embed_tokens"]}"#,
        &[zeros("base_model.model.model.embed_tokens.weight", &[256, 64])],
        &tied,
        &opts,
    );
    assert!(table.is_servable());
    assert_eq!(table.overlay.lm_head, LmHeadMode::None, "PEFT's copy unties the head");
    let head = tokens(
        r#"{"trainable_token_indices": {"embed_tokens": [1], "lm_head": [2]}}"#,
        &[zeros(EMBED_DELTA, &[1, 64]), zeros(HEAD_DELTA, &[1, 64])],
        &tied,
        &opts,
    );
    assert_eq!(codes(&head), [RejectCode::TiedHead]);
    let untied = tokens(
        r#"{"trainable_token_indices": {"embed_tokens": [1], "lm_head": [2]}}"#,
        &[zeros(EMBED_DELTA, &[1, 64]), zeros(HEAD_DELTA, &[1, 64])],
        &test_support::llama(false),
        &opts,
    );
    assert!(untied.is_servable());
    assert_eq!(
        (untied.overlay.lm_head, untied.overlay.lm_head_ids.as_slice()),
        (LmHeadMode::Own, &[2u32][..])
    );
}

#[test]
fn full_tables_must_be_the_served_shape() {
    let cfg = test_support::llama(false);
    let report = tokens(
        r#"{"modules_to_save": ["lm_head"]}"#,
        &[zeros("base_model.model.lm_head.weight", &[260, 64])],
        &cfg,
        &LoraOptions::default(),
    );
    assert_eq!(codes(&report), [RejectCode::Shape]);
}

#[test]
fn config_targets_that_can_never_be_served() {
    let next = test_support::qwen3_next();
    let config =
        PeftAdapterConfig::from_json(r#"{"target_modules": ["in_proj_qkvz", "out_proj", "lm_head"]}"#).unwrap();
    let refusals = validate_peft_config(&config, &next);
    let got: Vec<RejectCode> = refusals.iter().map(|r| r.code).collect();
    // lm_head is judged on its tensors (a LoRA pair on the head).
    assert_eq!(got, [RejectCode::GdnTarget]);
    assert!(refusals.iter().all(|r| r.subject == "target_modules"));
    // A name the model does not have is not a reason to refuse.
    let llama = test_support::llama(false);
    assert!(
        validate_peft_config(&config, &llama)[..]
            .iter()
            .all(|r| r.code != RejectCode::GdnTarget)
    );
}

/// The fixtures' adapters with a safetensors file, with their model config.
fn fixture_adapters() -> Vec<(ModelConfig, std::path::PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut found = Vec::new();
    let mut models: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).collect();
    models.sort();
    for model in models.into_iter().filter(|m| m.join("config.json").is_file()) {
        let cfg = ModelConfig::from_file(&model.join("config.json")).unwrap();
        let mut adapters: Vec<_> = std::fs::read_dir(&model).unwrap().map(|e| e.unwrap().path()).collect();
        adapters.sort();
        for adapter in adapters.into_iter().filter(|a| a.join(ADAPTER_WEIGHTS).is_file()) {
            found.push((cfg.clone(), adapter));
        }
    }
    found
}

#[test]
fn the_header_audit_is_the_directory_audit_for_every_fixture() {
    let fixtures = fixture_adapters();
    assert!(fixtures.len() >= 20, "{} fixtures", fixtures.len());
    let partial = LoraOptions {
        allow_partial: true,
        ..experts_on()
    };
    for (cfg, dir) in &fixtures {
        for opts in [LoraOptions::default(), partial.clone()] {
            let from_dir = audit_adapter(dir, cfg, &opts);
            let text = std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).unwrap();
            let infos = LoadedSafetensors::open(&dir.join(ADAPTER_WEIGHTS))
                .unwrap()
                .infos()
                .unwrap();
            let from_header = audit_header(&dir.display().to_string(), &text, infos, cfg, &opts);
            match (from_dir, from_header) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{}", dir.display()),
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{}", dir.display()),
                (a, b) => panic!("{}: {a:?} vs {b:?}", dir.display()),
            }
        }
    }
}

#[test]
fn the_header_audit_ignores_tensor_order_and_reads_no_data() {
    let (cfg, dir) = fixture_adapters()
        .into_iter()
        .find(|(_, d)| d.ends_with("llama/rank_alpha_pattern"))
        .unwrap();
    let text = std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).unwrap();
    let infos = LoadedSafetensors::open(&dir.join(ADAPTER_WEIGHTS))
        .unwrap()
        .infos()
        .unwrap();
    let mut reversed = infos.clone();
    reversed.reverse();
    let opts = LoraOptions::default();
    let sorted = audit_header("a", &text, infos, &cfg, &opts).unwrap();
    assert!(sorted.is_servable() && !sorted.placed.is_empty());
    assert_eq!(audit_header("a", &text, reversed, &cfg, &opts).unwrap(), sorted);
    // A header naming a tensor twice (impossible in a file, possible on the
    // wire) is refused, not trusted.
    let mut twice = LoadedSafetensors::open(&dir.join(ADAPTER_WEIGHTS))
        .unwrap()
        .infos()
        .unwrap();
    twice.push(twice[0].clone());
    let report = audit_header("a", &text, twice, &cfg, &opts).unwrap();
    assert!(
        codes(&report).contains(&RejectCode::DuplicateTensor),
        "{:?}",
        codes(&report)
    );
    assert!(audit_header("a", "{not json", vec![], &cfg, &opts).is_err());
}

/// A 2-D tensor of 0.5s with `value` at element `at`, in `dtype`.
fn with_value(name: &str, shape: &[usize], dtype: safetensors::Dtype, at: usize, value: f32) -> RawTensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|i| if i == at { value } else { 0.5 }).collect();
    let bytes: Vec<u8> = match dtype {
        safetensors::Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        safetensors::Dtype::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
    };
    (name.to_string(), dtype, shape.to_vec(), bytes)
}

/// The non-finite refusals of a report: `(tensor, reason)`.
fn non_finite(report: &AuditReport) -> Vec<(&str, &str)> {
    report
        .refused
        .iter()
        .filter(|r| r.code == RejectCode::NonFinite)
        .map(|r| (r.subject.as_str(), r.reason.as_str()))
        .collect()
}

#[test]
fn non_finite_values_are_refused_as_served_naming_the_tensor() {
    use safetensors::Dtype;
    let cfg = test_support::llama(false);
    let a = |m: &str| format!("base_model.model.model.layers.0.self_attn.{m}.lora_A.weight");
    let b = |m: &str| format!("base_model.model.model.layers.0.self_attn.{m}.lora_B.weight");
    let t = vec![
        with_value(&a("q_proj"), &[4, 64], Dtype::F32, 5, f32::NAN),
        zeros(&b("q_proj"), &[64, 4]),
        zeros(&a("k_proj"), &[4, 64]),
        // Finite in F32, +inf once rounded to BF16.
        with_value(&b("k_proj"), &[32, 4], Dtype::F32, 7, 3.4e38),
        zeros(&a("v_proj"), &[4, 64]),
        with_value(&b("v_proj"), &[32, 4], Dtype::BF16, 0, f32::NEG_INFINITY),
        zeros(&a("o_proj"), &[4, 64]),
        // The largest F32 that still rounds to a finite BF16: served.
        with_value(&b("o_proj"), &[64, 4], Dtype::F32, 1, f32::from_bits(0x7F7F_7FFF)),
    ];
    let dir = write_adapter(r#"{"r": 4}"#, &t);
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::NonFinite]);
    let found = non_finite(&report);
    let subjects: Vec<&str> = found.iter().map(|f| f.0).collect();
    assert_eq!(subjects, [b("k_proj"), a("q_proj"), b("v_proj")]);
    assert!(
        found[0].1.contains("element 7") && found[0].1.contains("+inf"),
        "{}",
        found[0].1
    );
    assert!(
        found[1].1.contains("element 5") && found[1].1.contains("NaN"),
        "{}",
        found[1].1
    );
    // The header-only audit cannot see values.
    let text = std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).unwrap();
    let infos = LoadedSafetensors::open(&dir.join(ADAPTER_WEIGHTS))
        .unwrap()
        .infos()
        .unwrap();
    assert!(
        audit_header("h", &text, infos, &cfg, &LoraOptions::default())
            .unwrap()
            .is_servable()
    );
    // prepare_adapter refuses with the same report.
    match crate::prepare_adapter(&dir.0, &cfg, &LoraOptions::default()) {
        Err(AuditError::Refused(r)) => assert_eq!(r.refused, report.refused),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn non_finite_experts_routers_and_token_rows_are_refused() {
    use safetensors::Dtype;
    let moe = test_support::qwen3_moe();
    let mut t = Vec::new();
    t.extend(pair("model.layers.1.mlp.experts.2.down_proj", 8, 32, 16));
    t[1] = with_value(&t[1].0.clone(), &[32, 8], Dtype::F16, 3, f32::INFINITY);
    t.extend(pair("model.layers.1.mlp.gate", 8, 4, 32));
    t[2] = with_value(&t[2].0.clone(), &[8, 32], Dtype::F32, 0, f32::NAN);
    t.push(zeros("model.layers.1.mlp.experts.base_layer.lora_A.weight", &[16, 32]));
    t.push(with_value(
        "model.layers.1.mlp.experts.base_layer.lora_B.weight",
        &[32, 16],
        Dtype::BF16,
        31,
        f32::NAN,
    ));
    let dir = write_adapter(r#"{"r": 8, "rank_pattern": {"gate_up_proj": 4}}"#, &t);
    let report = audit_adapter(&dir.0, &moe, &experts_on()).unwrap();
    let subjects: Vec<&str> = non_finite(&report).iter().map(|f| f.0).collect();
    assert_eq!(
        subjects,
        [
            "base_model.model.model.layers.1.mlp.experts.2.down_proj.lora_B.weight",
            "base_model.model.model.layers.1.mlp.gate.lora_A.weight",
            "model.layers.1.mlp.experts.base_layer.lora_B.weight",
        ],
        "{:?}",
        report.refused
    );

    let cfg = test_support::llama(false);
    let rows = tokens(
        r#"{"trainable_token_indices": [3, 9]}"#,
        &[with_value(EMBED_DELTA, &[2, 64], Dtype::F32, 70, f32::NAN)],
        &cfg,
        &LoraOptions::default(),
    );
    assert_eq!(non_finite(&rows).iter().map(|f| f.0).collect::<Vec<_>>(), [EMBED_DELTA]);
    let table = tokens(
        r#"{"modules_to_save": ["lm_head"]}"#,
        &[with_value(
            "base_model.model.lm_head.weight",
            &[256, 64],
            Dtype::BF16,
            100,
            f32::INFINITY,
        )],
        &cfg,
        &LoraOptions::default(),
    );
    assert_eq!(
        non_finite(&table).iter().map(|f| f.0).collect::<Vec<_>>(),
        ["base_model.model.lm_head.weight"]
    );
}

#[test]
fn an_alpha_that_overflows_f32_is_refused_naming_the_field() {
    let cfg = test_support::llama(false);
    let mut t = pair("model.layers.0.self_attn.q_proj", 8, 64, 64).to_vec();
    t.extend(pair("model.layers.1.self_attn.q_proj", 8, 64, 64));
    t.extend(pair("model.layers.0.self_attn.k_proj", 8, 32, 64));
    for (config, subject, key) in [
        (r#"{"r": 8, "lora_alpha": 1e40}"#, "lora_alpha", None),
        (r#"{"r": 8, "lora_alpha": -1e308}"#, "lora_alpha", None),
        (
            r#"{"r": 8, "use_rslora": true, "lora_alpha": 1e39}"#,
            "lora_alpha",
            None,
        ),
        // The scale of a pattern entry, checked as served too.
        (
            r#"{"r": 8, "alpha_pattern": {"q_proj": 1e40}}"#,
            "alpha_pattern",
            Some("`q_proj`"),
        ),
        (
            r#"{"r": 8, "alpha_pattern": {"k_proj": -3e40, "q_proj": 2}}"#,
            "alpha_pattern",
            Some("`k_proj`"),
        ),
    ] {
        let report = audit_adapter(&write_adapter(config, &t).0, &cfg, &LoraOptions::default()).unwrap();
        assert_eq!(codes(&report), [RejectCode::NonFiniteScale], "{config}");
        // One refusal per alpha source, not one per pair.
        assert_eq!(report.refused.len(), 1, "{config}: {:?}", report.refused);
        assert_eq!(report.refused[0].subject, subject, "{config}");
        assert!(
            key.is_none_or(|k| report.refused[0].reason.contains(k)),
            "{:?}",
            report.refused[0]
        );
        assert!(report.placed.iter().all(|p| p.scale.is_finite()), "{config}");
    }
    // Served scales that are finite in f32 are served, even when alpha is not.
    for ok in [
        r#"{"r": 8, "lora_alpha": 2.7e39}"#,
        r#"{"r": 8, "alpha_pattern": {"down_proj": 1e39}}"#,
    ] {
        let report = audit_adapter(&write_adapter(ok, &t).0, &cfg, &LoraOptions::default()).unwrap();
        assert!(report.is_servable(), "{ok}: {:?}", report.refused);
        assert!(report.placed.iter().all(|p| p.scale.is_finite()));
    }
}

#[test]
fn pattern_keys_python_cannot_compile_are_refused_not_applied() {
    // Issue 42: `{"(?i)Q_PROJ": 1000}` gave q_proj a scale of 353.55.
    let cfg = test_support::llama(false);
    let t = pair("model.layers.0.self_attn.q_proj", 8, 64, 64);
    for key in [r"(?i)Q_PROJ", r"(?s)q.proj", r"\x{71}_proj", r"q_proj\z"] {
        let config = serde_json::json!({"r": 8, "lora_alpha": 8, "alpha_pattern": {key: 1000}}).to_string();
        let report = audit_adapter(&write_adapter(&config, &t).0, &cfg, &LoraOptions::default()).unwrap();
        assert_eq!(codes(&report), [RejectCode::PatternRegex], "{key}");
        assert!(
            report.refused[0].reason.contains(key),
            "names the key: {}",
            report.refused[0].reason
        );
    }
}

#[test]
fn tensor_names_outside_printable_ascii_are_unknown_keys() {
    let cfg = test_support::llama(false);
    let mut t = Vec::new();
    t.extend(pair("model.layers.0.self_attn.q_proj", 8, 64, 64));
    t.extend(pair("modèle.layers.1.self_attn.q_proj", 8, 64, 64));
    let report = audit_adapter(&write_adapter(r#"{"r": 8}"#, &t).0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::UnknownKey]);
    assert_eq!(report.refused.len(), 2, "both halves");
    assert_eq!(report.placed.len(), 1);
}

#[test]
fn phi3_fused_pairs_are_placed_at_the_fused_width() {
    let cfg = test_support::phi3();
    let mut t = Vec::new();
    t.extend(pair("model.layers.0.self_attn.qkv_proj", 4, 64, 32));
    t.extend(pair("model.layers.1.mlp.gate_up_proj", 2, 128, 32));
    let dir = write_adapter(r#"{"r": 4, "lora_alpha": 8, "rank_pattern": {"gate_up_proj": 2}}"#, &t);
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert!(report.is_servable(), "{:?}", report.refused);
    let placed: Vec<_> = report
        .placed
        .iter()
        .map(|p| (p.layer, p.module, p.rank, p.scale))
        .collect();
    assert_eq!(
        placed,
        [(0, LoraModule::QkvProj, 4, 2.0), (1, LoraModule::GateUpProj, 2, 4.0)]
    );
    // A B of q's width alone does not fit the fused output.
    let dir = write_adapter(
        r#"{"r": 4, "lora_alpha": 8}"#,
        &pair("model.layers.0.self_attn.qkv_proj", 4, 32, 32),
    );
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Shape]);
}

#[test]
fn gemma_projections_use_head_dim_not_hidden() {
    // q_proj is 4 heads x 16 = 64 wide on hidden 32; o_proj takes 64.
    let cfg = test_support::gemma3();
    let mut t = Vec::new();
    t.extend(pair("model.language_model.layers.0.self_attn.q_proj", 4, 64, 32));
    t.extend(pair("model.language_model.layers.0.self_attn.o_proj", 4, 32, 64));
    let dir = write_adapter(r#"{"r": 4, "lora_alpha": 8}"#, &t);
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert!(report.is_servable(), "{:?}", report.refused);
    let dir = write_adapter(
        r#"{"r": 4, "lora_alpha": 8}"#,
        &pair("model.language_model.layers.0.self_attn.q_proj", 4, 32, 32),
    );
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::Shape]);
    // The vision tower's q_proj, even of a shape that fits the text
    // decoder's, is refused by name; under allow_partial it is skipped and
    // listed, and the text pair is served.
    let mut t = pair("model.language_model.layers.0.self_attn.q_proj", 4, 64, 32).to_vec();
    t.extend(pair("model.vision_tower.encoder.layers.0.self_attn.q_proj", 4, 64, 32));
    let dir = write_adapter(r#"{"r": 4, "lora_alpha": 8}"#, &t);
    let report = audit_adapter(&dir.0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::VisionTower]);
    assert_eq!(report.placed.len(), 1);
    let partial = LoraOptions {
        allow_partial: true,
        ..LoraOptions::default()
    };
    let report = audit_adapter(&dir.0, &cfg, &partial).unwrap();
    assert!(report.is_servable());
    assert_eq!(report.skipped.len(), 2, "{:?}", report.skipped);
}

#[test]
fn a_dense_weight_targeted_as_a_parameter_matches_patterns_by_its_parameter_path() {
    // PEFT matched rank/alpha patterns of a `target_parameters` weight
    // against `….weight` (GLM-4.5's shared experts have no other way in).
    let cfg = test_support::deepseek_v3(Some(16));
    let t = pair("model.layers.1.mlp.shared_experts.down_proj", 2, 32, 16);
    let config = r#"{"r": 4, "lora_alpha": 8, "target_parameters": ["mlp.shared_experts.down_proj.weight"],
        "rank_pattern": {"shared_experts.down_proj.weight": 2}}"#;
    let report = audit_adapter(&write_adapter(config, &t).0, &cfg, &LoraOptions::default()).unwrap();
    assert!(report.is_servable(), "{:?}", report.refused);
    assert_eq!((report.placed[0].rank, report.placed[0].scale), (2, 4.0));
    // Targeted as a module, the same key matches by its module path only.
    let config = r#"{"r": 4, "lora_alpha": 8, "target_modules": ["down_proj"],
        "rank_pattern": {"shared_experts.down_proj.weight": 2}}"#;
    let report = audit_adapter(&write_adapter(config, &t).0, &cfg, &LoraOptions::default()).unwrap();
    assert_eq!(codes(&report), [RejectCode::RankMismatch]);
}

#[test]
fn gpt_oss_gate_up_is_cut_from_interleaved_rows_and_bias_targets_are_refused() {
    let cfg = test_support::gpt_oss();
    let (e, r, hidden, inter) = (4, 2, 32, 16);
    let mut t = Vec::new();
    // gate_up_proj (inner), down_proj (outer), the router weight.
    t.extend(pair("model.layers.0.mlp.experts.base_layer", e * r, 2 * inter, hidden));
    t.extend(pair("model.layers.0.mlp.experts", e * r, hidden, inter));
    t.extend(pair("model.layers.1.mlp.router", r, e, hidden));
    let dir = write_adapter(r#"{"r": 2, "lora_alpha": 4}"#, &t);
    let report = audit_adapter(&dir.0, &cfg, &experts_on()).unwrap();
    assert!(report.is_servable(), "{:?}", report.refused);
    assert_eq!(report.experts.len(), e * 3 + 1);
    for p in &report.experts {
        match p.site {
            ExpertSite::Expert { proj, .. } => {
                let want: Vec<usize> = match proj {
                    ExpertProj::Gate => (0..inter).map(|j| 2 * j).collect(),
                    ExpertProj::Up => (0..inter).map(|j| 2 * j + 1).collect(),
                    ExpertProj::Down => (0..hidden).collect(),
                };
                assert_eq!(p.slice.out_rows(), want, "{:?}", p.site);
            }
            ExpertSite::Router => assert_eq!((p.layer, &p.slice), (1, &ExpertSlice::Direct)),
        }
    }
    // A third wrapper on `gate_up_proj_bias` ([E, 2·inter] read as a 2-D
    // weight: A [r, 2·inter], B [E, r]) is refused naming the parameter.
    let mut t = Vec::new();
    t.extend(pair(
        "model.layers.0.mlp.experts.base_layer.base_layer",
        e * r,
        2 * inter,
        hidden,
    ));
    t.extend(pair("model.layers.0.mlp.experts.base_layer", r, e, 2 * inter));
    t.extend(pair("model.layers.0.mlp.experts", e * r, hidden, inter));
    let dir = write_adapter(r#"{"r": 2, "lora_alpha": 4}"#, &t);
    let report = audit_adapter(&dir.0, &cfg, &experts_on()).unwrap();
    assert_eq!(codes(&report), [RejectCode::UnsupportedTarget]);
    assert!(
        report.refused[0].reason.contains("mlp.experts.gate_up_proj_bias"),
        "{}",
        report.refused[0]
    );
    assert_eq!(report.experts.len(), e * 3, "the weights' pairs are still placed");
}

#[test]
fn a_tensor_parallel_rank_sizes_its_slot_and_a_cut_that_does_not_divide_is_named() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
    let cfg = ModelConfig::from_file(&fixtures.join("config.json")).unwrap();
    let dir = fixtures.join("rslora");
    for world in [1, 2, 4] {
        for placement in lora_layout::Placement::new(0, world).unwrap().ranks() {
            let opts = LoraOptions {
                placement,
                ..LoraOptions::default()
            };
            let report = audit_adapter(&dir, &cfg, &opts).unwrap();
            assert!(report.is_servable());
            let layout = SlotLayout::with_placement(&cfg, opts.max_rank, placement).unwrap();
            assert_eq!(report.slot_bytes, layout.slot_bytes());
        }
    }
    // The llama fixture has 4 attention heads: 8 ranks cannot cut them.
    let opts = LoraOptions {
        placement: lora_layout::Placement::new(5, 8).unwrap(),
        ..LoraOptions::default()
    };
    let err = audit_adapter(&dir, &cfg, &opts).unwrap_err();
    assert!(
        matches!(
            &err,
            AuditError::Layout(lora_layout::LayoutError::Placement(
                lora_layout::PlacementError::Indivisible {
                    dimension: "num_attention_heads",
                    size: 4,
                    tp_world: 8,
                    ..
                }
            ))
        ),
        "{err}"
    );
    assert!(err.to_string().contains("num_attention_heads"), "{err}");
}

const EMBED_A: &str = "base_model.model.model.embed_tokens.lora_embedding_A";
const EMBED_B: &str = "base_model.model.model.embed_tokens.lora_embedding_B";
const EMBED_COPY: &str = "base_model.model.model.embed_tokens.base_layer.weight";

fn embedding_on() -> LoraOptions {
    LoraOptions {
        embedding_lora: true,
        ..LoraOptions::default()
    }
}

#[test]
fn embedding_lora_is_placed_with_peft_scaling() {
    let cfg = test_support::llama(false);
    let tensors = [
        zeros(EMBED_A, &[4, 256]),
        zeros(EMBED_B, &[64, 4]),
        zeros(EMBED_COPY, &[256, 64]),
    ];
    let report = tokens(r#"{"r": 4, "lora_alpha": 8}"#, &tensors, &cfg, &embedding_on());
    assert!(report.is_servable(), "{:?}", report.refused);
    let e = report.embedding.as_ref().unwrap();
    assert_eq!(
        (e.rank, e.scale, e.a_key.as_str(), e.b_key.as_str()),
        (4, 2.0, EMBED_A, EMBED_B)
    );
    assert_eq!(
        report.overlay.tensors.embed.base_table(),
        Some(EMBED_COPY),
        "the saved base copy is a full table"
    );
    assert!(report.served_tensors().contains(EMBED_A) && report.served_tensors().contains(EMBED_B));
    let with_place = embedding_on().slot_layout(&cfg).unwrap().slot_bytes();
    assert_eq!(report.slot_bytes, with_place);
    assert!(with_place > lora_layout::pool_slot_bytes(&cfg, 16).unwrap());
    // rsLoRA, then an alpha_pattern keyed by the module path.
    let rs = tokens(
        r#"{"r": 4, "lora_alpha": 8, "use_rslora": true}"#,
        &tensors,
        &cfg,
        &embedding_on(),
    );
    assert_eq!(rs.embedding.unwrap().scale, 4.0);
    let pattern = tokens(
        r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"embed_tokens": 2}}"#,
        &tensors,
        &cfg,
        &embedding_on(),
    );
    assert_eq!(pattern.embedding.unwrap().scale, 0.5);
    let ranked = tokens(
        r#"{"r": 8, "rank_pattern": {"model.embed_tokens": 4}}"#,
        &tensors,
        &cfg,
        &embedding_on(),
    );
    assert!(ranked.is_servable(), "{:?}", ranked.refused);
}

#[test]
fn embedding_lora_refusals_name_the_tensor() {
    let cfg = test_support::llama(false);
    let pair = [zeros(EMBED_A, &[4, 256]), zeros(EMBED_B, &[64, 4])];
    let off = tokens(r#"{"r": 4}"#, &pair, &cfg, &LoraOptions::default());
    assert_eq!(codes(&off), [RejectCode::EmbeddingLoraDisabled]);
    assert_eq!(off.refused[0].subject, EMBED_A);
    let tied = tokens(r#"{"r": 4}"#, &pair, &test_support::llama(true), &embedding_on());
    assert_eq!(codes(&tied), [RejectCode::EmbeddingLora]);
    let mut with_tokens = pair.to_vec();
    with_tokens.push(zeros(EMBED_DELTA, &[1, 64]));
    let both = tokens(
        r#"{"r": 4, "trainable_token_indices": [3]}"#,
        &with_tokens,
        &cfg,
        &embedding_on(),
    );
    assert_eq!(codes(&both), [RejectCode::EmbeddingLora]);
    let cases: &[(&str, Vec<RawTensor>, RejectCode)] = &[
        (r#"{"r": 4}"#, vec![zeros(EMBED_A, &[4, 256])], RejectCode::Unpaired),
        (
            r#"{"r": 4}"#,
            vec![zeros(EMBED_A, &[4, 255]), zeros(EMBED_B, &[64, 4])],
            RejectCode::Shape,
        ),
        (
            r#"{"r": 4}"#,
            vec![zeros(EMBED_A, &[4, 256]), zeros(EMBED_B, &[64, 3])],
            RejectCode::Shape,
        ),
        (r#"{"r": 8}"#, pair.to_vec(), RejectCode::RankMismatch),
        (
            r#"{"r": 32}"#,
            vec![zeros(EMBED_A, &[32, 256]), zeros(EMBED_B, &[64, 32])],
            RejectCode::RankExceedsMax,
        ),
    ];
    for (config, tensors, code) in cases {
        let report = tokens(config, tensors, &cfg, &embedding_on());
        assert_eq!(codes(&report), [*code], "{config}");
        assert!(report.embedding.is_none());
    }
}

/// DoRA on the input embedding is refused on a pool with both the DoRA
/// rescale and the embedding place (never served as a plain pair): the
/// rescale covers dense projections only. The two options are otherwise
/// independent: a plain embedding pair is placed on a DoRA pool.
#[test]
fn dora_on_the_input_embedding_is_refused_with_both_options_on() {
    let cfg = test_support::llama(false);
    let both = LoraOptions {
        dora: true,
        ..embedding_on()
    };
    let magnitude = "base_model.model.model.embed_tokens.lora_magnitude_vector";
    let pair = [zeros(EMBED_A, &[4, 256]), zeros(EMBED_B, &[64, 4])];
    let with_m = [pair[0].clone(), pair[1].clone(), zeros(magnitude, &[256])];
    for tensors in [&pair[..], &with_m[..]] {
        let report = tokens(r#"{"r": 4, "use_dora": true}"#, tensors, &cfg, &both);
        assert!(!report.is_servable(), "{} tensors", tensors.len());
        assert!(report.embedding.is_none());
        assert!(codes(&report).contains(&RejectCode::Dora), "{:?}", report.refused);
    }
    let plain = tokens(r#"{"r": 4}"#, &pair, &cfg, &both);
    assert!(plain.is_servable(), "{:?}", plain.refused);
    assert!(plain.embedding.is_some());
}

#[test]
fn a_tensor_parallel_rank_places_the_embedding_pair_whole() {
    let cfg = test_support::llama(false);
    let tensors = [zeros(EMBED_A, &[4, 256]), zeros(EMBED_B, &[64, 4])];
    for world in [1, 2, 4] {
        for placement in lora_layout::Placement::new(0, world).unwrap().ranks() {
            let opts = LoraOptions {
                placement,
                ..embedding_on()
            };
            let report = tokens(r#"{"r": 4, "lora_alpha": 8}"#, &tensors, &cfg, &opts);
            assert!(report.is_servable(), "{:?}", report.refused);
            let e = report.embedding.as_ref().unwrap();
            assert_eq!((e.rank, e.scale), (4, 2.0));
            // The rank's dense shards, then the whole embedding pair.
            let dense = SlotLayout::with_placement(&cfg, opts.max_rank, placement).unwrap();
            let whole_pair = lora_layout::pair_bytes(cfg.hidden_size, cfg.vocab_size, opts.max_rank).unwrap();
            assert_eq!(report.slot_bytes, dense.slot_bytes() + whole_pair);
            assert_eq!(report.slot_bytes, opts.slot_layout(&cfg).unwrap().slot_bytes());
        }
    }
}

const HEAD_A: &str = "base_model.model.lm_head.lora_A.weight";
const HEAD_B: &str = "base_model.model.lm_head.lora_B.weight";
const HEAD_COPY: &str = "base_model.model.lm_head.base_layer.weight";

fn head_on() -> LoraOptions {
    LoraOptions {
        lm_head_lora: true,
        ..LoraOptions::default()
    }
}

#[test]
fn lm_head_lora_is_placed_with_peft_scaling() {
    let cfg = test_support::llama(false);
    let mut tensors = pair("model.layers.0.self_attn.q_proj", 4, 64, 64).to_vec();
    tensors.extend([
        zeros(HEAD_A, &[4, 64]),
        zeros(HEAD_B, &[256, 4]),
        zeros(HEAD_COPY, &[256, 64]),
    ]);
    let config = r#"{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]}"#;
    let report = tokens(config, &tensors, &cfg, &head_on());
    assert!(report.is_servable(), "{:?}", report.refused);
    let h = report.lm_head.as_ref().unwrap();
    assert_eq!(
        (h.rank, h.scale, h.a_key.as_str(), h.b_key.as_str()),
        (4, 2.0, HEAD_A, HEAD_B)
    );
    assert_eq!(report.placed.len(), 1, "the decoder pair beside it");
    assert_eq!(
        report.overlay.tensors.lm_head.base_table(),
        Some(HEAD_COPY),
        "the saved head table is the head's own table"
    );
    assert!(report.served_tensors().contains(HEAD_A) && report.served_tensors().contains(HEAD_B));
    let with_place = head_on().slot_layout(&cfg).unwrap().slot_bytes();
    assert_eq!(report.slot_bytes, with_place);
    assert_eq!(
        with_place - lora_layout::pool_slot_bytes(&cfg, 16).unwrap(),
        2 * 16 * (64 + 256),
        "the head place: A [16, hidden] and B [vocab, 16]"
    );
    let rs = tokens(
        r#"{"r": 4, "lora_alpha": 8, "use_rslora": true}"#,
        &tensors,
        &cfg,
        &head_on(),
    );
    assert_eq!(rs.lm_head.unwrap().scale, 4.0);
    let pattern = tokens(
        r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"lm_head": 2}}"#,
        &tensors,
        &cfg,
        &head_on(),
    );
    assert_eq!(pattern.lm_head.unwrap().scale, 0.5);
    let ranked = tokens(
        r#"{"r": 8, "rank_pattern": {"lm_head": 4, "q_proj": 4}}"#,
        &tensors,
        &cfg,
        &head_on(),
    );
    assert!(ranked.is_servable(), "{:?}", ranked.refused);
}

#[test]
fn lm_head_lora_refusals_name_the_tensor() {
    let cfg = test_support::llama(false);
    let head = [zeros(HEAD_A, &[4, 64]), zeros(HEAD_B, &[256, 4])];
    let off = tokens(r#"{"r": 4}"#, &head, &cfg, &LoraOptions::default());
    assert_eq!(codes(&off), [RejectCode::LmHeadLoraDisabled]);
    assert_eq!(off.refused[0].subject, HEAD_A);
    assert!(
        off.refused[0].reason.contains("LORA_LM_HEAD_LORA"),
        "{}",
        off.refused[0]
    );
    // A tied head: PEFT's forward and merge disagree.
    let tied = tokens(r#"{"r": 4}"#, &head, &test_support::llama(true), &head_on());
    assert_eq!(codes(&tied), [RejectCode::TiedHead]);
    assert_eq!(tied.refused[0].subject, HEAD_A);
    // Trainable tokens on the same head: PEFT refuses to build it.
    let mut with_tokens = head.to_vec();
    with_tokens.push(zeros(
        "base_model.model.lm_head.token_adapter.trainable_tokens_delta",
        &[1, 64],
    ));
    let both = tokens(
        r#"{"r": 4, "trainable_token_indices": {"lm_head": [3]}}"#,
        &with_tokens,
        &cfg,
        &head_on(),
    );
    assert_eq!(codes(&both), [RejectCode::TrainableTokens]);
    assert!(both.lm_head.is_none());
    let cases: &[(&str, Vec<RawTensor>, RejectCode)] = &[
        (r#"{"r": 4}"#, vec![zeros(HEAD_B, &[256, 4])], RejectCode::Unpaired),
        (
            r#"{"r": 4}"#,
            vec![zeros(HEAD_A, &[4, 63]), zeros(HEAD_B, &[256, 4])],
            RejectCode::Shape,
        ),
        (
            r#"{"r": 4}"#,
            vec![zeros(HEAD_A, &[4, 64]), zeros(HEAD_B, &[255, 4])],
            RejectCode::Shape,
        ),
        (
            r#"{"r": 4}"#,
            vec![zeros(HEAD_A, &[4, 64]), zeros(HEAD_B, &[256, 3])],
            RejectCode::Shape,
        ),
        (r#"{"r": 8}"#, head.to_vec(), RejectCode::RankMismatch),
        (
            r#"{"r": 32}"#,
            vec![zeros(HEAD_A, &[32, 64]), zeros(HEAD_B, &[256, 32])],
            RejectCode::RankExceedsMax,
        ),
        (
            r#"{"r": 4}"#,
            vec![
                zeros(HEAD_A, &[4, 64]),
                zeros("base_model.model.model.lm_head.lora_A.weight", &[4, 64]),
                zeros(HEAD_B, &[256, 4]),
            ],
            RejectCode::DuplicateTensor,
        ),
    ];
    for (config, tensors, code) in cases {
        let report = tokens(config, tensors, &cfg, &head_on());
        assert_eq!(codes(&report), [*code], "{config}");
        // A duplicate keeps the first tensor placed, as for any pair: the
        // refusal makes the adapter unservable.
        assert!(report.lm_head.is_none() || *code == RejectCode::DuplicateTensor);
    }
}

#[test]
fn a_tensor_parallel_rank_places_the_head_pair_whole_after_the_embedding_pair() {
    let cfg = test_support::llama(false);
    let tensors = [
        zeros(EMBED_A, &[4, 256]),
        zeros(EMBED_B, &[64, 4]),
        zeros(HEAD_A, &[4, 64]),
        zeros(HEAD_B, &[256, 4]),
    ];
    for world in [1, 2, 4] {
        for placement in lora_layout::Placement::new(0, world).unwrap().ranks() {
            let opts = LoraOptions {
                placement,
                embedding_lora: true,
                ..head_on()
            };
            let report = tokens(r#"{"r": 4, "lora_alpha": 8}"#, &tensors, &cfg, &opts);
            assert!(report.is_servable(), "{:?}", report.refused);
            let h = report.lm_head.as_ref().unwrap();
            assert_eq!((h.rank, h.scale), (4, 2.0));
            assert!(report.embedding.is_some());
            // The rank's dense shards, then the whole embedding and head pairs.
            let dense = SlotLayout::with_placement(&cfg, opts.max_rank, placement).unwrap();
            let whole_pairs = 2 * lora_layout::pair_bytes(cfg.hidden_size, cfg.vocab_size, opts.max_rank).unwrap();
            assert_eq!(report.slot_bytes, dense.slot_bytes() + whole_pairs);
            assert_eq!(report.slot_bytes, opts.slot_layout(&cfg).unwrap().slot_bytes());
        }
    }
}
