use half::bf16;

use super::*;

fn call(
    rows: usize,
    in_dim: usize,
    stride: usize,
    segments: Option<usize>,
    outs: &[usize],
    f32_y: bool,
) -> PrefillCall {
    let made = match (segments, f32_y) {
        (Some(s), false) => PrefillCall::segments::<bf16>(rows, in_dim, stride, s, outs),
        (Some(s), true) => PrefillCall::segments::<f32>(rows, in_dim, stride, s, outs),
        (None, false) => PrefillCall::one_entry::<bf16>(rows, in_dim, stride, outs),
        (None, true) => PrefillCall::one_entry::<f32>(rows, in_dim, stride, outs),
    };
    made.unwrap_or_else(|e| panic!("rows {rows} in {in_dim} r {stride}: {e}"))
}

/// The calls of the recorded table: rows 1..=8192 (odd sizes too) × rank
/// strides 8..=128 × 1..=64 segments or one entry, in dims, targets and y
/// elements in turn; the bench shapes; odd dims, and strides past what the
/// expand's shared memory holds.
fn golden_calls() -> Vec<PrefillCall> {
    let rows = [1, 3, 17, 64, 65, 127, 300, 512, 1000, 2048, 4095, 4096, 8192];
    let strides = [8, 16, 32, 64, 128];
    let groups = [Some(1), Some(4), Some(16), Some(64), None];
    let in_dims = [2048, 4096, 5120, 8192];
    let outs: [&[usize]; 6] = [
        &[4096],
        &[14336],
        &[4096, 1024, 1024],
        &[14336, 14336],
        &[2048, 512, 512, 2048],
        &[1024],
    ];
    let mut calls = Vec::new();
    let mut i = 0usize;
    for &n in &rows {
        for &stride in &strides {
            for &segments in &groups {
                let (in_dim, out) = (in_dims[i % in_dims.len()], outs[(i / 3) % outs.len()]);
                calls.push(call(n, in_dim, stride, segments, out, i % 7 == 3));
                i += 1;
            }
        }
    }
    // The bench shapes (PREFILL and PREFILL_SWEEP of xtask's bench).
    for (n, s, in_dim, out, r) in [
        (4096, 8, 4096, 4096, 16),
        (8192, 32, 4096, 4096, 64),
        (1024, 8, 4096, 4096, 16),
        (2048, 4, 4096, 4096, 16),
        (4096, 32, 4096, 4096, 16),
        (8192, 8, 4096, 4096, 16),
        (4096, 8, 4096, 4096, 32),
        (4096, 16, 4096, 4096, 64),
    ] {
        for f32_y in [false, true] {
            calls.push(call(n, in_dim, r, Some(s), &[out], f32_y));
        }
    }
    for (n, in_dim, r, outs) in [
        (5, 24, 5, &[9][..]),
        (130, 96, 128, &[130]),
        (300, 2049, 64, &[200, 64]),
        (40, 37, 8, &[19]),
        (4096, 4096, 256, &[4096]),
        (4096, 4096, 384, &[4096]),
        (64, 4096, 1024, &[4096]),
    ] {
        for f32_y in [false, true] {
            calls.push(call(n, in_dim, r, Some(3), outs, f32_y));
        }
    }
    calls
}

const DEVICES: [(&str, DeviceLimits); 2] = [("h200", DeviceLimits::H200), ("sm80", DeviceLimits::SM80)];

/// One line per (device, call): the rule table's plan and the launches it gives.
fn line(dev: &str, c: &PrefillCall, limits: &DeviceLimits, choice: Choice<PrefillPlan>) -> String {
    let got = match resolve(c, limits, choice) {
        Ok((p, s)) => format!(
            "{p} | {} {:?} smem {} | {} {:?} smem {}",
            s.shrink_kernel, s.shrink_grid, s.shrink_smem, s.expand_kernel, s.expand_grid, s.expand_smem
        ),
        Err(e) => format!("error: {e}"),
    };
    format!("{dev} {c} -> {got}\n")
}

#[test]
fn sgmv_auto_plans_match_the_recorded_table() {
    let mut text = String::new();
    for (dev, limits) in DEVICES {
        for c in golden_calls() {
            text += &line(dev, &c, &limits, Choice::Auto);
        }
    }
    crate::ops::golden::check("src/ops/sgmv/plan.golden", &text);
}

#[test]
fn an_exact_plan_launches_as_its_auto_twin() {
    for (dev, limits) in DEVICES {
        for c in golden_calls() {
            if let Ok(auto) = plan(&c, &limits, Choice::Auto) {
                assert_eq!(
                    line(dev, &c, &limits, Choice::Exact(auto)),
                    line(dev, &c, &limits, Choice::Auto)
                );
            }
        }
    }
}

#[test]
fn candidates_start_with_the_auto_plan_and_all_pass_the_check() {
    for (dev, limits) in DEVICES {
        for c in golden_calls() {
            let all = candidates(&c, &limits);
            match plan(&c, &limits, Choice::Auto) {
                Ok(auto) => assert_eq!(all.first(), Some(&auto), "{dev} {c}"),
                Err(_) => assert!(!all.contains(&auto(&c, &limits)), "{dev} {c}"),
            }
            let mut labels: Vec<String> = all.iter().map(|p| p.to_string()).collect();
            labels.sort();
            labels.dedup();
            assert_eq!(labels.len(), all.len(), "{dev} {c}: two candidates alike");
            for p in &all {
                assert_eq!(plan(&c, &limits, Choice::Exact(*p)).ok(), Some(*p), "{dev} {c}: {p}");
            }
        }
    }
}

#[test]
fn candidates_cover_every_form_the_device_runs() {
    let c = call(4096, 4096, 16, Some(8), &[4096], false);
    let h200 = candidates(&c, &DeviceLimits::H200);
    // 4 shrinks (wgmma16, narrow, 64-row paired and split) × 3 expands × 2 y buffers
    // × 3 launches (dependent early or late, plain) × 2 ways of dealing items.
    assert_eq!(h200.len(), 4 * 3 * 2 * 3 * 2);
    // sm_80: the three mma.sync shrinks, the mma.sync expand, no dependent launch.
    let sm80 = candidates(&c, &DeviceLimits::SM80);
    assert_eq!(sm80.len(), 3 * 2 * 2);
    assert!(
        sm80.iter()
            .all(|p| !p.dependent_expand && p.expand == ExpandKernel::MmaSync)
    );
    // Past rank stride 16 there is no narrow shrink.
    let r64 = call(4096, 4096, 64, Some(8), &[4096], false);
    assert_eq!(candidates(&r64, &DeviceLimits::H200).len(), 3 * 3 * 2 * 3 * 2);
    assert!(
        candidates(&r64, &DeviceLimits::H200)
            .iter()
            .all(|p| p.shrink != ShrinkKernel::Narrow)
    );
    // Each shrink's K splits are the rule's for it.
    for p in &h200 {
        assert_eq!(p.k_splits, auto_k_splits(&c, &DeviceLimits::H200, p.shrink), "{p}");
    }
    // Nothing fits where the expand's shared memory exceeds the device.
    let huge = call(64, 4096, 1024, Some(3), &[4096], false);
    assert!(candidates(&huge, &DeviceLimits::H200).is_empty());
}

#[test]
fn the_labels_are_short_and_stable() {
    let c = call(8192, 4096, 64, Some(32), &[4096], false);
    let auto = plan(&c, &DeviceLimits::H200, Choice::Auto).unwrap();
    assert_eq!(
        auto.to_string(),
        "shrink=wgmma64 ks=3 expand=wgmma-before-y y1 dep early bal"
    );
    let sm80 = plan(&c, &DeviceLimits::SM80, Choice::Auto).unwrap();
    assert_eq!(sm80.to_string(), "shrink=mma64 ks=4 expand=mma y1 nodep early bal");
    let other = PrefillPlan {
        shrink: ShrinkKernel::Wide { paired: false },
        expand: ExpandKernel::Wgmma { mma_before_y: false },
        y_buffers: 2,
        early_dependents: false,
        balanced_items: false,
        ..auto
    };
    assert_eq!(
        other.to_string(),
        "shrink=mma64-split ks=3 expand=wgmma y2 dep late unbal"
    );
    assert_eq!(ShrinkKernel::Narrow.to_string(), "mma16");
    assert_eq!(c.to_string(), "rows=8192 in=4096 r=64 segs=32 out=[4096] y=bf16");
    let one = call(5, 24, 5, None, &[9, 3], true);
    assert_eq!(one.to_string(), "rows=5 in=24 r=5 segs=one out=[9, 3] y=f32");
}

/// The error of an exact plan, which must name `field`.
fn refused(c: &PrefillCall, limits: &DeviceLimits, p: PrefillPlan, field: &str) {
    match plan(c, limits, Choice::Exact(p)) {
        Err(KernelError::InvalidArgument { arg, .. }) => assert_eq!(arg, field, "{p}"),
        other => panic!("{p}: {other:?}"),
    }
}

#[test]
fn exact_plans_the_call_or_device_cannot_serve_are_typed_errors() {
    let (h200, sm80) = (&DeviceLimits::H200, &DeviceLimits::SM80);
    let c = call(4096, 4096, 16, Some(8), &[4096], false);
    let auto = plan(&c, h200, Choice::Auto).unwrap();
    let with = |f: &dyn Fn(&mut PrefillPlan)| {
        let mut p = auto;
        f(&mut p);
        p
    };
    // wgmma kernels and the dependent launch need the H200's capabilities.
    refused(&c, sm80, auto, "plan.shrink");
    let mma_shrink = with(&|p| p.shrink = ShrinkKernel::Wide { paired: true });
    refused(&c, sm80, mma_shrink, "plan.expand");
    let mma_both = PrefillPlan {
        expand: ExpandKernel::MmaSync,
        ..mma_shrink
    };
    refused(&c, sm80, mma_both, "plan.dependent_expand");
    let plain = PrefillPlan {
        dependent_expand: false,
        ..mma_both
    };
    assert_eq!(plan(&c, sm80, Choice::Exact(plain)).ok(), Some(plain));
    // A wgmma shrink of another rank stride's tile height, the narrow shrink past 16.
    refused(
        &c,
        h200,
        with(&|p| p.shrink = ShrinkKernel::Wgmma { a_rows: 64 }),
        "plan.shrink",
    );
    let r32 = call(4096, 4096, 32, Some(8), &[4096], false);
    let narrow = PrefillPlan {
        shrink: ShrinkKernel::Narrow,
        ..plan(&r32, h200, Choice::Auto).unwrap()
    };
    refused(&r32, h200, narrow, "plan.shrink");
    // K splits: 1 to 8, at most one per K chunk; y buffers: 1 or 2.
    for k in [0, 9] {
        refused(&c, h200, with(&|p| p.k_splits = k), "plan.k_splits");
    }
    let short_k = call(64, 130, 16, Some(1), &[64], false);
    let p = plan(&short_k, h200, Choice::Auto).unwrap();
    assert_eq!(p.k_splits, 3, "three K chunks");
    refused(&short_k, h200, PrefillPlan { k_splits: 4, ..p }, "plan.k_splits");
    for y in [0, 3] {
        refused(&c, h200, with(&|p| p.y_buffers = y), "plan.y_buffers");
    }
    // Shared memory the device does not have, for the rule's plan and any other.
    let huge = call(64, 4096, 1024, Some(3), &[4096], false);
    let err = plan(&huge, h200, Choice::Auto).unwrap_err().to_string();
    assert!(err.contains("rank_stride") && err.contains("shared memory"), "{err}");
    let mma_expand = PrefillPlan {
        expand: ExpandKernel::MmaSync,
        ..super::auto(&huge, h200)
    };
    refused(&huge, h200, mma_expand, "rank_stride");
}

#[test]
fn calls_are_validated_when_built() {
    let field = |r: Result<PrefillCall, KernelError>| match r {
        Err(KernelError::InvalidArgument { arg, .. }) => arg,
        other => panic!("{other:?}"),
    };
    assert_eq!(field(PrefillCall::segments::<bf16>(0, 64, 16, 1, &[64])), "rows");
    assert_eq!(field(PrefillCall::segments::<bf16>(1, 64, 0, 1, &[64])), "rank_stride");
    assert_eq!(field(PrefillCall::segments::<bf16>(1, 64, 16, 1, &[])), "targets");
    assert_eq!(field(PrefillCall::one_entry::<f32>(1, 64, 16, &[64; 5])), "targets");
    assert_eq!(
        field(PrefillCall::one_entry::<f32>(1, 64, 16, &[1 << 31])),
        "targets.out_dim"
    );
    assert_eq!(field(PrefillCall::segments::<f32>(1 << 31, 64, 16, 1, &[64])), "rows");
    let c = PrefillCall::segments::<f32>(7, 64, 16, 2, &[64, 32]).unwrap();
    assert_eq!(
        (
            c.rows(),
            c.in_dim(),
            c.rank_stride(),
            c.n_segments(),
            c.out_dims(),
            c.y_bytes()
        ),
        (7, 64, 16, Some(2), &[64, 32][..], 4)
    );
}

#[test]
fn a_hostile_device_description_is_an_error_or_a_plan_never_a_panic() {
    let c = call(8192, 8192, 128, Some(64), &[14336; 4], true);
    for limits in [
        DeviceLimits {
            multiprocessors: usize::MAX,
            smem_per_sm: usize::MAX,
            ..DeviceLimits::H200
        },
        DeviceLimits {
            multiprocessors: 0,
            smem_per_sm: 0,
            smem_optin: 0,
            ..DeviceLimits::SM80
        },
    ] {
        let _ = plan(&c, &limits, Choice::Auto);
        for p in candidates(&c, &limits) {
            assert!(plan(&c, &limits, Choice::Exact(p)).is_ok());
        }
    }
    // Shared memory too small for any shrink: no plan.
    let tiny = DeviceLimits {
        smem_optin: 48 * 1024,
        ..DeviceLimits::SM80
    };
    let err = plan(&call(64, 64, 8, Some(1), &[64], false), &tiny, Choice::Auto)
        .unwrap_err()
        .to_string();
    assert!(err.contains("plan.shrink"), "{err}");
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
fn the_wgmma_shrink_is_the_default_where_the_device_has_it() {
    for (stride, name) in [
        (1, "sgmv_shrink_wg16_bf16"),
        (16, "sgmv_shrink_wg16_bf16"),
        (17, "sgmv_shrink_wg32_bf16"),
        (32, "sgmv_shrink_wg32_bf16"),
        (33, "sgmv_shrink_wg64_bf16"),
        (64, "sgmv_shrink_wg64_bf16"),
        (256, "sgmv_shrink_wg64_bf16"),
    ] {
        let c = call(512, 4096, stride, Some(4), &[1024], false);
        let h200 = plan(&c, &DeviceLimits::H200, Choice::Auto).unwrap();
        assert_eq!(h200.shrink.name(), name, "stride {stride}");
        assert_eq!(h200.shrink, ShrinkKernel::wgmma_for(stride));
        // Without sm_90a: the 64-row mma.sync shrink, paired.
        let sm80 = plan(&c, &DeviceLimits::SM80, Choice::Auto).unwrap();
        assert_eq!(sm80.shrink.name(), "sgmv_shrink_bf16");
    }
    assert_eq!(ShrinkKernel::Narrow.name(), "sgmv_shrink_r16_bf16");
    assert_eq!(ShrinkKernel::Wide { paired: false }.name(), "sgmv_shrink_split_bf16");
}

#[test]
fn the_wgmma_expand_starts_before_y_past_rank_stride_32() {
    assert!(!default_mma_before_y(16));
    assert!(!default_mma_before_y(32));
    assert!(default_mma_before_y(33));
    assert!(default_mma_before_y(64));
    let before = ExpandKernel::Wgmma { mma_before_y: true };
    let from_y = ExpandKernel::Wgmma { mma_before_y: false };
    assert_eq!(before.name(YKind::Bf16), "sgmv_expand_wgf_bf16");
    assert_eq!(from_y.name(YKind::F32), "sgmv_expand_wg_f32");
    assert_eq!(ExpandKernel::MmaSync.name(YKind::Bf16), "sgmv_expand_bf16");
    assert_eq!(ExpandKernel::MmaSync.name(YKind::F32), "sgmv_expand_f32");
}

#[test]
fn the_wgmma_stages_mirror_the_kernel_source() {
    // sgmv.cu sizes its stages from SG_WG_STAGE_BUDGET the way wg_shrink_stages does.
    let source = include_str!("../../../../cuda/sgmv.cu");
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

/// The output head's pair (`lm_head`: out = vocab, in = hidden), the
/// tallest expand of a model, is planned for every served vocabulary, by
/// segments and as one entry, on both recorded devices.
#[test]
fn the_output_head_is_planned_for_every_vocabulary() {
    let heads = [
        (4096, 32_000),
        (4096, 128_256),
        (3584, 152_064),
        (5376, 262_208),
        (2880, 201_088),
    ];
    for limits in [DeviceLimits::H200, DeviceLimits::SM80] {
        for (in_dim, vocab) in heads {
            for stride in [8, 16, 64] {
                for rows in [1, 17, 512, 4096] {
                    for segments in [Some(1), Some(8), None] {
                        for f32_y in [false, true] {
                            let c = call(rows, in_dim, stride, segments, &[vocab], f32_y);
                            if let Err(e) = plan(&c, &limits, Choice::Auto) {
                                panic!("head {in_dim}->{vocab} r{stride} rows {rows} {segments:?}: {e}");
                            }
                        }
                    }
                }
            }
        }
    }
}
