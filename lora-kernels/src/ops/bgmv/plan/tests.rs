use super::super::{LIST_STATIC_SMEM, STATIC_SMEM, THREADS, fused_threads};
use super::*;
use crate::Device;
use crate::ops::dora::DoraEpilogue;
use crate::ops::{Rows, RowsMut};
use crate::table::PairEntry;
use proptest::prelude::*;

/// The recorded grid: batch sizes, table sizes and target geometries of
/// every model family the workspace serves, on the two recorded devices.
fn grid() -> Vec<(String, DecodeCall)> {
    let rows = [1, 2, 7, 16, 31, 32, 48, 64, 65, 96, 128, 129, 256, 512, 513, 1024, 2048];
    let entries = [1, 8, 32, 64];
    // (label, in, outs, rank stride, y)
    let geometries: [(&str, usize, &[usize], usize, OutputKind); 11] = [
        ("o", 4096, &[4096], 16, OutputKind::Bf16),
        ("o r64", 4096, &[4096], 64, OutputKind::Bf16),
        ("o r128", 4096, &[4096], 128, OutputKind::Bf16),
        ("o r8", 4096, &[4096], 8, OutputKind::Bf16),
        ("up", 4096, &[14336], 16, OutputKind::Bf16),
        ("qkv", 4096, &[4096, 1024, 1024], 16, OutputKind::Bf16),
        ("gate_up", 4096, &[14336, 14336], 16, OutputKind::Bf16),
        ("down", 14336, &[4096], 16, OutputKind::Bf16),
        ("small r32", 2048, &[2048], 32, OutputKind::Bf16),
        ("router", 5120, &[64], 16, OutputKind::F32),
        ("odd", 4100, &[4100], 16, OutputKind::Bf16),
    ];
    let mut out = Vec::new();
    for (label, in_dim, outs, stride, y) in geometries {
        for &e in &entries {
            let mut col = 0;
            let targets: Vec<CallTarget> = outs
                .iter()
                .map(|&out_dim| {
                    let t = CallTarget {
                        out_dim,
                        y_col_offset: col,
                        n_entries: e,
                    };
                    col += out_dim;
                    t
                })
                .collect();
            for &n in &rows {
                let call = DecodeCall::dense(n, in_dim, stride, y, &targets).expect("a valid call");
                out.push((format!("{label} n{n} e{e}"), call));
            }
        }
    }
    out
}

fn contexts(limits: &DeviceLimits) -> Vec<(&'static str, DecodeContext)> {
    let plain = DecodeContext::default();
    let mut all = vec![
        ("unknown", plain),
        (
            "overlap",
            DecodeContext {
                overlap_previous: true,
                ..plain
            },
        ),
    ];
    if limits.hopper() {
        all.push((
            "root",
            DecodeContext {
                predecessor: Predecessor::NoKernel,
                ..plain
            },
        ));
    }
    all
}

fn table(decide: impl Fn(&DecodeCall, &DeviceLimits, DecodeContext) -> Result<DecodePlan, KernelError>) -> String {
    let mut text = String::new();
    for (device, limits) in [("h200", DeviceLimits::H200), ("sm80", DeviceLimits::SM80)] {
        for (ctx_label, ctx) in contexts(&limits) {
            for (label, call) in grid() {
                let decision = match decide(&call, &limits, ctx) {
                    Ok(plan) => plan.to_string(),
                    Err(e) => format!("refused: {e}"),
                };
                text += &format!("{device} {ctx_label} {label}: {decision}\n");
            }
        }
    }
    text
}

/// Every decision of the rule table, recorded: a changed line is a changed launch.
#[test]
fn the_decisions_are_the_recorded_ones() {
    let text = table(|call, limits, ctx| plan(call, limits, ctx, Choice::Auto));
    crate::ops::golden::check("src/ops/bgmv/plan.golden", &text);
}

#[test]
fn clusters_of_four_where_eights_would_take_two_rounds_past_rank_16() {
    let h200 = &DeviceLimits::H200;
    assert_eq!(entry_cluster(16, 64, h200), 8);
    assert_eq!(entry_cluster(64, 8, h200), 8);
    // Past rank 16 two blocks share a multiprocessor: one round holds the
    // driver's count of clusters of 8 at 2 a multiprocessor (30 on the H200).
    let one_round = h200.clusters_of_8[1];
    assert_eq!(entry_cluster(32, one_round, h200), 8);
    assert_eq!(entry_cluster(64, one_round, h200), 8);
    assert_eq!(entry_cluster(64, one_round + 1, h200), 4);
    assert_eq!(entry_cluster(64, 64, h200), 4);
    // A chip whose GPCs hold fewer clusters takes clusters of 4 sooner.
    let fewer = DeviceLimits {
        clusters_of_8: [12, 24, 36, 48],
        ..DeviceLimits::H200
    };
    assert_eq!(entry_cluster(64, 25, &fewer), 4);
}

#[test]
fn the_next_kernel_is_let_in_early_only_by_launches_of_a_block_a_multiprocessor() {
    assert!(lets_next_in_early(16, 8, 1, 1, 132));
    assert!(lets_next_in_early(16, 8, 16, 1, 132));
    assert!(lets_next_in_early(32, 8, 16, 1, 132));
    assert!(!lets_next_in_early(16, 8, 24, 1, 132));
    assert!(!lets_next_in_early(16, 8, 32, 1, 132));
    assert!(!lets_next_in_early(64, 4, 32, 1, 132));
    assert!(!lets_next_in_early(16, 8, 8, 3, 16));
    assert!(!lets_next_in_early(16, usize::MAX, 2, 2, 132));
    assert_eq!(Chain::of(true, true, true), Chain::EarlyReads);
    assert_eq!(Chain::of(false, true, true), Chain::WaitFirstEarlyNext);
    assert_eq!(Chain::of(false, true, false), Chain::WaitFirst);
    assert_eq!(Chain::of(false, false, true), Chain::Plain);
    assert!(!Chain::Plain.dependent() && Chain::WaitFirst.dependent());
    assert!(Chain::WaitFirst.waits_first() && Chain::WaitFirstEarlyNext.waits_first());
    assert!(!Chain::Plain.waits_first() && !Chain::EarlyReads.waits_first());
}

#[test]
fn the_register_kernel_by_default_from_eight_rows_per_entry() {
    assert!(entry_registers_by_default(256, 32));
    assert!(!entry_registers_by_default(255, 32));
    assert!(!entry_registers_by_default(256, 64));
    assert!(entry_registers_by_default(8, 0));
    assert!(!entry_registers_by_default(1, 1));
}

/// The rule table's plan is an exact plan the checks accept, unchanged;
/// every candidate is accepted too, the rule table's first, none twice.
#[test]
fn every_auto_plan_and_every_candidate_is_accepted_as_exact() {
    let mut forms = std::collections::HashSet::new();
    for limits in [DeviceLimits::H200, DeviceLimits::SM80] {
        for (_, ctx) in contexts(&limits) {
            for (label, call) in grid() {
                let auto = plan(&call, &limits, ctx, Choice::Auto);
                if let Ok(auto) = auto {
                    assert_eq!(
                        plan(&call, &limits, ctx, Choice::Exact(auto)).ok(),
                        Some(auto),
                        "{label}"
                    );
                }
                let all = candidates(&call, &limits, ctx);
                if let Ok(auto) = auto {
                    assert_eq!(all.first(), Some(&auto), "{label}");
                }
                for (i, c) in all.iter().enumerate() {
                    assert!(!all[..i].contains(c), "{label}: {c} twice");
                    assert_eq!(
                        plan(&call, &limits, ctx, Choice::Exact(*c)).ok(),
                        Some(*c),
                        "{label}: {c}"
                    );
                    forms.insert(std::mem::discriminant(&c.form));
                }
            }
        }
    }
    assert_eq!(forms.len(), 4, "every form is some call's candidate");
}

fn one_target(n: usize, in_dim: usize, out: usize, stride: usize, entries: usize) -> DecodeCall {
    let t = CallTarget {
        out_dim: out,
        y_col_offset: 0,
        n_entries: entries,
    };
    DecodeCall::dense(n, in_dim, stride, OutputKind::Bf16, &[t]).unwrap()
}

fn field_of(e: KernelError) -> String {
    e.to_string()
}

/// Exact plans the call, the device or the caller's promises do not allow
/// are refused, naming the plan field.
#[test]
fn exact_plans_that_cannot_serve_are_refused_by_field() {
    let h200 = DeviceLimits::H200;
    let plain = DecodeContext::default();
    let call = one_target(64, 4096, 4096, 16, 64);
    let auto = plan(&call, &h200, plain, Choice::Auto).unwrap();
    assert_eq!(auto.form, DecodeForm::RowRegisters { straight_line: true });
    let early = DecodePlan {
        form: DecodeForm::RowRegisters { straight_line: false },
        chain: Chain::EarlyReads,
    };
    let straight_early = DecodePlan {
        chain: Chain::EarlyReads,
        ..auto
    };
    let refused = |call: &DecodeCall, limits: &DeviceLimits, ctx, p| {
        field_of(plan(call, limits, ctx, Choice::Exact(p)).unwrap_err())
    };
    assert!(refused(&call, &h200, plain, early).contains("plan.chain"));
    let promised = DecodeContext {
        overlap_previous: true,
        ..plain
    };
    assert_eq!(plan(&call, &h200, promised, Choice::Exact(early)).ok(), Some(early));
    assert!(refused(&call, &h200, promised, straight_early).contains("plan.straight_line"));
    let wait = DecodePlan {
        chain: Chain::WaitFirst,
        ..auto
    };
    assert!(refused(&call, &DeviceLimits::SM80, plain, wait).contains("sm_90"));
    let fused = FusedForm {
        cluster: 8,
        out_splits: 1,
        clusters_per_window: 8,
        tensor_cores: false,
        items: ItemList::Scan,
        push_sum: true,
    };
    let as_plan = |form| DecodePlan {
        form: DecodeForm::Fused(form),
        chain: Chain::Plain,
    };
    assert!(plan(&call, &h200, plain, Choice::Exact(as_plan(fused))).is_ok());
    assert!(refused(&call, &DeviceLimits::SM80, plain, as_plan(fused)).contains("plan.cluster"));
    assert!(refused(&call, &h200, plain, as_plan(FusedForm { cluster: 3, ..fused })).contains("plan.cluster"));
    let one = FusedForm {
        cluster: 1,
        push_sum: true,
        ..fused
    };
    assert!(refused(&call, &h200, plain, as_plan(one)).contains("plan.push_sum"));
    let wide = FusedForm {
        clusters_per_window: 65,
        ..fused
    };
    assert!(refused(&call, &h200, plain, as_plan(wide)).contains("plan.clusters_per_window"));
    let mapped = FusedForm {
        cluster: 2,
        clusters_per_window: 64,
        ..fused
    };
    assert!(plan(&call, &h200, plain, Choice::Exact(as_plan(mapped))).is_ok());
    // The item list serves the tensor-core kernels only.
    let listed = FusedForm {
        tensor_cores: true,
        items: ItemList::Listed,
        ..fused
    };
    assert!(plan(&call, &h200, plain, Choice::Exact(as_plan(listed))).is_ok());
    let scalar_listed = FusedForm {
        tensor_cores: false,
        ..listed
    };
    assert!(refused(&call, &h200, plain, as_plan(scalar_listed)).contains("plan.items"));
    let waits = DecodePlan {
        chain: Chain::WaitFirst,
        ..as_plan(fused)
    };
    assert!(refused(&call, &h200, plain, waits).contains("does not wait first"));
    // The entry form on rows it cannot read, and its kernels past their limits.
    let odd = one_target(64, 4100, 4096, 16, 8);
    let entry = DecodePlan {
        form: DecodeForm::Entry {
            kernel: EntryKernel::Staged { cluster: 8 },
            prefetch: false,
        },
        chain: Chain::Plain,
    };
    assert!(refused(&odd, &h200, plain, entry).contains("entry clusters"));
    let r64 = one_target(64, 4096, 4096, 64, 8);
    let registers = DecodePlan {
        form: DecodeForm::Entry {
            kernel: EntryKernel::Registers,
            prefetch: false,
        },
        chain: Chain::Plain,
    };
    assert!(refused(&r64, &h200, plain, registers).contains("register kernel"));
    let prefetched = DecodePlan {
        form: DecodeForm::Entry {
            kernel: EntryKernel::Registers,
            prefetch: true,
        },
        chain: Chain::Plain,
    };
    assert!(refused(&call, &h200, plain, prefetched).contains("plan.prefetch"));
    // Two launches past the scratch, and expand units off the grid of 8 or past 4096 outputs.
    let two = TwoPhaseForm {
        shrink_tensor_cores: false,
        expand_cols: 1024,
    };
    let as_two = |form| DecodePlan {
        form: DecodeForm::TwoPhase(form),
        chain: Chain::Plain,
    };
    assert!(plan(&call, &h200, plain, Choice::Exact(as_two(two))).is_ok());
    for expand_cols in [1020, 4104] {
        let off = as_two(TwoPhaseForm { expand_cols, ..two });
        assert!(
            refused(&call, &h200, plain, off).contains("expand_cols"),
            "{expand_cols}"
        );
    }
    let many = one_target(513, 4096, 4096, 16, 64);
    assert!(refused(&many, &h200, plain, as_two(two)).contains("two-phase scratch"));
    // Row registers at another rank stride.
    let rows = DecodePlan {
        form: DecodeForm::RowRegisters { straight_line: false },
        chain: Chain::Plain,
    };
    assert!(refused(&r64, &h200, plain, rows).contains("row registers"));
}

// The cost model and the rules' predicates.

const H200: DeviceLimits = DeviceLimits::H200;

/// The planner's view of targets.
fn call_targets(targets: &[LoraTarget<'_>]) -> Vec<CallTarget> {
    targets
        .iter()
        .map(|t| CallTarget {
            out_dim: t.out_dim,
            y_col_offset: t.y_col_offset,
            n_entries: t.n_entries,
        })
        .collect()
}

/// The launch choice for `n` rows over a table of `n` entries (one-row items possible).
fn choice(n: usize, in_dim: usize, out: usize, stride: usize) -> LaunchChoice {
    choice_y(n, in_dim, out, stride, 2, n)
}

/// The H200's launch choice for one target of `out` columns over a table of `entries` entries.
fn pick_one_target(rows: RowShape, out: usize, entries: usize, fixed: Fixed) -> Result<LaunchChoice, KernelError> {
    let d = Device::cpu();
    let table = d.alloc_zeros::<PairEntry>(entries).unwrap();
    let t = [LoraTarget {
        table: &table,
        table_offset: 0,
        n_entries: entries,
        out_dim: out,
        y_col_offset: 0,
        dora: None,
    }];
    LaunchChoice::pick(&H200, rows, &call_targets(&t), fixed)
}

fn choice_y(n: usize, in_dim: usize, out: usize, stride: usize, y_size: usize, entries: usize) -> LaunchChoice {
    let rows = RowShape {
        in_dim,
        stride,
        y_size,
        window: n,
        n_windows: 1,
        tensor_cores: n >= TENSOR_CORE_MIN_ROWS,
        list: TENSOR_CORE_MIN_ROWS <= (n),
    };
    pick_one_target(rows, out, entries, Fixed::default()).unwrap()
}

#[test]
fn launch_choices_keep_every_block_resident() {
    for (n, in_dim, out, stride) in [
        (1, 4096, 4096, 16),
        (16, 4096, 4096, 16),
        (64, 4096, 4096, 16),
        (64, 4096, 4096, 64),
        (256, 4096, 4096, 16),
        (512, 4096, 4096, 16),
        (64, 4096, 14336, 16),
        (7, 2049, 333, 3),
    ] {
        let c = choice(n, in_dim, out, stride);
        eprintln!("n={n} in={in_dim} out={out} stride={stride}: {c:?}");
        // Small adapters sum by pushes where their receive buffers cost no
        // resident block (at 14336 outputs they would: the pull is kept).
        if out == 4096 {
            assert_eq!(c.push, stride <= PUSH_SUM_MAX_STRIDE, "n={n} stride={stride}: {c:?}");
        }
        if stride > PUSH_SUM_MAX_STRIDE {
            assert!(!c.push);
        }
        // One or two rows: two output splits (measured faster at n = 1); else one.
        if (in_dim, out) == (4096, 4096) {
            assert_eq!(c.plan.splits, if n <= 2 { 2 } else { 1 }, "n={n}: {c:?}");
        }
        // 64 one-row items outnumber the resident clusters of 8 (43): the
        // scalar kernel takes clusters of 2, one block per multiprocessor,
        // all 64 in one round; so do tensor cores for 512 rows (at least 64
        // items of 8). Fewer items: clusters of 8.
        let pairs = (n == 64 || n == 512) && out == 4096 && stride == 16;
        if (in_dim, out) == (4096, 4096) {
            assert_eq!(c.cluster, if pairs { 2 } else { 8 }, "n={n} stride={stride}: {c:?}");
        }
        if pairs {
            assert_eq!(c.cpw, if n == 64 { 64 } else { 66 }, "{c:?}");
        }
        let blocks = c.cluster * c.plan.splits * c.cpw;
        let reg_blocks = if n >= TENSOR_CORE_MIN_ROWS {
            TC_BLOCKS_PER_SM
        } else {
            REG_BLOCKS_PER_SM
        };
        let static_smem = if TENSOR_CORE_MIN_ROWS <= (n) {
            LIST_STATIC_SMEM
        } else {
            STATIC_SMEM
        };
        let bps = reg_blocks.min(H200.smem_per_sm / (c.plan.total + static_smem + 1024));
        assert!(
            blocks <= 132 * bps,
            "n={n} stride={stride}: {c:?} has {blocks} blocks for {bps}/SM"
        );
        assert!(c.plan.total <= H200.smem_optin);
        assert!(c.cpw >= 1 && c.cpw <= n);
    }
    // Without clusters (before sm_90) the choice is the one-block kernel.
    let d = Device::cpu();
    let table = d.alloc_zeros::<PairEntry>(1).unwrap();
    let t = [LoraTarget {
        table: &table,
        table_offset: 0,
        n_entries: 1,
        out_dim: 64,
        y_col_offset: 0,
        dora: None,
    }];
    let rows = RowShape {
        in_dim: 64,
        stride: 8,
        y_size: 2,
        window: 4,
        n_windows: 1,
        tensor_cores: false,
        list: false,
    };
    let ampere = DeviceLimits {
        capability: (8, 0),
        ..H200
    };
    assert_eq!(
        LaunchChoice::pick(&ampere, rows, &call_targets(&t), Fixed::default())
            .unwrap()
            .cluster,
        1
    );
    assert!(
        LaunchChoice::pick(
            &ampere,
            rows,
            &call_targets(&t),
            Fixed {
                cluster: Some(8),
                ..Default::default()
            }
        )
        .is_err()
    );
}

#[test]
fn two_launches_by_default_where_they_measured_faster() {
    // Tables of 64 entries: items of one row are possible up to 128 rows.
    // Few rows: the fused kernel's single launch.
    assert!(!two_phase_by_default(16, 16, 4096, 4096, 64, None, true));
    // Larger adapters or more rows: two launches.
    assert!(two_phase_by_default(64, 64, 4096, 4096, 64, None, true));
    assert!(two_phase_by_default(64, 16, 4096, 14336, 64, None, true));
    assert!(two_phase_by_default(128, 16, 4096, 4096, 64, None, true));
    // Many rows: the fused kernel (on tensor cores).
    assert!(!two_phase_by_default(256, 16, 4096, 4096, 64, None, true));
    // Rows that must share few adapters (more than 2 per table entry):
    // the fused kernel on tensor cores with the item list, as for many rows.
    assert!(!two_phase_by_default(128, 16, 4096, 4096, 16, None, true));
    assert!(!two_phase_by_default(64, 64, 4096, 4096, 31, None, true));
    assert!(two_phase_by_default(64, 64, 4096, 4096, 32, None, true));
    // Up to 64 rows of small adapters: the fused launch, in however many
    // rounds (three targets); past 64 rows, or larger adapters, two launches
    // unless the fused launch takes one round.
    assert!(!two_phase_by_default(64, 16, 4096, 4096, 64, None, true));
    assert!(!two_phase_by_default(64, 16, 4096, 4096, 64, Some(3), true));
    assert!(!two_phase_by_default(40, 8, 4096, 8192, 64, Some(2), true));
    assert!(two_phase_by_default(65, 16, 4096, 4096, 64, Some(2), true));
    assert!(two_phase_by_default(64, 32, 4096, 4096, 64, Some(2), true));
    assert!(two_phase_by_default(64, 16, 4096, 8200, 64, Some(2), true));
    assert!(!two_phase_by_default(96, 16, 4096, 4096, 64, Some(1), true));
    assert!(two_phase_by_default(64, 64, 4096, 4096, 64, Some(5), true));
    // Small outputs of a wide input (Llama-3.1-8B's down projection, in =
    // 14336): two launches from 32 rows (n = 64 of 64, 32 launches in one
    // graph, H100: 626.9 against the fused kernel's 879.6 µs, NOTES v38).
    assert!(two_phase_by_default(64, 16, 14336, 4096, 64, None, true));
    assert!(two_phase_by_default(32, 16, 14336, 4096, 64, Some(3), true));
    assert!(!two_phase_by_default(16, 16, 14336, 4096, 64, None, true));
    // Not measured before sm_90: the fused launch stays there.
    assert!(!two_phase_by_default(64, 16, 14336, 4096, 64, None, false));
}

#[test]
fn fused_rounds_of_the_two_phase_range() {
    // 64 one-row items of rank 16: clusters of 2, one round (bf16 y). With
    // f32 y their y pieces do not fit beside A and B: several rounds.
    assert_eq!(choice(64, 4096, 4096, 16).rounds, 1);
    assert!(choice_y(64, 4096, 4096, 16, 4, 64).rounds > 1);
    // 64 rows over 32 adapters make at most 36 items: clusters of 8, one round.
    let c = choice_y(64, 4096, 4096, 16, 2, 32);
    assert_eq!((c.cluster, c.rounds), (8, 1), "{c:?}");
    // 32 items fit the resident clusters of 8.
    let c = choice(32, 4096, 4096, 16);
    assert_eq!((c.cluster, c.rounds), (8, 1), "{c:?}");
    // Larger adapters, wider outputs or more rows: several rounds.
    assert!(choice(64, 4096, 4096, 64).rounds > 1);
    assert!(choice(64, 4096, 14336, 16).rounds > 1);
    assert!(choice(128, 4096, 4096, 16).rounds > 1);
}

#[test]
fn few_adapters_is_a_bound_on_the_items_of_the_two_phase_range() {
    assert!(few_adapters(128, 16));
    assert!(!few_adapters(128, 64));
    assert!(few_adapters(32, 15));
    assert!(!few_adapters(32, 16));
    // Outside the range the row count alone decides.
    assert!(!few_adapters(16, 1));
    assert!(!few_adapters(256, 1));
}

#[test]
fn item_list_by_default_where_it_measured_faster() {
    // Items of several rows (n = 256 of 32 adapters on the H200), one window.
    assert!(many_rows(256, usize::MAX));
    assert!(many_rows(WINDOW_MAX, usize::MAX));
    // Few rows per item: the scan in every block costs less than a second launch.
    for n in [1, 16, 64, 128] {
        assert!(!many_rows(n, usize::MAX), "{n}");
    }
    // Several windows (n = 1024 of 64 adapters on the H200).
    assert!(many_rows(WINDOW_MAX + 1, usize::MAX));
    assert!(many_rows(1024, usize::MAX));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// However the rows of a window fall on a table's entries, their items
    /// (8 rows at most each, one entry each) never exceed the bound the
    /// launch choice sizes its clusters by.
    #[test]
    fn window_items_never_exceed_their_bound(
        entries in 1usize..300,
        rows in proptest::collection::vec(0usize..300, 1..=WINDOW_MAX),
    ) {
        let mut per_entry = std::collections::HashMap::new();
        for r in &rows {
            *per_entry.entry(r % entries).or_insert(0usize) += 1;
        }
        let items: usize = per_entry.values().map(|r| r.div_ceil(ITEM_ROWS)).sum();
        prop_assert!(items <= window_items_bound(rows.len(), entries));
        prop_assert!(window_items_bound(rows.len(), entries) <= rows.len());
    }
}

#[test]
fn scalar_clusters_of_two_run_sixteen_warps_one_block_per_multiprocessor() {
    // `BGMV_KERNEL_CL` in cuda/bgmv.cu: the scalar clusters of 2 are built
    // for 512 threads with `__launch_bounds__(512, 1)`; every other form for 256.
    assert_eq!(fused_threads(2, false), 2 * THREADS);
    for (cluster, tensor_cores) in [
        (1, false),
        (4, false),
        (8, false),
        (1, true),
        (2, true),
        (4, true),
        (8, true),
    ] {
        assert_eq!(
            fused_threads(cluster, tensor_cores),
            THREADS,
            "cluster {cluster}, tc {tensor_cores}"
        );
    }
    let rows = |tensor_cores| RowShape {
        in_dim: 4096,
        stride: 16,
        y_size: 2,
        window: 64,
        n_windows: 1,
        tensor_cores,
        list: false,
    };
    assert_eq!(rows(false).reg_blocks(2), 1);
    assert_eq!(rows(false).reg_blocks(8), REG_BLOCKS_PER_SM);
    assert_eq!(rows(true).reg_blocks(2), TC_BLOCKS_PER_SM);
    // The bench's n = 64 of rank-16 adapters: clusters of 2, every item in one round.
    let c = choice(64, 4096, 4096, 16);
    assert_eq!((c.cluster, c.rounds), (2, 1), "{c:?}");
}

/// Facts of a one-target call on the H200.
fn h200_facts(call: &DecodeCall, ctx: DecodeContext) -> Facts<'_> {
    Facts::of(call, &DeviceLimits::H200, ctx)
}

#[test]
fn row_mapped_by_default_where_one_round_of_clusters_of_two_holds_every_row() {
    let plain = DecodeContext::default();
    let mapped = |n: usize, in_dim: usize, out: usize, stride: usize, entries: usize, targets: usize| {
        let t = CallTarget {
            out_dim: out,
            y_col_offset: 0,
            n_entries: entries,
        };
        let ts: Vec<CallTarget> = (0..targets)
            .map(|i| CallTarget {
                y_col_offset: i * out,
                ..t
            })
            .collect();
        let call = DecodeCall::dense(n, in_dim, stride, OutputKind::Bf16, &ts).unwrap();
        row_mapped_rule(&h200_facts(&call, plain)).map(|p| p.form)
    };
    let Some(DecodeForm::Fused(form)) = mapped(64, 4096, 4096, 16, 64, 1) else {
        panic!("n = 64 of one target is row-mapped");
    };
    assert_eq!(
        (
            form.cluster,
            form.out_splits,
            form.clusters_per_window,
            form.tensor_cores,
            form.items
        ),
        (2, 1, 64, false, ItemList::Scan)
    );
    // Rows from the threshold to one block per multiprocessor per (row, target).
    let sms = DeviceLimits::H200.multiprocessors;
    assert!(mapped(ROW_MAPPED_MIN_ROWS, 4096, 4096, 16, 64, 1).is_some());
    assert!(mapped(ROW_MAPPED_MIN_ROWS - 1, 4096, 4096, 16, 64, 1).is_none());
    assert!(mapped(sms / 2, 4096, 4096, 16, 64, 1).is_some());
    assert!(mapped(sms / 2 + 1, 4096, 4096, 16, 64, 1).is_none());
    assert!(
        mapped(64, 4096, 4096, 16, 64, 2).is_none(),
        "two targets need two rounds"
    );
    // Over a table of any size; rank 64 and 14336 outputs do not fit clusters of 2.
    for entries in [1, 8, 64, 512] {
        assert!(mapped(64, 4096, 4096, 16, entries, 1).is_some(), "{entries} entries");
    }
    assert!(mapped(64, 4096, 4096, 64, 64, 1).is_none());
    assert!(mapped(64, 4096, 14336, 16, 64, 1).is_none());
    // Not before sm_90, nor under the overlap.
    let call = one_target(64, 4096, 4096, 16, 64);
    assert!(row_mapped_rule(&Facts::of(&call, &DeviceLimits::SM80, plain)).is_none());
    let promised = DecodeContext {
        overlap_previous: true,
        ..plain
    };
    assert!(row_mapped_rule(&h200_facts(&call, promised)).is_none());
}

#[test]
fn tensor_cores_take_pairs_only_where_the_rows_fill_a_round_of_eights() {
    let tc_tuned = |n: usize, entries: usize, fixed: Fixed| {
        let (window, n_windows) = row_windows(n, true, 1);
        let rows = RowShape {
            in_dim: 4096,
            stride: 16,
            y_size: 2,
            window,
            n_windows,
            tensor_cores: true,
            list: true,
        };
        pick_one_target(rows, 4096, entries, fixed).unwrap()
    };
    let tc = |n: usize, entries: usize| tc_tuned(n, entries, Fixed::default());
    // 256 rows make at least 32 items: one round of the 43 resident clusters
    // of 8 may serve them, whatever the table's size (the bound counts every entry).
    for entries in [32, 64, 1024] {
        assert_eq!(tc(256, entries).cluster, 8, "{entries} entries");
    }
    // 512 rows (one window) and 1024 (two) make at least 64 items per window.
    for (n, entries) in [(512, 64), (512, 32), (1024, 64), (1024, 1024)] {
        let c = tc(n, entries);
        assert_eq!((c.cluster, c.plan.splits), (2, 1), "n={n} of {entries}: {c:?}");
    }
    // A cluster size the caller sets is kept.
    let eights = Fixed {
        cluster: Some(8),
        ..Default::default()
    };
    assert_eq!(tc_tuned(1024, 64, eights).cluster, 8);
}

#[test]
fn the_item_list_serves_by_default_except_short_batches_under_the_overlap() {
    // Plain: from TENSOR_CORE_MIN_ROWS rows, and few adapters in the two-phase range.
    assert!(item_list_by_default(256, 32, false));
    assert!(item_list_by_default(128, 16, false));
    assert!(!item_list_by_default(128, 128, false));
    assert!(!item_list_by_default(64, 64, false));
    // Under the overlap a window of up to 256 rows is scanned by every block.
    assert!(!item_list_by_default(256, 32, true));
    assert!(!item_list_by_default(128, 16, true));
    assert!(item_list_by_default(257, 32, true));
    assert!(item_list_by_default(1024, 64, true));
}

#[test]
fn the_entry_clusters_serve_several_rows_per_entry_or_small_tables_by_default() {
    let takes = |n: usize, entries: usize, stride: usize, out: usize, targets: usize, overlap: bool| {
        let ts: Vec<CallTarget> = (0..targets)
            .map(|i| CallTarget {
                out_dim: out,
                y_col_offset: i * out,
                n_entries: entries,
            })
            .collect();
        let call = DecodeCall::dense(n, 4096, stride, OutputKind::Bf16, &ts).unwrap();
        let ctx = DecodeContext {
            overlap_previous: overlap,
            ..DecodeContext::default()
        };
        entry_rule(&h200_facts(&call, ctx)).is_some()
    };
    // Several rows per entry of the table, from ENTRY_MIN_ROWS rows on, any rank or width.
    for (n, entries) in [(256, 32), (128, 16), (64, 8), (64, 32), (1024, 64), (32, 16)] {
        assert!(takes(n, entries, 64, 14336, 1, false), "n={n} of {entries}");
    }
    // Rank 16 and one round of clusters of 8 (3 blocks a multiprocessor): up
    // to the driver's count of them, 45 entries of one target on the H200.
    let one_round = DeviceLimits::H200.clusters_of_8[2];
    for (n, entries) in [(1, 1), (16, 16), (32, 32), (64, one_round)] {
        assert!(takes(n, entries, 16, 4096, 1, false), "n={n} of {entries}");
    }
    // One row per entry otherwise: a 64-entry table, three targets, wide outputs, larger ranks.
    for (n, entries, stride, out, targets) in [
        (64, 64, 16, 4096, 1),
        (64, one_round + 1, 16, 4096, 1),
        (64, 64, 16, 4096, 3),
        (32, 32, 16, 14336, 1),
        (16, 16, 64, 4096, 1),
        (31, 2, 64, 4096, 1),
    ] {
        assert!(
            !takes(n, entries, stride, out, targets, false),
            "n={n} of {entries}, stride {stride}, {out} outputs, {targets} targets"
        );
    }
    // Under the overlap only several rows per entry.
    assert!(!takes(16, 16, 16, 4096, 1, true));
    assert!(takes(128, 16, 16, 4096, 1, true));
}

#[test]
fn row_registers_by_default_for_rows_of_few_rows_an_adapter() {
    let takes = |n: usize, entries: usize, overlap: bool| {
        let call = one_target(n, 4096, 4096, 16, entries);
        let ctx = DecodeContext {
            overlap_previous: overlap,
            ..DecodeContext::default()
        };
        row_registers_rule(&h200_facts(&call, ctx)).is_some()
    };
    let (lo, hi) = (*ROW_REGISTER_ROWS.start(), *ROW_REGISTER_ROWS.end());
    assert!(takes(64, 64, false));
    assert!(takes(lo, lo, false));
    assert!(takes(hi, 4096, false));
    assert!(!takes(lo - 1, 4096, false), "below the measured range");
    assert!(!takes(hi + 1, 4096, false), "past one round");
    assert!(takes(64, 32, false), "two rows an entry");
    assert!(!takes(64, 31, false), "more than two rows an entry");
    assert!(!takes(64, 0, false), "an empty table");
    assert!(!takes(64, 64, true), "under the overlap");
    // Only where the straight-line kernels serve: 4096 x 4096.
    let narrow = one_target(64, 2048, 4096, 16, 64);
    assert!(row_registers_rule(&h200_facts(&narrow, DecodeContext::default())).is_none());
}

#[test]
fn waiting_first_is_the_default_unless_no_kernel_precedes_the_capture() {
    assert!(wait_first_by_default(Predecessor::Unknown));
    assert!(wait_first_by_default(Predecessor::Kernels));
    assert!(!wait_first_by_default(Predecessor::NoKernel));
}

/// The output heads of the served families (hidden, vocab): 32k, 128k,
/// 152k, 201k and 256k vocabularies.
const HEADS: [(usize, usize); 5] = [
    (4096, 32_000),
    (4096, 128_256),
    (3584, 152_064),
    (2880, 201_088),
    (5376, 262_208),
];

/// The output head's pair (`lm_head`: out = vocab, in = hidden) is the
/// tallest expand of a model: the rule table plans it for every vocabulary
/// the served families have, at every batch size and context, on both
/// recorded devices, and every such plan is accepted as exact. The one
/// exception is the fused kernel's own at rank stride 128 on sm_80 (it
/// serves no call there, `plan.golden`'s `o r128`): past the two launches'
/// window of 512 rows such a call is refused, with a typed error.
#[test]
fn the_output_head_is_planned_for_every_vocabulary() {
    let mut failures = Vec::new();
    for (device, limits) in [("h200", DeviceLimits::H200), ("sm80", DeviceLimits::SM80)] {
        for (ctx_label, ctx) in contexts(&limits) {
            for (in_dim, vocab) in HEADS {
                for stride in [8, 16, 64, 128] {
                    for entries in [1, 8, 64] {
                        let targets = [CallTarget {
                            out_dim: vocab,
                            y_col_offset: 0,
                            n_entries: entries,
                        }];
                        for n in [1, 7, 64, 129, 512, 513, 2048] {
                            for y in [OutputKind::Bf16, OutputKind::F32] {
                                let call = DecodeCall::dense(n, in_dim, stride, y, &targets).expect("a valid call");
                                let label = format!(
                                    "{device} {ctx_label} head {in_dim}->{vocab} r{stride} n{n} e{entries} {y:?}"
                                );
                                match plan(&call, &limits, ctx, Choice::Auto) {
                                    Ok(p) => {
                                        if let Err(e) = plan(&call, &limits, ctx, Choice::Exact(p)) {
                                            failures.push(format!("{label}: {p} not accepted as exact: {e}"));
                                        }
                                    }
                                    Err(_) if device == "sm80" && stride == 128 && n > WINDOW_MAX => {}
                                    Err(e) => failures.push(format!("{label}: {e}")),
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} refused:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Rule 6 serves only calls every other rule refused: the recorded grid's
/// refusals (square pairs at rank stride 128 on sm_80) are not tall and
/// stay refused; every output head is tall, and the splits rule 6 tries
/// grow past [`MAX_OUT_SPLITS`] up to one 64-column slice a split.
#[test]
fn only_widening_pairs_are_tall() {
    for (device, limits) in [("h200", DeviceLimits::H200), ("sm80", DeviceLimits::SM80)] {
        for (label, call) in grid() {
            let f = Facts::of(&call, &limits, DecodeContext::default());
            let refused = plan(&call, &limits, DecodeContext::default(), Choice::Auto).is_err();
            assert!(!(refused && tall(&f)), "{device} {label} is refused and tall");
        }
    }
    for (in_dim, vocab) in HEADS {
        let targets = [CallTarget {
            out_dim: vocab,
            y_col_offset: 0,
            n_entries: 8,
        }];
        for stride in [8, 16, 64] {
            let call = DecodeCall::dense(1, in_dim, stride, OutputKind::F32, &targets).expect("a valid call");
            let f = Facts::of(&call, &DeviceLimits::SM80, DecodeContext::default());
            assert!(tall(&f), "{in_dim}->{vocab}");
            let splits: Vec<usize> = tall_splits(&f).collect();
            assert!(
                !splits.is_empty() && splits[0] > MAX_OUT_SPLITS,
                "r{stride}: {splits:?}"
            );
            assert!(splits.windows(2).all(|w| w[0] < w[1]), "{splits:?}");
            assert!(splits.iter().all(|&s| s <= vocab / 64), "{splits:?}");
        }
    }
}

/// Past the two launches' window (513 rows and more) a tall head runs the
/// fused kernel in more than [`MAX_OUT_SPLITS`] splits on sm_80; up to it,
/// two launches.
#[test]
fn tall_heads_take_two_launches_up_to_a_window_then_wide_splits() {
    let targets = [CallTarget {
        out_dim: 128_256,
        y_col_offset: 0,
        n_entries: 8,
    }];
    for n in [1, 64, 512] {
        let call = DecodeCall::dense(n, 4096, 16, OutputKind::F32, &targets).unwrap();
        let p = plan(&call, &DeviceLimits::SM80, DecodeContext::default(), Choice::Auto).unwrap();
        assert!(matches!(p.form, DecodeForm::TwoPhase(_)), "n{n}: {p}");
    }
    let call = DecodeCall::dense(2048, 4096, 16, OutputKind::F32, &targets).unwrap();
    let p = plan(&call, &DeviceLimits::SM80, DecodeContext::default(), Choice::Auto).unwrap();
    let DecodeForm::Fused(u) = p.form else {
        panic!("n2048: {p}");
    };
    assert!(u.out_splits > MAX_OUT_SPLITS, "{p}");
}

/// Rule 4½: on sm_90 an output head of 2 to `WINDOW_MAX` rows takes the
/// two launches (measured at n = 4, 8, 15 and 16: about half the fused
/// kernel's time), under the overlap promise too; one row takes them
/// without the overlap and keeps the fused kernel under it (measured
/// faster there), and a projection narrower than [`HEAD_MIN_OUT`] is no head.
#[test]
fn output_heads_take_two_launches_on_sm90() {
    let head = [CallTarget {
        out_dim: 128_256,
        y_col_offset: 0,
        n_entries: 16,
    }];
    for n in [2, 4, 8, 15, 16, 17, 64, 256, WINDOW_MAX] {
        let call = DecodeCall::dense(n, 4096, 16, OutputKind::F32, &head).unwrap();
        for overlap_previous in [false, true] {
            let ctx = DecodeContext {
                overlap_previous,
                ..DecodeContext::default()
            };
            let p = plan(&call, &DeviceLimits::H200, ctx, Choice::Auto).unwrap();
            assert!(matches!(p.form, DecodeForm::TwoPhase(_)), "n{n}: {p}");
        }
    }
    let call = DecodeCall::dense(1, 4096, 16, OutputKind::F32, &head).unwrap();
    let p = plan(&call, &DeviceLimits::H200, DecodeContext::default(), Choice::Auto).unwrap();
    assert!(matches!(p.form, DecodeForm::TwoPhase(_)), "n1: {p}");
    let overlapped = DecodeContext {
        overlap_previous: true,
        ..DecodeContext::default()
    };
    let p = plan(&call, &DeviceLimits::H200, overlapped, Choice::Auto).unwrap();
    assert!(matches!(p.form, DecodeForm::Fused(_)), "n1 overlapped: {p}");
    let narrow = [CallTarget {
        out_dim: HEAD_MIN_OUT - 64,
        ..head[0]
    }];
    let call = DecodeCall::dense(16, 4096, 16, OutputKind::F32, &narrow).unwrap();
    let f = Facts::of(&call, &DeviceLimits::H200, DecodeContext::default());
    assert!(head_rule(&f).is_none());
}

/// The DoRA epilogue is data of the targets, not a launch form: every
/// form applies it where it stores y, so a call with DoRA targets is the
/// same call to the planner as without them (`ops::dora`).
#[test]
fn dora_targets_plan_as_the_same_call() {
    let d = Device::cpu();
    let table = d.alloc_zeros::<PairEntry>(8).unwrap();
    let g_table = d.alloc_zeros::<u64>(16).unwrap();
    let bias = d.alloc_zeros::<f32>(4096).unwrap();
    let x = d.alloc_zeros::<half::bf16>(64 * 4096).unwrap();
    let mut y = d.alloc_zeros::<half::bf16>(64 * 4096).unwrap();
    let y = RowsMut::dense(&mut y, 64, 4096);
    let x = Rows::dense(&x, 64, 4096);
    let target = |dora| LoraTarget {
        table: &table,
        table_offset: 0,
        n_entries: 8,
        out_dim: 4096,
        y_col_offset: 0,
        dora,
    };
    let plain = DecodeCall::of(&x, &[target(None)], 16, &y).unwrap();
    for bias in [None, Some((&bias, 0))] {
        let epilogue = DoraEpilogue {
            table: &g_table,
            table_offset: 8,
            bias,
        };
        assert_eq!(DecodeCall::of(&x, &[target(Some(epilogue))], 16, &y).unwrap(), plain);
    }
}
