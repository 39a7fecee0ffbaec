//! DoRA through the pool against PEFT: a pool built for DoRA refuses a DoRA
//! adapter until the engine gives it the base weights
//! (`REJECT[dora-needs-base-weights]`, nothing written), then serves it in
//! one mixed batch with a plain LoRA adapter and base rows — decode, mixed
//! prefill and one-adapter prefill — equal to PEFT's module outputs (the
//! fixtures' module-output probes; qwen2's q/k/v carry a bias, which must
//! stay outside the rescale), leaves plain and base rows as a plain pool
//! would, and a swap or eviction clears the slot's rescale.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use half::bf16;
use lora_audit::{AuditError, ProbeBase, ProbeInputs, RejectCode, WeightRef, parse_weight_name, read_probe_inputs};
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::{LoraModule, ModelConfig};
use lora_pool::{
    BaseProjection, BaseWeights, BatchCapacity, FusedTargets, LoraOptions, LoraPool, PoolError, PrefillSeq, SlotId,
    StepRow,
};

use common::{fixtures, model_config, rel_error};

/// Base projections from a DoRA fixture's oracle.
struct OracleBase(HashMap<(usize, LoraModule), ProbeBase>);

impl BaseWeights for OracleBase {
    fn projection(&self, layer: usize, module: LoraModule) -> Option<BaseProjection<'_>> {
        self.0.get(&(layer, module)).map(|b| BaseProjection {
            weight: &b.weight.data,
            bias: b.bias.as_ref().map(|t| t.data.as_slice()),
        })
    }
}

/// One probe: (layer, module), x `[n, in]`, W, b, PEFT's answer `[n, out]`.
struct Probe {
    layer: usize,
    module: LoraModule,
    x: Vec<f32>,
    n: usize,
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    want: Vec<f32>,
}

fn probes(cfg: &ModelConfig, model: &str, adapter: &str) -> (Vec<Probe>, OracleBase) {
    let path = fixtures().join(model).join(adapter).join("oracle.safetensors");
    let inputs: ProbeInputs = read_probe_inputs(&path).unwrap();
    let oracle = lora_audit::read_oracle(&path).unwrap();
    let mut out = Vec::new();
    let mut base = HashMap::new();
    for (name, x) in &inputs.inputs {
        let WeightRef::Dense { layer, module } = parse_weight_name(name, cfg).unwrap() else {
            panic!("{name}: not a dense projection");
        };
        let pb = &inputs.base[name];
        let b = pb.bias.as_ref().map(|t| t.data.clone());
        base.insert((layer, module), pb.clone());
        out.push(Probe {
            layer,
            module,
            x: x.data.clone(),
            n: x.shape[0],
            w: pb.weight.data.clone(),
            b,
            want: oracle.expected[&format!("probe_out::{name}")].data.clone(),
        });
    }
    (out, OracleBase(base))
}

/// `W x + b` per row, f32: the base projection's output.
fn base_out(p: &Probe, x: &[f32], out: usize, inp: usize) -> Vec<f32> {
    let rows = x.len() / inp;
    let mut y = vec![0f32; rows * out];
    for r in 0..rows {
        for o in 0..out {
            let wx: f32 = (0..inp).map(|i| p.w[o * inp + i] * x[r * inp + i]).sum();
            y[r * out + o] = wx + p.b.as_ref().map_or(0.0, |b| b[o]);
        }
    }
    y
}

/// One apply call of a pool over uploaded x and y.
type Apply<'a> = dyn Fn(&LoraPool, Rows<'_, bf16>, RowsMut<'_, f32>) + 'a;

/// Which rows a batch holds: DoRA, plain LoRA, base.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Dora,
    Plain,
    Base,
}

/// Check a batch's output: DoRA rows equal PEFT, base rows untouched,
/// plain rows equal a plain pool's.
fn check_rows(label: &str, p: &Probe, kinds: &[(Kind, usize)], y0: &[f32], y: &[f32], plain: &[f32], out: usize) {
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for (r, &(kind, probe_row)) in kinds.iter().enumerate() {
        let row = |v: &[f32]| v[r * out..(r + 1) * out].to_vec();
        match kind {
            Kind::Dora => {
                got.extend(row(y).iter().zip(row(y0)).map(|(y, y0)| y - y0));
                want.extend_from_slice(&p.want[probe_row * out..(probe_row + 1) * out]);
            }
            Kind::Base => assert_eq!(row(y), row(y0), "{label}: base row {r} changed"),
            Kind::Plain => assert_eq!(row(y), row(plain), "{label}: plain row {r} differs from a plain pool's"),
        }
    }
    let err = rel_error(&got, &want);
    // x enters the delta in BF16 and A, B are served in BF16; W x is f32.
    assert!(err < 1e-2, "{label}: DoRA rows vs PEFT: relative error {err:.3e}");
}

fn opts(dora: bool) -> LoraOptions {
    LoraOptions {
        max_loras: 3,
        max_rank: 16,
        rotatable: true,
        dora,
        ..LoraOptions::default()
    }
}

fn refused_code(err: &PoolError) -> Vec<RejectCode> {
    match err {
        PoolError::Audit { source, .. } => match source.as_ref() {
            AuditError::Refused(report) => report.refused_codes().into_iter().collect(),
            other => panic!("not a refusal: {other}"),
        },
        other => panic!("not a refusal: {other}"),
    }
}

/// The DoRA fixture `adapter` of `model` served beside plain adapter
/// `plain` (whose pairs need not touch the probed projections).
fn serve_against_peft(device: &Device, model: &str, adapter: &str, plain: &str) {
    let cfg = model_config(model);
    let (probes, base) = probes(&cfg, model, adapter);
    let dir = fixtures().join(model).join(adapter);
    let plain_dir = fixtures().join(model).join(plain);
    let capacity = BatchCapacity {
        max_rows: 64,
        max_segments: 16,
    };
    let mut pool = LoraPool::new(device, cfg.clone(), opts(true), capacity).unwrap();
    // A pool not built for DoRA takes no base weights and refuses the adapter.
    let mut plain_pool = LoraPool::new(device, cfg.clone(), opts(false), capacity).unwrap();
    let err = plain_pool.swap_from_disk(SlotId::new(0), "d", &dir).unwrap_err();
    assert_eq!(refused_code(&err), vec![RejectCode::Dora], "{err}");
    assert!(matches!(
        plain_pool.set_base_weights(Arc::new(OracleBase(HashMap::new()))),
        Err(PoolError::DoraDisabled)
    ));
    // Without base weights: refused with the code that says so, nothing written.
    let err = pool.swap_from_disk(SlotId::new(0), "d", &dir).unwrap_err();
    assert_eq!(refused_code(&err), vec![RejectCode::DoraNeedsBaseWeights], "{err}");
    assert!(pool.slot_of("d").is_none());
    pool.set_base_weights(Arc::new(base)).unwrap();
    // The swap in two halves (the slot bytes on the copy lane): the rescale
    // is staged with the adapter and written by the second half; new base
    // weights are refused in between.
    pool.begin_swap(SlotId::new(0), "d", &dir).unwrap();
    assert_eq!(pool.dora_pairs(SlotId::new(0)), 0);
    assert!(matches!(
        pool.set_base_weights(Arc::new(OracleBase(HashMap::new()))),
        Err(PoolError::SwapPending { .. })
    ));
    let report = pool.finish_swap().unwrap();
    assert_eq!(report.dora_pairs, probes.len());
    assert_eq!(pool.dora_pairs(SlotId::new(0)), probes.len());
    // New base weights while a slot serves a rescale from these: refused.
    assert!(matches!(
        pool.set_base_weights(Arc::new(OracleBase(HashMap::new()))),
        Err(PoolError::BaseWeightsInUse { dora_slots: 1 })
    ));
    pool.swap_from_disk(SlotId::new(1), "p", &plain_dir).unwrap();
    plain_pool.swap_from_disk(SlotId::new(1), "p", &plain_dir).unwrap();
    let (d, p) = (pool.acquire("d").unwrap(), pool.acquire("p").unwrap());
    let p_plain = plain_pool.acquire("p").unwrap();
    for probe in &probes {
        let (out, inp) = probe.module.dims(&cfg);
        let targets = FusedTargets::single(&cfg, probe.module);
        // Interleaved rows: DoRA, plain, base, each over every probe row.
        let kinds: Vec<(Kind, usize)> = (0..3 * probe.n)
            .map(|r| ([Kind::Dora, Kind::Plain, Kind::Base][r % 3], r / 3))
            .collect();
        let x: Vec<f32> = kinds
            .iter()
            .flat_map(|&(_, i)| probe.x[i * inp..(i + 1) * inp].to_vec())
            .collect();
        let x_bf: Vec<bf16> = x.iter().map(|v| bf16::from_f32(*v)).collect();
        let y0 = base_out(probe, &x, out, inp);
        let label = format!("{model}/{adapter} layer {} {}", probe.layer, probe.module);
        let row_of = |k: Kind, plain_lease| match k {
            Kind::Dora => StepRow::Adapter(&d),
            Kind::Plain => StepRow::Adapter(plain_lease),
            Kind::Base => StepRow::Base,
        };
        let run = |pool: &LoraPool, f: &Apply<'_>| {
            let xb = device.upload(&x_bf).unwrap();
            let mut yb = device.upload(&y0).unwrap();
            f(
                pool,
                Rows::dense(&xb, kinds.len(), inp),
                RowsMut::dense(&mut yb, kinds.len(), out),
            );
            device.synchronize().unwrap();
            device.check_faults().unwrap();
            yb.download().unwrap()
        };
        // Decode: one mixed batch.
        let rows: Vec<StepRow<'_>> = kinds.iter().map(|&(k, _)| row_of(k, &p)).collect();
        let step = pool.decode_step(&rows, kinds.len()).unwrap();
        let y = run(&pool, &|pool, x, y| {
            pool.apply_decode(&step, probe.layer, &targets, x, y).unwrap()
        });
        let plain_rows: Vec<StepRow<'_>> = kinds
            .iter()
            .map(|&(k, _)| {
                if k == Kind::Plain {
                    StepRow::Adapter(&p_plain)
                } else {
                    StepRow::Base
                }
            })
            .collect();
        let plain_step = plain_pool.decode_step(&plain_rows, kinds.len()).unwrap();
        let y_plain = run(&plain_pool, &|pool, x, y| {
            pool.apply_decode(&plain_step, probe.layer, &targets, x, y).unwrap()
        });
        check_rows(&format!("{label} decode"), probe, &kinds, &y0, &y, &y_plain, out);
        drop(step);
        // Mixed prefill: one segment per row (the same mix, as sequences).
        let seqs: Vec<PrefillSeq<'_>> = kinds
            .iter()
            .map(|&(k, _)| PrefillSeq {
                row: row_of(k, &p),
                len: 1,
            })
            .collect();
        let step = pool.prefill_step(&seqs).unwrap();
        let y = run(&pool, &|pool, x, y| {
            pool.apply_prefill(&step, probe.layer, &targets, x, y).unwrap()
        });
        // The plain pool's rows through the same apply (a decode and a
        // prefill kernel sum in different orders, so their plain rows may
        // differ in the last bits on CUDA).
        let plain_seqs: Vec<PrefillSeq<'_>> = plain_rows.iter().map(|&row| PrefillSeq { row, len: 1 }).collect();
        let plain_step = plain_pool.prefill_step(&plain_seqs).unwrap();
        let y_plain = run(&plain_pool, &|pool, x, y| {
            pool.apply_prefill(&plain_step, probe.layer, &targets, x, y).unwrap()
        });
        check_rows(&format!("{label} prefill"), probe, &kinds, &y0, &y, &y_plain, out);
        drop(step);
        // One-adapter prefill: the DoRA rows alone.
        let dora_kinds: Vec<(Kind, usize)> = (0..probe.n).map(|i| (Kind::Dora, i)).collect();
        let xd: Vec<bf16> = probe.x.iter().map(|v| bf16::from_f32(*v)).collect();
        let yd0 = base_out(probe, &probe.x, out, inp);
        let step = pool
            .prefill_step(&[PrefillSeq {
                row: StepRow::Adapter(&d),
                len: probe.n,
            }])
            .unwrap();
        let xb = device.upload(&xd).unwrap();
        let mut yb = device.upload(&yd0).unwrap();
        pool.apply_one_adapter(
            &step,
            probe.layer,
            &targets,
            Rows::dense(&xb, probe.n, inp),
            RowsMut::dense(&mut yb, probe.n, out),
        )
        .unwrap();
        let y = yb.download().unwrap();
        check_rows(&format!("{label} one adapter"), probe, &dora_kinds, &yd0, &y, &[], out);
    }
    drop((d, p));
    // A swap to a plain adapter clears the slot's rescale; so does eviction.
    let report = pool.swap_from_disk(SlotId::new(2), "d2", &dir).unwrap();
    assert_eq!(report.dora_pairs, probes.len());
    pool.evict(SlotId::new(2)).unwrap();
    assert_eq!(pool.dora_pairs(SlotId::new(2)), 0);
    let report = pool.swap_from_disk(SlotId::new(0), "p2", &plain_dir).unwrap();
    assert_eq!((report.dora_pairs, pool.dora_pairs(SlotId::new(0))), (0, 0));
}

#[test]
fn dora_adapters_serve_in_mixed_batches_equal_to_peft() {
    let cpu = Device::cpu();
    serve_against_peft(&cpu, "llama", "dora", "demo_r4_plain");
    serve_against_peft(&cpu, "llama", "dora_rslora_alpha_pattern", "demo_r8_rslora");
    serve_against_peft(&cpu, "qwen2", "dora_bias_qkv", "bias_none_attention");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_dora_adapters_serve_in_mixed_batches_equal_to_peft() {
    let Some(gpu) = lora_kernels::testing::cuda_or_skip("gpu_dora_adapters_serve_in_mixed_batches_equal_to_peft")
    else {
        return;
    };
    serve_against_peft(&gpu, "llama", "dora", "demo_r4_plain");
    serve_against_peft(&gpu, "llama", "dora_rslora_alpha_pattern", "demo_r8_rslora");
    serve_against_peft(&gpu, "qwen2", "dora_bias_qkv", "bias_none_attention");
}

/// A DoRA adapter through the host tier: the tier keeps its packed pairs
/// and magnitudes, and a promotion from it computes the rescale from the
/// pool's base weights there, so the slot (pair bytes and every row's `g`)
/// equals a disk swap's bit for bit. Without the base weights the
/// promotion is refused `REJECT[dora-needs-base-weights]` and changes
/// nothing, as a disk swap is.
#[test]
fn dora_adapters_promoted_from_the_host_tier_equal_a_disk_swap() {
    dora_through_the_host_tier_equals_a_disk_swap(&Device::cpu());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_dora_adapters_promoted_from_the_host_tier_equal_a_disk_swap() {
    let Some(gpu) =
        lora_kernels::testing::cuda_or_skip("gpu_dora_adapters_promoted_from_the_host_tier_equal_a_disk_swap")
    else {
        return;
    };
    dora_through_the_host_tier_equals_a_disk_swap(&gpu);
}

fn dora_through_the_host_tier_equals_a_disk_swap(device: &Device) {
    for (model, adapter) in [
        ("llama", "dora"),
        ("llama", "dora_rslora_alpha_pattern"),
        ("qwen2", "dora_bias_qkv"),
    ] {
        let cfg = model_config(model);
        let (_, base) = probes(&cfg, model, adapter);
        let base: Arc<dyn BaseWeights> = Arc::new(base);
        let dir = fixtures().join(model).join(adapter);
        let mut disk = LoraPool::new(device, cfg.clone(), opts(true), BatchCapacity::default()).unwrap();
        disk.set_base_weights(Arc::clone(&base)).unwrap();
        let from_disk = disk.swap_from_disk(SlotId::new(1), "d", &dir).unwrap();
        assert!(from_disk.dora_pairs > 0, "{model}/{adapter}");

        let tiered = LoraOptions {
            host_tier_bytes: 1 << 26,
            ..opts(true)
        };
        let mut pool = LoraPool::new(device, cfg.clone(), tiered, BatchCapacity::default()).unwrap();
        pool.prefetch("d", &dir).unwrap();
        pool.wait_for_prefetch();
        let events = pool.prefetch_events();
        assert!(
            matches!(&events[..], [e] if e.outcome.is_ok()),
            "{model}/{adapter}: {events:?}"
        );
        assert_eq!(pool.host_tier().unwrap().names, ["d"]);
        // No base weights yet: refused as a disk swap is, nothing written.
        let before = pool.slot_contents(SlotId::new(1)).unwrap();
        let err = pool.swap_from_disk(SlotId::new(1), "d", &dir).unwrap_err();
        assert_eq!(refused_code(&err), [RejectCode::DoraNeedsBaseWeights], "{err}");
        assert_eq!(pool.slot_contents(SlotId::new(1)).unwrap(), before);
        assert!(pool.slot_of("d").is_none());

        pool.set_base_weights(Arc::clone(&base)).unwrap();
        let promoted = pool.swap_from_disk(SlotId::new(1), "d", &dir).unwrap();
        assert_eq!(promoted.route, lora_pool::SwapRoute::HostTier, "{model}/{adapter}");
        assert_eq!(promoted.dora_pairs, from_disk.dora_pairs);
        assert_eq!(
            pool.slot_contents(SlotId::new(1)).unwrap(),
            disk.slot_contents(SlotId::new(1)).unwrap(),
            "{model}/{adapter}: slot bytes"
        );
        let (tier_g, disk_g) = (
            pool.dora_scales(SlotId::new(1)).unwrap(),
            disk.dora_scales(SlotId::new(1)).unwrap(),
        );
        assert_eq!(tier_g.len(), from_disk.dora_pairs);
        for ((l0, m0, g0), (l1, m1, g1)) in tier_g.iter().zip(&disk_g) {
            assert_eq!((l0, m0), (l1, m1));
            let bits = |g: &[f32]| g.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(g0), bits(g1), "{model}/{adapter}: g of layer {l0} {m0}");
        }
        for m in LoraModule::ALL {
            for layer in 0..cfg.num_hidden_layers {
                assert_eq!(
                    pool.entry(layer, m, SlotId::new(1))
                        .map(|e| (e.rank, e.scale.to_bits())),
                    disk.entry(layer, m, SlotId::new(1))
                        .map(|e| (e.rank, e.scale.to_bits())),
                );
            }
        }
    }
}

/// DoRA on a tensor- or expert-parallel rank's pool is refused by type
/// (the rescale's row norm spans every input column, which a row-parallel
/// rank does not hold); the same placement without DoRA, and DoRA beside
/// the embedding place, build.
#[test]
fn dora_is_refused_on_a_placed_pool() {
    let cfg = model_config("llama");
    let tp = lora_layout::Placement::new(1, 2).unwrap();
    let ep = lora_layout::Placement::SINGLE.with_experts(0, 2).unwrap();
    for (placement, want) in [(tp, (2, 1)), (ep, (1, 2))] {
        let placed = LoraOptions {
            placement,
            ..opts(true)
        };
        match LoraPool::new(&Device::cpu(), cfg.clone(), placed.clone(), BatchCapacity::default()) {
            Err(PoolError::DoraPlaced { tp_world, ep_world }) => assert_eq!((tp_world, ep_world), want),
            Err(other) => panic!("{placement:?}: {other}"),
            Ok(_) => panic!("{placement:?}: a placed DoRA pool was built"),
        }
        let plain = LoraOptions { dora: false, ..placed };
        LoraPool::new(&Device::cpu(), cfg.clone(), plain, BatchCapacity::default()).unwrap();
    }
    let both = LoraOptions {
        embedding_lora: true,
        ..opts(true)
    };
    let pool = LoraPool::new(&Device::cpu(), cfg, both, BatchCapacity::default()).unwrap();
    assert!(pool.layout().embedding().is_some());
}

/// The probe of (layer, module) among a fixture's probes.
fn probe_of(probes: Vec<Probe>, layer: usize, module: LoraModule) -> Probe {
    probes
        .into_iter()
        .find(|p| (p.layer, p.module) == (layer, module))
        .unwrap()
}

/// A CUDA graph captured with a DoRA slot in its batch keeps serving after
/// swaps (the DoRA table, `g` and biases never move): a DoRA adapter
/// swapped for another DoRA adapter serves the new one's rescale, one
/// swapped for a plain adapter serves no rescale, each once a new step has
/// written its rows (GPU only; skipped without one).
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_a_graph_with_dora_slots_serves_swapped_adapters() {
    let Some(device) = lora_kernels::testing::cuda_or_skip("gpu_a_graph_with_dora_slots_serves_swapped_adapters")
    else {
        return;
    };
    let cfg = model_config("llama");
    let (layer, module) = (1, LoraModule::QProj);
    let (d_probes, OracleBase(mut base)) = probes(&cfg, "llama", "dora");
    let (e_probes, OracleBase(e_base)) = probes(&cfg, "llama", "dora_rslora_alpha_pattern");
    base.extend(e_base);
    let (d, e) = (probe_of(d_probes, layer, module), probe_of(e_probes, layer, module));
    let plain = lora_audit::read_oracle(&fixtures().join("llama/demo_r8_rslora/oracle.safetensors")).unwrap();
    let weight = "model.layers.1.self_attn.q_proj.weight";
    let (p_x, p_want) = (
        plain.inputs.inputs[weight].data.clone(),
        plain.expected[&format!("probe_out::{weight}")].data.clone(),
    );
    let dir = |a: &str| fixtures().join("llama").join(a);
    let mut pool = LoraPool::new(&device, cfg.clone(), opts(true), BatchCapacity::default()).unwrap();
    pool.set_base_weights(Arc::new(OracleBase(base))).unwrap();
    pool.swap_from_disk(SlotId::new(0), "d", &dir("dora")).unwrap();
    pool.swap_from_disk(SlotId::new(1), "p", &dir("demo_r8_rslora"))
        .unwrap();
    let (out, inp) = module.dims(&cfg);
    let n = 8;
    let to_bf = |v: &[f32]| v.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<bf16>>();
    // Rows 0..4: slot 0 on the DoRA probe's x from its base output; rows 4..8:
    // slot 1 (plain) from zeros, so they hold its delta.
    let inputs = |p: &Probe| {
        let y0 = [base_out(p, &p.x, out, inp), vec![0.0; 4 * out]].concat();
        ([to_bf(&p.x), to_bf(&p_x)].concat(), y0)
    };
    let (x0, y0) = inputs(&d);
    let mut x = device.upload(&x0).unwrap();
    let mut y = device.upload(&y0).unwrap();
    let target = FusedTargets::single(&cfg, module);
    let (lease_d, lease_p) = (pool.acquire("d").unwrap(), pool.acquire("p").unwrap());
    let rows = [[StepRow::Adapter(&lease_d); 4], [StepRow::Adapter(&lease_p); 4]].concat();
    let step = pool.decode_step(&rows, n).unwrap();
    let graph = {
        let (pool, step, x, y) = (&pool, &step, &x, &mut y);
        device
            .capture_graph(|| {
                pool.apply_decode(step, layer, &target, Rows::dense(x, n, inp), RowsMut::dense(y, n, out))
                    .map_err(|e| lora_kernels::KernelError::InvalidArgument {
                        arg: "pool",
                        reason: e.to_string(),
                    })
            })
            .unwrap()
    };
    let check = |y: &[f32], y0: &[f32], want: &[f32], label: &str| {
        let got: Vec<f32> = y[..4 * out].iter().zip(&y0[..4 * out]).map(|(a, b)| a - b).collect();
        let err = rel_error(&got, want);
        assert!(err < 1e-2, "{label}: slot 0 rows: {err:.3e}");
        let err = rel_error(&y[4 * out..], &p_want);
        assert!(err < 1e-2, "{label}: plain rows: {err:.3e}");
    };
    graph.replay().unwrap();
    device.check_faults().unwrap();
    check(&y.download().unwrap(), &y0, &d.want, "DoRA d");
    // Another DoRA adapter into slot 0, then a new step.
    let (pool_addr, table_addr) = (pool.pool_addr(), pool.table().device_addr());
    drop((step, lease_d));
    pool.swap_from_disk(SlotId::new(0), "e", &dir("dora_rslora_alpha_pattern"))
        .unwrap();
    assert_eq!((pool.pool_addr(), pool.table().device_addr()), (pool_addr, table_addr));
    let lease_e = pool.acquire("e").unwrap();
    let rows = [[StepRow::Adapter(&lease_e); 4], [StepRow::Adapter(&lease_p); 4]].concat();
    let step = pool.decode_step(&rows, n).unwrap();
    let (x1, y1) = inputs(&e);
    x.write(0, &x1).unwrap();
    y.write(0, &y1).unwrap();
    graph.replay().unwrap();
    device.check_faults().unwrap();
    check(&y.download().unwrap(), &y1, &e.want, "DoRA e after the swap");
    // A plain adapter into slot 0: its rows get no rescale.
    drop((step, lease_e));
    pool.swap_from_disk(SlotId::new(0), "p2", &dir("demo_r8_rslora"))
        .unwrap();
    assert_eq!(pool.dora_pairs(SlotId::new(0)), 0);
    let lease_p2 = pool.acquire("p2").unwrap();
    let rows = [[StepRow::Adapter(&lease_p2); 4], [StepRow::Adapter(&lease_p); 4]].concat();
    let _step = pool.decode_step(&rows, n).unwrap();
    x.write(0, &[to_bf(&p_x), to_bf(&p_x)].concat()).unwrap();
    let zeros = vec![0.0f32; n * out];
    y.write(0, &zeros).unwrap();
    graph.replay().unwrap();
    device.check_faults().unwrap();
    check(&y.download().unwrap(), &zeros, &p_want, "plain p2 after the swap");
}
