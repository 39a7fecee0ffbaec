use lora_audit::{LoadedSafetensors, LoraOptions};
use lora_layout::LoraModule;

use super::*;
use crate::manifest::{ManifestEntry, WireKey, WirePlacement};
use crate::peer::{PeerStore, StoreOptions};
use crate::protocol::{ReadRange, TransportKind};
use crate::test_support::{config, disk_images, fixture, opts};

fn store(model: &str, adapters: &[&str], options: StoreOptions) -> PeerStore {
    let mut store = PeerStore::new(config(model), options);
    for a in adapters {
        store.add_adapter(a, &fixture(model).join(a)).unwrap();
    }
    store
}

type Tamper<'a> = Box<dyn Fn(&mut Manifest) + 'a>;
type Poison<'a> = Box<dyn Fn(&mut [u8]) + 'a>;

/// A transport straight onto a [`PeerStore`], with optional tampering.
struct MemTransport<'a> {
    store: &'a PeerStore,
    /// Rewrites the manifest after the peer built it.
    tamper: Option<Tamper<'a>>,
    /// Rewrites the bytes of one op after they landed.
    poison: Option<(usize, Poison<'a>)>,
    /// Fails with a lost connection before op `n`.
    fail_before: Option<usize>,
    /// Tells the sink each op landed (as the TCP transport does), so the
    /// lander checks it during the read.
    announce: bool,
    /// After every op landed (and was announced), asks for op `n`'s region
    /// again and flips its first byte, without announcing it.
    rewrite_after: Option<usize>,
}

impl<'a> MemTransport<'a> {
    fn new(store: &'a PeerStore) -> MemTransport<'a> {
        MemTransport {
            store,
            tamper: None,
            poison: None,
            fail_before: None,
            announce: false,
            rewrite_after: None,
        }
    }

    fn announcing(store: &'a PeerStore) -> MemTransport<'a> {
        MemTransport {
            announce: true,
            ..MemTransport::new(store)
        }
    }
}

impl Transport for MemTransport<'_> {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn fetch_manifest(
        &mut self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        placement: WirePlacement,
    ) -> Result<Manifest, TransportError> {
        let mut m = self
            .store
            .manifest(adapter, max_rank, expert_rank, placement, TransportKind::Tcp)
            .map_err(TransportError::Refused)?;
        if let Some(t) = &self.tamper {
            t(&mut m);
        }
        Ok(m)
    }

    fn read(&mut self, ops: &[ReadOp], sink: &mut dyn LandingSink) -> Result<(), TransportError> {
        for (i, op) in ops.iter().enumerate() {
            if self.fail_before == Some(i) {
                return Err(TransportError::Disconnected(std::io::ErrorKind::ConnectionReset.into()));
            }
            let Location::Tcp { region, offset } = op.location else {
                panic!("TCP locations only");
            };
            let range = ReadRange {
                region,
                offset,
                len: op.len as u64,
            };
            let resolved = self.store.resolve(&[range]).map_err(TransportError::Refused)?;
            let (staged, bytes) = &resolved[0];
            let dst = sink.region(i)?;
            dst.copy_from_slice(&staged.memory.bytes()[bytes.clone()]);
            if let Some((at, f)) = &self.poison
                && *at == i
            {
                f(dst);
            }
            if self.announce {
                sink.landed(i);
            }
        }
        if let Some(n) = self.rewrite_after {
            sink.region(n)?[0] ^= 0x5a;
        }
        Ok(())
    }
}

/// Each part checked on the receiving thread as it lands, whatever the
/// host's cores.
const CHECK_AS_LANDED: LandingTuning = LandingTuning {
    populate_ahead: false,
    check_as_landed: true,
};

/// The disk path's dense and expert images.
fn packed(model: &str, adapter: &str, o: &LoraOptions) -> (SlotImage, SlotImage) {
    let (_, dense, experts) = disk_images(model, adapter, o);
    (dense, experts)
}

fn assert_fresh(target: &HostLanding) {
    assert!(target.dense().pairs().is_empty() && target.experts().pairs().is_empty());
    assert!(target.dense().as_bytes().iter().all(|&b| b == 0));
    assert!(target.experts().as_bytes().iter().all(|&b| b == 0));
}

#[test]
fn dense_adapters_land_byte_for_byte_as_the_disk_pack() {
    let adapters = [
        "demo_r4_plain",
        "demo_r8_rslora",
        "demo_r16_alpha_pattern",
        "rank_alpha_pattern",
    ];
    let store = store("llama", &adapters, StoreOptions::default());
    let o = opts(32, 16);
    let lander = Lander::new(config("llama"), o.clone()).unwrap();
    for adapter in adapters {
        let mut target = HostLanding::new(lander.layout());
        let landed = lander
            .land(&mut MemTransport::new(&store), adapter, &mut target)
            .unwrap();
        let (dense, experts) = packed("llama", adapter, &o);
        assert_eq!(target.dense().as_bytes(), dense.as_bytes(), "{adapter}");
        assert_eq!(target.dense().pairs(), dense.pairs(), "{adapter}: ranks and scales");
        assert_eq!(landed.dense, dense.pairs());
        assert!(landed.experts.is_empty() && experts.as_bytes().is_empty());
    }
}

/// `adapter`'s opt-in pair (`key`) lands in the slot's place for it with
/// the place switched on (`on`), as the pool packs it; an engine without
/// the place refuses it with `code`.
fn an_opt_in_pair_lands_in_its_place(adapter: &str, on: LoraOptions, key: PairKey, code: lora_audit::RejectCode) {
    let store = store("llama", &[adapter], StoreOptions::default());
    let lander = Lander::new(config("llama"), on.clone()).unwrap();
    let mut target = HostLanding::new(lander.layout());
    let landed = lander
        .land(&mut MemTransport::new(&store), adapter, &mut target)
        .unwrap();
    let (dense, _) = packed("llama", adapter, &on);
    assert!(landed.dense.iter().any(|m| m.key == key), "{adapter}");
    assert_eq!(target.dense().as_bytes(), dense.as_bytes(), "{adapter}");
    assert_eq!(target.dense().pairs(), dense.pairs(), "{adapter}: ranks and scales");
    let without = Lander::new(config("llama"), opts(16, 16)).unwrap();
    let mut target = HostLanding::new(without.layout());
    let err = without
        .land(&mut MemTransport::new(&store), adapter, &mut target)
        .unwrap_err();
    assert!(
        matches!(&err, LandError::Refused(report) if report.refused_codes().contains(&code)),
        "{adapter}: {err}"
    );
}

#[test]
fn an_embedding_pair_lands_in_the_slots_embedding_place() {
    let on = LoraOptions {
        embedding_lora: true,
        ..opts(16, 16)
    };
    assert!(on.slot_layout(&config("llama")).unwrap().embedding().is_some());
    an_opt_in_pair_lands_in_its_place(
        "embedding_lora_no_table",
        on,
        PairKey::Embedding,
        lora_audit::RejectCode::EmbeddingLoraDisabled,
    );
}

#[test]
fn a_head_pair_lands_in_the_slots_head_place() {
    let on = LoraOptions {
        lm_head_lora: true,
        ..opts(16, 16)
    };
    assert!(on.slot_layout(&config("llama")).unwrap().lm_head().is_some());
    an_opt_in_pair_lands_in_its_place(
        "lm_head_lora_no_table",
        on,
        PairKey::LmHead,
        lora_audit::RejectCode::LmHeadLoraDisabled,
    );
}

#[test]
fn expert_and_router_pairs_land_in_their_own_image() {
    for (model, adapter) in [
        ("qwen3_moe", "experts_fused_router"),
        ("mixtral_v4", "experts_w1_w2_w3_router"),
    ] {
        let store = store(model, &[adapter], StoreOptions::default());
        let o = opts(16, 16);
        let lander = Lander::new(config(model), o.clone()).unwrap();
        let mut target = HostLanding::new(lander.layout());
        let landed = lander
            .land(&mut MemTransport::new(&store), adapter, &mut target)
            .unwrap();
        let (dense, experts) = packed(model, adapter, &o);
        assert!(!landed.experts.is_empty(), "{adapter}");
        assert_eq!(target.dense().as_bytes(), dense.as_bytes(), "{adapter}");
        assert_eq!(target.experts().as_bytes(), experts.as_bytes(), "{adapter}");
        assert_eq!(target.experts().pairs(), experts.pairs(), "{adapter}");
    }
}

#[test]
fn stale_target_images_are_replaced_before_landing() {
    let store = store("llama", &["demo_r4_plain", "rslora"], StoreOptions::default());
    let o = opts(16, 16);
    let lander = Lander::new(config("llama"), o.clone()).unwrap();
    let mut target = HostLanding::new(lander.layout());
    lander
        .land(&mut MemTransport::new(&store), "rslora", &mut target)
        .unwrap();
    lander
        .land(&mut MemTransport::new(&store), "demo_r4_plain", &mut target)
        .unwrap();
    let (dense, _) = packed("llama", "demo_r4_plain", &o);
    assert_eq!(target.dense().as_bytes(), dense.as_bytes());
    assert_eq!(target.dense().pairs(), dense.pairs());
}

#[test]
fn a_corrupted_byte_is_a_checksum_error_and_leaves_fresh_images() {
    let options = StoreOptions {
        corrupt_staged_byte: true,
        ..StoreOptions::default()
    };
    let store = store("llama", &["demo_r8_rslora"], options);
    let lander = Lander::new(config("llama"), opts(16, 16)).unwrap();
    let mut target = HostLanding::new(lander.layout());
    let err = lander
        .land(&mut MemTransport::new(&store), "demo_r8_rslora", &mut target)
        .unwrap_err();
    assert!(matches!(err, LandError::Checksum { .. }), "{err}");
    assert_fresh(&target);
}

#[test]
fn a_lost_connection_mid_landing_leaves_fresh_images() {
    let store = store("llama", &["demo_r8_rslora"], StoreOptions::default());
    let lander = Lander::new(config("llama"), opts(16, 16)).unwrap();
    let mut target = HostLanding::new(lander.layout());
    let mut transport = MemTransport::new(&store);
    transport.fail_before = Some(5);
    let err = lander.land(&mut transport, "demo_r8_rslora", &mut target).unwrap_err();
    assert!(
        matches!(err, LandError::Transport(TransportError::Disconnected(_))),
        "{err}"
    );
    assert_fresh(&target);
}

#[test]
fn non_zero_b_padding_is_refused_even_with_a_matching_checksum() {
    let lander = Lander::new(config("llama"), opts(16, 16)).unwrap();
    b_padding_under_its_checksum_is_refused(&lander, false);
}

/// `demo_r4_plain`'s first B entry with the last byte of its first row set
/// (a padding column at rank 4 < stride 16), under a manifest with that
/// checksum, through a transport that announces each op landed or not:
/// `lander` refuses it by type and leaves fresh images.
fn b_padding_under_its_checksum_is_refused(lander: &Lander, announce: bool) {
    let store = store("llama", &["demo_r4_plain"], StoreOptions::default());
    let manifest = manifest(&store, "demo_r4_plain");
    let mut transport = MemTransport {
        announce,
        ..MemTransport::new(&store)
    };
    poison_under_its_checksum(&mut transport, &manifest, WirePart::B, |b: &mut [u8]| {
        b[2 * 16 - 1] = 0x3f
    });
    let mut target = HostLanding::new(lander.layout());
    let err = lander.land(&mut transport, "demo_r4_plain", &mut target).unwrap_err();
    assert!(matches!(err, LandError::Padding { rank: 4, .. }), "{err}");
    assert_fresh(&target);
}

/// `transport` lands the first `part` entry of `manifest` with `poison`
/// applied, under a manifest whose checksum for it is the poisoned bytes'
/// (so only the checks on the landed bytes can refuse it).
fn poison_under_its_checksum<'a>(
    transport: &mut MemTransport<'a>,
    manifest: &Manifest,
    part: WirePart,
    poison: impl Fn(&mut [u8]) + 'a,
) {
    let (index, entry) = manifest
        .entries
        .iter()
        .enumerate()
        .find(|(_, e)| e.part == part)
        .unwrap();
    let Location::Tcp { region, offset } = entry.location else {
        panic!()
    };
    let mut bytes = stored_bytes(transport.store, region, offset, entry.len);
    poison(&mut bytes);
    let checksum = xxh64(&bytes);
    transport.tamper = Some(Box::new(move |m: &mut Manifest| m.entries[index].checksum = checksum));
    transport.poison = Some((index, Box::new(poison)));
}

/// The `len` bytes `store` serves at `offset` of `region`.
fn stored_bytes(store: &PeerStore, region: u32, offset: u64, len: u64) -> Vec<u8> {
    let resolved = store.resolve(&[ReadRange { region, offset, len }]).unwrap();
    resolved[0].0.memory.bytes()[resolved[0].1.clone()].to_vec()
}

fn manifest(store: &PeerStore, adapter: &str) -> Manifest {
    store
        .manifest(adapter, 16, 16, WirePlacement::SINGLE, TransportKind::Tcp)
        .unwrap()
}

#[test]
fn every_manifest_mismatch_is_refused_before_landing() {
    let store = store("llama", &["rslora"], StoreOptions::default());
    let lander = Lander::new(config("llama"), opts(16, 16)).unwrap();
    let good = manifest(&store, "rslora");
    assert!(lander.check("rslora", &good).is_ok());

    assert!(matches!(
        lander.check("other", &good),
        Err(LandError::AdapterName { .. })
    ));

    let tied = Lander::new(config("llama_tied"), opts(16, 16)).unwrap();
    assert!(matches!(
        tied.check("rslora", &good),
        Err(LandError::Manifest(ManifestError::ModelMismatch { .. }))
    ));

    let wider = Lander::new(config("llama"), opts(32, 16)).unwrap();
    assert!(matches!(
        wider.check("rslora", &good),
        Err(LandError::Manifest(ManifestError::RankMismatch {
            what: "max_rank",
            ..
        }))
    ));

    let mut m = good.clone();
    m.entries[1].len += 2;
    assert!(matches!(
        lander.check("rslora", &m),
        Err(LandError::Manifest(ManifestError::Length { index: 1, .. }))
    ));

    // An entry for a pair outside the engine's slot: not expected.
    let mut m = good.clone();
    m.entries.push(ManifestEntry {
        key: WireKey::from_key(PairKey::Dense {
            layer: 99,
            module: LoraModule::QProj,
        }),
        ..m.entries[0]
    });
    assert!(matches!(
        lander.check("rslora", &m),
        Err(LandError::Manifest(ManifestError::Unexpected { .. }))
    ));

    // A header naming a layer the model lacks: the engine's audit refuses.
    let mut m = good.clone();
    let t = m.tensors[0].clone();
    m.tensors[0].name = t.name.replace("layers.0.", "layers.99.");
    assert!(matches!(lander.check("rslora", &m), Err(LandError::Refused(_))));

    // A config whose rank disagrees with the tensor shapes.
    let mut m = good.clone();
    m.adapter_config = m.adapter_config.replace("\"r\": 16", "\"r\": 8");
    assert_ne!(m.adapter_config, good.adapter_config);
    assert!(matches!(lander.check("rslora", &m), Err(LandError::Refused(_))));

    // A dimension the host cannot hold.
    let mut m = good;
    m.tensors[0].shape[0] = u64::MAX;
    if usize::try_from(u64::MAX).is_err() {
        assert!(matches!(lander.check("rslora", &m), Err(LandError::Tensor { .. })));
    } else {
        assert!(lander.check("rslora", &m).is_err());
    }
}

#[test]
fn rank_and_scale_come_from_the_engines_audit_not_the_peer() {
    let store = store("llama", &["rslora"], StoreOptions::default());
    let lander = Lander::new(config("llama"), opts(16, 16)).unwrap();
    let good = manifest(&store, "rslora");
    let plan = lander.check("rslora", &good).unwrap();
    // Turning rsLoRA off in the config the peer sends changes the scale the
    // engine computes: the engine reads the config itself.
    let mut m = good;
    m.adapter_config = m
        .adapter_config
        .replace("\"use_rslora\": true", "\"use_rslora\": false");
    let plain = lander.check("rslora", &m).unwrap();
    let r = plan.dense[0].rank as f32;
    assert_eq!(plan.dense[0].scale * r.sqrt(), plain.dense[0].scale * r);
}

/// A manifest of fixture `name`'s header as a peer would send it.
fn header_manifest(name: &str, adapter: &str) -> Manifest {
    let dir = fixture(name);
    let mapped = LoadedSafetensors::open(&dir.join(lora_audit::ADAPTER_WEIGHTS)).unwrap();
    Manifest {
        adapter: adapter.into(),
        model: crate::fingerprint::model_fingerprint(&config("llama")),
        max_rank: 16,
        expert_rank: 16,
        placement: WirePlacement::SINGLE,
        adapter_config: std::fs::read_to_string(dir.join(lora_audit::ADAPTER_CONFIG)).unwrap(),
        tensors: mapped
            .infos()
            .unwrap()
            .into_iter()
            .map(|t| WireTensor {
                name: t.name,
                dtype: t.dtype.to_string(),
                shape: t.shape.iter().map(|&d| d as u64).collect(),
            })
            .collect(),
        entries: vec![],
    }
}

/// A DoRA adapter's manifest must list each DoRA pair's magnitude beside
/// its A and B (`out * 4` bytes, planned beside the images in the audit's
/// order): one without them is refused before anything lands; an engine
/// without DoRA refuses the adapter in its audit.
#[test]
fn dora_manifests_carry_each_pairs_magnitude() {
    let dora = LoraOptions {
        dora: true,
        ..opts(16, 16)
    };
    let store = store("llama", &["dora"], StoreOptions::default());
    let lander = Lander::new(config("llama"), dora).unwrap();
    let m = manifest(&store, "dora");
    let plan = lander.check("dora", &m).unwrap();
    let dora_pairs = plan.report.placed.iter().filter(|p| p.magnitude_key.is_some()).count();
    assert!(dora_pairs > 0);
    assert_eq!(plan.magnitudes.len(), dora_pairs);
    let mut at = 0;
    for (key, range) in &plan.magnitudes {
        let place = place_of(lander.layout(), *key).unwrap();
        assert_eq!(*range, at..at + 4 * place.out_dim, "{key}");
        at = range.end;
    }
    let mut stripped = m.clone();
    stripped.entries.retain(|e| e.part != WirePart::Magnitude);
    assert!(matches!(
        lander.check("dora", &stripped),
        Err(LandError::Manifest(ManifestError::Missing {
            part: WirePart::Magnitude,
            ..
        }))
    ));
    let plain = Lander::new(config("llama"), opts(16, 16)).unwrap();
    assert!(matches!(plain.check("dora", &m), Err(LandError::Refused(_))));
    let header = header_manifest("llama/dora", "dora");
    assert!(matches!(plain.check("dora", &header), Err(LandError::Refused(_))));
}

#[test]
fn adapters_with_token_overlays_are_refused() {
    let m = header_manifest("llama/trainable_tokens_untied_list", "tokens");
    let lander = Lander::new(config("llama"), opts(16, 16)).unwrap();
    assert!(matches!(lander.check("tokens", &m), Err(LandError::Overlay(_))));
}

#[test]
fn dtype_names_round_trip_through_the_wire() {
    for d in [
        TensorDtype::F32,
        TensorDtype::F16,
        TensorDtype::BF16,
        TensorDtype::I64,
        TensorDtype::I32,
        TensorDtype::Other("F64"),
        TensorDtype::Other("U8"),
    ] {
        assert_eq!(dtype_from_name(&d.to_string()), d);
    }
    assert_eq!(dtype_from_name("F8_E4M3"), TensorDtype::Other("an unsupported dtype"));
}

#[test]
fn parts_checked_as_they_land_give_the_same_images() {
    let adapters = ["demo_r4_plain", "demo_r16_alpha_pattern"];
    let dense_store = store("llama", &adapters, StoreOptions::default());
    let o = opts(32, 16);
    let lander = Lander::new(config("llama"), o.clone())
        .unwrap()
        .with_tuning(CHECK_AS_LANDED);
    for adapter in adapters {
        let mut target = HostLanding::new(lander.layout());
        let landed = lander
            .land(&mut MemTransport::announcing(&dense_store), adapter, &mut target)
            .unwrap();
        let (dense, _) = packed("llama", adapter, &o);
        assert_eq!(target.dense().as_bytes(), dense.as_bytes(), "{adapter}");
        assert_eq!(landed.dense, dense.pairs());
    }
    let (model, adapter) = ("qwen3_moe", "experts_fused_router");
    let moe = store(model, &[adapter], StoreOptions::default());
    let o = opts(16, 16);
    let lander = Lander::new(config(model), o.clone())
        .unwrap()
        .with_tuning(CHECK_AS_LANDED);
    let mut target = HostLanding::new(lander.layout());
    lander
        .land(&mut MemTransport::announcing(&moe), adapter, &mut target)
        .unwrap();
    let (_, experts) = packed(model, adapter, &o);
    assert_eq!(target.experts().as_bytes(), experts.as_bytes());
}

#[test]
fn a_part_checked_as_it_lands_is_refused_as_after_the_read() {
    // A corrupted byte.
    let options = StoreOptions {
        corrupt_staged_byte: true,
        ..StoreOptions::default()
    };
    let corrupt = store("llama", &["demo_r8_rslora"], options);
    let lander = Lander::new(config("llama"), opts(16, 16))
        .unwrap()
        .with_tuning(CHECK_AS_LANDED);
    let mut target = HostLanding::new(lander.layout());
    let err = lander
        .land(&mut MemTransport::announcing(&corrupt), "demo_r8_rslora", &mut target)
        .unwrap_err();
    assert!(matches!(err, LandError::Checksum { .. }), "{err}");
    assert_fresh(&target);

    // Non-zero B padding under a matching checksum.
    b_padding_under_its_checksum_is_refused(&lander, true);
}

/// A landed DoRA magnitude that is not finite, under a matching checksum,
/// is refused by type and leaves fresh images.
#[test]
fn a_non_finite_magnitude_is_refused() {
    let dora = LoraOptions {
        dora: true,
        ..opts(16, 16)
    };
    let store = store("llama", &["dora"], StoreOptions::default());
    let lander = Lander::new(config("llama"), dora).unwrap();
    let manifest = manifest(&store, "dora");
    let mut transport = MemTransport::new(&store);
    poison_under_its_checksum(&mut transport, &manifest, WirePart::Magnitude, |b: &mut [u8]| {
        b[4..8].copy_from_slice(&f32::NAN.to_le_bytes())
    });
    let mut target = HostLanding::new(lander.layout());
    let err = lander.land(&mut transport, "dora", &mut target).unwrap_err();
    assert!(matches!(err, LandError::NonFiniteMagnitude { index: 1, .. }), "{err}");
    assert_fresh(&target);
}

/// A part checked when it landed and then handed out again is checked
/// again: what is published is what was checked last.
#[test]
fn a_part_handed_out_again_after_it_landed_is_checked_again() {
    let store = store("llama", &["demo_r8_rslora"], StoreOptions::default());
    let lander = Lander::new(config("llama"), opts(16, 16))
        .unwrap()
        .with_tuning(CHECK_AS_LANDED);
    for n in [0, 3] {
        let mut transport = MemTransport::announcing(&store);
        transport.rewrite_after = Some(n);
        let mut target = HostLanding::new(lander.layout());
        let err = lander.land(&mut transport, "demo_r8_rslora", &mut target).unwrap_err();
        assert!(matches!(err, LandError::Checksum { .. }), "op {n}: {err}");
        assert_fresh(&target);
    }
}

/// The sink's part states: only a part handed out and then said landed is
/// checked during the read, and only while its bytes match.
#[test]
fn the_sink_checks_only_parts_handed_out_and_landed() {
    let store = store("llama", &["demo_r8_rslora"], StoreOptions::default());
    let lander = Lander::new(config("llama"), opts(16, 16)).unwrap();
    let plan = lander
        .check("demo_r8_rslora", &manifest(&store, "demo_r8_rslora"))
        .unwrap();
    let mut dense = SlotImage::zeroed(lander.layout());
    let mut experts = SlotImage::zeroed(&plan.expert_layout);
    for meta in &plan.dense {
        dense.declare(lander.layout(), *meta).unwrap();
    }
    let mut sink = ImageSink {
        layout: lander.layout(),
        expert_layout: &plan.expert_layout,
        dense: &mut dense,
        experts: &mut experts,
        magnitudes: &mut [],
        parts: &plan.parts,
        states: vec![PartState::Waiting; plan.parts.len()],
        check_as_landed: true,
    };
    let staged = |i: usize| {
        let Location::Tcp { region, offset } = plan.parts[i].location else {
            panic!()
        };
        stored_bytes(&store, region, offset, plan.parts[i].range.len() as u64)
    };
    // Said landed before it was handed out: not checked.
    sink.landed(0);
    assert_eq!(sink.states[0], PartState::Waiting);
    // Handed out, filled, said landed: checked.
    sink.region(0).unwrap().copy_from_slice(&staged(0));
    sink.landed(0);
    assert_eq!(sink.states[0], PartState::Checked);
    // Handed out again: no longer checked, whatever it holds.
    sink.region(0).unwrap();
    assert_eq!(sink.states[0], PartState::Handed);
    // Said landed with bytes that do not match: left for the check after
    // the read, which reports it.
    sink.region(1).unwrap();
    sink.landed(1);
    assert_eq!(sink.states[1], PartState::Handed);
    // An op that does not exist changes nothing.
    sink.landed(plan.parts.len());
    assert!(matches!(
        sink.region(plan.parts.len()),
        Err(TransportError::NoSuchOp(_))
    ));
    let states = std::mem::take(&mut sink.states);
    drop(sink);
    let err = verify(&plan.parts, &states, [dense.as_bytes(), experts.as_bytes(), &[]]).unwrap_err();
    assert!(matches!(err, LandError::Checksum { .. }), "{err}");
}

#[test]
fn the_tuning_follows_the_cores() {
    for (cores, spare) in [
        (0, false),
        (1, false),
        (2, false),
        (3, false),
        (4, true),
        (16, true),
        (256, true),
    ] {
        assert_eq!(
            LandingTuning::for_cores(cores),
            LandingTuning {
                populate_ahead: spare,
                check_as_landed: !spare,
            },
            "{cores} cores"
        );
    }
    let lander = Lander::new(config("llama"), opts(16, 16)).unwrap();
    assert_eq!(lander.tuning(), LandingTuning::for_host());
    assert_eq!(lander.with_tuning(CHECK_AS_LANDED).tuning(), CHECK_AS_LANDED);
}

/// A Llama of 8 layers whose slot image (5.6 MB at rank 16) is large enough
/// for huge pages and the populating helper.
const MID_LLAMA: &str = r#"{
    "model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "num_hidden_layers": 8, "vocab_size": 1000, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": false
}"#;

/// Over TCP from a peer, an adapter whose image is large enough for huge
/// pages lands byte for byte as the disk pack under every tuning, and a
/// corrupted byte is refused under every tuning.
#[test]
fn every_tuning_lands_a_large_adapter_over_tcp_as_the_disk_pack() {
    use crate::peer::{Peer, PeerOptions};
    use crate::tcp::{TcpOptions, TcpTransport};

    let cfg = ModelConfig::from_hf_config(MID_LLAMA).unwrap();
    let dir = std::env::temp_dir().join(format!("lora-rdma-tuning-{}", std::process::id()));
    crate::bench::write_adapter(&dir, &cfg, 16).unwrap();
    let o = opts(16, 16);
    let prepared = lora_audit::prepare_adapter(&dir, &cfg, &o).unwrap();
    let layout = SlotLayout::new(&cfg, 16).unwrap();
    let packed = SlotImage::pack(&layout, &lora_pool::image::dense_sources(&prepared)).unwrap();
    assert!(packed.as_bytes().len() >= pages::MIN_ADVISED_BYTES);
    let serve = |options: StoreOptions| {
        let mut store = PeerStore::new(cfg.clone(), options);
        store.add_adapter("mid", &dir).unwrap();
        Peer::bind(store, "127.0.0.1:0", PeerOptions::default())
            .unwrap()
            .spawn()
            .unwrap()
    };
    let good = serve(StoreOptions::default());
    let corrupt = serve(StoreOptions {
        corrupt_staged_byte: true,
        ..StoreOptions::default()
    });
    for populate_ahead in [false, true] {
        for check_as_landed in [false, true] {
            let tuning = LandingTuning {
                populate_ahead,
                check_as_landed,
            };
            let lander = Lander::new(cfg.clone(), o.clone()).unwrap().with_tuning(tuning);
            let mut target = HostLanding::new(lander.layout());
            let mut t = TcpTransport::connect(&good.addr().to_string(), TcpOptions::default()).unwrap();
            // Twice: the second lands over the first's images.
            for _ in 0..2 {
                let landed = lander.land(&mut t, "mid", &mut target).unwrap();
                assert_eq!(target.dense().as_bytes(), packed.as_bytes(), "{tuning:?}");
                assert_eq!(landed.dense, packed.pairs(), "{tuning:?}");
            }
            let mut t = TcpTransport::connect(&corrupt.addr().to_string(), TcpOptions::default()).unwrap();
            let mut target = HostLanding::new(lander.layout());
            let err = lander.land(&mut t, "mid", &mut target).unwrap_err();
            assert!(matches!(err, LandError::Checksum { .. }), "{tuning:?}: {err}");
            assert_fresh(&target);
        }
    }
    drop((good, corrupt));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fully-sharded or vocab-parallel rank asks for its own cut: the lander
/// builds for it, a manifest of the same ranks staged for another cut is
/// refused `PlacementMismatch` before its audit, and the rank's own manifest
/// passes. A fully-sharded rank whose block of rank rows lies past the
/// adapter's rank expects (and gets) no A rows of a column-parallel pair.
#[test]
fn a_ranks_cut_options_are_asked_for_and_checked() {
    let store = store("llama", &["demo_r8_rslora"], StoreOptions::default());
    let rank1 = lora_layout::Placement::new(1, 2).unwrap();
    for placement in [
        rank1.with_fully_sharded(true),
        rank1.with_vocab_parallel(true),
        rank1.with_fully_sharded(true).with_vocab_parallel(true),
    ] {
        let lander = Lander::new(
            config("llama"),
            LoraOptions {
                placement,
                ..opts(16, 16)
            },
        )
        .unwrap();
        let wire = WirePlacement::from_placement(placement);
        for other in [rank1, rank1.with_fully_sharded(true), rank1.with_vocab_parallel(true)] {
            let other = WirePlacement::from_placement(other);
            if other == wire {
                continue;
            }
            let m = store
                .manifest("demo_r8_rslora", 16, 16, other, TransportKind::Tcp)
                .unwrap();
            let err = lander.check("demo_r8_rslora", &m).unwrap_err();
            assert!(
                matches!(
                    err,
                    LandError::Manifest(ManifestError::PlacementMismatch { expected, got })
                        if expected == wire && got == other
                ),
                "{placement:?}: {err}"
            );
        }
        let own = store
            .manifest("demo_r8_rslora", 16, 16, wire, TransportKind::Tcp)
            .unwrap();
        assert_eq!(own.placement, wire);
        let plan = lander.check("demo_r8_rslora", &own).unwrap();
        if placement.fully_sharded() {
            // Rank 1 of 2 holds rows 8..16 of a rank-8 pair's A: none.
            let column_a = plan.parts.iter().filter(|p| {
                p.part == WirePart::A
                    && matches!(p.key, PairKey::Dense { module, .. } if module.shard_kind() == lora_layout::ShardKind::Column)
            });
            assert!(column_a.clone().count() > 0);
            assert!(column_a.clone().all(|p| p.range.is_empty()), "{placement:?}");
        }
    }
}

#[test]
fn a_manifest_for_another_rank_is_refused_before_anything_lands() {
    let store = store("llama", &["demo_r8_rslora"], StoreOptions::default());
    let placement = lora_layout::Placement::new(1, 2).unwrap();
    let placed = LoraOptions {
        placement,
        ..opts(16, 16)
    };
    let lander = Lander::new(config("llama"), placed).unwrap();
    let whole = manifest(&store, "demo_r8_rslora");
    let err = lander.check("demo_r8_rslora", &whole).unwrap_err();
    assert!(
        matches!(
            err,
            LandError::Manifest(ManifestError::PlacementMismatch { expected, got })
                if expected == WirePlacement::from_placement(placement) && got == WirePlacement::SINGLE
        ),
        "{err}"
    );
    let mut forged = whole.clone();
    forged.placement = WirePlacement::from_placement(placement);
    let err = lander.check("demo_r8_rslora", &forged).unwrap_err();
    assert!(
        matches!(err, LandError::Manifest(ManifestError::Length { .. })),
        "{err}"
    );
    let mut transport = MemTransport::new(&store);
    transport.tamper = Some(Box::new(move |m: &mut Manifest| *m = forged.clone()));
    let mut target = HostLanding::new(lander.layout());
    assert!(lander.land(&mut transport, "demo_r8_rslora", &mut target).is_err());
    assert_fresh(&target);
    // The rank's own manifest lists its shard's lengths and passes.
    let rank = store
        .manifest(
            "demo_r8_rslora",
            16,
            16,
            WirePlacement::from_placement(placement),
            TransportKind::Tcp,
        )
        .unwrap();
    assert!(lander.check("demo_r8_rslora", &rank).is_ok());
}
