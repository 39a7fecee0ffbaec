use super::*;
use crate::test_support;
use lora_layout::{ExpertProj, LoraModule};

fn target(key: &str, cfg: &ModelConfig) -> (usize, LoraTarget, AdapterAb) {
    let k = classify_key(key, cfg).unwrap_or_else(|r| panic!("{key}: {r}"));
    (k.layer, k.target, k.ab)
}

fn refused(key: &str, cfg: &ModelConfig) -> RejectCode {
    let r = classify_key(key, cfg).expect_err(key);
    assert_eq!(r.subject, key, "a refusal names the tensor");
    assert!(!r.reason.is_empty());
    r.code
}

#[test]
fn prefixes_are_optional_and_anything_before_layers_is_ignored() {
    let cfg = test_support::llama(false);
    let want = (1, LoraTarget::Dense(LoraModule::QProj), AdapterAb::A);
    for key in [
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight",
        "model.layers.1.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight",
        "layers.1.self_attn.q_proj.lora_A.weight",
    ] {
        assert_eq!(target(key, &cfg), want, "{key}");
    }
    let k = classify_key("base_model.model.model.layers.2.mlp.down_proj.lora_B.weight", &cfg).unwrap();
    assert_eq!((k.layer, k.ab), (2, AdapterAb::B));
    assert_eq!(k.module_path, "model.layers.2.mlp.down_proj");
}

#[test]
fn split_layer_path_needs_a_whole_layers_component() {
    assert_eq!(split_layer_path("model.layers.12.mlp"), Some(("model", 12, "mlp")));
    assert_eq!(split_layer_path("layers.0.x"), Some(("", 0, "x")));
    assert_eq!(split_layer_path("model.sublayers.3.mlp"), None);
    assert_eq!(split_layer_path("model.layers.x.mlp"), None);
    assert_eq!(split_layer_path("model.layers.3"), None);
    assert_eq!(split_layer_path("model.layers.99999999999999999999999.mlp"), None);
    assert_eq!(
        split_layer_path("a.sublayers.1.b.layers.2.c"),
        Some(("a.sublayers.1.b", 2, "c"))
    );
}

#[test]
fn per_expert_keys_of_transformers_4() {
    let qwen = test_support::qwen3_moe();
    assert_eq!(
        target(
            "base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight",
            &qwen
        ),
        (
            1,
            LoraTarget::Expert {
                expert: 3,
                proj: ExpertProj::Up
            },
            AdapterAb::B
        )
    );
    assert_eq!(
        target("base_model.model.model.layers.1.mlp.gate.lora_A.weight", &qwen),
        (1, LoraTarget::Router, AdapterAb::A)
    );
    let mixtral = test_support::mixtral();
    for (name, proj) in [
        ("w1", ExpertProj::Gate),
        ("w3", ExpertProj::Up),
        ("w2", ExpertProj::Down),
    ] {
        let key = format!("base_model.model.model.layers.0.block_sparse_moe.experts.2.{name}.lora_A.weight");
        assert_eq!(
            target(&key, &mixtral),
            (0, LoraTarget::Expert { expert: 2, proj }, AdapterAb::A)
        );
    }
    assert_eq!(
        target(
            "base_model.model.model.layers.1.block_sparse_moe.gate.lora_B.weight",
            &mixtral
        ),
        (1, LoraTarget::Router, AdapterAb::B)
    );
    // transformers 5.x names Mixtral's block `mlp`, with fused experts.
    assert_eq!(
        target("base_model.model.model.layers.1.mlp.gate.lora_B.weight", &mixtral),
        (1, LoraTarget::Router, AdapterAb::B)
    );
    assert_eq!(
        target(
            "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight",
            &mixtral
        ),
        (1, LoraTarget::FusedExperts(FusedWrapper::Inner), AdapterAb::A)
    );
    // Mixtral names only exist in Mixtral.
    assert_eq!(
        refused("base_model.model.model.layers.1.mlp.experts.0.w1.lora_A.weight", &qwen),
        RejectCode::UnsupportedTarget
    );
}

#[test]
fn fused_expert_wrappers_of_transformers_5() {
    let qwen = test_support::qwen3_moe();
    assert_eq!(
        target(
            "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight",
            &qwen
        ),
        (1, LoraTarget::FusedExperts(FusedWrapper::Inner), AdapterAb::A)
    );
    let k = classify_key("base_model.model.model.layers.1.mlp.experts.lora_B.weight", &qwen).unwrap();
    assert_eq!(k.target, LoraTarget::FusedExperts(FusedWrapper::Outer));
    assert_eq!(k.module_path, "model.layers.1.mlp.experts");
    assert_eq!(
        refused(
            "base_model.model.model.layers.1.mlp.experts.base_layer.base_layer.lora_A.weight",
            &qwen
        ),
        RejectCode::UnsupportedTarget
    );
}

#[test]
fn targets_the_model_lacks_are_model_mismatches() {
    let qwen = test_support::qwen3_moe();
    for key in [
        "model.layers.2.self_attn.q_proj.lora_A.weight", // layer out of range
        "model.layers.0.mlp.experts.0.gate_proj.lora_A.weight", // layer 0 is dense
        "model.layers.1.mlp.experts.4.gate_proj.lora_A.weight", // expert out of range
        "model.layers.1.mlp.gate_proj.lora_A.weight",    // layer 1 has no dense MLP
        "model.layers.0.mlp.gate.lora_A.weight",         // no router on a dense layer
    ] {
        assert_eq!(refused(key, &qwen), RejectCode::ModelMismatch, "{key}");
    }
    let llama = test_support::llama(false);
    assert_eq!(
        refused("model.layers.0.mlp.gate.lora_A.weight", &llama),
        RejectCode::UnsupportedTarget
    );
}

#[test]
fn qwen3_next_gdn_inputs_are_refused_and_out_proj_placed() {
    let cfg = test_support::qwen3_next();
    assert_eq!(
        target(
            "base_model.model.model.layers.0.linear_attn.out_proj.lora_A.weight",
            &cfg
        ),
        (0, LoraTarget::Dense(LoraModule::LinearAttnOutProj), AdapterAb::A)
    );
    for name in ["in_proj_qkvz", "in_proj_ba", "conv1d"] {
        let key = format!("base_model.model.model.layers.0.linear_attn.{name}.lora_A.weight");
        assert_eq!(refused(&key, &cfg), RejectCode::GdnTarget, "{key}");
        assert!(is_gdn_key(&key));
    }
    assert!(!is_gdn_key(
        "base_model.model.model.layers.0.linear_attn.out_proj.lora_A.weight"
    ));
    assert!(!is_gdn_key(
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    ));
    // Full attention only on layer 1; out_proj only on layer 0.
    assert_eq!(
        refused("model.layers.0.self_attn.q_proj.lora_A.weight", &cfg),
        RejectCode::ModelMismatch
    );
    assert_eq!(
        refused("model.layers.1.linear_attn.out_proj.lora_A.weight", &cfg),
        RejectCode::ModelMismatch
    );
    assert_eq!(
        target("model.layers.1.mlp.shared_expert_gate.lora_B.weight", &cfg),
        (1, LoraTarget::Dense(LoraModule::SharedExpertGate), AdapterAb::B)
    );
}

#[test]
fn deepseek_mla_and_shared_experts() {
    let with_q = test_support::deepseek_v3(Some(16));
    for (name, module) in [
        ("self_attn.q_a_proj", LoraModule::QAProj),
        ("self_attn.q_b_proj", LoraModule::QBProj),
        ("self_attn.kv_a_proj_with_mqa", LoraModule::KvAProjWithMqa),
        ("self_attn.kv_b_proj", LoraModule::KvBProj),
        ("self_attn.o_proj", LoraModule::OProj),
        ("mlp.shared_experts.up_proj", LoraModule::SharedUpProj),
    ] {
        let key = format!("model.layers.1.{name}.lora_A.weight");
        assert_eq!(target(&key, &with_q).1, LoraTarget::Dense(module), "{key}");
    }
    assert_eq!(
        refused("model.layers.1.self_attn.q_proj.lora_A.weight", &with_q),
        RejectCode::ModelMismatch
    );
    let without_q = test_support::deepseek_v3(None);
    assert_eq!(
        target("model.layers.1.self_attn.q_proj.lora_A.weight", &without_q).1,
        LoraTarget::Dense(LoraModule::QProj)
    );
    assert_eq!(
        refused("model.layers.1.self_attn.q_a_proj.lora_A.weight", &without_q),
        RejectCode::ModelMismatch
    );
}

#[test]
fn non_pair_tensors_get_their_own_codes() {
    let cfg = test_support::llama(false);
    for (key, code) in [
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",
            RejectCode::LoraBias,
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
            RejectCode::Dora,
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias",
            RejectCode::Bias,
        ),
        (
            "base_model.model.model.layers.0.self_attn.k_proj.bias",
            RejectCode::Bias,
        ),
        (
            "base_model.model.model.vision_embed.lora_embedding_A",
            RejectCode::EmbeddingLora,
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
            RejectCode::UnknownKey,
        ),
        ("base_model.model.lm_head.lora_A.weight", RejectCode::UnsupportedTarget),
        (
            "base_model.model.model.layers.0.input_layernorm.lora_A.weight",
            RejectCode::UnsupportedTarget,
        ),
        (
            "model.layers.0.self_attn.q_proj.lora_A.weight\n",
            RejectCode::UnknownKey,
        ),
    ] {
        assert_eq!(refused(key, &cfg), code, "{key}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]
    #[test]
    fn classify_key_never_panics_on_arbitrary_names(key in "\\PC{0,80}") {
        for cfg in [test_support::llama(false), test_support::qwen3_moe(), test_support::qwen3_next()] {
            let _ = classify_key(&key, &cfg);
            let _ = is_gdn_key(&key);
        }
    }

    #[test]
    fn classify_key_never_panics_on_near_miss_names(
        prefix in proptest::sample::select(vec!["", "base_model.model.", "base_model.model.model.", "x."]),
        layer in "[0-9]{0,22}",
        rest in proptest::sample::select(vec![
            "self_attn.q_proj", "mlp.experts", "mlp.experts.base_layer", "mlp.experts.7.w1",
            "mlp.experts.18446744073709551616.gate_proj", "block_sparse_moe.experts.1.w2", "mlp.gate",
            "linear_attn.in_proj_qkvz", "linear_attn.out_proj", "mlp.shared_expert_gate", "",
        ]),
        suffix in proptest::sample::select(vec![".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".weight", ""]),
    ) {
        let key = format!("{prefix}layers.{layer}.{rest}{suffix}");
        for cfg in [test_support::mixtral(), test_support::qwen3_moe(), test_support::deepseek_v3(None)] {
            let _ = classify_key(&key, &cfg);
        }
    }
}

/// The substring-search formulation of `split_layer_path`, as a reference.
fn split_layer_path_by_search(path: &str) -> Option<(&str, usize, &str)> {
    let mut from = 0;
    loop {
        let found = path[from..].find("layers.")? + from;
        let at_boundary = found == 0 || path.as_bytes()[found - 1] == b'.';
        let after = &path[found + "layers.".len()..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if at_boundary && digits > 0 && after.as_bytes().get(digits) == Some(&b'.') {
            let layer = after[..digits].parse::<usize>().ok()?;
            return Some((
                path[..found].strip_suffix('.').unwrap_or(""),
                layer,
                &after[digits + 1..],
            ));
        }
        from = found + 1;
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    #[test]
    fn the_segment_walk_agrees_with_a_substring_search(
        parts in proptest::collection::vec(
            proptest::sample::select(vec!["layers", "xlayers", "layersx", "model", "7", "12", "", "mlp", "0x", "99999999999999999999999"]),
            0..8,
        )
    ) {
        let path = parts.join(".");
        proptest::prop_assert_eq!(split_layer_path(&path), split_layer_path_by_search(&path), "{}", path);
    }
}

#[test]
fn a_wrappers_vision_tower_is_never_taken_for_the_text_decoder() {
    let cfg = test_support::gemma3();
    // transformers 5.17's Gemma3ForConditionalGeneration: the text decoder
    // under `model.language_model`, q_proj 4 heads x 16 wide.
    assert_eq!(
        target(
            "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight",
            &cfg
        ),
        (1, LoraTarget::Dense(LoraModule::QProj), AdapterAb::A)
    );
    // Its SigLIP tower has `encoder.layers.{i}.self_attn.q_proj` too; those,
    // the tower's head and the projector's parameter are refused by name.
    for key in [
        "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.vision_tower.encoder.layers.1.mlp.fc2.lora_B.weight",
        "base_model.model.model.vision_tower.head.attention.out_proj.lora_A.weight",
        "base_model.model.model.multi_modal_projector.lora_A.weight",
        // transformers 4.x wrappers: `vision_tower.vision_model.encoder`.
        "base_model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_B.weight",
        "base_model.model.visual.blocks.0.attn.qkv.lora_A.weight",
    ] {
        assert_eq!(refused(key, &cfg), RejectCode::VisionTower, "{key}");
        let r = classify_key(key, &cfg).unwrap_err();
        assert!(r.reason.contains("not its text decoder"), "{}", r.reason);
    }
    assert!(RejectCode::VisionTower.skippable());
}

#[test]
fn non_text_tower_names_the_component() {
    assert_eq!(
        non_text_tower("model.vision_tower.encoder.layers.0.self_attn.q_proj"),
        Some("vision_tower")
    );
    assert_eq!(
        non_text_tower("model.multi_modal_projector"),
        Some("multi_modal_projector")
    );
    assert_eq!(non_text_tower("model.visual.blocks.0.attn.qkv"), Some("visual"));
    for text in [
        "model.language_model.layers.0.self_attn.q_proj",
        "model.layers.3.mlp.experts.gate_up_proj",
        "model.layers.0.linear_attn.in_proj_qkvz",
        "model.layers.1.self_attn.kv_a_proj_with_mqa",
        "lm_head",
    ] {
        assert_eq!(non_text_tower(text), None, "{text}");
    }
}

#[test]
fn phi3_fused_projections_are_single_targets() {
    let phi3 = test_support::phi3();
    assert_eq!(
        target(
            "base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight",
            &phi3
        ),
        (1, LoraTarget::Dense(LoraModule::QkvProj), AdapterAb::B)
    );
    assert_eq!(
        target("base_model.model.model.layers.0.mlp.gate_up_proj.lora_A.weight", &phi3),
        (0, LoraTarget::Dense(LoraModule::GateUpProj), AdapterAb::A)
    );
    // Unfused names on Phi-3, and fused names on another family, name
    // modules the model does not have.
    for key in [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
    ] {
        assert_eq!(refused(key, &phi3), RejectCode::ModelMismatch, "{key}");
    }
    let llama = test_support::llama(false);
    assert_eq!(
        refused(
            "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight",
            &llama
        ),
        RejectCode::ModelMismatch
    );
}

#[test]
fn gpt_oss_router_and_nested_expert_wrappers() {
    let oss = test_support::gpt_oss();
    assert_eq!(
        target("base_model.model.model.layers.0.mlp.router.lora_B.weight", &oss),
        (0, LoraTarget::Router, AdapterAb::B)
    );
    // Its router is not `mlp.gate`.
    assert_eq!(
        refused("base_model.model.model.layers.0.mlp.gate.lora_A.weight", &oss),
        RejectCode::UnsupportedTarget
    );
    // Its experts have four parameters (two biases): wrappers nest up to
    // three deep, each its own group.
    for (key, wrapper) in [
        ("mlp.experts.lora_A.weight", FusedWrapper::Outer),
        ("mlp.experts.base_layer.lora_A.weight", FusedWrapper::Inner),
        (
            "mlp.experts.base_layer.base_layer.lora_A.weight",
            FusedWrapper::Nested { depth: 2 },
        ),
    ] {
        let key = format!("base_model.model.model.layers.1.{key}");
        assert_eq!(target(&key, &oss), (1, LoraTarget::FusedExperts(wrapper), AdapterAb::A));
    }
    assert_eq!(
        refused(
            "base_model.model.model.layers.1.mlp.experts.base_layer.base_layer.base_layer.base_layer.lora_A.weight",
            &oss
        ),
        RejectCode::UnsupportedTarget
    );
    // Saved expert and router biases (`bias="all"`) are absolute base biases.
    for key in [
        "base_model.model.model.layers.0.mlp.experts.gate_up_proj_bias",
        "base_model.model.model.layers.0.mlp.router.bias",
    ] {
        assert_eq!(refused(key, &oss), RejectCode::Bias, "{key}");
    }
}
