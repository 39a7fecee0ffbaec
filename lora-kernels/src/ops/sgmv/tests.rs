use super::*;
use crate::WorkspaceSpec;
use crate::testing::{RandomPairs, Rng, rel_error};

struct Case {
    d: Device,
    pairs: RandomPairs,
    pool: crate::testing::PairPool,
    x_host: Vec<bf16>,
    x: DeviceBuffer<bf16>,
    n: usize,
    ws: LoraWorkspace,
}

fn case(seed: u64, n: usize, in_dim: usize, out: usize, stride: usize, ranks: &[u32]) -> Case {
    let mut rng = Rng::new(seed);
    let d = Device::cpu();
    let mut pairs = RandomPairs::new(&mut rng, in_dim, out, stride, ranks);
    pairs.poison_padding();
    let pool = pairs.upload(&d).unwrap();
    let x_host = rng.bf16_vec(n * in_dim, 1.0);
    let x = d.upload(&x_host).unwrap();
    let spec = WorkspaceSpec {
        max_rows: n,
        max_rank: stride,
        max_segments: 16,
        max_targets: 1,
    };
    let ws = LoraWorkspace::new(&d, spec).unwrap();
    Case {
        d,
        pairs,
        pool,
        x_host,
        x,
        n,
        ws,
    }
}

impl Case {
    fn run(&mut self, grouping: Option<(&[i32], &[i32])>, entry: usize) -> Result<Vec<f32>, KernelError> {
        let (n, in_dim, out) = (self.n, self.pairs.in_dim, self.pairs.out_dim);
        let mut y = self.d.alloc_zeros::<f32>(n * out)?;
        let slots = self.pairs.ranks.len();
        let t = [LoraTarget {
            table: &self.pool.table,
            table_offset: 0,
            n_entries: slots,
            out_dim: out,
            y_col_offset: 0,
        }];
        let (x, yv) = (Rows::dense(&self.x, n, in_dim), RowsMut::dense(&mut y, n, out));
        match grouping {
            Some((cu, slot)) => {
                let cu = self.d.upload(cu)?;
                let seg_slot = self.d.upload(slot)?;
                let s = Segments {
                    cu_seqlens: &cu,
                    seg_slot: &seg_slot,
                    n_segments: slot.len(),
                };
                sgmv(&self.d, x, &s, &t, self.pairs.stride, yv, &mut self.ws)?;
            }
            None => one_adapter(&self.d, x, entry, &t, self.pairs.stride, yv, &mut self.ws)?,
        }
        y.download()
    }

    /// The f64 oracle for per-row entries (-1: none).
    fn oracle(&self, row_entry: &[i32]) -> Vec<f32> {
        let (in_dim, out) = (self.pairs.in_dim, self.pairs.out_dim);
        let mut want = vec![0f32; self.n * out];
        for (r, &e) in row_entry.iter().enumerate() {
            if e >= 0 {
                let xr: Vec<f32> = self.x_host[r * in_dim..(r + 1) * in_dim]
                    .iter()
                    .map(|v| v.to_f32())
                    .collect();
                for (o, v) in self.pairs.delta_f64(e as usize, &xr).iter().enumerate() {
                    want[r * out + o] = *v as f32;
                }
            }
        }
        want
    }
}

#[test]
fn segments_match_the_f64_oracle() {
    let mut c = case(31, 40, 37, 19, 8, &[8, 1, 5, 0]);
    // Segments: 0..7 slot 2, 7..7 empty, 7..20 none, 20..33 slot 0, 33..40 slot 3 (rank 0).
    let cu = [0, 7, 7, 20, 33, 40];
    let slot = [2, 1, -1, 0, 3];
    let got = c.run(Some((&cu, &slot)), 0).unwrap();
    let mut rows = vec![-1i32; 40];
    rows[..7].fill(2);
    rows[20..33].fill(0);
    let want = c.oracle(&rows);
    assert!(rel_error(&got, &want) < 1e-5);
    assert!(
        got[7 * 19..20 * 19].iter().all(|v| *v == 0.0),
        "rows of no segment adapter stay untouched"
    );
}

#[test]
fn rows_outside_every_segment_are_untouched() {
    let mut c = case(32, 20, 16, 8, 4, &[4, 2]);
    let got = c.run(Some((&[5, 9], &[1])), 0).unwrap();
    let mut rows = vec![-1i32; 20];
    rows[5..9].fill(1);
    assert!(rel_error(&got, &c.oracle(&rows)) < 1e-5);
}

#[test]
fn one_adapter_is_one_segment_over_every_row() {
    let mut c = case(33, 25, 30, 11, 16, &[3, 16]);
    let a = c.run(None, 1).unwrap();
    let b = c.run(Some((&[0, 25], &[1])), 0).unwrap();
    assert_eq!(a, b);
    assert!(rel_error(&a, &c.oracle(&[1; 25])) < 1e-5);
}

#[test]
fn bad_segments_are_errors() {
    let mut c = case(34, 10, 8, 4, 4, &[4]);
    for (cu, slot) in [
        (vec![0, 11], vec![0]),
        (vec![5, 3], vec![0]),
        (vec![-1, 3], vec![0]),
        (vec![0, 4], vec![1]),
    ] {
        assert!(c.run(Some((&cu, &slot)), 0).is_err(), "cu {cu:?} slot {slot:?}");
    }
    assert!(matches!(c.run(None, 1), Err(KernelError::BadIndex { .. })));
}

#[test]
fn workspace_limits_are_enforced() {
    let mut c = case(35, 10, 8, 4, 4, &[4]);
    let spec = WorkspaceSpec {
        max_rows: 9,
        max_rank: 4,
        max_segments: 1,
        max_targets: 1,
    };
    c.ws = LoraWorkspace::new(&c.d, spec).unwrap();
    assert!(c.run(None, 0).is_err(), "more rows than the workspace serves");
    let spec = WorkspaceSpec {
        max_rows: 10,
        max_rank: 2,
        max_segments: 1,
        max_targets: 1,
    };
    c.ws = LoraWorkspace::new(&c.d, spec).unwrap();
    assert!(c.run(None, 0).is_err(), "stride above the workspace rank");
    let spec = WorkspaceSpec {
        max_rows: 10,
        max_rank: 4,
        max_segments: 1,
        max_targets: 1,
    };
    c.ws = LoraWorkspace::new(&c.d, spec).unwrap();
    assert!(
        c.run(Some((&[0, 5, 10], &[0, 0])), 0).is_err(),
        "more segments than the workspace serves"
    );
    assert!(c.run(None, 0).is_ok());
    assert!(LoraWorkspace::new(&c.d, WorkspaceSpec { max_targets: 5, ..spec }).is_err());
}

#[test]
fn default_k_splits_fill_one_wave_within_the_least_to_the_most() {
    // The bench shapes on an H200 (132 SMs, four 64-row shrink blocks each).
    let mma_sync = least_k_splits(ShrinkKernel::Wide { paired: true });
    let wgmma = least_k_splits(ShrinkKernel::Wgmma { a_rows: 64 });
    assert_eq!((mma_sync, wgmma), (4, 3));
    assert_eq!(default_k_splits(72, 528, mma_sync), 7);
    assert_eq!(default_k_splits(160, 528, mma_sync), 4);
    assert_eq!(default_k_splits(160, 528, wgmma), 3);
    // A handful of tiles: the most the workspace holds; a huge batch: the least.
    assert_eq!(default_k_splits(3, 528, wgmma), MAX_K_SPLITS);
    assert_eq!(default_k_splits(100_000, 528, mma_sync), 4);
    assert_eq!(default_k_splits(100_000, 528, wgmma), 3);
    assert_eq!(default_k_splits(0, 528, mma_sync), MAX_K_SPLITS);
}

#[test]
fn the_expand_gets_resident_early_but_after_wide_wgmma_shrinks_with_two_y_buffers() {
    for y_buffers in [1, 2] {
        assert!(default_early_dependents(ShrinkKernel::Wgmma { a_rows: 16 }, y_buffers));
        assert!(default_early_dependents(ShrinkKernel::Wide { paired: true }, y_buffers));
        assert!(default_early_dependents(ShrinkKernel::Narrow, y_buffers));
    }
    for a_rows in [32, 64] {
        assert!(default_early_dependents(ShrinkKernel::Wgmma { a_rows }, 1));
        assert!(!default_early_dependents(ShrinkKernel::Wgmma { a_rows }, 2));
    }
}

#[test]
fn the_narrow_shrink_wins_over_the_staging_choice() {
    let name = |narrow, paired| {
        let t = SgmvTuning {
            narrow_shrink: Some(narrow),
            paired_staging: Some(paired),
            ..Default::default()
        };
        choose_shrink(&t, 16, true).unwrap().name()
    };
    assert_eq!(name(true, true), "sgmv_shrink_r16_bf16");
    assert_eq!(name(true, false), "sgmv_shrink_r16_bf16");
    assert_eq!(name(false, true), "sgmv_shrink_bf16");
    assert_eq!(name(false, false), "sgmv_shrink_split_bf16");
}

#[test]
fn the_wgmma_shrink_is_the_default_where_the_device_has_it() {
    let default = SgmvTuning::default();
    for (stride, name) in [
        (1, "sgmv_shrink_wg16_bf16"),
        (16, "sgmv_shrink_wg16_bf16"),
        (17, "sgmv_shrink_wg32_bf16"),
        (32, "sgmv_shrink_wg32_bf16"),
        (33, "sgmv_shrink_wg64_bf16"),
        (64, "sgmv_shrink_wg64_bf16"),
        (256, "sgmv_shrink_wg64_bf16"),
    ] {
        assert_eq!(
            choose_shrink(&default, stride, true).unwrap().name(),
            name,
            "stride {stride}"
        );
        // Without sm_90a: the 64-row mma.sync shrink, paired.
        assert_eq!(
            choose_shrink(&default, stride, false).unwrap().name(),
            "sgmv_shrink_bf16"
        );
    }
    // Naming an mma.sync kernel, or turning wgmma off, reaches the mma.sync shrinks on any device.
    let narrow = SgmvTuning {
        narrow_shrink: Some(true),
        ..Default::default()
    };
    assert_eq!(choose_shrink(&narrow, 16, true).unwrap(), ShrinkKernel::Narrow);
    let off = SgmvTuning {
        wgmma_shrink: Some(false),
        ..Default::default()
    };
    assert_eq!(
        choose_shrink(&off, 64, true).unwrap(),
        ShrinkKernel::Wide { paired: true }
    );
}

#[test]
fn asking_for_wgmma_where_it_cannot_run_is_an_error() {
    let on = SgmvTuning {
        wgmma_shrink: Some(true),
        ..Default::default()
    };
    assert_eq!(
        choose_shrink(&on, 16, true).unwrap(),
        ShrinkKernel::Wgmma { a_rows: 16 }
    );
    let err = choose_shrink(&on, 16, false).unwrap_err().to_string();
    assert!(err.contains("wgmma_shrink"), "{err}");
    let conflicting = SgmvTuning {
        narrow_shrink: Some(true),
        ..on
    };
    let err = choose_shrink(&conflicting, 16, true).unwrap_err().to_string();
    assert!(err.contains("wgmma_shrink"), "{err}");
}

#[test]
fn a_flag_asked_for_without_its_capability_is_an_error() {
    let err = capability_flag("tuning.x", Some(true), false, "needs y", true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tuning.x"), "{err}");
    assert!(!capability_flag("tuning.x", Some(false), false, "needs y", true).unwrap());
    assert!(capability_flag("tuning.x", Some(true), true, "needs y", false).unwrap());
    assert!(!capability_flag("tuning.x", None, false, "needs y", true).unwrap());
    assert!(capability_flag("tuning.x", None, true, "needs y", true).unwrap());
    assert!(!capability_flag("tuning.x", None, true, "needs y", false).unwrap());
}

#[test]
fn the_wgmma_expand_starts_before_y_past_rank_stride_32() {
    assert!(!default_mma_before_y(16));
    assert!(!default_mma_before_y(32));
    assert!(default_mma_before_y(33));
    assert!(default_mma_before_y(64));
    assert_eq!(expand_kernel(true, true, true), "sgmv_expand_wgf_bf16");
    assert_eq!(expand_kernel(false, true, false), "sgmv_expand_wg_f32");
    // mma.sync has one form whatever the flag says.
    assert_eq!(expand_kernel(true, false, true), "sgmv_expand_bf16");
}

#[test]
fn the_wgmma_stages_mirror_the_kernel_source() {
    // sgmv.cu sizes its stages from SG_WG_STAGE_BUDGET the way wg_shrink_stages does.
    let source = include_str!("../../../cuda/sgmv.cu");
    assert!(source.contains("#define SG_WG_STAGE_BUDGET (56 * 1024)"));
    assert_eq!(wg_shrink_stages(16), 5);
    assert_eq!(wg_shrink_stages(32), 4);
    assert_eq!(wg_shrink_stages(64), 3);
    // Four blocks of each stay resident on an H200 multiprocessor, as for the mma.sync shrink.
    for a_rows in [16, 32, 64] {
        assert_eq!(
            blocks_per_sm(wg_shrink_smem(a_rows) as usize, 228 * 1024),
            4,
            "A rows {a_rows}"
        );
    }
}

#[test]
fn one_y_buffer_never_leaves_fewer_expand_blocks_resident_than_two() {
    // The H200: 228 KiB of shared memory per multiprocessor.
    let sm = 228 * 1024;
    // Rank stride 64: two bf16 y buffers leave 3 blocks, one leaves 4.
    assert_eq!(blocks_per_sm(expand_smem_bytes(64, 2, 2, false), sm), 3);
    assert_eq!(blocks_per_sm(expand_smem_bytes(64, 2, 1, false), sm), 4);
    // The wgmma expand keeps four at rank strides 16 and 64.
    assert_eq!(blocks_per_sm(expand_smem_bytes(16, 2, 1, true), sm), 4);
    assert_eq!(blocks_per_sm(expand_smem_bytes(64, 2, 1, true), sm), 4);
    assert_eq!(DEFAULT_Y_BUFFERS, 1);
    for stride in 1..=256 {
        for y_size in [2, 4] {
            for wgmma in [false, true] {
                let two = blocks_per_sm(expand_smem_bytes(stride, y_size, 2, wgmma), sm);
                let one = blocks_per_sm(expand_smem_bytes(stride, y_size, 1, wgmma), sm);
                assert!(one >= two, "stride {stride} y {y_size} wgmma {wgmma}");
            }
        }
    }
}
