use super::*;
use crate::testing::{RepackCase, Rng, bf16_carrier};

fn region(src_byte: u64, dst_elem: u64, rows: u32, src_cols: u32, dst_rows: u32, dst_cols: u32) -> RepackRegion {
    RepackRegion {
        src_byte,
        dst_elem,
        rows,
        src_cols,
        dst_rows,
        dst_cols,
        dtype: RepackDtype::Bf16 as u32,
        pad: 0,
    }
}

#[test]
fn the_region_layout_matches_the_cuda_struct() {
    assert_eq!(std::mem::size_of::<RepackRegion>(), 40);
    assert_eq!(std::mem::offset_of!(RepackRegion, rows), 16);
    assert_eq!(std::mem::offset_of!(RepackRegion, dtype), 32);
}

/// Each destination block holds its source block at the top-left, zeros
/// elsewhere, and nothing outside the blocks is touched.
#[test]
fn blocks_land_top_left_with_zeros_around_and_nothing_else_touched() {
    let mut rng = Rng::new(7);
    let case = RepackCase::random(&mut rng, 40, 9);
    let poison = bf16::from_f32(-77.0);
    let out = case.run(&Device::cpu(), poison).unwrap();
    let mut covered = vec![false; case.dst_len];
    for r in &case.regions {
        let dtype = r.dtype().unwrap();
        for row in 0..r.dst_rows as usize {
            for col in 0..r.dst_cols as usize {
                let at = r.dst_elem as usize + row * r.dst_cols as usize + col;
                covered[at] = true;
                let want = if row < r.rows as usize && col < r.src_cols as usize {
                    let i = r.src_byte as usize + (row * r.src_cols as usize + col) * dtype.size();
                    let b = &case.src[i..i + dtype.size()];
                    match dtype {
                        RepackDtype::Bf16 => bf16::from_le_bytes([b[0], b[1]]),
                        RepackDtype::F16 => bf16::from_f32(f16::from_le_bytes([b[0], b[1]]).to_f32()),
                        RepackDtype::F32 => bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                    }
                } else {
                    bf16::ZERO
                };
                assert_eq!(out[at].to_bits(), want.to_bits(), "region {r:?} at ({row}, {col})");
            }
        }
    }
    for (at, c) in covered.iter().enumerate() {
        if !c {
            assert_eq!(out[at].to_bits(), poison.to_bits(), "element {at} outside every region");
        }
    }
}

#[test]
fn regions_outside_either_buffer_or_malformed_are_refused() {
    let device = Device::cpu();
    let src = device.upload(&[bf16::ONE; 8]).unwrap();
    let mut dst = device.upload(&[bf16::ONE; 32]).unwrap();
    let mut scratch = device.alloc_zeros(4).unwrap();
    let mut bad_dtype = region(0, 0, 1, 1, 1, 1);
    bad_dtype.dtype = 9;
    for (what, r, src_bytes) in [
        ("source past its bytes", region(10, 0, 2, 2, 2, 2), 16),
        ("source past src_bytes", region(0, 0, 2, 4, 2, 4), 8),
        ("destination past the end", region(0, 30, 1, 1, 2, 2), 16),
        ("more rows than the block", region(0, 0, 3, 1, 2, 2), 16),
        ("wider than the block", region(0, 0, 1, 3, 2, 2), 16),
        ("unknown dtype", bad_dtype, 16),
        ("huge sizes", region(0, 0, u32::MAX, u32::MAX, u32::MAX, u32::MAX), 16),
    ] {
        let before = dst.download().unwrap();
        let got = repack(&device, &src, src_bytes, &[r], &mut scratch, &mut dst);
        assert!(got.is_err(), "{what}");
        assert_eq!(dst.download().unwrap(), before, "{what}: nothing written");
    }
    assert!(
        repack(&device, &src, 17, &[], &mut scratch, &mut dst).is_err(),
        "src_bytes past the buffer"
    );
    let five = [region(0, 0, 0, 1, 1, 1); 5];
    assert!(
        repack(&device, &src, 16, &five, &mut scratch, &mut dst).is_err(),
        "more regions than scratch"
    );
}

#[test]
fn nan_and_subnormal_sources_convert_like_the_host_packer() {
    let halves = [0x7c01u16, 0xfe00, 0x0001, 0x83ff, 0x7c00, 0x8000];
    let singles = [f32::from_bits(0x7f80_0001), -0.0, 1.0e-40, 3.0e38, f32::INFINITY];
    let mut src: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
    let f32_at = src.len();
    src.extend(singles.iter().flat_map(|v| v.to_le_bytes()));
    let device = Device::cpu();
    let srcbuf = device.upload(&bf16_carrier(&src)).unwrap();
    let mut dst = device.alloc_zeros(16).unwrap();
    let mut scratch = device.alloc_zeros(2).unwrap();
    let mut a = region(0, 0, 1, halves.len() as u32, 1, halves.len() as u32);
    a.dtype = RepackDtype::F16 as u32;
    let mut b = region(f32_at as u64, 8, 1, singles.len() as u32, 1, singles.len() as u32);
    b.dtype = RepackDtype::F32 as u32;
    repack(&device, &srcbuf, src.len(), &[a, b], &mut scratch, &mut dst).unwrap();
    let out = dst.download().unwrap();
    for (i, h) in halves.iter().enumerate() {
        let want = bf16::from_f32(f16::from_bits(*h).to_f32());
        assert_eq!(out[i].to_bits(), want.to_bits(), "f16 {h:#06x}");
    }
    for (i, v) in singles.iter().enumerate() {
        assert_eq!(out[8 + i].to_bits(), bf16::from_f32(*v).to_bits(), "f32 {v}");
    }
}

#[test]
fn random_cases_run_whatever_their_source_length() {
    // One region of side 1 has an empty source (zero rows, no gap) about
    // one time in eight: the empty byte vector's address is not 2-aligned.
    let cases: Vec<RepackCase> = (0..64)
        .map(|seed| RepackCase::random(&mut Rng::new(seed), 1, 1))
        .collect();
    assert!(
        cases.iter().any(|c| c.src.is_empty()),
        "no empty source among the seeds"
    );
    for case in &cases {
        case.run(&Device::cpu(), bf16::from_bits(0x7fa1)).unwrap();
    }
}

#[test]
fn the_first_non_finite_element_of_each_region_is_found() {
    let mut rng = Rng::new(7);
    for (n, side, poisoned) in [(1, 1, 1), (7, 3, 4), (60, 20, 25), (20, 64, 0)] {
        let mut case = RepackCase::random(&mut rng, n, side);
        let expected = case.poison_values(&mut rng, poisoned);
        assert_eq!(
            case.first_non_finite(&Device::cpu()).unwrap(),
            expected,
            "{n} regions of side <= {side}"
        );
    }
}

#[test]
fn a_gated_repack_writes_only_when_every_value_is_finite() {
    let mut rng = Rng::new(11);
    let poison = bf16::from_bits(0x7fa1);
    for (n, side) in [(1, 1), (7, 3), (60, 20)] {
        let mut case = RepackCase::random(&mut rng, n, side);
        let (found, dst) = case.run_if_finite(&Device::cpu(), poison).unwrap();
        assert_eq!(found, vec![None; n], "{n} regions: clean");
        let bits = |v: Vec<bf16>| v.into_iter().map(bf16::to_bits).collect::<Vec<_>>();
        let plain = case.run(&Device::cpu(), poison).unwrap();
        assert_eq!(bits(dst), bits(plain), "{n} regions: written as repack writes");
        let expected = case.poison_values(&mut rng, 2);
        if expected.iter().all(Option::is_none) {
            continue;
        }
        let (found, dst) = case.run_if_finite(&Device::cpu(), poison).unwrap();
        assert_eq!(found, expected, "{n} regions: the scan's answers");
        assert!(
            dst.iter().all(|v| v.to_bits() == poison.to_bits()),
            "{n} regions: a value not finite leaves the destination as it was"
        );
    }
}

#[test]
fn a_gated_repack_over_other_regions_than_the_scan_is_refused() {
    let device = Device::cpu();
    let src = device.upload(&bf16_carrier(&[0u8; 16])).unwrap();
    let mut scratch = device.alloc_zeros(2).unwrap();
    let mut hits = device.alloc_zeros(3).unwrap();
    let mut dst = device.alloc_zeros(16).unwrap();
    let one = [region(0, 0, 1, 1, 1, 1)];
    let two = [region(0, 0, 1, 1, 1, 1), region(2, 4, 1, 1, 1, 1)];
    let scan = queue_value_scan(&device, crate::Lane::Copy, &src, 16, &one, &mut scratch, &mut hits).unwrap();
    let err = repack_if_finite(&device, &scan, &hits, &src, 16, &two, &mut scratch, &mut dst).unwrap_err();
    assert!(err.to_string().contains("value scan covered 1"), "{err}");
}

#[test]
fn an_f32_value_past_bf16_range_counts_as_not_finite_and_the_largest_finite_does_not() {
    // 3.3895e38 rounds to BF16's largest finite value; 3.4e38 rounds past it.
    let mut src = Vec::new();
    for v in [1.0f32, 3.3895e38, -3.3895e38, 3.4e38] {
        src.extend_from_slice(&v.to_le_bytes());
    }
    let mut r = region(0, 0, 1, 4, 1, 4);
    r.dtype = RepackDtype::F32 as u32;
    let case = RepackCase {
        src,
        regions: vec![r],
        dst_len: 4,
    };
    assert_eq!(case.first_non_finite(&Device::cpu()).unwrap(), vec![Some(3)]);
}

#[test]
fn a_scan_outside_the_source_is_refused() {
    let device = Device::cpu();
    let src = device.upload(&bf16_carrier(&[0u8; 16])).unwrap();
    let mut scratch = device.alloc_zeros(2).unwrap();
    let mut hits = device.alloc_zeros(2).unwrap();
    let past = region(8, 0, 1, 8, 1, 8);
    let err = first_non_finite(&device, &src, 16, &[past], &mut scratch, &mut hits).unwrap_err();
    assert!(err.to_string().contains("region source"), "{err}");
    let mut odd = region(0, 0, 1, 1, 1, 1);
    odd.dtype = 9;
    assert!(first_non_finite(&device, &src, 16, &[odd], &mut scratch, &mut hits).is_err());
    let mut short_hits = device.alloc_zeros(1).unwrap();
    let two = [region(0, 0, 1, 1, 1, 1), region(2, 0, 1, 1, 1, 1)];
    let err = first_non_finite(&device, &src, 16, &two, &mut scratch, &mut short_hits).unwrap_err();
    assert!(err.to_string().contains("hits"), "{err}");
}
