//! The peer in its own process (`lora-peer serve` on loopback), the engine
//! landing over TCP: three real PEFT fixture adapters land as the disk path
//! packs them, byte for byte; published into a CPU pool they serve a mixed
//! decode batch exactly as the same adapters loaded from disk, and as PEFT's
//! own merged weights say.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use common::{PeerProcess, disk_pool, fixtures, model_config, packed_from_disk};
use half::bf16;
use lora_audit::{Oracle, WeightRef, parse_weight_name, read_oracle};
use lora_kernels::testing::{Rng, rel_error};
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::{LoraModule, ModelConfig};
use lora_pool::{BatchCapacity, FusedTargets, LoraOptions, LoraPool, SlotLease, StepRow};
use lora_rdma::land::{HostLanding, Lander};
use lora_rdma::swap::promote_from_peer;
use lora_rdma::tcp::{TcpOptions, TcpTransport};

const MODEL: &str = "llama";
const ADAPTERS: [&str; 3] = ["demo_r4_plain", "demo_r8_rslora", "demo_r16_alpha_pattern"];

fn options() -> LoraOptions {
    LoraOptions {
        max_loras: 4,
        max_rank: 16,
        rotatable: true,
        ..LoraOptions::default()
    }
}

/// Land every adapter from the peer process into fresh images, check them
/// against the disk pack, and publish them into an empty pool.
fn peer_pool(peer: &PeerProcess) -> LoraPool {
    let lander = Lander::new(model_config(MODEL), options()).unwrap();
    let mut transport = TcpTransport::connect(&peer.addr, TcpOptions::default()).unwrap();
    let mut pool = LoraPool::new(&Device::cpu(), model_config(MODEL), options(), BatchCapacity::default()).unwrap();
    for adapter in ADAPTERS {
        let mut target = HostLanding::new(lander.layout());
        let landed = lander.land(&mut transport, adapter, &mut target).unwrap();
        let (dense, experts) = packed_from_disk(MODEL, adapter, &options());
        assert_eq!(target.dense().as_bytes(), dense.as_bytes(), "{adapter}: landed bytes");
        assert_eq!(target.dense().pairs(), dense.pairs(), "{adapter}: ranks and scales");
        assert!(landed.experts.is_empty() && experts.as_bytes().is_empty());
        assert!(landed.bytes > 0);
        let victim = pool.pick_victim(adapter).unwrap();
        let (dense, experts) = target.into_images();
        pool.publish_landed(victim, adapter, landed.into_images(dense, experts))
            .unwrap();
    }
    pool
}

#[test]
fn three_adapters_land_from_a_peer_process_as_from_disk_and_serve_the_same_deltas() {
    let peer = PeerProcess::spawn(MODEL, &ADAPTERS, &[]);
    let mut landed = peer_pool(&peer);
    let names: Vec<(&str, &str)> = ADAPTERS.iter().map(|a| (*a, *a)).collect();
    let mut disk = disk_pool(MODEL, &names, options());
    let cfg = model_config(MODEL);
    for adapter in ADAPTERS {
        let (l, d) = (landed.slot_of(adapter).unwrap(), disk.slot_of(adapter).unwrap());
        assert_eq!(
            landed.slot_contents(l).unwrap(),
            disk.slot_contents(d).unwrap(),
            "{adapter}: slot bytes"
        );
        assert_eq!(
            landed.slots()[l.index()].pairs,
            disk.slots()[d.index()].pairs,
            "{adapter}: pairs"
        );
        for layer in 0..cfg.num_hidden_layers {
            for module in LoraModule::ALL {
                let (a, b) = (landed.entry(layer, module, l), disk.entry(layer, module, d));
                assert_eq!(
                    a.map(|e| (e.scale, e.rank)),
                    b.map(|e| (e.scale, e.rank)),
                    "{adapter} {layer} {module}"
                );
            }
        }
    }
    mixed_decode_matches(&mut landed, &mut disk, &cfg);
}

/// Every dense weight any adapter changes, with its (layer, module).
fn weights(cfg: &ModelConfig, oracles: &[Oracle]) -> Vec<(String, usize, LoraModule)> {
    let names: BTreeSet<&String> = oracles.iter().flat_map(|o| o.inputs.inputs.keys()).collect();
    names
        .into_iter()
        .map(|w| match parse_weight_name(w, cfg).unwrap() {
            WeightRef::Dense { layer, module } => (w.clone(), layer, module),
            other => panic!("{w}: unexpected {other:?}"),
        })
        .collect()
}

/// One decode apply of `layer`'s `module` on `pool`: row `r` holds a lease
/// on adapter `rows_of[r]` (or runs the base model). Returns y.
#[allow(clippy::too_many_arguments)]
fn decode(
    pool: &mut LoraPool,
    rows_of: &[Option<usize>],
    layer: usize,
    module: LoraModule,
    x: &[f32],
    y0: &[f32],
    (out_dim, in_dim): (usize, usize),
) -> Vec<f32> {
    let device = pool.device().clone();
    let n = rows_of.len();
    let leases: Vec<SlotLease> = ADAPTERS.iter().map(|a| pool.acquire(a).unwrap()).collect();
    let rows: Vec<StepRow<'_>> = rows_of
        .iter()
        .map(|r| r.map_or(StepRow::Base, |i| StepRow::Adapter(&leases[i])))
        .collect();
    let step = pool.decode_step(&rows, n).unwrap();
    let xb = device
        .upload(&x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>())
        .unwrap();
    let mut yb = device.upload(y0).unwrap();
    let target = FusedTargets::single(pool.config(), module);
    pool.apply_decode(
        &step,
        layer,
        &target,
        Rows::dense(&xb, n, in_dim),
        RowsMut::dense(&mut yb, n, out_dim),
    )
    .unwrap();
    device.check_faults().unwrap();
    yb.download().unwrap()
}

/// For every adapted weight, one decode batch mixing 4 rows per adapter (its
/// PEFT probe rows, or random rows where it leaves the weight alone) and 3
/// base-model rows, run on both pools: the outputs must be bit-identical,
/// and each adapter's rows must match PEFT's merged-weight oracle.
fn mixed_decode_matches(landed: &mut LoraPool, disk: &mut LoraPool, cfg: &ModelConfig) {
    let oracles: Vec<Oracle> = ADAPTERS
        .iter()
        .map(|a| read_oracle(&fixtures().join(MODEL).join(a).join("oracle.safetensors")).unwrap())
        .collect();
    let mut rng = Rng::fresh("lora-rdma peer_process");
    let weights = weights(cfg, &oracles);
    assert!(!weights.is_empty());
    for (w, layer, module) in weights {
        let (out_dim, in_dim) = module.dims(cfg);
        let mut x = Vec::new();
        let mut expected = Vec::new();
        let mut rows_of = Vec::new();
        for (i, o) in oracles.iter().enumerate() {
            match (o.inputs.inputs.get(&w), o.expected.get(&format!("probe_out::{w}"))) {
                (Some(pin), Some(pout)) => {
                    x.extend_from_slice(&pin.data);
                    expected.extend((0..4).map(|r| Some(pout.data[r * out_dim..(r + 1) * out_dim].to_vec())));
                }
                _ => {
                    x.extend((0..4 * in_dim).map(|_| rng.uniform() * 2.0 - 1.0));
                    expected.extend(std::iter::repeat_n(None, 4));
                }
            }
            rows_of.extend([Some(i); 4]);
        }
        x.extend((0..3 * in_dim).map(|_| rng.uniform() * 2.0 - 1.0));
        expected.extend(std::iter::repeat_n(None, 3));
        rows_of.extend([None; 3]);
        let y0: Vec<f32> = (0..rows_of.len() * out_dim).map(|_| rng.uniform() - 0.5).collect();
        let y = decode(landed, &rows_of, layer, module, &x, &y0, (out_dim, in_dim));
        let y_disk = decode(disk, &rows_of, layer, module, &x, &y0, (out_dim, in_dim));
        assert_eq!(y, y_disk, "{w}: the landed and the disk pool differ");
        for (r, want) in expected.iter().enumerate() {
            let delta: Vec<f32> = (0..out_dim).map(|c| y[r * out_dim + c] - y0[r * out_dim + c]).collect();
            match want {
                Some(reference) => {
                    let err = rel_error(&delta, reference);
                    assert!(err < 1e-2, "{w} row {r}: relative error {err} against PEFT");
                }
                None => assert!(delta.iter().all(|d| *d == 0.0), "{w} row {r} must be untouched"),
            }
        }
    }
}

/// Routed-expert and router pairs travel too: an MoE adapter promoted from
/// the peer process into a CPU pool with an expert pool holds the same
/// dense and expert slot bytes and table entries as the same adapter loaded
/// from disk.
#[test]
fn an_expert_adapter_promoted_from_the_peer_matches_the_disk_load() {
    const MOE: &str = "qwen3_moe";
    const ADAPTER: &str = "experts_fused_router";
    let (_, expert_image) = packed_from_disk(MOE, ADAPTER, &moe_options(None));
    let opts = moe_options(Some(expert_image.as_bytes().len()));
    let disk = disk_pool(MOE, &[(ADAPTER, ADAPTER)], opts.clone());
    let peer = PeerProcess::spawn(MOE, &[ADAPTER], &[]);
    let mut pool = LoraPool::new(&Device::cpu(), model_config(MOE), opts, BatchCapacity::default()).unwrap();
    let mut transport = TcpTransport::connect(&peer.addr, TcpOptions::default()).unwrap();
    let lease = promote_from_peer(&mut pool, &mut transport, ADAPTER).unwrap();
    let (l, d) = (lease.slot(), disk.slot_of(ADAPTER).unwrap());
    assert_eq!(pool.slot_contents(l).unwrap(), disk.slot_contents(d).unwrap());
    let (pe, de) = (pool.experts().unwrap(), disk.experts().unwrap());
    let (l, d) = (l.index(), d.index());
    assert_eq!(pe.slot_contents(l).unwrap(), de.slot_contents(d).unwrap());
    assert_eq!(pool.slots()[l].expert_pairs, disk.slots()[d].expert_pairs);
    assert!(!pool.slots()[l].expert_pairs.is_empty());
    for p in &pool.slots()[l].expert_pairs {
        let lora_layout::PairKey::Expert { layer, site } = p.key else {
            panic!()
        };
        let (a, b) = (pe.entry(layer, site, l).unwrap(), de.entry(layer, site, d).unwrap());
        assert_eq!((a.scale, a.rank), (b.scale, b.rank), "{}", p.key);
    }
}

fn moe_options(expert_slot_bytes: Option<usize>) -> LoraOptions {
    LoraOptions {
        max_loras: 2,
        max_rank: 16,
        experts: true,
        expert_slot_bytes,
        rotatable: true,
        ..LoraOptions::default()
    }
}
