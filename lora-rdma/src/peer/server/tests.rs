use std::path::Path;
use std::sync::atomic::AtomicBool;

use lora_layout::ModelConfig;

use super::*;
use crate::manifest::WirePlacement;
use crate::peer::StoreOptions;
use crate::wire::{read_frame, write_frame};

fn peer(max_connections: usize) -> PeerHandle {
    let options = PeerOptions {
        max_connections,
        ..PeerOptions::default()
    };
    peer_with(options, StoreOptions::default())
}

fn peer_with(options: PeerOptions, store_options: StoreOptions) -> PeerHandle {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let mut store = PeerStore::new(cfg, store_options);
    store.add_adapter("r4", &dir.join("demo_r4_plain")).unwrap();
    store.add_adapter("r8", &dir.join("demo_r8_rslora")).unwrap();
    Peer::bind(store, "127.0.0.1:0", options).unwrap().spawn().unwrap()
}

fn connect(handle: &PeerHandle) -> TcpStream {
    let s = TcpStream::connect(handle.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn ask(s: &mut TcpStream, request: &Request) -> Response {
    send_json(s, FrameKind::Request, request).unwrap();
    recv_json(s, FrameKind::Response).unwrap()
}

/// The valid header of a 1 MiB request frame whose payload never comes
/// (or comes a byte at a time): the connection is mid-request, not idle.
fn start_a_request(s: &mut TcpStream) {
    let mut header = b"LRDM".to_vec();
    header.extend_from_slice(&crate::wire::PROTOCOL_VERSION.to_le_bytes());
    header.extend_from_slice(&1u16.to_le_bytes());
    header.extend_from_slice(&(1u32 << 20).to_le_bytes());
    s.write_all(&header).unwrap();
}

fn refused(r: &Response) -> Option<RefusalCode> {
    match r {
        Response::Refused(PeerRefusal { code, .. }) => Some(*code),
        _ => None,
    }
}

fn unknown_adapter() -> Request {
    Request::Manifest {
        adapter: "nope".into(),
        max_rank: 8,
        expert_rank: 16,
        placement: WirePlacement::SINGLE,
        transport: crate::protocol::TransportKind::Tcp,
    }
}

#[test]
fn connections_past_the_limit_are_refused_busy() {
    let handle = peer(1);
    let mut first = connect(&handle);
    // The first connection is served (its thread holds the only slot).
    let r = ask(&mut first, &unknown_adapter());
    assert_eq!(refused(&r), Some(RefusalCode::UnknownAdapter), "{r:?}");
    start_a_request(&mut first);
    std::thread::sleep(Duration::from_millis(50));
    let mut second = connect(&handle);
    let busy: Response = recv_json(&mut second, FrameKind::Response).unwrap();
    assert_eq!(refused(&busy), Some(RefusalCode::Busy), "{busy:?}");
    drop(first);
}

#[test]
fn one_client_address_is_held_to_its_own_limit() {
    let handle = peer_with(
        PeerOptions {
            max_connections: 8,
            max_per_client: 2,
            ..PeerOptions::default()
        },
        StoreOptions::default(),
    );
    let mut held: Vec<TcpStream> = (0..2).map(|_| connect(&handle)).collect();
    for s in &mut held {
        start_a_request(s);
    }
    std::thread::sleep(Duration::from_millis(50));
    let mut third = connect(&handle);
    let busy: Response = recv_json(&mut third, FrameKind::Response).unwrap();
    assert_eq!(refused(&busy), Some(RefusalCode::Busy), "{busy:?}");
    let Response::Refused(r) = busy else { panic!() };
    assert!(r.message.contains("127.0.0.1"), "{r}");
}

#[test]
fn the_longest_idle_connection_is_closed_to_admit_a_new_one() {
    let handle = peer(2);
    let mut oldest = connect(&handle);
    let r = ask(&mut oldest, &unknown_adapter());
    assert_eq!(refused(&r), Some(RefusalCode::UnknownAdapter));
    std::thread::sleep(Duration::from_millis(20));
    let mut younger = connect(&handle);
    let r = ask(&mut younger, &unknown_adapter());
    assert_eq!(refused(&r), Some(RefusalCode::UnknownAdapter));
    // Both idle: the next one closes the oldest and is served.
    let mut new = connect(&handle);
    let r = ask(&mut new, &unknown_adapter());
    assert_eq!(refused(&r), Some(RefusalCode::UnknownAdapter), "{r:?}");
    assert!(closed_within(&mut oldest, Duration::from_secs(2)));
    let r = ask(&mut younger, &unknown_adapter());
    assert_eq!(refused(&r), Some(RefusalCode::UnknownAdapter), "{r:?}");
}

/// Whether the peer closes `s` within `limit` (reading any bytes it still
/// sends).
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 1 << 16];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => return false,
            Err(_) => return true,
        }
    }
}

/// Options for the slow-client tests: short deadlines, one address.
fn slow_client_options() -> PeerOptions {
    PeerOptions {
        max_connections: 32,
        max_per_client: 64,
        idle_timeout: Duration::from_secs(60),
        io_timeout: Duration::from_millis(300),
        ..PeerOptions::default()
    }
}

/// A correct client's landing: a manifest and a read of all of it. Retries
/// while the peer says busy; returns how many times it was refused.
fn land_r4(handle: &PeerHandle, within: Duration) -> usize {
    let deadline = Instant::now() + within;
    let mut busy = 0;
    loop {
        assert!(Instant::now() < deadline, "locked out: refused busy {busy} times");
        let mut s = connect(handle);
        // A refused connection may be closed before the request is sent.
        let asked = send_json(&mut s, FrameKind::Request, &r4_manifest())
            .and_then(|()| recv_json::<Response>(&mut s, FrameKind::Response));
        let manifest = match asked {
            Ok(Response::Manifest(m)) => m,
            Ok(r) if refused(&r) == Some(RefusalCode::Busy) => {
                busy += 1;
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            Err(WireError::Io(_)) => {
                busy += 1;
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            other => panic!("{other:?}"),
        };
        let ranges = tcp_ranges(&manifest);
        send_json(&mut s, FrameKind::Request, &Request::Read { ranges: ranges.clone() }).unwrap();
        for range in ranges {
            let mut got = 0;
            for want in data_frame_lens(range.len as usize) {
                assert_eq!(read_frame(&mut s, FrameKind::Data).unwrap().len(), want);
                got += want;
            }
            assert_eq!(got as u64, range.len);
        }
        return busy;
    }
}

fn r4_manifest() -> Request {
    Request::Manifest {
        adapter: "r4".into(),
        max_rank: 8,
        expert_rank: 16,
        placement: WirePlacement::SINGLE,
        transport: crate::protocol::TransportKind::Tcp,
    }
}

fn tcp_ranges(m: &crate::manifest::Manifest) -> Vec<ReadRange> {
    m.entries
        .iter()
        .map(|e| match e.location {
            crate::manifest::Location::Tcp { region, offset } => ReadRange {
                region,
                offset,
                len: e.len,
            },
            other => panic!("{other:?}"),
        })
        .collect()
}

#[test]
fn forty_idle_connections_do_not_lock_out_a_client() {
    let handle = peer_with(slow_client_options(), StoreOptions::default());
    let idle: Vec<TcpStream> = (0..40).map(|_| connect(&handle)).collect();
    let start = Instant::now();
    // Served at once: it takes the slot of the longest-idle connection.
    assert_eq!(land_r4(&handle, Duration::from_secs(5)), 0);
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    drop(idle);
}

#[test]
fn forty_trickling_requests_are_cut_at_the_deadline_and_the_excess_refused_at_once() {
    let options = PeerOptions {
        io_timeout: Duration::from_secs(1),
        ..slow_client_options()
    };
    let handle = peer_with(options, StoreOptions::default());
    // 32 take every slot, each mid-request...
    let mut tricklers: Vec<TcpStream> = (0..32).map(|_| connect(&handle)).collect();
    for s in &mut tricklers {
        start_a_request(s);
    }
    std::thread::sleep(Duration::from_millis(200));
    // ...and 8 more come.
    let mut late: Vec<TcpStream> = (0..8).map(|_| connect(&handle)).collect();
    for s in &mut late {
        start_a_request(s);
    }
    let stop = Arc::new(AtomicBool::new(false));
    // One byte every 100 ms on every connection: each single read is well
    // inside io_timeout, the request never completes.
    let trickle = {
        let streams: Vec<TcpStream> = tricklers.iter().chain(&late).map(|s| s.try_clone().unwrap()).collect();
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(100));
                for mut s in &streams {
                    let _ = s.write_all(b" ");
                }
            }
        })
    };
    let start = Instant::now();
    // 32 slots, all mid-request: the rest are refused busy at once.
    let mut busy = 0;
    for s in &mut late {
        s.set_read_timeout(Some(Duration::from_millis(150))).unwrap();
        let r = recv_json::<Response>(s, FrameKind::Response);
        busy += usize::from(r.is_ok_and(|r| refused(&r) == Some(RefusalCode::Busy)));
    }
    assert_eq!(busy, 8);
    // The deadline frees the slots: the correct client lands soon after.
    assert!(land_r4(&handle, Duration::from_secs(5)) > 0);
    assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
    for s in &mut tricklers {
        assert!(closed_within(s, Duration::from_secs(1)));
    }
    stop.store(true, Ordering::Release);
    trickle.join().unwrap();
}

#[test]
fn a_client_taking_its_reply_too_slowly_is_cut_at_the_deadline() {
    let options = PeerOptions {
        max_connections: 1,
        min_rate: 256 << 20,
        ..slow_client_options()
    };
    let handle = peer_with(options, StoreOptions::default());
    let mut s = connect(&handle);
    // Several wide stagings, each read once: more than the socket buffers
    // of both ends hold.
    let mut ranges = Vec::new();
    for adapter in ["r4", "r8"] {
        for max_rank in [4096, 4095, 4094] {
            let wide = Request::Manifest {
                adapter: adapter.into(),
                max_rank,
                expert_rank: 16,
                placement: WirePlacement::SINGLE,
                transport: crate::protocol::TransportKind::Tcp,
            };
            let Response::Manifest(m) = ask(&mut s, &wide) else {
                panic!()
            };
            ranges.extend(tcp_ranges(&m));
        }
    }
    let total: u64 = ranges.iter().map(|r| r.len).sum();
    assert!(
        total > 64 << 20,
        "the reply ({total} bytes) must outgrow the socket buffers"
    );
    send_json(&mut s, FrameKind::Request, &Request::Read { ranges }).unwrap();
    // 4 KiB every 10 ms: every single write of the peer goes through in
    // time, the whole reply would take minutes; its deadline is
    // 2 x 300 ms + total / 256 MiB/s, under a second.
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let mut got = 0u64;
            while !stop.load(Ordering::Acquire) {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n as u64,
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            got
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    // The slow client holds the only slot until its deadline, no longer.
    let start = Instant::now();
    let busy = land_r4(&handle, Duration::from_secs(4));
    assert!(busy > 0, "the slow client should have held the slot a while");
    assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
    stop.store(true, Ordering::Release);
    let got = reader.join().unwrap();
    assert!(got < total, "{got} of {total}");
}

#[test]
fn a_landing_keeps_its_staging_until_it_has_read_it_or_closes() {
    let store = StoreOptions {
        max_staged: 1,
        ..StoreOptions::default()
    };
    let handle = peer_with(slow_client_options(), store);
    let r8 = Request::Manifest {
        adapter: "r8".into(),
        max_rank: 8,
        expert_rank: 16,
        placement: WirePlacement::SINGLE,
        transport: crate::protocol::TransportKind::Tcp,
    };
    let mut a = connect(&handle);
    let mut b = connect(&handle);
    let Response::Manifest(m) = ask(&mut a, &r4_manifest()) else {
        panic!()
    };
    let ranges = tcp_ranges(&m);
    let (first, rest) = ranges.split_at(ranges.len() / 2);
    // Mid-landing: another client's request cannot evict it.
    assert_eq!(refused(&ask(&mut b, &r8)), Some(RefusalCode::Busy));
    let read_all = |s: &mut TcpStream, ranges: &[ReadRange]| {
        send_json(
            s,
            FrameKind::Request,
            &Request::Read {
                ranges: ranges.to_vec(),
            },
        )
        .unwrap();
        for r in ranges {
            assert_eq!(read_frame(s, FrameKind::Data).unwrap().len() as u64, r.len);
        }
    };
    read_all(&mut a, first);
    assert_eq!(refused(&ask(&mut b, &r8)), Some(RefusalCode::Busy));
    read_all(&mut a, rest);
    // Landed: its staging may go.
    let Response::Manifest(_) = ask(&mut b, &r8) else {
        panic!()
    };
    assert_eq!(refused(&ask(&mut a, &r4_manifest())), Some(RefusalCode::Busy));
    // Closed mid-landing: its staging may go.
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match ask(&mut a, &r4_manifest()) {
            Response::Manifest(_) => break,
            r => assert!(Instant::now() < deadline, "{r:?}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Idle past io_timeout: not landing any more, its staging may go.
    let idle = Instant::now();
    let mut c = connect(&handle);
    loop {
        match ask(&mut c, &r8) {
            Response::Manifest(_) => break,
            r => assert!(idle.elapsed() < Duration::from_secs(3), "{r:?}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(idle.elapsed() >= Duration::from_millis(250), "{:?}", idle.elapsed());
}

#[test]
fn bad_reads_get_a_refusal_and_no_data() {
    let handle = peer(4);
    let mut s = connect(&handle);
    let manifest = match ask(
        &mut s,
        &Request::Manifest {
            adapter: "r4".into(),
            max_rank: 8,
            expert_rank: 16,
            placement: WirePlacement::SINGLE,
            transport: crate::protocol::TransportKind::Tcp,
        },
    ) {
        Response::Manifest(m) => m,
        other => panic!("{other:?}"),
    };
    let crate::manifest::Location::Tcp { region, offset } = manifest.entries[0].location else {
        panic!()
    };
    let outside = ReadRange {
        region,
        offset: u64::MAX - 1,
        len: 4,
    };
    let r = ask(&mut s, &Request::Read { ranges: vec![outside] });
    assert!(
        matches!(
            r,
            Response::Refused(PeerRefusal {
                code: RefusalCode::BadRead,
                ..
            })
        ),
        "{r:?}"
    );
    let too_many = vec![ReadRange { region, offset, len: 1 }; MAX_READ_RANGES + 1];
    let r = ask(&mut s, &Request::Read { ranges: too_many });
    assert!(
        matches!(
            r,
            Response::Refused(PeerRefusal {
                code: RefusalCode::TooManyRanges,
                ..
            })
        ),
        "{r:?}"
    );
    // A small request asking for the whole region over and over.
    let whole = ReadRange {
        region,
        offset: 0,
        len: manifest.entries.iter().map(|e| e.len).sum(),
    };
    let start = Instant::now();
    let r = ask(
        &mut s,
        &Request::Read {
            ranges: vec![whole; 64],
        },
    );
    assert_eq!(refused(&r), Some(RefusalCode::TooManyBytes), "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(1));
    // The connection still serves a good read afterwards.
    let good = ReadRange { region, offset, len: 6 };
    send_json(&mut s, FrameKind::Request, &Request::Read { ranges: vec![good] }).unwrap();
    assert_eq!(read_frame(&mut s, FrameKind::Data).unwrap().len(), 6);
    let r = ask(
        &mut s,
        &Request::Connect {
            endpoint: crate::protocol::Endpoint {
                lid: 1,
                qpn: 2,
                psn: 3,
                gid: [0; 16],
                mtu: 3,
                rd_atomic: 1,
            },
        },
    );
    assert!(
        matches!(
            r,
            Response::Refused(PeerRefusal {
                code: RefusalCode::NoRdma,
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn a_malformed_request_is_refused_and_the_connection_closed() {
    let handle = peer(4);
    let mut s = connect(&handle);
    write_frame(&mut s, FrameKind::Request, b"{\"Nonsense\":1}").unwrap();
    let r: Response = recv_json(&mut s, FrameKind::Response).unwrap();
    assert!(
        matches!(
            r,
            Response::Refused(PeerRefusal {
                code: RefusalCode::Malformed,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(matches!(
        read_frame(&mut s, FrameKind::Response),
        Err(WireError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof
    ));
}
