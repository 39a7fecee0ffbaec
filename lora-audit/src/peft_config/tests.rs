use super::*;
use crate::error::RejectCode;

fn parse(json: &str) -> PeftAdapterConfig {
    PeftAdapterConfig::from_json(json).unwrap()
}

#[test]
fn defaults_are_peft_defaults() {
    let c = parse("{}");
    assert_eq!(c.peft_type, "LORA");
    assert_eq!(c.r, 8);
    assert_eq!(c.lora_alpha, 8.0);
    assert!(!c.use_rslora && !c.use_dora && !c.lora_bias);
    assert_eq!(c.bias, "none");
    assert_eq!(c.init_lora_weights, InitLoraWeights::Bool(true));
    assert!(c.refusals().is_empty());
}

#[test]
fn pattern_objects_keep_file_order_not_sorted_order() {
    let c = parse(r#"{"r": 8, "alpha_pattern": {"z_proj": 1, "a_proj": 2, "m_proj": 3}}"#);
    let keys: Vec<&str> = c.alpha_pattern.entries().iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["z_proj", "a_proj", "m_proj"]);
}

#[test]
fn a_repeated_pattern_key_keeps_its_first_place_and_last_value() {
    // What a Python dict built by json.load does.
    let c = parse(r#"{"alpha_pattern": {"q_proj": 1, "proj": 2, "q_proj": 3}}"#);
    let e = c.alpha_pattern.entries();
    assert_eq!((e[0].key.as_str(), e[0].value), ("q_proj", 3.0));
    assert_eq!((e[1].key.as_str(), e[1].value), ("proj", 2.0));
    assert_eq!(e.len(), 2);
}

#[test]
fn alpha_and_rank_come_from_the_first_matching_key() {
    let c = parse(
        r#"{"r": 8, "lora_alpha": 16,
            "rank_pattern": {"q_proj": 4},
            "alpha_pattern": {"down_proj": 2, "model.layers.1.mlp.down_proj": 32}}"#,
    );
    assert_eq!(c.rank_for("model.layers.0.self_attn.q_proj"), 4);
    assert_eq!(c.rank_for("model.layers.0.self_attn.k_proj"), 8);
    assert_eq!(c.alpha_for("model.layers.1.mlp.down_proj"), 2.0);
    assert_eq!(c.alpha_for("model.layers.1.mlp.up_proj"), 16.0);
}

#[test]
fn scaling_is_alpha_over_r_or_over_sqrt_r_with_rslora() {
    let plain = parse(r#"{"lora_alpha": 8}"#);
    assert_eq!(plain.scale_for("x.q_proj", 16), (8.0f64 / 16.0) as f32);
    let rs = parse(r#"{"lora_alpha": 8, "use_rslora": true}"#);
    assert_eq!(rs.scale_for("x.q_proj", 16), (8.0f64 / 16f64.sqrt()) as f32);
    let patterned = parse(r#"{"lora_alpha": 8, "use_rslora": true, "alpha_pattern": {"q_proj": 3.5}}"#);
    assert_eq!(patterned.scale_for("x.q_proj", 4), (3.5f64 / 2.0) as f32);
}

#[test]
fn unsupported_math_is_refused_naming_the_field() {
    let cases: &[(&str, RejectCode, &str)] = &[
        (r#"{"peft_type": "LOHA"}"#, RejectCode::PeftType, "peft_type"),
        (r#"{"use_dora": true}"#, RejectCode::Dora, "use_dora"),
        (r#"{"lora_bias": true}"#, RejectCode::LoraBias, "lora_bias"),
        (
            r#"{"init_lora_weights": "pissa_niter_4"}"#,
            RejectCode::InitMutatesBase,
            "init_lora_weights",
        ),
        (
            r#"{"init_lora_weights": "olora"}"#,
            RejectCode::InitMutatesBase,
            "init_lora_weights",
        ),
        (
            r#"{"init_lora_weights": "corda"}"#,
            RejectCode::InitMutatesBase,
            "init_lora_weights",
        ),
        (
            r#"{"init_lora_weights": "loftq"}"#,
            RejectCode::InitMutatesBase,
            "init_lora_weights",
        ),
        (
            r#"{"init_lora_weights": "lora_ga"}"#,
            RejectCode::InitMutatesBase,
            "init_lora_weights",
        ),
        (
            r#"{"init_lora_weights": "something_new"}"#,
            RejectCode::InitMutatesBase,
            "init_lora_weights",
        ),
        (
            r#"{"init_lora_weights": "mica"}"#,
            RejectCode::LoraVariant,
            "init_lora_weights",
        ),
        (
            r#"{"alora_invocation_tokens": [1, 2]}"#,
            RejectCode::Alora,
            "alora_invocation_tokens",
        ),
        (
            r#"{"layer_replication": [[0, 2]]}"#,
            RejectCode::LayerReplication,
            "layer_replication",
        ),
        (r#"{"use_qalora": true}"#, RejectCode::Qalora, "use_qalora"),
        (r#"{"use_bdlora": {"nblocks": 2}}"#, RejectCode::Bdlora, "use_bdlora"),
        (r#"{"velora_config": {}}"#, RejectCode::LoraVariant, "velora_config"),
        (r#"{"kasa_config": {"x": 1}}"#, RejectCode::LoraVariant, "kasa_config"),
        (
            r#"{"modules_to_save": ["score"]}"#,
            RejectCode::ModulesToSave,
            "modules_to_save",
        ),
        (
            r#"{"trainable_token_indices": {"wte2": [1]}}"#,
            RejectCode::TrainableTokens,
            "trainable_token_indices",
        ),
        (
            r#"{"alpha_pattern": {"(?<=a)q_proj": 1}}"#,
            RejectCode::PatternRegex,
            "alpha_pattern",
        ),
        (
            r#"{"rank_pattern": {"q_proj\\1": 2}}"#,
            RejectCode::PatternRegex,
            "rank_pattern",
        ),
    ];
    for (json, code, field) in cases {
        let refusals = parse(json).refusals();
        assert_eq!(refusals.len(), 1, "{json}: {refusals:?}");
        assert_eq!(refusals[0].code, *code, "{json}");
        assert_eq!(refusals[0].subject, *field, "{json}");
        assert!(!refusals[0].reason.is_empty());
        match parse_peft_adapter_config(json) {
            Err(AuditError::ConfigRefused(r)) => assert_eq!(r, refusals),
            other => panic!("{json}: expected ConfigRefused, got {other:?}"),
        }
    }
}

#[test]
fn plain_initialisations_and_empty_variant_fields_are_accepted() {
    for json in [
        r#"{"init_lora_weights": false}"#,
        r#"{"init_lora_weights": "gaussian"}"#,
        r#"{"init_lora_weights": "eva"}"#,
        r#"{"init_lora_weights": "orthogonal"}"#,
        r#"{"alora_invocation_tokens": null, "layer_replication": [], "use_bdlora": null, "velora_config": null}"#,
        r#"{"modules_to_save": ["embed_tokens", "model.language_model.lm_head"]}"#,
        r#"{"trainable_token_indices": {"embed_tokens": [1, 2], "lm_head": [3]}}"#,
        r#"{"fan_in_fan_out": true, "lora_dropout": 0.1, "bias": "all"}"#,
    ] {
        assert!(parse_peft_adapter_config(json).is_ok(), "{json}");
    }
}

#[test]
fn trainable_token_indices_in_both_forms() {
    assert_eq!(
        parse(r#"{"trainable_token_indices": [5, 3]}"#).trainable_token_indices,
        Some(TrainableTokenIndices::List(vec![5, 3]))
    );
    let c = parse(r#"{"trainable_token_indices": {"lm_head": [1], "embed_tokens": [9, 2]}}"#);
    let Some(TrainableTokenIndices::PerModule(m)) = c.trainable_token_indices else {
        panic!("dict form expected");
    };
    assert!(m.contains(&("embed_tokens".to_string(), vec![9, 2])));
    assert!(m.contains(&("lm_head".to_string(), vec![1])));
}

#[test]
fn target_modules_as_list_or_regex() {
    assert_eq!(
        parse(r#"{"target_modules": ["q_proj"]}"#).target_modules,
        Some(TargetModules::List(vec!["q_proj".into()]))
    );
    assert_eq!(
        parse(r#"{"target_modules": "all-linear"}"#).target_modules,
        Some(TargetModules::Regex("all-linear".into()))
    );
}

#[test]
fn malformed_fields_are_errors_naming_the_field() {
    for (json, field) in [
        (r#"{"r": 0}"#, "r"),
        (r#"{"r": -4}"#, "r"),
        (r#"{"r": "8"}"#, "r"),
        (r#"{"lora_alpha": "x"}"#, "lora_alpha"),
        (r#"{"use_rslora": 1}"#, "use_rslora"),
        (r#"{"rank_pattern": {"q_proj": 0}}"#, "rank_pattern.q_proj"),
        (r#"{"alpha_pattern": {"q_proj": null}}"#, "alpha_pattern.q_proj"),
        (r#"{"trainable_token_indices": [-1]}"#, "trainable_token_indices"),
        (
            r#"{"trainable_token_indices": [4294967296]}"#,
            "trainable_token_indices",
        ),
        (r#"{"modules_to_save": [1]}"#, "modules_to_save"),
        (r#"{"init_lora_weights": 3}"#, "init_lora_weights"),
    ] {
        match PeftAdapterConfig::from_json(json) {
            Err(AuditError::ConfigField { field: f, .. }) => assert_eq!(f, field, "{json}"),
            other => panic!("{json}: expected a field error, got {other:?}"),
        }
    }
    for json in ["", "[]", "{", r#"{"r": 8} x"#, "null", r#"{"alpha_pattern": [1]}"#] {
        assert!(
            matches!(PeftAdapterConfig::from_json(json), Err(AuditError::ConfigJson { .. })),
            "{json:?}"
        );
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
    #[test]
    fn parsing_arbitrary_text_never_panics(text in "\\PC{0,200}") {
        let _ = parse_peft_adapter_config(&text);
    }

    #[test]
    fn parsing_arbitrary_field_values_never_panics(
        field in proptest::sample::select(vec![
            "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
            "target_parameters", "modules_to_save", "trainable_token_indices", "use_dora", "lora_bias",
            "bias", "init_lora_weights", "alora_invocation_tokens", "layer_replication", "use_qalora",
            "use_bdlora", "velora_config", "peft_type",
        ]),
        value in json_value(),
    ) {
        let text = serde_json::json!({ field: value }).to_string();
        if let Ok(cfg) = PeftAdapterConfig::from_json(&text) {
            let _ = cfg.refusals();
            let _ = cfg.scale_for("model.layers.0.self_attn.q_proj", 4);
        }
    }
}

fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
        any::<f64>().prop_map(|x| serde_json::json!(x)),
        "[a-z_.()?*\\[\\]\\\\|]{0,12}".prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..6)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A config whose two pattern tables have `n` distinct full-path keys each
/// (plus one repeat of every 100th), as a 4.x per-expert adapter's would.
fn many_keys(n: usize) -> String {
    let keys: Vec<String> = (0..n)
        .map(|i| format!("model.layers.{}.mlp.experts.{}.down_proj", i / 512, i % 512))
        .collect();
    let table = |v: usize| {
        let mut parts: Vec<String> = keys.iter().map(|k| format!("\"{k}\": {v}")).collect();
        parts.extend(keys.iter().step_by(100).map(|k| format!("\"{k}\": {}", v + 1)));
        parts.join(",")
    };
    format!(
        r#"{{"r": 4, "rank_pattern": {{{}}}, "alpha_pattern": {{{}}}}}"#,
        table(4),
        table(8)
    )
}

#[test]
fn the_largest_pattern_tables_parse_in_linear_time() {
    // Issue 42: 80k keys took 15.6 s (the repeats were found by a scan per
    // key). No time is asserted: it must simply finish in a test run.
    let json = many_keys(MAX_PATTERN_KEYS);
    assert!(json.len() <= MAX_ADAPTER_CONFIG_BYTES, "{} bytes", json.len());
    let c = parse(&json);
    assert_eq!(c.rank_pattern.entries().len(), MAX_PATTERN_KEYS);
    assert!(c.refusals().is_empty());
    // A repeat keeps its first place and takes the last value.
    let e = &c.alpha_pattern.entries()[100];
    assert_eq!(
        (e.key.as_str(), e.value),
        ("model.layers.0.mlp.experts.100.down_proj", 9.0)
    );
    assert_eq!(c.rank_for("model.layers.127.mlp.experts.511.down_proj"), 4);
    assert_eq!(c.alpha_for("model.layers.1.mlp.experts.88.down_proj"), 9.0);
    assert_eq!(c.rank_for("model.layers.1.mlp.experts.88.up_proj"), 4, "r, from no key");
}

#[test]
fn pattern_tables_and_configs_past_their_bounds_are_refused_typed() {
    match PeftAdapterConfig::from_json(&many_keys(MAX_PATTERN_KEYS + 1)) {
        Err(AuditError::PatternLimit { field, keys, limit }) => {
            assert_eq!(
                (field, keys, limit),
                ("rank_pattern", MAX_PATTERN_KEYS + 1, MAX_PATTERN_KEYS)
            );
        }
        other => panic!("expected a pattern limit, got {other:?}"),
    }
    let padded = format!(
        r#"{{"r": 4, "base_model_name_or_path": "{}"}}"#,
        "x".repeat(MAX_ADAPTER_CONFIG_BYTES)
    );
    match PeftAdapterConfig::from_json(&padded) {
        Err(e @ AuditError::ConfigTooLarge { .. }) => assert!(e.to_string().contains("MAX_ADAPTER_CONFIG_BYTES")),
        other => panic!("expected a size refusal, got {other:?}"),
    }
    // The directory audit refuses the file before reading it all.
    let dir = crate::test_support::ScratchDir::new("big-config");
    std::fs::write(dir.join("adapter_config.json"), &padded).unwrap();
    let cfg = crate::test_support::llama(false);
    assert!(matches!(
        crate::audit_adapter(&dir.0, &cfg, &crate::LoraOptions::default()),
        Err(AuditError::ConfigTooLarge { .. })
    ));
}
