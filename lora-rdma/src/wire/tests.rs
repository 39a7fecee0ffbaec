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
