//! Every expert and router probe of every servable MoE fixture, answered
//! through the serving path (pool expert tables + MoE folds), against PEFT's
//! merged weights; the dense parts of the same adapters through the pool's
//! own dense apply. Qwen3-MoE (5.x fused and 4.x per-expert), Mixtral (5.x
//! and 4.x `w1`/`w3`/`w2`), DeepSeek-V3 and Qwen3-Next (both formats). Runs
//! on the CPU backend (CI) and on CUDA when present (GPU bundle).

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{MOE_MODELS, Oracle, load_model, rel_error, to_bf16};
use lora_audit::{ProbeInputs, ProbeTensor, WeightRef, parse_weight_name};
use lora_kernels::testing::cuda_or_skip;
use lora_kernels::{Device, Rows, RowsMut};
use lora_moe::probe_expert_lora;
use lora_pool::{FusedTargets, LoraPool, SlotLease, StepRow};

/// The probe inputs of adapter `own`'s oracle, and those of every other
/// weight any other adapter of the model changes, by weight name.
fn probe_inputs(own: &Oracle, oracles: &[Oracle]) -> ProbeInputs {
    let mut inputs = BTreeMap::new();
    for o in std::iter::once(own).chain(oracles) {
        for (w, (pin, _)) in &o.probes {
            inputs.entry(w.clone()).or_insert_with(|| ProbeTensor {
                shape: pin.shape.clone(),
                data: pin.data.clone(),
            });
        }
    }
    ProbeInputs {
        inputs,
        rows: BTreeMap::new(),
        ..ProbeInputs::default()
    }
}

/// The dense delta of `lease`'s adapter on `x` through the pool's decode apply, each
/// f32 probe row served as two BF16 rows `hi` and `lo` whose deltas are
/// summed, as `probe_expert_lora` does (see its module docs): BF16 probe
/// rows alone would measure the input format, not the pairs.
fn dense_delta(pool: &mut LoraPool, lease: &SlotLease, weight: &str, x: &ProbeTensor) -> Vec<f32> {
    let cfg = pool.config().clone();
    let WeightRef::Dense { layer, module } = parse_weight_name(weight, &cfg).unwrap() else {
        panic!("{weight}: not a dense weight");
    };
    let (out_dim, in_dim) = module.dims(&cfg);
    let n = x.shape[0];
    let hi = to_bf16(&x.data);
    let lo: Vec<f32> = x.data.iter().zip(&hi).map(|(v, h)| v - h.to_f32()).collect();
    let mut split = hi.clone();
    split.extend(to_bf16(&lo));
    let device = pool.device().clone();
    let xb = device.upload(&split).unwrap();
    let mut y = device.alloc_zeros::<f32>(2 * n * out_dim).unwrap();
    let step = pool.decode_step(&vec![StepRow::Adapter(lease); 2 * n], 2 * n).unwrap();
    pool.apply_decode(
        &step,
        layer,
        &FusedTargets::single(&cfg, module),
        Rows::dense(&xb, 2 * n, in_dim),
        RowsMut::dense(&mut y, 2 * n, out_dim),
    )
    .unwrap();
    device.check_faults().unwrap();
    let y = y.download().unwrap();
    let (y_hi, y_lo) = y.split_at(n * out_dim);
    y_hi.iter().zip(y_lo).map(|(a, b)| a + b).collect()
}

fn run(device: &Device) {
    for model in MOE_MODELS {
        let (mut pool, names, oracles) = load_model(device, model);
        let cfg = pool.config().clone();
        let mut model_expert_probes = 0;
        for (slot, (name, oracle)) in names.iter().zip(&oracles).enumerate() {
            let inputs = probe_inputs(oracle, &oracles);
            let lease = pool.acquire(name).unwrap();
            assert_eq!(lease.slot().index(), slot, "{model}/{name}");
            let answered = probe_expert_lora(&mut pool, &lease, &inputs).unwrap();
            let not_expert: BTreeSet<&String> = answered.not_expert.iter().collect();
            let mut expert_probes = 0;
            for (weight, x) in &inputs.inputs {
                let key = format!("probe_out::{weight}");
                let (out, is_expert) = match answered.tensors.get(&key) {
                    Some(t) => (t.clone(), true),
                    None => {
                        assert!(not_expert.contains(weight), "{model}/{name}: {weight} was not answered");
                        let data = dense_delta(&mut pool, &lease, weight, x);
                        let out_dim = data.len() / x.shape[0];
                        (
                            ProbeTensor {
                                shape: vec![x.shape[0], out_dim],
                                data,
                            },
                            false,
                        )
                    }
                };
                match oracle.probes.get(weight) {
                    Some((_, want)) => {
                        assert_eq!(out.shape, want.shape, "{model}/{name}: {weight}");
                        let err = rel_error(&out.data, &want.data);
                        assert!(err < 1e-2, "{model}/{name}: {weight}: relative error {err}");
                        expert_probes += usize::from(is_expert);
                    }
                    // Another adapter's weight: this one leaves it alone.
                    None => assert!(
                        out.data.iter().all(|v| *v == 0.0),
                        "{model}/{name}: {weight} is not adapted, yet its served delta is not zero"
                    ),
                }
            }
            let oracle_expert_probes = oracle
                .probes
                .keys()
                .filter(|w| {
                    !matches!(
                        parse_weight_name(w, &cfg).unwrap(),
                        WeightRef::Dense { .. } | WeightRef::Table(_) | WeightRef::Unserved
                    )
                })
                .count();
            assert_eq!(expert_probes, oracle_expert_probes, "{model}/{name}");
            model_expert_probes += expert_probes;
        }
        assert!(
            model_expert_probes > 0,
            "{model}: no expert or router probe was checked"
        );
    }
}

#[test]
fn expert_and_router_probes_match_the_peft_oracle_on_cpu() {
    run(&Device::cpu());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn expert_and_router_probes_match_the_peft_oracle_on_cuda() {
    if let Some(device) = cuda_or_skip("expert_and_router_probes_match_the_peft_oracle_on_cuda") {
        run(&device);
    }
}
