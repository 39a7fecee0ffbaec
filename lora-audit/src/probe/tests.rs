use super::*;
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
