//! Row-indexed LoRA apply (BGMV): decode batches of mixed slots, and the
//! routed-expert gather. Every row names a table entry (`idx[row]`, -1 = no
//! delta) and, for every target,
//! `y[row, col_off .. col_off + out] += e.scale * B_e (A_e x[row])`.
//!
//! Dense decode passes `idx = seq_slot` into a `[max_loras]` table; MoE
//! passes `idx = expert * max_loras + slot` into a `[num_experts * max_loras]`
//! table. CUDA kernel family: `cuda/bgmv.cu`, the entry-clustered form's
//! `cuda/bgmv_entry.cu` (module `entry`) and the row-register form's
//! `cuda/bgmv_rows.cu` (module `rows`), compiled with it.

use half::bf16;

use super::pairs::reference_apply;
use super::{LoraTarget, MAX_TARGETS, OutputElem, Rows, RowsMut, TargetParams, check_targets, to_i32, to_u32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{CudaBackend, Family, Kernel, Launch, Predecessor, SCRATCH_BYTES};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};
use crate::ops::limits::DeviceLimits;
use plan::{CallTarget, Chain, DecodeCall, DecodeContext, DecodeForm, DecodePlan, FusedForm, ItemList, TwoPhaseForm};

mod entry;
pub mod plan;
mod rows;
pub use entry::{ENTRY_MAX_ROWS, ENTRY_REGISTERS_MAX_DIM, ENTRY_REGISTERS_MAX_ROWS, ENTRY_REGISTERS_ROWS_PER_ENTRY};
pub use rows::{ROWS_MAX_IN, ROWS_MAX_OUT, ROWS_STRIDE};

/// Largest rank stride bgmv serves (the rank vectors live in shared memory).
pub const BGMV_MAX_RANK: usize = 256;
/// Rows grouped together at most (one window); larger batches use windows
/// of this many rows with the item list, else of [`WINDOW_LARGE`] (`row_windows`).
const WINDOW_MAX: usize = 512;
const WINDOW_LARGE: usize = 256;
const THREADS: u32 = 256;

/// Threads per block of the fused kernel: the scalar clusters of 2 run 16
/// warps (`BGMV_KERNEL_CL` in `cuda/bgmv.cu`), the others eight.
fn fused_threads(cluster: usize, tensor_cores: bool) -> u32 {
    if cluster == 2 && !tensor_cores {
        2 * THREADS
    } else {
        THREADS
    }
}

/// Rows per item (`BGMV_G` in the kernel).
const ITEM_ROWS: usize = 8;

/// Length of the largest piece of `[0, n)` cut in `parts`, each piece a multiple of 8 (`split8` in the kernel).
fn piece8(n: usize, parts: usize) -> usize {
    n.div_ceil(parts.max(1)).div_ceil(8) * 8
}

fn round16(v: usize) -> usize {
    v.div_ceil(16) * 16
}

/// Pitch (elements) of a staged A or x row of a `k_chunk`-column chunk: 8
/// more than the chunk, so ldmatrix rows fall in distinct banks.
fn stage_pitch(k_chunk: usize) -> usize {
    k_chunk + 8
}

/// What the shared-memory plan depends on.
#[derive(Debug, Clone, Copy)]
struct PlanShape {
    in_dim: usize,
    max_out: usize,
    stride: usize,
    y_size: usize,
    cluster: usize,
    /// The cluster sum pushes partials into receive slots (`off_r`).
    push: bool,
    /// The tensor-core shrink's per-warp tiles follow the rank vectors.
    tensor_cores: bool,
    /// The row-mapped form may hold B in registers (`BgmvTuning::expand_b_registers`):
    /// where the plan is one chunk of at most [`B_REGISTERS_MAX_OUTS`] outputs, B is
    /// not staged and every item is one row.
    b_registers: bool,
}

/// Most outputs per block of the row-mapped form with B in registers
/// (`BGMV_REG_B_OUTS` in `cuda/bgmv.cu`: 8 warps of 16 tiles of 16).
const B_REGISTERS_MAX_OUTS: usize = 2048;

/// The kernel's dynamic shared memory layout for one launch (see `cuda/bgmv.cu`):
/// B rows and y values of the block's outputs, the rank vectors, one or
/// two stages of A and x chunks, then (push form) the cluster sum's two
/// receive buffers of `cluster` slots of `[G][stride8]` f32. The output
/// piece is a multiple of 16 and an A stage holds the stride rounded up to
/// 16 rows, so the tensor-core kernels' 16-row tiles stay inside the allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SmemPlan {
    splits: usize,
    k_chunk: usize,
    lo_max: usize,
    /// Staged B row pitch, elements.
    b_pitch: usize,
    off_y: usize,
    off_t: usize,
    off_a: usize,
    off_x: usize,
    off_r: usize,
    total: usize,
    /// B in registers (`p.b_registers`): the B region holds the expand's
    /// `lo_max` f32 instead, and y and x one row each.
    b_registers: bool,
}

impl SmemPlan {
    /// Up to the first, three blocks fit on a multiprocessor; up to the second, two.
    const BUDGETS: [usize; 2] = [70 * 1024, 104 * 1024];

    fn layout(shape: PlanShape, splits: usize, k_chunk: usize, stages: usize) -> SmemPlan {
        let PlanShape {
            max_out,
            stride,
            y_size,
            cluster,
            push,
            tensor_cores,
            ..
        } = shape;
        let lo_max = round16(piece8(piece8(max_out, splits), cluster));
        // B rows: the stride rounded to 8 columns, plus 8 against bank
        // conflicts, except in clusters of 2, whose blocks stage half of B
        // (at rank 16 and 4096 outputs the padding would not fit beside A).
        let b_pitch = stride.div_ceil(8) * 8 + if cluster == 2 { 0 } else { 8 };
        let b_registers = shape.b_registers
            && stages == 1
            && k_chunk >= piece8(shape.in_dim, cluster)
            && lo_max <= B_REGISTERS_MAX_OUTS;
        let (b_bytes, item_rows) = if b_registers {
            (lo_max * 4, 1)
        } else {
            (lo_max * b_pitch * 2, ITEM_ROWS)
        };
        let off_y = round16(b_bytes);
        let off_t = off_y + round16(item_rows * lo_max * y_size);
        // sTp and sT [G][stride8] f32, then (TC) the shrink's per-warp tiles [warps][128] f32.
        let red = if tensor_cores {
            (THREADS as usize / 32) * 128 * 4
        } else {
            0
        };
        let off_a = off_t + 2 * ITEM_ROWS * stride.div_ceil(8) * 8 * 4 + red;
        let off_x = off_a + round16(stages * round16(stride) * stage_pitch(k_chunk) * 2);
        let off_r = off_x + round16(stages * item_rows * stage_pitch(k_chunk) * 2);
        let total = off_r + if push { push_recv_bytes(cluster, stride) } else { 0 };
        SmemPlan {
            splits,
            k_chunk,
            lo_max,
            b_pitch,
            off_y,
            off_t,
            off_a,
            off_x,
            off_r,
            total,
            b_registers,
        }
    }

    /// The plan for a launch: the fewest output splits (from `splits0`) whose
    /// whole A and x slices fit a budget in one chunk; else A and x in two
    /// stages of chunks of at least 128 columns; else one chunk in whatever
    /// shared memory it takes (the caller checks the device's limit).
    fn choose(shape: PlanShape, splits0: usize, fixed_splits: bool) -> SmemPlan {
        // A multiple of 8: the kernel pads every staged row to whole 16-byte chunks.
        let slice = piece8(shape.in_dim, shape.cluster);
        let options: Vec<usize> = if fixed_splits {
            vec![splits0]
        } else {
            (0..4).map(|i| splits0 << i).collect()
        };
        for budget in Self::BUDGETS {
            for &s in &options {
                let p = Self::layout(shape, s, slice, 1);
                if p.total <= budget {
                    return p;
                }
            }
        }
        for &s in &options {
            let fixed = Self::layout(shape, s, 0, 2).total;
            let room = Self::BUDGETS[1].saturating_sub(fixed);
            let k_chunk = (room / (2 * (round16(shape.stride) + ITEM_ROWS) * 2)).saturating_sub(8) / 8 * 8;
            if k_chunk >= 128 {
                return Self::layout(shape, s, k_chunk.min(slice), 2);
            }
        }
        Self::layout(shape, splits0, slice, 1)
    }
}

/// Static shared memory of the scanning kernels (row window, items, a small
/// table) and of the `_list` ones (an item), bytes.
const STATIC_SMEM: usize = 7 * 1024 + 256;
const LIST_STATIC_SMEM: usize = 256;

/// Bytes of the push form's receive buffers: two of `cluster` slots of `[G][stride8]` f32.
fn push_recv_bytes(cluster: usize, stride: usize) -> usize {
    2 * cluster * ITEM_ROWS * stride.div_ceil(8) * 8 * 4
}

/// Rank strides up to which clusters sum by pushing by default: the receive
/// buffers (`push_recv_bytes`, 8 KB at 16 with clusters of 8) then cost
/// little shared memory.
pub const PUSH_SUM_MAX_STRIDE: usize = 32;
/// Blocks per multiprocessor the kernel's register use allows (`__launch_bounds__(256, 3)`;
/// the 512-thread scalar clusters of 2, `__launch_bounds__(512, 1)`, one).
const REG_BLOCKS_PER_SM: usize = 3;
/// The same for the tensor-core cluster kernels (`__launch_bounds__(256, 4)`).
const TC_BLOCKS_PER_SM: usize = 4;

/// What of the call the launch choice depends on (besides the targets).
#[derive(Debug, Clone, Copy)]
struct RowShape {
    in_dim: usize,
    stride: usize,
    y_size: usize,
    window: usize,
    n_windows: usize,
    /// The tensor-core kernels (more blocks per multiprocessor with clusters).
    tensor_cores: bool,
    /// The `_list` kernels (items from `bgmv_list`: little static shared memory).
    list: bool,
}

impl RowShape {
    /// Static shared memory of the kernel form, bytes.
    fn static_smem(&self) -> usize {
        if self.list { LIST_STATIC_SMEM } else { STATIC_SMEM }
    }

    /// Blocks per multiprocessor the kernel's registers allow.
    fn reg_blocks(&self, cluster: usize) -> usize {
        if self.tensor_cores && cluster > 1 {
            TC_BLOCKS_PER_SM
        } else if fused_threads(cluster, self.tensor_cores) > THREADS {
            1
        } else {
            REG_BLOCKS_PER_SM
        }
    }
}

/// The launch shape of one call: cluster size, clusters per window and the shared-memory plan.
#[derive(Debug, Clone, Copy)]
struct LaunchChoice {
    cluster: usize,
    cpw: usize,
    /// Rounds of resident clusters the launch needs for the most items its windows can hold.
    rounds: usize,
    plan: SmemPlan,
    /// The cluster sum pushes partials (st.async) instead of a barrier and peer loads.
    push: bool,
    /// B in registers was asked for (`PlanShape::b_registers`; `plan.b_registers` says whether it fits).
    requested_b_registers: bool,
}

impl LaunchChoice {
    /// Pick the cluster size and output splits that need the fewest rounds of
    /// latency: every block resident at once (clusters per window sized to
    /// the device), few items per cluster, few A chunks, few splits (each
    /// split re-reads A). Decode is latency-bound: a round costs the chain
    /// idx -> table entry -> weights, whatever its bytes.
    fn pick(
        limits: &DeviceLimits,
        rows: RowShape,
        targets: &[CallTarget],
        tuning: BgmvTuning,
    ) -> Result<LaunchChoice, KernelError> {
        let hopper = limits.hopper();
        let sms = limits.multiprocessors;
        let smem_optin = limits.smem_optin;
        let smem_per_sm = limits.smem_per_sm;
        let RowShape {
            in_dim,
            stride,
            y_size,
            window,
            n_windows,
            ..
        } = rows;
        let clusters: Vec<usize> = match tuning.cluster {
            Some(8 | 4 | 2) if !hopper => return Err(invalid("tuning.cluster", "clusters need sm_90 or newer")),
            Some(v) => vec![v as usize],
            // Clusters of 4 are kept for tuning; on the H200 they never beat 8
            // (NOTES.md). Clusters of 2 (one block per multiprocessor) win
            // where items outnumber the resident clusters of 8: each of their
            // blocks does four times the work, but in fewer rounds. On tensor
            // cores only where the rows alone make more items than a round
            // of clusters of 8 holds (below).
            None if hopper => vec![8, 2],
            None => vec![1],
        };
        // The fewest items the window's rows can make (at most ITEM_ROWS rows
        // each), whatever the table: the real count is known only on the device.
        let min_items = window.div_ceil(ITEM_ROWS);
        let min_out = targets.iter().map(|t| t.out_dim).min().unwrap_or(0);
        let max_out = targets.iter().map(|t| t.out_dim).max().unwrap_or(0);
        let n_targets = targets.len();
        let items = window_items_bound(window, targets.iter().map(|t| t.n_entries).max().unwrap_or(0));
        let mut best: Option<(f64, LaunchChoice)> = None;
        // The push sum where asked for; by default tried first up to
        // PUSH_SUM_MAX_STRIDE, and kept wherever its receive buffers cost no
        // resident block (a tie otherwise goes to it), else the pull.
        let push_options: &[bool] = match tuning.push_sum {
            Some(true) => &[true],
            Some(false) => &[false],
            None if stride <= PUSH_SUM_MAX_STRIDE => &[true, false],
            None => &[false],
        };
        let pairs = clusters.iter().flat_map(|&cl| {
            // One block per item has no cluster sum.
            let options: &[bool] = if cl > 1 { push_options } else { &[false] };
            options.iter().map(move |&push| (cl, push))
        });
        for (cl, push) in pairs {
            // Tensor cores in pairs only where clusters of 8 surely take more
            // than one round (H200, in a graph: n = 512 of 64 adapters 23.8 ->
            // 20.9 µs, n = 1024 41.5 -> 36.6). Where one round may do, the
            // pairs' four times the work per block loses (n = 256 of 32
            // adapters: 13.8 against 18.4), and their bound on the items
            // counts every table entry, not the ones the rows name.
            if cl == 2
                && rows.tensor_cores
                && tuning.cluster.is_none()
                && best.as_ref().is_none_or(|(_, b)| min_items <= b.cpw)
            {
                continue;
            }
            // The row-mapped form (the kernel's `row_mapped`: 16-warp scanning
            // clusters of 2 with a cluster for every row of the window) may
            // hold B in registers where its rank vectors are pushed.
            let row_mapped = cl == 2
                && !rows.tensor_cores
                && !rows.list
                && !tuning.overlap_previous.unwrap_or(false)
                && tuning.clusters_per_window.is_some_and(|v| v as usize >= window);
            let shape = PlanShape {
                in_dim,
                max_out,
                stride,
                y_size,
                cluster: cl,
                push,
                tensor_cores: rows.tensor_cores,
                b_registers: row_mapped && push && stride == 16 && tuning.expand_b_registers == Some(true),
            };
            let slice = piece8(in_dim, cl);
            let split_options: Vec<usize> = match tuning.out_splits {
                Some(v) => vec![(v as usize).max(1)],
                None => (1..=(min_out / (cl * 64)).clamp(1, 16)).collect(),
            };
            for s in split_options {
                let plan = SmemPlan::choose(shape, s, true);
                if plan.total > smem_optin {
                    continue;
                }
                let bps = rows
                    .reg_blocks(cl)
                    .min(smem_per_sm / (plan.total + rows.static_smem() + 1024));
                if bps == 0 {
                    continue;
                }
                // Clusters must fit whole in a GPC, so fewer are resident than
                // blocks allow (ncu on the H200: 45 active clusters of 8 where
                // 132 x 3 blocks would give 49); a cluster past that waits for a
                // second wave, so a window gets at most 7/8 of the block count.
                // Pairs fit every GPC (the occupancy query: 66 clusters of 2 at
                // one block per multiprocessor).
                let capacity = if cl > 2 { sms * bps * 7 / 8 } else { sms * bps };
                let per_cluster_row = cl * s * n_targets * n_windows;
                let cpw = match tuning.clusters_per_window {
                    Some(v) => (v as usize).clamp(1, window),
                    None => items.min((capacity / per_cluster_row).max(1)),
                };
                let rounds = items.div_ceil(cpw) * (per_cluster_row * cpw).div_ceil(capacity);
                let chunks = slice.div_ceil(plan.k_chunk.max(1));
                // Ties go to more resident blocks (latency overlaps), then to one
                // split, or two for a batch of one or two rows (measured on the H200:
                // 9.0 against 9.5-9.9 µs at n = 1; one split wins from n = 16 on).
                let preferred = if window * n_windows <= 2 { 2.0 } else { 1.0 };
                let cost = rounds as f64 * (3.0 + chunks as f64) - 0.1 * bps as f64
                    + 0.05 * (s as f64 - preferred).abs()
                    + if push { 0.0 } else { 0.001 };
                if best.as_ref().is_none_or(|(b, _)| cost < *b) {
                    best = Some((
                        cost,
                        LaunchChoice {
                            cluster: cl,
                            cpw,
                            rounds,
                            plan,
                            push,
                            requested_b_registers: shape.b_registers,
                        },
                    ));
                }
            }
        }
        best.map(|(_, choice)| choice).ok_or_else(|| {
            invalid(
                "rank_stride",
                format!("{stride} with in {in_dim} does not fit the kernel's shared memory"),
            )
        })
    }
}

/// The most items a window of `window` rows can hold over a table of
/// `entries` entries: an entry's `r` rows make `ceil(r / 8)` items, so the
/// at most `min(entries, window)` entries with rows make at most
/// `(window + 7 · min(entries, window)) / 8` (and never more than the rows).
fn window_items_bound(window: usize, entries: usize) -> usize {
    let used = entries.min(window);
    (window.saturating_add(7 * used) / ITEM_ROWS).clamp(1, window.max(1))
}

/// Launch knobs of [`bgmv_tuned`]; `None` picks from the shape and device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BgmvTuning {
    /// Blocks per cluster sharing one item's shrink: 8, 4 or 2 (sm_90 and newer) or 1.
    pub cluster: Option<u32>,
    /// Output splits: clusters serving one item, each a slice of the outputs.
    pub out_splits: Option<u32>,
    /// Clusters per row window (items are dealt round-robin to them). As
    /// many as the window's rows make the scalar clusters of 2 row-mapped:
    /// each cluster serves its own row alone, as soon as its entry is known,
    /// and no window is scanned. `None`: from the shape and device, row-mapped for
    /// [`ROW_MAPPED_MIN_ROWS`] rows or more that fit one round when this
    /// knob, `cluster`, `out_splits`, `two_phase`, `tensor_cores` and
    /// `item_list_pass` are all unset and `overlap_previous` is off, where
    /// the row-register form (`row_registers`) does not take the call.
    pub clusters_per_window: Option<u32>,
    /// Two launches (a shrink into the device's scratch, then an expand)
    /// instead of the fused kernel; batches of at most 512 rows. `None`:
    /// two launches for [`TWO_PHASE_ROWS`] rows, except batches the fused
    /// launch serves in one round of resident clusters, batches of more
    /// than [`MULTI_ROW_ITEMS`] rows per table entry and batches of up to
    /// 64 rows of adapters of rank stride 16 or less and at most 8192
    /// outputs; never for the row-mapped batches (`clusters_per_window`).
    pub two_phase: Option<bool>,
    /// Two-phase expand: outputs per unit of work (8..=1024, or 8..=4096 in
    /// the row form; rounded up to a multiple of 8). `None`: the row form
    /// cuts each row's outputs into equal chunks, as many as give every
    /// (row, target) the same share of the expand's resident blocks
    /// (256..=4096 outputs; H200, n = 64 of one target: 14336 outputs in 8
    /// chunks of 1792, 20.4 against 22.4 µs in a graph with 14 of 1024, where
    /// some blocks took two); the scanning form takes 512, or 1024 for
    /// outputs wider than 8192.
    pub expand_cols: Option<u32>,
    /// Two-phase shrink: round the K slice count down to a power of two, so
    /// every slice is whole 256-column warp passes when `in` is a multiple of
    /// 4096 (no idle warps or lanes). `None`: on (measured faster at every
    /// two-phase shape: 19.8 / 42.1 / 31.1 against 20.4 / 44.8 / 31.7 µs).
    pub pow2_slices: Option<bool>,
    /// Two-phase: launch the expand as a programmatic dependent of the
    /// shrink, so its blocks get resident while the shrink drains. `None`:
    /// on (n = 64 on the H200, in a graph: rank 64 28.20 -> 27.90 µs, 14336
    /// outputs 24.80 -> 24.55).
    pub dependent_launch: Option<bool>,
    /// Two-phase shrink on tensor cores: one matrix instruction per 16 rank
    /// rows x 16 columns x the item's rows (up to 8), instead of per-lane
    /// unpacking, multiply-adds and warp exchanges for every 2 rows. `None`:
    /// off (items of one row, where two launches serve by default, measured
    /// the same either way; n = 256 of 32 adapters, forced to two launches:
    /// 24.1 against 27.6 µs in a graph on the H200).
    pub shrink_tensor_cores: Option<bool>,
    /// Two launches, every row an item of its own (the row form): the
    /// shrink scans no window and writes no item descriptors, and the expand
    /// reads each row's entry from the indices and tables, so a block's first
    /// B rows (and, unless under `overlap_previous`, y values) are requested
    /// before it waits for the shrink. Rows of one adapter each read its A
    /// and B (from L2 after the first). Off: the scanning form, whose shrink
    /// lists items of up to 8 rows of one entry for the expand. `None`: on
    /// (H200, in a graph, row form against scanning form: n = 64, rank 64
    /// 26.1 against 26.8 µs, 14336 outputs 22.5 against 23.1; under the
    /// overlap 24.3 against 25.0 and 21.3 against 21.2; n = 128 of 16
    /// adapters forced to two launches, under the overlap, 15.0 against 22.3).
    pub two_phase_row_items: Option<bool>,
    /// Fused kernel: shrink and expand on tensor cores (items of several
    /// rows cost one matrix instruction per 8 columns instead of a warp
    /// reduction per row). `None`: on for batches of at least
    /// [`TENSOR_CORE_MIN_ROWS`] rows, and of [`TWO_PHASE_ROWS`] rows of more
    /// than [`MULTI_ROW_ITEMS`] rows per table entry, except the row-mapped
    /// batches (`clusters_per_window`).
    pub tensor_cores: Option<bool>,
    /// Fused kernel: a small first launch (`bgmv_list`) lists each window's
    /// items (rows and checked table entry) once into the device's scratch,
    /// and the fused kernel, launched as its programmatic dependent, reads
    /// its items from there instead of every block scanning the window.
    /// Used when the lists fit the device's launch scratch and every
    /// table has at most [`ITEM_LIST_MAX_ENTRIES`] entries; else the
    /// scanning form. `None`: where `tensor_cores` is on by default
    /// ([`ITEM_LIST_ROWS`], and few adapters for [`TWO_PHASE_ROWS`] rows),
    /// except under `overlap_previous` for batches of up to 256 rows.
    pub item_list_pass: Option<bool>,
    /// With the item list: the fused blocks poll a ready flag the first
    /// launch releases once its list is written, instead of waiting for
    /// that launch's completion (`griddepcontrol.wait`). `None`: off
    /// (measured slower: 17.7 against 17.3 µs at n = 256, 19.6 against
    /// 19.4 at n = 64).
    pub list_ready_flag: Option<bool>,
    /// Fused kernel in clusters: each block pushes its partial rank vectors
    /// into every peer's shared memory (`st.async`, counted on the peer's
    /// mbarrier) and waits on its own, instead of a cluster barrier, peer
    /// loads and a second barrier per item. Costs receive buffers of
    /// `2 · cluster · 8 · stride` f32. `None`: on up to
    /// [`PUSH_SUM_MAX_STRIDE`] where those cost no resident block.
    pub push_sum: Option<bool>,
    /// Launch the apply's first kernel as a programmatic dependent of the
    /// stream's previous kernel, so what depends only on the row indices,
    /// the tables and the adapters is read while that kernel finishes; x, y
    /// and the device's scratch are touched only after it completed
    /// (`griddepcontrol.wait`). The fused kernel's scanning form reads idx,
    /// the table entries and its first item's A and B early; `bgmv_list`
    /// and the two-phase shrink idx and the table. The apply's last kernel
    /// lets the next kernel start early the same way.
    ///
    /// Only correct when the previous kernel writes neither `idx`, the
    /// pair tables nor the adapter weights they point at (in an engine:
    /// the apply follows the base projection, which writes y). Off by default.
    pub overlap_previous: Option<bool>,
    /// The entry-clustered form (`cuda/bgmv_entry.cu`): one launch, a
    /// cluster of blocks (8, or 4 with `cluster: Some(4)`) per table entry
    /// serving all of the entry's rows, on tensor cores with fragments
    /// loaded straight from global memory; no window scan or item list.
    /// Serves bf16 y, rank strides 16, 32 and 64, at most
    /// [`ENTRY_MAX_ROWS`] rows, rows 16-byte aligned (`Some(true)` on
    /// another call is an error). `None`: on where the call suits it, no
    /// knob of another form is set, and either the batch has
    /// [`ENTRY_MIN_ROWS`] rows or more with at least
    /// [`ENTRY_MIN_ROWS_PER_ENTRY`] per table entry, or (rank stride 16,
    /// at most [`ENTRY_ONE_ROUND_MAX_OUT`] outputs, not under the overlap)
    /// every entry's cluster of 8 is resident at once.
    pub entry_clusters: Option<bool>,
    /// The row-mapped form (`clusters_per_window`) at rank stride 16, its
    /// rank vectors pushed, A and x in one chunk and at most 2048 outputs
    /// per block: warps 8-15 load the block's B rows straight into
    /// registers (64 a lane) as soon as A is requested, and expand on tensor
    /// cores once the rank vector is summed, instead of staging B in shared
    /// memory for a scalar expand by all 16 warps. The block's shared
    /// memory then holds no B (and y and x one row each). `None`: off
    /// (H200, in a graph, against the staged form in the same call: n = 64
    /// of 64 rank-16 adapters 9.36 against 8.89 µs; 8 adapters named in a
    /// 64-entry table 7.17 against 7.96, 32 of 64 7.97 against 8.02;
    /// NOTES.md v28).
    pub expand_b_registers: Option<bool>,
    /// The row-register form (`cuda/bgmv_rows.cu`): one launch, a cluster
    /// of 2 blocks of 512 threads per (row, target), each loading its half
    /// of the row's A slice, x, B rows and y values straight into registers
    /// (8 loads of A and 8 of B in flight a thread) as soon as the row's
    /// entry is known, the pair's partial rank vectors pushed to each other.
    /// Serves rank stride [`ROWS_STRIDE`], `in` a multiple of 8 up to
    /// [`ROWS_MAX_IN`], targets of up to [`ROWS_MAX_OUT`] outputs, on sm_90
    /// or newer (`Some(true)` on another call, or with `entry_clusters`, is
    /// an error). In 4096 x 4096 calls with aligned x and y rows it runs its
    /// straight-line kernels (`_full`) for rank-16 entries with aligned
    /// weights. `None`: from the shape and device: the form for
    /// [`ROW_REGISTER_ROWS`] rows, at most [`ROW_REGISTER_ROWS_PER_ENTRY`]
    /// per entry of the largest table, in calls its straight-line kernels
    /// serve (`in` and every target [`ROWS_MAX_IN`] wide, x and y rows
    /// aligned), no other knob set and `overlap_previous` off (measured
    /// there: [`ROW_REGISTER_ROWS`]); the general kernel alone ran n = 64
    /// of 64 slower than the row-mapped form (9.07 against 8.84 µs, NOTES.md
    /// v29), so other shapes keep their form. Slower at n = 1 (5.26 against
    /// 4.56 µs) and with many rows per adapter (n = 256 of 32: 21.30
    /// against 8.73), where the entry-clustered form shares each adapter's
    /// bytes (NOTES.md v29-v30).
    pub row_registers: Option<bool>,
    /// The entry-clustered form's register kernel (`bge_reg_body` in
    /// `cuda/bgmv_entry.cu`): at rank stride 16 in clusters of 8, each block
    /// requests its A slice and B rows into registers as soon as its entry
    /// is known (before the row indices arrive, so also where no row names
    /// the entry), keeps them for every pass, and loads each pass's x and y
    /// into registers before its first mma; nothing is staged in shared
    /// memory. Serves calls of at most [`ENTRY_REGISTERS_MAX_ROWS`] rows with
    /// `in` and every target at most [`ENTRY_REGISTERS_MAX_DIM`] wide
    /// (`Some(true)` on another call, or with the entry form off, is an
    /// error). `None`: on where the entry-clustered form runs a call it
    /// serves with at least [`ENTRY_REGISTERS_ROWS_PER_ENTRY`] rows per
    /// entry of the largest table (H200, in a graph, n = 256 of 32 rank-16
    /// adapters: 7.40 against 8.39 µs, NOTES.md v33).
    pub entry_registers: Option<bool>,
    /// The entry-clustered and row-register forms (`entry_clusters`,
    /// `row_registers`) and the two-phase shrink (`two_phase`) on sm_90 and
    /// newer: launched as a programmatic dependent of the stream's previous
    /// kernel whose blocks wait for it before they read anything, so they
    /// run in a plain launch's order but are resident, their launch done,
    /// when that kernel ends; each then lets the next kernel launch early
    /// the same way (`griddepcontrol.launch_dependents`: a kernel launched
    /// so must wait before it reads what this one writes, as every such
    /// kernel does): as soon as its blocks waited where they are at most one
    /// a multiprocessor (the row-register form always), else once their
    /// work is out (the two-phase expand: before its blocks' last stores).
    /// Unlike `overlap_previous`, correct whatever the previous kernel
    /// writes; that knob, when on, takes its place. `None`: on (H200, in a
    /// graph of back-to-back applies, against plain launches: n = 1 4.15
    /// against 4.54 µs, n = 64 of 64 rank-16 adapters 7.53 against 7.90, n
    /// = 256 of 32 7.12 against 7.41, NOTES.md v34; two-phase, n = 64 of 64:
    /// 14336 outputs 16.98 against 17.30, rank 64 21.86 against 22.23,
    /// NOTES.md v36), except where
    /// the call is captured with no kernel before it in the graph (its root
    /// node, or after a copy or memset, as the driver's capture state says):
    /// nothing overlaps its start there, and the weight prefetch and spread
    /// kernel that waiting first brings by default only cost time (NOTES.md v36).
    pub wait_first: Option<bool>,
    /// Where the entry-clustered form waits first (`wait_first`): each block
    /// asks L2 for its slice of its entry's A and B before it waits
    /// (`cp.async.bulk.prefetch.L2`), so DRAM streams them while the
    /// previous kernel ends. Read before that kernel completed, the entry may
    /// be stale; a prefetch returns nothing to the block, so at worst it warms
    /// L2 with bytes the block then does not read. Rank stride 16 only.
    /// `None`: where the launch's blocks are at most one a multiprocessor
    /// (and in the spread kernel), letting the next kernel in early with it
    /// (H200, in a graph: n = 16 of 16 4.88 against 5.41 µs, n = 64 of 8
    /// 4.12 against 4.41; where blocks share multiprocessors it lost: n = 256
    /// of 32 7.45 against 7.21, n = 64 of 24 6.40 against 6.03; NOTES.md v35).
    pub prefetch_weights: Option<bool>,
    /// Where the entry-clustered form or the two-phase launches wait first:
    /// whether the launch lets the next kernel in as soon as its blocks
    /// waited (the two-phase expand: at its start; `Some(true)`) or once
    /// their work is out (`Some(false)`). `None`: in the entry-clustered
    /// form early where its blocks are at most one a multiprocessor at rank
    /// strides up to 32, or where they prefetch their weights, else late;
    /// in the two-phase launches late (H200, in a graph, n = 64 of 64:
    /// 14336 outputs 16.99 against 17.02 µs early, rank 64 21.89 against
    /// 21.98; NOTES.md v36).
    pub early_next: Option<bool>,
    /// The entry-clustered form's spread kernel (rank stride 16, at most 256
    /// rows, `in` and outputs up to 4096, 4 blocks per table entry and target
    /// all resident at once, one a multiprocessor): no clusters, each
    /// entry's 4 blocks exchanging their partial rank vectors through
    /// global memory, so a batch of 32 entries takes 128 multiprocessors
    /// evenly where the register kernel's clusters of 8 leave 16 of them
    /// three blocks. Launched waiting first (on sm_90) with the next kernel
    /// let in at once and the weights asked into L2 before the wait, or
    /// cooperatively. `Some(true)` where it cannot serve is an error. `None`:
    /// where the other kernels' clusters of 8 would be more than one block a
    /// multiprocessor, waiting first (H200, in a graph: n = 256 of 32
    /// rank-16 adapters 6.89 against 7.24 µs, n = 64 of 24 5.63 against
    /// 6.07; NOTES.md v35). Its blocks wait for one another: waiting first,
    /// its launch is not cooperative, so a kernel of another stream that
    /// holds multiprocessors while it spins on this stream's results could
    /// keep some of its blocks from starting; turn it off beside such kernels.
    pub entry_spread: Option<bool>,
}

/// Batch sizes for which the fused kernel reads a first launch's item list
/// by default: where items hold several rows, so every block's own window
/// scan is long (H200, n = 256 of 32 adapters: 17.3 against 19.4 µs on
/// tensor cores, 25.3 against 26.8 scalar), and past one window, where the
/// list also lets windows hold 512 rows instead of 256, so each window reads
/// its adapters once for twice the rows (n = 1024 of 64 adapters: 45.5
/// against 77.6 µs; 70.9 with the list and 256-row windows). With fewer rows
/// the list's second launch costs more than the scan it saves (n = 1: 10.0
/// against 9.1, n = 16: 11.6 against 10.8, n = 64 rank 16: 19.4 against 18.5).
pub const ITEM_LIST_ROWS: std::ops::RangeFrom<usize> = TENSOR_CORE_MIN_ROWS..;

/// Whether the fused launch reads a first launch's item list by default:
/// for [`ITEM_LIST_ROWS`] rows and few adapters, except under the overlap
/// for batches of one window of up to [`WINDOW_LARGE`] rows, which every
/// block then scans itself: the list's launch would wait for the previous
/// kernel, where the scan overlaps it (H200, in a graph under the overlap:
/// n = 128 of 16 adapters 8.1 against 10.3 µs, n = 256 of 32 12.1 against
/// 13.1, n = 256 of 64 18.3 against 20.3; but n = 512 of 64 22.1 against 19.6).
fn item_list_by_default(n: usize, max_entries: usize, overlap: bool) -> bool {
    many_rows(n, max_entries) && !(overlap && n <= WINDOW_LARGE)
}

/// Batches the fused launch serves on tensor cores by default (and lists
/// by default, `item_list_by_default`): [`ITEM_LIST_ROWS`] rows, or few
/// adapters for [`TWO_PHASE_ROWS`] rows.
fn many_rows(n: usize, max_entries: usize) -> bool {
    ITEM_LIST_ROWS.contains(&n) || few_adapters(n, max_entries)
}

/// Largest table (entries per target) the item-list launch serves: it
/// counts each entry's rows in a shared-memory array indexed by entry
/// (`BGMV_LIST_MAP` in `cuda/bgmv.cu`).
pub const ITEM_LIST_MAX_ENTRIES: usize = 4096;

/// Bytes of one (window, target) item list in the scratch (`list_stride` in
/// `cuda/bgmv.cu`): a 64-byte header (item count and ready flag), then up
/// to one 64-byte `ItemRows` record per window row. `None` on overflow.
fn item_list_stride(window: usize) -> Option<usize> {
    window.checked_add(1)?.checked_mul(64)
}

/// Row windows `(rows per window, windows)` of a fused launch of `n` rows:
/// one window up to [`WINDOW_MAX`] rows; past that, windows of
/// [`WINDOW_MAX`] when the item list serves them (`list`, and their lists
/// fit the scratch), since no block then scans a window and every window
/// reads its adapters once; else windows of [`WINDOW_LARGE`], whose
/// per-block scan stays short.
fn row_windows(n: usize, list: bool, n_targets: usize) -> (usize, usize) {
    if n <= WINDOW_MAX {
        (n, 1)
    } else if list && item_list_fits(WINDOW_MAX, n.div_ceil(WINDOW_MAX), n_targets) {
        (WINDOW_MAX, n.div_ceil(WINDOW_MAX))
    } else {
        (WINDOW_LARGE, n.div_ceil(WINDOW_LARGE))
    }
}

/// Whether the item lists of a fused launch (every window and target) fit
/// the launch scratch ([`SCRATCH_BYTES`]).
fn item_list_fits(window: usize, n_windows: usize, n_targets: usize) -> bool {
    item_list_stride(window)
        .and_then(|b| b.checked_mul(n_windows))
        .and_then(|b| b.checked_mul(n_targets))
        .is_some_and(|b| b <= SCRATCH_BYTES)
}

/// The fused kernel uses tensor cores by default from this many rows on
/// (items of several rows are likely); below, its scalar path, whose code is
/// smaller (a small batch runs from a cold instruction cache).
pub const TENSOR_CORE_MIN_ROWS: usize = 129;

/// Rows per table entry from which [`bgmv`] serves a batch of
/// [`ENTRY_MIN_ROWS`] rows or more in the entry-clustered form by default
/// (`BgmvTuning::entry_clusters`): there each entry's A and B are read once
/// for all its rows by one cluster. H200, in a graph, against the previous
/// defaults: n = 256 of 32 rank-16 adapters 8.70 against 14.27 µs, n = 128
/// of 16 6.38 against 11.37, n = 64 of 8 5.28 against 7.88, n = 64 of 24
/// 6.49 against 7.95, n = 512 of 64 15.52 against 21.08, n = 1024 of 64
/// 19.64 against 36.99. With one row per entry of a 64-entry table it loses
/// (n = 64 of 64 adapters of rank 64: 37.6 against 25.7): each cluster then
/// serves one row, and the clusters need two rounds of resident blocks.
pub const ENTRY_MIN_ROWS_PER_ENTRY: usize = 2;

/// Widest output the entry-clustered form serves by default with one row
/// per entry (`entry_by_default`); 14336 outputs lost there (28 against 20 µs).
pub const ENTRY_ONE_ROUND_MAX_OUT: usize = 8192;

/// Batch sizes from which the entry-clustered form serves batches of
/// several rows per entry by default (smaller ones only when their tables
/// are small, below).
pub const ENTRY_MIN_ROWS: usize = 32;

/// What of a call the default choice of the entry-clustered form depends on.
#[derive(Debug, Clone, Copy)]
struct EntryCall {
    n: usize,
    max_entries: usize,
    n_targets: usize,
    stride: usize,
    max_out: usize,
    sms: usize,
    /// `BgmvTuning::overlap_previous`.
    overlap: bool,
}

/// Whether [`bgmv`] takes the entry-clustered form when the caller left it
/// unset and set no knob of another form (the call must also suit the form,
/// which the caller checks):
/// - [`ENTRY_MIN_ROWS`] rows or more, at least [`ENTRY_MIN_ROWS_PER_ENTRY`]
///   per entry of the largest table; or
/// - rank stride 16 and at most [`ENTRY_ONE_ROUND_MAX_OUT`] outputs, with
///   clusters of 8 for every entry of every target resident at once
///   (`entry::cluster_block_slots`): H200, in a graph, n = 1 4.60 against
///   4.80 µs, n = 16 of 16 adapters 5.94 against 5.97, n = 32 of 32 7.50
///   against 7.73. A 64-entry table of one-row entries needs two rounds and
///   loses (n = 64 of 64: 12.7 against 8.8), as do wider outputs and larger
///   ranks with one row per entry (14336 outputs 28 against 20, rank 64 35
///   against 26), where the clusters' per-entry chain is not shared by rows.
///   Not under the overlap, where the fused launch reads its first item's
///   weights under the previous kernel (n = 1 2.71 against 4.46 µs, n = 16
///   3.70 against 5.64, n = 32 5.59 against 7.12; with several rows per
///   entry the entry form still wins there: n = 128 of 16 5.94 against 8.12).
fn entry_by_default(call: EntryCall, tuning: BgmvTuning) -> bool {
    let others_unset = tuning.out_splits.is_none()
        && tuning.clusters_per_window.is_none()
        && tuning.two_phase.is_none()
        && tuning.tensor_cores.is_none()
        && tuning.item_list_pass.is_none()
        && matches!(tuning.cluster, None | Some(8) | Some(4));
    let entries = call.max_entries.max(1);
    let several_rows = call.n >= ENTRY_MIN_ROWS && call.n >= ENTRY_MIN_ROWS_PER_ENTRY * entries;
    let one_round = !call.overlap
        && call.stride <= 16
        && call.max_out <= ENTRY_ONE_ROUND_MAX_OUT
        && entries * 8 * call.n_targets.max(1) <= entry::cluster_block_slots(16, call.sms);
    others_unset && (several_rows || one_round)
}

/// Batch sizes for which [`bgmv`] may take two launches by default (see
/// `two_phase_by_default` for the small adapters it leaves fused). Below,
/// the fused kernel's single launch wins (its chain of round trips is the
/// whole time: 9-10 against 13-15 µs on the H200 at n = 1 and 16); in
/// between, the adapters' bytes dominate and two launches stream them better
/// (n = 64: 41-44 against 87 µs at rank 64, 31-34 against 56-60 at 14336
/// outputs); above, items of several rows make the two-phase
/// shrink's per-row reductions the cost (n = 256, 32 adapters: 36-39 against 29).
pub const TWO_PHASE_ROWS: std::ops::RangeInclusive<usize> = 32..=128;

/// Batches the row-register form serves by default (`BgmvTuning::row_registers`),
/// over tables of at least one entry per [`ROW_REGISTER_ROWS_PER_ENTRY`] rows.
/// H200, in a graph, against the previous default in the same call (NOTES.md
/// v30): n = 32 of 32 adapters 6.29 against 7.44 µs, n = 64 of 64 7.85
/// against 8.81, three targets of 64 20.59 against 23.38, 64 rows naming 8
/// or 32 of a 64-entry table 5.98 and 6.86 against 7.98 and 8.01; at n = 16
/// about even (5.78 against 5.89), at n = 1 slower (5.26 against 4.56), and
/// past one round of resident clusters (66 rows on the H200) slower (n = 128
/// of 16: 11.23 against 6.38).
pub const ROW_REGISTER_ROWS: std::ops::RangeInclusive<usize> = 32..=64;

/// Most rows per table entry the row-register form takes by default: rows
/// of one adapter each read its A and B (from L2 after the first), which
/// the entry-clustered and fused forms share. n = 64 over 32-entry tables
/// 6.84 against 7.63 µs, over 24-entry ones 6.63 against 6.50, over 8 5.93
/// against 5.26 (H200, in a graph, NOTES.md v30).
pub const ROW_REGISTER_ROWS_PER_ENTRY: usize = 2;

/// Whether [`bgmv`] takes the row-register form by default for `n` rows over
/// tables of at most `max_entries` entries: [`ROW_REGISTER_ROWS`] rows, at
/// most [`ROW_REGISTER_ROWS_PER_ENTRY`] per entry, no other knob set and
/// the overlap off. The caller checks that the form serves the call's
/// shape (`RowsShape::check`) and that its straight-line kernels do
/// (`rows::full_form`).
fn row_registers_by_default(n: usize, max_entries: usize, tuning: BgmvTuning) -> bool {
    let others_unset = BgmvTuning {
        row_registers: None,
        overlap_previous: None,
        wait_first: None,
        prefetch_weights: None,
        early_next: None,
        entry_spread: None,
        ..tuning
    } == BgmvTuning::default();
    others_unset
        && tuning.overlap_previous != Some(true)
        && ROW_REGISTER_ROWS.contains(&n)
        && n <= ROW_REGISTER_ROWS_PER_ENTRY.saturating_mul(max_entries)
}

/// Batches the fused kernel serves row-mapped by default: at least this many
/// rows in one window, whose scalar clusters of 2 with a cluster per row fit
/// one round of resident clusters (one block per multiprocessor: 66 rows of
/// one target on the H200). Each row is then its own item, requested as soon
/// as its entry is known (rows of one adapter read its A and B again, from
/// L2), instead of items of up to 8 rows grouped by a window scan. H200, in a
/// graph, n = 64 of rank-16 adapters over tables of 8, 24 and 32 entries:
/// 9.69, 11.04 and 9.47 µs by the grouping choices, 7.82, 7.88 and 7.88
/// row-mapped; with fewer rows fewer multiprocessors stream the bytes: n =
/// 32 of 32 adapters 7.52 (clusters of 8) against 7.81, n = 16 5.98 against
/// 7.73. Between 32 and 64 rows unmeasured: the threshold is their midpoint.
pub const ROW_MAPPED_MIN_ROWS: usize = 48;

/// The tuning of the row-mapped form (scalar, scanning, clusters of 2, a
/// cluster per row, one launch) where [`bgmv`] takes it by default: sm_90 or
/// newer, [`ROW_MAPPED_MIN_ROWS`] rows or more, one round of one block per
/// multiprocessor for every (row, target), and none of the knobs it sets
/// (nor the overlap, which it does not serve) chosen by the caller. The
/// caller still checks that its launch fits one round.
fn row_mapped_tuning(n: usize, n_targets: usize, sms: usize, hopper: bool, tuning: BgmvTuning) -> Option<BgmvTuning> {
    let unset = tuning.cluster.is_none()
        && tuning.out_splits.is_none()
        && tuning.clusters_per_window.is_none()
        && tuning.two_phase.is_none()
        && tuning.tensor_cores.is_none()
        && tuning.item_list_pass.is_none()
        && tuning.overlap_previous != Some(true);
    let one_round = n.checked_mul(2 * n_targets).is_some_and(|blocks| blocks <= sms);
    (hopper && unset && n >= ROW_MAPPED_MIN_ROWS && one_round).then(|| BgmvTuning {
        cluster: Some(2),
        out_splits: Some(1),
        clusters_per_window: u32::try_from(n).ok(),
        two_phase: Some(false),
        tensor_cores: Some(false),
        item_list_pass: Some(false),
        ..tuning
    })
}

/// Whether [`bgmv`] takes the two launches for `n` rows: [`TWO_PHASE_ROWS`],
/// except batches of up to 64 rows of small adapters (rank stride 16 or
/// less, at most 8192 outputs), which the fused launch serves faster even in
/// several rounds: H200, in a graph, n = 64 of rank-16 adapters, 4096 x
/// 4096, three targets in one launch (q, k, v): fused 23.3 µs (three rounds
/// of row-mapped clusters of 2, or its own pick) against 26.8 for two
/// launches (row form); one target: 8.8 (one round) against 13.1; under the
/// overlap the fused launch reads its first items' weights under the
/// previous kernel. At rank 64 or 14336 outputs two launches stay ahead,
/// under the overlap too (25.3 against 47.6 µs, 21.5 against 33.4).
///
/// Nor batches whose items must hold several rows: more than
/// [`MULTI_ROW_ITEMS`] rows per entry of the largest table, so fewer than
/// `n / MULTI_ROW_ITEMS` distinct adapters. There the fused kernel on
/// tensor cores with the item list (as from [`TENSOR_CORE_MIN_ROWS`] rows)
/// reads each adapter once for all its rows without the two launches'
/// fixed cost (H200, in a graph: n = 128 of 16 adapters 11.5 against 19.1
/// µs, n = 64 of 8 10.3 against 16.9, n = 64 of 24 11.1 against 14.6).
///
/// Nor batches the fused launch serves in one round of resident clusters
/// (`fused_rounds`, for the most items its windows can make over the
/// table): its chain is then paid once, against the two launches' two
/// chains (H200, in a graph: n = 64 of rank-16 adapters, clusters of 2,
/// one block per multiprocessor, 10.9 against 13.9 µs); at rank 64 or
/// 14336 outputs the fused launch needs several rounds.
fn two_phase_by_default(
    n: usize,
    stride: usize,
    max_out: usize,
    max_entries: usize,
    fused_rounds: Option<usize>,
) -> bool {
    TWO_PHASE_ROWS.contains(&n)
        && !few_adapters(n, max_entries)
        && !(n <= 64 && stride <= 16 && max_out <= TWO_PHASE_WIDE_OUT)
        && fused_rounds != Some(1)
}

/// Rows per table entry past which a batch of [`TWO_PHASE_ROWS`] rows is
/// served like a large one (see `two_phase_by_default`).
pub const MULTI_ROW_ITEMS: usize = 2;

/// A batch of [`TWO_PHASE_ROWS`] rows over tables of at most `max_entries`
/// entries, so of items of several rows on average.
fn few_adapters(n: usize, max_entries: usize) -> bool {
    TWO_PHASE_ROWS.contains(&n) && n > MULTI_ROW_ITEMS * max_entries
}

/// Byte offsets in the scratch of the two-phase decode (`BGMV2_*` in `cuda/bgmv.cu`):
/// per-target headers, then item descriptors, then the partial rank vectors.
const TWO_PHASE_DESC_OFF: usize = 256;
const TWO_PHASE_PART_OFF: usize = TWO_PHASE_DESC_OFF + MAX_TARGETS * WINDOW_MAX * 64;
/// Most K slices of the two-phase shrink (`BGMV2_MAX_SPLITS` in `cuda/bgmv.cu`),
/// and the fewest columns per slice.
const TWO_PHASE_MAX_SPLITS: usize = 16;
const TWO_PHASE_MIN_SLICE: usize = 256;
const TWO_PHASE_COLS: usize = 512;
/// Outputs wider than this use expand units of `2 * TWO_PHASE_COLS` (31.5 against 33-34.5 µs at 14336).
const TWO_PHASE_WIDE_OUT: usize = 8192;
/// The row form's expand units: one row's outputs in as many equal chunks
/// as give every row the same share of the expand's resident blocks (one
/// round, no block with a second unit), of this many outputs at most (and
/// at least the smaller bound, so a unit's B rows stay one long stream).
const TWO_PHASE_ROW_COLS: std::ops::RangeInclusive<usize> = 256..=4096;

/// The row form's expand blocks per target: the resident blocks, shared
/// by the targets (a grid layer each), at least one.
fn row_form_expand_slots(sms: usize, n_targets: usize) -> usize {
    (sms * EXPAND_BLOCKS_PER_SM / n_targets.max(1)).max(1)
}

/// The shape of a two-phase launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TwoPhasePlan {
    /// Most K slices (the scratch holds this many partial rank vectors per row).
    ks_max: usize,
    /// Outputs per expand unit, a multiple of 8.
    cols: usize,
    /// Rows per expand unit: 1 in the row form, else up to [`ITEM_ROWS`].
    unit_rows: usize,
    /// Bytes of the scratch the launch uses.
    scratch_bytes: usize,
    /// Dynamic shared memory of the expand, for y elements of `y_size` bytes.
    expand_smem: usize,
}

impl TwoPhasePlan {
    /// `None` when the batch spans several windows or its partials do not fit
    /// `scratch`. `row_form`: the expand's resident blocks per target, for
    /// the row form (items of one row), or `None` (the scanning form).
    #[allow(clippy::too_many_arguments)]
    fn new(
        n: usize,
        in_dim: usize,
        stride: usize,
        n_targets: usize,
        max_out: usize,
        y_size: usize,
        cols: Option<u32>,
        scratch: usize,
        row_form: Option<usize>,
    ) -> Option<TwoPhasePlan> {
        if n == 0 || n > WINDOW_MAX || n_targets == 0 {
            return None;
        }
        let rpad = stride.div_ceil(8) * 8;
        let per_split = n_targets * n * rpad * 4;
        let room = scratch.checked_sub(TWO_PHASE_PART_OFF)?;
        let ks_max = TWO_PHASE_MAX_SPLITS
            .min((in_dim / TWO_PHASE_MIN_SLICE).max(1))
            .min(room / per_split);
        if ks_max == 0 {
            return None;
        }
        let (default_cols, max_cols, unit_rows) = match row_form {
            Some(slots) => {
                let chunks = (slots / n).max(1);
                let cols = max_out.div_ceil(chunks).div_ceil(8) * 8;
                let cols = cols.clamp(*TWO_PHASE_ROW_COLS.start(), *TWO_PHASE_ROW_COLS.end());
                (cols, *TWO_PHASE_ROW_COLS.end(), 1)
            }
            None if max_out > TWO_PHASE_WIDE_OUT => (2 * TWO_PHASE_COLS, 1024, ITEM_ROWS),
            None => (TWO_PHASE_COLS, 1024, ITEM_ROWS),
        };
        let cols = cols.map_or(default_cols, |c| (c as usize).clamp(8, max_cols).div_ceil(8) * 8);
        Some(TwoPhasePlan {
            ks_max,
            cols,
            unit_rows,
            scratch_bytes: TWO_PHASE_PART_OFF + ks_max * per_split,
            expand_smem: unit_rows * (cols * (4 + y_size) + rpad * 4),
        })
    }
}

/// Mirror of `struct Bgmv2Params` in `cuda/bgmv.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Bgmv2Params {
    x: u64,
    y: u64,
    idx: u64,
    fault: u64,
    scratch: u64,
    n_rows: i32,
    in_dim: i32,
    x_stride: i32,
    y_stride: i32,
    rank_stride: i32,
    n_targets: i32,
    ks_max: i32,
    expand_cols: i32,
    pow2_slices: i32,
    /// 1: the shrink is a programmatic dependent of the stream's previous kernel (`BgmvTuning::overlap_previous`).
    overlap: i32,
    /// Above zero: every row its own item, in this many K slices (the
    /// `_rows` kernels, `BgmvTuning::two_phase_row_items`).
    row_ks: i32,
    /// Keeps `targets` 8-byte aligned.
    pad: i32,
    targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<Bgmv2Params>() == 184 && std::mem::offset_of!(Bgmv2Params, targets) == 88);

/// Resident blocks per multiprocessor of the two-phase kernels (`__launch_bounds__` in `cuda/bgmv.cu`).
const SHRINK_BLOCKS_PER_SM: usize = 4;
const EXPAND_BLOCKS_PER_SM: usize = 4;

/// Mirror of `struct BgmvParams` in `cuda/bgmv.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct BgmvParams {
    x: u64,
    y: u64,
    idx: u64,
    fault: u64,
    n_rows: i32,
    in_dim: i32,
    x_stride: i32,
    y_stride: i32,
    rank_stride: i32,
    n_targets: i32,
    out_splits: i32,
    clusters_per_window: i32,
    window: i32,
    n_windows: i32,
    k_chunk: i32,
    lo_max: i32,
    off_y: i32,
    off_t: i32,
    off_a: i32,
    off_x: i32,
    /// Device address of the launch's item lists, or 0 (every block scans its window).
    list: u64,
    list_stride: i32,
    list_flag: i32,
    /// Push form: byte offset of the receive buffers in the dynamic shared memory.
    off_r: i32,
    /// 1: the cluster sum pushes partials (`BgmvTuning::push_sum`).
    push: i32,
    /// 1: a programmatic dependent of the stream's previous kernel (`BgmvTuning::overlap_previous`).
    overlap: i32,
    b_pitch: i32,
    /// 1: the row-mapped clusters of 2 at rank stride 16 hold B in registers (`BgmvTuning::expand_b_registers`).
    b_registers: i32,
    /// Keeps `targets` 8-byte aligned.
    pad: i32,
    targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<BgmvParams>() == 232 && std::mem::offset_of!(BgmvParams, targets) == 136);

/// `y[row, target columns] += scale * B (A x[row])` with the entry of
/// `idx[row]` (`idx` holds at least `x.n_rows` values; -1 = no delta).
///
/// `x` is `[n, in]` BF16, `y` is `[n, width]` of BF16 or F32 (router logits),
/// updated in place; `rank_stride` is the stride of the pool's A rows and B
/// columns (at most [`BGMV_MAX_RANK`]).
pub fn bgmv<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    idx: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    bgmv_tuned(device, x, idx, targets, rank_stride, y, BgmvTuning::default())
}

/// [`bgmv`] with explicit launch knobs (benchmarks, tests of each path).
pub fn bgmv_tuned<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    idx: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
    tuning: BgmvTuning,
) -> Result<(), KernelError> {
    x.check(device, "x")?;
    y.check(device, "y")?;
    device.expect_same("idx", idx.device())?;
    if y.n_rows != x.n_rows {
        return Err(invalid("y", format!("{} rows, x has {}", y.n_rows, x.n_rows)));
    }
    check_range("idx", 0, x.n_rows, idx.len())?;
    if rank_stride == 0 || rank_stride > BGMV_MAX_RANK {
        return Err(invalid(
            "rank_stride",
            format!("{rank_stride}; 1..={BGMV_MAX_RANK} allowed"),
        ));
    }
    let target_params = check_targets(device, targets, y.width)?;
    if x.n_rows == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => reference(&cpu.memory, &x, idx, targets, rank_stride, y),
        Backend::Cuda(c) => {
            let call = DecodeCall::of(&x, targets, rank_stride, &y)?;
            let limits = DeviceLimits::of(c);
            let overlap_previous = tuning.overlap_previous.unwrap_or(false);
            // The driver is asked only where a launch may wait first.
            let predecessor = if limits.hopper() && !overlap_previous {
                c.predecessor()
            } else {
                Predecessor::Unknown
            };
            let ctx = DecodeContext {
                overlap_previous,
                predecessor,
            };
            let plan = plan::legacy(&call, &limits, ctx, tuning)?;
            launch(c, &x, idx, &target_params, targets, rank_stride, &y, &plan)
        }
    }
}

fn reference<Y: OutputElem>(
    memory: &CpuMemory,
    x: &Rows<'_, bf16>,
    idx: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    stride: usize,
    y: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    let idx = idx.download_range(0, x.n_rows)?;
    let rows: Vec<(i64, usize)> = idx.iter().enumerate().map(|(r, &e)| (i64::from(e), r)).collect();
    reference_apply(memory, x, &rows, "idx", targets, stride, y)
}

/// The fused kernel for a cluster size, y type and form (`_list`: reads `bgmv_list`'s item list).
fn kernel_name(cluster: u32, y: &'static str, tensor_cores: bool, list: bool) -> Option<&'static str> {
    Some(match (cluster, y, tensor_cores, list) {
        (1, "bf16", false, false) => "bgmv_c1_bf16",
        (1, "f32", false, false) => "bgmv_c1_f32",
        (2, "bf16", false, false) => "bgmv_c2_bf16",
        (2, "f32", false, false) => "bgmv_c2_f32",
        (4, "bf16", false, false) => "bgmv_c4_bf16",
        (4, "f32", false, false) => "bgmv_c4_f32",
        (8, "bf16", false, false) => "bgmv_c8_bf16",
        (8, "f32", false, false) => "bgmv_c8_f32",
        (1, "bf16", true, false) => "bgmv_tc_c1_bf16",
        (1, "f32", true, false) => "bgmv_tc_c1_f32",
        (2, "bf16", true, false) => "bgmv_tc_c2_bf16",
        (2, "f32", true, false) => "bgmv_tc_c2_f32",
        (4, "bf16", true, false) => "bgmv_tc_c4_bf16",
        (4, "f32", true, false) => "bgmv_tc_c4_f32",
        (8, "bf16", true, false) => "bgmv_tc_c8_bf16",
        (8, "f32", true, false) => "bgmv_tc_c8_f32",
        (1, "bf16", false, true) => "bgmv_c1_bf16_list",
        (1, "f32", false, true) => "bgmv_c1_f32_list",
        (2, "bf16", false, true) => "bgmv_c2_bf16_list",
        (2, "f32", false, true) => "bgmv_c2_f32_list",
        (4, "bf16", false, true) => "bgmv_c4_bf16_list",
        (4, "f32", false, true) => "bgmv_c4_f32_list",
        (8, "bf16", false, true) => "bgmv_c8_bf16_list",
        (8, "f32", false, true) => "bgmv_c8_f32_list",
        (1, "bf16", true, true) => "bgmv_tc_c1_bf16_list",
        (1, "f32", true, true) => "bgmv_tc_c1_f32_list",
        (2, "bf16", true, true) => "bgmv_tc_c2_bf16_list",
        (2, "f32", true, true) => "bgmv_tc_c2_f32_list",
        (4, "bf16", true, true) => "bgmv_tc_c4_bf16_list",
        (4, "f32", true, true) => "bgmv_tc_c4_f32_list",
        (8, "bf16", true, true) => "bgmv_tc_c8_bf16_list",
        (8, "f32", true, true) => "bgmv_tc_c8_f32_list",
        _ => return None,
    })
}

/// `BgmvTuning::wait_first`'s default: on unless the launch is captured
/// where no kernel precedes it (a graph's root node, or after a copy or
/// memset). There nothing overlaps its start, and the prefetch and the
/// spread kernel that waiting first brings by default cost time instead
/// (H200, one apply a graph after an L2 flush: NOTES.md v35-v36).
fn wait_first_by_default(predecessor: Predecessor) -> bool {
    predecessor != Predecessor::NoKernel
}

/// Run what `plan` says: a `match` over the forms, no decision of its own
/// (the launch shapes are arithmetic of the plan and the call).
#[allow(clippy::too_many_arguments)]
fn launch<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    idx: &DeviceBuffer<i32>,
    target_params: &[TargetParams; MAX_TARGETS],
    targets: &[LoraTarget<'_>],
    stride: usize,
    y: &RowsMut<'_, Y>,
    plan: &DecodePlan,
) -> Result<(), KernelError> {
    let chain = plan.chain;
    match plan.form {
        DecodeForm::RowRegisters { straight_line } => {
            rows::launch_rows(c, x, idx.device_addr(), target_params, targets, y, chain, straight_line)
        }
        DecodeForm::Entry { kernel, prefetch } => entry::launch_entry(
            c,
            x,
            idx.device_addr(),
            target_params,
            targets,
            stride,
            y,
            kernel,
            chain,
            prefetch,
        ),
        DecodeForm::TwoPhase(form) => {
            let n_targets = targets.len();
            let max_out = targets.iter().map(|t| t.out_dim).max().unwrap_or(0);
            let two = TwoPhasePlan::new(
                x.n_rows,
                x.width,
                stride,
                n_targets,
                max_out,
                std::mem::size_of::<Y>(),
                Some(form.expand_cols as u32),
                SCRATCH_BYTES,
                form.row_items
                    .then_some(row_form_expand_slots(c.sm_count as usize, n_targets)),
            )
            .ok_or_else(|| invalid("plan", "the two-phase scratch does not hold the call"))?;
            launch_two_phase(c, x, idx, target_params, targets, stride, y, two, form, chain)
        }
        DecodeForm::Fused(form) => launch_fused(c, x, idx, target_params, targets, stride, y, form, chain),
    }
}

/// The fused kernel (after `bgmv_list` where its items are listed).
#[allow(clippy::too_many_arguments)]
fn launch_fused<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    idx: &DeviceBuffer<i32>,
    target_params: &[TargetParams; MAX_TARGETS],
    targets: &[LoraTarget<'_>],
    stride: usize,
    y: &RowsMut<'_, Y>,
    form: FusedForm,
    chain: Chain,
) -> Result<(), KernelError> {
    let n = x.n_rows;
    let n_targets = targets.len();
    let overlap = chain == Chain::EarlyReads;
    let list = form.items != ItemList::Scan;
    let (window, n_windows) = row_windows(n, list, n_targets);
    let (cl, splits, cpw, tensor_cores) = (
        form.cluster,
        form.out_splits,
        form.clusters_per_window,
        form.tensor_cores,
    );
    let shape = PlanShape {
        in_dim: x.width,
        max_out: targets.iter().map(|t| t.out_dim).max().unwrap_or(0),
        stride,
        y_size: std::mem::size_of::<Y>(),
        cluster: cl,
        push: form.push_sum,
        tensor_cores,
        b_registers: form.b_registers,
    };
    let plan = SmemPlan::choose(shape, splits, true);
    let name = kernel_name(cl as u32, Y::NAME, tensor_cores, list)
        .ok_or_else(|| invalid("plan", format!("clusters of {cl}; 1, 2, 4 or 8")))?;
    let grid_y = n_windows * cpw;
    let mut params = BgmvParams {
        x: x.addr(),
        y: y.addr(),
        idx: idx.device_addr(),
        fault: c.fault_addr(),
        n_rows: to_i32("x.n_rows", n)?,
        in_dim: to_i32("x.width", x.width)?,
        x_stride: to_i32("x.stride", x.stride)?,
        y_stride: to_i32("y.stride", y.stride)?,
        rank_stride: to_i32("rank_stride", stride)?,
        n_targets: to_i32("targets", n_targets)?,
        out_splits: to_i32("plan.out_splits", splits)?,
        clusters_per_window: to_i32("plan.clusters_per_window", cpw)?,
        window: to_i32("window", window)?,
        n_windows: to_i32("windows", n_windows)?,
        k_chunk: to_i32("k_chunk", plan.k_chunk)?,
        lo_max: to_i32("lo_max", plan.lo_max)?,
        off_y: to_i32("smem", plan.off_y)?,
        off_t: to_i32("smem", plan.off_t)?,
        off_a: to_i32("smem", plan.off_a)?,
        off_x: to_i32("smem", plan.off_x)?,
        list: 0,
        list_stride: to_i32("window", item_list_stride(window).unwrap_or(usize::MAX))?,
        list_flag: i32::from(form.items == ItemList::ListedFlag),
        off_r: to_i32("smem", plan.off_r)?,
        push: i32::from(form.push_sum),
        overlap: i32::from(overlap),
        b_pitch: to_i32("rank_stride", plan.b_pitch)?,
        b_registers: i32::from(plan.b_registers),
        pad: 0,
        targets: *target_params,
    };
    let kernel = Kernel {
        family: Family::Bgmv,
        name,
    };
    let shape = Launch {
        grid: (
            to_u32("grid", cl * splits)?,
            to_u32("grid", grid_y)?,
            to_u32("grid", n_targets)?,
        ),
        block: fused_threads(cl, tensor_cores),
        smem: to_u32("smem", plan.total)?,
    };
    if !list {
        // SAFETY: `BgmvParams` mirrors the kernel's struct (sizes asserted on both sides). The
        // host checked that x and y cover `n_rows` rows of their widths and strides,
        // that idx holds `n_rows` values, that each target's table range and
        // column range lie inside their buffers, and that the stride fits the
        // kernel; the kernel checks each index against `n_entries` and each entry's
        // rank against the stride before reading A and B through table addresses,
        // which the table's owner keeps pointing at live `[stride, in]` / `[out, stride]` pairs.
        // As a dependent launch (`overlap`) the kernel reads x and y only after
        // `griddepcontrol.wait`; idx, the tables and the pairs before it, which the
        // caller promised the previous kernel does not write.
        return unsafe { c.launch_chained(kernel, shape, &params, overlap) };
    }
    c.with_scratch(|scratch| {
        params.list = scratch;
        // SAFETY: as for the scanning form above; in addition the plan was
        // checked to keep every (window, target) list `bgmv_list` writes and the fused
        // kernel reads inside the scratch (`item_list_fits`), which `with_scratch` holds for both
        // launches; every table has at most `ITEM_LIST_MAX_ENTRIES` entries, so
        // `bgmv_list`'s per-entry counters stay inside its shared array. It
        // checks indices and entries as the scanning kernel does (the fused
        // kernel reads only checked entries), and the fused kernel reads the
        // list only after `griddepcontrol.wait` or after acquiring the ready
        // flag `bgmv_list` clears before its dependents may start. As a dependent
        // launch (`overlap`) `bgmv_list` reads idx and the tables before its wait
        // and writes the scratch only after it.
        unsafe {
            c.launch_chained(
                Kernel {
                    family: Family::Bgmv,
                    name: "bgmv_list",
                },
                Launch {
                    grid: (to_u32("grid", n_windows)?, 1, to_u32("grid", n_targets)?),
                    block: THREADS,
                    smem: 0,
                },
                &params,
                overlap,
            )?;
            c.launch_chained(kernel, shape, &params, true)
        }
    })
}

/// K slices of the two-phase shrink: enough that its units fill the grid
/// once, at most `ks_max`, rounded down to a power of two under
/// `pow2_slices` (the kernel's own rule for the scanning form, whose item
/// count it knows only there; the row form's count is the rows).
fn two_phase_slices(grid: usize, items: usize, ks_max: usize, pow2_slices: bool) -> usize {
    let ks = (grid / items.max(1)).clamp(1, ks_max.max(1));
    if pow2_slices { 1 << ks.ilog2() } else { ks }
}

/// The two-phase decode: `bgmv2_shrink` then `bgmv2_expand_*`, through the
/// backend's scratch (held for both launches).
#[allow(clippy::too_many_arguments)]
fn launch_two_phase<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    idx: &DeviceBuffer<i32>,
    target_params: &[TargetParams; MAX_TARGETS],
    targets: &[LoraTarget<'_>],
    stride: usize,
    y: &RowsMut<'_, Y>,
    plan: TwoPhasePlan,
    forms: TwoPhaseForm,
    chain: Chain,
) -> Result<(), KernelError> {
    let n = x.n_rows;
    let n_targets = targets.len();
    let sms = c.sm_count as usize;
    let max_out = targets.iter().map(|t| t.out_dim).max().unwrap_or(0);
    // Every block resident at once; more units than blocks are walked in turn.
    let shrink_blocks = (n * plan.ks_max).min(sms * SHRINK_BLOCKS_PER_SM).max(1);
    let expand_blocks = (n * max_out.div_ceil(plan.cols)).min(sms * EXPAND_BLOCKS_PER_SM).max(1);
    let expand = match (Y::NAME, forms.row_items) {
        ("bf16", false) => "bgmv2_expand_bf16",
        ("bf16", true) => "bgmv2_expand_rows_bf16",
        (_, false) => "bgmv2_expand_f32",
        (_, true) => "bgmv2_expand_rows_f32",
    };
    let row_ks = if forms.row_items {
        two_phase_slices(shrink_blocks, n, plan.ks_max, forms.pow2_slices)
    } else {
        0
    };
    c.with_scratch(|scratch| {
        let params = Bgmv2Params {
            x: x.addr(),
            y: y.addr(),
            idx: idx.device_addr(),
            fault: c.fault_addr(),
            scratch,
            n_rows: to_i32("x.n_rows", n)?,
            in_dim: to_i32("x.width", x.width)?,
            x_stride: to_i32("x.stride", x.stride)?,
            y_stride: to_i32("y.stride", y.stride)?,
            rank_stride: to_i32("rank_stride", stride)?,
            n_targets: to_i32("targets", n_targets)?,
            ks_max: to_i32("k_splits", plan.ks_max)?,
            expand_cols: to_i32("plan.expand_cols", plan.cols)?,
            pow2_slices: i32::from(forms.pow2_slices),
            overlap: chain as i32,
            row_ks: to_i32("k_splits", row_ks)?,
            pad: 0,
            targets: *target_params,
        };
        // SAFETY: `Bgmv2Params` mirrors the kernels' struct (sizes asserted on both
        // sides). The host checked x, y, idx and the targets as for the fused
        // kernel; `plan` keeps every descriptor and partial the kernels address
        // inside the scratch (`scratch_bytes <= SCRATCH_BYTES`, n <= 512 rows),
        // which `with_scratch` holds for both launches; the kernels check each
        // index and each entry's rank before reading A and B through table addresses.
        // Under the overlap (`Chain::EarlyReads`) the shrink reads x and touches
        // the scratch only after its wait; idx and the tables before it, which
        // the caller promised the previous kernel does not write. Waiting first
        // its blocks wait before any read and let the expand in only after
        // that wait. The row form's expand checks each row's index and entry
        // itself and reads idx, the tables and B before its wait (the shrink
        // writes none of them), and y only where the shrink is not under the
        // overlap (every earlier kernel then completed before the shrink's
        // blocks let the expand in); a next kernel it lets in early waits for
        // it (the contract of `launch_chained`).
        unsafe {
            c.launch_chained(
                Kernel {
                    family: Family::Bgmv,
                    name: match (forms.shrink_tensor_cores, forms.row_items) {
                        (false, false) => "bgmv2_shrink",
                        (true, false) => "bgmv2_shrink_tc",
                        (false, true) => "bgmv2_shrink_rows",
                        (true, true) => "bgmv2_shrink_tc_rows",
                    },
                },
                Launch {
                    grid: (to_u32("grid", shrink_blocks)?, 1, to_u32("grid", n_targets)?),
                    block: THREADS,
                    smem: 0,
                },
                &params,
                chain.dependent(),
            )?;
            let kernel = Kernel {
                family: Family::Bgmv,
                name: expand,
            };
            let shape = Launch {
                grid: (to_u32("grid", expand_blocks)?, 1, to_u32("grid", n_targets)?),
                block: THREADS,
                smem: to_u32("smem", plan.expand_smem)?,
            };
            // The expand runs `griddepcontrol.wait` before it reads the scratch.
            c.launch_chained(kernel, shape, &params, forms.dependent_expand)
        }
    })
}

#[cfg(test)]
mod tests;
