use super::*;
use crate::table::PairEntry;
use crate::testing::{RandomPairs, Rng, rel_error};
use proptest::prelude::*;

/// Run the CPU reference on `[n, in]` rows (x stride in + 2) into y (f32,
/// zero, two targets side by side plus a spare column) and compare every
/// row's delta with the f64 oracle computed straight from the weights.
fn check_against_f64(seed: u64, n: usize, in_dim: usize, outs: [usize; 2], stride: usize, ranks: &[u32]) {
    let mut rng = Rng::new(seed);
    let d = Device::cpu();
    let slots = ranks.len();
    let mut pairs: Vec<RandomPairs> = outs
        .iter()
        .map(|&o| RandomPairs::new(&mut rng, in_dim, o, stride, ranks))
        .collect();
    for p in &mut pairs {
        p.poison_padding(); // the reference must never read past a rank
    }
    let weights: Vec<_> = pairs.iter().map(|p| d.upload(&p.data).unwrap()).collect();
    let mut entries: Vec<PairEntry> = Vec::new();
    for (p, w) in pairs.iter().zip(&weights) {
        entries.extend(p.entries(w.device_addr()));
    }
    let table = d.upload(&entries).unwrap();
    let x_stride = in_dim + 2;
    let x_host = rng.bf16_vec(n * x_stride, 1.0);
    let x = d.upload(&x_host).unwrap();
    let idx_host: Vec<i32> = (0..n)
        .map(|i| if i % 5 == 4 { -1 } else { rng.below(slots) as i32 })
        .collect();
    let idx = d.upload(&idx_host).unwrap();
    let width = outs[0] + outs[1] + 1;
    let mut y = d.alloc_zeros::<f32>(n * width).unwrap();
    let targets = [
        LoraTarget {
            table: &table,
            table_offset: 0,
            n_entries: slots,
            out_dim: outs[0],
            y_col_offset: 0,
            dora: None,
        },
        LoraTarget {
            table: &table,
            table_offset: slots,
            n_entries: slots,
            out_dim: outs[1],
            y_col_offset: outs[0],
            dora: None,
        },
    ];
    let xv = Rows {
        buf: &x,
        offset: 0,
        n_rows: n,
        width: in_dim,
        stride: x_stride,
    };
    bgmv(&d, xv, &idx, &targets, stride, RowsMut::dense(&mut y, n, width)).unwrap();
    let got = y.download().unwrap();
    let mut want = vec![0f32; n * width];
    for r in 0..n {
        let xr: Vec<f32> = x_host[r * x_stride..r * x_stride + in_dim]
            .iter()
            .map(|v| v.to_f32())
            .collect();
        if idx_host[r] < 0 {
            continue;
        }
        let mut col = 0;
        for p in &pairs {
            for (o, v) in p.delta_f64(idx_host[r] as usize, &xr).iter().enumerate() {
                want[r * width + col + o] = *v as f32;
            }
            col += p.out_dim;
        }
    }
    let err = rel_error(&got, &want);
    assert!(err < 1e-5, "seed {seed:#x}: relative error {err:e}");
    // The spare column and the no-adapter rows stay exactly zero.
    for r in 0..n {
        assert_eq!(got[r * width + width - 1], 0.0);
        if idx_host[r] < 0 {
            assert!(got[r * width..(r + 1) * width].iter().all(|v| *v == 0.0));
        }
    }
}

#[test]
fn reference_matches_f64_dense_math() {
    check_against_f64(11, 9, 33, [20, 7], 8, &[8, 3, 1, 0, 5]);
}

#[test]
fn reference_serves_every_rank_of_a_padded_pool() {
    let ranks: Vec<u32> = (1..=64).collect();
    check_against_f64(12, 70, 24, [16, 5], 64, &ranks);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    #[test]
    fn reference_matches_f64_on_random_shapes(
        seed in any::<u64>(),
        n in 1usize..20,
        in_dim in 1usize..70,
        o0 in 1usize..30,
        o1 in 1usize..30,
        stride in 1usize..20,
        slots in 1usize..6,
    ) {
        let ranks: Vec<u32> = (0..slots).map(|s| ((seed >> (s * 5)) % (stride as u64 + 1)) as u32).collect();
        check_against_f64(seed, n, in_dim, [o0, o1], stride, &ranks);
    }
}

/// A BF16 y is updated as round(y + delta): compare with f64 to bf16 precision.
#[test]
fn bf16_y_is_rounded_once() {
    let mut rng = Rng::new(21);
    let d = Device::cpu();
    let (n, in_dim, out, stride) = (6, 40, 12, 4);
    let pairs = RandomPairs::new(&mut rng, in_dim, out, stride, &[4, 2]);
    let pool = pairs.upload(&d).unwrap();
    let x_host = rng.bf16_vec(n * in_dim, 1.0);
    let y_host = rng.bf16_vec(n * out, 1.0);
    let x = d.upload(&x_host).unwrap();
    let mut y = d.upload(&y_host).unwrap();
    let idx_host = [0, 1, -1, 1, 0, 0];
    let idx = d.upload(&idx_host).unwrap();
    let t = [LoraTarget {
        table: &pool.table,
        table_offset: 0,
        n_entries: 2,
        out_dim: out,
        y_col_offset: 0,
        dora: None,
    }];
    bgmv(
        &d,
        Rows::dense(&x, n, in_dim),
        &idx,
        &t,
        stride,
        RowsMut::dense(&mut y, n, out),
    )
    .unwrap();
    let got: Vec<f32> = y.download().unwrap().iter().map(|v| v.to_f32()).collect();
    let mut want: Vec<f32> = y_host.iter().map(|v| v.to_f32()).collect();
    for r in 0..n {
        if idx_host[r] >= 0 {
            let xr: Vec<f32> = x_host[r * in_dim..(r + 1) * in_dim]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            for (o, v) in pairs.delta_f64(idx_host[r] as usize, &xr).iter().enumerate() {
                want[r * out + o] = (f64::from(want[r * out + o]) + v) as f32;
            }
        }
    }
    assert!(rel_error(&got, &want) < 1e-2);
    assert_eq!(
        &got[2 * out..3 * out],
        &y_host[2 * out..3 * out].iter().map(|v| v.to_f32()).collect::<Vec<_>>()[..]
    );
}

struct Small {
    d: Device,
    pool: crate::testing::PairPool,
    x: DeviceBuffer<bf16>,
    y: DeviceBuffer<f32>,
}

fn small() -> Small {
    let d = Device::cpu();
    let pairs = RandomPairs::new(&mut Rng::new(3), 8, 4, 4, &[4, 4]);
    let pool = pairs.upload(&d).unwrap();
    let x = d.upload(&[bf16::ONE; 16]).unwrap();
    let y = d.upload(&[1.0f32; 8]).unwrap();
    Small { d, pool, x, y }
}

#[test]
fn an_index_past_the_table_is_an_error_and_y_is_untouched() {
    let mut s = small();
    let idx = s.d.upload(&[0i32, 2]).unwrap();
    let t = [LoraTarget {
        table: &s.pool.table,
        table_offset: 0,
        n_entries: 2,
        out_dim: 4,
        y_col_offset: 0,
        dora: None,
    }];
    let r = bgmv(
        &s.d,
        Rows::dense(&s.x, 2, 8),
        &idx,
        &t,
        4,
        RowsMut::dense(&mut s.y, 2, 4),
    );
    assert!(
        matches!(
            r,
            Err(KernelError::BadIndex {
                position: 1,
                index: 2,
                n_entries: 2,
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(s.y.download().unwrap(), [1.0; 8]);
}

#[test]
fn bad_entries_and_dangling_addresses_are_errors() {
    let mut s = small();
    let idx = s.d.upload(&[0i32, 1]).unwrap();
    let good = s.pool.table.download().unwrap();
    let cases = [
        (PairEntry { rank: 5, ..good[1] }, "rank above stride"),
        (PairEntry { a: 0, ..good[1] }, "null A"),
        (
            PairEntry {
                b: good[1].b + 2,
                ..good[1]
            },
            "B running past the pool",
        ),
        (
            PairEntry {
                a: 0xdead_0000,
                ..good[1]
            },
            "A nowhere",
        ),
    ];
    for (bad, what) in cases {
        let table = s.d.upload(&[good[0], bad]).unwrap();
        let t = [LoraTarget {
            table: &table,
            table_offset: 0,
            n_entries: 2,
            out_dim: 4,
            y_col_offset: 0,
            dora: None,
        }];
        let r = bgmv(
            &s.d,
            Rows::dense(&s.x, 2, 8),
            &idx,
            &t,
            4,
            RowsMut::dense(&mut s.y, 2, 4),
        );
        assert!(
            matches!(r, Err(KernelError::BadEntry { .. } | KernelError::BadAddress { .. })),
            "{what}: {r:?}"
        );
        assert_eq!(s.y.download().unwrap(), [1.0; 8], "{what}: y untouched");
    }
    // A freed pool: its addresses no longer resolve.
    let table = s.d.upload(&good).unwrap();
    drop(s.pool);
    let t = [LoraTarget {
        table: &table,
        table_offset: 0,
        n_entries: 2,
        out_dim: 4,
        y_col_offset: 0,
        dora: None,
    }];
    let r = bgmv(
        &s.d,
        Rows::dense(&s.x, 2, 8),
        &idx,
        &t,
        4,
        RowsMut::dense(&mut s.y, 2, 4),
    );
    assert!(matches!(r, Err(KernelError::BadAddress { .. })), "freed pool: {r:?}");
}

#[test]
fn arguments_are_validated() {
    let mut s = small();
    let idx = s.d.upload(&[0i32]).unwrap();
    let t = [LoraTarget {
        table: &s.pool.table,
        table_offset: 0,
        n_entries: 2,
        out_dim: 4,
        y_col_offset: 0,
        dora: None,
    }];
    let x = Rows::dense(&s.x, 2, 8);
    assert!(matches!(
        bgmv(&s.d, x, &idx, &t, 4, RowsMut::dense(&mut s.y, 2, 4)),
        Err(KernelError::OutOfBounds { .. })
    ));
    let idx = s.d.upload(&[0i32, 1]).unwrap();
    assert!(bgmv(&s.d, x, &idx, &t, 0, RowsMut::dense(&mut s.y, 2, 4)).is_err());
    assert!(bgmv(&s.d, x, &idx, &t, BGMV_MAX_RANK + 1, RowsMut::dense(&mut s.y, 2, 4)).is_err());
    assert!(
        bgmv(&s.d, x, &idx, &t, 4, RowsMut::dense(&mut s.y, 1, 4)).is_err(),
        "row count mismatch"
    );
    assert!(bgmv(&s.d, x, &idx, &[], 4, RowsMut::dense(&mut s.y, 2, 4)).is_err());
    let other = Device::cpu();
    let idx2 = other.upload(&[0i32, 1]).unwrap();
    assert!(matches!(
        bgmv(&s.d, x, &idx2, &t, 4, RowsMut::dense(&mut s.y, 2, 4)),
        Err(KernelError::DeviceMismatch { .. })
    ));
    assert_eq!(s.y.download().unwrap(), [1.0; 8]);
}

pub(super) fn shape(in_dim: usize, max_out: usize, stride: usize) -> PlanShape {
    PlanShape {
        in_dim,
        max_out,
        stride,
        y_size: 2,
        cluster: 8,
        push: stride <= plan::PUSH_SUM_MAX_STRIDE,
        tensor_cores: true,
    }
}

/// Every region of the plan is 16-byte aligned, holds what the kernel puts
/// there, and the regions follow each other without overlap.
fn check_plan(p: &SmemPlan, s: PlanShape, stages: usize) {
    for off in [p.off_y, p.off_t, p.off_a, p.off_x, p.off_r, p.total] {
        assert_eq!(off % 16, 0, "{p:?}");
    }
    // B rows: whole 16-byte chunks, padded by 8 columns except in clusters of 2.
    let pad = if s.cluster == 2 { 0 } else { 8 };
    assert_eq!(p.b_pitch, s.stride.div_ceil(8) * 8 + pad, "{p:?}");
    assert!(p.off_y >= p.lo_max * p.b_pitch * 2);
    assert!(p.off_t - p.off_y >= ITEM_ROWS * p.lo_max * s.y_size);
    let red = if s.tensor_cores { 8 * 128 * 4 } else { 0 };
    assert!(p.off_a - p.off_t >= 2 * ITEM_ROWS * s.stride * 4 + red);
    // A stages hold whole 16-row tiles of padded rows.
    assert!(p.off_x - p.off_a >= stages * s.stride.div_ceil(16) * 16 * (p.k_chunk + 8) * 2);
    assert!(p.off_r - p.off_x >= stages * ITEM_ROWS * (p.k_chunk + 8) * 2);
    // Push form: two receive buffers of one [G][stride8] f32 slot per cluster rank.
    let recv = if s.push {
        2 * s.cluster * ITEM_ROWS * s.stride.div_ceil(8) * 8 * 4
    } else {
        0
    };
    assert!(p.total - p.off_r >= recv, "{p:?}");
    assert_eq!(p.k_chunk % 8, 0);
    // Whole 16-output tiles of B rows stay inside the B region.
    assert_eq!(p.lo_max % 16, 0, "{p:?}");
    // The block's output piece never exceeds lo_max.
    assert!(piece8(piece8(s.max_out, p.splits), s.cluster) <= p.lo_max);
}

#[test]
fn smem_plans_of_the_bench_shapes_fit_two_or_three_blocks_per_sm() {
    let s = shape(4096, 4096, 16);
    let p = SmemPlan::choose(s, 1, false);
    assert_eq!((p.splits, p.k_chunk), (1, 512), "{p:?}");
    assert!(p.total <= SmemPlan::BUDGETS[0]);
    check_plan(&p, s, 1);
    let s = shape(4096, 4096, 64);
    let p = SmemPlan::choose(s, 1, false);
    assert!(p.total <= SmemPlan::BUDGETS[1], "{p:?}");
    check_plan(&p, s, if p.k_chunk < 512 { 2 } else { 1 });
    let s = shape(4096, 14336, 16);
    let p = SmemPlan::choose(s, 1, false);
    assert!(p.total <= SmemPlan::BUDGETS[1], "{p:?}");
    check_plan(&p, s, 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn smem_plans_are_consistent(in_dim in 1usize..20_000, out in 1usize..40_000, stride in 1usize..=256, s0 in 1usize..9, fixed in any::<bool>(), push in any::<bool>(), tensor_cores in any::<bool>(), cluster in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)]) {
        let s = PlanShape { push, tensor_cores, cluster, ..shape(in_dim, out, stride) };
        let p = SmemPlan::choose(s, s0, fixed);
        let slice = piece8(in_dim, cluster);
        let stages = if p.k_chunk < slice { 2 } else { 1 };
        check_plan(&p, s, stages);
        prop_assert!(p.k_chunk <= slice.max(8));
        if fixed { prop_assert_eq!(p.splits, s0); }
    }
}

const H200: DeviceLimits = DeviceLimits::H200;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn two_phase_plans_fit_the_scratch(
        n in 1usize..=WINDOW_MAX,
        in_dim in 1usize..40_000,
        stride in 1usize..=BGMV_MAX_RANK,
        targets in 1usize..=MAX_TARGETS,
        y_size in prop_oneof![Just(2usize), Just(4usize)],
        cols in proptest::option::of(0u32..10_000),
    ) {
        let slots = row_form_expand_slots(H200.multiprocessors, targets);
        let p = TwoPhasePlan::new(n, in_dim, stride, targets, 4096, y_size, cols, SCRATCH_BYTES, slots).unwrap();
        prop_assert!(p.scratch_bytes <= SCRATCH_BYTES);
        prop_assert!((1..=TWO_PHASE_MAX_SPLITS).contains(&p.ks_max));
        // Every slice keeps at least one warp-wide pass of columns, unless `in` is below that.
        prop_assert!(p.ks_max == 1 || in_dim / p.ks_max >= TWO_PHASE_MIN_SLICE);
        prop_assert!(p.cols >= 8 && p.cols.is_multiple_of(8));
        prop_assert!(p.expand_smem <= H200.smem_optin);
    }

    /// The expand's units: one row each, at most 4096 outputs (the default
    /// in equal chunks of a row, one unit per resident block where the rows
    /// allow), and shared memory for that one row.
    #[test]
    fn two_phase_units_fit_one_row(
        n in 1usize..=WINDOW_MAX,
        stride in 1usize..=BGMV_MAX_RANK,
        max_out in 1usize..60_000,
        y_size in prop_oneof![Just(2usize), Just(4usize)],
        cols in proptest::option::of(0u32..10_000),
        slots in 1usize..2048,
    ) {
        let p = TwoPhasePlan::new(n, 4096, stride, 1, max_out, y_size, cols, SCRATCH_BYTES, slots).unwrap();
        prop_assert!(p.cols >= 8 && p.cols <= 4096 && p.cols.is_multiple_of(8));
        if cols.is_none() {
            prop_assert!(TWO_PHASE_ROW_COLS.contains(&p.cols));
            let chunks = max_out.div_ceil(p.cols);
            // Never more units than blocks, unless the chunks are at a bound.
            prop_assert!(n * chunks <= slots.max(n) || TWO_PHASE_ROW_COLS.start() == &p.cols || TWO_PHASE_ROW_COLS.end() == &p.cols);
        }
        let rpad = stride.div_ceil(8) * 8;
        prop_assert_eq!(p.expand_smem, p.cols * (4 + y_size) + rpad * 4);
        prop_assert!(p.expand_smem <= H200.smem_optin);
    }
}

#[test]
fn two_phase_serves_single_windows_only() {
    assert!(TwoPhasePlan::new(WINDOW_MAX + 1, 4096, 16, 1, 4096, 2, None, SCRATCH_BYTES, 528).is_none());
    assert!(TwoPhasePlan::new(0, 4096, 16, 1, 4096, 2, None, SCRATCH_BYTES, 528).is_none());
    // Partials that cannot fit the scratch even once.
    assert!(TwoPhasePlan::new(512, 4096, 256, 4, 4096, 2, None, 1 << 20, 528).is_none());
    // On the H200's 528 expand blocks: 64 rows get 8 chunks each.
    let p = TwoPhasePlan::new(64, 4096, 64, 1, 4096, 2, None, SCRATCH_BYTES, 528).unwrap();
    assert_eq!((p.ks_max, p.cols), (16, 512));
    let p = TwoPhasePlan::new(64, 4096, 16, 1, 14336, 2, None, SCRATCH_BYTES, 528).unwrap();
    assert_eq!(p.cols, 1792);
    // Three targets (q, k, v) share the blocks: 176 each, 2 chunks of a row.
    assert_eq!(row_form_expand_slots(132, 1), 528);
    assert_eq!(row_form_expand_slots(132, 3), 176);
    assert_eq!(row_form_expand_slots(1, 4), 1);
    let slots = row_form_expand_slots(132, 3);
    let p = TwoPhasePlan::new(64, 4096, 16, 3, 4096, 2, None, SCRATCH_BYTES, slots).unwrap();
    assert_eq!(p.cols, 2048);
}

proptest! {
    /// The K slices (computed here, passed to both kernels) stay inside the
    /// partials the scratch holds (`ks_max`), fill the shrink's grid at most
    /// once, and are a power of two, the largest that does.
    #[test]
    fn two_phase_slices_fit_the_scratch_and_the_grid(
        n in 1usize..=512,
        ks_max in 1usize..=TWO_PHASE_MAX_SPLITS,
        grid in 1usize..=2048,
    ) {
        let ks = two_phase_slices(grid, n, ks_max);
        prop_assert!((1..=ks_max).contains(&ks));
        prop_assert!(n * ks <= grid || ks == 1);
        prop_assert!(ks.is_power_of_two());
        prop_assert!(2 * ks > (grid / n).clamp(1, ks_max));
    }
}

#[test]
fn item_lists_fit_the_scratch_of_large_batches() {
    // Every single window, for every target.
    assert!(item_list_fits(WINDOW_MAX, 1, MAX_TARGETS));
    // Windows of 256 rows: a list is 16 KiB + 64 bytes per target.
    assert!(item_list_fits(WINDOW_LARGE, 100, 1));
    assert!(!item_list_fits(WINDOW_LARGE, 200, 4));
    assert!(!item_list_fits(usize::MAX / 2, 4, 4));
    assert_eq!(item_list_stride(256), Some(64 * 257));
}

#[test]
fn every_tensor_core_fused_kernel_has_a_list_form() {
    let name = |cluster, y, tensor_cores, listed| {
        kernels::DecodeKernel::Fused {
            cluster,
            tensor_cores,
            listed,
            y,
        }
        .name(kernels::Epilogue::Plain)
    };
    for cluster in [1, 2, 8] {
        for y in [OutputKind::Bf16, OutputKind::F32] {
            let scan = name(cluster, y, true, false).unwrap();
            let list = name(cluster, y, true, true).unwrap();
            assert_eq!(list, format!("{scan}_list"));
            assert!(name(cluster, y, false, false).is_some());
            assert!(name(cluster, y, false, true).is_none(), "no scalar list kernels");
        }
    }
    assert!(name(3, OutputKind::Bf16, true, true).is_none());
}

#[test]
fn windows_hold_512_rows_past_one_window_only_with_the_item_list() {
    for n in [1, 300, WINDOW_MAX] {
        assert_eq!(row_windows(n, true, 1), (n, 1));
        assert_eq!(row_windows(n, false, 1), (n, 1));
    }
    assert_eq!(row_windows(WINDOW_MAX + 1, true, 1), (WINDOW_MAX, 2));
    assert_eq!(row_windows(1024, true, 3), (WINDOW_MAX, 2));
    assert_eq!(row_windows(1024, false, 1), (WINDOW_LARGE, 4));
    // Lists past the scratch: the scanning form's windows.
    let huge = 300 * WINDOW_MAX;
    assert!(!item_list_fits(WINDOW_MAX, huge.div_ceil(WINDOW_MAX), 1));
    assert_eq!(row_windows(huge, true, 1), (WINDOW_LARGE, huge.div_ceil(WINDOW_LARGE)));
}
