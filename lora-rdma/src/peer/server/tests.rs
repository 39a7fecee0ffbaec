use std::path::Path;

use lora_layout::ModelConfig;

use super::*;
use crate::peer::StoreOptions;
use crate::wire::{read_frame, write_frame};

fn peer(max_connections: usize) -> PeerHandle {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let mut store = PeerStore::new(cfg, StoreOptions::default());
    store.add_adapter("r4", &dir.join("demo_r4_plain")).unwrap();
    let options = PeerOptions {
        max_connections,
        ..PeerOptions::default()
    };
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

#[test]
fn connections_past_the_limit_are_refused_busy() {
    let handle = peer(1);
    let mut first = connect(&handle);
    // The first connection is served (its thread holds the only slot).
    let unknown = Request::Manifest {
        adapter: "nope".into(),
        max_rank: 8,
        expert_rank: 16,
        transport: crate::protocol::TransportKind::Tcp,
    };
    let r = ask(&mut first, &unknown);
    assert!(
        matches!(
            r,
            Response::Refused(PeerRefusal {
                code: RefusalCode::UnknownAdapter,
                ..
            })
        ),
        "{r:?}"
    );
    let mut second = connect(&handle);
    let busy: Response = recv_json(&mut second, FrameKind::Response).unwrap();
    assert!(
        matches!(
            busy,
            Response::Refused(PeerRefusal {
                code: RefusalCode::Busy,
                ..
            })
        ),
        "{busy:?}"
    );
    drop(first);
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
