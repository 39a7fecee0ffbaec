use proptest::prelude::*;

use super::*;
use crate::wire::MAX_CONTROL_BYTES;

#[test]
fn a_full_read_request_fits_a_control_frame() {
    let widest = ReadRange {
        region: u32::MAX,
        offset: u64::MAX,
        len: u64::MAX,
    };
    let request = Request::Read {
        ranges: vec![widest; MAX_READ_RANGES],
    };
    let bytes = serde_json::to_vec(&request).unwrap();
    assert!(bytes.len() <= MAX_CONTROL_BYTES as usize, "{} bytes", bytes.len());
}

#[test]
fn ranges_outside_their_region_are_refused() {
    let range = |offset, len| ReadRange { region: 0, offset, len };
    assert_eq!(range(0, 10).within(10), Some(0..10));
    assert_eq!(range(4, 6).within(10), Some(4..10));
    assert_eq!(range(10, 0).within(10), Some(10..10));
    assert_eq!(range(4, 7).within(10), None);
    assert_eq!(range(11, 0).within(10), None);
    assert_eq!(range(u64::MAX, 2).within(10), None);
    assert_eq!(range(2, u64::MAX).within(usize::MAX), None);
}

fn endpoint() -> Endpoint {
    Endpoint {
        lid: 7,
        qpn: 0x12_3456,
        psn: 0xab_cdef,
        gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        mtu: 5,
        rd_atomic: 16,
    }
}

#[test]
fn endpoints_round_trip_and_are_range_checked() {
    let e = endpoint();
    let json = serde_json::to_vec(&Request::Connect { endpoint: e }).unwrap();
    assert_eq!(
        serde_json::from_slice::<Request>(&json).unwrap(),
        Request::Connect { endpoint: e }
    );
    assert_eq!(e.validate(), Ok(()));
    let with = |f: fn(&mut Endpoint)| {
        let mut e = endpoint();
        f(&mut e);
        e.validate()
    };
    assert_eq!(
        with(|e| e.qpn = 1 << 24),
        Err(EndpointError::Wide {
            field: "qpn",
            value: 1 << 24
        })
    );
    assert!(matches!(
        with(|e| e.psn = u32::MAX),
        Err(EndpointError::Wide { field: "psn", .. })
    ));
    assert_eq!(with(|e| e.qpn = 1), Err(EndpointError::ReservedQp(1)));
    assert_eq!(with(|e| e.mtu = 0), Err(EndpointError::Mtu(0)));
    assert_eq!(with(|e| e.mtu = 6), Err(EndpointError::Mtu(6)));
    assert_eq!(with(|e| e.rd_atomic = 0), Err(EndpointError::RdAtomic(0)));
    // A GID of the wrong length does not decode.
    let bad = r#"{"Connect":{"endpoint":{"lid":1,"qpn":5,"psn":1,"gid":[1,2,3],"mtu":3,"rd_atomic":1}}}"#;
    assert!(serde_json::from_str::<Request>(bad).is_err());
}

#[test]
fn refusals_round_trip() {
    let r = Response::Refused(PeerRefusal::new(RefusalCode::BadRead, "region 9 is not staged"));
    let json = serde_json::to_vec(&r).unwrap();
    assert_eq!(serde_json::from_slice::<Response>(&json).unwrap(), r);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn data_frames_tile_a_range(len in 0usize..(3 * MAX_DATA_BYTES as usize + 5)) {
        let lens: Vec<usize> = data_frame_lens(len).collect();
        prop_assert_eq!(lens.iter().sum::<usize>(), len);
        prop_assert!(lens.iter().all(|&l| l > 0 && l <= MAX_DATA_BYTES as usize));
        // Only the last frame may be short.
        prop_assert!(lens.iter().rev().skip(1).all(|&l| l == MAX_DATA_BYTES as usize));
    }
}
