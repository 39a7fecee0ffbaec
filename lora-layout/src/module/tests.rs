use super::*;
use crate::ModelConfig;

fn tiny(model_type: &str, extra: serde_json::Value) -> ModelConfig {
    let mut v = serde_json::json!({
        "model_type": model_type, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
        "vocab_size": 64
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    ModelConfig::from_hf_value(&v).unwrap()
}

#[test]
fn all_lists_every_module_once_in_index_order() {
    for (i, m) in LoraModule::ALL.iter().enumerate() {
        assert_eq!(m.index(), i);
    }
    for (i, p) in ExpertProj::ALL.iter().enumerate() {
        assert_eq!(p.index(), i);
    }
}

#[test]
fn paths_round_trip_per_family() {
    for family in [
        ModelFamily::Llama,
        ModelFamily::Qwen2Moe,
        ModelFamily::DeepseekV3,
        ModelFamily::Glm4Moe,
        ModelFamily::Gemma2,
        ModelFamily::Phi3,
    ] {
        for m in LoraModule::ALL {
            assert_eq!(LoraModule::from_path(family, m.path(family)), Some(m));
        }
    }
    assert_eq!(
        LoraModule::SharedUpProj.path(ModelFamily::DeepseekV3),
        "mlp.shared_experts.up_proj"
    );
    assert_eq!(
        LoraModule::SharedUpProj.path(ModelFamily::Qwen2Moe),
        "mlp.shared_expert.up_proj"
    );
    assert_eq!(
        LoraModule::from_path(ModelFamily::Llama, "mlp.gate"),
        None,
        "the router is not a slot module"
    );
    assert_eq!(LoraModule::SharedExpertGate.short_name(), "shared_expert_gate");
    assert_eq!(LoraModule::KvAProjWithMqa.to_string(), "kv_a_proj_with_mqa");
}

#[test]
fn dense_llama_has_attention_and_mlp_everywhere() {
    let cfg = tiny("llama", serde_json::json!({}));
    let present: Vec<_> = LoraModule::ALL
        .into_iter()
        .filter(|m| m.applies_to_layer(&cfg, 2))
        .collect();
    use LoraModule::*;
    assert_eq!(present, [QProj, KProj, VProj, OProj, GateProj, UpProj, DownProj]);
    assert!(
        LoraModule::ALL.iter().all(|m| !m.applies_to_layer(&cfg, 4)),
        "past the last layer"
    );
    assert_eq!(router_dims(&cfg), None);
    assert_eq!(ExpertProj::Gate.dims(&cfg), None);
    assert_eq!(ExpertSite::Router.dims(&cfg), None);
}

#[test]
fn applicable_modules_have_nonzero_dims() {
    let configs = [
        tiny("llama", serde_json::json!({})),
        tiny(
            "qwen2_moe",
            serde_json::json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                               "shared_expert_intermediate_size": 24, "mlp_only_layers": [0]}),
        ),
        tiny(
            "qwen3_next",
            serde_json::json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                               "shared_expert_intermediate_size": 24, "head_dim": 8,
                               "linear_num_value_heads": 4, "linear_value_head_dim": 8,
                               "full_attention_interval": 2}),
        ),
        tiny(
            "glm4_moe",
            serde_json::json!({"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                               "n_shared_experts": 2, "first_k_dense_replace": 1, "head_dim": 16}),
        ),
        tiny("gemma2", serde_json::json!({"head_dim": 16})),
        tiny("phi3", serde_json::json!({})),
        tiny(
            "deepseek_v3",
            serde_json::json!({"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                               "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": null,
                               "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                               "v_head_dim": 8}),
        ),
    ];
    for cfg in &configs {
        for layer in 0..cfg.num_hidden_layers {
            for m in LoraModule::ALL {
                if m.applies_to_layer(cfg, layer) {
                    let (out, inp) = m.dims(cfg);
                    assert!(out > 0 && inp > 0, "{:?} {m} layer {layer}", cfg.family);
                }
            }
        }
    }
    let ds = &configs[6];
    assert_eq!(LoraModule::SharedGateProj.dims(ds), (32, 32), "2 shared experts of 16");
    assert!(!LoraModule::SharedGateProj.applies_to_layer(ds, 0));
    assert!(LoraModule::SharedGateProj.applies_to_layer(ds, 1));
    assert!(
        !LoraModule::SharedExpertGate.applies_to_layer(ds, 1),
        "DeepSeek has no shared-expert gate"
    );
}

#[test]
fn expert_sites_are_bounded_by_expert_count() {
    let cfg = tiny(
        "mixtral",
        serde_json::json!({"num_local_experts": 4, "num_experts_per_tok": 2}),
    );
    let gate = ExpertSite::Expert {
        expert: 3,
        proj: ExpertProj::Gate,
    };
    assert_eq!(gate.dims(&cfg), Some((48, 32)));
    let down = ExpertSite::Expert {
        expert: 0,
        proj: ExpertProj::Down,
    };
    assert_eq!(down.dims(&cfg), Some((32, 48)));
    assert_eq!(
        ExpertSite::Expert {
            expert: 4,
            proj: ExpertProj::Up
        }
        .dims(&cfg),
        None
    );
    assert_eq!(ExpertSite::Router.dims(&cfg), Some((4, 32)));
}

#[test]
fn phi3_fuses_qkv_and_gate_up_into_single_targets() {
    let cfg = tiny("phi3", serde_json::json!({}));
    use LoraModule::*;
    let present: Vec<_> = LoraModule::ALL
        .into_iter()
        .filter(|m| m.applies_to_layer(&cfg, 1))
        .collect();
    assert_eq!(present, [OProj, DownProj, QkvProj, GateUpProj]);
    // 4 heads of 8, 2 kv heads: q 32 | k 16 | v 16.
    assert_eq!(QkvProj.dims(&cfg), (64, 32));
    assert_eq!(GateUpProj.dims(&cfg), (96, 32));
    assert_eq!(QkvProj.path(ModelFamily::Phi3), "self_attn.qkv_proj");
    assert_eq!(GateUpProj.short_name(), "gate_up_proj");
    assert_eq!(LoraModule::qkv(ModelFamily::Phi3), [QkvProj]);
    assert_eq!(LoraModule::gate_up(ModelFamily::Phi3), [GateUpProj]);
    // Every other family keeps its separate projections, and has no fused one.
    assert_eq!(LoraModule::qkv(ModelFamily::Llama), [QProj, KProj, VProj]);
    assert_eq!(LoraModule::gate_up(ModelFamily::Gemma2), [GateProj, UpProj]);
    let llama = tiny("llama", serde_json::json!({}));
    assert!(!QkvProj.applies_to_layer(&llama, 0) && !GateUpProj.applies_to_layer(&llama, 0));
    // The fused modules are last in ALL: the others keep their indices.
    assert_eq!((QkvProj.index(), GateUpProj.index()), (16, 17));
    assert_eq!(SharedExpertGate.index(), 15);
}

#[test]
fn gate_up_layouts_place_gate_and_up_outputs() {
    use crate::GateUpLayout;
    assert_eq!(GateUpLayout::of(ModelFamily::GptOss), GateUpLayout::Interleaved);
    assert_eq!(GateUpLayout::of(ModelFamily::Qwen3Moe), GateUpLayout::Halves);
    let halves: Vec<usize> = [ExpertProj::Gate, ExpertProj::Up]
        .into_iter()
        .flat_map(|p| (0..3).map(move |j| GateUpLayout::Halves.column(p, j, 3)))
        .collect();
    assert_eq!(halves, [0, 1, 2, 3, 4, 5]);
    let interleaved: Vec<usize> = [ExpertProj::Gate, ExpertProj::Up]
        .into_iter()
        .flat_map(|p| (0..3).map(move |j| GateUpLayout::Interleaved.column(p, j, 3)))
        .collect();
    assert_eq!(interleaved, [0, 2, 4, 1, 3, 5]);
    assert_eq!(GateUpLayout::Interleaved.column(ExpertProj::Down, 7, 3), 7);
}
