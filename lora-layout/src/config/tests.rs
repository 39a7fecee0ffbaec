use super::*;
use crate::{LoraModule, full_attention_layers, pool_slot_bytes, router_dims};

fn testdata(name: &str) -> ModelConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join(name);
    ModelConfig::from_file(&path).unwrap()
}

// The testdata configs are transformers 5.17's own `to_json_string()` of each
// model's published geometry (AutoConfig.for_model), so field names and
// defaults are the library's, not ours.

#[test]
fn llama_3_1_8b() {
    let cfg = testdata("llama-3.1-8b.json");
    assert_eq!(cfg.family, ModelFamily::Llama);
    assert_eq!(LoraModule::QProj.dims(&cfg), (4096, 4096));
    assert_eq!(LoraModule::KProj.dims(&cfg), (1024, 4096));
    assert_eq!(LoraModule::DownProj.dims(&cfg), (4096, 14336));
    assert!(cfg.moe.is_none() && router_dims(&cfg).is_none());
    // Per layer, 2·r·Σ(in + out) bytes at r = 16, i.e. 32·Σ(in + out):
    //   q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096 = 26624
    //   gate, up, down 3·(4096+14336)                       = 55296
    //   32 · 81920 = 2_621_440 per layer; · 32 layers = 83_886_080.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 83_886_080);
}

#[test]
fn qwen3_8b() {
    let cfg = testdata("qwen3-8b.json");
    assert_eq!(cfg.family, ModelFamily::Qwen3);
    assert_eq!(cfg.head_dim, 128);
    assert_eq!(LoraModule::UpProj.dims(&cfg), (12288, 4096));
    // q 8192 + k 5120 + v 5120 + o 8192 + 3·(4096+12288) = 75776;
    // 32 · 75776 = 2_424_832 per layer; · 36 layers = 87_293_952.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 87_293_952);
}

#[test]
fn qwen3_30b_a3b() {
    let cfg = testdata("qwen3-30b-a3b.json");
    assert_eq!(cfg.family, ModelFamily::Qwen3Moe);
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
        (128, 8, 768)
    );
    assert!((0..48).all(|l| cfg.is_moe_layer(l)));
    assert!(!LoraModule::GateProj.applies_to_layer(&cfg, 0));
    assert!(!LoraModule::SharedGateProj.applies_to_layer(&cfg, 0));
    assert_eq!(router_dims(&cfg), Some((128, 2048)));
    assert_eq!(crate::ExpertProj::Down.dims(&cfg), Some((2048, 768)));
    // Attention only (every layer is sparse, no shared expert):
    //   q 2048+4096, k 2048+512, v 2048+512, o 4096+2048 = 17408;
    //   32 · 17408 = 557_056 per layer; · 48 layers = 26_738_688.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 26_738_688);
}

#[test]
fn mixtral_8x7b() {
    let cfg = testdata("mixtral-8x7b.json");
    assert_eq!(cfg.family, ModelFamily::Mixtral);
    assert_eq!(cfg.head_dim, 128, "head_dim null derives hidden / heads");
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!((moe.num_experts, moe.expert_intermediate_size), (8, 14336));
    // Attention only: q 8192 + k 5120 + v 5120 + o 8192 = 26624;
    // 32 · 26624 = 851_968 per layer; · 32 layers = 27_262_976.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 27_262_976);
}

#[test]
fn qwen3_next_80b_a3b() {
    let cfg = testdata("qwen3-next-80b-a3b.json");
    assert_eq!(cfg.family, ModelFamily::Qwen3Next);
    assert_eq!(
        full_attention_layers(&cfg),
        (0..48).filter(|l| (l + 1) % 4 == 0).collect::<Vec<_>>()
    );
    assert_eq!(
        LoraModule::QProj.dims(&cfg),
        (8192, 2048),
        "gated q_proj: 2·heads·head_dim"
    );
    assert!(LoraModule::LinearAttnOutProj.applies_to_layer(&cfg, 0));
    assert!(!LoraModule::LinearAttnOutProj.applies_to_layer(&cfg, 3));
    assert!(!LoraModule::QProj.applies_to_layer(&cfg, 0));
    assert_eq!(LoraModule::LinearAttnOutProj.dims(&cfg), (2048, 4096));
    assert_eq!(LoraModule::SharedExpertGate.dims(&cfg), (1, 2048));
    // Full-attention layer (12 of them):
    //   q 2048+8192, k 2048+512, v 2048+512, o 4096+2048   = 21504
    //   shared gate/up/down 3·(2048+512) = 7680; shared_expert_gate 2048+1 = 2049
    //   32 · 31233 = 999_456.
    // Linear-attention layer (36): out_proj 4096+2048 = 6144, + 7680 + 2049
    //   = 15873; 32 · 15873 = 507_936.
    // 12 · 999_456 + 36 · 507_936 = 11_993_472 + 18_285_696 = 30_279_168.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 30_279_168);
}

#[test]
fn deepseek_v3() {
    let cfg = testdata("deepseek-v3.json");
    assert_eq!(cfg.family, ModelFamily::DeepseekV3);
    assert!(!cfg.is_moe_layer(2) && cfg.is_moe_layer(3));
    assert!(
        !LoraModule::QProj.applies_to_layer(&cfg, 0),
        "q_lora_rank set: q_a/q_b, no q_proj"
    );
    assert!(!LoraModule::KProj.applies_to_layer(&cfg, 0));
    assert_eq!(LoraModule::QBProj.dims(&cfg), (24576, 1536));
    assert_eq!(LoraModule::KvAProjWithMqa.dims(&cfg), (576, 7168));
    assert_eq!(LoraModule::KvBProj.dims(&cfg), (32768, 512));
    assert_eq!(LoraModule::OProj.dims(&cfg), (7168, 16384));
    assert_eq!(LoraModule::SharedDownProj.dims(&cfg), (7168, 2048));
    // Attention: q_a 7168+1536 = 8704, q_b 1536+24576 = 26112,
    //   kv_a 7168+576 = 7744, kv_b 512+32768 = 33280, o 16384+7168 = 23552
    //   = 99392.
    // Dense layers 0..3: + 3·(7168+18432) = 76800 → 176192 · 32 = 5_638_144.
    // MoE layers 3..61: + shared 3·(7168+2048) = 27648 → 127040 · 32 = 4_065_280.
    // 3 · 5_638_144 + 58 · 4_065_280 = 16_914_432 + 235_786_240 = 252_700_672.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 252_700_672);
}

#[test]
fn deepseek_without_q_lora_rank_has_q_proj() {
    let mut v: serde_json::Value = serde_json::from_str(include_str!("../../testdata/deepseek-v3.json")).unwrap();
    v["q_lora_rank"] = serde_json::Value::Null;
    let cfg = ModelConfig::from_hf_value(&v).unwrap();
    assert!(LoraModule::QProj.applies_to_layer(&cfg, 0));
    assert!(!LoraModule::QAProj.applies_to_layer(&cfg, 0));
    assert!(!LoraModule::QBProj.applies_to_layer(&cfg, 0));
    assert_eq!(LoraModule::QProj.dims(&cfg), (128 * 192, 7168));
}

fn llama_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256
    })
}

#[test]
fn nested_text_config_is_read() {
    let wrapped = serde_json::json!({
        "model_type": "llava", "vision_config": {"hidden_size": 1},
        "text_config": llama_json(),
    });
    let cfg = ModelConfig::from_hf_value(&wrapped).unwrap();
    assert_eq!(cfg.family, ModelFamily::Llama);
    assert_eq!(cfg.hidden_size, 64);
}

#[test]
fn unknown_model_type_is_named() {
    let mut v = llama_json();
    v["model_type"] = "gpt2".into();
    let err = ModelConfig::from_hf_value(&v).unwrap_err();
    assert!(matches!(&err, ConfigError::UnknownModelType(t) if t == "gpt2"), "{err}");
    assert!(err.to_string().contains("gpt2"));
}

#[test]
fn missing_field_is_named() {
    for field in [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ] {
        let mut v = llama_json();
        v.as_object_mut().unwrap().remove(field);
        let err = ModelConfig::from_hf_value(&v).unwrap_err();
        assert!(
            matches!(&err, ConfigError::MissingField { field: f, .. } if *f == field),
            "{field}: {err}"
        );
        assert!(err.to_string().contains(field));
    }
    let mut v = llama_json();
    v.as_object_mut().unwrap().remove("model_type");
    assert!(matches!(
        ModelConfig::from_hf_value(&v),
        Err(ConfigError::MissingModelType)
    ));
}

#[test]
fn moe_fields_are_required_by_family() {
    let mut v = serde_json::json!({
        "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64,
        "num_experts": 4, "num_experts_per_tok": 2
    });
    let err = ModelConfig::from_hf_value(&v).unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::MissingField {
                field: "moe_intermediate_size",
                ..
            }
        ),
        "{err}"
    );
    v["moe_intermediate_size"] = 16.into();
    let cfg = ModelConfig::from_hf_value(&v).unwrap();
    assert_eq!(cfg.moe.unwrap().num_experts, 4);
}

#[test]
fn sparse_step_and_mlp_only_layers_pick_dense_layers() {
    let v = serde_json::json!({
        "model_type": "qwen2_moe", "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "decoder_sparse_step": 2, "mlp_only_layers": [3]
    });
    let cfg = ModelConfig::from_hf_value(&v).unwrap();
    // (l + 1) % 2 == 0 → 1 and 3 sparse; 3 is forced dense.
    assert_eq!(
        (0..4).map(|l| cfg.is_moe_layer(l)).collect::<Vec<_>>(),
        [false, true, false, false]
    );
    assert!(LoraModule::GateProj.applies_to_layer(&cfg, 0));
    assert!(LoraModule::SharedGateProj.applies_to_layer(&cfg, 1));
    assert!(LoraModule::SharedExpertGate.applies_to_layer(&cfg, 1));
    assert!(!LoraModule::SharedExpertGate.applies_to_layer(&cfg, 0));
}

#[test]
fn qwen3_next_layer_types_from_interval() {
    let v = serde_json::json!({
        "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 64, "vocab_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
        "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_value_head_dim": 8
    });
    let cfg = ModelConfig::from_hf_value(&v).unwrap();
    assert_eq!(full_attention_layers(&cfg), [1, 3]);
    let mut bad = v.clone();
    bad["layer_types"] = serde_json::json!(["full_attention"]);
    assert!(matches!(
        ModelConfig::from_hf_value(&bad),
        Err(ConfigError::InvalidField {
            field: "layer_types",
            ..
        })
    ));
}

#[test]
fn wrong_types_and_absurd_sizes_are_invalid_fields() {
    for (field, value) in [
        ("hidden_size", serde_json::json!("64")),
        ("hidden_size", serde_json::json!(-1)),
        ("hidden_size", serde_json::json!(0)),
        ("hidden_size", serde_json::json!(1u64 << 40)),
        ("num_attention_heads", serde_json::json!(1.5)),
        ("tie_word_embeddings", serde_json::json!("yes")),
    ] {
        let mut v = llama_json();
        v[field] = value.clone();
        let err = ModelConfig::from_hf_value(&v).unwrap_err();
        assert!(
            matches!(&err, ConfigError::InvalidField { field: f, .. } if *f == field),
            "{field}={value}: {err}"
        );
    }
    assert!(matches!(
        ModelConfig::from_hf_config("[1, 2]"),
        Err(ConfigError::Json(_))
    ));
    assert!(matches!(ModelConfig::from_hf_config("{"), Err(ConfigError::Json(_))));
}

#[test]
fn head_dim_that_cannot_be_derived_is_an_error() {
    let mut v = llama_json();
    v["num_attention_heads"] = 5.into();
    assert!(matches!(
        ModelConfig::from_hf_value(&v),
        Err(ConfigError::InvalidField { field: "head_dim", .. })
    ));
}

mod never_panics {
    use super::*;
    use proptest::prelude::*;

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            (0u64..100).prop_map(serde_json::Value::from),
            prop_oneof![
                Just("llama"),
                Just("qwen3_next"),
                Just("deepseek_v3"),
                Just("mixtral"),
                Just("qwen2_moe"),
                Just("full_attention"),
                Just("x")
            ]
            .prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
                prop::collection::vec((field_name(), inner), 0..12)
                    .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    fn field_name() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("model_type"),
            Just("hidden_size"),
            Just("num_hidden_layers"),
            Just("num_attention_heads"),
            Just("num_key_value_heads"),
            Just("head_dim"),
            Just("intermediate_size"),
            Just("vocab_size"),
            Just("num_experts"),
            Just("num_local_experts"),
            Just("n_routed_experts"),
            Just("num_experts_per_tok"),
            Just("moe_intermediate_size"),
            Just("shared_expert_intermediate_size"),
            Just("mlp_only_layers"),
            Just("decoder_sparse_step"),
            Just("layer_types"),
            Just("full_attention_interval"),
            Just("q_lora_rank"),
            Just("kv_lora_rank"),
            Just("text_config"),
        ]
        .prop_map(String::from)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn parsing_arbitrary_json_never_panics(v in json_value()) {
            if let Ok(cfg) = ModelConfig::from_hf_value(&v) {
                // Whatever parses must also lay out without panicking.
                let _ = pool_slot_bytes(&cfg, 64);
            }
        }

        #[test]
        fn parsing_arbitrary_text_never_panics(s in ".{0,200}") {
            let _ = ModelConfig::from_hf_config(&s);
        }
    }
}

#[test]
fn a_config_file_that_does_not_parse_is_named_in_its_error() {
    let dir = std::env::temp_dir().join(format!("lora-layout-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("config.json");
    std::fs::write(&path, r#"{"hidden_size": 8}"#).expect("write");
    let err = ModelConfig::from_file(&path).expect_err("no model_type");
    assert!(
        matches!(&err, ConfigError::InFile { source, .. } if matches!(**source, ConfigError::MissingModelType)),
        "{err}"
    );
    assert!(err.to_string().starts_with(&path.display().to_string()), "{err}");
    let missing = ModelConfig::from_file(&dir.join("absent.json")).expect_err("absent");
    assert!(missing.to_string().contains("absent.json"), "{missing}");
    std::fs::remove_dir_all(&dir).ok();
}
