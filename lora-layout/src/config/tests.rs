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
                Just("glm4_moe"),
                Just("gemma3"),
                Just("gpt_oss"),
                Just("phi3"),
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
            Just("n_shared_experts"),
            Just("first_k_dense_replace"),
            Just("tie_word_embeddings"),
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

#[test]
fn gemma_2_9b() {
    let cfg = testdata("gemma-2-9b.json");
    assert_eq!(cfg.family, ModelFamily::Gemma2);
    assert!(cfg.tie_word_embeddings);
    // Explicit head_dim: q/k/v/o widths are heads · 256, not hidden_size 3584.
    assert_eq!(cfg.head_dim, 256);
    assert_eq!(LoraModule::QProj.dims(&cfg), (16 * 256, 3584));
    assert_eq!(LoraModule::KProj.dims(&cfg), (8 * 256, 3584));
    assert_eq!(LoraModule::OProj.dims(&cfg), (3584, 4096));
    assert!(cfg.moe.is_none());
    // Sliding and full layers have the same projections.
    assert!((0..42).all(|l| LoraModule::QProj.applies_to_layer(&cfg, l)));
    // q 3584+4096, k 3584+2048, v 3584+2048, o 4096+3584 = 26624
    // gate, up, down 3·(3584+14336) = 53760; 26624 + 53760 = 80384;
    // 32 · 80384 = 2_572_288 per layer; · 42 layers = 108_036_096.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 108_036_096);
}

#[test]
fn gemma_3_27b_wrapper_reads_its_text_config() {
    let cfg = testdata("gemma-3-27b-it.json");
    assert_eq!(cfg.family, ModelFamily::Gemma3Text);
    assert_eq!((cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim), (5376, 62, 128));
    assert_eq!(LoraModule::QProj.dims(&cfg), (32 * 128, 5376));
    assert_eq!(LoraModule::VProj.dims(&cfg), (16 * 128, 5376));
    assert!(cfg.tie_word_embeddings);
    // q 5376+4096, k 5376+2048, v 5376+2048, o 4096+5376 = 33792
    // gate, up, down 3·(5376+21504) = 80640; 114432 · 32 = 3_661_824 per
    // layer; · 62 layers = 227_033_088.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 227_033_088);
}

fn gemma_json(model_type: &str) -> serde_json::Value {
    serde_json::json!({
        "model_type": model_type, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 128
    })
}

#[test]
fn gemma_absent_fields_take_the_config_class_defaults() {
    for model_type in ["gemma2", "gemma3_text"] {
        let cfg = ModelConfig::from_hf_value(&gemma_json(model_type)).unwrap();
        // Gemma2Config / Gemma3TextConfig: head_dim 256 (not 32 / 4),
        // num_key_value_heads 4, tie_word_embeddings true.
        assert_eq!(
            (cfg.head_dim, cfg.num_key_value_heads, cfg.tie_word_embeddings),
            (256, 4, true),
            "{model_type}"
        );
        assert_eq!(LoraModule::QProj.dims(&cfg), (1024, 32));
        let mut untied = gemma_json(model_type);
        untied["tie_word_embeddings"] = false.into();
        untied["head_dim"] = 8.into();
        let cfg = ModelConfig::from_hf_value(&untied).unwrap();
        assert_eq!((cfg.head_dim, cfg.tie_word_embeddings), (8, false));
        for field in [
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        ] {
            let mut v = gemma_json(model_type);
            v.as_object_mut().unwrap().remove(field);
            assert!(
                matches!(ModelConfig::from_hf_value(&v), Err(ConfigError::MissingField { field: f, .. }) if f == field),
                "{model_type} {field}"
            );
        }
    }
}

#[test]
fn the_gemma_3_wrapper_ties_by_its_own_field() {
    let wrapper = |top_tie: Option<serde_json::Value>| {
        let mut text = gemma_json("gemma3_text");
        text["head_dim"] = 8.into();
        text["tie_word_embeddings"] = true.into();
        let mut v = serde_json::json!({
            "model_type": "gemma3", "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16}
        });
        if let Some(t) = top_tie {
            v["tie_word_embeddings"] = t;
        }
        ModelConfig::from_hf_value(&v)
    };
    let tied = wrapper(None).unwrap();
    assert_eq!(
        (tied.family, tied.head_dim, tied.tie_word_embeddings),
        (ModelFamily::Gemma3Text, 8, true)
    );
    assert!(!wrapper(Some(false.into())).unwrap().tie_word_embeddings);
    assert!(!wrapper(Some(serde_json::Value::Null)).unwrap().tie_word_embeddings);
    assert!(matches!(
        wrapper(Some("yes".into())),
        Err(ConfigError::InvalidField {
            model_type: "gemma3",
            field: "tie_word_embeddings",
            ..
        })
    ));
    // A wrapper without its text_config has no geometry: the first missing
    // field is named.
    let bare = serde_json::json!({"model_type": "gemma3", "vision_config": {}});
    assert!(matches!(
        ModelConfig::from_hf_value(&bare),
        Err(ConfigError::MissingField {
            field: "hidden_size",
            ..
        })
    ));
}

#[test]
fn glm_4_5_air() {
    let cfg = testdata("glm-4.5-air.json");
    assert_eq!(cfg.family, ModelFamily::Glm4Moe);
    // head_dim 128 is explicit: 96 heads x 128 = 12288, not hidden 4096.
    assert_eq!(LoraModule::QProj.dims(&cfg), (12288, 4096));
    assert_eq!(LoraModule::KProj.dims(&cfg), (1024, 4096));
    assert_eq!(LoraModule::OProj.dims(&cfg), (4096, 12288));
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
        (128, 8, 1408)
    );
    assert_eq!(moe.shared_expert_intermediate_size, Some(1408));
    assert!(!moe.shared_expert_gate);
    assert!(!cfg.is_moe_layer(0) && (1..46).all(|l| cfg.is_moe_layer(l)));
    assert!(LoraModule::GateProj.applies_to_layer(&cfg, 0));
    assert!(!LoraModule::GateProj.applies_to_layer(&cfg, 1));
    assert!(LoraModule::SharedDownProj.applies_to_layer(&cfg, 1));
    assert!(!LoraModule::SharedExpertGate.applies_to_layer(&cfg, 1));
    assert_eq!(LoraModule::SharedUpProj.path(cfg.family), "mlp.shared_experts.up_proj");
    assert_eq!(router_dims(&cfg), Some((128, 4096)));
    assert_eq!(crate::ExpertProj::Gate.dims(&cfg), Some((1408, 4096)));
    // Attention: q 4096+12288, k 4096+1024, v 4096+1024, o 12288+4096 = 43008.
    // Dense layer 0: + 3·(4096+10944) = 45120 → 88128 · 32 = 2_820_096.
    // MoE layers 1..46: + shared 3·(4096+1408) = 16512 → 59520 · 32 =
    //   1_904_640; · 45 = 85_708_800. Total 88_528_896.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 88_528_896);
}

fn glm_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "glm4_moe", "hidden_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "head_dim": 16, "intermediate_size": 64, "vocab_size": 128,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16
    })
}

#[test]
fn glm4_moe_defaults_and_required_fields() {
    let cfg = ModelConfig::from_hf_value(&glm_json()).unwrap();
    // Glm4MoeConfig's defaults: 8 kv heads, first_k_dense_replace 1, one
    // shared expert.
    assert_eq!(cfg.num_key_value_heads, 8);
    assert_eq!(
        (0..3).map(|l| cfg.is_moe_layer(l)).collect::<Vec<_>>(),
        [false, true, true]
    );
    assert_eq!(cfg.moe.as_ref().unwrap().shared_expert_intermediate_size, Some(16));
    let mut v = glm_json();
    v["first_k_dense_replace"] = 0.into();
    v["n_shared_experts"] = 0.into();
    v.as_object_mut().unwrap().remove("intermediate_size");
    let cfg = ModelConfig::from_hf_value(&v).unwrap();
    assert!(
        (0..3).all(|l| cfg.is_moe_layer(l)),
        "no dense layer needs no intermediate_size"
    );
    assert_eq!(cfg.moe.as_ref().unwrap().shared_expert_intermediate_size, None);
    assert!(!LoraModule::SharedGateProj.applies_to_layer(&cfg, 1));
    // The alias `num_local_experts` is read when `n_routed_experts` is absent.
    let mut v = glm_json();
    v.as_object_mut().unwrap().remove("n_routed_experts");
    v["num_local_experts"] = 6.into();
    assert_eq!(ModelConfig::from_hf_value(&v).unwrap().moe.unwrap().num_experts, 6);
    for field in [
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "intermediate_size",
    ] {
        let mut v = glm_json();
        v.as_object_mut().unwrap().remove(field);
        let err = ModelConfig::from_hf_value(&v).unwrap_err();
        assert!(
            matches!(&err, ConfigError::MissingField { model_type: "glm4_moe", field: f } if *f == field),
            "{field}: {err}"
        );
    }
    let mut v = glm_json();
    v["n_routed_experts"] = 0.into();
    assert!(matches!(
        ModelConfig::from_hf_value(&v),
        Err(ConfigError::InvalidField {
            field: "n_routed_experts",
            ..
        })
    ));
    let mut v = glm_json();
    v["n_shared_experts"] = (1u64 << 13).into();
    v["moe_intermediate_size"] = (1u64 << 20).into();
    assert!(matches!(
        ModelConfig::from_hf_value(&v),
        Err(ConfigError::InvalidField {
            field: "n_shared_experts",
            ..
        })
    ));
}

#[test]
fn phi_4() {
    let cfg = testdata("phi-4.json");
    assert_eq!(cfg.family, ModelFamily::Phi3);
    assert_eq!(
        (cfg.head_dim, cfg.num_key_value_heads),
        (128, 10),
        "head_dim derives 5120 / 40"
    );
    // Fused targets: qkv_proj is q | k | v, 5120 + 2·1280 wide; gate_up_proj
    // is gate | up, 2·17920 wide. The unfused modules do not exist.
    assert_eq!(LoraModule::QkvProj.dims(&cfg), (7680, 5120));
    assert_eq!(LoraModule::GateUpProj.dims(&cfg), (35840, 5120));
    assert_eq!(LoraModule::DownProj.dims(&cfg), (5120, 17920));
    let present: Vec<_> = LoraModule::ALL
        .into_iter()
        .filter(|m| m.applies_to_layer(&cfg, 0))
        .collect();
    assert_eq!(
        present,
        [
            LoraModule::OProj,
            LoraModule::DownProj,
            LoraModule::QkvProj,
            LoraModule::GateUpProj
        ]
    );
    // qkv 7680+5120, o 5120+5120, gate_up 35840+5120, down 17920+5120
    // = 87040; 32 · 87040 = 2_785_280 per layer; · 40 layers = 111_411_200.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 111_411_200);
}

#[test]
fn phi3_fields_are_named() {
    let v = serde_json::json!({
        "model_type": "phi3", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 128
    });
    let cfg = ModelConfig::from_hf_value(&v).unwrap();
    // Phi3Config: num_key_value_heads None means num_attention_heads.
    assert_eq!(
        (cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings),
        (4, 8, false)
    );
    for field in ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"] {
        let mut bad = v.clone();
        bad.as_object_mut().unwrap().remove(field);
        assert!(
            matches!(ModelConfig::from_hf_value(&bad), Err(ConfigError::MissingField { model_type: "phi3", field: f }) if f == field),
            "{field}"
        );
    }
}

#[test]
fn gpt_oss_20b() {
    let cfg = testdata("gpt-oss-20b.json");
    assert_eq!(cfg.family, ModelFamily::GptOss);
    assert_eq!(LoraModule::QProj.dims(&cfg), (64 * 64, 2880));
    assert_eq!(LoraModule::KProj.dims(&cfg), (8 * 64, 2880));
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
        (32, 4, 2880)
    );
    assert!(moe.shared_expert_intermediate_size.is_none());
    assert!((0..24).all(|l| cfg.is_moe_layer(l)));
    assert!(!LoraModule::GateProj.applies_to_layer(&cfg, 0));
    assert_eq!(router_dims(&cfg), Some((32, 2880)));
    assert_eq!(crate::ExpertProj::Up.dims(&cfg), Some((2880, 2880)));
    assert_eq!(crate::GateUpLayout::of(cfg.family), crate::GateUpLayout::Interleaved);
    // Attention only: q 2880+4096, k 2880+512, v 2880+512, o 4096+2880
    // = 20736; 32 · 20736 = 663_552 per layer; · 24 layers = 15_925_248.
    assert_eq!(pool_slot_bytes(&cfg, 16).unwrap(), 15_925_248);
}

#[test]
fn gpt_oss_absent_and_null_fields_follow_the_config_class() {
    let v = serde_json::json!({
        "model_type": "gpt_oss", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 16, "vocab_size": 128,
        "num_local_experts": 4, "num_experts_per_tok": 2
    });
    // GptOssConfig: head_dim 64 and 8 kv heads when absent ...
    let cfg = ModelConfig::from_hf_value(&v).unwrap();
    assert_eq!((cfg.head_dim, cfg.num_key_value_heads), (64, 8));
    // ... hidden / heads and one kv head per head when null.
    let mut nulls = v.clone();
    nulls["head_dim"] = serde_json::Value::Null;
    nulls["num_key_value_heads"] = serde_json::Value::Null;
    let cfg = ModelConfig::from_hf_value(&nulls).unwrap();
    assert_eq!((cfg.head_dim, cfg.num_key_value_heads), (8, 4));
    // `num_experts` is the alias of `num_local_experts`.
    let mut alias = v.clone();
    alias.as_object_mut().unwrap().remove("num_local_experts");
    alias["num_experts"] = 6.into();
    assert_eq!(ModelConfig::from_hf_value(&alias).unwrap().moe.unwrap().num_experts, 6);
    for field in ["num_local_experts", "num_experts_per_tok", "intermediate_size"] {
        let mut bad = v.clone();
        bad.as_object_mut().unwrap().remove(field);
        assert!(
            matches!(ModelConfig::from_hf_value(&bad), Err(ConfigError::MissingField { model_type: "gpt_oss", field: f }) if f == field),
            "{field}"
        );
    }
    let mut bad = v.clone();
    bad["head_dim"] = 0.into();
    assert!(matches!(
        ModelConfig::from_hf_value(&bad),
        Err(ConfigError::InvalidField { field: "head_dim", .. })
    ));
}
