use super::*;
use std::collections::HashMap;

fn opts(vars: &[(&str, &str)]) -> Result<LoraOptions, OptionsError> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    LoraOptions::from_vars(|name| map.get(name).cloned())
}

#[test]
fn unset_variables_give_the_defaults() {
    assert_eq!(opts(&[]).unwrap(), LoraOptions::default());
}

#[test]
fn every_variable_is_read() {
    let o = opts(&[
        ("LORA_MAX_LORAS", "8"),
        ("LORA_MAX_RANK", "64"),
        ("LORA_PINNED", "2"),
        ("LORA_ALLOW_PARTIAL", "TRUE"),
        ("LORA_EXPERTS", "1"),
        ("LORA_EXPERT_RANK", "32"),
        ("LORA_EXPERT_SLOT_BYTES", "4096"),
        ("LORA_EAGER", "True"),
        ("LORA_ROTATE", "0"),
        ("LORA_HOST_TIER_BYTES", "1073741824"),
        ("LORA_DORA", "1"),
    ])
    .unwrap();
    assert_eq!(o.host_tier_bytes, 1 << 30);
    assert_eq!(o.max_loras, 8);
    assert_eq!(o.max_rank, 64);
    assert_eq!(o.pinned, 2);
    assert!(o.allow_partial && o.experts && o.eager && o.dora);
    assert_eq!(o.expert_rank, 32);
    assert_eq!(o.expert_slot_bytes, Some(4096));
    assert!(!o.rotatable);
    assert_eq!(o.peer, None);
}

#[test]
fn booleans_are_one_or_true_in_any_case() {
    for (v, want) in [
        ("1", true),
        ("true", true),
        ("tRuE", true),
        ("yes", false),
        ("0", false),
        ("", false),
    ] {
        assert_eq!(opts(&[("LORA_EXPERTS", v)]).unwrap().experts, want, "{v:?}");
    }
}

#[test]
fn a_peer_makes_the_pool_rotatable() {
    let o = opts(&[("LORA_PEER", "10.0.0.2:7000")]).unwrap();
    assert_eq!(o.peer.as_deref(), Some("10.0.0.2:7000"));
    assert!(o.rotatable);
    assert!(opts(&[("LORA_ROTATE", "true")]).unwrap().rotatable);
    assert_eq!(opts(&[("LORA_PEER", "  ")]).unwrap().peer, None);
}

#[test]
fn a_malformed_number_names_its_variable() {
    for var in [
        "LORA_MAX_LORAS",
        "LORA_MAX_RANK",
        "LORA_PINNED",
        "LORA_EXPERT_RANK",
        "LORA_EXPERT_SLOT_BYTES",
        "LORA_HOST_TIER_BYTES",
    ] {
        let err = opts(&[(var, "12x")]).unwrap_err();
        assert_eq!(err.variable, var);
        assert!(err.to_string().contains(var));
    }
    assert_eq!(opts(&[("LORA_MAX_RANK", "-1")]).unwrap_err().variable, "LORA_MAX_RANK");
}

#[test]
fn zero_sizes_and_excess_pins_are_errors() {
    assert_eq!(opts(&[("LORA_MAX_RANK", "0")]).unwrap_err().variable, "LORA_MAX_RANK");
    assert_eq!(
        opts(&[("LORA_EXPERT_RANK", "0")]).unwrap_err().variable,
        "LORA_EXPERT_RANK"
    );
    assert_eq!(opts(&[("LORA_MAX_LORAS", "0")]).unwrap_err().variable, "LORA_MAX_LORAS");
    let err = opts(&[("LORA_MAX_LORAS", "2"), ("LORA_PINNED", "3")]).unwrap_err();
    assert_eq!(err.variable, "LORA_PINNED");
}

#[test]
fn audit_args_override_the_environment_and_refuse_rank_zero() {
    let env = opts(&[("LORA_MAX_RANK", "32"), ("LORA_EXPERTS", "1")]).unwrap();
    let kept = env.clone().with_args(AuditArgs::default()).unwrap();
    assert_eq!(kept, env);
    let args = AuditArgs {
        max_rank: Some(8),
        expert_rank: Some(4),
        allow_partial: true,
        experts: false,
        dora: true,
        embedding_lora: true,
        lm_head_lora: true,
        ..AuditArgs::default()
    };
    let o = env.clone().with_args(args).unwrap();
    assert_eq!(
        (
            o.max_rank,
            o.expert_rank,
            o.allow_partial,
            o.experts,
            o.dora,
            o.embedding_lora,
            o.lm_head_lora
        ),
        (8, 4, true, true, true, true, true)
    );
    assert!(!env.embedding_lora && !env.lm_head_lora);
    assert!(opts(&[("LORA_EMBEDDING_LORA", "1")]).unwrap().embedding_lora);
    let head = opts(&[("LORA_LM_HEAD_LORA", "true")]).unwrap();
    assert!(head.lm_head_lora && !head.embedding_lora);
    for args in [
        AuditArgs {
            max_rank: Some(0),
            ..AuditArgs::default()
        },
        AuditArgs {
            expert_rank: Some(0),
            ..AuditArgs::default()
        },
    ] {
        let err = env.clone().with_args(args).unwrap_err();
        assert!(err.to_string().contains("must be at least 1"), "{err}");
    }
}

#[test]
fn the_tensor_parallel_placement_is_read_and_checked() {
    let o = opts(&[("LORA_TP_RANK", "3"), ("LORA_TP_WORLD", "4")]).unwrap();
    assert_eq!(o.placement, lora_layout::Placement::new(3, 4).unwrap());
    assert_eq!(opts(&[]).unwrap().placement, lora_layout::Placement::SINGLE);
    let err = opts(&[("LORA_TP_RANK", "4"), ("LORA_TP_WORLD", "4")]).unwrap_err();
    assert_eq!((err.variable, err.value.as_str()), ("LORA_TP_RANK", "4"));
    let err = opts(&[("LORA_TP_WORLD", "0")]).unwrap_err();
    assert_eq!(err.variable, "LORA_TP_WORLD");
    let err = opts(&[("LORA_TP_RANK", "1")]).unwrap_err();
    assert_eq!(err.variable, "LORA_TP_RANK");
}

#[test]
fn the_expert_parallel_placement_is_read_and_checked() {
    let o = opts(&[
        ("LORA_TP_RANK", "1"),
        ("LORA_TP_WORLD", "2"),
        ("LORA_EP_RANK", "2"),
        ("LORA_EP_WORLD", "4"),
    ])
    .unwrap();
    let want = lora_layout::Placement::new(1, 2).unwrap().with_experts(2, 4).unwrap();
    assert_eq!(o.placement, want);
    assert_eq!((o.placement.ep_rank(), o.placement.ep_world()), (2, 4));
    let err = opts(&[("LORA_EP_RANK", "4"), ("LORA_EP_WORLD", "4")]).unwrap_err();
    assert_eq!((err.variable, err.value.as_str()), ("LORA_EP_RANK", "4"));
    let err = opts(&[("LORA_EP_WORLD", "0")]).unwrap_err();
    assert_eq!(err.variable, "LORA_EP_WORLD");
    let err = opts(&[("LORA_EP_RANK", "1")]).unwrap_err();
    assert_eq!(err.variable, "LORA_EP_RANK");
}

#[test]
fn audit_args_replace_the_placement() {
    let env = opts(&[("LORA_TP_RANK", "1"), ("LORA_TP_WORLD", "2")]).unwrap();
    let args = AuditArgs {
        ep_rank: Some(3),
        ep_world: Some(4),
        ..AuditArgs::default()
    };
    let o = env.clone().with_args(args).unwrap();
    let want = lora_layout::Placement::new(1, 2).unwrap().with_experts(3, 4).unwrap();
    assert_eq!(o.placement, want);
    let args = AuditArgs {
        tp_rank: Some(2),
        ..AuditArgs::default()
    };
    let err = env.clone().with_args(args).unwrap_err();
    assert_eq!((err.variable, err.value.as_str()), ("tp_rank", "2"));
    let args = AuditArgs {
        ep_world: Some(0),
        ..AuditArgs::default()
    };
    assert_eq!(env.with_args(args).unwrap_err().variable, "ep_world");
}

#[test]
fn dora_is_refused_on_a_placed_pool() {
    for (var, world) in [("LORA_TP_WORLD", "2"), ("LORA_EP_WORLD", "4")] {
        let err = opts(&[("LORA_DORA", "1"), (var, world)]).unwrap_err();
        assert_eq!(err.variable, "LORA_DORA", "{var}");
        assert!(err.reason.contains("parallelism"), "{err}");
    }
    // Either alone is fine; DoRA and the embedding place together too.
    assert!(opts(&[("LORA_DORA", "1"), ("LORA_EMBEDDING_LORA", "1")]).unwrap().dora);
    assert!(opts(&[("LORA_TP_WORLD", "2")]).is_ok());
    let env = opts(&[("LORA_DORA", "1")]).unwrap();
    for args in [
        AuditArgs {
            tp_world: Some(2),
            ..AuditArgs::default()
        },
        AuditArgs {
            ep_world: Some(2),
            ..AuditArgs::default()
        },
    ] {
        assert_eq!(env.clone().with_args(args).unwrap_err().variable, "dora");
    }
    let placed = opts(&[("LORA_TP_WORLD", "2")]).unwrap();
    let args = AuditArgs {
        dora: true,
        ..AuditArgs::default()
    };
    assert_eq!(placed.with_args(args).unwrap_err().variable, "dora");
}

#[test]
fn the_fully_sharded_option_is_read_and_kept_over_the_args() {
    let o = opts(&[
        ("LORA_TP_RANK", "1"),
        ("LORA_TP_WORLD", "2"),
        ("LORA_FULLY_SHARDED", "1"),
    ])
    .unwrap();
    assert_eq!(
        o.placement,
        lora_layout::Placement::new(1, 2).unwrap().with_fully_sharded(true)
    );
    assert!(!opts(&[]).unwrap().placement.fully_sharded());
    // Args that replace the ranks keep the option; the flag turns it on.
    let args = AuditArgs {
        tp_rank: Some(0),
        ..AuditArgs::default()
    };
    assert!(o.clone().with_args(args).unwrap().placement.fully_sharded());
    let args = AuditArgs {
        fully_sharded: true,
        ..AuditArgs::default()
    };
    let env = opts(&[("LORA_TP_WORLD", "4")]).unwrap();
    let on = env.with_args(args).unwrap();
    assert_eq!(
        on.placement,
        lora_layout::Placement::new(0, 4).unwrap().with_fully_sharded(true)
    );
    // The layout of a max_rank the world does not divide names max_rank.
    let cfg = lora_layout::ModelConfig::from_hf_value(&serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 32,
    }))
    .unwrap();
    let err = LoraOptions { max_rank: 6, ..on }.slot_layout(&cfg).unwrap_err();
    assert!(err.to_string().contains("max_rank = 6"), "{err}");
}

#[test]
fn the_vocab_parallel_and_fully_sharded_options_are_independent() {
    let both = opts(&[
        ("LORA_TP_RANK", "1"),
        ("LORA_TP_WORLD", "2"),
        ("LORA_VOCAB_PARALLEL", "1"),
        ("LORA_FULLY_SHARDED", "1"),
    ])
    .unwrap();
    assert!(both.placement.vocab_parallel() && both.placement.fully_sharded());
    let only_vocab = opts(&[("LORA_TP_WORLD", "2"), ("LORA_VOCAB_PARALLEL", "1")]).unwrap();
    assert!(only_vocab.placement.vocab_parallel() && !only_vocab.placement.fully_sharded());
    let args = AuditArgs {
        fully_sharded: true,
        ..AuditArgs::default()
    };
    let p = only_vocab.with_args(args).unwrap().placement;
    assert!(p.vocab_parallel() && p.fully_sharded());
}

#[test]
fn the_vocab_parallel_cut_is_read_from_the_env_and_the_args() {
    let off = opts(&[("LORA_TP_RANK", "1"), ("LORA_TP_WORLD", "2")]).unwrap();
    assert!(!off.placement.vocab_parallel());
    let on = opts(&[
        ("LORA_TP_RANK", "1"),
        ("LORA_TP_WORLD", "2"),
        ("LORA_VOCAB_PARALLEL", "1"),
    ])
    .unwrap();
    let want = lora_layout::Placement::new(1, 2).unwrap().with_vocab_parallel(true);
    assert_eq!(on.placement, want);
    // Args replacing the ranks keep it; the args' switch turns it on.
    let args = AuditArgs {
        tp_rank: Some(0),
        ..AuditArgs::default()
    };
    assert!(on.with_args(args).unwrap().placement.vocab_parallel());
    let args = AuditArgs {
        vocab_parallel: true,
        ..AuditArgs::default()
    };
    assert_eq!(off.with_args(args).unwrap().placement, want);
}
