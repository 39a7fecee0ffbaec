use super::*;
use crate::prepare_adapter;
use crate::test_support;

#[test]
fn weight_names_of_every_form() {
    let qwen = test_support::qwen3_moe();
    let cases = [
        (
            "model.layers.0.self_attn.q_proj.weight",
            WeightRef::Dense {
                layer: 0,
                module: LoraModule::QProj,
            },
        ),
        (
            "model.layers.0.mlp.down_proj.weight",
            WeightRef::Dense {
                layer: 0,
                module: LoraModule::DownProj,
            },
        ),
        (
            "model.layers.1.mlp.experts.gate_up_proj",
            WeightRef::Fused {
                layer: 1,
                param: FusedParam::GateUp,
            },
        ),
        (
            "model.layers.1.mlp.experts.down_proj",
            WeightRef::Fused {
                layer: 1,
                param: FusedParam::Down,
            },
        ),
        (
            "model.layers.1.mlp.experts.3.gate_proj.weight",
            WeightRef::Expert {
                layer: 1,
                expert: 3,
                proj: ExpertProj::Gate,
            },
        ),
        ("model.layers.1.mlp.gate.weight", WeightRef::Router { layer: 1 }),
        ("model.embed_tokens.weight", WeightRef::Table(OverlayModule::Embed)),
        (
            "model.language_model.embed_tokens.weight",
            WeightRef::Table(OverlayModule::Embed),
        ),
        ("lm_head.weight", WeightRef::Table(OverlayModule::LmHead)),
        ("model.layers.0.input_layernorm.weight", WeightRef::Unserved),
    ];
    for (name, want) in cases {
        assert_eq!(parse_weight_name(name, &qwen).unwrap(), want, "{name}");
    }
    let mixtral = test_support::mixtral();
    assert_eq!(
        parse_weight_name("model.layers.0.block_sparse_moe.experts.3.w1.weight", &mixtral).unwrap(),
        WeightRef::Expert {
            layer: 0,
            expert: 3,
            proj: ExpertProj::Gate
        }
    );
    assert_eq!(
        parse_weight_name("model.layers.1.block_sparse_moe.gate.weight", &mixtral).unwrap(),
        WeightRef::Router { layer: 1 }
    );
    let next = test_support::qwen3_next();
    assert_eq!(
        parse_weight_name("model.layers.0.linear_attn.in_proj_qkvz.weight", &next).unwrap(),
        WeightRef::Unserved
    );
    for bad in [
        "model.norm.weight",
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.9.gate_proj.weight",
        "model.layers.0.self_attn.q_proj",
    ] {
        assert!(parse_weight_name(bad, &qwen).is_err(), "{bad}");
    }
}

#[test]
fn apply_pair_is_scale_b_a_x() {
    // x [2, 3], A [2, 3], B [4, 2]; the reference multiplies dW = s·B·A first.
    let x = [0.5f32, -1.0, 2.0, 1.5, 0.25, -0.75];
    let a: Vec<bf16> = [1.0f32, 2.0, -1.0, 0.5, 0.0, 3.0]
        .iter()
        .map(|v| bf16::from_f32(*v))
        .collect();
    let b: Vec<bf16> = [1.0f32, -2.0, 0.5, 0.25, 3.0, 1.0, -1.0, 0.0]
        .iter()
        .map(|v| bf16::from_f32(*v))
        .collect();
    let (n, inp, out, r, s) = (2, 3, 4, 2, 0.75f32);
    let shape = PairShape { n, rank: r, inp, out };
    let y = apply_pair(&x, &a, &b, shape, s).unwrap();
    assert!(apply_pair(&x[1..], &a, &b, shape, s).is_none(), "lengths are checked");
    assert!(apply_pair(&x, &a[1..], &b, shape, s).is_none());
    assert!(apply_pair(&x, &a, &b[1..], shape, s).is_none());
    for row in 0..n {
        for o in 0..out {
            let dw = |i: usize| {
                s * (0..r)
                    .map(|k| b[o * r + k].to_f32() * a[k * inp + i].to_f32())
                    .sum::<f32>()
            };
            let want: f32 = (0..inp).map(|i| x[row * inp + i] * dw(i)).sum();
            assert!(
                (y[row * out + o] - want).abs() <= 1e-5 * want.abs().max(1.0),
                "row {row} out {o}"
            );
        }
    }
}

#[test]
fn an_oracle_pairs_every_input_with_peft_s_answer() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama/trainable_tokens_untied_list");
    let oracle = read_oracle(&dir.join("oracle.safetensors")).unwrap();
    assert!(!oracle.inputs.inputs.is_empty() || !oracle.inputs.rows.is_empty());
    for (weight, input) in &oracle.inputs.inputs {
        let out = &oracle.expected[&format!("{PROBE_OUT}{weight}")];
        assert_eq!(out.shape[..out.shape.len() - 1].last(), input.shape.first(), "{weight}");
    }
    for (table, ids) in &oracle.inputs.rows {
        let rows = &oracle.expected[&format!("{ROWS_MERGED}{table}")];
        assert_eq!(rows.shape[0], ids.len(), "{table}");
    }
    assert_eq!(
        oracle.expected.len(),
        oracle.inputs.inputs.len() + oracle.inputs.rows.len()
    );
}

/// A Llama of hidden 64 whose MLP is `intermediate_size` wide, and a
/// servable attention-only adapter for it.
fn wide_mlp_model(intermediate_size: usize) -> (ModelConfig, crate::test_support::ScratchDir) {
    let cfg = ModelConfig::from_hf_config(&format!(
        r#"{{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": {intermediate_size}, "vocab_size": 256}}"#
    ))
    .unwrap();
    let dir = crate::test_support::ScratchDir::new("probe-wide");
    let pair = [
        crate::test_support::f32_tensor(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            &[4, 64],
            &[0.5; 256],
        ),
        crate::test_support::f32_tensor(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
            &[64, 4],
            &[0.25; 256],
        ),
    ];
    std::fs::write(dir.join(crate::ADAPTER_CONFIG), r#"{"r": 4}"#).unwrap();
    std::fs::write(
        dir.join(crate::ADAPTER_WEIGHTS),
        crate::test_support::safetensors_bytes(&pair),
    )
    .unwrap();
    (cfg, dir)
}

fn probe_rows(weight: &str, rows: usize) -> ProbeInputs {
    let mut inputs = ProbeInputs::default();
    inputs.inputs.insert(
        weight.to_string(),
        ProbeTensor {
            shape: vec![rows, 64],
            data: vec![1.0; rows * 64],
        },
    );
    inputs
}

#[test]
fn a_probe_past_the_output_bound_is_refused_naming_the_field_not_aborted() {
    // Issue 42: intermediate_size 2^24 (the largest a config may give) and a
    // probe of 1000 rows asked for 67108864000 bytes and aborted the process.
    let (cfg, dir) = wide_mlp_model(1 << 24);
    let adapter = crate::prepare_adapter(&dir.0, &cfg, &crate::LoraOptions::default()).unwrap();
    let inputs = probe_rows("model.layers.0.mlp.gate_proj.weight", 1000);
    match probe_adapter(&adapter, &cfg, &inputs, None) {
        Err(e @ AuditError::ProbeTooLarge { .. }) => {
            let AuditError::ProbeTooLarge {
                field,
                rows,
                width,
                bytes,
                ..
            } = &e
            else {
                unreachable!()
            };
            assert_eq!((*field, *rows, *width), ("intermediate_size", 1000, 1 << 24));
            assert_eq!(*bytes, 67_108_864_000);
            let msg = e.to_string();
            assert!(
                msg.contains("gate_proj") && msg.contains("MAX_PROBE_OUTPUT_BYTES"),
                "{msg}"
            );
        }
        other => panic!("expected a bounded refusal, got {other:?}"),
    }
    // A probe within the bound is answered: x = 1, A = 0.5, B = 0.25,
    // r = 4, scale 8 / 4: each output is 2 * 4 * (64 * 0.5) * 0.25 = 64.
    let ok = probe_adapter(
        &adapter,
        &cfg,
        &probe_rows("model.layers.0.self_attn.q_proj.weight", 3),
        None,
    )
    .unwrap();
    let out = &ok.tensors["probe_out::model.layers.0.self_attn.q_proj.weight"];
    assert_eq!(out.shape, [3, 64]);
    assert!(out.data.iter().all(|&v| v == 64.0), "{:?}", &out.data[..4]);
}

#[test]
fn the_probe_output_bound_is_over_the_whole_run() {
    let (cfg, dir) = wide_mlp_model(1024);
    let adapter = crate::prepare_adapter(&dir.0, &cfg, &crate::LoraOptions::default()).unwrap();
    // 10 rows x 1024 outputs x 4 bytes = 40960 bytes each: one fits, two do not.
    let mut two = probe_rows("model.layers.0.mlp.gate_proj.weight", 10);
    assert!(probe_within(&adapter, &cfg, &two, None, Placement::SINGLE, 60_000).is_ok());
    two.inputs
        .extend(probe_rows("model.layers.0.mlp.up_proj.weight", 10).inputs);
    match probe_within(&adapter, &cfg, &two, None, Placement::SINGLE, 60_000) {
        Err(AuditError::ProbeTooLarge { field, limit, .. }) => {
            assert_eq!((field, limit), ("intermediate_size", 60_000 - 40_960), "what was left");
        }
        other => panic!("expected the run's bound, got {other:?}"),
    }
    assert!(probe_within(&adapter, &cfg, &two, None, Placement::SINGLE, 81_920).is_ok());
}

#[test]
fn row_probes_are_bounded_too() {
    let (cfg, dir) = wide_mlp_model(128);
    let adapter = crate::prepare_adapter(&dir.0, &cfg, &crate::LoraOptions::default()).unwrap();
    let table = vec![bf16::ONE; 256 * 64];
    let base = BaseTables {
        embed: Some(table),
        lm_head: None,
    };
    let mut inputs = ProbeInputs::default();
    inputs.rows.insert("model.embed_tokens.weight".into(), vec![0; 11]);
    assert!(matches!(
        probe_within(&adapter, &cfg, &inputs, Some(&base), Placement::SINGLE, 10 * 64 * 4),
        Err(AuditError::ProbeTooLarge {
            field: "hidden_size",
            rows: 11,
            ..
        })
    ));
    inputs.rows.insert("model.embed_tokens.weight".into(), vec![5, 7]);
    let ok = probe_adapter(&adapter, &cfg, &inputs, Some(&base)).unwrap();
    assert_eq!(
        ok.tensors["rows_merged::model.embed_tokens.weight"].data,
        vec![1.0; 128]
    );
}

/// ‖out − ref‖ / ‖ref‖ (infinite on a length mismatch).
fn rel_error(out: &[f32], reference: &[f32]) -> f64 {
    if out.len() != reference.len() {
        return f64::INFINITY;
    }
    let diff: f64 = out.iter().zip(reference).map(|(a, b)| f64::from(a - b).powi(2)).sum();
    let norm: f64 = reference.iter().map(|b| f64::from(*b).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Every fixture family's adapters probed on dense weights only, with
/// their oracles.
fn dense_fixture_adapters() -> Vec<(String, ModelConfig, std::path::PathBuf, Oracle)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut out = Vec::new();
    let mut families: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).collect();
    families.sort();
    for family in families {
        let Ok(cfg) = ModelConfig::from_file(&family.join("config.json")) else {
            continue;
        };
        let mut dirs: Vec<_> = std::fs::read_dir(&family).unwrap().map(|e| e.unwrap().path()).collect();
        dirs.sort();
        for dir in dirs {
            let Ok(oracle) = read_oracle(&dir.join("oracle.safetensors")) else {
                continue;
            };
            let dense = oracle.inputs.rows.is_empty()
                && oracle
                    .inputs
                    .inputs
                    .keys()
                    .all(|w| matches!(parse_weight_name(w, &cfg), Ok(WeightRef::Dense { .. })));
            let servable = crate::audit_adapter(&dir, &cfg, &crate::LoraOptions::default())
                .is_ok_and(|r| r.is_servable() && r.experts.is_empty());
            if dense && servable {
                out.push((family.display().to_string(), cfg.clone(), dir, oracle));
            }
        }
    }
    out
}

#[test]
fn the_ranks_probe_parts_reassemble_the_peft_oracle() {
    let adapters = dense_fixture_adapters();
    assert!(adapters.len() >= 15, "{} dense fixture adapters", adapters.len());
    for (family, cfg, dir, oracle) in &adapters {
        let whole = prepare_adapter(dir, cfg, &crate::LoraOptions::default()).unwrap();
        let unsharded = probe_adapter(&whole, cfg, &oracle.inputs, None).unwrap();
        for world in [1, 2, 4, 8] {
            let group = Placement::new(0, world).unwrap();
            let opts = |placement| crate::LoraOptions {
                placement,
                ..crate::LoraOptions::default()
            };
            if let Err(expected) = lora_layout::SlotLayout::with_placement(cfg, 16, group) {
                // Every fixture has 4 attention heads: 8 ranks cannot cut
                // them, and the audit says so by type.
                assert_eq!(world, 8, "{}: {expected}", dir.display());
                for p in group.ranks() {
                    match prepare_adapter(dir, cfg, &opts(p)) {
                        Err(AuditError::Layout(e)) => assert_eq!(e, expected),
                        other => panic!("{}: x8 gave {:?}", dir.display(), other.map(|_| ())),
                    }
                }
                continue;
            }
            let parts: Vec<(Placement, ProbeOutputs)> = group
                .ranks()
                .map(|p| {
                    let adapter = prepare_adapter(dir, cfg, &opts(p)).unwrap();
                    (p, probe_adapter_at(&adapter, cfg, &oracle.inputs, None, p).unwrap())
                })
                .collect();
            for (weight, x) in &oracle.inputs.inputs {
                let WeightRef::Dense { module, .. } = parse_weight_name(weight, cfg).unwrap() else {
                    unreachable!("dense probes only");
                };
                let key = format!("{PROBE_OUT}{weight}");
                let n = x.shape[0];
                let (out, _) = module.dims(cfg);
                let mut full = vec![0.0f32; n * out];
                let mut held = vec![false; out];
                for (p, outputs) in &parts {
                    let shard = ModuleShard::of(module, cfg, *p).unwrap();
                    let part = &outputs.tensors[&key];
                    let what = format!("{family} {} x{world} rank {} {weight}", dir.display(), p.tp_rank());
                    match shard.kind {
                        ShardKind::Row => {
                            assert_eq!(part.shape, [n, out], "{what}");
                            for (f, v) in full.iter_mut().zip(&part.data) {
                                *f += v;
                            }
                            held.fill(true);
                        }
                        ShardKind::Column | ShardKind::Replicated => {
                            let (out_r, _) = shard.dims();
                            assert_eq!(part.shape, [n, out_r], "{what}");
                            for j in 0..out_r {
                                let col = shard.src_row(j).unwrap();
                                for t in 0..n {
                                    let v = part.data[t * out_r + j];
                                    if held[col] {
                                        assert_eq!(full[t * out + col], v, "{what}: a replica differs");
                                    }
                                    full[t * out + col] = v;
                                }
                                held[col] = true;
                            }
                        }
                    }
                }
                assert!(held.iter().all(|&h| h), "{weight}: every column is some rank's");
                let what = format!("{} x{world} {weight}", dir.display());
                let err = rel_error(&full, &unsharded.tensors[&key].data);
                assert!(err < 1e-3, "{what}: {err} against the unsharded probe");
                let err = rel_error(&full, &oracle.expected[&key].data);
                assert!(err < 1e-2, "{what}: {err} against PEFT");
            }
        }
    }
}

#[test]
fn expert_and_table_probes_have_no_placement() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
    let cfg = ModelConfig::from_file(&root.join("config.json")).unwrap();
    let dir = root.join("trainable_tokens_untied_list");
    let opts = crate::LoraOptions {
        placement: Placement::new(0, 2).unwrap(),
        ..crate::LoraOptions::default()
    };
    let adapter = prepare_adapter(&dir, &cfg, &opts).unwrap();
    let oracle = read_oracle(&dir.join("oracle.safetensors")).unwrap();
    assert!(!oracle.inputs.rows.is_empty());
    let err = probe_adapter_at(&adapter, &cfg, &oracle.inputs, None, opts.placement).unwrap_err();
    assert!(
        matches!(&err, AuditError::Probe { name, .. } if name.starts_with(ROWS_IDX)),
        "{err}"
    );
}

#[test]
fn the_head_pairs_probe_is_whole_on_every_tensor_parallel_rank() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
    let cfg = ModelConfig::from_file(&root.join("config.json")).unwrap();
    let dir = root.join("lm_head_lora");
    let oracle = read_oracle(&dir.join("oracle.safetensors")).unwrap();
    let key = format!("{PROBE_OUT}lm_head.weight");
    assert!(oracle.expected.contains_key(&key), "the fixture probes its head");
    let opts = |placement| crate::LoraOptions {
        placement,
        lm_head_lora: true,
        ..crate::LoraOptions::default()
    };
    let whole = prepare_adapter(&dir, &cfg, &opts(Placement::SINGLE)).unwrap();
    assert!(whole.lm_head.is_some());
    let unsharded = probe_adapter(&whole, &cfg, &oracle.inputs, None).unwrap();
    for world in [2, 4] {
        for p in Placement::new(0, world).unwrap().ranks() {
            let adapter = prepare_adapter(&dir, &cfg, &opts(p)).unwrap();
            let outputs = probe_adapter_at(&adapter, &cfg, &oracle.inputs, None, p).unwrap();
            let what = format!("x{world} rank {}", p.tp_rank());
            // Replicated: the whole head delta, the same on every rank.
            let part = &outputs.tensors[&key];
            assert_eq!(
                part.shape,
                [oracle.inputs.inputs["lm_head.weight"].shape[0], cfg.vocab_size],
                "{what}"
            );
            assert_eq!(part, &unsharded.tensors[&key], "{what}: the whole delta");
            let err = rel_error(&part.data, &oracle.expected[&key].data);
            assert!(err < 1e-2, "{what}: {err} against PEFT");
        }
    }
    // A table without a LoRA pair is still a token table: no placement.
    let mut inputs = ProbeInputs::default();
    inputs
        .inputs
        .insert("lm_head.weight".into(), oracle.inputs.inputs["lm_head.weight"].clone());
    let plain = prepare_adapter(&root.join("rslora"), &cfg, &opts(Placement::new(0, 2).unwrap())).unwrap();
    let err = probe_adapter_at(&plain, &cfg, &inputs, None, Placement::new(0, 2).unwrap()).unwrap_err();
    assert!(err.to_string().contains("tensor-parallel"), "{err}");
}
