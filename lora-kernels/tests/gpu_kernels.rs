//! GPU equals CPU reference, for every kernel: fresh random inputs each run
//! (seed printed), poisoned outputs and scratch, odd shapes, every rank
//! against a padded pool, and graph replay after table contents change.
//! Skips without a GPU; fails instead under `LORA_REQUIRE_GPU=1`.

#![allow(clippy::unwrap_used)]

use half::bf16;
use lora_kernels::testing::{RandomPairs, Rng, cuda_or_skip, rel_error, widen};
use lora_kernels::{
    BgmvTuning, Device, DeviceBuffer, EmbedOverlayEntry, LmHeadOverlayEntry, LoraTarget, LoraWorkspace, MoeRouting,
    OutputElem, PairEntry, ROWS_MAX_IN, ROWS_MAX_OUT, Rows, RowsMut, Segments, SgmvTuning, WorkspaceSpec, bgmv_tuned,
    embed_overlay, lm_head_overlay, moe_decode_index, moe_sorted_index, one_adapter, row_diff, sgmv_tuned,
};

const TOL: f64 = 1e-2;

/// One apply problem, built identically on any device.
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
        }
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

fn run_bgmv_on<Y: OutputElem>(dev: &Device, p: &Problem, idx: &[i32], y0: &[Y], tuning: BgmvTuning) -> Vec<Y> {
    run_bgmv_shifted(dev, p, idx, y0, 0, tuning)
}

/// [`run_bgmv_on`] with the weights placed by `OnDevice::shifted`.
fn run_bgmv_shifted<Y: OutputElem>(
    dev: &Device,
    p: &Problem,
    idx: &[i32],
    y0: &[Y],
    shift: usize,
    tuning: BgmvTuning,
) -> Vec<Y> {
    let on = OnDevice::shifted(dev, p, shift);
    let idx = dev.upload(idx).unwrap();
    let mut y = dev.upload(y0).unwrap();
    let targets = on.targets(p);
    let yv = RowsMut::dense(&mut y, p.n, p.y_width);
    bgmv_tuned(dev, on.x_rows(p), &idx, &targets, p.stride, yv, tuning).unwrap();
    dev.check_faults().unwrap();
    y.download().unwrap()
}

fn check_bgmv(gpu: &Device, label: &str, p: &Problem, idx: &[i32], tuning: BgmvTuning) {
    let cpu = Device::cpu();
    let c = run_bgmv_on(&cpu, p, idx, &p.y_bf16, BgmvTuning::default());
    let g = run_bgmv_on(gpu, p, idx, &p.y_bf16, tuning);
    compare(&format!("{label} (bf16 y)"), &p.y_bf16, &c, &g);
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
        // Wide outputs: the row form's expand units past 1024 outputs.
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
        // The two-phase kernels serve single windows (512 rows) only.
        let mut tunings = vec![BgmvTuning::default()];
        tunings.extend(FUSED_FORMS);
        if n <= 512 {
            tunings.extend([TWO_PHASE, TWO_PHASE_DEPENDENT, TWO_PHASE_POW2]);
            tunings.extend([TWO_PHASE_TC, TWO_PHASE_TC_POW2_DEPENDENT]);
            tunings.extend([TWO_PHASE_ROWS, TWO_PHASE_ROWS_PLAIN, TWO_PHASE_ROWS_TC]);
        }
        // The cluster sum both ways, whatever the stride's default (the
        // push's receive buffers of rank stride 256 do not fit: refused below).
        let pushed = [
            BgmvTuning {
                push_sum: Some(true),
                ..FUSED_TC_SCAN
            },
            BgmvTuning {
                push_sum: Some(true),
                ..FUSED_SCALAR_LIST
            },
        ];
        if stride <= 64 {
            tunings.extend(pushed);
        }
        tunings.push(BgmvTuning {
            push_sum: Some(false),
            ..FUSED_SCALAR_SCAN
        });
        // A cluster for every row (the row-mapped form in 16-warp clusters
        // of 2, where their stage fits), and the default cluster size.
        tunings.push(BgmvTuning {
            cluster: None,
            ..FUSED_ROW_MAPPED
        });
        if stride <= 64 {
            tunings.push(FUSED_ROW_MAPPED);
            // B in registers (rank stride 16; elsewhere the staged form serves).
            tunings.push(BGMV_ROW_MAPPED_B_REGISTERS);
        }
        // The row-register form where its shape limits allow.
        if stride == 16 && in_dim.is_multiple_of(8) && in_dim <= ROWS_MAX_IN && outs.iter().all(|&o| o <= ROWS_MAX_OUT)
        {
            tunings.push(ROW_REGISTERS);
        }
        for t in tunings {
            check_bgmv(
                &gpu,
                &format!("n={n} in={in_dim} outs={outs:?} stride={stride} {t:?}"),
                &p,
                &idx,
                t,
            );
        }
        if stride > 64 {
            let on = OnDevice::new(&gpu, &p);
            let idx = gpu.upload(&idx).unwrap();
            let mut y = gpu.upload(&p.y_bf16).unwrap();
            let y = RowsMut::dense(&mut y, p.n, p.y_width);
            let err = bgmv_tuned(&gpu, on.x_rows(&p), &idx, &on.targets(&p), p.stride, y, pushed[0]).unwrap_err();
            assert!(err.to_string().contains("rank_stride"), "{err}");
        }
    }
}

/// The fused one-launch kernel, whatever the batch.
const FUSED: BgmvTuning = BgmvTuning {
    cluster: None,
    out_splits: None,
    clusters_per_window: None,
    two_phase: Some(false),
    expand_cols: None,
    dependent_launch: None,
    shrink_tensor_cores: None,
    two_phase_row_items: None,
    pow2_slices: None,
    tensor_cores: None,
    item_list_pass: None,
    list_ready_flag: None,
    push_sum: None,
    overlap_previous: None,
    entry_clusters: None,
    expand_b_registers: None,
    row_registers: Some(false),
    entry_registers: None,
    wait_first: None,
    prefetch_weights: None,
    early_next: None,
    entry_spread: None,
};

/// The fused kernel on its scalar path and on tensor cores.
const FUSED_SCALAR: BgmvTuning = BgmvTuning {
    tensor_cores: Some(false),
    ..FUSED
};
const FUSED_TC: BgmvTuning = BgmvTuning {
    tensor_cores: Some(true),
    ..FUSED
};

/// The fused kernel reading the item list of a first launch (`bgmv_list`),
/// scalar and on tensor cores, after that launch completes or once its
/// ready flag is up.
const FUSED_SCALAR_LIST: BgmvTuning = BgmvTuning {
    item_list_pass: Some(true),
    ..FUSED_SCALAR
};
const FUSED_TC_LIST: BgmvTuning = BgmvTuning {
    item_list_pass: Some(true),
    ..FUSED_TC
};
const FUSED_TC_LIST_FLAG: BgmvTuning = BgmvTuning {
    list_ready_flag: Some(true),
    ..FUSED_TC_LIST
};
const FUSED_SCALAR_LIST_FLAG: BgmvTuning = BgmvTuning {
    list_ready_flag: Some(true),
    ..FUSED_SCALAR_LIST
};
/// The fused kernel in the scanning form (every block lists its window's items).
const FUSED_SCALAR_SCAN: BgmvTuning = BgmvTuning {
    item_list_pass: Some(false),
    ..FUSED_SCALAR
};
const FUSED_TC_SCAN: BgmvTuning = BgmvTuning {
    item_list_pass: Some(false),
    ..FUSED_TC
};
/// The scanning scalar kernel in 16-warp clusters of 2 with a cluster for
/// every row: the row-mapped form (windows of up to 512 rows).
const FUSED_ROW_MAPPED: BgmvTuning = BgmvTuning {
    cluster: Some(2),
    clusters_per_window: Some(512),
    ..FUSED_SCALAR_SCAN
};
/// The row-mapped form with B in registers at rank stride 16 (opt-in).
const BGMV_ROW_MAPPED_B_REGISTERS: BgmvTuning = BgmvTuning {
    expand_b_registers: Some(true),
    ..FUSED_ROW_MAPPED
};
/// The row-register form: a cluster of 2 blocks per (row, target), loads into registers.
const ROW_REGISTERS: BgmvTuning = BgmvTuning {
    row_registers: Some(true),
    ..FUSED
};
/// The entry-clustered form: a cluster of 8 (or 4) blocks per table entry.
const ENTRY: BgmvTuning = BgmvTuning {
    entry_clusters: Some(true),
    ..FUSED
};
const ENTRY_C4: BgmvTuning = BgmvTuning {
    cluster: Some(4),
    ..ENTRY
};
/// The entry form's staged kernel where the register kernel is the default
/// (rank stride 16, clusters of 8, at most 256 rows, `in` and outputs up to
/// 4096, 8 rows per table entry).
const ENTRY_STAGED: BgmvTuning = BgmvTuning {
    entry_registers: Some(false),
    ..ENTRY
};
/// The entry form's register kernel wherever it serves the call.
const ENTRY_REGISTERS: BgmvTuning = BgmvTuning {
    entry_registers: Some(true),
    ..ENTRY
};
/// The entry form's spread kernel wherever it serves the call (rank stride
/// 16, at most 256 rows, 4 blocks per entry all resident at once).
const ENTRY_SPREAD: BgmvTuning = BgmvTuning {
    entry_spread: Some(true),
    ..ENTRY
};

/// Every form of the fused kernel: scalar and tensor-core, each scanning
/// its window, reading the item list after completion, or after its flag.
const FUSED_FORMS: [BgmvTuning; 6] = [
    FUSED_SCALAR_SCAN,
    FUSED_TC_SCAN,
    FUSED_SCALAR_LIST,
    FUSED_TC_LIST,
    FUSED_SCALAR_LIST_FLAG,
    FUSED_TC_LIST_FLAG,
];

/// The two-phase kernels (shrink, then expand), whatever the batch, in the
/// scanning form (items of up to 8 rows of one entry, listed by the shrink),
/// with as many K slices as fill the grid, the expand a plain launch.
const TWO_PHASE: BgmvTuning = BgmvTuning {
    two_phase: Some(true),
    two_phase_row_items: Some(false),
    pow2_slices: Some(false),
    dependent_launch: Some(false),
    ..FUSED
};

/// The two-phase kernels with K slices rounded down to a power of two.
const TWO_PHASE_POW2: BgmvTuning = BgmvTuning {
    pow2_slices: Some(true),
    ..TWO_PHASE
};

/// The two-phase kernels with the expand as a programmatic dependent launch.
const TWO_PHASE_DEPENDENT: BgmvTuning = BgmvTuning {
    dependent_launch: Some(true),
    ..TWO_PHASE
};

/// The two-phase kernels with the shrink on tensor cores, with each launch
/// form of the expand.
const TWO_PHASE_TC: BgmvTuning = BgmvTuning {
    shrink_tensor_cores: Some(true),
    ..TWO_PHASE
};
const TWO_PHASE_TC_POW2_DEPENDENT: BgmvTuning = BgmvTuning {
    shrink_tensor_cores: Some(true),
    pow2_slices: Some(true),
    ..TWO_PHASE_DEPENDENT
};

/// The two-phase kernels with every row its own item, the expand a
/// dependent launch (its first unit's entry, first B rows and y read before
/// it waits); the same as plain launches, and with the shrink on tensor
/// cores.
const TWO_PHASE_ROWS: BgmvTuning = BgmvTuning {
    two_phase_row_items: Some(true),
    pow2_slices: Some(true),
    ..TWO_PHASE_DEPENDENT
};
const TWO_PHASE_ROWS_PLAIN: BgmvTuning = BgmvTuning {
    two_phase_row_items: Some(true),
    ..TWO_PHASE
};
const TWO_PHASE_ROWS_TC: BgmvTuning = BgmvTuning {
    shrink_tensor_cores: Some(true),
    ..TWO_PHASE_ROWS
};

/// Applies chained in one stream, each reading as x what the one before
/// wrote as y (`overlap_previous`: launched as a programmatic dependent, it
/// reads x and y only after the previous kernel completed), against the same
/// chain on the CPU. Both buffers hold `n` rows of `pitch` columns (x and y
/// use the first `in_dim == out` of them); apply i reads `bufs[i % 2]` and
/// adds into `bufs[(i + 1) % 2]`.
fn overlap_chain(
    dev: &Device,
    p: &Problem,
    start: &[Vec<bf16>; 2],
    pitch: usize,
    idx: &[i32],
    tunings: &[BgmvTuning],
) -> Vec<f32> {
    assert_eq!(p.outs, [p.in_dim], "the chain feeds y back as x");
    let on = OnDevice::new(dev, p);
    let idx = dev.upload(idx).unwrap();
    let targets = on.targets(p);
    let mut bufs = [dev.upload(&start[0]).unwrap(), dev.upload(&start[1]).unwrap()];
    for (i, &t) in tunings.iter().enumerate() {
        let (lo, hi) = bufs.split_at_mut(1);
        let (x, y) = if i % 2 == 0 {
            (&lo[0], &mut hi[0])
        } else {
            (&hi[0], &mut lo[0])
        };
        let rows = Rows {
            buf: x,
            offset: 0,
            n_rows: p.n,
            width: p.in_dim,
            stride: pitch,
        };
        let y = RowsMut {
            buf: y,
            offset: 0,
            n_rows: p.n,
            width: p.in_dim,
            stride: pitch,
        };
        bgmv_tuned(dev, rows, &idx, &targets, p.stride, y, t).unwrap();
    }
    dev.check_faults().unwrap();
    let last = bufs[tunings.len() % 2].download().unwrap();
    widen(&last)
}

#[test]
fn gpu_bgmv_overlap_previous_reads_x_and_y_after_the_previous_kernel() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_overlap_previous_reads_x_and_y_after_the_previous_kernel") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_overlap_previous_reads_x_and_y_after_the_previous_kernel");
    let overlap = BgmvTuning {
        overlap_previous: Some(true),
        ..FUSED_SCALAR_SCAN
    };
    // (n, width, stride, slots, tuning): the first item's A chunks requested
    // before the wait (one or two chunks), or everything after it (more
    // chunks: one block per item), with the cluster sum pushed or pulled.
    let cases: [(usize, usize, usize, usize, BgmvTuning); 5] = [
        (1, 4096, 16, 2, overlap),
        (16, 1024, 16, 5, overlap),
        (
            16,
            1024,
            16,
            5,
            BgmvTuning {
                push_sum: Some(false),
                ..overlap
            },
        ),
        (
            9,
            2048,
            64,
            3,
            BgmvTuning {
                cluster: Some(1),
                ..overlap
            },
        ),
        (
            40,
            520,
            32,
            6,
            BgmvTuning {
                tensor_cores: Some(true),
                clusters_per_window: Some(2),
                ..overlap
            },
        ),
    ];
    for (n, width, stride, slots, t) in cases {
        // A plain apply first (its predecessor is an upload), then dependents.
        check_overlap_chain(
            &gpu,
            &mut rng,
            (n, width, stride, slots),
            &[FUSED_SCALAR_SCAN, t, t, t, t, t],
        );
    }
}

/// One chain of [`overlap_chain`] on random data against the CPU.
/// (n, width, rank stride, slots) of a chain's applies.
type ApplyShape = (usize, usize, usize, usize);

fn check_overlap_chain(gpu: &Device, rng: &mut Rng, shape: ApplyShape, chain: &[BgmvTuning]) {
    let (n, width, stride, slots) = shape;
    let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 7 % stride) as u32).collect();
    let p = Problem::new(rng, n, width, &[width], stride, &ranks, true);
    // Rows of no adapter among the rest (a single row always has one).
    let idx = random_idx(rng, n, slots, if n == 1 { 0 } else { 5 });
    // 16-byte aligned rows (the vector paths) with spare columns past the width.
    let pitch = width.div_ceil(8) * 8 + 8;
    let start = [rng.bf16_vec(n * pitch, 1.0), rng.bf16_vec(n * pitch, 1.0)];
    let cpu = overlap_chain(
        &Device::cpu(),
        &p,
        &start,
        pitch,
        &idx,
        &vec![BgmvTuning::default(); chain.len()],
    );
    let g = overlap_chain(gpu, &p, &start, pitch, &idx, chain);
    assert!(g.iter().all(|v| v.is_finite()), "n={n} {chain:?}: non-finite output");
    let err = rel_error(&g, &cpu);
    assert!(err < TOL, "n={n} width={width} {chain:?}: ‖gpu − cpu‖/‖cpu‖ = {err:e}");
}

/// The overlap in the forms of two launches: the item list (`bgmv_list`
/// reads idx and the tables before its wait, writes its list after it) and
/// the two-phase shrink (idx and the tables before its wait; the scratch and
/// x after it). Chains mix the forms, so each one's first kernel runs under
/// a previous apply's last kernel that still reads the same scratch.
#[test]
fn gpu_bgmv_overlap_previous_in_the_list_and_two_phase_forms() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_overlap_previous_in_the_list_and_two_phase_forms") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_overlap_previous_in_the_list_and_two_phase_forms");
    let with_overlap = |t: BgmvTuning| BgmvTuning {
        overlap_previous: Some(true),
        ..t
    };
    let list = with_overlap(FUSED_TC_LIST);
    let list_flag = with_overlap(FUSED_SCALAR_LIST_FLAG);
    let two_phase = with_overlap(TWO_PHASE_POW2);
    let two_phase_dependent = BgmvTuning {
        dependent_launch: Some(true),
        ..two_phase
    };
    let scan = with_overlap(FUSED_SCALAR_SCAN);
    let two_phase_tc = with_overlap(TWO_PHASE_TC_POW2_DEPENDENT);
    let two_phase_rows = with_overlap(TWO_PHASE_ROWS);
    // (n, width, stride, slots): one window and several (n > 512 for the list).
    let shapes = [
        (200, 1024, 16, 7),
        (64, 2048, 64, 9),
        (300, 520, 32, 4),
        (700, 264, 16, 11),
    ];
    for (i, &shape) in shapes.iter().enumerate() {
        let n = shape.0;
        // The two-phase kernels serve at most one window.
        let chain: Vec<BgmvTuning> = if n <= 512 {
            vec![
                TWO_PHASE_POW2,
                list,
                two_phase,
                list_flag,
                two_phase_dependent,
                two_phase,
                scan,
                two_phase_tc,
                two_phase_tc,
                two_phase_rows,
                two_phase,
                two_phase_rows,
                list,
            ]
        } else {
            vec![FUSED_TC_LIST, list, list_flag, scan, list, list]
        };
        // And each form chained to itself.
        let own: Vec<BgmvTuning> = vec![[list, two_phase, two_phase_tc, list_flag][i]; 5];
        check_overlap_chain(&gpu, &mut rng, shape, &chain);
        check_overlap_chain(&gpu, &mut rng, shape, &own);
        if n <= 512 {
            check_overlap_chain(&gpu, &mut rng, shape, &[two_phase_rows; 5]);
        }
        // The defaults under the overlap (up to 256 rows every block scans
        // its window on tensor cores; past that, the list).
        let defaults = with_overlap(BgmvTuning::default());
        check_overlap_chain(
            &gpu,
            &mut rng,
            shape,
            &[BgmvTuning::default(), defaults, defaults, defaults],
        );
    }
}

/// Every decode form sums in a fixed order (the two-phase shrink: at most
/// two column groups, each walking its own passes, or the tensor-core tiles
/// in warp order; the fused kernel's warps and cluster peers in order), so
/// repeated applies give the same f32 bits: long K slices (several
/// 256-column passes per warp) and items of several rows.
#[test]
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
        let cpu = run_bgmv_on(&Device::cpu(), &p, &idx, &p.y_f32, BgmvTuning::default());
        for t in [TWO_PHASE, TWO_PHASE_TC, TWO_PHASE_ROWS, FUSED_ROW_MAPPED]
            .into_iter()
            .chain(FUSED_FORMS)
        {
            let first = run_bgmv_on(&gpu, &p, &idx, &p.y_f32, t);
            compare(&format!("n={n} in={in_dim} {t:?}"), &p.y_f32, &cpu, &first);
            for _ in 0..4 {
                let again = run_bgmv_on(&gpu, &p, &idx, &p.y_f32, t);
                let same = first.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "n={n} in={in_dim} {t:?}: a repeated apply differs");
            }
        }
    }
}

#[test]
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
    for t in FUSED_FORMS.into_iter().chain([TWO_PHASE, TWO_PHASE_TC, TWO_PHASE_ROWS]) {
        check_bgmv(&gpu, &format!("every rank {t:?}"), &p, &idx, t);
    }
}

/// The row-mapped clusters of 2 at rank stride 16 with each block's B rows
/// in registers (`expand_b_registers`): every rank 1..=16 against a poisoned
/// padded pool, rows of no adapter, blocks of 2048 outputs (every tile of
/// every warp) and of a few hundred (warps partly or wholly past the
/// block's outputs), f32 y, and weights 8-byte aligned (one load per lane
/// and tile) or only 2-byte (four), against the CPU, the default and the
/// staged form.
#[test]
fn gpu_bgmv_row_mapped_b_in_registers() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_row_mapped_b_in_registers") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_row_mapped_b_in_registers");
    for (outs, aligned_rows) in [
        (&[4096][..], true),
        (&[4096], false),
        (&[1000, 24], true),
        (&[1000, 24], false),
    ] {
        // Rows 16-byte aligned: y added and stored 8 outputs at a time; otherwise one by one.
        let tunings = [BgmvTuning::default(), FUSED_ROW_MAPPED, BGMV_ROW_MAPPED_B_REGISTERS];
        check_row_form(
            &gpu,
            &mut rng,
            (64, 1024, outs),
            aligned_rows,
            (3, 40),
            &tunings,
            BGMV_ROW_MAPPED_B_REGISTERS,
        );
    }
}

/// One shape of the row forms' tests: pairs of every rank 1..=16 over a
/// poisoned padded pool, row i naming entry (i % 17) - 1 (-1: no adapter)
/// with the rows `swap` exchanged, x and y rows 16-byte aligned or not:
/// every tuning with the weights shifted by 0, 4 and 1 elements (16-, 8-
/// and 2-byte aligned) against the CPU with bf16 y, then `f32_tuning` with
/// f32 y.
fn check_row_form(
    gpu: &Device,
    rng: &mut Rng,
    (n, in_dim, outs): (usize, usize, &[usize]),
    aligned_rows: bool,
    swap: (usize, usize),
    tunings: &[BgmvTuning],
    f32_tuning: BgmvTuning,
) {
    let cpu = Device::cpu();
    let ranks: Vec<u32> = (1..=16).collect();
    let p = Problem::new(rng, n, in_dim, outs, 16, &ranks, true);
    let p = if aligned_rows { p.with_aligned_rows(rng) } else { p };
    let mut idx: Vec<i32> = (0..n).map(|i| (i % 17) as i32 - 1).collect();
    idx.swap(swap.0, swap.1);
    let shape = format!("n={n} in={in_dim} outs={outs:?} aligned rows {aligned_rows}");
    let c = run_bgmv_on(&cpu, &p, &idx, &p.y_bf16, BgmvTuning::default());
    for shift in [0, 4, 1] {
        for &t in tunings {
            let g = run_bgmv_shifted(gpu, &p, &idx, &p.y_bf16, shift, t);
            compare(&format!("{shape} weights shifted by {shift} {t:?}"), &p.y_bf16, &c, &g);
        }
    }
    let c = run_bgmv_on(&cpu, &p, &idx, &p.y_f32, BgmvTuning::default());
    let g = run_bgmv_on(gpu, &p, &idx, &p.y_f32, f32_tuning);
    compare(&format!("{shape} f32 y {f32_tuning:?}"), &p.y_f32, &c, &g);
}

/// The row-register form (`row_registers`): every rank 1..=16 against a
/// poisoned padded pool, rows of no adapter, blocks of 2048 outputs and
/// columns (every thread busy) and of a few (threads and the second block
/// partly or wholly idle), outputs not a multiple of 4 (a thread's last
/// outputs one by one), several targets, f32 y, rows 16-byte aligned or
/// not, and weights 16-byte aligned or only 8- or 2-byte (element loads),
/// against the CPU; at 4096 x 4096 the `_full` kernels, whose straight-line
/// form serves the rank-16 entries with aligned weights and the general
/// form the others; at n = 64 of one target also the default and the
/// row-mapped fused form.
#[test]
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
        let mut tunings = vec![ROW_REGISTERS];
        if n == 64 && outs.len() == 1 {
            tunings.extend([BgmvTuning::default(), FUSED_ROW_MAPPED]);
        }
        for aligned_rows in [true, false] {
            check_row_form(
                &gpu,
                &mut rng,
                (n, in_dim, outs),
                aligned_rows,
                (1, n - 1),
                &tunings,
                ROW_REGISTERS,
            );
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
        check_row_form(
            &gpu,
            &mut rng,
            shape,
            round % 4 < 2,
            (0, 1),
            &[ROW_REGISTERS],
            ROW_REGISTERS,
        );
    }
}

/// The row-register form's faults (an index past the table, an entry of a
/// rank past the stride: their rows get no delta, the others theirs), its
/// refusals (a typed error naming the knob, nothing launched), and the
/// overlap (x and y read only after the previous kernel) in chains mixed
/// with the fused form.
#[test]
fn gpu_bgmv_row_registers_faults_refusals_and_overlap() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_row_registers_faults_refusals_and_overlap") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_row_registers_faults_refusals_and_overlap");
    let (n, stride) = (5, 16);
    let p = Problem::new(&mut rng, n, 64, &[32], stride, &[16, 7], false);
    let on = OnDevice::new(&gpu, &p);
    let table = table_with_bad_rank(&gpu, &on, stride);
    let target = whole_table_target(&table, 2, 32);
    let idx = gpu.upload(&[0i32, 1, 9, -1, 0]).unwrap();
    let cpu = Device::cpu();
    let good_only = run_bgmv_on(&cpu, &p, &[0, -1, -1, -1, 0], &p.y_bf16, BgmvTuning::default());
    let mut y = gpu.upload(&p.y_bf16).unwrap();
    bgmv_tuned(
        &gpu,
        on.x_rows(&p),
        &idx,
        &target,
        stride,
        RowsMut::dense(&mut y, n, p.y_width),
        ROW_REGISTERS,
    )
    .unwrap();
    let faults = gpu.take_faults().unwrap();
    assert_eq!(
        faults.0,
        lora_kernels::FaultFlags::BAD_RANK | lora_kernels::FaultFlags::BAD_INDEX,
        "faults: {faults}"
    );
    compare(
        "row registers, bad entry and index",
        &p.y_bf16,
        &good_only,
        &y.download().unwrap(),
    );

    // Refused: another rank stride, in past the limit or not a multiple of 8, a wider target.
    let refused: [(usize, usize, usize); 4] = [
        (32, 64, 32),
        (16, ROWS_MAX_IN + 8, 32),
        (16, 60, 32),
        (16, 64, ROWS_MAX_OUT + 8),
    ];
    for (stride, in_dim, out) in refused {
        let p = Problem::new(&mut rng, 2, in_dim, &[out], stride, &[4], false);
        let on = OnDevice::new(&gpu, &p);
        let idx = gpu.upload(&[0i32, 0]).unwrap();
        let before = p.y_bf16.clone();
        let mut y = gpu.upload(&before).unwrap();
        let err = bgmv_tuned(
            &gpu,
            on.x_rows(&p),
            &idx,
            &on.targets(&p),
            stride,
            RowsMut::dense(&mut y, 2, p.y_width),
            ROW_REGISTERS,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("row_registers"),
            "stride {stride} in {in_dim} out {out}: {err}"
        );
        assert_eq!(y.download().unwrap(), before, "nothing launched");
    }
    let both = BgmvTuning {
        entry_clusters: Some(true),
        ..ROW_REGISTERS
    };
    let mut y = gpu.upload(&p.y_bf16).unwrap();
    let err = bgmv_tuned(
        &gpu,
        on.x_rows(&p),
        &idx,
        &on.targets(&p),
        stride,
        RowsMut::dense(&mut y, n, p.y_width),
        both,
    )
    .unwrap_err();
    assert!(err.to_string().contains("row_registers"), "{err}");

    let overlap = BgmvTuning {
        overlap_previous: Some(true),
        ..ROW_REGISTERS
    };
    for (rows, width, slots) in [(64, 4096, 64), (7, 1024, 3)] {
        check_overlap_chain(
            &gpu,
            &mut rng,
            (rows, width, 16, slots),
            &[FUSED_SCALAR_SCAN, overlap, overlap, FUSED_SCALAR_SCAN, overlap, overlap],
        );
    }
}

/// `wait_first` (the default of the entry-clustered, row-register and
/// two-phase forms: a programmatic dependent whose blocks wait for the
/// previous kernel before any read, and let the next one launch early):
/// chained applies, each reading as x what the one before wrote as y, in
/// every kernel that takes it (the staged, register and spread entry
/// kernels, the row-register one, straight-line and general, the two-phase
/// shrinks with their expands letting the next apply in at their start or
/// before their last stores, the row form's expand reading y before its
/// wait), with and without the weights asked into L2 before the wait, mixed
/// with plain launches (the spread kernel's cooperative), the fused kernel
/// (which does not wait first) and the overlap. Back-to-back spread launches also show that each
/// leaves its inboxes zero: a stale word tagged as a later launch's pass
/// would be summed.
#[test]
fn gpu_bgmv_wait_first_keeps_the_stream_order() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_wait_first_keeps_the_stream_order") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_wait_first_keeps_the_stream_order");
    let plain = |t: BgmvTuning| BgmvTuning {
        wait_first: Some(false),
        ..t
    };
    let overlap = |t: BgmvTuning| BgmvTuning {
        overlap_previous: Some(true),
        ..t
    };
    // The weights asked into L2 before the wait with the next kernel let in
    // late, and not asked for with it let in early (neither the default here).
    let prefetch_late = |t: BgmvTuning| BgmvTuning {
        prefetch_weights: Some(true),
        early_next: Some(false),
        ..t
    };
    let no_prefetch_early = |t: BgmvTuning| BgmvTuning {
        prefetch_weights: Some(false),
        early_next: Some(true),
        ..t
    };
    let (reg, staged, c4) = (ENTRY_REGISTERS, ENTRY_STAGED, ENTRY_C4);
    let early = |t: BgmvTuning| BgmvTuning {
        early_next: Some(true),
        ..t
    };
    let late = |t: BgmvTuning| BgmvTuning {
        early_next: Some(false),
        ..t
    };
    // (n, width, stride, slots): 8 rows an entry at 4096 (the register
    // kernel's default), few rows an entry, rank 64 in clusters of 4.
    let chains: [(ApplyShape, Vec<BgmvTuning>); 7] = [
        (
            (256, 4096, 16, 32),
            vec![
                reg,
                reg,
                staged,
                reg,
                plain(reg),
                reg,
                FUSED_SCALAR_SCAN,
                reg,
                prefetch_late(staged),
                prefetch_late(reg),
                no_prefetch_early(reg),
                reg,
                ENTRY_SPREAD,
                ENTRY_SPREAD,
                plain(ENTRY_SPREAD),
                ENTRY_SPREAD,
                overlap(ENTRY_SPREAD),
                no_prefetch_early(ENTRY_SPREAD),
                reg,
                ENTRY_SPREAD,
            ],
        ),
        (
            (64, 1000, 16, 9),
            vec![staged, staged, plain(staged), overlap(staged), staged, reg, reg],
        ),
        ((48, 2056, 64, 5), vec![c4, c4, FUSED_TC_SCAN, c4, plain(c4), c4]),
        (
            (64, 4096, 16, 64),
            vec![
                ROW_REGISTERS,
                ROW_REGISTERS,
                plain(ROW_REGISTERS),
                ROW_REGISTERS,
                reg,
                ROW_REGISTERS,
            ],
        ),
        (
            (7, 1024, 16, 3),
            vec![ROW_REGISTERS, ROW_REGISTERS, overlap(ROW_REGISTERS), ROW_REGISTERS],
        ),
        (
            (64, 2048, 64, 9),
            vec![
                TWO_PHASE_ROWS,
                TWO_PHASE_ROWS,
                early(TWO_PHASE_ROWS),
                early(TWO_PHASE_ROWS),
                TWO_PHASE_ROWS,
                plain(TWO_PHASE_ROWS),
                early(TWO_PHASE_ROWS_TC),
                c4,
                late(TWO_PHASE),
                early(TWO_PHASE_TC_POW2_DEPENDENT),
                overlap(TWO_PHASE_ROWS),
                TWO_PHASE_ROWS_PLAIN,
                early(TWO_PHASE_ROWS_PLAIN),
                FUSED_TC_SCAN,
                early(TWO_PHASE_ROWS),
                c4,
                TWO_PHASE_ROWS,
            ],
        ),
        (
            (96, 4096, 16, 32),
            vec![
                early(TWO_PHASE_ROWS),
                TWO_PHASE_ROWS,
                reg,
                late(TWO_PHASE_ROWS),
                ROW_REGISTERS,
                early(TWO_PHASE_ROWS),
                ENTRY_SPREAD,
                TWO_PHASE_ROWS,
            ],
        ),
    ];
    for (shape, chain) in chains {
        check_overlap_chain(&gpu, &mut rng, shape, &chain);
    }
}

/// The entry form waiting first asks its entries' weights into L2 before
/// its wait (`prefetch_weights`, the default): here the previous kernel is
/// still writing those weights. A first apply adds its deltas to the
/// second apply's weights buffer, seen as rows of `width` (A rows, B rows
/// and padding alike), and the second apply follows it in the stream with
/// nothing between; it must read the written weights, in the register,
/// staged and spread kernels and in clusters of 4, with the next kernel let
/// in early and late, as the CPU reference does.
#[test]
fn gpu_bgmv_entry_weights_written_by_the_previous_kernel() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_entry_weights_written_by_the_previous_kernel") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_entry_weights_written_by_the_previous_kernel");
    let late = |t: BgmvTuning| BgmvTuning {
        early_next: Some(false),
        ..t
    };
    let early = |t: BgmvTuning| BgmvTuning {
        early_next: Some(true),
        ..t
    };
    // (n, width, stride, slots) of the second apply, and its tunings.
    let cases = [
        (
            (256, 4096, 16, 32),
            vec![
                ENTRY_REGISTERS,
                early(ENTRY_REGISTERS),
                late(ENTRY_STAGED),
                ENTRY_SPREAD,
            ],
        ),
        (
            (64, 1000, 16, 9),
            vec![early(ENTRY_STAGED), late(ENTRY_STAGED), ENTRY_REGISTERS, ENTRY_SPREAD],
        ),
        ((48, 2056, 64, 5), vec![ENTRY_C4, early(ENTRY_C4)]),
    ];
    for ((n, width, stride, slots), tunings) in cases {
        let ranks: Vec<u32> = (0..slots).map(|s| 1 + (s * 7 % stride) as u32).collect();
        let pairs = RandomPairs::new(&mut rng, width, width, stride, &ranks);
        // The weights as rows of `width`: every slot is stride * (width + width) elements.
        let w_rows = pairs.data.len() / width;
        let writer = Problem::new(&mut rng, w_rows, width, &[width], 16, &[16, 5, 9], true);
        let writer_idx = random_idx(&mut rng, w_rows, 3, 7);
        let x = rng.bf16_vec(n * width, 1.0);
        let y = rng.bf16_vec(n * width, 1.0);
        let idx = random_idx(&mut rng, n, slots, 5);
        let run = |dev: &Device, tuning: BgmvTuning| -> Vec<f32> {
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
            let weights_as_rows = RowsMut {
                buf: &mut w,
                offset: 0,
                n_rows: w_rows,
                width,
                stride: width,
            };
            bgmv_tuned(
                dev,
                writer_rows,
                &w_idx,
                &on.targets(&writer),
                16,
                weights_as_rows,
                BgmvTuning::default(),
            )
            .unwrap();
            let targets = [LoraTarget {
                table: &table,
                table_offset: 0,
                n_entries: slots,
                out_dim: width,
                y_col_offset: 0,
            }];
            let rows = Rows {
                buf: &x,
                offset: 0,
                n_rows: n,
                width,
                stride: width,
            };
            let out = RowsMut {
                buf: &mut y,
                offset: 0,
                n_rows: n,
                width,
                stride: width,
            };
            bgmv_tuned(dev, rows, &idx, &targets, stride, out, tuning).unwrap();
            dev.check_faults().unwrap();
            widen(&y.download().unwrap())
        };
        let cpu = run(&Device::cpu(), BgmvTuning::default());
        for t in tunings {
            let g = run(&gpu, t);
            assert!(g.iter().all(|v| v.is_finite()), "n={n} {t:?}: non-finite output");
            let err = rel_error(&g, &cpu);
            assert!(err < TOL, "n={n} width={width} {t:?}: ‖gpu − cpu‖/‖cpu‖ = {err:e}");
        }
    }
}

#[test]
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
    for t in [FUSED_SCALAR_LIST, FUSED_TC_LIST_FLAG] {
        check_bgmv(&gpu, &format!("large table {t:?}"), &p, &idx, t);
    }
}

#[test]
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
        let tunings = [
            BgmvTuning::default(),
            BgmvTuning {
                cluster: Some(1),
                ..FUSED
            },
            BgmvTuning {
                cluster: Some(8),
                out_splits: Some(3),
                clusters_per_window: Some(2),
                ..FUSED
            },
            BgmvTuning {
                cluster: Some(1),
                out_splits: Some(1),
                clusters_per_window: Some(1),
                ..FUSED
            },
            BgmvTuning {
                cluster: Some(1),
                ..FUSED_TC
            },
            BgmvTuning {
                cluster: Some(8),
                out_splits: Some(3),
                clusters_per_window: Some(2),
                ..FUSED_TC
            },
            BgmvTuning {
                cluster: Some(4),
                ..FUSED_SCALAR_SCAN
            },
            // Many items per cluster (rank-0 items among them): the push form's
            // receive buffers and mbarrier phases reused, and the pull form.
            BgmvTuning {
                cluster: Some(8),
                out_splits: Some(3),
                clusters_per_window: Some(2),
                push_sum: Some(false),
                ..FUSED_SCALAR_SCAN
            },
            BgmvTuning {
                cluster: Some(8),
                clusters_per_window: Some(1),
                push_sum: Some(true),
                ..FUSED_SCALAR_SCAN
            },
            BgmvTuning {
                cluster: Some(4),
                clusters_per_window: Some(1),
                push_sum: Some(true),
                ..FUSED_TC_LIST
            },
            BgmvTuning {
                cluster: Some(8),
                out_splits: Some(2),
                clusters_per_window: Some(3),
                push_sum: Some(false),
                ..FUSED_TC_LIST
            },
            FUSED_SCALAR_LIST,
            FUSED_TC_LIST,
            FUSED_SCALAR_LIST_FLAG,
            // Clusters of 2: one block per multiprocessor, B rows unpadded.
            BgmvTuning {
                cluster: Some(2),
                ..FUSED_SCALAR_SCAN
            },
            BgmvTuning {
                cluster: Some(2),
                out_splits: Some(3),
                clusters_per_window: Some(2),
                push_sum: Some(false),
                ..FUSED_SCALAR_SCAN
            },
            BgmvTuning {
                cluster: Some(2),
                clusters_per_window: Some(1),
                push_sum: Some(true),
                ..FUSED_TC_LIST
            },
            BgmvTuning {
                cluster: Some(2),
                ..FUSED_SCALAR_LIST
            },
            // Tensor cores in clusters of 2 (the default where 8-row items
            // surely fill more than a round of clusters of 8), listed and scanning.
            BgmvTuning {
                cluster: Some(2),
                ..FUSED_TC_LIST
            },
            BgmvTuning {
                cluster: Some(2),
                ..FUSED_TC
            },
            // A cluster for every row. The 16-warp clusters of 2 take the
            // row-mapped form there (row q's cluster serves row q alone,
            // requesting its weights as soon as its entry is known; rows of
            // one adapter are not grouped), pushed and pulled. The others
            // scan, most clusters idle.
            FUSED_ROW_MAPPED,
            BgmvTuning {
                push_sum: Some(false),
                ..FUSED_ROW_MAPPED
            },
            BgmvTuning {
                cluster: Some(8),
                clusters_per_window: Some(512),
                ..FUSED_SCALAR_SCAN
            },
            BgmvTuning {
                cluster: Some(8),
                out_splits: Some(3),
                clusters_per_window: Some(512),
                push_sum: Some(false),
                ..FUSED_SCALAR_SCAN
            },
            BgmvTuning {
                cluster: Some(1),
                clusters_per_window: Some(512),
                ..FUSED_SCALAR_SCAN
            },
            // Every item of a window through one cluster: the one-chunk items'
            // copy groups and the push's receive buffers reused many times.
            BgmvTuning {
                cluster: Some(2),
                clusters_per_window: Some(1),
                ..FUSED_SCALAR_SCAN
            },
            BgmvTuning {
                cluster: Some(1),
                clusters_per_window: Some(1),
                ..FUSED_SCALAR_LIST
            },
            BgmvTuning {
                cluster: Some(1),
                ..FUSED_SCALAR_LIST
            },
            BgmvTuning {
                cluster: Some(4),
                ..FUSED_SCALAR_LIST
            },
            BgmvTuning {
                cluster: Some(8),
                out_splits: Some(3),
                clusters_per_window: Some(2),
                ..FUSED_TC_LIST
            },
            BgmvTuning {
                cluster: Some(1),
                out_splits: Some(1),
                clusters_per_window: Some(1),
                ..FUSED_TC_LIST_FLAG
            },
            BgmvTuning {
                expand_cols: Some(64),
                ..TWO_PHASE
            },
            BgmvTuning {
                expand_cols: Some(512),
                ..TWO_PHASE_DEPENDENT
            },
            BgmvTuning {
                pow2_slices: Some(true),
                ..TWO_PHASE
            },
            TWO_PHASE_TC_POW2_DEPENDENT,
            // The row form: units of one row, of its default width, of an
            // odd width past the scanning form's most, and of its most.
            TWO_PHASE_ROWS,
            BgmvTuning {
                expand_cols: Some(1500),
                ..TWO_PHASE_ROWS
            },
            BgmvTuning {
                expand_cols: Some(4096),
                ..TWO_PHASE_ROWS_PLAIN
            },
        ];
        for (label, idx) in &patterns {
            for t in tunings {
                check_bgmv(&gpu, &format!("n={n} {label} {t:?}"), &p, idx, t);
            }
        }
    }
}

#[test]
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
    let c = run_bgmv_on(&cpu, &p, &idx, &p.y_f32, BgmvTuning::default());
    for t in FUSED_FORMS
        .into_iter()
        .chain([TWO_PHASE, TWO_PHASE_ROWS, FUSED_ROW_MAPPED])
    {
        let g = run_bgmv_on(&gpu, &p, &idx, &p.y_f32, t);
        compare(&format!("f32 y {t:?}"), &p.y_f32, &c, &g);
        let dc: Vec<f32> = c.iter().zip(&p.y_f32).map(|(a, b)| a - b).collect();
        let dg: Vec<f32> = g.iter().zip(&p.y_f32).map(|(a, b)| a - b).collect();
        let err = rel_error(&dg, &dc);
        assert!(err < 1e-4, "f32 delta error {err:e} {t:?}");
    }
}

#[test]
fn gpu_bgmv_bad_index_raises_a_fault() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_bad_index_raises_a_fault") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_bad_index_raises_a_fault");
    let p = Problem::new(&mut rng, 4, 64, &[32], 8, &[8, 8], false);
    let on = OnDevice::new(&gpu, &p);
    let idx = gpu.upload(&[0i32, 9, 1, -1]).unwrap();
    let mut y = gpu.upload(&p.y_bf16).unwrap();
    let targets = on.targets(&p);
    for t in FUSED_FORMS
        .into_iter()
        .chain([TWO_PHASE, TWO_PHASE_ROWS, FUSED_ROW_MAPPED])
    {
        bgmv_tuned(
            &gpu,
            on.x_rows(&p),
            &idx,
            &targets,
            8,
            RowsMut::dense(&mut y, 4, p.y_width),
            t,
        )
        .unwrap();
        let faults = gpu.take_faults().unwrap();
        assert!(
            faults.0 & lora_kernels::FaultFlags::BAD_INDEX != 0,
            "faults: {faults} {t:?}"
        );
        assert!(gpu.take_faults().unwrap().is_empty());
    }
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
    }]
}

#[test]
fn gpu_bgmv_bad_entry_raises_a_fault_and_skips_its_rows() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_bad_entry_raises_a_fault_and_skips_its_rows") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_bad_entry_raises_a_fault_and_skips_its_rows");
    let (n, stride) = (4, 8);
    let p = Problem::new(&mut rng, n, 64, &[32], stride, &[8, 8], false);
    let on = OnDevice::new(&gpu, &p);
    // Entry 1 claims a rank above the stride: its rows get no delta, the others theirs.
    let table = table_with_bad_rank(&gpu, &on, stride);
    let target = whole_table_target(&table, 2, 32);
    let idx = gpu.upload(&[0i32, 1, 1, -1]).unwrap();
    let cpu = Device::cpu();
    let good_only = run_bgmv_on(&cpu, &p, &[0, -1, -1, -1], &p.y_bf16, BgmvTuning::default());
    for t in FUSED_FORMS
        .into_iter()
        .chain([TWO_PHASE, TWO_PHASE_ROWS, FUSED_ROW_MAPPED])
    {
        let mut y = gpu.upload(&p.y_bf16).unwrap();
        bgmv_tuned(
            &gpu,
            on.x_rows(&p),
            &idx,
            &target,
            stride,
            RowsMut::dense(&mut y, n, p.y_width),
            t,
        )
        .unwrap();
        let faults = gpu.take_faults().unwrap();
        assert_eq!(faults.0, lora_kernels::FaultFlags::BAD_RANK, "faults: {faults} {t:?}");
        compare(
            &format!("bad entry {t:?}"),
            &p.y_bf16,
            &good_only,
            &y.download().unwrap(),
        );
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
    tuning: SgmvTuning,
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
            sgmv_tuned(dev, on.x_rows(p), &s, &targets, p.stride, yv, &mut ws, tuning).unwrap();
        }
        None => one_adapter(dev, on.x_rows(p), entry, &targets, p.stride, yv, &mut ws).unwrap(),
    }
    dev.check_faults().unwrap();
    y.download().unwrap()
}

/// Launch choices of the segment apply the tests cover: each shrink (the
/// wgmma ones where the device has them, the narrow one, the 64-row one with
/// paired and split staging), each expand (wgmma from y or before it,
/// mma.sync), the
/// dependent and the plain expand launch, early and late dependents, each
/// way of dealing items, one and two y buffers.
fn sgmv_kernels() -> Vec<SgmvTuning> {
    let pick = |narrow, dependent, balanced, paired| SgmvTuning {
        narrow_shrink: Some(narrow),
        dependent_expand: Some(dependent),
        balanced_items: Some(balanced),
        paired_staging: Some(paired),
        ..Default::default()
    };
    let y_buffers = |n| SgmvTuning {
        y_buffers: Some(n),
        ..Default::default()
    };
    let mma_sync = SgmvTuning {
        wgmma_shrink: Some(false),
        wgmma_expand: Some(false),
        ..Default::default()
    };
    // The wgmma expand from y past rank stride 32, where the default starts before y.
    let mma_after_y = SgmvTuning {
        mma_before_y: Some(false),
        ..Default::default()
    };
    let dependents = |early| SgmvTuning {
        early_dependents: Some(early),
        ..Default::default()
    };
    vec![
        SgmvTuning::default(),
        mma_sync,
        mma_after_y,
        dependents(true),
        dependents(false),
        pick(true, false, true, true),
        pick(false, true, false, true),
        pick(false, true, true, false),
        y_buffers(1),
        y_buffers(2),
    ]
}

#[test]
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
        let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, SgmvTuning::default());
        for ks in [None, Some(1), Some(3), Some(8)] {
            for kernels in sgmv_kernels() {
                let tuning = SgmvTuning {
                    k_splits: ks,
                    ..kernels
                };
                let label = format!("sgmv n={n} in={in_dim} outs={outs:?} stride={stride} {tuning:?}");
                let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, tuning);
                compare(&label, &p.y_bf16, &c, &g);
            }
        }
        let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_f32, SgmvTuning::default());
        for tuning in sgmv_kernels() {
            let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_f32, tuning);
            compare(&format!("sgmv f32 y {tuning:?}"), &p.y_f32, &c, &g);
        }
    }
}

#[test]
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
    let c = run_sgmv_on(&cpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, SgmvTuning::default());
    for tuning in sgmv_kernels() {
        let g = run_sgmv_on(&gpu, &p, Some((&cu, &slot)), 0, &p.y_bf16, tuning);
        compare(&format!("sgmv every rank {tuning:?}"), &p.y_bf16, &c, &g);
    }
}

#[test]
fn gpu_one_adapter_matches_cpu() {
    let Some(gpu) = cuda_or_skip("gpu_one_adapter_matches_cpu") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = Rng::fresh("gpu_one_adapter_matches_cpu");
    for &(n, in_dim, out, stride, rank) in &[(777, 4096, 1024, 64, 64), (65, 2049, 300, 16, 5), (3, 8, 8, 8, 1)] {
        let p = Problem::new(&mut rng, n, in_dim, &[out], stride, &[stride as u32, rank], true);
        let c = run_sgmv_on(&cpu, &p, None, 1, &p.y_bf16, SgmvTuning::default());
        let g = run_sgmv_on(&gpu, &p, None, 1, &p.y_bf16, SgmvTuning::default());
        compare(
            &format!("one adapter n={n} in={in_dim} out={out} rank={rank}"),
            &p.y_bf16,
            &c,
            &g,
        );
    }
}

#[test]
fn gpu_graph_replay_follows_table_contents() {
    let Some(gpu) = cuda_or_skip("gpu_graph_replay_follows_table_contents") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_graph_replay_follows_table_contents");
    for t in [BgmvTuning::default()].into_iter().chain(FUSED_FORMS).chain([
        TWO_PHASE_DEPENDENT,
        TWO_PHASE_ROWS,
        FUSED_ROW_MAPPED,
        ROW_REGISTERS,
    ]) {
        graph_replay_case(&gpu, &mut rng, t);
    }
}

/// Capture bgmv (with `tuning`) and sgmv into one graph, change every
/// buffer's contents, replay, and compare with the CPU on the new contents.
fn graph_replay_case(gpu: &Device, rng: &mut Rng, tuning: BgmvTuning) {
    let gpu = gpu.clone();
    let cpu = Device::cpu();
    let (n, slots) = (48, 6);
    let p = Problem::new(rng, n, 1024, &[512], 16, &[16, 8, 4, 16, 2, 1], false);
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
        }];
        gpu.capture_graph(|| {
            let yv = RowsMut::dense(&mut y, n, p.y_width);
            bgmv_tuned(&gpu, on.x_rows(&p), &idx, &target, 16, yv, tuning)?;
            let s = Segments {
                cu_seqlens: &cu,
                seg_slot: &seg_slot,
                n_segments: 4,
            };
            let yv = RowsMut::dense(&mut y, n, p.y_width);
            sgmv_tuned(&gpu, on.x_rows(&p), &s, &target, 16, yv, &mut ws, SgmvTuning::default())
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
    }];
    let mut cy = cpu.upload(&y1).unwrap();
    let cidx = cpu.upload(&idx1).unwrap();
    bgmv_tuned(
        &cpu,
        cpu_on.x_rows(&p),
        &cidx,
        &target,
        16,
        RowsMut::dense(&mut cy, n, p.y_width),
        BgmvTuning::default(),
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
    sgmv_tuned(
        &cpu,
        cpu_on.x_rows(&p),
        &s,
        &target,
        16,
        yv,
        &mut cws,
        SgmvTuning::default(),
    )
    .unwrap();
    compare(
        &format!("graph replay after table change {tuning:?}"),
        &y1,
        &cy.download().unwrap(),
        &g,
    );
}

#[test]
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
/// stride against NaN padding, and weights at every 2-byte alignment.
#[test]
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
        let c = run_bgmv_on(&cpu, &p, &idx, &p.y_bf16, BgmvTuning::default());
        for t in [ENTRY, ENTRY_STAGED, ENTRY_C4] {
            let label = format!("entry n={n} in={in_dim} outs={outs:?} stride={stride} {t:?}");
            let g = run_bgmv_on(&gpu, &p, &idx, &p.y_bf16, t);
            compare(&label, &p.y_bf16, &c, &g);
            // The same sums in the same order: bit-identical when repeated.
            assert_eq!(
                g,
                run_bgmv_on(&gpu, &p, &idx, &p.y_bf16, t),
                "{label}: a repeated apply differs"
            );
        }
        for shift in [1, 2, 4, 7] {
            let g = run_bgmv_shifted(&gpu, &p, &idx, &p.y_bf16, shift, ENTRY);
            compare(
                &format!("entry n={n} stride={stride} weights shifted by {shift}"),
                &p.y_bf16,
                &c,
                &g,
            );
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
        // At stride 16 the register kernel also where it is not the default
        // (2 rows per entry; no row anywhere: every cluster reads its weights
        // for nothing).
        let tunings: &[BgmvTuning] = if stride == 16 {
            &[ENTRY, ENTRY_STAGED, ENTRY_C4, ENTRY_REGISTERS, ENTRY_SPREAD]
        } else {
            &[ENTRY, ENTRY_STAGED, ENTRY_C4]
        };
        for (what, idx) in patterns {
            let c = run_bgmv_on(&cpu, &p, &idx, &p.y_bf16, BgmvTuning::default());
            for &t in tunings {
                let g = run_bgmv_on(&gpu, &p, &idx, &p.y_bf16, t);
                compare(
                    &format!("entry {what} stride={stride} in={in_dim} {t:?}"),
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
/// rows; under the overlap it reads x and y only after the previous kernel.
#[test]
fn gpu_bgmv_entry_clusters_faults_and_overlap() {
    let Some(gpu) = cuda_or_skip("gpu_bgmv_entry_clusters_faults_and_overlap") else {
        return;
    };
    let mut rng = Rng::fresh("gpu_bgmv_entry_clusters_faults_and_overlap");
    let (n, stride) = (6, 16);
    let p = Problem::new(&mut rng, n, 64, &[32], stride, &[8, 16, 4], false).with_aligned_rows(&mut rng);
    let on = OnDevice::new(&gpu, &p);
    let table = table_with_bad_rank(&gpu, &on, stride);
    let target = whole_table_target(&table, 3, 32);
    // Row 1 names entry 1 (bad rank), row 4 an index past the table.
    let idx = gpu.upload(&[0i32, 1, 2, -1, 3, 0]).unwrap();
    let good_only = run_bgmv_on(
        &Device::cpu(),
        &p,
        &[0, -1, 2, -1, -1, 0],
        &p.y_bf16,
        BgmvTuning::default(),
    );
    for t in [ENTRY, ENTRY_STAGED, ENTRY_C4, ENTRY_REGISTERS, ENTRY_SPREAD] {
        let mut y = gpu.upload(&p.y_bf16).unwrap();
        let yv = RowsMut::dense(&mut y, n, p.y_width);
        bgmv_tuned(&gpu, on.x_rows(&p), &idx, &target, stride, yv, t).unwrap();
        let faults = gpu.take_faults().unwrap();
        let want = lora_kernels::FaultFlags::BAD_RANK | lora_kernels::FaultFlags::BAD_INDEX;
        assert_eq!(faults.0, want, "faults: {faults} {t:?}");
        compare(
            &format!("entry faults {t:?}"),
            &p.y_bf16,
            &good_only,
            &y.download().unwrap(),
        );
    }
    // Calls the form cannot serve are refused, not approximated.
    let unaligned = Problem::new(&mut rng, 8, 64, &[32], stride, &[8], false);
    let on = OnDevice::new(&gpu, &unaligned);
    let idx = gpu.upload(&[0i32; 8]).unwrap();
    let mut y = gpu.upload(&unaligned.y_bf16).unwrap();
    let yv = RowsMut::dense(&mut y, 8, unaligned.y_width);
    let err = bgmv_tuned(
        &gpu,
        on.x_rows(&unaligned),
        &idx,
        &on.targets(&unaligned),
        stride,
        yv,
        ENTRY,
    )
    .unwrap_err();
    assert!(err.to_string().contains("entry_clusters"), "{err}");

    let overlap = BgmvTuning {
        overlap_previous: Some(true),
        ..ENTRY
    };
    for shape in [(256, 1024, 16, 32), (40, 520, 64, 6)] {
        check_overlap_chain(
            &gpu,
            &mut rng,
            shape,
            &[FUSED_SCALAR_SCAN, overlap, overlap, TWO_PHASE, overlap],
        );
    }
}
