//! Every swap route lands the same slot. For every rank of tensor- and
//! expert-parallel placements (tensor world 1, 2, 4; expert world 1, 2) on
//! dense and MoE fixtures, and for every rank of tensor worlds 2 and 4 under
//! the fully-sharded option, the vocab-parallel cut and both (dense,
//! embedding and head adapters), a peer landing over TCP of that rank's
//! manifest leaves the rank's pool exactly as the rank's disk swap of the
//! same adapter does: slot bytes, pair tables, expert slot and tables, and
//! the registry entry (so the adapter identity hash too). A manifest for
//! the same rank but another cut is refused and changes nothing. A DoRA adapter landed
//! from a peer equals its disk swap bit for bit, pair bytes and every
//! row's rescale `g`, and without the pool's base weights it is refused
//! `REJECT[dora-needs-base-weights]` with nothing changed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{fixtures, model_config, snapshot};
use lora_audit::{AuditError, LoraOptions, RejectCode};
use lora_kernels::Device;
use lora_layout::{ExpertSite, LoraModule, ModelConfig, Placement};
use lora_pool::{AdapterSlot, BaseProjection, BaseWeights, BatchCapacity, LoraPool, PoolError, SlotId};
use lora_rdma::land::{HostLanding, LandError};
use lora_rdma::manifest::{Manifest, ManifestError, WirePlacement};
use lora_rdma::peer::{Peer, PeerHandle, PeerOptions, PeerStore, StoreOptions};
use lora_rdma::protocol::TransportKind;
use lora_rdma::swap::{PeerSwapError, swap_from_peer};
use lora_rdma::tcp::{TcpOptions, TcpTransport};
use lora_rdma::transport::{LandingSink, ReadOp, Transport, TransportError};

/// What a swap leaves in one slot of a pool, addresses aside.
#[derive(Debug, PartialEq)]
struct SlotState {
    bytes: Vec<u16>,
    registry: AdapterSlot,
    adapter_id: u64,
    /// (rank, scale bits) of every dense table entry, in table order.
    entries: Vec<Option<(u32, u32)>>,
    expert_bytes: Option<Vec<u16>>,
    /// (rank, scale bits, whether A is set) of every expert-pool entry.
    expert_entries: Vec<Option<(u32, u32, bool)>>,
    dora: Vec<(usize, LoraModule, Vec<u32>)>,
}

/// `landed == disk`, naming the first field (and element) that differs.
fn assert_same(landed: &SlotState, disk: &SlotState, what: &str) {
    let first = |a: &[u16], b: &[u16]| a.iter().zip(b).position(|(x, y)| x != y);
    assert_eq!(landed.bytes.len(), disk.bytes.len(), "{what}: slot sizes");
    assert_eq!(first(&landed.bytes, &disk.bytes), None, "{what}: slot bytes");
    assert_eq!(landed.registry, disk.registry, "{what}: registry entry");
    assert_eq!(landed.adapter_id, disk.adapter_id, "{what}: identity hash");
    assert_eq!(landed.entries, disk.entries, "{what}: pair tables");
    match (&landed.expert_bytes, &disk.expert_bytes) {
        (Some(l), Some(d)) => {
            assert_eq!(l.len(), d.len(), "{what}: expert slot sizes");
            assert_eq!(first(l, d), None, "{what}: expert slot bytes");
        }
        (l, d) => assert_eq!(l.is_some(), d.is_some(), "{what}: expert pools"),
    }
    assert_eq!(landed.expert_entries, disk.expert_entries, "{what}: expert tables");
    assert_eq!(landed.dora, disk.dora, "{what}: DoRA rescales");
    assert_eq!(landed, disk, "{what}");
}

fn bits(v: &[half::bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn state(pool: &LoraPool, slot: SlotId) -> SlotState {
    let cfg = pool.config();
    let mut entries = Vec::new();
    for layer in 0..cfg.num_hidden_layers {
        for module in LoraModule::ALL {
            entries.push(pool.entry(layer, module, slot).map(|e| (e.rank, e.scale.to_bits())));
        }
    }
    entries.push(pool.embedding_entry(slot).map(|e| (e.rank, e.scale.to_bits())));
    entries.push(pool.lm_head_entry(slot).map(|e| (e.rank, e.scale.to_bits())));
    let mut expert_entries = Vec::new();
    if let (Some(experts), Some(moe)) = (pool.experts(), cfg.moe.as_ref()) {
        for layer in 0..cfg.num_hidden_layers {
            let sites = (0..moe.num_experts)
                .flat_map(|expert| {
                    lora_layout::ExpertProj::ALL
                        .into_iter()
                        .map(move |proj| ExpertSite::Expert { expert, proj })
                })
                .chain([ExpertSite::Router]);
            for site in sites {
                expert_entries.push(
                    experts
                        .entry(layer, site, slot.index())
                        .map(|e| (e.rank, e.scale.to_bits(), e.a != 0)),
                );
            }
        }
    }
    let registry = pool.slots()[slot.index()].clone();
    SlotState {
        bytes: bits(&pool.slot_contents(slot).unwrap()),
        adapter_id: registry.adapter_id(),
        registry,
        entries,
        expert_bytes: pool.experts().map(|e| bits(&e.slot_contents(slot.index()).unwrap())),
        expert_entries,
        dora: pool
            .dora_scales(slot)
            .unwrap()
            .into_iter()
            .map(|(l, m, g)| (l, m, g.iter().map(|v| v.to_bits()).collect()))
            .collect(),
    }
}

fn options(cfg: &ModelConfig, placement: Placement, dora: bool) -> LoraOptions {
    LoraOptions {
        max_loras: 2,
        max_rank: 16,
        expert_rank: 16,
        rotatable: true,
        experts: cfg.moe.is_some(),
        expert_slot_bytes: Some(4 << 20),
        embedding_lora: true,
        lm_head_lora: true,
        dora,
        placement,
        ..LoraOptions::default()
    }
}

/// An in-process peer serving `adapters` of fixture model `model`.
fn peer(model: &str, adapters: &[&str]) -> PeerHandle {
    let mut store = PeerStore::new(model_config(model), StoreOptions::default());
    for a in adapters {
        store
            .add_adapter(a, &fixtures().join(model).join(a))
            .unwrap_or_else(|r| panic!("{model}/{a}: {}", r.reason));
    }
    Peer::bind(store, "127.0.0.1:0", PeerOptions::default())
        .unwrap()
        .spawn()
        .unwrap()
}

/// Swap `adapter` into two fresh pools of `opts` on `device`, one from
/// disk and one from the peer, and return both slots' states.
fn both_routes(
    device: &Device,
    model: &str,
    adapter: &str,
    opts: &LoraOptions,
    peer: &PeerHandle,
    base: Option<Arc<dyn BaseWeights>>,
) -> (SlotState, SlotState) {
    let cfg = model_config(model);
    let pool = || {
        let mut pool = LoraPool::new(device, cfg.clone(), opts.clone(), BatchCapacity::default()).unwrap();
        if let Some(base) = &base {
            pool.set_base_weights(Arc::clone(base)).unwrap();
        }
        pool
    };
    let (mut disk, mut landed) = (pool(), pool());
    let victim = disk.pick_victim(adapter).unwrap();
    disk.swap_from_disk(victim, adapter, &fixtures().join(model).join(adapter))
        .unwrap_or_else(|e| panic!("{model}/{adapter} from disk: {e}"));
    let mut transport = TcpTransport::connect(&peer.addr().to_string(), TcpOptions::default()).unwrap();
    let mut target = HostLanding::new(landed.layout());
    let report = swap_from_peer(&mut landed, &mut transport, adapter, &mut target)
        .unwrap_or_else(|e| panic!("{model}/{adapter} from the peer: {e}"));
    assert_eq!(report.slot, victim, "{model}/{adapter}");
    (state(&disk, victim), state(&landed, victim))
}

/// The placements every rank of which is checked: tensor world 1, 2, 4
/// (with expert world 2 where the adapter has routed experts, which
/// tensor parallelism alone does not place) and expert world 2.
fn placements(moe: bool) -> Vec<Placement> {
    let worlds: &[(usize, usize)] = if moe {
        &[(1, 1), (1, 2), (2, 2), (4, 2)]
    } else {
        &[(1, 1), (2, 1), (4, 1)]
    };
    worlds
        .iter()
        .flat_map(|&(tp, ep)| {
            let first = Placement::new(0, tp).unwrap().with_experts(0, ep).unwrap();
            first.ranks().flat_map(|p| p.expert_ranks()).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn a_ranks_peer_landing_equals_its_disk_swap_for_every_rank_and_family() {
    let cases: &[(&str, &[&str])] = &[
        (
            "llama",
            &[
                "dense_all_linear_f32",
                "demo_r8_rslora",
                "embedding_lora_no_table",
                "lm_head_lora_no_table",
            ],
        ),
        ("qwen3_moe", &["experts_fused_router", "experts_fused_gate_up_only"]),
        ("mixtral", &["experts_fused_router", "experts_converted_from_w1_w2_w3"]),
        ("glm4_moe", &["all_linear", "experts_shared_dense_router"]),
        ("gpt_oss", &["experts_router_attention"]),
        ("deepseek_v3", &["mla_experts_router"]),
    ];
    let cpu = Device::cpu();
    for (model, adapters) in cases {
        let cfg = model_config(model);
        let peer = peer(model, adapters);
        let mut checked = 0;
        for placement in placements(cfg.moe.is_some()) {
            let opts = options(&cfg, placement, false);
            for adapter in *adapters {
                let (disk, landed) = both_routes(&cpu, model, adapter, &opts, &peer, None);
                assert!(disk.registry.is_filled(), "{model}/{adapter} {placement:?}");
                assert_same(&landed, &disk, &format!("{model}/{adapter} at {placement:?}"));
                checked += 1;
            }
        }
        assert!(checked >= adapters.len() * 3, "{model}: {checked}");
    }
}

/// The cut options checked on every rank of tensor worlds 2 and 4: the
/// fully-sharded option, the vocab-parallel cut, and both.
fn cut_placements() -> Vec<Placement> {
    let cuts = [(true, false), (false, true), (true, true)];
    [2, 4]
        .into_iter()
        .flat_map(|tp| {
            cuts.into_iter().flat_map(move |(fully_sharded, vocab_parallel)| {
                Placement::new(0, tp)
                    .unwrap()
                    .with_fully_sharded(fully_sharded)
                    .with_vocab_parallel(vocab_parallel)
                    .ranks()
            })
        })
        .collect()
}

/// Under the fully-sharded option, the vocab-parallel cut and both, every
/// rank of tensor worlds 2 and 4 lands from the peer exactly what its disk
/// swap packs: dense adapters of rank 8 (a fully-sharded rank past the
/// rank's rows holds none of a column-parallel A) and 16 (every rank's
/// block full), and embedding and head adapters (their pairs cut by
/// vocabulary under the vocab-parallel cut).
#[test]
fn a_ranks_peer_landing_equals_its_disk_swap_under_every_cut() {
    let model = "llama";
    let adapters = [
        "dense_all_linear_f32",
        "demo_r16_alpha_pattern",
        "embedding_lora_no_table",
        "lm_head_lora_no_table",
    ];
    let cfg = model_config(model);
    let peer = peer(model, &adapters);
    let cpu = Device::cpu();
    let placements = cut_placements();
    assert_eq!(placements.len(), 3 * (2 + 4));
    for placement in placements {
        let opts = options(&cfg, placement, false);
        for adapter in adapters {
            let (disk, landed) = both_routes(&cpu, model, adapter, &opts, &peer, None);
            assert!(disk.registry.is_filled(), "{model}/{adapter} {placement:?}");
            assert_same(&landed, &disk, &format!("{model}/{adapter} at {placement:?}"));
        }
    }
}

/// A transport that asks the peer for `placement` whatever the engine
/// asks for: a manifest of the engine's ranks staged for another cut.
struct OtherCut {
    inner: TcpTransport,
    placement: WirePlacement,
}

impl Transport for OtherCut {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn fetch_manifest(
        &mut self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        _: WirePlacement,
    ) -> Result<Manifest, TransportError> {
        self.inner
            .fetch_manifest(adapter, max_rank, expert_rank, self.placement)
    }

    fn read(&mut self, ops: &[ReadOp], sink: &mut dyn LandingSink) -> Result<(), TransportError> {
        self.inner.read(ops, sink)
    }
}

/// A manifest staged for the rank's own ranks but another cut (each of the
/// four cut combinations against each other) is refused
/// `PlacementMismatch` naming both, and the pool is unchanged.
#[test]
fn a_manifest_for_the_same_rank_but_another_cut_is_refused_and_changes_nothing() {
    let (model, adapter) = ("llama", "embedding_lora_no_table");
    let cfg = model_config(model);
    let peer = peer(model, &[adapter, "dense_all_linear_f32"]);
    let rank = Placement::new(1, 2).unwrap();
    let cuts: Vec<Placement> = [(false, false), (true, false), (false, true), (true, true)]
        .into_iter()
        .map(|(fs, vp)| rank.with_fully_sharded(fs).with_vocab_parallel(vp))
        .collect();
    for &engine in &cuts {
        for &staged in &cuts {
            if engine == staged {
                continue;
            }
            for adapter in [adapter, "dense_all_linear_f32"] {
                let mut pool = LoraPool::new(
                    &Device::cpu(),
                    cfg.clone(),
                    options(&cfg, engine, false),
                    BatchCapacity::default(),
                )
                .unwrap();
                let before = snapshot(&pool);
                let mut transport = OtherCut {
                    inner: TcpTransport::connect(&peer.addr().to_string(), TcpOptions::default()).unwrap(),
                    placement: WirePlacement::from_placement(staged),
                };
                let mut target = HostLanding::new(pool.layout());
                let err = swap_from_peer(&mut pool, &mut transport, adapter, &mut target).unwrap_err();
                assert!(
                    matches!(
                        &err,
                        PeerSwapError::Land(LandError::Manifest(ManifestError::PlacementMismatch { expected, got }))
                            if *expected == WirePlacement::from_placement(engine)
                                && *got == WirePlacement::from_placement(staged)
                    ),
                    "{adapter} {engine:?} <- {staged:?}: {err}"
                );
                assert_eq!(snapshot(&pool), before, "a refused landing changed the pool");
                assert!(target.dense().as_bytes().iter().all(|&b| b == 0));
            }
        }
    }
}

/// Base weights of every adapted projection, deterministic and nowhere
/// zero-normed (a DoRA rescale divides by each row's norm).
struct SyntheticBase(HashMap<(usize, LoraModule), (Vec<f32>, Vec<f32>)>);

impl SyntheticBase {
    fn new(cfg: &ModelConfig) -> SyntheticBase {
        let mut map = HashMap::new();
        for layer in 0..cfg.num_hidden_layers {
            for module in LoraModule::ALL {
                if !module.applies_to_layer(cfg, layer) {
                    continue;
                }
                let (out, inp) = module.dims(cfg);
                let seed = layer * 31 + module.index() * 7;
                let w = (0..out * inp)
                    .map(|i| (((i + seed) * 37 % 113) as f32 - 56.0) / 97.0 + 0.01)
                    .collect();
                let b = (0..out).map(|i| ((i + seed) % 5) as f32 / 10.0).collect();
                map.insert((layer, module), (w, b));
            }
        }
        SyntheticBase(map)
    }
}

impl BaseWeights for SyntheticBase {
    fn projection(&self, layer: usize, module: LoraModule) -> Option<BaseProjection<'_>> {
        self.0.get(&(layer, module)).map(|(w, b)| BaseProjection {
            weight: w,
            bias: Some(b),
        })
    }
}

const DORA: [(&str, &str); 3] = [
    ("llama", "dora"),
    ("llama", "dora_rslora_alpha_pattern"),
    ("qwen2", "dora_bias_qkv"),
];

#[test]
fn a_dora_adapter_landed_from_a_peer_equals_its_disk_swap() {
    dora_from_a_peer_equals_its_disk_swap(&Device::cpu());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_a_dora_adapter_landed_from_a_peer_equals_its_disk_swap() {
    let Some(gpu) = lora_kernels::testing::cuda_or_skip("gpu_a_dora_adapter_landed_from_a_peer_equals_its_disk_swap")
    else {
        return;
    };
    dora_from_a_peer_equals_its_disk_swap(&gpu);
}

fn dora_from_a_peer_equals_its_disk_swap(device: &Device) {
    for (model, adapter) in DORA {
        let cfg = model_config(model);
        let peer = peer(model, &[adapter]);
        let base: Arc<dyn BaseWeights> = Arc::new(SyntheticBase::new(&cfg));
        let opts = options(&cfg, Placement::SINGLE, true);
        let (disk, landed) = both_routes(device, model, adapter, &opts, &peer, Some(base));
        assert!(!disk.dora.is_empty(), "{model}/{adapter}");
        assert_same(&landed, &disk, &format!("{model}/{adapter}"));
    }
}

#[test]
fn a_dora_adapter_from_a_peer_without_base_weights_is_refused_and_changes_nothing() {
    let (model, adapter) = DORA[0];
    let cfg = model_config(model);
    let peer = peer(model, &[adapter]);
    let mut pool = LoraPool::new(
        &Device::cpu(),
        cfg.clone(),
        options(&cfg, Placement::SINGLE, true),
        BatchCapacity::default(),
    )
    .unwrap();
    let before = snapshot(&pool);
    let mut transport = TcpTransport::connect(&peer.addr().to_string(), TcpOptions::default()).unwrap();
    let mut target = HostLanding::new(pool.layout());
    let err = swap_from_peer(&mut pool, &mut transport, adapter, &mut target).unwrap_err();
    let codes = match &err {
        PeerSwapError::Pool(PoolError::Audit { source, .. }) => match source.as_ref() {
            AuditError::Refused(report) => report.refused_codes().into_iter().collect::<Vec<_>>(),
            other => panic!("{other}"),
        },
        other => panic!("{other}"),
    };
    assert_eq!(codes, [RejectCode::DoraNeedsBaseWeights], "{err}");
    assert_eq!(snapshot(&pool), before, "a refused landing changed the pool");
    assert_eq!(pool.dora_pairs(SlotId::new(0)), 0);
}
