//! GPU equals CPU reference, for every kernel: fresh random inputs each run
//! (seed printed), poisoned outputs and scratch, odd shapes, every rank
//! against a padded pool, and graph replay after table contents change.
//! Skips without a GPU; fails instead under `LORA_REQUIRE_GPU=1`.

#![allow(clippy::unwrap_used)]

use half::bf16;
use lora_kernels::testing::{RandomPairs, Rng, cuda_or_skip, rel_error, widen};
use lora_kernels::{
    Chain, DecodeForm, DecodeOptions, DecodePlan, Device, DeviceBuffer, DoraEpilogue, EmbedOverlayEntry,
    EmbeddingPairs, EntryKernel, FusedForm, ItemList, KernelError, LmHeadOverlayEntry, LoraTarget, LoraWorkspace,
    MoeRouting, OutputElem, PairEntry, ROWS_MAX_IN, ROWS_MAX_OUT, Rows, RowsMut, Segments, TwoPhaseForm, WorkspaceSpec,
    bgmv, bgmv_candidates, bgmv_plan, bgmv_with, embed_lora, embed_overlay, embed_overlay_at, lm_head_overlay,
    moe_decode_index, moe_sorted_index, one_adapter, row_diff,
};
use lora_kernels::{Choice, PrefillCall, PrefillOptions, PrefillPlan, sgmv, sgmv_plan, sgmv_with};

const TOL: f64 = 1e-2;

/// One apply problem, built identically on any device.
#[derive(Clone)]
struct Problem {
    n: usize,
    in_dim: usize,
    outs: Vec<usize>,
    stride: usize,
    /// One `RandomPairs` per target, same slot count.
    pairs: Vec<RandomPairs>,
    x: Vec<bf16>,
    x_stride: usize,
    y_width: usize,
    y_bf16: Vec<bf16>,
    y_f32: Vec<f32>,
    /// The DoRA epilogue's inputs per target (`with_dora`), or none.
    dora: Option<Vec<DoraSpec>>,
}

/// One target's DoRA epilogue inputs: each slot's rescale `g` (none: a
/// plain-LoRA slot there) and the base bias, if any.
#[derive(Clone)]
struct DoraSpec {
    g: Vec<Option<Vec<f32>>>,
    bias: Option<Vec<f32>>,
}

impl Problem {
    fn new(
        rng: &mut Rng,
        n: usize,
        in_dim: usize,
        outs: &[usize],
        stride: usize,
        ranks: &[u32],
        poison: bool,
    ) -> Problem {
        let pairs: Vec<RandomPairs> = outs
            .iter()
            .map(|&out| {
                let mut p = RandomPairs::new(rng, in_dim, out, stride, ranks);
                if poison {
                    p.poison_padding();
                }
                p
            })
            .collect();
        // A few spare x columns and y columns that no target owns.
        let x_stride = in_dim + 3;
        let y_width = outs.iter().sum::<usize>() + 5;
        Problem {
            n,
            in_dim,
            outs: outs.to_vec(),
            stride,
            pairs,
            x: rng.bf16_vec(n * x_stride, 1.0),
            x_stride,
            y_width,
            y_bf16: rng.bf16_vec(n * y_width, 1.0),
            y_f32: (0..n * y_width).map(|_| rng.uniform()).collect(),
            dora: None,
        }
    }

    /// The same problem with DoRA epilogues at every target: two slots of
    /// every three have a rescale there (the third is plain LoRA; which
    /// ones differs by target), and with `bias` the even targets have a
    /// base bias (the odd ones none: zeros).
    fn with_dora(mut self, rng: &mut Rng, bias: bool) -> Problem {
        let slots = self.pairs[0].ranks.len();
        self.dora = Some(
            self.outs
                .iter()
                .enumerate()
                .map(|(t, &out)| DoraSpec {
                    g: (0..slots)
                        .map(|s| ((s + t) % 3 != 1).then(|| (0..out).map(|_| 1.0 + 0.5 * rng.uniform()).collect()))
                        .collect(),
                    bias: (bias && t % 2 == 0).then(|| (0..out).map(|_| rng.uniform()).collect()),
                })
                .collect(),
        );
        self
    }
}

impl Problem {
    /// The same adapters with x and y rows 16-byte aligned (a multiple of 8
    /// columns apart) and fresh x and y, for the forms that need it.
    fn with_aligned_rows(mut self, rng: &mut Rng) -> Problem {
        self.x_stride = self.in_dim.div_ceil(8) * 8 + 8;
        self.y_width = self.outs.iter().sum::<usize>().div_ceil(8) * 8 + 8;
        self.x = rng.bf16_vec(self.n * self.x_stride, 1.0);
        self.y_bf16 = rng.bf16_vec(self.n * self.y_width, 1.0);
        self.y_f32 = (0..self.n * self.y_width).map(|_| rng.uniform()).collect();
        self
    }
}

/// The problem's buffers on one device.
struct OnDevice {
    x: DeviceBuffer<bf16>,
    _weights: Vec<DeviceBuffer<bf16>>,
    /// All targets' tables in one buffer, target t at offset t * slots.
    table: DeviceBuffer<PairEntry>,
    slots: usize,
    /// Per target: its DoRA `g` address table, its bias (and the `g` buffers the table points at).
    dora: Vec<DoraOnDevice>,
}

/// One target's DoRA epilogue buffers.
struct DoraOnDevice {
    table: DeviceBuffer<u64>,
    bias: Option<DeviceBuffer<f32>>,
    _g: Vec<DeviceBuffer<f32>>,
}

impl DoraOnDevice {
    /// Each `g` in a buffer of its own, poisoned (NaN) past its outputs, so a
    /// read past them shows in y.
    fn new(dev: &Device, spec: &DoraSpec) -> DoraOnDevice {
        let mut table = Vec::new();
        let mut g_bufs = Vec::new();
        for g in &spec.g {
            match g {
                Some(g) => {
                    let mut v = g.clone();
                    v.extend([f32::NAN; 8]);
                    let buf = dev.upload(&v).unwrap();
                    table.push(buf.device_addr());
                    g_bufs.push(buf);
                }
                None => table.push(0),
            }
        }
        DoraOnDevice {
            table: dev.upload(&table).unwrap(),
            bias: spec.bias.as_ref().map(|b| dev.upload(b).unwrap()),
            _g: g_bufs,
        }
    }
}

impl OnDevice {
    fn new(dev: &Device, p: &Problem) -> OnDevice {
        OnDevice::shifted(dev, p, 0)
    }

    /// The buffers with every pair's weights `shift` elements past a 16-byte
    /// boundary (A and B rows of any 2-byte alignment; 0: aligned).
    fn shifted(dev: &Device, p: &Problem, shift: usize) -> OnDevice {
        let mut weights = Vec::new();
        let mut entries = Vec::new();
        for pairs in &p.pairs {
            let mut data = vec![bf16::ZERO; shift];
            data.extend_from_slice(&pairs.data);
            let w = dev.upload(&data).unwrap();
            entries.extend(pairs.entries(w.device_addr() + 2 * shift as u64));
            weights.push(w);
        }
        OnDevice {
            x: dev.upload(&p.x).unwrap(),
            _weights: weights,
            table: dev.upload(&entries).unwrap(),
            slots: p.pairs[0].ranks.len(),
            dora: p
                .dora
                .iter()
                .flatten()
                .map(|spec| DoraOnDevice::new(dev, spec))
                .collect(),
        }
    }

    fn targets<'a>(&'a self, p: &Problem) -> Vec<LoraTarget<'a>> {
        let mut col = 0;
        p.outs
            .iter()
            .enumerate()
            .map(|(t, &out)| {
                let target = LoraTarget {
                    table: &self.table,
                    table_offset: t * self.slots,
                    n_entries: self.slots,
                    out_dim: out,
                    y_col_offset: col,
                    dora: self.dora.get(t).map(|d| DoraEpilogue {
                        table: &d.table,
                        table_offset: 0,
                        bias: d.bias.as_ref().map(|b| (b, 0)),
                    }),
                };
                col += out;
                target
            })
            .collect()
    }

    fn x_rows(&self, p: &Problem) -> Rows<'_, bf16> {
        Rows {
            buf: &self.x,
            offset: 0,
            n_rows: p.n,
            width: p.in_dim,
            stride: p.x_stride,
        }
    }
}

/// y before and after on both devices: `(input, cpu, gpu)` widened.
fn compare<Y: OutputElem>(label: &str, input: &[Y], cpu: &[Y], gpu: &[Y]) {
    let (inp, c, g): (Vec<f32>, Vec<f32>, Vec<f32>) = (
        input.iter().map(|v| v.to_f32()).collect(),
        cpu.iter().map(|v| v.to_f32()).collect(),
        gpu.iter().map(|v| v.to_f32()).collect(),
    );
    let err = rel_error(&g, &c);
    if err >= TOL {
        // The first elements that differ, to tell a wrong row, target or slice from noise.
        let off: Vec<String> = (0..c.len())
            .filter(|&i| (g[i] - c[i]).abs() > 1e-2 * c[i].abs().max(1e-2))
            .take(24)
            .map(|i| format!("[{i}] in {} cpu {} gpu {}", inp[i], c[i], g[i]))
            .collect();
        panic!("{label}: ‖gpu − cpu‖/‖cpu‖ = {err:e}; differing: {}", off.join(", "));
    }
    // Elements the reference left bit-identical (no delta there) must be
    // bit-identical on the GPU too: no stray writes.
    for i in 0..c.len() {
        if c[i].to_bits() == inp[i].to_bits() && c[i] != 0.0 {
            let changed = (g[i] - c[i]).abs() > 1e-2 * c[i].abs().max(1e-3);
            assert!(
                !changed,
                "{label}: element {i} should be untouched: in {} gpu {}",
                inp[i], g[i]
            );
        }
    }
    // The deltas themselves agree (catches a skipped row hidden by a large y).
    let dc: Vec<f32> = c.iter().zip(&inp).map(|(a, b)| a - b).collect();
    let dg: Vec<f32> = g.iter().zip(&inp).map(|(a, b)| a - b).collect();
    let derr = rel_error(&dg, &dc);
    assert!(derr < 5e-2, "{label}: delta error {derr:e}");
}

/// Options that run exactly `plan`, with the overlap promise where its chain
/// needs it (here the previous kernel is an upload, a copy or an apply, none
/// of which writes idx, the tables or the weights).
fn exact(plan: DecodePlan) -> DecodeOptions {
    DecodeOptions {
        choice: lora_kernels::Choice::Exact(plan),
        overlap_previous: plan.chain == Chain::EarlyReads,
    }
}

/// The rule table's plan, with the overlap promise or without.
fn auto(overlap_previous: bool) -> DecodeOptions {
    DecodeOptions {
        choice: lora_kernels::Choice::Auto,
        overlap_previous,
    }
}

/// What a run ran, for messages: the plan's label, or the rule table's.
fn describe(options: DecodeOptions) -> String {
    match (options.choice, options.overlap_previous) {
        (lora_kernels::Choice::Exact(plan), _) => plan.to_string(),
        (lora_kernels::Choice::Auto, false) => "the rule table's plan".into(),
        (lora_kernels::Choice::Auto, true) => "the rule table's plan under the overlap".into(),
    }
}

/// The labels of `plans`, for messages.
fn labels(plans: &[DecodePlan]) -> String {
    plans.iter().map(DecodePlan::to_string).collect::<Vec<_>>().join(", ")
}

/// A problem's buffers and row indices on one device, applied again and
/// again, y uploaded afresh each time.
struct Applies<'a> {
    dev: &'a Device,
    p: &'a Problem,
    bufs: OnDevice,
    idx: DeviceBuffer<i32>,
}

impl<'a> Applies<'a> {
    fn new(dev: &'a Device, p: &'a Problem, idx: &[i32]) -> Applies<'a> {
        Applies::shifted(dev, p, idx, 0)
    }

    /// The buffers with the weights placed by `OnDevice::shifted`.
    fn shifted(dev: &'a Device, p: &'a Problem, idx: &[i32], shift: usize) -> Applies<'a> {
        Applies {
            dev,
            p,
            bufs: OnDevice::shifted(dev, p, shift),
            idx: dev.upload(idx).unwrap(),
        }
    }

    /// Every plan that serves the call with y of `Y` on this device, under
    /// the overlap promise or not (the rule table's first; none on the CPU).
    fn candidates<Y: OutputElem>(&self, y0: &[Y], overlap_previous: bool) -> Vec<DecodePlan> {
        let mut y = self.dev.upload(y0).unwrap();
        let y = RowsMut::dense(&mut y, self.p.n, self.p.y_width);
        let (x, targets) = (self.bufs.x_rows(self.p), self.bufs.targets(self.p));
        bgmv_candidates(self.dev, x, &targets, self.p.stride, &y, overlap_previous).unwrap()
    }

    /// The candidates, asserted to be some: some form serves every call of
    /// these tests.
    fn plans<Y: OutputElem>(&self, y0: &[Y], overlap_previous: bool) -> Vec<DecodePlan> {
        let plans = self.candidates(y0, overlap_previous);
        assert!(
            !plans.is_empty(),
            "n={} in={} outs={:?} stride={}: no plan (overlap {overlap_previous})",
            self.p.n,
            self.p.in_dim,
            self.p.outs,
            self.p.stride
        );
        plans
    }

    /// Whether the planner takes `plan` for the call.
    fn serves<Y: OutputElem>(&self, y0: &[Y], plan: DecodePlan) -> bool {
        let mut y = self.dev.upload(y0).unwrap();
        let y = RowsMut::dense(&mut y, self.p.n, self.p.y_width);
        let (x, targets) = (self.bufs.x_rows(self.p), self.bufs.targets(self.p));
        bgmv_plan(self.dev, x, &targets, self.p.stride, &y, exact(plan)).is_ok()
    }

    /// One apply adding into `y` (dense rows of the problem's width).
    fn apply<Y: OutputElem>(&self, y: &mut DeviceBuffer<Y>, options: DecodeOptions) -> Result<(), KernelError> {
        let y = RowsMut::dense(y, self.p.n, self.p.y_width);
        let (x, targets) = (self.bufs.x_rows(self.p), self.bufs.targets(self.p));
        bgmv_with(self.dev, x, &self.idx, &targets, self.p.stride, y, options)
    }

    /// One apply on y uploaded from `y0`, and the faults it raised.
    fn run_faulting<Y: OutputElem>(&self, y0: &[Y], options: DecodeOptions) -> (Vec<Y>, lora_kernels::FaultFlags) {
        let mut y = self.dev.upload(y0).unwrap();
        self.apply(&mut y, options)
            .unwrap_or_else(|e| panic!("{}: {e}", describe(options)));
        let faults = self.dev.take_faults().unwrap();
        (y.download().unwrap(), faults)
    }

    /// One apply on y uploaded from `y0`, which raises no fault.
    fn run<Y: OutputElem>(&self, y0: &[Y], options: DecodeOptions) -> Vec<Y> {
        let (y, faults) = self.run_faulting(y0, options);
        assert!(faults.is_empty(), "{}: faults {faults}", describe(options));
        y
    }
}

fn run_bgmv_on<Y: OutputElem>(dev: &Device, p: &Problem, idx: &[i32], y0: &[Y], options: DecodeOptions) -> Vec<Y> {
    Applies::new(dev, p, idx).run(y0, options)
}

/// Each of `runs` on the GPU against the CPU reference (computed once), bf16 y.
fn check_bgmv(gpu: &Device, label: &str, p: &Problem, idx: &[i32], runs: &[DecodeOptions]) {
    let c = run_bgmv_on(&Device::cpu(), p, idx, &p.y_bf16, DecodeOptions::default());
    let on = Applies::new(gpu, p, idx);
    for &options in runs {
        let g = on.run(&p.y_bf16, options);
        compare(&format!("{label} {} (bf16 y)", describe(options)), &p.y_bf16, &c, &g);
    }
}

/// The rule table's plan under the overlap promise or not, then each of `plans`.
fn runs_of(overlap_previous: bool, plans: &[DecodePlan]) -> Vec<DecodeOptions> {
    std::iter::once(auto(overlap_previous))
        .chain(plans.iter().map(|&plan| exact(plan)))
        .collect()
}

fn random_idx(rng: &mut Rng, n: usize, slots: usize, none_every: usize) -> Vec<i32> {
    (0..n)
        .map(|i| {
            if none_every > 0 && i % none_every == 0 {
                -1
            } else {
                rng.below(slots) as i32
            }
        })
        .collect()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_matches_cpu_over_shapes() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_matches_cpu_over_shapes") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_matches_cpu_over_shapes");
    // (n, in, outs, stride, slots)
    let shapes: &[(usize, usize, &[usize], usize, usize)] = &[
        (1, 4096, &[4096], 16, 4),
        (16, 4096, &[4096], 16, 16),
        (64, 2049, &[333], 16, 8),
        (64, 4096, &[4096], 64, 64),
        (256, 4096, &[1024, 256, 256], 16, 32),
        (700, 512, &[96], 32, 5),
        (33, 96, &[4097], 8, 3),
        // Wide outputs: the two-phase expand units past 1024 outputs.
        (64, 520, &[14336], 16, 64),
        (5, 7, &[9], 3, 2),
        // The largest rank stride: 32 lanes share each B row in the two-phase expand.
        (40, 1000, &[300], 256, 3),
    ];
    for &(n, in_dim, outs, stride, slots) in shapes {
        // Ranks spread over the stride (at stride 256: 1, 98, 195).
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 97 % stride) as u32).collect();
        let p = Problem::new(&mut rng, n, in_dim, outs, stride, &ranks, true);
        let idx = random_idx(&mut rng, n, slots, 7);
        let label = format!("n={n} in={in_dim} outs={outs:?} stride={stride}");
        let cpu = run_bgmv_on(&Device::cpu(), &p, &idx, &p.y_bf16, DecodeOptions::default());
        let on = Applies::new(&gpu, &p, &idx);
        // The rule table's plan and every candidate (each form, kernel,
        // cluster size, item source and cluster sum that serves the call; the
        // two-phase kernels serve single windows of 512 rows only), and the
        // scanning fused ones with a cluster for every row (the
        // row-mapped form in 16-warp clusters of 2 where their stage fits),
        // without the overlap promise and with it (the previous kernel is an upload).
        let mut runs = Vec::new();
        for overlap in [false, true] {
            let plans = on.plans(&p.y_bf16, overlap);
            let per_row = cluster_per_row(&on, &p.y_bf16, &plans);
            if !overlap {
                // The cluster sum both ways where the push's receive buffers fit.
                if stride <= 64 {
                    plans_where(&label, &plans, |t| matches!(t.form, DecodeForm::Fused(f) if f.push_sum));
                    assert!(
                        plans
                            .iter()
                            .chain(&per_row)
                            .any(|t| is_row_mapped_any_splits(t, scan_window(n))),
                        "{label}: no row-mapped plan among {}",
                        labels(&[plans.as_slice(), &per_row].concat())
                    );
                }
                // The row-register form where its shape limits allow.
                if stride == 16
                    && in_dim.is_multiple_of(8)
                    && in_dim <= ROWS_MAX_IN
                    && outs.iter().all(|&o| o <= ROWS_MAX_OUT)
                {
                    plans_where(&label, &plans, is_row_registers);
                }
                assert_forms(&label, &plans, &FUSED_FORMS);
            }
            runs.extend(runs_of(overlap, &plans));
            runs.extend(per_row.into_iter().map(exact));
        }
        for options in runs {
            let g = on.run(&p.y_bf16, options);
            compare(&format!("{label} {} (bf16 y)", describe(options)), &p.y_bf16, &cpu, &g);
        }
        if stride > 64 {
            // The push's receive buffers of rank stride 256 do not fit: no
            // candidate pushes, and each clustered one is refused with its sum pushed.
            let plans = on.candidates(&p.y_bf16, false);
            let clustered = plans_where(
                &label,
                &plans,
                |t| matches!(t.form, DecodeForm::Fused(f) if f.cluster > 1),
            );
            for t in clustered {
                let DecodeForm::Fused(f) = t.form else { unreachable!() };
                assert!(!f.push_sum, "{label}: {t}");
                let pushed = DecodePlan {
                    form: DecodeForm::Fused(FusedForm { push_sum: true, ..f }),
                    ..t
                };
                let mut y = gpu.upload(&p.y_bf16).unwrap();
                let err = on.apply(&mut y, exact(pushed)).unwrap_err();
                assert!(err.to_string().contains("rank_stride"), "{pushed}: {err}");
            }
        }
    }
}

/// A plan's form and kernel, its launch shape and chain left out (for the
/// old hand-picked forms, and to pick one plan of each form).
fn form_name(p: &DecodePlan) -> &'static str {
    match p.form {
        DecodeForm::RowRegisters { straight_line: true } => "rows full",
        DecodeForm::RowRegisters { straight_line: false } => "rows",
        DecodeForm::Entry {
            kernel: EntryKernel::Staged { cluster: 8 },
            ..
        } => "entry c8",
        DecodeForm::Entry {
            kernel: EntryKernel::Staged { .. },
            ..
        } => "entry c4",
        DecodeForm::Entry {
            kernel: EntryKernel::Registers,
            ..
        } => "entry reg",
        DecodeForm::Entry {
            kernel: EntryKernel::Spread,
            ..
        } => "entry spread",
        DecodeForm::TwoPhase(t) => {
            if t.shrink_tensor_cores {
                "two-phase rows tc"
            } else {
                "two-phase rows"
            }
        }
        DecodeForm::Fused(f) => match (f.tensor_cores, f.items) {
            (false, ItemList::Scan) => "fused scalar scan",
            (true, ItemList::Scan) => "fused tc scan",
            // Refused by the planner: the item list serves tensor cores only.
            (false, ItemList::Listed) => "fused scalar list",
            (true, ItemList::Listed) => "fused tc list",
        },
    }
}

/// Every form of the fused kernel: scalar and tensor-core, each scanning
/// its window, and on tensor cores also reading the item list of a first
/// launch (`bgmv_list`) after that launch completes.
const FUSED_FORMS: [&str; 3] = ["fused scalar scan", "fused tc scan", "fused tc list"];

/// The two-phase kernels (shrink, then expand; every row its own item, the
/// expand reads its first entry, B rows and y before it waits), with the
/// shrink scalar and on tensor cores.
const TWO_PHASE_FORMS: [&str; 2] = ["two-phase rows", "two-phase rows tc"];

/// Asserts that each of `forms` (`form_name`) is among `plans`: each form
/// the tests forced before the plans still runs where it served.
fn assert_forms(label: &str, plans: &[DecodePlan], forms: &[&str]) {
    for form in forms {
        assert!(
            plans.iter().any(|p| form_name(p) == *form),
            "{label}: no {form} plan among {}",
            labels(plans)
        );
    }
}

/// The plans of `plans` that `form` keeps, asserted to be some (the form
/// served the call before the plans).
fn plans_where(label: &str, plans: &[DecodePlan], form: impl Fn(&DecodePlan) -> bool) -> Vec<DecodePlan> {
    let kept: Vec<DecodePlan> = plans.iter().copied().filter(|p| form(p)).collect();
    assert!(!kept.is_empty(), "{label}: no such plan among {}", labels(plans));
    kept
}

/// The fused kernel's scanning form (every block lists its window's items).
fn is_fused_scan(p: &DecodePlan) -> bool {
    matches!(
        p.form,
        DecodeForm::Fused(FusedForm {
            items: ItemList::Scan,
            ..
        })
    )
}

/// The fused kernel reading the item list of a first launch, after that
/// launch completes.
fn is_fused_listed(p: &DecodePlan) -> bool {
    matches!(
        p.form,
        DecodeForm::Fused(FusedForm {
            items: ItemList::Listed,
            ..
        })
    )
}

/// The row-mapped form: the scanning scalar kernel in 16-warp clusters of 2
/// with a cluster for every row of its window of `rows` rows, one split.
fn is_row_mapped(p: &DecodePlan, rows: usize) -> bool {
    is_row_mapped_any_splits(p, rows) && matches!(p.form, DecodeForm::Fused(f) if f.out_splits == 1)
}

/// The same with any number of output splits (where one does not fit).
fn is_row_mapped_any_splits(p: &DecodePlan, rows: usize) -> bool {
    matches!(
        p.form,
        DecodeForm::Fused(FusedForm {
            cluster: 2,
            clusters_per_window,
            tensor_cores: false,
            items: ItemList::Scan,
            ..
        }) if clusters_per_window == rows
    )
}

/// The row-register form: a cluster of 2 blocks per (row, target), loads into registers.
fn is_row_registers(p: &DecodePlan) -> bool {
    matches!(p.form, DecodeForm::RowRegisters { .. })
}

/// The entry-clustered form: a cluster of 8 or 4 blocks (or the spread
/// kernel's 4 blocks) per table entry.
fn is_entry(p: &DecodePlan) -> bool {
    matches!(p.form, DecodeForm::Entry { .. })
}

/// The entry form waiting first with its entries' weights asked into L2 before the wait.
fn is_entry_prefetch(p: &DecodePlan) -> bool {
    matches!(p.form, DecodeForm::Entry { prefetch: true, .. })
}

/// Any two-phase plan.
fn is_two_phase(p: &DecodePlan) -> bool {
    matches!(p.form, DecodeForm::TwoPhase(_))
}

/// A fused plan with other output splits and clusters per window (launch
/// shapes the cost model does not pick); `None` for the other forms.
fn with_launch(plan: DecodePlan, out_splits: usize, clusters_per_window: usize) -> Option<DecodePlan> {
    match plan.form {
        DecodeForm::Fused(f) => Some(DecodePlan {
            form: DecodeForm::Fused(FusedForm {
                out_splits,
                clusters_per_window,
                ..f
            }),
            ..plan
        }),
        _ => None,
    }
}

/// Rows of the scanning fused form's windows for a batch of `n` rows: the
/// batch up to 512 rows, else 256.
fn scan_window(n: usize) -> usize {
    if n <= 512 { n } else { 256 }
}

/// The scanning fused plans of `plans` with a cluster for every row of their
/// window (the row-mapped form in 16-warp clusters of 2; most clusters idle
/// in the others), at the fewest output splits the planner takes, where it
/// takes one and the candidates do not hold it.
fn cluster_per_row<Y: OutputElem>(on: &Applies<'_>, y0: &[Y], plans: &[DecodePlan]) -> Vec<DecodePlan> {
    let window = scan_window(on.p.n);
    let mut out: Vec<DecodePlan> = Vec::new();
    for &plan in plans.iter().filter(|p| is_fused_scan(p)) {
        let served = [1, 2, 4, 8, 16]
            .into_iter()
            .filter_map(|splits| with_launch(plan, splits, window))
            .find(|&v| on.serves(y0, v));
        if let Some(v) = served
            && !plans.contains(&v)
            && !out.contains(&v)
        {
            out.push(v);
        }
    }
    out
}

/// The first plan of each form (`form_name`) among `plans` launched with `chain`.
fn one_per_form(plans: &[DecodePlan], chain: Chain) -> Vec<DecodePlan> {
    let mut out: Vec<DecodePlan> = Vec::new();
    for &p in plans {
        if p.chain == chain && !out.iter().any(|q| form_name(q) == form_name(&p)) {
            out.push(p);
        }
    }
    out
}

/// The plans of `groups` taken in turn, one of each group while it lasts.
fn interleave(groups: &[Vec<DecodePlan>]) -> Vec<DecodePlan> {
    let longest = groups.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest)
        .flat_map(|i| groups.iter().filter_map(move |g| g.get(i).copied()))
        .collect()
}

/// Applies chained in one stream, each reading as x what the one before
/// wrote as y (under the overlap promise: launched as a programmatic
/// dependent, it reads x and y only after the previous kernel completed),
/// against the same chain on the CPU. Both buffers hold `n` rows of `pitch`
/// columns (x and y use the first `in_dim == out` of them); apply i reads
/// `bufs[i % 2]` and adds into `bufs[(i + 1) % 2]`. Returns what the last
/// apply wrote, or with `every` what each apply wrote (downloaded after
/// it: only the CPU reference does that, so on the GPU each launch meets
/// its predecessor still running).
fn overlap_chain(dev: &Device, case: &ChainCase, chain: &[DecodeOptions], every: bool) -> Vec<Vec<f32>> {
    let p = &case.p;
    assert_eq!(p.outs, [p.in_dim], "the chain feeds y back as x");
    let on = OnDevice::new(dev, p);
    let idx = dev.upload(&case.idx).unwrap();
    let targets = on.targets(p);
    let mut bufs = [dev.upload(&case.start[0]).unwrap(), dev.upload(&case.start[1]).unwrap()];
    let mut out = Vec::new();
    for (i, &options) in chain.iter().enumerate() {
        let (lo, hi) = bufs.split_at_mut(1);
        let (x, y) = if i % 2 == 0 {
            (&lo[0], &mut hi[0])
        } else {
            (&hi[0], &mut lo[0])
        };
        let (x, y) = case.views(x, y);
        bgmv_with(dev, x, &idx, &targets, p.stride, y, options)
            .unwrap_or_else(|e| panic!("apply {i} {}: {e}", describe(options)));
        if every {
            out.push(widen(&bufs[(i + 1) % 2].download().unwrap()));
        }
    }
    dev.check_faults().unwrap();
    if !every {
        out.push(widen(&bufs[chain.len() % 2].download().unwrap()));
    }
    out
}

/// (n, width, rank stride, slots) of a chain's applies.
type ApplyShape = (usize, usize, usize, usize);

/// Most applies of one chain built from a sequence of plans ([`chains_of`]:
/// a longer sequence runs as several chains, each from the same start).
const CHAIN_LEN: usize = 12;

/// One shape of chained applies on random data: the problem (one target as
/// wide as `in`), the row indices and both buffers' first contents.
struct ChainCase {
    p: Problem,
    idx: Vec<i32>,
    /// Columns from one row of a buffer to the next.
    pitch: usize,
    start: [Vec<bf16>; 2],
}

impl ChainCase {
    fn new(rng: &mut Rng, (n, width, stride, slots): ApplyShape) -> ChainCase {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 7 % stride) as u32).collect();
        let p = Problem::new(rng, n, width, &[width], stride, &ranks, true);
        // Rows of no adapter among the rest (a single row always has one).
        let idx = random_idx(rng, n, slots, if n == 1 { 0 } else { 5 });
        // 16-byte aligned rows (the vector paths) with spare columns past the width.
        let pitch = width.div_ceil(8) * 8 + 8;
        let start = [rng.bf16_vec(n * pitch, 1.0), rng.bf16_vec(n * pitch, 1.0)];
        ChainCase { p, idx, pitch, start }
    }

    fn label(&self) -> String {
        format!("n={} width={} stride={}", self.p.n, self.p.in_dim, self.p.stride)
    }

    /// x and y of one apply: `n` rows of `pitch` columns.
    fn views<'a>(
        &self,
        x: &'a DeviceBuffer<bf16>,
        y: &'a mut DeviceBuffer<bf16>,
    ) -> (Rows<'a, bf16>, RowsMut<'a, bf16>) {
        let (n_rows, width, stride) = (self.p.n, self.p.in_dim, self.pitch);
        (
            Rows {
                buf: x,
                offset: 0,
                n_rows,
                width,
                stride,
            },
            RowsMut {
                buf: y,
                offset: 0,
                n_rows,
                width,
                stride,
            },
        )
    }

    /// Every plan that serves the chain's applies on `gpu`, under the overlap promise or not.
    fn candidates(&self, gpu: &Device, overlap_previous: bool) -> Vec<DecodePlan> {
        let on = OnDevice::new(gpu, &self.p);
        let x = gpu.upload(&self.start[0]).unwrap();
        let mut y = gpu.upload(&self.start[1]).unwrap();
        let (x, y) = self.views(&x, &mut y);
        bgmv_candidates(gpu, x, &on.targets(&self.p), self.p.stride, &y, overlap_previous).unwrap()
    }

    /// Whether the planner takes `plan` for the chain's applies.
    fn serves(&self, gpu: &Device, plan: DecodePlan) -> bool {
        let on = OnDevice::new(gpu, &self.p);
        let x = gpu.upload(&self.start[0]).unwrap();
        let mut y = gpu.upload(&self.start[1]).unwrap();
        let (x, y) = self.views(&x, &mut y);
        bgmv_plan(gpu, x, &on.targets(&self.p), self.p.stride, &y, exact(plan)).is_ok()
    }

    /// Each chain on `gpu` against the same applies on the CPU (run once,
    /// as long as the longest chain: every chain starts from the same buffers).
    fn check(&self, gpu: &Device, chains: &[Vec<DecodeOptions>]) {
        let longest = chains.iter().map(Vec::len).max().unwrap_or(0);
        let cpu = overlap_chain(&Device::cpu(), self, &vec![DecodeOptions::default(); longest], true);
        let label = self.label();
        for chain in chains {
            let g = overlap_chain(gpu, self, chain, false).pop().unwrap();
            let applies = chain.iter().map(|&o| describe(o)).collect::<Vec<_>>().join(", ");
            assert!(
                g.iter().all(|v| v.is_finite()),
                "{label} [{applies}]: non-finite output"
            );
            let err = rel_error(&g, &cpu[chain.len() - 1]);
            assert!(err < TOL, "{label} [{applies}]: ‖gpu − cpu‖/‖cpu‖ = {err:e}");
        }
    }
}

/// `plans` as chains of at most [`CHAIN_LEN`] applies.
fn chains_of(plans: &[DecodePlan]) -> Vec<Vec<DecodeOptions>> {
    plans
        .chunks(CHAIN_LEN)
        .map(|c| c.iter().map(|&plan| exact(plan)).collect())
        .collect()
}

/// `plan` launched plainly.
fn plain(plan: DecodePlan) -> DecodePlan {
    DecodePlan {
        chain: Chain::Plain,
        ..plan
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_overlap_previous_reads_x_and_y_after_the_previous_kernel() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_overlap_previous_reads_x_and_y_after_the_previous_kernel") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_overlap_previous_reads_x_and_y_after_the_previous_kernel");
    // (n, width, stride, slots): the first item's A chunks requested before
    // the wait (one or two chunks), or everything after it (more chunks: one
    // block per item). Every scanning fused plan under the overlap: clusters
    // of 1, 2, 4 and 8, scalar and on tensor cores, the cluster sum pushed
    // or pulled, and the tensor-core ones also with 2 clusters a window.
    for shape in [(1, 4096, 16, 2), (16, 1024, 16, 5), (9, 2048, 64, 3), (40, 520, 32, 6)] {
        let case = ChainCase::new(&mut rng, shape);
        let mut scans = plans_where(&case.label(), &case.candidates(&gpu, true), is_fused_scan);
        let two_clusters: Vec<DecodePlan> = scans
            .iter()
            .filter(|p| form_name(p) == "fused tc scan")
            .filter_map(|&p| with_launch(p, 1, 2))
            .filter(|&p| case.serves(&gpu, p))
            .collect();
        for p in two_clusters {
            if !scans.contains(&p) {
                scans.push(p);
            }
        }
        // A plain apply first (its predecessor is an upload), then dependents.
        let chains: Vec<Vec<DecodeOptions>> = scans
            .iter()
            .map(|&t| std::iter::once(exact(plain(t))).chain([exact(t); 5]).collect())
            .collect();
        case.check(&gpu, &chains);
    }
}

/// The overlap in the forms of two launches: the item list (`bgmv_list`
/// reads idx and the tables before its wait, writes its list after it) and
/// the two-phase shrink (idx and the tables before its wait; the scratch and
/// x after it). Chains mix the forms, so each one's first kernel runs under
/// a previous apply's last kernel that still reads the same scratch.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_overlap_previous_in_the_list_and_two_phase_forms() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_overlap_previous_in_the_list_and_two_phase_forms") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_overlap_previous_in_the_list_and_two_phase_forms");
    // (n, width, stride, slots): one window and several (n > 512 for the list).
    let shapes = [
        (200, 1024, 16, 7),
        (64, 2048, 64, 9),
        (300, 520, 32, 4),
        (700, 264, 16, 11),
    ];
    for shape in shapes {
        let case = ChainCase::new(&mut rng, shape);
        let label = case.label();
        let overlap = case.candidates(&gpu, true);
        // Every listed plan under the overlap (each cluster size, on tensor
        // cores, waiting for the list launch, pushed or pulled), every
        // two-phase one (the two-phase kernels serve at most one window), and
        // a few scanning ones.
        let listed = plans_where(&label, &overlap, is_fused_listed);
        let two_phase: Vec<DecodePlan> = overlap.iter().copied().filter(is_two_phase).collect();
        if shape.0 <= 512 {
            assert_forms(&label, &two_phase, &TWO_PHASE_FORMS);
        }
        let scans = plans_where(&label, &overlap, is_fused_scan);
        let mixed = interleave(&[listed.clone(), two_phase.clone(), scans[..scans.len().min(3)].to_vec()]);
        // A plain apply first (its predecessor is an upload), then the forms in turn.
        let mut sequence = vec![plain(mixed[0])];
        sequence.extend(mixed);
        let mut chains = chains_of(&sequence);
        // And each form chained to itself.
        chains.extend(listed.iter().chain(&two_phase).map(|&t| vec![exact(t); 5]));
        // The defaults under the overlap (up to 256 rows every block scans
        // its window on tensor cores; past that, the list).
        chains.push(vec![auto(false), auto(true), auto(true), auto(true)]);
        case.check(&gpu, &chains);
    }
}

/// Every decode form sums in a fixed order (the two-phase shrink: at most
/// two column groups, each walking its own passes, or the tensor-core tiles
/// in warp order; the fused kernel's warps and cluster peers in order), so
/// repeated applies give the same f32 bits: long K slices (several
/// 256-column passes per warp) and items of several rows, in every
/// candidate plan (with the two-phase ones' other K slices and expand
/// launches and the fused ones' cluster for every row).
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_decode_applies_are_bit_reproducible() {
    let Some(gpu) = cuda_or_skip("gpu_decode_applies_are_bit_reproducible") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_decode_applies_are_bit_reproducible");
    // (n, in, stride, slots): 40 items over 8 K slices of 2048 columns; 8-row
    // items of an odd width.
    for (n, in_dim, stride, slots) in [(40, 16384, 16, 40), (64, 4100, 64, 8)] {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 13 % stride) as u32).collect();
        let p = Problem::new(&mut rng, n, in_dim, &[1024], stride, &ranks, true);
        let idx: Vec<i32> = (0..n).map(|i| (i % slots) as i32).collect();
        let label = format!("n={n} in={in_dim}");
        let cpu = run_bgmv_on(&Device::cpu(), &p, &idx, &p.y_f32, DecodeOptions::default());
        let on = Applies::new(&gpu, &p, &idx);
        let mut plans = on.plans(&p.y_f32, false);
        assert_forms(&label, &plans, &FUSED_FORMS);
        assert_forms(&label, &plans, &TWO_PHASE_FORMS);
        plans.extend(cluster_per_row(&on, &p.y_f32, &plans));
        assert!(
            plans.iter().any(|t| is_row_mapped_any_splits(t, n)),
            "{label}: {}",
            labels(&plans)
        );
        for t in plans {
            let first = on.run(&p.y_f32, exact(t));
            compare(&format!("{label} {t}"), &p.y_f32, &cpu, &first);
            for _ in 0..4 {
                let again = on.run(&p.y_f32, exact(t));
                let same = first.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{label} {t}: a repeated apply differs");
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_every_rank_against_padded_pool() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_every_rank_against_padded_pool") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_every_rank_against_padded_pool");
    let ranks: Vec<u32> = (1..=64).collect();
    let p = Problem::new(&mut rng, 128, 1024, &[768], 64, &ranks, true);
    // Every rank once, then every rank again in another order.
    let mut idx: Vec<i32> = (0..64).collect();
    idx.extend((0..64).map(|i| i * 37 % 64));
    // Every candidate: each fused form and each two-phase one.
    let plans = Applies::new(&gpu, &p, &idx).plans(&p.y_bf16, false);
    assert_forms("every rank", &plans, &FUSED_FORMS);
    assert_forms("every rank", &plans, &TWO_PHASE_FORMS);
    check_bgmv(&gpu, "every rank", &p, &idx, &runs_of(false, &plans));
}

/// The row-mapped clusters of 2 at rank stride 16: every rank 1..=16
/// against a poisoned padded pool, rows of no adapter, blocks of 2048
/// outputs and of a few hundred, f32 y, and weights 16-, 8- or 2-byte
/// aligned, against the CPU and the default (every row-mapped plan, pushed
/// and pulled).
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_row_mapped_every_rank_to_16() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_row_mapped_every_rank_to_16") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_row_mapped_every_rank_to_16");
    for (outs, aligned_rows) in [
        (&[4096][..], true),
        (&[4096], false),
        (&[1000, 24], true),
        (&[1000, 24], false),
    ] {
        check_row_form(
            &gpu,
            &mut rng,
            (64, 1024, outs),
            aligned_rows,
            (3, 40),
            &|t| is_row_mapped(t, 64),
            true,
        );
    }
}

/// One shape of the row forms' tests: pairs of every rank 1..=16 over a
/// poisoned padded pool, row i naming entry (i % 17) - 1 (-1: no adapter)
/// with the rows `swap` exchanged, x and y rows 16-byte aligned or not:
/// every candidate `form` keeps (asserted to be some) and, `with_default`,
/// the rule table's plan, with the weights shifted by 0, 4 and 1 elements
/// (16-, 8- and 2-byte aligned) against the CPU with bf16 y, then every
/// candidate `form` keeps with f32 y. Returns the plans run with bf16 y and with f32 y.
fn check_row_form(
    gpu: &Device,
    rng: &mut Rng,
    (n, in_dim, outs): (usize, usize, &[usize]),
    aligned_rows: bool,
    swap: (usize, usize),
    form: &dyn Fn(&DecodePlan) -> bool,
    with_default: bool,
) -> (Vec<DecodePlan>, Vec<DecodePlan>) {
    let cpu = Device::cpu();
    let ranks: Vec<u32> = (1..=16).collect();
    let p = Problem::new(rng, n, in_dim, outs, 16, &ranks, true);
    let p = if aligned_rows { p.with_aligned_rows(rng) } else { p };
    let mut idx: Vec<i32> = (0..n).map(|i| (i % 17) as i32 - 1).collect();
    idx.swap(swap.0, swap.1);
    let shape = format!("n={n} in={in_dim} outs={outs:?} aligned rows {aligned_rows}");
    let c = run_bgmv_on(&cpu, &p, &idx, &p.y_bf16, DecodeOptions::default());
    let bf16_plans = plans_where(&shape, &Applies::new(gpu, &p, &idx).candidates(&p.y_bf16, false), form);
    let mut runs: Vec<DecodeOptions> = bf16_plans.iter().map(|&t| exact(t)).collect();
    if with_default {
        runs.insert(0, DecodeOptions::default());
    }
    for shift in [0, 4, 1] {
        let on = Applies::shifted(gpu, &p, &idx, shift);
        for &t in &runs {
            let g = on.run(&p.y_bf16, t);
            compare(
                &format!("{shape} weights shifted by {shift} {}", describe(t)),
                &p.y_bf16,
                &c,
                &g,
            );
        }
    }
    let c = run_bgmv_on(&cpu, &p, &idx, &p.y_f32, DecodeOptions::default());
    let on = Applies::new(gpu, &p, &idx);
    let f32_plans = plans_where(&format!("{shape} f32 y"), &on.candidates(&p.y_f32, false), form);
    for &t in &f32_plans {
        let g = on.run(&p.y_f32, exact(t));
        compare(&format!("{shape} f32 y {t}"), &p.y_f32, &c, &g);
    }
    (bf16_plans, f32_plans)
}

/// The row-register form (`DecodeForm::RowRegisters`): every rank 1..=16
/// against a poisoned padded pool, rows of no adapter, blocks of 2048
/// outputs and columns (every thread busy) and of a few (threads and the
/// second block partly or wholly idle), outputs not a multiple of 4 (a
/// thread's last outputs one by one), several targets, f32 y, rows 16-byte
/// aligned or not, and weights 16-byte aligned or only 8- or 2-byte (element
/// loads), against the CPU, in every chain its candidates hold; at 4096 x
/// 4096 with aligned rows also the `_full` kernels, whose straight-line
/// form serves the rank-16 entries with aligned weights and the general
/// form the others; at n = 64 of one target also the default and the
/// row-mapped fused form.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_row_registers() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_row_registers") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_row_registers");
    // (n, in, outs)
    let shapes: &[(usize, usize, &[usize])] = &[
        (64, 4096, &[4096]),
        (48, 4096, &[4096, 4096]),
        (64, 1024, &[1000, 24]),
        (50, 2056, &[4093]),
        (3, 8, &[8, 5, 3]),
    ];
    for &(n, in_dim, outs) in shapes {
        let also_fused = n == 64 && outs.len() == 1;
        let form = |t: &DecodePlan| is_row_registers(t) || (also_fused && is_row_mapped(t, n));
        for aligned_rows in [true, false] {
            let (bf16_plans, f32_plans) = check_row_form(
                &gpu,
                &mut rng,
                (n, in_dim, outs),
                aligned_rows,
                (1, n - 1),
                &form,
                also_fused,
            );
            let label = format!("n={n} in={in_dim} outs={outs:?} aligned rows {aligned_rows}");
            let mut forms = vec!["rows"];
            if aligned_rows && in_dim == ROWS_MAX_IN && outs.iter().all(|&o| o == ROWS_MAX_OUT) {
                forms.push("rows full");
            }
            assert_forms(&label, &bf16_plans, &forms);
            assert_forms(&format!("{label} f32 y"), &f32_plans, &forms);
            if also_fused {
                plans_where(&label, &bf16_plans, |t| is_row_mapped(t, n));
            }
        }
    }
    // Tiny calls of several odd-width targets, again and again on fresh
    // inputs. A target that ends 1 past a multiple of 4 outputs, followed
    // by another in the same 8 bytes of y, caught a miscompile (NOTES.md
    // v30): its thread of 1 output took the 4-output vector store and wrote
    // stale y over the next target's first columns, in some rows only, as
    // the two blocks' stores raced.
    for round in 0..16 {
        let outs: &[usize] = if round % 2 == 0 { &[8, 5, 3] } else { &[3, 3, 7, 1] };
        let shape = (3 + round % 3, 8, outs);
        check_row_form(&gpu, &mut rng, shape, round % 4 < 2, (0, 1), &is_row_registers, false);
    }
}

/// The row-register form's faults (an index past the table, an entry of a
/// rank past the stride: their rows get no delta, the others theirs), its
/// refusals (an exact plan it cannot serve: a typed error naming the plan's
/// field, nothing launched), and the overlap (x and y read only after the
/// previous kernel) in chains mixed with the fused form.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_row_registers_faults_refusals_and_overlap() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_row_registers_faults_refusals_and_overlap") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_row_registers_faults_refusals_and_overlap");
    let (n, stride) = (5, 16);
    let p = Problem::new(&mut rng, n, 64, &[32], stride, &[16, 7], false);
    let mut on = Applies::new(&gpu, &p, &[0, 1, 9, -1, 0]);
    on.bufs.table = table_with_bad_rank(&gpu, &on.bufs, stride);
    let good_only = run_bgmv_on(
        &Device::cpu(),
        &p,
        &[0, -1, -1, -1, 0],
        &p.y_bf16,
        DecodeOptions::default(),
    );
    let label = "row registers, bad entry and index";
    for t in plans_where(label, &on.candidates(&p.y_bf16, false), is_row_registers) {
        let (y, faults) = on.run_faulting(&p.y_bf16, exact(t));
        assert_eq!(
            faults.0,
            lora_kernels::FaultFlags::BAD_RANK | lora_kernels::FaultFlags::BAD_INDEX,
            "faults: {faults} {t}"
        );
        compare(&format!("{label} {t}"), &p.y_bf16, &good_only, &y);
    }
    let row_registers = |straight_line| DecodePlan {
        form: DecodeForm::RowRegisters { straight_line },
        chain: Chain::Plain,
    };
    // The straight-line kernels only at 4096 x 4096.
    let mut y = gpu.upload(&p.y_bf16).unwrap();
    let err = on.apply(&mut y, exact(row_registers(true))).unwrap_err();
    assert!(err.to_string().contains("plan.straight_line"), "{err}");
    assert_eq!(y.download().unwrap(), p.y_bf16, "nothing launched");

    // Refused: another rank stride, in past the limit or not a multiple of 8, a wider target.
    let refused: [(usize, usize, usize); 4] = [
        (32, 64, 32),
        (16, ROWS_MAX_IN + 8, 32),
        (16, 60, 32),
        (16, 64, ROWS_MAX_OUT + 8),
    ];
    for (stride, in_dim, out) in refused {
        let p = Problem::new(&mut rng, 2, in_dim, &[out], stride, &[4], false);
        let on = Applies::new(&gpu, &p, &[0, 0]);
        for straight_line in [false, true] {
            let before = p.y_bf16.clone();
            let mut y = gpu.upload(&before).unwrap();
            let err = on.apply(&mut y, exact(row_registers(straight_line))).unwrap_err();
            assert!(
                err.to_string().contains("plan.form"),
                "stride {stride} in {in_dim} out {out}: {err}"
            );
            assert_eq!(y.download().unwrap(), before, "nothing launched");
        }
    }
    // Row registers together with entry clusters (the old knobs' conflict)
    // cannot be expressed: a plan has one form.

    // Each row-register plan under the overlap, chained with a plain
    // scanning fused apply.
    for (rows, width, slots) in [(64, 4096, 64), (7, 1024, 3)] {
        let case = ChainCase::new(&mut rng, (rows, width, 16, slots));
        let label = case.label();
        let overlap = plans_where(&label, &case.candidates(&gpu, true), is_row_registers);
        let scan = plans_where(&label, &case.candidates(&gpu, false), |t| {
            form_name(t) == "fused scalar scan"
        })[0];
        let chains: Vec<Vec<DecodeOptions>> = overlap
            .iter()
            .map(|&t| [scan, t, t, scan, t, t].map(exact).to_vec())
            .collect();
        case.check(&gpu, &chains);
    }
}

/// Waiting first (`Chain::WaitFirst` and `Chain::WaitFirstEarlyNext`, the
/// default chains of the entry-clustered, row-register and two-phase forms:
/// a programmatic dependent whose blocks wait for the previous kernel
/// before any read, and let the next one launch late or early): chained
/// applies, each reading as x what the one before wrote as y, in every
/// plan that takes it (the staged, register and spread entry kernels, the
/// row-register one, straight-line and general, the two-phase shrinks with
/// their expands letting the next apply in at their start or before their
/// last stores, the expand reading y before its wait), with and
/// without the weights asked into L2 before the wait, mixed with plain
/// launches (the spread kernel's cooperative), the fused kernel (which does
/// not wait first) and the overlap. Back-to-back spread launches also show
/// that each leaves its inboxes zero: a stale word tagged as a later
/// launch's pass would be summed.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_wait_first_keeps_the_stream_order() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_wait_first_keeps_the_stream_order") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_wait_first_keeps_the_stream_order");
    // (n, width, stride, slots) and the forms that wait first there: 8 rows
    // an entry at 4096 (the register kernel's default), few rows an entry,
    // rank 64 in clusters of 4, the row-register form at 4096 x 4096 and
    // smaller, the two-phase forms.
    let shapes: [(ApplyShape, &[&str]); 7] = [
        ((256, 4096, 16, 32), &["entry reg", "entry c8", "entry spread"]),
        ((64, 1000, 16, 9), &["entry c8", "entry reg", "entry spread"]),
        ((48, 2056, 64, 5), &["entry c4"]),
        ((64, 4096, 16, 64), &["rows full", "entry reg"]),
        ((7, 1024, 16, 3), &["rows"]),
        ((64, 2048, 64, 9), &["entry c4", "two-phase rows", "two-phase rows tc"]),
        (
            (96, 4096, 16, 32),
            &["two-phase rows", "entry reg", "rows full", "entry spread"],
        ),
    ];
    for (shape, forms) in shapes {
        let case = ChainCase::new(&mut rng, shape);
        let label = case.label();
        let plans = case.candidates(&gpu, false);
        // Every plan that waits first.
        let waiting = plans_where(&label, &plans, |t| t.chain.waits_first());
        assert_forms(&label, &waiting, forms);
        if shape.2 == 16 {
            plans_where(&label, &waiting, is_entry_prefetch);
        }
        // To mix in: one plan of each form launched plainly, and one under the overlap.
        let others = interleave(&[
            one_per_form(&plans, Chain::Plain),
            one_per_form(&case.candidates(&gpu, true), Chain::EarlyReads),
        ]);
        let mut sequence = Vec::new();
        for (i, &w) in waiting.iter().enumerate() {
            sequence.push(w);
            // Back to back with itself (each spread launch, and every third other).
            if i % 3 == 0 || form_name(&w) == "entry spread" {
                sequence.push(w);
            }
            if i % 2 == 1 {
                sequence.push(others[i / 2 % others.len()]);
            }
        }
        case.check(&gpu, &chains_of(&sequence));
    }
}

/// The entry form waiting first asks its entries' weights into L2 before
/// its wait (`prefetch`, the default at rank stride 16): here the previous
/// kernel is still writing those weights. A first apply adds its deltas to
/// the second apply's weights buffer, seen as rows of `width` (A rows, B
/// rows and padding alike), and the second apply follows it in the stream
/// with nothing between; it must read the written weights, in every entry
/// plan and every plan that waits first (the register, staged and spread
/// kernels, clusters of 4, with and without the prefetch, the next kernel
/// let in early and late), as the CPU reference does.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_entry_weights_written_by_the_previous_kernel() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_entry_weights_written_by_the_previous_kernel") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_entry_weights_written_by_the_previous_kernel");
    // (n, width, stride, slots) of the second apply, and the entry kernels it must run.
    let cases: [(ApplyShape, &[&str]); 3] = [
        ((256, 4096, 16, 32), &["entry reg", "entry c8", "entry spread"]),
        ((64, 1000, 16, 9), &["entry c8", "entry reg", "entry spread"]),
        ((48, 2056, 64, 5), &["entry c4"]),
    ];
    for ((n, width, stride, slots), forms) in cases {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 7 % stride) as u32).collect();
        let pairs = RandomPairs::new(&mut rng, width, width, stride, &ranks);
        // The weights as rows of `width`: every slot is stride * (width + width) elements.
        let w_rows = pairs.data.len() / width;
        let writer = Problem::new(&mut rng, w_rows, width, &[width], 16, &[16, 5, 9], true);
        let writer_idx = random_idx(&mut rng, w_rows, 3, 7);
        let x = rng.bf16_vec(n * width, 1.0);
        let y = rng.bf16_vec(n * width, 1.0);
        let idx = random_idx(&mut rng, n, slots, 5);
        let run = |dev: &Device, options: DecodeOptions| -> Vec<f32> {
            let on = OnDevice::new(dev, &writer);
            let w_idx = dev.upload(&writer_idx).unwrap();
            let mut w = dev.upload(&pairs.data).unwrap();
            // Uploaded before the first apply, so nothing sits between the two.
            let table = dev.upload(&pairs.entries(w.device_addr())).unwrap();
            let (x, mut y, idx) = (
                dev.upload(&x).unwrap(),
                dev.upload(&y).unwrap(),
                dev.upload(&idx).unwrap(),
            );
            let writer_rows = Rows {
                buf: &on.x,
                offset: 0,
                n_rows: w_rows,
                width,
                stride: writer.x_stride,
            };
            let weights_as_rows = RowsMut::dense(&mut w, w_rows, width);
            bgmv(dev, writer_rows, &w_idx, &on.targets(&writer), 16, weights_as_rows).unwrap();
            let targets = whole_table_target(&table, slots, width);
            let out = RowsMut::dense(&mut y, n, width);
            bgmv_with(dev, Rows::dense(&x, n, width), &idx, &targets, stride, out, options)
                .unwrap_or_else(|e| panic!("{}: {e}", describe(options)));
            dev.check_faults().unwrap();
            widen(&y.download().unwrap())
        };
        // The second apply's plans: every entry plan, and every other that waits first.
        let plans = {
            let w = gpu.upload(&pairs.data).unwrap();
            let table = gpu.upload(&pairs.entries(w.device_addr())).unwrap();
            let (x, mut y) = (gpu.upload(&x).unwrap(), gpu.upload(&y).unwrap());
            let targets = whole_table_target(&table, slots, width);
            let out = RowsMut::dense(&mut y, n, width);
            bgmv_candidates(&gpu, Rows::dense(&x, n, width), &targets, stride, &out, false).unwrap()
        };
        let label = format!("n={n} width={width} stride={stride}");
        let plans = plans_where(&label, &plans, |t| is_entry(t) || t.chain.waits_first());
        assert_forms(&label, &plans, forms);
        if stride == 16 {
            plans_where(&label, &plans, is_entry_prefetch);
        }
        let cpu = run(&Device::cpu(), DecodeOptions::default());
        for t in plans {
            let g = run(&gpu, exact(t));
            assert!(g.iter().all(|v| v.is_finite()), "{label} {t}: non-finite output");
            let err = rel_error(&g, &cpu);
            assert!(err < TOL, "{label} {t}: ‖gpu − cpu‖/‖cpu‖ = {err:e}");
        }
    }
}

/// Tables of more entries than the item list serves: no candidate lists
/// items (every fused one scans its window), an exact listed plan is
/// refused naming `plan.items`, and every candidate matches the CPU.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_tables_past_the_item_list_limit_scan_instead() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_tables_past_the_item_list_limit_scan_instead") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_tables_past_the_item_list_limit_scan_instead");
    // One entry more than the list launch serves; rows repeat a few of them.
    let slots = lora_kernels::ops::bgmv::ITEM_LIST_MAX_ENTRIES + 1;
    let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s % 8) as u32).collect();
    let p = Problem::new(&mut rng, 200, 64, &[40], 8, &ranks, true);
    let idx: Vec<i32> = (0..200)
        .map(|i| {
            if i % 9 == 0 {
                -1
            } else {
                (rng.below(12) * 373 % slots) as i32
            }
        })
        .collect();
    let on = Applies::new(&gpu, &p, &idx);
    let plans = on.plans(&p.y_bf16, false);
    assert!(!plans.iter().any(is_fused_listed), "large table: {}", labels(&plans));
    for t in plans_where("large table", &plans, is_fused_scan) {
        let DecodeForm::Fused(f) = t.form else { unreachable!() };
        let listed = DecodePlan {
            form: DecodeForm::Fused(FusedForm {
                items: ItemList::Listed,
                ..f
            }),
            ..t
        };
        let mut y = gpu.upload(&p.y_bf16).unwrap();
        let err = on.apply(&mut y, exact(listed)).unwrap_err();
        assert!(err.to_string().contains("plan.items"), "{listed}: {err}");
    }
    check_bgmv(&gpu, "large table", &p, &idx, &runs_of(false, &plans));
}

/// The fused plans of `plans` at other launch shapes, where the planner
/// takes them and the candidates do not hold them: 3 output splits over 2
/// clusters a window, 2 over 3, one cluster a window (every item of the
/// window through it: the one-chunk items' copy groups, the push's receive
/// buffers and mbarrier phases reused many times) and a cluster for every
/// row of the `window` (3 splits too).
fn other_launches<Y: OutputElem>(on: &Applies<'_>, y0: &[Y], plans: &[DecodePlan], window: usize) -> Vec<DecodePlan> {
    let mut out: Vec<DecodePlan> = Vec::new();
    for &plan in plans {
        let DecodeForm::Fused(f) = plan.form else {
            continue;
        };
        for (splits, per_window) in [(3, 2), (2, 3), (f.out_splits, 1), (f.out_splits, window), (3, window)] {
            let Some(v) = with_launch(plan, splits, per_window) else {
                continue;
            };
            if !plans.contains(&v) && !out.contains(&v) && on.serves(y0, v) {
                out.push(v);
            }
        }
    }
    out
}

/// The two-phase plans of `plans` with other expand units, where the
/// planner takes them: of 64, 512, 1504 and 4096 (the most) outputs.
fn other_expand_units<Y: OutputElem>(on: &Applies<'_>, y0: &[Y], plans: &[DecodePlan]) -> Vec<DecodePlan> {
    let mut out: Vec<DecodePlan> = Vec::new();
    for &plan in plans {
        let DecodeForm::TwoPhase(t) = plan.form else {
            continue;
        };
        for expand_cols in [64, 512, 1504, 4096] {
            let v = DecodePlan {
                form: DecodeForm::TwoPhase(TwoPhaseForm { expand_cols, ..t }),
                ..plan
            };
            if !plans.contains(&v) && !out.contains(&v) && on.serves(y0, v) {
                out.push(v);
            }
        }
    }
    out
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_row_patterns_and_paths() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_row_patterns_and_paths") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_row_patterns_and_paths");
    // Windows of 300 rows (the scan's two rows per thread) and of 200 (one per thread).
    for n in [300, 200] {
        let p = Problem::new(&mut rng, n, 1024, &[512, 128], 32, &[32, 7, 16, 0, 1], true);
        let patterns: Vec<(&str, Vec<i32>)> = vec![
            ("no adapter anywhere", vec![-1; n]),
            ("all rows one adapter", vec![2; n]),
            (
                "every row a different adapter",
                (0..n).map(|i| (i % 5) as i32).collect(),
            ),
            (
                "padding rows at the end",
                (0..n).map(|i| if i < 200 { (i % 3) as i32 } else { -1 }).collect(),
            ),
            (
                "rank-0 slot rows",
                (0..n).map(|i| if i % 2 == 0 { 3 } else { 1 }).collect(),
            ),
            ("random", random_idx(&mut rng, n, 5, 4)),
        ];
        // The rule table's plan, every candidate (each cluster size, scalar
        // and on tensor cores, scanning or (on tensor cores) listed, pushed
        // and pulled), and the other launch shapes: many items per cluster
        // (rank-0 items among them), several output splits, and a cluster
        // for every row. The 16-warp clusters of 2 take the row-mapped form
        // there (row q's cluster serves row q alone, requesting its weights
        // as soon as its entry is known; rows of one adapter are not
        // grouped), pushed and pulled; the others scan, most clusters idle.
        // The two-phase expand in units of 64, 512, of an odd width and of
        // its most.
        let label = format!("n={n}");
        let on = Applies::new(&gpu, &p, &patterns[0].1);
        let plans = on.plans(&p.y_bf16, false);
        let launches = other_launches(&on, &p.y_bf16, &plans, n);
        let units = other_expand_units(&on, &p.y_bf16, &plans);
        assert_forms(&label, &plans, &FUSED_FORMS);
        assert_forms(&label, &plans, &TWO_PHASE_FORMS);
        let launched = |what: &str, shape: &dyn Fn(&FusedForm) -> bool| {
            let found = launches
                .iter()
                .chain(&plans)
                .any(|t| matches!(t.form, DecodeForm::Fused(f) if shape(&f)));
            assert!(found, "{label}: no fused plan with {what} among {}", labels(&launches));
        };
        for cluster in [1, 2, 8] {
            launched(&format!("clusters of {cluster}, one a window"), &|f| {
                f.cluster == cluster && f.clusters_per_window == 1
            });
        }
        for cluster in [2, 8] {
            launched(&format!("clusters of {cluster}, 3 splits over 2 a window"), &|f| {
                f.cluster == cluster && f.out_splits == 3 && f.clusters_per_window == 2
            });
        }
        for cluster in [1, 2, 8] {
            launched(&format!("clusters of {cluster}, one a row"), &|f| {
                f.cluster == cluster && f.clusters_per_window == n
            });
        }
        plans_where(&label, &plans, |t| is_row_mapped(t, n));
        let all: Vec<DecodePlan> = [plans, launches, units].concat();
        for cols in [64, 512, 4096] {
            plans_where(
                &label,
                &all,
                |t| matches!(t.form, DecodeForm::TwoPhase(u) if u.expand_cols == cols),
            );
        }
        let runs = runs_of(false, &all);
        for (what, idx) in &patterns {
            check_bgmv(&gpu, &format!("n={n} {what}"), &p, idx, &runs);
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_f32_router_logits() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_f32_router_logits") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_f32_router_logits");
    // MoE-style table: idx = expert * max_loras + slot over 8 experts x 4 slots.
    let p = Problem::new(
        &mut rng,
        40,
        2048,
        &[64],
        16,
        &(0..32).map(|s| 1 + s % 16).collect::<Vec<u32>>(),
        false,
    );
    let idx = random_idx(&mut rng, 40, 32, 9);
    let cpu = Device::cpu();
    let c = run_bgmv_on(&cpu, &p, &idx, &p.y_f32, DecodeOptions::default());
    // The rule table's plan and every candidate with f32 y: each fused form,
    // the two-phase ones, the row-mapped form.
    let on = Applies::new(&gpu, &p, &idx);
    let plans = on.plans(&p.y_f32, false);
    assert_forms("f32 y", &plans, &FUSED_FORMS);
    assert_forms("f32 y", &plans, &["two-phase rows"]);
    plans_where("f32 y", &plans, |t| is_row_mapped(t, 40));
    for options in runs_of(false, &plans) {
        let g = on.run(&p.y_f32, options);
        compare(&format!("f32 y {}", describe(options)), &p.y_f32, &c, &g);
        let dc: Vec<f32> = c.iter().zip(&p.y_f32).map(|(a, b)| a - b).collect();
        let dg: Vec<f32> = g.iter().zip(&p.y_f32).map(|(a, b)| a - b).collect();
        let err = rel_error(&dg, &dc);
        assert!(err < 1e-4, "f32 delta error {err:e} {}", describe(options));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_bad_index_raises_a_fault() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_bad_index_raises_a_fault") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_bad_index_raises_a_fault");
    let p = Problem::new(&mut rng, 4, 64, &[32], 8, &[8, 8], false);
    let on = Applies::new(&gpu, &p, &[0, 9, 1, -1]);
    for options in runs_of(false, &fault_plans(&on)) {
        let (_, faults) = on.run_faulting(&p.y_bf16, options);
        assert!(
            faults.0 & lora_kernels::FaultFlags::BAD_INDEX != 0,
            "faults: {faults} {}",
            describe(options)
        );
        assert!(gpu.take_faults().unwrap().is_empty());
    }
}

/// The faults' calls: 4 rows of in 64, one target of 32 outputs, rank
/// stride 8, two table entries; every candidate, each fused form, the
/// two-phase ones and the row-mapped one asserted among them.
fn fault_plans(on: &Applies<'_>) -> Vec<DecodePlan> {
    let plans = on.plans(&on.p.y_bf16, false);
    assert_forms("faults", &plans, &FUSED_FORMS);
    assert_forms("faults", &plans, &["two-phase rows"]);
    plans_where("faults", &plans, |t| is_row_mapped(t, on.p.n));
    plans
}

/// The problem's table with entry 1 claiming a rank past the stride.
fn table_with_bad_rank(gpu: &Device, on: &OnDevice, stride: usize) -> DeviceBuffer<PairEntry> {
    let mut entries = on.table.download().unwrap();
    entries[1].rank = stride as u32 + 1;
    gpu.upload(&entries).unwrap()
}

/// One target over the first `n_entries` entries of `table`, at column 0.
fn whole_table_target(table: &DeviceBuffer<PairEntry>, n_entries: usize, out_dim: usize) -> [LoraTarget<'_>; 1] {
    [LoraTarget {
        table,
        table_offset: 0,
        n_entries,
        out_dim,
        y_col_offset: 0,
        dora: None,
    }]
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_bad_entry_raises_a_fault_and_skips_its_rows() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_bad_entry_raises_a_fault_and_skips_its_rows") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_bad_entry_raises_a_fault_and_skips_its_rows");
    let (n, stride) = (4, 8);
    let p = Problem::new(&mut rng, n, 64, &[32], stride, &[8, 8], false);
    // Entry 1 claims a rank above the stride: its rows get no delta, the others theirs.
    let mut on = Applies::new(&gpu, &p, &[0, 1, 1, -1]);
    on.bufs.table = table_with_bad_rank(&gpu, &on.bufs, stride);
    let good_only = run_bgmv_on(
        &Device::cpu(),
        &p,
        &[0, -1, -1, -1],
        &p.y_bf16,
        DecodeOptions::default(),
    );
    for options in runs_of(false, &fault_plans(&on)) {
        let (y, faults) = on.run_faulting(&p.y_bf16, options);
        let label = describe(options);
        assert_eq!(faults.0, lora_kernels::FaultFlags::BAD_RANK, "faults: {faults} {label}");
        compare(&format!("bad entry {label}"), &p.y_bf16, &good_only, &y);
    }
}

fn segments_for(rng: &mut Rng, n: usize, n_seg: usize, slots: usize) -> (Vec<i32>, Vec<i32>) {
    // Random cut points (empty segments allowed), random slots with some -1.
    let mut cuts: Vec<i32> = (0..n_seg - 1).map(|_| rng.below(n + 1) as i32).collect();
    cuts.sort_unstable();
    let mut cu = vec![0];
    cu.extend(cuts);
    cu.push(n as i32);
    let slot = (0..n_seg)
        .map(|s| if s % 5 == 3 { -1 } else { rng.below(slots) as i32 })
        .collect();
    (cu, slot)
}

fn run_sgmv_on<Y: OutputElem>(
    dev: &Device,
    p: &Problem,
    seg: Option<(&[i32], &[i32])>,
    entry: usize,
    y0: &[Y],
    choice: Choice<PrefillPlan>,
) -> Vec<Y> {
    let on = OnDevice::new(dev, p);
    let n_seg = seg.map_or(1, |(_, s)| s.len());
    let spec = WorkspaceSpec {
        max_rows: p.n + 3,
        max_rank: p.stride,
        max_segments: n_seg,
        max_targets: p.outs.len(),
    };
    let mut ws = LoraWorkspace::new(dev, spec).unwrap();
    ws.poison().unwrap();
    let mut y = dev.upload(y0).unwrap();
    let targets = on.targets(p);
    let yv = RowsMut::dense(&mut y, p.n, p.y_width);
    match seg {
        Some((cu, slot)) => {
            let cu = dev.upload(cu).unwrap();
            let slot = dev.upload(slot).unwrap();
            let s = Segments {
                cu_seqlens: &cu,
                seg_slot: &slot,
                n_segments: n_seg,
            };
            if let Choice::Exact(want) = choice {
                let planned = sgmv_plan(dev, on.x_rows(p), &s, &targets, p.stride, &yv, choice).unwrap();
                assert!(planned.is_none_or(|got| got == want), "{planned:?} for {want}");
            }
            let options = PrefillOptions {
                choice,
                only_phase: None,
            };
            sgmv_with(dev, on.x_rows(p), &s, &targets, p.stride, yv, &mut ws, options).unwrap();
        }
        None => one_adapter(dev, on.x_rows(p), entry, &targets, p.stride, yv, &mut ws).unwrap(),
    }
    dev.check_faults().unwrap();
    y.download().unwrap()
}

/// The plans of the segment apply the tests cover for a problem on `gpu`
/// with y elements `Y`: every candidate (each shrink the device runs, each
/// expand, dependent early or late and plain launches, each way of dealing
/// items, one and two y buffers), then K splits 1, 3 and 8 on the first
/// candidate of each shrink where the call allows them.
fn sgmv_plans<Y: OutputElem>(gpu: &Device, p: &Problem, n_seg: usize) -> Vec<PrefillPlan> {
    let call = PrefillCall::segments::<Y>(p.n, p.in_dim, p.stride, n_seg, &p.outs).unwrap();
    let limits = gpu.limits().unwrap();
    let mut plans = lora_kernels::ops::sgmv::plan::candidates(&call, &limits);
    assert!(!plans.is_empty(), "no plan for {call}");
    let mut shrinks: Vec<_> = plans.iter().map(|c| c.shrink).collect();
    shrinks.dedup();
    for shrink in shrinks {
        let first = *plans.iter().find(|c| c.shrink == shrink).unwrap();
        for k_splits in [1, 3, 8] {
            let plan = PrefillPlan { k_splits, ..first };
            let ok = lora_kernels::ops::sgmv::plan::plan(&call, &limits, Choice::Exact(plan)).is_ok();
            if ok && !plans.contains(&plan) {
                plans.push(plan);
            }
        }
    }
    plans
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_sgmv_matches_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_sgmv_matches_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_sgmv_matches_cpu");
    // (n, in, outs, stride, slots, segments)
    type Shape = (usize, usize, &'static [usize], usize, usize, usize);
    let shapes: &[Shape] = &[
        (512, 4096, &[4096], 16, 4, 4),
        (300, 2049, &[200, 64], 64, 6, 7),
        (1000, 1024, &[1024], 64, 64, 32),
        (130, 96, &[130], 128, 3, 3),
        (17, 24, &[9], 5, 2, 5),
    ];
    for &(n, in_dim, outs, stride, slots, n_seg) in shapes {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 13 % stride) as u32).collect();
        let p = Problem::new(&mut rng, n, in_dim, outs, stride, &ranks, true);
        let (cu, slot) = segments_for(&mut rng, n, n_seg, slots);
        let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Auto);
        for plan in sgmv_plans::<bf16>(&gpu, &p, n_seg) {
            let label = format!("sgmv n={n} in={in_dim} outs={outs:?} stride={stride} {plan}");
            let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Exact(plan));
            compare(&label, &p.y_bf16, &c, &g);
        }
        let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_f32, Choice::Auto);
        // An f32 y changes the expand alone: every plan with the rule table's shrink.
        let f32_plans = sgmv_plans::<f32>(&gpu, &p, n_seg);
        for &plan in f32_plans.iter().filter(|q| q.shrink == f32_plans[0].shrink) {
            let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_f32, Choice::Exact(plan));
            compare(&format!("sgmv f32 y {plan}"), &p.y_f32, &c, &g);
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_sgmv_every_rank_against_padded_pool() {
    let Some(gpu) = cuda_or_skip("gpu_sgmv_every_rank_against_padded_pool") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_sgmv_every_rank_against_padded_pool");
    let ranks: Vec<u32> = (1..=64).collect();
    let n = 64 * 20;
    let p = Problem::new(&mut rng, n, 512, &[256], 64, &ranks, true);
    let cu: Vec<i32> = (0..=64).map(|s| s * 20).collect();
    let slot: Vec<i32> = (0..64).collect();
    let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Auto);
    for plan in sgmv_plans::<bf16>(&gpu, &p, slot.len()) {
        let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Exact(plan));
        compare(&format!("sgmv every rank {plan}"), &p.y_bf16, &c, &g);
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_one_adapter_matches_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_one_adapter_matches_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_one_adapter_matches_cpu");
    for &(n, in_dim, out, stride, rank) in &[(777, 4096, 1024, 64, 64), (65, 2049, 300, 16, 5), (3, 8, 8, 8, 1)] {
        let p = Problem::new(&mut rng, n, in_dim, &[out], stride, &[stride as u32, rank], true);
        let c = run_sgmv_on(&cpu, &p, None, 1, &p.y_bf16, Choice::Auto);
        let g = run_sgmv_on(&gpu, &p, None, 1, &p.y_bf16, Choice::Auto);
        compare(
            &format!("one adapter n={n} in={in_dim} out={out} rank={rank}"),
            &p.y_bf16,
            &c,
            &g,
        );
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_graph_replay_follows_table_contents() {
    let Some(gpu) = cuda_or_skip("gpu_graph_replay_follows_table_contents") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_graph_replay_follows_table_contents");
    // The graph's decode call is the same in every case: the rule table's
    // plan and every candidate of it, each fused form, the two-phase
    // ones, the row-mapped and the row-register form among them.
    let probe = graph_problem(&mut rng);
    let plans = Applies::new(&gpu, &probe, &vec![0; probe.n]).plans(&probe.y_bf16, false);
    assert_forms("graph", &plans, &FUSED_FORMS);
    assert_forms("graph", &plans, &["two-phase rows", "rows"]);
    plans_where("graph", &plans, |t| is_row_mapped(t, probe.n));
    for options in runs_of(false, &plans) {
        graph_replay_case(&gpu, &mut rng, options);
    }
}

/// The problem of [`graph_replay_case`]: 48 rows of 1024 columns, one
/// target of 512 outputs, rank stride 16, 6 slots.
fn graph_problem(rng: &mut Rng) -> Problem {
    Problem::new(rng, 48, 1024, &[512], 16, &[16, 8, 4, 16, 2, 1], false)
}

/// Capture bgmv (with `options`) and sgmv into one graph, change every
/// buffer's contents, replay, and compare with the CPU on the new contents.
fn graph_replay_case(gpu: &Device, rng: &mut Rng, options: DecodeOptions) {
    let gpu = gpu.clone();
    let cpu = Device::cpu();
    let (n, slots) = (48, 6);
    let p = graph_problem(rng);
    let on = OnDevice::new(&gpu, &p);
    let idx0 = random_idx(rng, n, slots, 5);
    let mut idx = gpu.upload(&idx0).unwrap();
    let mut y = gpu.upload(&p.y_bf16).unwrap();
    let (cu0, slot0) = segments_for(rng, n, 4, slots);
    let mut cu = gpu.upload(&cu0).unwrap();
    let mut seg_slot = gpu.upload(&slot0).unwrap();
    let spec = WorkspaceSpec {
        max_rows: n,
        max_rank: 16,
        max_segments: 4,
        max_targets: 1,
    };
    let mut ws = LoraWorkspace::new(&gpu, spec).unwrap();
    let mut table = gpu.upload(&on.table.download().unwrap()).unwrap();
    gpu.preload_kernels().unwrap();
    let graph = {
        let target = [LoraTarget {
            table: &table,
            table_offset: 0,
            n_entries: slots,
            out_dim: 512,
            y_col_offset: 0,
            dora: None,
        }];
        gpu.capture_graph(|| {
            let yv = RowsMut::dense(&mut y, n, p.y_width);
            bgmv_with(&gpu, on.x_rows(&p), &idx, &target, 16, yv, options)?;
            let s = Segments {
                cu_seqlens: &cu,
                seg_slot: &seg_slot,
                n_segments: 4,
            };
            let yv = RowsMut::dense(&mut y, n, p.y_width);
            sgmv(&gpu, on.x_rows(&p), &s, &target, 16, yv, &mut ws)
        })
        .unwrap()
    };
    // New contents: permuted table entries, new idx, new segments, fresh y.
    let mut entries = on.table.download().unwrap();
    entries.rotate_left(2);
    entries[1] = PairEntry::default();
    table.write(0, &entries).unwrap();
    let idx1 = random_idx(rng, n, slots, 3);
    idx.write(0, &idx1).unwrap();
    let (cu1, slot1) = segments_for(rng, n, 4, slots);
    cu.write(0, &cu1).unwrap();
    seg_slot.write(0, &slot1).unwrap();
    let y1 = rng.bf16_vec(n * p.y_width, 1.0);
    y.write(0, &y1).unwrap();
    graph.replay().unwrap();
    gpu.synchronize().unwrap();
    gpu.check_faults().unwrap();
    let g = y.download().unwrap();

    // The same two calls on the CPU with the new contents.
    let cpu_on = OnDevice::new(&cpu, &p);
    let mut cpu_entries = cpu_on.table.download().unwrap();
    cpu_entries.rotate_left(2);
    cpu_entries[1] = PairEntry::default();
    let cpu_table = cpu.upload(&cpu_entries).unwrap();
    let target = [LoraTarget {
        table: &cpu_table,
        table_offset: 0,
        n_entries: slots,
        out_dim: 512,
        y_col_offset: 0,
        dora: None,
    }];
    let mut cy = cpu.upload(&y1).unwrap();
    let cidx = cpu.upload(&idx1).unwrap();
    bgmv(
        &cpu,
        cpu_on.x_rows(&p),
        &cidx,
        &target,
        16,
        RowsMut::dense(&mut cy, n, p.y_width),
    )
    .unwrap();
    let (ccu, cslot) = (cpu.upload(&cu1).unwrap(), cpu.upload(&slot1).unwrap());
    let s = Segments {
        cu_seqlens: &ccu,
        seg_slot: &cslot,
        n_segments: 4,
    };
    let mut cws = LoraWorkspace::new(&cpu, spec).unwrap();
    let yv = RowsMut::dense(&mut cy, n, p.y_width);
    sgmv(&cpu, cpu_on.x_rows(&p), &s, &target, 16, yv, &mut cws).unwrap();
    compare(
        &format!("graph replay after table change {}", describe(options)),
        &y1,
        &cy.download().unwrap(),
        &g,
    );
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_moe_index_builders_match_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_moe_index_builders_match_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_moe_index_builders_match_cpu");
    let routing = MoeRouting {
        top_k: 8,
        max_loras: 4,
        n_experts: 64,
    };
    let n_tokens = 100;
    let ra: Vec<i32> = (0..n_tokens)
        .map(|i| if i % 6 == 0 { -1 } else { rng.below(4) as i32 })
        .collect();
    let topk: Vec<i32> = (0..n_tokens * 8).map(|_| rng.below(64) as i32).collect();
    // Sorted layout: rows grouped by expert, with 3 padding rows per expert.
    let mut sorted = Vec::new();
    let mut offsets = vec![0i32];
    for e in 0..64 {
        for (r, &x) in topk.iter().enumerate() {
            if x == e {
                sorted.push(r as i32);
            }
        }
        sorted.extend([-1, (n_tokens * 8) as i32, i32::MAX]);
        offsets.push(sorted.len() as i32);
    }
    let run = |dev: &Device| -> (Vec<i32>, Vec<i32>) {
        let ra_d = dev.upload(&ra).unwrap();
        let topk_d = dev.upload(&topk).unwrap();
        let mut idx = dev.upload(&vec![i32::MIN; n_tokens * 8]).unwrap();
        moe_decode_index(dev, &ra_d, &topk_d, n_tokens, routing, &mut idx).unwrap();
        let st = dev.upload(&sorted).unwrap();
        let off = dev.upload(&offsets).unwrap();
        let mut sidx = dev.upload(&vec![i32::MIN; sorted.len() + 4]).unwrap();
        moe_sorted_index(dev, &st, sorted.len(), &off, &ra_d, n_tokens, routing, &mut sidx).unwrap();
        dev.check_faults().unwrap();
        (idx.download().unwrap(), sidx.download().unwrap())
    };
    let (cd, cs) = run(&cpu);
    let (gd, gs) = run(&gpu);
    assert_eq!(cd, gd, "decode index");
    assert_eq!(cs, gs, "sorted index");
    assert!(gd.iter().all(|&v| v != i32::MIN), "every decode index written");
    assert!(
        gs[..sorted.len()].iter().all(|&v| v != i32::MIN),
        "every sorted index written"
    );
    assert!(
        gs[sorted.len()..].iter().all(|&v| v == i32::MIN),
        "nothing written past n_sorted"
    );
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_overlay_kernels_match_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_overlay_kernels_match_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_overlay_kernels_match_cpu");
    let (vocab, h, n) = (1000, 264, 50);
    let base = rng.bf16_vec(vocab * h, 1.0);
    let mut table = base.clone();
    let changed: Vec<usize> = (0..vocab).filter(|v| v % 37 == 5).collect();
    for &v in &changed {
        table[v * h + (v % h)] = bf16::from_f32(table[v * h + (v % h)].to_f32() + 0.5);
    }
    table[7 * h] = bf16::NAN;
    // Slot 0: rows for `changed`; slot 1: no overlay; slot 2: 3 rows.
    let rows0 = rng.bf16_vec(changed.len() * h, 1.0);
    let rows2 = rng.bf16_vec(3 * h, 1.0);
    let mut map0 = vec![-1i32; vocab];
    for (k, &v) in changed.iter().enumerate() {
        map0[v] = k as i32;
    }
    let mut map2 = vec![-1i32; vocab];
    for (k, v) in [3usize, 500, 999].iter().enumerate() {
        map2[*v] = k as i32;
    }
    let ids: Vec<u32> = (0..n)
        .map(|i| {
            if i % 4 == 0 {
                changed[i % changed.len()] as u32
            } else {
                rng.below(vocab) as u32
            }
        })
        .collect();
    let row_slot: Vec<i32> = (0..n).map(|i| (i % 4) as i32 - 1).map(|s| s.min(2)).collect();
    let head_ids0: Vec<u32> = changed.iter().map(|&v| v as u32).collect();
    let head_ids2: Vec<u32> = vec![999, 3, 500];
    let hidden = rng.bf16_vec(n * h, 1.0);
    let logits0: Vec<f32> = (0..n * vocab).map(|_| rng.uniform()).collect();

    let run = |dev: &Device| -> (Vec<u8>, Vec<bf16>, Vec<f32>, Vec<bf16>) {
        let base_d = dev.upload(&base).unwrap();
        let table_d = dev.upload(&table).unwrap();
        let mut diff = dev.upload(&vec![7u8; vocab]).unwrap();
        row_diff(
            dev,
            Rows::dense(&table_d, vocab, h),
            Rows::dense(&base_d, vocab, h),
            0.0,
            &mut diff,
        )
        .unwrap();
        let r0 = dev.upload(&rows0).unwrap();
        let r2 = dev.upload(&rows2).unwrap();
        let m0 = dev.upload(&map0).unwrap();
        let m2 = dev.upload(&map2).unwrap();
        let ents = dev
            .upload(&[
                EmbedOverlayEntry {
                    slot_map: m0.device_addr(),
                    rows: r0.device_addr(),
                    n_rows: changed.len() as u32,
                    pad: 0,
                },
                EmbedOverlayEntry::default(),
                EmbedOverlayEntry {
                    slot_map: m2.device_addr(),
                    rows: r2.device_addr(),
                    n_rows: 3,
                    pad: 0,
                },
            ])
            .unwrap();
        let ids_d = dev.upload(&ids).unwrap();
        let rs_d = dev.upload(&row_slot).unwrap();
        let mut out = dev.upload(&vec![bf16::NAN; n * h]).unwrap();
        embed_overlay(
            dev,
            &ids_d,
            Some(&rs_d),
            Rows::dense(&base_d, vocab, h),
            &ents,
            RowsMut::dense(&mut out, n, h),
        )
        .unwrap();
        let hid0 = dev.upload(&head_ids0).unwrap();
        let hid2 = dev.upload(&head_ids2).unwrap();
        let hents = dev
            .upload(&[
                LmHeadOverlayEntry {
                    ids: hid0.device_addr(),
                    rows: r0.device_addr(),
                    count: head_ids0.len() as u32,
                    pad: 0,
                },
                LmHeadOverlayEntry::default(),
                LmHeadOverlayEntry {
                    ids: hid2.device_addr(),
                    rows: r2.device_addr(),
                    count: 3,
                    pad: 0,
                },
            ])
            .unwrap();
        let hidden_d = dev.upload(&hidden).unwrap();
        let mut logits = dev.upload(&logits0).unwrap();
        lm_head_overlay(
            dev,
            Rows::dense(&hidden_d, n, h),
            &rs_d,
            &hents,
            RowsMut::dense(&mut logits, n, vocab),
        )
        .unwrap();
        let lb0: Vec<bf16> = logits0.iter().map(|v| bf16::from_f32(*v)).collect();
        let mut logits_b = dev.upload(&lb0).unwrap();
        lm_head_overlay(
            dev,
            Rows::dense(&hidden_d, n, h),
            &rs_d,
            &hents,
            RowsMut::dense(&mut logits_b, n, vocab),
        )
        .unwrap();
        dev.check_faults().unwrap();
        (
            diff.download().unwrap(),
            out.download().unwrap(),
            logits.download().unwrap(),
            logits_b.download().unwrap(),
        )
    };
    let (cd, ce, cl, clb) = run(&cpu);
    let (gd, ge, gl, glb) = run(&gpu);
    assert_eq!(cd, gd, "row diff");
    assert!(gd.iter().all(|&v| v <= 1), "every diff flag written");
    assert_eq!(
        ce.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        ge.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "embedding rows"
    );
    let err = rel_error(&gl, &cl);
    assert!(err < 1e-5, "lm_head f32 logits error {err:e}");
    let err = rel_error(&widen(&glb), &widen(&clb));
    assert!(err < TOL, "lm_head bf16 logits error {err:e}");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_buffers_round_trip() {
    let Some(gpu) = cuda_or_skip("gpu_buffers_round_trip") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_buffers_round_trip");
    assert!(gpu.name().contains("(sm_"), "name {}", gpu.name());
    let (free, total) = gpu.memory_info().unwrap();
    assert!(free > 0 && free <= total);
    let data: Vec<u64> = (0..1000).map(|_| rng.next_u64()).collect();
    let mut a = gpu.upload(&data).unwrap();
    assert_eq!(a.download().unwrap(), data);
    a.write(10, &data[..5]).unwrap();
    assert_eq!(a.download_range(10, 5).unwrap(), &data[..5]);
    let mut b = gpu.alloc_zeros::<u64>(2000).unwrap();
    b.copy_from(100, &a, 0, 1000).unwrap();
    assert_eq!(b.download_range(100, 1000).unwrap(), a.download().unwrap());
    b.zero_range(150, 10).unwrap();
    assert!(b.download_range(150, 10).unwrap().iter().all(|&v| v == 0));
    let mut pinned = gpu.alloc_pinned::<u64>(300).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&data[..300]);
    b.upload_pinned(1500, &pinned).unwrap();
    gpu.synchronize().unwrap();
    assert_eq!(b.download_range(1500, 300).unwrap(), &data[..300]);
    assert!(b.write(1999, &data[..2]).is_err());
    gpu.preload_kernels().unwrap();
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_empty_launch_runs_and_captures() {
    let Some(gpu) = cuda_or_skip("gpu_empty_launch_runs_and_captures") else {
        return;
    };
    lora_kernels::ops::launch_floor::empty_launch(&gpu).unwrap();
    let graph = gpu
        .capture_graph(|| lora_kernels::ops::launch_floor::empty_launch(&gpu))
        .unwrap();
    graph.replay().unwrap();
    gpu.synchronize().unwrap();
    gpu.check_faults().unwrap();
}

/// The entry-clustered form against the CPU reference: every stride it
/// serves, entries of one row to hundreds (several 16-row passes), slices of
/// `in` that end inside a 32-column chunk, outputs that end inside a
/// 32-output group, several targets, rows of no adapter, every rank of the
/// stride against NaN padding, and weights at every 2-byte alignment, in
/// every entry plan (each kernel, with and without the prefetch, each chain).
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_entry_clusters_match_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_entry_clusters_match_cpu") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_entry_clusters_match_cpu");
    let cpu = Device::cpu();
    // (n, in, outs, stride, slots, rows of no adapter every)
    type Shape = (usize, usize, &'static [usize], usize, usize, usize);
    let shapes: &[Shape] = &[
        (256, 4096, &[4096], 16, 32, 0),
        (300, 520, &[96, 336], 32, 5, 4),
        (64, 1024, &[14336], 64, 64, 0),
        (1000, 264, &[264], 16, 3, 9),
        (1024, 128, &[72, 8, 40], 64, 2, 0),
        (17, 8, &[8], 32, 17, 3),
        (1, 4096, &[4096], 16, 4, 0),
    ];
    for &(n, in_dim, outs, stride, slots, none_every) in shapes {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 37 % stride) as u32).collect();
        let p = Problem::new(&mut rng, n, in_dim, outs, stride, &ranks, true).with_aligned_rows(&mut rng);
        let idx = random_idx(&mut rng, n, slots, none_every);
        let c = run_bgmv_on(&cpu, &p, &idx, &p.y_bf16, DecodeOptions::default());
        let shape = format!("entry n={n} in={in_dim} outs={outs:?} stride={stride}");
        let on = Applies::new(&gpu, &p, &idx);
        let plans = plans_where(&shape, &on.candidates(&p.y_bf16, false), is_entry);
        assert_forms(&shape, &plans, &["entry c8", "entry c4"]);
        for &t in &plans {
            let label = format!("{shape} {t}");
            let g = on.run(&p.y_bf16, exact(t));
            compare(&label, &p.y_bf16, &c, &g);
            // The same sums in the same order: bit-identical when repeated.
            assert_eq!(g, on.run(&p.y_bf16, exact(t)), "{label}: a repeated apply differs");
        }
        for shift in [1, 2, 4, 7] {
            let on = Applies::shifted(&gpu, &p, &idx, shift);
            for &t in &plans {
                let g = on.run(&p.y_bf16, exact(t));
                compare(&format!("{shape} weights shifted by {shift} {t}"), &p.y_bf16, &c, &g);
            }
        }
    }
    // Every rank of the stride, each entry `per` times, and the patterns of
    // whole batches; at stride 16 (8 rows per entry: the register kernel by
    // default, where one adapter's batch leaves 16 clusters reading their
    // weights for nothing) and 64.
    for (stride, in_dim, out, per) in [
        (64, 1024, 768, 2),
        (16, 4096, 4096, 2),
        (16, 2056, 1032, 2),
        (16, 4096, 4096, 8),
        (16, 1032, 2056, 8),
    ] {
        let ranks: Vec<u32> = (0..=stride as u32).collect();
        let slots = ranks.len() as i32;
        let n = per * ranks.len();
        let p = Problem::new(&mut rng, n, in_dim, &[out], stride, &ranks, true).with_aligned_rows(&mut rng);
        let idx: Vec<i32> = (0..n as i32).map(|i| (i * 37 + i / slots) % slots).collect();
        let patterns: [(&str, Vec<i32>); 3] = [
            ("every rank", idx),
            ("all rows one adapter", vec![slots - 1; n]),
            ("no adapter anywhere", vec![-1; n]),
        ];
        // Every entry plan; at stride 16 the register kernel also where it
        // is not the default (2 rows per entry; no row anywhere: every
        // cluster reads its weights for nothing), and the spread kernel.
        let label = format!("entry stride={stride} in={in_dim}");
        let plans = plans_where(
            &label,
            &Applies::new(&gpu, &p, &patterns[0].1).candidates(&p.y_bf16, false),
            is_entry,
        );
        if stride == 16 {
            assert_forms(&label, &plans, &["entry c8", "entry c4", "entry reg", "entry spread"]);
        } else {
            assert_forms(&label, &plans, &["entry c8", "entry c4"]);
        }
        for (what, idx) in patterns {
            let c = run_bgmv_on(&cpu, &p, &idx, &p.y_bf16, DecodeOptions::default());
            let on = Applies::new(&gpu, &p, &idx);
            for &t in &plans {
                let g = on.run(&p.y_bf16, exact(t));
                compare(
                    &format!("entry {what} stride={stride} in={in_dim} {t}"),
                    &p.y_bf16,
                    &c,
                    &g,
                );
            }
        }
    }
}

/// The entry-clustered form reports an index past the table and an entry
/// of a rank past the stride as the other forms do, and serves the other
/// rows, in every entry plan; an exact entry plan it cannot serve is
/// refused naming the plan's field; under the overlap it reads x and y only
/// after the previous kernel.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_entry_clusters_faults_and_overlap() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_entry_clusters_faults_and_overlap") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_entry_clusters_faults_and_overlap");
    let (n, stride) = (6, 16);
    let p = Problem::new(&mut rng, n, 64, &[32], stride, &[8, 16, 4], false).with_aligned_rows(&mut rng);
    // Row 1 names entry 1 (bad rank), row 4 an index past the table.
    let mut on = Applies::new(&gpu, &p, &[0, 1, 2, -1, 3, 0]);
    on.bufs.table = table_with_bad_rank(&gpu, &on.bufs, stride);
    let good_only = run_bgmv_on(
        &Device::cpu(),
        &p,
        &[0, -1, 2, -1, -1, 0],
        &p.y_bf16,
        DecodeOptions::default(),
    );
    let plans = plans_where("entry faults", &on.candidates(&p.y_bf16, false), is_entry);
    assert_forms(
        "entry faults",
        &plans,
        &["entry c8", "entry c4", "entry reg", "entry spread"],
    );
    for t in plans {
        let (y, faults) = on.run_faulting(&p.y_bf16, exact(t));
        let want = lora_kernels::FaultFlags::BAD_RANK | lora_kernels::FaultFlags::BAD_INDEX;
        assert_eq!(faults.0, want, "faults: {faults} {t}");
        compare(&format!("entry faults {t}"), &p.y_bf16, &good_only, &y);
    }
    let entry = |kernel, prefetch| DecodePlan {
        form: DecodeForm::Entry { kernel, prefetch },
        chain: Chain::Plain,
    };
    // Exact plans the form cannot serve are refused, not approximated:
    // clusters of 2, and the prefetch without waiting first.
    let refused = [
        (entry(EntryKernel::Staged { cluster: 2 }, false), "plan.kernel"),
        (entry(EntryKernel::Staged { cluster: 8 }, true), "plan.prefetch"),
    ];
    for (t, field) in refused {
        let mut y = gpu.upload(&p.y_bf16).unwrap();
        let err = on.apply(&mut y, exact(t)).unwrap_err();
        assert!(err.to_string().contains(field), "{t}: {err}");
    }
    // Calls the form cannot serve (rows not 16-byte aligned) are refused in every kernel.
    let unaligned = Problem::new(&mut rng, 8, 64, &[32], stride, &[8], false);
    let on = Applies::new(&gpu, &unaligned, &[0; 8]);
    assert!(!on.candidates(&unaligned.y_bf16, false).iter().any(is_entry));
    for kernel in [
        EntryKernel::Staged { cluster: 8 },
        EntryKernel::Registers,
        EntryKernel::Spread,
    ] {
        let mut y = gpu.upload(&unaligned.y_bf16).unwrap();
        let err = on.apply(&mut y, exact(entry(kernel, false))).unwrap_err();
        assert!(err.to_string().contains("plan.form"), "{kernel:?}: {err}");
    }

    // Each entry plan under the overlap, chained with a plain scanning fused
    // apply and a plain two-phase one (or, past its rows, another fused
    // one).
    for shape in [(256, 1024, 16, 32), (40, 520, 64, 6)] {
        let case = ChainCase::new(&mut rng, shape);
        let label = case.label();
        let overlap = plans_where(&label, &case.candidates(&gpu, true), is_entry);
        let plans = case.candidates(&gpu, false);
        let scan = plans_where(&label, &plans, |t| form_name(t) == "fused scalar scan")[0];
        let two_phase = plans
            .iter()
            .copied()
            .find(|t| form_name(t) == "two-phase rows" && t.chain == Chain::Plain)
            .unwrap_or(scan);
        let chains: Vec<Vec<DecodeOptions>> = overlap
            .iter()
            .map(|&t| [scan, t, t, two_phase, t].map(exact).to_vec())
            .collect();
        case.check(&gpu, &chains);
    }
}

/// One embedding-LoRA call on `dev`: `y0` uploaded, the call, y and faults.
fn run_embed_lora<Y: OutputElem>(
    dev: &Device,
    pairs: &RandomPairs,
    ids: &[u32],
    row_slot: &[i32],
    y0: &[Y],
) -> (Vec<Y>, lora_kernels::FaultFlags) {
    run_embed_lora_at(dev, pairs, (0, pairs.in_dim), ids, row_slot, y0)
}

/// [`run_embed_lora`] for a vocab-parallel rank: A's columns are the ids
/// `vocab_start .. vocab_start + in_dim` of a vocabulary of `vocab_size`.
fn run_embed_lora_at<Y: OutputElem>(
    dev: &Device,
    pairs: &RandomPairs,
    (vocab_start, vocab_size): (usize, usize),
    ids: &[u32],
    row_slot: &[i32],
    y0: &[Y],
) -> (Vec<Y>, lora_kernels::FaultFlags) {
    let pool = pairs.upload(dev).unwrap();
    let (ids_d, rs_d) = (dev.upload(ids).unwrap(), dev.upload(row_slot).unwrap());
    let mut y = dev.upload(y0).unwrap();
    let table = EmbeddingPairs {
        table: &pool.table,
        table_offset: 0,
        n_entries: pairs.ranks.len(),
        stride: pairs.stride,
        vocab: pairs.in_dim,
        vocab_start,
        vocab_size,
    };
    embed_lora(
        dev,
        &ids_d,
        &rs_d,
        table,
        RowsMut::dense(&mut y, ids.len(), pairs.out_dim),
    )
    .unwrap();
    let faults = dev.take_faults().unwrap();
    (y.download().unwrap(), faults)
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_embed_lora_matches_cpu() {
    let Some(dev) = cuda_or_skip("gpu_embed_lora_matches_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_embed_lora_matches_cpu");
    // (vocab, hidden, stride, ranks per slot, rows): odd widths, rank 0
    // slots, every rank up to the stride, padding poisoned with NaN.
    for &(vocab, h, stride, ref ranks, n) in &[
        (97usize, 64usize, 16usize, vec![16u32, 0, 3, 8], 37usize),
        (1000, 130, 8, vec![1, 2, 5, 7, 8], 300),
        (33, 4096, 64, vec![64, 17], 9),
        (5, 3, 4, vec![4, 4], 1),
    ] {
        let mut pairs = RandomPairs::new(&mut rng, vocab, h, stride, ranks);
        pairs.poison_padding();
        let ids: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
        // Every slot and the base row (-1).
        let row_slot: Vec<i32> = (0..n).map(|_| rng.below(ranks.len() + 1) as i32 - 1).collect();
        let y_f32: Vec<f32> = (0..n * h).map(|_| rng.uniform()).collect();
        let y_bf16 = rng.bf16_vec(n * h, 1.0);
        let label = format!("vocab {vocab} h {h} stride {stride} ranks {ranks:?} rows {n}");
        let (want, cpu_faults) = run_embed_lora(&cpu, &pairs, &ids, &row_slot, &y_f32);
        let (got, faults) = run_embed_lora(&dev, &pairs, &ids, &row_slot, &y_f32);
        assert!(faults.is_empty() && cpu_faults.is_empty(), "{label}: faults {faults}");
        // The CPU reference against an f64 oracle straight from the weights.
        let mut oracle = y_f32.clone();
        for (i, (&t, &s)) in ids.iter().zip(&row_slot).enumerate() {
            if s >= 0 && pairs.ranks[s as usize] > 0 {
                let mut x = vec![0f32; vocab];
                x[t as usize] = 1.0;
                for (o, d) in pairs.delta_f64(s as usize, &x).into_iter().enumerate() {
                    oracle[i * h + o] = (f64::from(oracle[i * h + o]) + d) as f32;
                }
            }
        }
        assert!(rel_error(&want, &oracle) < 1e-5, "{label}: cpu vs f64 oracle");
        let err = rel_error(&got, &want);
        assert!(err < 1e-5, "{label}: f32 output, relative error {err:.3e}");
        for (i, &s) in row_slot.iter().enumerate() {
            if s < 0 {
                assert_eq!(
                    &got[i * h..(i + 1) * h],
                    &y_f32[i * h..(i + 1) * h],
                    "{label}: base row {i} changed"
                );
            }
        }
        let (want_b, _) = run_embed_lora(&cpu, &pairs, &ids, &row_slot, &y_bf16);
        let (got_b, faults) = run_embed_lora(&dev, &pairs, &ids, &row_slot, &y_bf16);
        assert!(faults.is_empty(), "{label}: faults {faults}");
        let err = rel_error(&widen(&got_b), &widen(&want_b));
        assert!(err < TOL, "{label}: bf16 output, relative error {err:.3e}");
    }
    // A token id past the vocab and a slot past the table raise faults and
    // leave their rows; the other rows are served.
    let pairs = RandomPairs::new(&mut rng, 50, 24, 8, &[8, 3]);
    let ids = [3u32, 50, 7, 9];
    let row_slot = [0i32, 1, 2, 1];
    let y0: Vec<f32> = (0..4 * 24).map(|_| rng.uniform()).collect();
    let (got, faults) = run_embed_lora(&dev, &pairs, &ids, &row_slot, &y0);
    assert_eq!(
        faults.0,
        lora_kernels::FaultFlags::BAD_TOKEN | lora_kernels::FaultFlags::BAD_INDEX,
        "faults: {faults}"
    );
    assert_eq!(&got[24..72], &y0[24..72], "faulting rows are left as they were");
    let (want, _) = run_embed_lora(
        &Device::cpu(),
        &pairs,
        &[3, 9],
        &[0, 1],
        &[&y0[..24], &y0[72..]].concat(),
    );
    assert!(rel_error(&[&got[..24], &got[72..]].concat(), &want) < 1e-5);
}

/// Output heads (`lm_head`: out = vocab, in = hidden), the tallest expands
/// a model has: the decode rule table's plan (with the overlap promise and
/// without), every candidate, and the fused kernel in more output splits
/// than the other rules take (rule 6 past the two launches' window),
/// against the CPU reference on fresh random inputs, padding poisoned, y
/// of random values with spare columns no target owns (left untouched),
/// in bf16 and f32 y.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_tall_heads_match_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_tall_heads_match_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_bgmv_tall_heads_match_cpu");
    // (n, in = hidden, vocab, stride, slots)
    let shapes: &[(usize, usize, usize, usize, usize)] = &[
        (1, 512, 32_000, 16, 4),
        (7, 1024, 128_256, 64, 3),
        (64, 256, 152_064, 8, 5),
        (3, 128, 262_208, 16, 2),
        (129, 64, 32_000, 16, 4),
        // Past the two launches' window of 512 rows.
        (520, 64, 32_000, 16, 4),
    ];
    for &(n, in_dim, vocab, stride, slots) in shapes {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 7 % stride) as u32).collect();
        let p = Problem::new(&mut rng, n, in_dim, &[vocab], stride, &ranks, true);
        let idx = random_idx(&mut rng, n, slots, 5);
        let label = format!("head n={n} in={in_dim} vocab={vocab} stride={stride}");
        let on = Applies::new(&gpu, &p, &idx);
        let mut runs = vec![auto(false), auto(true)];
        for overlap in [false, true] {
            runs.extend(on.candidates(&p.y_bf16, overlap).into_iter().map(exact));
        }
        // The fused kernel in more than 16 output splits: the fewest the
        // device serves the call with (as rule 6 picks them), in one
        // block and (sm_90) clusters of 8.
        let mut wide = 0;
        for cluster in [1, 8] {
            let fused = |out_splits| DecodePlan {
                form: DecodeForm::Fused(FusedForm {
                    cluster,
                    out_splits,
                    clusters_per_window: 1,
                    tensor_cores: false,
                    items: ItemList::Scan,
                    push_sum: false,
                }),
                chain: Chain::Plain,
            };
            if let Some(s) = [32, 64, 128, 256, 512, 1024]
                .into_iter()
                .find(|&s| on.serves(&p.y_bf16, fused(s)))
            {
                runs.push(exact(fused(s)));
                wide += 1;
            }
        }
        assert!(wide > 0, "{label}: no fused plan past 16 output splits");
        let c = run_bgmv_on(&cpu, &p, &idx, &p.y_bf16, DecodeOptions::default());
        for &options in &runs {
            let g = on.run(&p.y_bf16, options);
            compare(&format!("{label} {} (bf16 y)", describe(options)), &p.y_bf16, &c, &g);
        }
        let c = run_bgmv_on(&cpu, &p, &idx, &p.y_f32, DecodeOptions::default());
        for options in [auto(false), auto(true)] {
            let g = on.run(&p.y_f32, options);
            compare(&format!("{label} {} (f32 y)", describe(options)), &p.y_f32, &c, &g);
        }
    }
}

/// Output heads in the segment apply (prefill): every candidate plan
/// against the CPU reference, fresh random inputs, poisoned padding and
/// workspace, bf16 y, and the rule table's plan with f32 y.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_sgmv_tall_heads_match_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_sgmv_tall_heads_match_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_sgmv_tall_heads_match_cpu");
    // (n, in, vocab, stride, slots, segments)
    let shapes: &[(usize, usize, usize, usize, usize, usize)] = &[
        (40, 256, 32_000, 16, 3, 3),
        (17, 512, 128_256, 64, 2, 5),
        (9, 128, 262_208, 8, 2, 2),
    ];
    for &(n, in_dim, vocab, stride, slots, n_seg) in shapes {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 13 % stride) as u32).collect();
        let p = Problem::new(&mut rng, n, in_dim, &[vocab], stride, &ranks, true);
        let (cu, slot) = segments_for(&mut rng, n, n_seg, slots);
        let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Auto);
        for plan in sgmv_plans::<bf16>(&gpu, &p, n_seg) {
            let label = format!("sgmv head n={n} in={in_dim} vocab={vocab} stride={stride} {plan}");
            let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Exact(plan));
            compare(&label, &p.y_bf16, &c, &g);
        }
        let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_f32, Choice::Auto);
        let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_f32, Choice::Auto);
        compare(&format!("sgmv head f32 y n={n} vocab={vocab}"), &p.y_f32, &c, &g);
    }
}

/// The vocab-parallel forms of the embedding kernels on fresh random
/// inputs: `embed_lora` with A holding the columns of one rank's block
/// (`vocab_start`), and `embed_overlay_at` over one rank's table rows, each
/// for every rank of 2 and 4 over ids drawn from the whole vocabulary. The
/// CUDA kernels equal the CPU reference (the lookup bit for bit, its NaN
/// poisoned output overwritten; the delta within f32 rounding), another
/// rank's token gets nothing from the LoRA and a zero row from the lookup,
/// and no fault is raised.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_vocab_parallel_embedding_kernels_match_cpu() {
    let Some(dev) = cuda_or_skip("gpu_vocab_parallel_embedding_kernels_match_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_vocab_parallel_embedding_kernels_match_cpu");
    let (vocab, h, stride, n) = (512usize, 96usize, 16usize, 131usize);
    for world in [2usize, 4] {
        let part = vocab / world;
        for rank in 0..world {
            let start = rank * part;
            let label = format!("rank {rank} of {world}");
            let mut pairs = RandomPairs::new(&mut rng, part, h, stride, &[16, 5, 0]);
            pairs.poison_padding();
            let ids: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
            let row_slot: Vec<i32> = (0..n).map(|_| rng.below(4) as i32 - 1).collect();
            let y0: Vec<f32> = (0..n * h).map(|_| rng.uniform()).collect();
            let at = (start, vocab);
            let (want, cpu_faults) = run_embed_lora_at(&cpu, &pairs, at, &ids, &row_slot, &y0);
            let (got, faults) = run_embed_lora_at(&dev, &pairs, at, &ids, &row_slot, &y0);
            assert!(faults.is_empty() && cpu_faults.is_empty(), "{label}: faults {faults}");
            let err = rel_error(&got, &want);
            assert!(err < 1e-5, "{label}: embed_lora relative error {err:.3e}");
            for (i, &t) in ids.iter().enumerate() {
                if !(start..start + part).contains(&(t as usize)) {
                    assert_eq!(&got[i * h..(i + 1) * h], &y0[i * h..(i + 1) * h], "{label}: row {i}");
                }
            }
            // The lookup over the rank's rows, one slot overlaying some.
            let base = rng.bf16_vec(part * h, 1.0);
            let over = rng.bf16_vec(3 * h, 1.0);
            let mut map = vec![-1i32; part];
            for (k, m) in [(0usize, 5usize), (1, part / 2), (2, part - 1)] {
                map[m] = k as i32;
            }
            let lookup = |d: &Device| -> (Vec<bf16>, lora_kernels::FaultFlags) {
                let (b, o, m) = (
                    d.upload(&base).unwrap(),
                    d.upload(&over).unwrap(),
                    d.upload(&map).unwrap(),
                );
                let ents = d
                    .upload(&[
                        EmbedOverlayEntry::default(),
                        EmbedOverlayEntry {
                            slot_map: m.device_addr(),
                            rows: o.device_addr(),
                            n_rows: 3,
                            pad: 0,
                        },
                    ])
                    .unwrap();
                let ids_d = d.upload(&ids).unwrap();
                let rs: Vec<i32> = row_slot.iter().map(|&s| s.min(1)).collect();
                let rs_d = d.upload(&rs).unwrap();
                let mut out = d.upload(&vec![bf16::NAN; n * h]).unwrap();
                embed_overlay_at(
                    d,
                    &ids_d,
                    Some(&rs_d),
                    Rows::dense(&b, part, h),
                    start..start + part,
                    vocab,
                    &ents,
                    RowsMut::dense(&mut out, n, h),
                )
                .unwrap();
                (out.download().unwrap(), d.take_faults().unwrap())
            };
            let (want, _) = lookup(&cpu);
            let (got, faults) = lookup(&dev);
            assert!(faults.is_empty(), "{label}: lookup faults {faults}");
            assert_eq!(widen(&got), widen(&want), "{label}: lookup");
            for (i, &t) in ids.iter().enumerate() {
                if !(start..start + part).contains(&(t as usize)) {
                    assert!(
                        got[i * h..(i + 1) * h].iter().all(|v| v.to_f32() == 0.0),
                        "{label}: row {i}"
                    );
                }
            }
        }
    }
}

/// Asserts that the DoRA run `got` equals the plain run `plain` bit for bit
/// on every (row, target) that has no rescale: base rows (-1) and rows of
/// plain-LoRA slots there (the epilogue leaves them as the expand wrote them).
fn assert_plain_rows_untouched<Y: OutputElem>(label: &str, p: &Problem, row_slot: &[i32], got: &[Y], plain: &[Y]) {
    let specs = p.dora.as_ref().unwrap();
    for (r, &s) in row_slot.iter().enumerate() {
        let mut col = 0;
        for (t, &out) in p.outs.iter().enumerate() {
            if s < 0 || specs[t].g[s as usize].is_none() {
                for c in col..col + out {
                    let i = r * p.y_width + c;
                    assert_eq!(
                        got[i].to_f32().to_bits(),
                        plain[i].to_f32().to_bits(),
                        "{label}: row {r} (slot {s}) target {t} column {c} differs from the plain apply"
                    );
                }
            }
            col += out;
        }
    }
}

/// The DoRA epilogue in every decode form the plan picks: mixed batches of
/// DoRA rows, plain-LoRA rows and base rows (-1), each `g` poisoned past
/// its outputs, biases present and absent, BF16 and f32 y, every candidate
/// plan with and without the overlap promise (and the row-mapped clusters),
/// against the CPU reference; rows without a rescale bit-identical to the
/// same plan without the epilogue. Over the shapes, every decode form runs.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_bgmv_dora_epilogue_in_every_form() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_dora_epilogue_in_every_form") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_dora_epilogue_in_every_form");
    let cpu = Device::cpu();
    // (n, in, outs, stride, slots, aligned rows, bias)
    type Shape = (usize, usize, &'static [usize], usize, usize, bool, bool);
    let shapes: &[Shape] = &[
        (1, 4096, &[4096], 16, 4, true, true),
        (64, 4096, &[4096], 16, 64, true, false),
        (256, 4096, &[4096], 16, 32, true, true),
        (256, 4096, &[1024, 256, 256], 16, 32, true, true),
        (64, 2049, &[333], 16, 8, false, true),
        (33, 96, &[4097], 8, 3, false, false),
        (64, 520, &[14336], 16, 64, false, true),
        (300, 520, &[96, 336], 32, 5, true, true),
        (64, 1024, &[14336], 64, 64, true, false),
        (1024, 128, &[72, 8, 40], 64, 2, true, true),
        (5, 7, &[9], 3, 2, false, true),
    ];
    let mut forms = std::collections::BTreeSet::new();
    for &(n, in_dim, outs, stride, slots, aligned, bias) in shapes {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 37 % stride) as u32).collect();
        let p = Problem::new(&mut rng, n, in_dim, outs, stride, &ranks, true);
        let p = if aligned { p.with_aligned_rows(&mut rng) } else { p };
        let p = p.with_dora(&mut rng, bias);
        let idx = random_idx(&mut rng, n, slots, 7);
        let label = format!("dora n={n} in={in_dim} outs={outs:?} stride={stride} bias={bias}");
        let on = Applies::new(&gpu, &p, &idx);
        let mut plain = Applies::new(&gpu, &p, &idx);
        plain.bufs.dora.clear();
        let c = run_bgmv_on(&cpu, &p, &idx, &p.y_bf16, DecodeOptions::default());
        let mut runs = Vec::new();
        for overlap in [false, true] {
            let plans = on.plans(&p.y_bf16, overlap);
            let per_row = cluster_per_row(&on, &p.y_bf16, &plans);
            forms.extend(plans.iter().chain(&per_row).map(form_name));
            runs.extend(runs_of(overlap, &plans));
            runs.extend(per_row.into_iter().map(exact));
        }
        for options in runs {
            let what = format!("{label} {} (bf16 y)", describe(options));
            let g = on.run(&p.y_bf16, options);
            compare(&what, &p.y_bf16, &c, &g);
            assert_plain_rows_untouched(&what, &p, &idx, &g, &plain.run(&p.y_bf16, options));
        }
        let c = run_bgmv_on(&cpu, &p, &idx, &p.y_f32, DecodeOptions::default());
        for options in runs_of(false, &on.plans(&p.y_f32, false)) {
            let what = format!("{label} {} (f32 y)", describe(options));
            let g = on.run(&p.y_f32, options);
            compare(&what, &p.y_f32, &c, &g);
            assert_plain_rows_untouched(&what, &p, &idx, &g, &plain.run(&p.y_f32, options));
        }
    }
    eprintln!("DoRA epilogue forms run: {forms:?}");
    for prefix in ["fused", "two-phase", "rows", "entry"] {
        assert!(
            forms.iter().any(|f| f.starts_with(prefix)),
            "no {prefix} form among the plans run: {forms:?}"
        );
    }
}

/// The DoRA epilogue of the prefill apply: every sgmv plan the tests cover
/// (`sgmv_plans`) on mixed segments (DoRA, plain-LoRA and base segments,
/// empty ones), BF16 and f32 y, biases present and absent, and the
/// one-adapter case on a DoRA slot, against the CPU reference; rows without
/// a rescale bit-identical to the same plan without the epilogue.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_sgmv_dora_epilogue_matches_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_sgmv_dora_epilogue_matches_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_sgmv_dora_epilogue_matches_cpu");
    // (n, in, outs, stride, slots, segments, bias)
    type Shape = (usize, usize, &'static [usize], usize, usize, usize, bool);
    let shapes: &[Shape] = &[
        (512, 4096, &[4096], 16, 4, 4, true),
        (300, 2049, &[200, 64], 64, 6, 7, true),
        (1000, 1024, &[1024], 64, 64, 32, false),
        (130, 96, &[130], 128, 3, 3, true),
        (17, 24, &[9], 5, 2, 5, false),
    ];
    for &(n, in_dim, outs, stride, slots, n_seg, bias) in shapes {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 13 % stride) as u32).collect();
        let p = Problem::new(&mut rng, n, in_dim, outs, stride, &ranks, true).with_dora(&mut rng, bias);
        let (cu, slot) = segments_for(&mut rng, n, n_seg, slots);
        let row_slot: Vec<i32> = (0..n)
            .map(|r| {
                let s = cu.windows(2).position(|w| (w[0] as usize..w[1] as usize).contains(&r));
                s.map_or(-1, |s| slot[s])
            })
            .collect();
        let plain = Problem {
            dora: None,
            ..p.clone()
        };
        let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Auto);
        for plan in sgmv_plans::<bf16>(&gpu, &p, n_seg) {
            let label = format!("dora sgmv n={n} in={in_dim} outs={outs:?} stride={stride} bias={bias} {plan}");
            let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Exact(plan));
            compare(&label, &p.y_bf16, &c, &g);
            let q = run_sgmv_on(&gpu, &plain, Some((&cu, &slot)), 0, &p.y_bf16, Choice::Exact(plan));
            assert_plain_rows_untouched(&label, &p, &row_slot, &g, &q);
        }
        let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_f32, Choice::Auto);
        for plan in sgmv_plans::<f32>(&gpu, &p, n_seg) {
            let label = format!("dora sgmv f32 y n={n} {plan}");
            let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_f32, Choice::Exact(plan));
            compare(&label, &p.y_f32, &c, &g);
            let q = run_sgmv_on(&gpu, &plain, Some((&cu, &slot)), 0, &p.y_f32, Choice::Exact(plan));
            assert_plain_rows_untouched(&label, &p, &row_slot, &g, &q);
        }
        // One adapter: slot 0, a DoRA slot at the first target.
        let c = run_sgmv_on(&cpu, &p, None, 0, &p.y_bf16, Choice::Auto);
        let g = run_sgmv_on(&gpu, &p, None, 0, &p.y_bf16, Choice::Auto);
        compare(&format!("dora one adapter n={n}"), &p.y_bf16, &c, &g);
    }
}
