use proptest::prelude::*;

use super::*;

/// An H200's limits (132 multiprocessors, 228 KiB of shared memory each, 227 KiB per block).
fn h200(n_rows: usize, in_dim: usize, stride: usize, out_dims: &[usize], y_size: usize) -> StreamShape<'_> {
    StreamShape {
        n_rows,
        in_dim,
        stride,
        out_dims,
        y_size,
        sms: 132,
        smem_per_sm: 228 * 1024,
        smem_optin: 227 * 1024,
    }
}

#[test]
fn the_bench_shapes_fit_with_several_stages() {
    for (n, stride, out) in [
        (1, 16, 4096),
        (16, 16, 4096),
        (64, 16, 4096),
        (64, 64, 4096),
        (256, 16, 4096),
        (64, 16, 14336),
    ] {
        let outs = [out];
        let p = StreamPlan::new(h200(n, 4096, stride, &outs, 2), DEFAULT_UNIT_BYTES).unwrap();
        assert!(p.n_stages >= 2, "{n} {stride} {out}: {p:?}");
        assert_eq!(p.k_slice * stride * 2, DEFAULT_UNIT_BYTES);
        assert_eq!(p.kp, p.k_slice + 8);
    }
}

#[test]
fn units_grow_until_the_partials_fit_the_scratch() {
    // 1 KiB units of rank stride 16: 128 K slices, partials of 17 MB.
    let shape = h200(512, 4096, 16, &[4096; 4], 2);
    let p = StreamPlan::new(shape, 1024).unwrap();
    assert!(p.part_off + p.part_bytes(shape) <= SCRATCH_BYTES);
    assert!(p.k_slice > 8);
}

#[test]
fn units_too_large_for_two_stages_are_halved() {
    // A short `in` leaves A small while 32 KiB of B rows of stride 8 span 2048 outputs.
    let p = StreamPlan::new(h200(33, 96, 8, &[4097], 2), 32 * 1024).unwrap();
    assert!(p.n_stages >= 2 && p.o_slice < 2048);
}

#[test]
fn refuses_what_the_kernel_cannot_serve() {
    // More than one window of rows.
    assert!(StreamPlan::new(h200(WINDOW_MAX + 1, 4096, 16, &[4096], 2), DEFAULT_UNIT_BYTES).is_none());
    assert!(StreamPlan::new(h200(0, 4096, 16, &[4096], 2), DEFAULT_UNIT_BYTES).is_none());
    assert!(StreamPlan::new(h200(4, 4096, 16, &[], 2), DEFAULT_UNIT_BYTES).is_none());
    // No room for two stages on a device with little shared memory.
    let mut small = h200(4, 4096, 256, &[4096], 4);
    small.smem_per_sm = 64 * 1024;
    assert!(StreamPlan::new(small, 64 * 1024).is_none());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every region the kernel addresses lies inside the block's shared
    /// memory and the scratch, 16-byte aligned, and no batch can hand a
    /// block more units than it holds.
    #[test]
    fn plan_regions_hold_what_the_kernel_reads(
        n in 1usize..=512,
        in_dim in 1usize..20_000,
        stride in 1usize..=256,
        outs in proptest::collection::vec(1usize..20_000, 1..=MAX_TARGETS),
        f32_y in any::<bool>(),
        unit_kib in 1usize..=64,
    ) {
        let y_size = if f32_y { 4 } else { 2 };
        let shape = h200(n, in_dim, stride, &outs, y_size);
        let Some(p) = StreamPlan::new(shape, unit_kib * 1024) else {
            // Refused only when no unit size it tries has both a ring of two
            // stages and partials inside the scratch.
            let mut unit = unit_kib * 1024;
            while StreamPlan::layout(shape, unit).is_none() && unit > MIN_UNIT_BYTES {
                unit /= 2;
            }
            while let Some(l) = StreamPlan::layout(shape, unit) {
                prop_assert!(l.part_off + l.part_bytes(shape) > SCRATCH_BYTES);
                unit *= 2;
            }
            return Ok(());
        };
        prop_assert!(p.k_slice % 8 == 0 && p.o_slice % 8 == 0 && p.k_slice > 0 && p.o_slice > 0);
        prop_assert!(p.n_ks * p.k_slice >= in_dim && (p.n_ks - 1) * p.k_slice < in_dim);
        prop_assert!((2..=MAX_STAGES).contains(&p.n_stages));
        prop_assert!(p.rows_off % 16 == 0 && p.stage_bytes % 16 == 0 && p.t_off % 16 == 0);
        // Weights: A rows of the slice (whole 16-rank tiles), or B rows of
        // the output slice (whole 16-output tiles), at 16-byte pitches past
        // what a tile reads.
        prop_assert!(p.kp >= p.k_slice + 8 && p.kp % 8 == 0 && p.bp >= stride.div_ceil(8) * 8 && p.bp % 8 == 0);
        prop_assert!(stride.div_ceil(16) * 16 * p.kp * 2 <= p.rows_off);
        prop_assert!(p.o_slice.div_ceil(16) * 16 * p.bp * 2 <= p.rows_off);
        // Rows: the item's x over the slice, or its y over the output slice.
        prop_assert!(p.rows_off + ITEM_ROWS * p.kp * 2 <= p.stage_bytes);
        prop_assert!(p.rows_off + ITEM_ROWS * p.o_slice * y_size <= p.stage_bytes);
        prop_assert!(p.t_off >= p.n_stages * p.stage_bytes);
        prop_assert!(p.smem >= p.t_off + ITEM_ROWS * stride.div_ceil(8) * 8 * 4);
        prop_assert!(p.smem + STATIC_SMEM <= shape.smem_optin);
        prop_assert!(BLOCKS_PER_SM * (p.smem + STATIC_SMEM + 1024) <= shape.smem_per_sm);
        // Lists, then partials, inside the scratch.
        prop_assert!(p.part_off >= outs.len() * p.list_stride && p.part_off % 256 == 0);
        prop_assert!(p.part_off + outs.len() * p.n_ks * n * stride * 4 <= SCRATCH_BYTES);
        let most_units: usize = outs.iter().map(|&o| n * (p.n_ks + o.div_ceil(p.o_slice))).sum();
        prop_assert!(most_units <= p.grid * MAX_UNITS_PER_BLOCK && p.grid >= 264);
    }
}
