//! The CUDA repack against its CPU reference, bit for bit, over outputs
//! poisoned first: random regions at any alignment in every dtype, and
//! slot-shaped BF16 regions that take the 16-byte path.

#![allow(clippy::unwrap_used)]

use half::bf16;
use lora_kernels::testing::{RepackCase, Rng, cuda_or_skip};
use lora_kernels::{Device, RepackDtype, RepackRegion};

fn same_bits(cpu: &[bf16], gpu: &[bf16], what: &str) {
    assert_eq!(cpu.len(), gpu.len());
    let diff = cpu.iter().zip(gpu).position(|(a, b)| a.to_bits() != b.to_bits());
    assert!(diff.is_none(), "{what}: first difference at element {diff:?}");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn cuda_repack_equals_the_cpu_reference_at_any_alignment() {
    let Some(cuda) = cuda_or_skip("cuda_repack_equals_the_cpu_reference_at_any_alignment") else {
        return;
    };
    let mut rng = Rng::fresh("repack");
    for (n, side) in [(1, 1), (7, 3), (300, 40), (64, 300)] {
        let case = RepackCase::random(&mut rng, n, side);
        let poison = bf16::from_bits(0x7fa1);
        let cpu = case.run(&Device::cpu(), poison).unwrap();
        let gpu = case.run(&cuda, poison).unwrap();
        same_bits(&cpu, &gpu, &format!("{n} regions of side <= {side}"));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn cuda_repack_of_slot_shaped_bf16_pairs_equals_the_cpu_reference() {
    let Some(cuda) = cuda_or_skip("cuda_repack_of_slot_shaped_bf16_pairs_equals_the_cpu_reference") else {
        return;
    };
    let mut rng = Rng::fresh("repack-slot");
    let (stride, inp, out) = (16usize, 2048usize, 1000usize);
    let mut src: Vec<u8> = Vec::new();
    let mut regions = Vec::new();
    let mut dst_at = 0usize;
    for pair in 0..12 {
        // Every rank 1..=stride across the pairs, and one unadapted place.
        let r = if pair == 5 { 0 } else { 1 + (pair * 5) % stride };
        let a_src = src.len();
        let values = rng.bf16_vec(r * inp + out * r, 2.0);
        src.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        src.resize(src.len().next_multiple_of(16), 0);
        let bf = RepackDtype::Bf16 as u32;
        regions.push(RepackRegion {
            src_byte: a_src as u64,
            dst_elem: dst_at as u64,
            rows: r as u32,
            src_cols: inp as u32,
            dst_rows: stride as u32,
            dst_cols: inp as u32,
            dtype: bf,
            pad: 0,
        });
        dst_at += stride * inp;
        regions.push(RepackRegion {
            src_byte: (a_src + 2 * r * inp) as u64,
            dst_elem: dst_at as u64,
            rows: if r == 0 { 0 } else { out as u32 },
            src_cols: r.max(1) as u32,
            dst_rows: out as u32,
            dst_cols: stride as u32,
            dtype: bf,
            pad: 0,
        });
        dst_at += out * stride;
    }
    let case = RepackCase {
        src,
        regions,
        dst_len: dst_at,
    };
    let poison = bf16::from_bits(0xffc3);
    let cpu = case.run(&Device::cpu(), poison).unwrap();
    let gpu = case.run(&cuda, poison).unwrap();
    same_bits(&cpu, &gpu, "slot-shaped pairs");
    assert!(
        cpu.iter().all(|v| v.to_bits() != poison.to_bits()),
        "every element written"
    );
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn cuda_first_non_finite_equals_the_cpu_reference_at_any_alignment() {
    let Some(cuda) = cuda_or_skip("cuda_first_non_finite_equals_the_cpu_reference_at_any_alignment") else {
        return;
    };
    let mut rng = Rng::fresh("repack-scan");
    for (n, side, poisoned) in [(1, 1, 1), (7, 3, 5), (300, 40, 120), (64, 300, 40), (64, 300, 0)] {
        let mut case = RepackCase::random(&mut rng, n, side);
        let expected = case.poison_values(&mut rng, poisoned);
        let cpu = case.first_non_finite(&Device::cpu()).unwrap();
        let gpu = case.first_non_finite(&cuda).unwrap();
        assert_eq!(cpu, expected, "CPU, {n} regions of side <= {side}");
        assert_eq!(gpu, expected, "CUDA, {n} regions of side <= {side}");
    }
    // Large 16-byte-aligned BF16 blocks (the vector path), a hit in a
    // piece and one in the tail of the same region: the piece's wins.
    let inp = 4096usize;
    let mut src = vec![0u8; 2 * (16 * inp + 5)];
    let bf = RepackDtype::Bf16 as u32;
    let region = RepackRegion {
        src_byte: 0,
        dst_elem: 0,
        rows: 1,
        src_cols: (16 * inp + 5) as u32,
        dst_rows: 1,
        dst_cols: (16 * inp + 5) as u32,
        dtype: bf,
        pad: 0,
    };
    for (at, bits) in [(16 * inp + 3, 0x7f80u16), (40_001, 0xffc1)] {
        src[2 * at..2 * at + 2].copy_from_slice(&bits.to_le_bytes());
    }
    let case = RepackCase {
        src,
        regions: vec![region],
        dst_len: 16 * inp + 5,
    };
    assert_eq!(case.first_non_finite(&cuda).unwrap(), vec![Some(40_001)]);
    assert_eq!(case.first_non_finite(&Device::cpu()).unwrap(), vec![Some(40_001)]);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn cuda_gated_repack_equals_the_cpu_reference_and_skips_every_write_after_a_hit() {
    let Some(cuda) = cuda_or_skip("cuda_gated_repack_equals_the_cpu_reference_and_skips_every_write_after_a_hit")
    else {
        return;
    };
    let mut rng = Rng::fresh("repack-gated");
    let poison = bf16::from_bits(0x7fa1);
    for (n, side, poisoned) in [(7, 3, 0), (300, 40, 0), (300, 40, 1), (64, 300, 3)] {
        let mut case = RepackCase::random(&mut rng, n, side);
        let expected = case.poison_values(&mut rng, poisoned);
        let (cpu_found, cpu) = case.run_if_finite(&Device::cpu(), poison).unwrap();
        let (gpu_found, gpu) = case.run_if_finite(&cuda, poison).unwrap();
        let what = format!("{n} regions of side <= {side}, {poisoned} poisoned");
        assert_eq!(cpu_found, expected, "CPU answers, {what}");
        assert_eq!(gpu_found, expected, "CUDA answers, {what}");
        same_bits(&cpu, &gpu, &what);
        if expected.iter().any(Option::is_some) {
            assert!(
                gpu.iter().all(|v| v.to_bits() == poison.to_bits()),
                "{what}: the destination is left as it was"
            );
        }
    }
}
