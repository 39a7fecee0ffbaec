use half::bf16;

use super::*;
use crate::ops::bgmv::bgmv;
use crate::testing::{PairPool, RandomPairs, Rng, rel_error, widen};

/// Two targets' random slots (ranks below, at and past the part size, and
/// an empty slot), padding poisoned with NaN so a read past a rank shows.
fn two_targets(rng: &mut Rng, in_dim: usize, stride: usize) -> Vec<RandomPairs> {
    let ranks = [stride as u32, 5, 0, 9, 1];
    [7usize, 12]
        .iter()
        .map(|&out| {
            let mut p = RandomPairs::new(rng, in_dim, out, stride, &ranks);
            p.poison_padding();
            p
        })
        .collect()
}

/// The part `w` tables of `pools`: each entry's A moved to its block of
/// rank rows (contiguous rows of the padded `[stride, in]` A), B and rank
/// as they are.
fn part_tables(
    device: &Device,
    pairs: &[RandomPairs],
    pools: &[PairPool],
    part: RankPart,
) -> Vec<DeviceBuffer<PairEntry>> {
    pairs
        .iter()
        .zip(pools)
        .map(|(p, pool)| {
            let mut entries = p.entries(pool.weights.device_addr());
            for e in &mut entries {
                if e.rank > 0 {
                    e.a += (part.part * part.len() * p.in_dim * 2) as u64;
                }
            }
            device.upload(&entries).unwrap()
        })
        .collect()
}

fn targets<'a>(tables: &'a [DeviceBuffer<PairEntry>], pairs: &[RandomPairs]) -> Vec<LoraTarget<'a>> {
    let mut col = 0;
    tables
        .iter()
        .zip(pairs)
        .map(|(table, p)| {
            let t = LoraTarget {
                table,
                table_offset: 0,
                n_entries: p.ranks.len(),
                out_dim: p.out_dim,
                y_col_offset: col,
                dora: None,
            };
            col += p.out_dim;
            t
        })
        .collect()
}

/// The split apply over `world` ranks on one device, the all-gather done
/// on the host (each part downloaded, concatenated in rank order): `y0`
/// plus every row's delta. Each part buffer starts as NaN: the shrink must
/// write all of it.
fn split_apply<Y: OutputElem>(
    device: &Device,
    pairs: &[RandomPairs],
    x: &[bf16],
    slots: &[i32],
    world: usize,
    y0: &[Y],
) -> Vec<Y> {
    let n = slots.len();
    let in_dim = pairs[0].in_dim;
    let stride = pairs[0].stride;
    let pools: Vec<PairPool> = pairs.iter().map(|p| p.upload(device).unwrap()).collect();
    let x_d = device.upload(x).unwrap();
    let slots_d = device.upload(slots).unwrap();
    let mut gathered = Vec::new();
    for w in 0..world {
        let part = RankPart {
            part: w,
            parts: world,
            stride,
        };
        let tables = part_tables(device, pairs, &pools, part);
        let t = targets(&tables, pairs);
        let len = part.part_len(n, t.len()).unwrap();
        let mut out = device.upload(&vec![f32::NAN; len + 3]).unwrap();
        shrink_part(device, Rows::dense(&x_d, n, in_dim), &slots_d, &t, part, &mut out).unwrap();
        device.check_faults().unwrap();
        let got = out.download().unwrap();
        assert!(got[len..].iter().all(|v| v.is_nan()), "past the part: untouched");
        assert!(
            got[..len].iter().all(|v| v.is_finite()),
            "every element of the part written"
        );
        gathered.extend_from_slice(&got[..len]);
    }
    let whole: Vec<DeviceBuffer<PairEntry>> = pools
        .iter()
        .map(|p| device.upload(&p.table.download().unwrap()).unwrap())
        .collect();
    let t = targets(&whole, pairs);
    let width: usize = pairs.iter().map(|p| p.out_dim).sum();
    let gathered_d = device.upload(&gathered).unwrap();
    let mut y = device.upload(y0).unwrap();
    let part = RankPart {
        part: 0,
        parts: world,
        stride,
    };
    expand_gathered(
        device,
        &gathered_d,
        &slots_d,
        &t,
        part,
        RowsMut::dense(&mut y, n, width),
    )
    .unwrap();
    device.check_faults().unwrap();
    y.download().unwrap()
}

/// The fused apply (bgmv) of the same pairs: the half-sharded result.
fn fused_apply<Y: OutputElem>(device: &Device, pairs: &[RandomPairs], x: &[bf16], slots: &[i32], y0: &[Y]) -> Vec<Y> {
    let n = slots.len();
    let pools: Vec<PairPool> = pairs.iter().map(|p| p.upload(device).unwrap()).collect();
    let tables: Vec<DeviceBuffer<PairEntry>> = pools
        .iter()
        .map(|p| device.upload(&p.table.download().unwrap()).unwrap())
        .collect();
    let t = targets(&tables, pairs);
    let width: usize = pairs.iter().map(|p| p.out_dim).sum();
    let x_d = device.upload(x).unwrap();
    let slots_d = device.upload(slots).unwrap();
    let mut y = device.upload(y0).unwrap();
    bgmv(
        device,
        Rows::dense(&x_d, n, pairs[0].in_dim),
        &slots_d,
        &t,
        pairs[0].stride,
        RowsMut::dense(&mut y, n, width),
    )
    .unwrap();
    device.check_faults().unwrap();
    y.download().unwrap()
}

/// On the CPU, every world size's split apply equals the fused apply bit
/// for bit (same f32 sums in the same order), and both are within 1e-5 of
/// the f64 oracle.
#[test]
fn the_split_apply_over_any_world_equals_the_fused_apply() {
    let d = Device::cpu();
    let mut rng = Rng::new(46);
    let (in_dim, stride) = (24, 16);
    let pairs = two_targets(&mut rng, in_dim, stride);
    let slots = [0i32, 1, -1, 3, 2, 4, 0, 1];
    let n = slots.len();
    let x = rng.bf16_vec(n * in_dim, 1.0);
    let width = 19;
    let y0: Vec<f32> = (0..n * width).map(|_| rng.uniform()).collect();
    let fused = fused_apply(&d, &pairs, &x, &slots, &y0);
    for world in [1, 2, 4, 8, 16] {
        let split = split_apply(&d, &pairs, &x, &slots, world, &y0);
        assert_eq!(split, fused, "world {world}");
    }
    let xs = widen(&x);
    let mut oracle = y0.clone();
    for (i, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let mut col = 0;
        for p in &pairs {
            for (o, v) in p
                .delta_f64(s as usize, &xs[i * in_dim..(i + 1) * in_dim])
                .iter()
                .enumerate()
            {
                oracle[i * width + col + o] += *v as f32;
            }
            col += p.out_dim;
        }
    }
    assert!(rel_error(&fused, &oracle) < 1e-5);
}

#[test]
fn bad_parts_rows_and_entries_are_refused_and_write_nothing() {
    let d = Device::cpu();
    let mut rng = Rng::new(47);
    let pairs = two_targets(&mut rng, 8, 8);
    let pools: Vec<PairPool> = pairs.iter().map(|p| p.upload(&d).unwrap()).collect();
    let tables: Vec<DeviceBuffer<PairEntry>> = pools
        .iter()
        .map(|p| d.upload(&p.table.download().unwrap()).unwrap())
        .collect();
    let t = targets(&tables, &pairs);
    let x = d.upload(&rng.bf16_vec(2 * 8, 1.0)).unwrap();
    let good = d.upload(&[0i32, 1]).unwrap();
    let bad = d.upload(&[0i32, 9]).unwrap();
    let part = |part, parts| RankPart { part, parts, stride: 8 };
    let mut out = d.upload(&[7.0f32; 2 * 2 * 4]).unwrap();
    let shrink = |slots, p, out: &mut DeviceBuffer<f32>| shrink_part(&d, Rows::dense(&x, 2, 8), slots, &t, p, out);
    assert!(shrink(&good, part(0, 3), &mut out).is_err(), "8 rank rows in 3 parts");
    assert!(shrink(&good, part(2, 2), &mut out).is_err(), "part past the parts");
    assert!(
        shrink(&good, part(0, 1), &mut out).is_err(),
        "out too short for a whole part"
    );
    let err = shrink(&bad, part(1, 2), &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::BadIndex {
                arg: "row_slot",
                position: 1,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(out.download().unwrap(), vec![7.0; 16], "nothing written");
    let gathered = d.upload(&[1.0f32; 2 * 2 * 8]).unwrap();
    let mut y = d.upload(&[3.0f32; 2 * 19]).unwrap();
    let err = expand_gathered(&d, &gathered, &bad, &t, part(0, 2), RowsMut::dense(&mut y, 2, 19)).unwrap_err();
    assert!(matches!(err, KernelError::BadIndex { .. }), "{err}");
    let short = d.upload(&[1.0f32; 2 * 2 * 8 - 1]).unwrap();
    assert!(expand_gathered(&d, &short, &good, &t, part(0, 2), RowsMut::dense(&mut y, 2, 19)).is_err());
    // A target carrying a DoRA epilogue: neither half applies one.
    let g_table = d.upload(&[0u64; 5]).unwrap();
    let mut with_dora = targets(&tables, &pairs);
    with_dora[0].dora = Some(crate::ops::dora::DoraEpilogue {
        table: &g_table,
        table_offset: 0,
        bias: None,
    });
    let err = shrink_part(&d, Rows::dense(&x, 2, 8), &good, &with_dora, part(0, 2), &mut out).unwrap_err();
    assert!(err.to_string().contains("DoRA"), "{err}");
    let err = expand_gathered(
        &d,
        &gathered,
        &good,
        &with_dora,
        part(0, 2),
        RowsMut::dense(&mut y, 2, 19),
    )
    .unwrap_err();
    assert!(err.to_string().contains("DoRA"), "{err}");
    assert_eq!(out.download().unwrap(), vec![7.0; 16], "nothing written");
    assert_eq!(y.download().unwrap(), vec![3.0; 38], "nothing written");
}

/// CUDA against the CPU reference on fresh random inputs: every world size,
/// f32 and BF16 outputs, padding poisoned with NaN, each part buffer
/// poisoned with NaN before its shrink.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn the_split_apply_on_cuda_equals_the_cpu_reference() {
    let Some(gpu) = crate::testing::cuda_or_skip("the_split_apply_on_cuda_equals_the_cpu_reference") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("the_split_apply_on_cuda_equals_the_cpu_reference");
    for (in_dim, stride) in [(24, 16), (200, 64), (4096, 32)] {
        let pairs = two_targets(&mut rng, in_dim, stride);
        let n = 37;
        let slots: Vec<i32> = (0..n).map(|_| rng.below(6) as i32 - 1).collect();
        let x = rng.bf16_vec(n * in_dim, 1.0);
        let width = 19;
        let y0: Vec<f32> = (0..n * width).map(|_| rng.uniform()).collect();
        let y0_bf: Vec<bf16> = y0.iter().map(|&v| bf16::from_f32(v)).collect();
        for world in [1, 2, 4, 8] {
            let want = split_apply(&cpu, &pairs, &x, &slots, world, &y0);
            let got = split_apply(&gpu, &pairs, &x, &slots, world, &y0);
            let err = rel_error(&got, &want);
            assert!(err < 1e-5, "in {in_dim} stride {stride} world {world}: f32 error {err}");
            let want = widen(&split_apply(&cpu, &pairs, &x, &slots, world, &y0_bf));
            let got = widen(&split_apply(&gpu, &pairs, &x, &slots, world, &y0_bf));
            let err = rel_error(&got, &want);
            assert!(
                err < 1e-2,
                "in {in_dim} stride {stride} world {world}: bf16 error {err}"
            );
        }
    }
}

/// The names the launches use are the source's entry points.
#[test]
fn the_launched_names_are_the_sources_kernels() {
    let src = include_str!("../../../cuda/rank_split.cu");
    for name in [
        "rank_shrink_part",
        "rank_expand_gathered_f32",
        "rank_expand_gathered_bf16",
    ] {
        assert!(src.contains(&format!("extern \"C\" __global__ void {name}(")), "{name}");
    }
}
