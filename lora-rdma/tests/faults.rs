//! Every fault of issue 8 is a typed error that leaves the landing images
//! fresh and the pool — the victim slot and every other — bit for bit as it
//! was: the peer killed mid-transfer or gone silent, a corrupted byte, a
//! truncated or oversized manifest, entries pointing outside the slot or
//! the peer's region or of the wrong length, a manifest for another model.
//! The peer runs in its own process (`lora-peer`), behind a tampering proxy
//! where a test needs a lying peer.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use common::{PeerProcess, Snapshot, assert_fresh, disk_pool, packed_from_disk, snapshot};
use lora_layout::{LoraModule, PairKey};
use lora_pool::{LandedImages, LoraOptions, LoraPool, PoolError, StepRow};
use lora_rdma::land::{HostLanding, LandError};
use lora_rdma::manifest::{Location, Manifest, ManifestEntry, ManifestError, WireKey};
use lora_rdma::protocol::{RefusalCode, Request, Response, data_frame_lens};
use lora_rdma::swap::{PeerSwapError, promote_from_peer, swap_from_peer};
use lora_rdma::tcp::{TcpOptions, TcpTransport};
use lora_rdma::transport::TransportError;
use lora_rdma::wire::{FrameKind, WireError, read_header, recv_json, send_json, write_frame};

const MODEL: &str = "llama";
const SERVED: [&str; 2] = ["demo_r8_rslora", "demo_r16_alpha_pattern"];
const LANDED: &str = "demo_r16_alpha_pattern";

fn options() -> LoraOptions {
    LoraOptions {
        max_loras: 3,
        max_rank: 16,
        rotatable: true,
        ..LoraOptions::default()
    }
}

/// A pool serving two adapters from disk, with one free slot (the victim).
fn bystander_pool() -> LoraPool {
    disk_pool(MODEL, &[("a", "demo_r4_plain"), ("b", "rslora")], options())
}

fn transport(addr: &str, io_timeout: Duration) -> Result<TcpTransport, TransportError> {
    let tcp = TcpOptions {
        connect_timeout: Duration::from_secs(5),
        io_timeout,
        ..TcpOptions::default()
    };
    TcpTransport::connect(addr, tcp)
}

/// Run a swap expected to fail; check the images and the pool are untouched
/// and return the error.
fn failed_swap(addr: &str, io_timeout: Duration) -> LandError {
    let mut pool = bystander_pool();
    let before: Snapshot = snapshot(&pool);
    let mut target = HostLanding::new(pool.layout());
    let err = transport(addr, io_timeout)
        .map_err(LandError::from)
        .and_then(|mut t| match swap_from_peer(&mut pool, &mut t, LANDED, &mut target) {
            Err(PeerSwapError::Land(e)) => Err::<(), _>(e),
            other => panic!("expected a landing error, got {other:?}"),
        })
        .unwrap_err();
    assert_fresh(&target);
    assert_eq!(snapshot(&pool), before, "a failed landing changed the pool");
    err
}

#[test]
fn a_clean_promotion_from_the_peer_writes_only_the_victim() {
    let peer = PeerProcess::spawn(MODEL, &SERVED, &[]);
    let mut pool = bystander_pool();
    let before = snapshot(&pool);
    let mut t = transport(&peer.addr, Duration::from_secs(30)).unwrap();
    let lease = promote_from_peer(&mut pool, &mut t, LANDED).unwrap();
    let after = snapshot(&pool);
    let victim = pool.slot_of(LANDED).unwrap();
    assert_eq!(lease.slot(), victim);
    assert_eq!(pool.slot_ids().count(), 3);
    for slot in pool.slot_ids() {
        let s = slot.index();
        if slot == victim {
            assert_ne!(after.bytes[s], before.bytes[s]);
        } else {
            assert_eq!(after.bytes[s], before.bytes[s], "slot {slot}");
            assert_eq!(after.slots[s], before.slots[s], "slot {slot}");
        }
    }
    // Resident now: a second promotion leases it without touching the peer.
    drop(peer);
    let again = promote_from_peer(&mut pool, &mut t, LANDED).unwrap();
    assert_eq!(again.slot(), victim);
}

/// Landed, checked images are still not published into a slot a running
/// step holds: the publish is refused and changes nothing until the step
/// drops.
#[test]
fn a_publish_into_a_slot_a_step_holds_is_refused_and_changes_nothing() {
    let mut pool = bystander_pool();
    let lease = pool.acquire("a").unwrap();
    let held = lease.slot();
    let step = pool.decode_step(&[StepRow::Adapter(&lease), StepRow::Base], 2).unwrap();
    // The request is done; its step still holds the slot.
    drop(lease);
    let before = snapshot(&pool);
    let (dense, _) = packed_from_disk(MODEL, LANDED, &options());
    let err = pool
        .publish_landed(held, LANDED, LandedImages::new(dense, None))
        .unwrap_err();
    assert!(
        matches!(err, PoolError::SlotInUse { slot, leases: 1 } if slot == held),
        "{err}"
    );
    assert_eq!(snapshot(&pool), before, "a refused publish changed the pool");
    drop(step);
    let (dense, _) = packed_from_disk(MODEL, LANDED, &options());
    let report = pool
        .publish_landed(held, LANDED, LandedImages::new(dense, None))
        .unwrap();
    assert_eq!((report.slot, pool.slot_of(LANDED)), (held, Some(held)));
    assert_eq!(pool.slot_of("a"), None);
}

#[test]
fn a_peer_killed_mid_transfer_is_a_lost_connection() {
    let mut peer = PeerProcess::spawn(MODEL, &SERVED, &["--test-fault", "stall-after=4096"]);
    let addr = peer.addr.clone();
    let landing: JoinHandle<LandError> = std::thread::spawn(move || failed_swap(&addr, Duration::from_secs(60)));
    peer.wait_line("lora-peer: stalled", Duration::from_secs(60));
    peer.kill();
    let err = landing.join().unwrap();
    assert!(
        matches!(err, LandError::Transport(TransportError::Disconnected(_))),
        "{err}"
    );
}

#[test]
fn a_silent_peer_is_a_timeout() {
    let peer = PeerProcess::spawn(MODEL, &SERVED, &["--test-fault", "stall-after=4096"]);
    let err = failed_swap(&peer.addr, Duration::from_millis(500));
    assert!(matches!(err, LandError::Transport(TransportError::Timeout(_))), "{err}");
}

#[test]
fn a_corrupted_byte_is_a_checksum_mismatch() {
    let peer = PeerProcess::spawn(MODEL, &SERVED, &["--test-fault", "corrupt-byte"]);
    let err = failed_swap(&peer.addr, Duration::from_secs(30));
    assert!(matches!(err, LandError::Checksum { .. }), "{err}");
}

#[test]
fn a_manifest_for_another_model_is_refused() {
    // The same adapters, staged by a peer serving the tied-embedding model.
    let peer = PeerProcess::spawn_with_config("llama_tied", MODEL, &SERVED, &[]);
    let err = failed_swap(&peer.addr, Duration::from_secs(30));
    assert!(
        matches!(err, LandError::Manifest(ManifestError::ModelMismatch { .. })),
        "{err}"
    );
}

/// What the proxy does to the manifest on its way to the engine.
enum Lie {
    /// Rewrite the manifest.
    Edit(fn(&mut Manifest)),
    /// Send these raw bytes instead of the manifest frame, then close.
    Raw(fn(Vec<u8>) -> Vec<u8>),
}

/// A proxy in front of the peer process: forwards requests and replies,
/// lying about the manifest as told.
fn lying_proxy(upstream: String, lie: Lie) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let handle = std::thread::spawn(move || {
        let (mut engine, _) = listener.accept().unwrap();
        let mut peer = TcpStream::connect(upstream).unwrap();
        while let Ok(request) = recv_json::<Request>(&mut engine, FrameKind::Request) {
            send_json(&mut peer, FrameKind::Request, &request).unwrap();
            match request {
                Request::Manifest { .. } => {
                    let reply: Response = recv_json(&mut peer, FrameKind::Response).unwrap();
                    let Response::Manifest(mut m) = reply else {
                        panic!("{reply:?}")
                    };
                    match &lie {
                        Lie::Edit(edit) => {
                            edit(&mut m);
                            send_json(&mut engine, FrameKind::Response, &Response::Manifest(m)).unwrap();
                        }
                        Lie::Raw(bytes) => {
                            let mut frame = Vec::new();
                            send_json(&mut frame, FrameKind::Response, &Response::Manifest(m)).unwrap();
                            let _ = engine.write_all(&bytes(frame));
                            return;
                        }
                    }
                }
                Request::Read { ranges } => {
                    for len in ranges.iter().flat_map(|r| data_frame_lens(r.len as usize)) {
                        let (kind, n) = read_header(&mut peer).unwrap();
                        let mut payload = vec![0u8; n];
                        std::io::Read::read_exact(&mut peer, &mut payload).unwrap();
                        write_frame(&mut engine, kind, &payload).unwrap();
                        if kind != FrameKind::Data || n != len {
                            break;
                        }
                    }
                }
                Request::Connect { .. } => panic!("no RDMA here"),
            }
        }
    });
    (addr, handle)
}

fn through_proxy(lie: Lie) -> LandError {
    let peer = PeerProcess::spawn(MODEL, &SERVED, &[]);
    let (addr, proxy) = lying_proxy(peer.addr.clone(), lie);
    let err = failed_swap(&addr, Duration::from_secs(30));
    proxy.join().unwrap();
    err
}

#[test]
fn a_truncated_manifest_is_a_lost_connection() {
    let err = through_proxy(Lie::Raw(|mut frame| {
        frame.truncate(frame.len() / 2);
        frame
    }));
    assert!(
        matches!(err, LandError::Transport(TransportError::Disconnected(_))),
        "{err}"
    );
}

#[test]
fn an_oversized_manifest_is_refused_before_it_is_read() {
    let err = through_proxy(Lie::Raw(|mut frame| {
        frame[8..12].copy_from_slice(&(lora_rdma::wire::MAX_RESPONSE_BYTES + 1).to_le_bytes());
        frame
    }));
    assert!(
        matches!(
            err,
            LandError::Transport(TransportError::Wire(WireError::Oversized { .. }))
        ),
        "{err}"
    );
}

#[test]
fn an_entry_outside_the_slot_is_refused_whole() {
    let err = through_proxy(Lie::Edit(|m| {
        let extra = ManifestEntry {
            key: WireKey::from_key(PairKey::Dense {
                layer: 40,
                module: LoraModule::QProj,
            }),
            ..m.entries[0]
        };
        m.entries.push(extra);
    }));
    assert!(
        matches!(err, LandError::Manifest(ManifestError::Unexpected { .. })),
        "{err}"
    );
}

#[test]
fn an_entry_of_the_wrong_length_is_refused_whole() {
    let err = through_proxy(Lie::Edit(|m| {
        let last = m.entries.len() - 1;
        m.entries[last].len *= 2;
    }));
    assert!(
        matches!(err, LandError::Manifest(ManifestError::Length { .. })),
        "{err}"
    );
}

#[test]
fn a_location_outside_the_peers_region_is_refused_by_the_peer() {
    let err = through_proxy(Lie::Edit(|m| {
        let last = m.entries.len() - 1;
        if let Location::Tcp { offset, .. } = &mut m.entries[last].location {
            *offset = u64::MAX / 2;
        }
    }));
    assert!(
        matches!(err, LandError::Transport(TransportError::Refused(ref r)) if r.code == RefusalCode::BadRead),
        "{err}"
    );
}
