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
