use super::*;
use proptest::prelude::*;

fn frame(kind: FrameKind, payload: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    write_frame(&mut buf, kind, payload).unwrap();
    buf
}

#[test]
fn frames_round_trip() {
    let buf = frame(FrameKind::Request, b"{\"x\":1}");
    assert_eq!(
        read_frame(&mut buf.as_slice(), FrameKind::Request).unwrap(),
        b"{\"x\":1}"
    );
    let buf = frame(FrameKind::Data, &[7u8; 300]);
    let mut dst = [0u8; 300];
    read_data_into(&mut buf.as_slice(), &mut dst).unwrap();
    assert_eq!(dst, [7u8; 300]);
}

#[test]
fn a_truncated_frame_is_an_io_error() {
    let buf = frame(FrameKind::Response, b"hello world");
    for cut in 0..buf.len() {
        let err = read_frame(&mut &buf[..cut], FrameKind::Response).unwrap_err();
        assert!(
            matches!(err, WireError::Io(ref e) if e.kind() == io::ErrorKind::UnexpectedEof),
            "{cut}: {err}"
        );
    }
}

#[test]
fn an_oversized_frame_is_refused_before_reading_it() {
    let mut buf = frame(FrameKind::Response, b"");
    buf[8..12].copy_from_slice(&(MAX_RESPONSE_BYTES + 1).to_le_bytes());
    let err = read_frame(&mut buf.as_slice(), FrameKind::Response).unwrap_err();
    assert!(
        matches!(
            err,
            WireError::Oversized {
                kind: FrameKind::Response,
                ..
            }
        ),
        "{err}"
    );
    let mut buf = frame(FrameKind::Request, b"");
    buf[8..12].copy_from_slice(&(MAX_CONTROL_BYTES + 1).to_le_bytes());
    assert!(matches!(
        read_frame(&mut buf.as_slice(), FrameKind::Request),
        Err(WireError::Oversized {
            kind: FrameKind::Request,
            ..
        })
    ));
    let big = vec![0u8; MAX_CONTROL_BYTES as usize + 1];
    assert!(matches!(
        write_frame(&mut Vec::new(), FrameKind::Request, &big),
        Err(WireError::Oversized { .. })
    ));
}

#[test]
fn wrong_magic_version_kind_and_length_are_refused() {
    let good = frame(FrameKind::Request, b"{}");
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(
        read_frame(&mut bad.as_slice(), FrameKind::Request),
        Err(WireError::BadMagic(_))
    ));
    let mut bad = good.clone();
    bad[4] = 9;
    assert!(matches!(
        read_frame(&mut bad.as_slice(), FrameKind::Request),
        Err(WireError::Version { got: 9 })
    ));
    // A peer of the previous protocol version (whole-pair manifests, no
    // placement, no DoRA magnitudes) is refused by type.
    let mut old = good.clone();
    old[4..6].copy_from_slice(&1u16.to_le_bytes());
    assert!(matches!(
        read_frame(&mut old.as_slice(), FrameKind::Request),
        Err(WireError::Version { got: 1 })
    ));
    let mut bad = good.clone();
    bad[6] = 77;
    assert!(matches!(
        read_frame(&mut bad.as_slice(), FrameKind::Request),
        Err(WireError::UnknownKind(77))
    ));
    assert!(matches!(
        read_frame(&mut good.as_slice(), FrameKind::Response),
        Err(WireError::UnexpectedKind { .. })
    ));
    let data = frame(FrameKind::Data, &[1, 2, 3]);
    assert!(matches!(
        read_data_into(&mut data.as_slice(), &mut [0u8; 4]),
        Err(WireError::Malformed { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = read_frame(&mut bytes.as_slice(), FrameKind::Request);
        let _ = recv_json::<serde_json::Value>(&mut bytes.as_slice(), FrameKind::Response);
    }
}

/// A reader that records the largest buffer it was asked to fill: the
/// decoder's allocation for a frame (it reads a payload into a buffer of
/// exactly the announced length).
struct Tracking<'a> {
    bytes: &'a [u8],
    largest: usize,
}

impl Read for Tracking<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.largest = self.largest.max(buf.len());
        self.bytes.read(buf)
    }
}

/// What [`read_frame`] must make of `bytes` when it expects `expected`,
/// decided from the format alone.
fn oracle(bytes: &[u8], expected: FrameKind) -> Result<Vec<u8>, &'static str> {
    if bytes.len() < HEADER_BYTES {
        return Err("eof");
    }
    if bytes[..4] != MAGIC {
        return Err("magic");
    }
    if u16::from_le_bytes([bytes[4], bytes[5]]) != PROTOCOL_VERSION {
        return Err("version");
    }
    let kind = match u16::from_le_bytes([bytes[6], bytes[7]]) {
        1 => FrameKind::Request,
        2 => FrameKind::Response,
        3 => FrameKind::Data,
        _ => return Err("kind"),
    };
    let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if len > kind.limit() {
        return Err("oversized");
    }
    if kind != expected {
        return Err("unexpected");
    }
    bytes
        .get(HEADER_BYTES..HEADER_BYTES + len as usize)
        .map(<[u8]>::to_vec)
        .ok_or("eof")
}

fn class(e: &WireError) -> &'static str {
    match e {
        WireError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => "eof",
        WireError::Io(_) => "io",
        WireError::BadMagic(_) => "magic",
        WireError::Version { .. } => "version",
        WireError::UnknownKind(_) => "kind",
        WireError::Oversized { .. } => "oversized",
        WireError::UnexpectedKind { .. } => "unexpected",
        WireError::Malformed { .. } => "malformed",
    }
}

/// Frame-shaped bytes: the magic and version mostly right, a kind code
/// among the known ones and a few others, a length around the payload or
/// around a kind's limit, and an arbitrary payload.
fn framey() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![4 => Just(MAGIC), 1 => any::<[u8; 4]>()],
        prop_oneof![4 => Just(PROTOCOL_VERSION), 1 => any::<u16>()],
        prop_oneof![Just(1u16), Just(2), Just(3), Just(0), Just(4), any::<u16>()],
        prop_oneof![Just(None), (-3i64..4).prop_map(Some),],
        prop_oneof![
            Just(0u32),
            Just(MAX_CONTROL_BYTES),
            Just(MAX_CONTROL_BYTES + 1),
            Just(MAX_DATA_BYTES),
            Just(MAX_DATA_BYTES + 1),
            Just(MAX_RESPONSE_BYTES),
            Just(MAX_RESPONSE_BYTES + 1),
            Just(u32::MAX),
            any::<u32>(),
        ],
        prop::collection::vec(any::<u8>(), 0..200),
        0usize..12,
    )
        .prop_map(|(magic, version, kind, near_payload, far, payload, cut)| {
            let len = match near_payload {
                Some(d) => (payload.len() as i64 + d).max(0) as u32,
                None => far,
            };
            let mut out = magic.to_vec();
            out.extend_from_slice(&version.to_le_bytes());
            out.extend_from_slice(&kind.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&payload);
            // Now and then a header cut short.
            if cut < 2 {
                out.truncate(cut * 7);
            }
            out
        })
}

/// A JSON payload of a control message, mangled.
fn json_payload() -> impl Strategy<Value = Vec<u8>> {
    let good = vec![
        br#"{"Manifest":{"adapter":"a","max_rank":16,"expert_rank":16,"transport":"Tcp"}}"#.to_vec(),
        br#"{"Refused":{"code":"NotFound","message":"x"}}"#.to_vec(),
        br#"{"Read":{"ranges":[[0,18446744073709551615]]}}"#.to_vec(),
        b"null".to_vec(),
        b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[".to_vec(),
    ];
    (
        prop::sample::select(good),
        prop::collection::vec((0usize..400, any::<u8>()), 0..4),
        prop::option::of(0usize..400),
    )
        .prop_map(|(mut p, flips, cut)| {
            for (at, b) in flips {
                if !p.is_empty() {
                    let i = at % p.len();
                    p[i] = b;
                }
            }
            if let Some(c) = cut {
                p.truncate(c);
            }
            p
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Any bytes: the decoder's answer is exactly what the format says
    /// (the payload, or the one typed error that applies), and it never
    /// asks for a buffer larger than the frame header or the announced
    /// length, which is at most the kind's limit.
    #[test]
    fn the_decoder_answers_any_bytes_by_the_format(
        bytes in prop_oneof![framey(), prop::collection::vec(any::<u8>(), 0..64)],
    ) {
        for expected in [FrameKind::Request, FrameKind::Response, FrameKind::Data] {
            let mut r = Tracking { bytes: &bytes, largest: 0 };
            let got = read_frame(&mut r, expected);
            let want = oracle(&bytes, expected);
            match (&got, &want) {
                (Ok(p), Ok(w)) => prop_assert_eq!(p, w),
                (Err(e), Err(w)) => prop_assert_eq!(class(e), *w, "{}", e),
                _ => prop_assert!(false, "read_frame {:?}, the format says {:?}", got.map(|p| p.len()), want),
            }
            if let Err(e) = &got {
                prop_assert!(!e.to_string().is_empty());
            }
            let announced = if bytes.len() >= HEADER_BYTES && want != Err("oversized") {
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize
            } else {
                0
            };
            prop_assert!(r.largest <= HEADER_BYTES.max(announced), "asked for {} bytes", r.largest);
            prop_assert!(r.largest <= HEADER_BYTES.max(expected.limit() as usize));

            // The header alone, and a data frame into a buffer of any size.
            let mut r = Tracking { bytes: &bytes, largest: 0 };
            if let Ok((kind, len)) = read_header(&mut r) {
                prop_assert!(len <= kind.limit() as usize);
            }
            prop_assert!(r.largest <= HEADER_BYTES);
            let mut dst = vec![0u8; bytes.len() % 97];
            let mut r = Tracking { bytes: &bytes, largest: 0 };
            match read_data_into(&mut r, &mut dst) {
                Ok(()) => prop_assert_eq!(oracle(&bytes, FrameKind::Data).map(|p| p.len()), Ok(dst.len())),
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
            prop_assert!(r.largest <= HEADER_BYTES.max(dst.len()));

            // And decoding, as every message type the two ends exchange.
            let _ = recv_json::<crate::protocol::Request>(&mut bytes.as_slice(), expected);
            let _ = recv_json::<crate::protocol::Response>(&mut bytes.as_slice(), expected);
        }
    }

    /// Control frames of mangled JSON decode to the message or to
    /// `Malformed`, never anything else, as both message types.
    #[test]
    fn mangled_control_payloads_are_malformed_not_panics(payload in json_payload()) {
        for kind in [FrameKind::Request, FrameKind::Response] {
            let buf = frame(kind, &payload);
            for res in [
                recv_json::<crate::protocol::Request>(&mut buf.as_slice(), kind).map(|_| ()),
                recv_json::<crate::protocol::Response>(&mut buf.as_slice(), kind).map(|_| ()),
                recv_json::<serde_json::Value>(&mut buf.as_slice(), kind).map(|_| ()),
            ] {
                if let Err(e) = res {
                    prop_assert!(
                        matches!(&e, WireError::Malformed { kind: k, reason } if *k == kind && !reason.is_empty()),
                        "{}", e
                    );
                }
            }
        }
    }

    /// A stream of frames read until the first error: every successful
    /// read consumes a header, so the loop ends, and the frames read are
    /// the stream's.
    #[test]
    fn a_stream_of_frames_is_read_to_its_first_error(
        frames in prop::collection::vec((0u16..4, prop::collection::vec(any::<u8>(), 0..40)), 0..6),
        tail in prop::collection::vec(any::<u8>(), 0..20),
    ) {
        let mut stream = Vec::new();
        for (kind, payload) in &frames {
            let kind = FrameKind::from_code(*kind).unwrap_or(FrameKind::Data);
            stream.extend_from_slice(&frame(kind, payload));
        }
        stream.extend_from_slice(&tail);
        let mut r = stream.as_slice();
        let mut read = 0;
        while let Ok((_, len)) = read_header(&mut r) {
            let mut payload = vec![0u8; len];
            if r.read_exact(&mut payload).is_err() {
                break;
            }
            read += 1;
            prop_assert!(read <= frames.len() + tail.len() / HEADER_BYTES);
        }
        prop_assert!(read >= frames.len());
    }
}

/// A writer that takes at most `step` bytes per call (cycling through the
/// steps), vectored or not, as a socket under pressure does.
struct Trickle {
    out: Vec<u8>,
    steps: Vec<usize>,
    calls: usize,
}

impl Write for Trickle {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let step = self.steps[self.calls % self.steps.len()];
        self.calls += 1;
        let n = buf.len().min(step);
        self.out.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut left = self.steps[self.calls % self.steps.len()];
        self.calls += 1;
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(left);
            self.out.extend_from_slice(&b[..take]);
            n += take;
            left -= take;
            if left == 0 {
                break;
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The vectored writer puts the same bytes on the wire as the plain
    /// one, however the writer cuts its calls, and the decoder reads the
    /// frame back.
    #[test]
    fn a_vectored_frame_is_the_same_frame(
        code in 1u16..4,
        payload in prop::collection::vec(any::<u8>(), 0..300),
        steps in prop::collection::vec(1usize..40, 1..5),
    ) {
        let kind = FrameKind::from_code(code).unwrap_or(FrameKind::Data);
        let mut w = Trickle { out: Vec::new(), steps, calls: 0 };
        write_frame_vectored(&mut w, kind, &payload).unwrap();
        prop_assert_eq!(&w.out, &frame(kind, &payload));
        let mut r = w.out.as_slice();
        prop_assert_eq!(read_header(&mut r).unwrap(), (kind, payload.len()));
        prop_assert_eq!(r, payload.as_slice());
    }
}

#[test]
fn a_vectored_frame_over_its_limit_writes_nothing() {
    let big = vec![0u8; MAX_CONTROL_BYTES as usize + 1];
    let mut out = Vec::new();
    assert!(matches!(
        write_frame_vectored(&mut out, FrameKind::Request, &big),
        Err(WireError::Oversized { .. })
    ));
    assert!(out.is_empty());
}

#[test]
fn a_writer_that_takes_nothing_is_an_error_not_a_loop() {
    struct Full;
    impl Write for Full {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Ok(0)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let err = write_frame_vectored(&mut Full, FrameKind::Data, &[1, 2, 3]).unwrap_err();
    assert!(
        matches!(err, WireError::Io(ref e) if e.kind() == io::ErrorKind::WriteZero),
        "{err}"
    );
}
