use std::io::{Read, Write};
use std::net::TcpListener;
use std::thread::JoinHandle;

use lora_pool::image::ImageError;

use super::*;
use crate::manifest::WirePlacement;
use crate::protocol::{PeerRefusal, RefusalCode};
use crate::wire::write_frame;

/// A one-connection server running `script` on the accepted stream.
fn serve(script: impl FnOnce(TcpStream) + Send + 'static) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let handle = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        script(stream);
    });
    (addr, handle)
}

fn options(io_timeout_ms: u64) -> TcpOptions {
    TcpOptions {
        connect_timeout: Duration::from_secs(2),
        io_timeout: Duration::from_millis(io_timeout_ms),
        ..TcpOptions::default()
    }
}

/// Skip the engine's request frame.
fn skip_request(stream: &mut TcpStream) -> Request {
    recv_json(stream, FrameKind::Request).unwrap()
}

struct VecSink(Vec<Vec<u8>>);

impl LandingSink for VecSink {
    fn region(&mut self, index: usize) -> Result<&mut [u8], TransportError> {
        self.0
            .get_mut(index)
            .map(Vec::as_mut_slice)
            .ok_or(TransportError::NoSuchOp(index))
    }
}

fn tcp_op(offset: u64, len: usize) -> ReadOp {
    ReadOp {
        location: Location::Tcp { region: 3, offset },
        len,
    }
}

#[test]
fn ranges_land_in_order_across_frames() {
    let big = crate::wire::MAX_DATA_BYTES as usize + 10;
    let (addr, server) = serve(move |mut s| {
        let Request::Read { ranges } = skip_request(&mut s) else {
            panic!()
        };
        assert_eq!(ranges.len(), 2);
        assert_eq!(
            ranges[1],
            ReadRange {
                region: 3,
                offset: 100,
                len: big as u64
            }
        );
        write_frame(&mut s, FrameKind::Data, &[1, 2, 3]).unwrap();
        let payload: Vec<u8> = (0..big).map(|i| i as u8).collect();
        for (i, len) in data_frame_lens(big).enumerate() {
            let start = i * crate::wire::MAX_DATA_BYTES as usize;
            write_frame(&mut s, FrameKind::Data, &payload[start..start + len]).unwrap();
        }
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    let mut sink = VecSink(vec![vec![0; 3], vec![0; big]]);
    t.read(&[tcp_op(0, 3), tcp_op(100, big)], &mut sink).unwrap();
    assert_eq!(sink.0[0], [1, 2, 3]);
    assert!(sink.0[1].iter().enumerate().all(|(i, &b)| b == i as u8));
    server.join().unwrap();
}

#[test]
fn a_data_frame_of_the_wrong_length_is_refused_before_reading_it() {
    let (addr, server) = serve(|mut s| {
        skip_request(&mut s);
        write_frame(&mut s, FrameKind::Data, &[9; 5]).unwrap();
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    let mut sink = VecSink(vec![vec![0; 4]]);
    let err = t.read(&[tcp_op(0, 4)], &mut sink).unwrap_err();
    assert!(
        matches!(err, TransportError::Wire(WireError::Malformed { .. })),
        "{err}"
    );
    assert_eq!(sink.0[0], [0; 4]);
    server.join().unwrap();
}

#[test]
fn a_refusal_instead_of_data_is_a_typed_error() {
    let (addr, server) = serve(|mut s| {
        skip_request(&mut s);
        let r = Response::Refused(PeerRefusal::new(RefusalCode::BadRead, "region 3 is not staged"));
        send_json(&mut s, FrameKind::Response, &r).unwrap();
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    let err = t.read(&[tcp_op(0, 4)], &mut VecSink(vec![vec![0; 4]])).unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Refused(PeerRefusal {
                code: RefusalCode::BadRead,
                ..
            })
        ),
        "{err}"
    );
    server.join().unwrap();
}

#[test]
fn a_silent_peer_is_a_timeout_and_a_closed_one_a_lost_connection() {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (addr, server) = serve(move |mut s| {
        skip_request(&mut s);
        // Stay silent until the engine gave up.
        let _ = rx.recv();
    });
    let mut t = TcpTransport::connect(&addr, options(200)).unwrap();
    let err = t.fetch_manifest("a", 16, 16, WirePlacement::SINGLE).unwrap_err();
    assert!(matches!(err, TransportError::Timeout(_)), "{err}");
    tx.send(()).unwrap();
    server.join().unwrap();

    let (addr, server) = serve(|mut s| {
        skip_request(&mut s);
        write_frame(&mut s, FrameKind::Data, &[1, 2]).unwrap();
        // Dropped mid-range.
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    let err = t
        .read(
            &[tcp_op(0, 2), tcp_op(2, 8)],
            &mut VecSink(vec![vec![0; 2], vec![0; 8]]),
        )
        .unwrap_err();
    assert!(matches!(err, TransportError::Disconnected(_)), "{err}");
    server.join().unwrap();
}

#[test]
fn a_truncated_or_oversized_manifest_is_a_typed_error() {
    let (addr, server) = serve(|mut s| {
        skip_request(&mut s);
        let mut frame = Vec::new();
        write_frame(&mut frame, FrameKind::Response, b"{\"Manifest\":{\"adapter\":\"a\"").unwrap();
        s.write_all(&frame[..frame.len() - 4]).unwrap();
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    assert!(matches!(
        t.fetch_manifest("a", 16, 16, WirePlacement::SINGLE).unwrap_err(),
        TransportError::Disconnected(_)
    ));
    server.join().unwrap();

    let (addr, server) = serve(|mut s| {
        skip_request(&mut s);
        let mut header = Vec::new();
        write_frame(&mut header, FrameKind::Response, b"").unwrap();
        header[8..12].copy_from_slice(&(crate::wire::MAX_RESPONSE_BYTES + 1).to_le_bytes());
        s.write_all(&header).unwrap();
        // The engine must refuse without waiting for the payload.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    assert!(matches!(
        t.fetch_manifest("a", 16, 16, WirePlacement::SINGLE).unwrap_err(),
        TransportError::Wire(WireError::Oversized { .. })
    ));
    drop(t);
    server.join().unwrap();
}

#[test]
fn rdma_locations_and_short_regions_are_refused() {
    let (addr, server) = serve(|_| {});
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    let rdma = ReadOp {
        location: Location::Rdma { addr: 0x1000, rkey: 1 },
        len: 4,
    };
    let err = t
        .read(&[tcp_op(0, 4), rdma], &mut VecSink(vec![vec![0; 4]; 2]))
        .unwrap_err();
    assert!(matches!(err, TransportError::Location { index: 1, .. }), "{err}");
    server.join().unwrap();

    struct Refusing;
    impl LandingSink for Refusing {
        fn region(&mut self, _: usize) -> Result<&mut [u8], TransportError> {
            Err(ImageError::Undeclared {
                key: lora_layout::PairKey::Expert {
                    layer: 0,
                    site: lora_layout::ExpertSite::Router,
                },
            }
            .into())
        }
    }
    let (addr, server) = serve(|mut s| {
        skip_request(&mut s);
        skip_request(&mut s);
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    assert!(matches!(
        t.read(&[tcp_op(0, 4)], &mut Refusing),
        Err(TransportError::Landing(_))
    ));
    assert!(matches!(
        t.read(&[tcp_op(0, 4)], &mut VecSink(vec![vec![0; 3]])),
        Err(TransportError::RegionLength {
            got: 3,
            expected: 4,
            ..
        })
    ));
    server.join().unwrap();
}

#[test]
fn the_configured_peer_is_lora_peer() {
    let (addr, server) = serve(|_| {});
    let opts = LoraOptions {
        peer: Some(addr),
        ..LoraOptions::default()
    };
    assert!(TcpTransport::connect_configured(&opts, options(5000)).is_ok());
    server.join().unwrap();
    assert!(matches!(
        TcpTransport::connect_configured(&LoraOptions::default(), options(5000)),
        Err(TransportError::NoPeer)
    ));
}

#[test]
fn an_unreachable_peer_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    assert!(matches!(
        TcpTransport::connect(&addr, options(500)),
        Err(TransportError::Connect { .. })
    ));
}

#[test]
fn many_ranges_travel_in_few_requests() {
    let n = MAX_READ_RANGES + 7;
    let (addr, server) = serve(move |mut s| {
        let mut sizes = Vec::new();
        while sizes.iter().sum::<usize>() < n {
            let Request::Read { ranges } = skip_request(&mut s) else {
                panic!()
            };
            for r in &ranges {
                write_frame(&mut s, FrameKind::Data, &[r.offset as u8]).unwrap();
            }
            sizes.push(ranges.len());
        }
        assert_eq!(sizes, [MAX_READ_RANGES, 7]);
    });
    let ops: Vec<ReadOp> = (0..n as u64).map(|i| tcp_op(i, 1)).collect();
    let mut sink = VecSink(vec![vec![0]; n]);
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    t.read(&ops, &mut sink).unwrap();
    assert!(sink.0.iter().enumerate().all(|(i, b)| b[0] == i as u8));
    server.join().unwrap();
}

/// A peer that trickles bytes just inside the per-read timeout is cut off
/// at the call's overall deadline, and the connection is then refused.
#[test]
fn a_trickling_peer_hits_the_overall_deadline() {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (addr, server) = serve(move |mut s| {
        skip_request(&mut s);
        let mut frame = Vec::new();
        write_frame(&mut frame, FrameKind::Data, &[7; 64]).unwrap();
        for b in frame {
            if rx.try_recv().is_ok() || s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let opts = TcpOptions {
        connect_timeout: Duration::from_secs(2),
        // Each byte comes well within the per-read timeout...
        io_timeout: Duration::from_millis(200),
        // ...but the call is due within 2 x 0.2 s + 64 B / 1 KiB/s = 0.46 s
        // in all, while the trickle takes 76 x 50 ms = 3.8 s.
        min_rate: 1024,
    };
    let mut t = TcpTransport::connect(&addr, opts).unwrap();
    let started = Instant::now();
    let err = t.read(&[tcp_op(0, 64)], &mut VecSink(vec![vec![0; 64]])).unwrap_err();
    assert!(matches!(err, TransportError::Deadline(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    let again = t.fetch_manifest("a", 16, 16, WirePlacement::SINGLE).unwrap_err();
    assert!(matches!(again, TransportError::Broken(_)), "{again}");
    tx.send(()).ok();
    server.join().unwrap();
}

/// A data frame after the last one a read asked for ends the read with a
/// typed error, and the connection is not used again.
#[test]
fn an_extra_data_frame_is_out_of_protocol_order() {
    let (addr, server) = serve(|mut s| {
        skip_request(&mut s);
        // Both frames in one write, so they arrive together.
        let mut frames = Vec::new();
        write_frame(&mut frames, FrameKind::Data, &[1, 2, 3, 4]).unwrap();
        write_frame(&mut frames, FrameKind::Data, &[5, 6]).unwrap();
        s.write_all(&frames).unwrap();
        s.flush().unwrap();
        // Keep the connection open until the engine is done.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    let err = t.read(&[tcp_op(0, 4)], &mut VecSink(vec![vec![0; 4]])).unwrap_err();
    assert!(matches!(err, TransportError::Protocol(_)), "{err}");
    let again = t.read(&[tcp_op(0, 4)], &mut VecSink(vec![vec![0; 4]])).unwrap_err();
    assert!(matches!(again, TransportError::Broken(_)), "{again}");
    drop(t);
    server.join().unwrap();
}

/// A sink that records each `landed` call with the region's bytes at that
/// moment.
struct Recording {
    regions: Vec<Vec<u8>>,
    landed: Vec<(usize, Vec<u8>)>,
}

impl LandingSink for Recording {
    fn region(&mut self, index: usize) -> Result<&mut [u8], TransportError> {
        self.regions
            .get_mut(index)
            .map(Vec::as_mut_slice)
            .ok_or(TransportError::NoSuchOp(index))
    }

    fn landed(&mut self, index: usize) {
        self.landed.push((index, self.regions[index].clone()));
    }
}

/// The transport says each region landed once it is whole (a range of
/// several frames included), in op order, and says nothing of a range it
/// did not finish.
#[test]
fn each_region_is_said_landed_once_it_is_whole() {
    let big = crate::wire::MAX_DATA_BYTES as usize + 3;
    let (addr, server) = serve(move |mut s| {
        skip_request(&mut s);
        write_frame(&mut s, FrameKind::Data, &[1, 2]).unwrap();
        let payload: Vec<u8> = (0..big).map(|i| (i % 7) as u8).collect();
        let mut at = 0;
        for len in data_frame_lens(big) {
            write_frame(&mut s, FrameKind::Data, &payload[at..at + len]).unwrap();
            at += len;
        }
        write_frame(&mut s, FrameKind::Data, &[9; 3]).unwrap();
        // The fourth range gets a frame of the wrong length.
        write_frame(&mut s, FrameKind::Data, &[5; 4]).unwrap();
    });
    let mut t = TcpTransport::connect(&addr, options(5000)).unwrap();
    let mut sink = Recording {
        regions: vec![vec![0; 2], vec![0; big], vec![0; 3], vec![0; 8]],
        landed: Vec::new(),
    };
    let ops = [tcp_op(0, 2), tcp_op(10, big), tcp_op(0, 3), tcp_op(0, 8)];
    let err = t.read(&ops, &mut sink).unwrap_err();
    assert!(
        matches!(err, TransportError::Wire(WireError::Malformed { .. })),
        "{err}"
    );
    let said: Vec<usize> = sink.landed.iter().map(|(i, _)| *i).collect();
    assert_eq!(said, [0, 1, 2]);
    assert_eq!(sink.landed[0].1, [1, 2]);
    assert!(sink.landed[1].1.iter().enumerate().all(|(i, &b)| b == (i % 7) as u8));
    assert_eq!(sink.landed[2].1, [9; 3]);
    server.join().unwrap();
}
