//! Row-indexed LoRA apply (BGMV): decode batches of mixed slots, and the
//! routed-expert gather. Every row names a table entry (`idx[row]`, -1 = no
//! delta) and, for every target,
//! `y[row, col_off .. col_off + out] += e.scale * B_e (A_e x[row])`.
//!
//! Dense decode passes `idx = seq_slot` into a `[max_loras]` table; MoE
//! passes `idx = expert * max_loras + slot` into a `[num_experts * max_loras]`
//! table. A target may carry a DoRA epilogue ([`super::dora`]): every form
//! writes each output element of y from one thread, which rescales the rows
//! of DoRA entries there before it rounds them; the plan does not look at
//! it, and the launch runs each kernel's `_dora` instantiation where a
//! target carries one, its plain one (compiled without the epilogue)
//! otherwise (`kernels::Epilogue`). CUDA kernel family: `cuda/bgmv.cu`, the entry-clustered form's
//! `cuda/bgmv_entry.cu` (module `entry`) and the row-register form's
//! `cuda/bgmv_rows.cu` (module `rows`), compiled with it.
//!
//! Which form a call runs, and every launch choice within it, is the rule
//! table's ([`plan`]: a pure function of the call, the device and the
//! caller's promises; its module docs also describe the launch chains);
//! [`bgmv_with`] runs a [`plan::DecodePlan`] and decides nothing itself. The
//! row-register form lives in `rows.rs`, the entry-clustered form in
//! `entry.rs`; this module launches the other two, described below.
//!
//! # The fused kernel ([`plan::DecodeForm::Fused`])
//!
//! One launch (two with the item list). Rows are grouped by table entry
//! inside a window of at most 512 rows (`WINDOW_MAX`) into *items* of up
//! to 8 rows of one entry (`ITEM_ROWS`), so an adapter's A and B are read
//! once per item. A cluster of [`plan::FusedForm::cluster`] blocks serves
//! one item: each block shrinks its slice of `in` into shared memory, the
//! partial rank vectors are summed over the cluster, and each block expands
//! its share of the outputs. The grid is (cluster x
//! [`plan::FusedForm::out_splits`], windows x
//! [`plan::FusedForm::clusters_per_window`], targets); items are dealt
//! round-robin to a window's clusters, and each output split recomputes the
//! (small) rank vector rather than pay a second launch. Before sm_90 a
//! cluster is one block; on sm_90 the cost model (`LaunchChoice::pick` in
//! [`plan`]) takes clusters of 8, or of 2 (one block a multiprocessor, each
//! doing four times the work) where items outnumber one round of resident
//! clusters of 8 (clusters of 4 were removed: slower everywhere, NOTES.md v38).
//!
//! Finding the items ([`plan::FusedForm::items`]):
//! - [`plan::ItemList::Scan`]: every block lists its window's items
//!   itself. Each thread reads its first row index before any other setup,
//!   and tables of up to 128 entries are copied into shared memory while
//!   the indices arrive, so an item's entry is no second round trip.
//!   Windows of up to one row a thread are listed with one `match_any` per
//!   warp, a count over the lower warps' rows and a ballot per warp, in
//!   three barriers (one for up to 32 rows); longer windows by a block scan.
//! - [`plan::ItemList::Listed`] (tensor cores only): a small first launch
//!   (`bgmv_list`, one block a window) lists each window's items (rows and
//!   checked entry) once into the device's scratch, and the fused kernel
//!   (the `_list` kernels), launched as its programmatic dependent, reads
//!   them after `griddepcontrol.wait` instead of scanning. Tables of at most
//!   [`ITEM_LIST_MAX_ENTRIES`] entries (`bgmv_list` counts each entry's
//!   rows in shared memory), and lists that fit the scratch. Past one
//!   window the list lets windows hold 512 rows instead of 256
//!   (`row_windows`), so each window reads its adapters once for twice the
//!   rows.
//!
//! The cluster sum: with [`plan::FusedForm::push_sum`] every block pushes
//! its partial rank vectors into each peer's receive buffers (`st.async`,
//! counted on the peer's mbarrier) and waits on its own mbarrier: one
//! one-way hop per item, no cluster barrier and so no GPU-scope release
//! fence; it costs receive buffers of `2 · cluster · 8 · stride` f32, so
//! the cost model takes it up to rank stride 32 where they cost no resident
//! block. Otherwise a cluster barrier, loads from the peers' shared memory
//! and a second barrier before the partials are overwritten.
//!
//! A scalar block requests its A and x slice before its B rows and y
//! values, starts the shrink when that slice alone has arrived, and waits
//! for B and y only before the expand. With
//! [`plan::FusedForm::tensor_cores`] shrink and expand run on tensor cores
//! (an item of several rows costs one matrix instruction per 8 columns
//! instead of a warp reduction per row); the scalar path's smaller code
//! suits small batches, which run from a cold instruction cache. The scalar
//! clusters of 2 run blocks of 16 warps (the others 8): for a one-row item
//! warps 0-7 request A and x and shrink while warps 8-15 request B and y;
//! for larger items all 16 share each phase (their window scan takes one
//! row per thread up to 512 rows).
//!
//! *Row-mapped*: scalar clusters of 2 with a cluster for every row of the
//! window (`clusters_per_window` = the window's rows). Cluster q serves row
//! q alone, an item of one row, requesting its weights as soon as its entry
//! is known, and the window is never scanned (rows of one adapter are not
//! grouped: its A and B come again from L2).
//!
//! Under [`plan::Chain::EarlyReads`] a scanning block reads idx, the table
//! and its first item's B and A before `griddepcontrol.wait`, and x and y
//! only after it, so the chain idx -> entry -> weights runs under the
//! previous kernel's tail; `bgmv_list` reads idx and the tables before its
//! wait and writes the scratch after it. The fused kernel never waits
//! first.
//!
//! # The two launches ([`plan::DecodeForm::TwoPhase`])
//!
//! A shrink (`bgmv2_shrink*_rows`) writes every row's partial rank vectors,
//! per K slice, into the device's scratch, and an expand
//! (`bgmv2_expand_rows_*`) sums them and adds `B t` to y; the scratch is
//! held for both launches (`with_scratch`), and a batch is one window (at
//! most 512 rows) whose partials fit it (`TwoPhasePlan`). Every block of
//! both launches is resident at once (four a multiprocessor); more units
//! than blocks are walked in turn.
//!
//! Every row is an item of its own: the shrink scans no window, reading
//! each row's index and entry itself, and the expand reads each row's
//! entry from the indices and tables itself (neither depends on the
//! shrink), so before it waits for the shrink it loads its first B rows
//! into registers and, unless the shrink runs under the overlap, copies its
//! first unit's y values into shared memory (an L2 prefetch of the whole B
//! span there measured slower, NOTES.md). Each row's outputs are cut into
//! equal chunks ([`plan::TwoPhaseForm::expand_cols`]), as many as give
//! every (row, target) the same share of the expand's resident blocks (one
//! unit a block, shared memory for one row). Rows of one adapter each read
//! its A and B (from L2 after the first).
//!
//! The shrink takes its rows 8 rank rows per step, so a lane has 8 A loads
//! in flight; its K slices fill the grid once, rounded down to a power of
//! two (whole 256-column warp passes when `in` is a multiple of 4096). Both
//! kernels sum their partial dot products by halving exchanges. The expand
//! is the shrink's programmatic dependent, its blocks resident while the
//! shrink drains, and it requests its next B rows before those exchanges.
//! The shrink sums each rank row over its warps in a fixed order (a warp's
//! column passes in registers, at most two shared adds per value; the
//! tensor-core shrink's tiles in warp order), so a repeated apply or a
//! graph replay gives the same bits.
//! [`plan::TwoPhaseForm::shrink_tensor_cores`] (exact plans only) shrinks
//! on tensor cores: one matrix instruction per 16 rank rows x 16 columns,
//! instead of per-lane unpacking, multiply-adds and warp exchanges.
//!
//! Waiting first ([`plan::Chain::WaitFirst`]) the shrink's blocks execute
//! `griddepcontrol.wait` and only then let the expand in, so the expand,
//! which reads y before its own wait, still starts only after every
//! earlier kernel completed; the expand lets the next kernel in before its
//! blocks' last stores ([`plan::Chain::WaitFirstEarlyNext`]: at its
//! start). Under [`plan::Chain::EarlyReads`] the shrink reads idx
//! and the tables before its wait, x and the scratch after it.
//!
//! Five forms that no rule picked and that measured slower than the
//! defaults at every benchmark shape were removed (the item list's ready
//! flag, the scalar kernels with the item list, B in registers for the
//! row-mapped clusters, the two-phase scanning form and its exact-plan
//! knobs for K slices and a plain expand): lora-kernels/NOTES.md.

use half::bf16;

use super::pairs::reference_apply;
use super::{LoraTarget, MAX_TARGETS, OutputElem, Rows, RowsMut, TargetParams, check_targets, to_i32, to_u32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{CudaBackend, Launch, Predecessor, SCRATCH_BYTES};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};
use crate::ops::limits::{Choice, DeviceLimits};
use kernels::{DecodeKernel, Epilogue};
use plan::{Chain, DecodeCall, DecodeContext, DecodeForm, DecodePlan, FusedForm, ItemList, OutputKind, TwoPhaseForm};

mod entry;
mod kernels;
pub mod plan;
mod rows;
pub use entry::{ENTRY_MAX_ROWS, ENTRY_REGISTERS_MAX_DIM, ENTRY_REGISTERS_MAX_ROWS};
pub use rows::{ROWS_MAX_IN, ROWS_MAX_OUT, ROWS_STRIDE};

/// Largest rank stride bgmv serves (the rank vectors live in shared memory).
pub const BGMV_MAX_RANK: usize = 256;
/// Rows grouped together at most (one window); larger batches use windows
/// of this many rows with the item list, else of [`WINDOW_LARGE`] (`row_windows`).
pub(crate) const WINDOW_MAX: usize = 512;
const WINDOW_LARGE: usize = 256;
pub(crate) const THREADS: u32 = 256;

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
pub(crate) const ITEM_ROWS: usize = 8;

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
}

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
        let off_y = round16(lo_max * b_pitch * 2);
        let off_t = off_y + round16(ITEM_ROWS * lo_max * y_size);
        // sTp and sT [G][stride8] f32, then (TC) the shrink's per-warp tiles [warps][128] f32.
        let red = if tensor_cores {
            (THREADS as usize / 32) * 128 * 4
        } else {
            0
        };
        let off_a = off_t + 2 * ITEM_ROWS * stride.div_ceil(8) * 8 * 4 + red;
        let off_x = off_a + round16(stages * round16(stride) * stage_pitch(k_chunk) * 2);
        let off_r = off_x + round16(stages * ITEM_ROWS * stage_pitch(k_chunk) * 2);
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

/// Largest table (entries per target) the item-list launch serves: it
/// counts each entry's rows in a shared-memory array indexed by entry
/// (`BGMV_LIST_MAP` in `cuda/bgmv.cu`).
pub const ITEM_LIST_MAX_ENTRIES: usize = 4096;

/// Bytes of one (window, target) item list in the scratch (`list_stride` in
/// `cuda/bgmv.cu`): a 64-byte header (the item count), then up to one
/// 64-byte `ItemRows` record per window row. `None` on overflow.
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

/// Byte offsets in the scratch of the two-phase decode (`BGMV2_*` in `cuda/bgmv.cu`):
/// per-target headers, a region the removed scanning form's item
/// descriptors took (kept, so the partials stay where they were), then the
/// partial rank vectors.
pub(crate) const TWO_PHASE_DESC_OFF: usize = 256;
const TWO_PHASE_PART_OFF: usize = TWO_PHASE_DESC_OFF + MAX_TARGETS * WINDOW_MAX * 64;
/// Most K slices of the two-phase shrink (`BGMV2_MAX_SPLITS` in `cuda/bgmv.cu`),
/// and the fewest columns per slice.
pub(crate) const TWO_PHASE_MAX_SPLITS: usize = 16;
const TWO_PHASE_MIN_SLICE: usize = 256;
/// Widest outputs of the small adapters rule 4 leaves to the fused launch
/// (`plan::two_phase_by_default`).
const TWO_PHASE_WIDE_OUT: usize = 8192;
/// The expand units: one row's outputs in as many equal chunks
/// as give every row the same share of the expand's resident blocks (one
/// round, no block with a second unit), of this many outputs at most (and
/// at least the smaller bound, so a unit's B rows stay one long stream).
const TWO_PHASE_ROW_COLS: std::ops::RangeInclusive<usize> = 256..=4096;

/// The expand's blocks per target: the resident blocks, shared by the
/// targets (a grid layer each), at least one.
fn row_form_expand_slots(sms: usize, n_targets: usize) -> usize {
    (sms * EXPAND_BLOCKS_PER_SM / n_targets.max(1)).max(1)
}

/// The shape of a two-phase launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TwoPhasePlan {
    /// Most K slices (the scratch holds this many partial rank vectors per row).
    ks_max: usize,
    /// Outputs per expand unit (of one row), a multiple of 8.
    cols: usize,
    /// Bytes of the scratch the launch uses.
    scratch_bytes: usize,
    /// Dynamic shared memory of the expand, for y elements of `y_size` bytes.
    expand_smem: usize,
}

impl TwoPhasePlan {
    /// `None` when the batch spans several windows or its partials do not fit
    /// `scratch`. `slots`: the expand's resident blocks per target
    /// ([`row_form_expand_slots`]).
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
        slots: usize,
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
        let chunks = (slots / n).max(1);
        let default_cols =
            (max_out.div_ceil(chunks).div_ceil(8) * 8).clamp(*TWO_PHASE_ROW_COLS.start(), *TWO_PHASE_ROW_COLS.end());
        let max_cols = *TWO_PHASE_ROW_COLS.end();
        let cols = cols.map_or(default_cols, |c| (c as usize).clamp(8, max_cols).div_ceil(8) * 8);
        Some(TwoPhasePlan {
            ks_max,
            cols,
            scratch_bytes: TWO_PHASE_PART_OFF + ks_max * per_split,
            expand_smem: cols * (4 + y_size) + rpad * 4,
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
    /// Keeps the fields below where the kernels read them, and `targets` 8-byte aligned.
    pad: i32,
    /// How the shrink follows the stream's previous kernel (`Chain as i32`:
    /// plain, [`Chain::EarlyReads`] or waiting first).
    overlap: i32,
    /// K slices of every row (each row its own item).
    row_ks: i32,
    targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<Bgmv2Params>() == 248 && std::mem::offset_of!(Bgmv2Params, targets) == 88);

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
    /// Push form: byte offset of the receive buffers in the dynamic shared memory.
    off_r: i32,
    /// 1: the cluster sum pushes partials ([`FusedForm::push_sum`]).
    push: i32,
    /// 1: a programmatic dependent of the stream's previous kernel ([`Chain::EarlyReads`]).
    overlap: i32,
    b_pitch: i32,
    /// Keeps `targets` 8-byte aligned.
    pad: i32,
    targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<BgmvParams>() == 288 && std::mem::offset_of!(BgmvParams, targets) == 128);

/// How [`bgmv_with`] runs a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// The rule table's plan, or an exact one (benchmarks, tests of each form).
    pub choice: Choice<DecodePlan>,
    /// The caller's promise that the stream's previous kernel writes neither
    /// `idx`, the pair tables nor the adapter weights they point at (in an
    /// engine: the apply follows the base projection, which writes y). The
    /// first kernel then reads those before that kernel completed
    /// ([`Chain::EarlyReads`]); x, y and the scratch only after. Off by default.
    pub overlap_previous: bool,
}

/// `y[row, target columns] += scale * B (A x[row])` with the entry of
/// `idx[row]` (`idx` holds at least `x.n_rows` values; -1 = no delta).
///
/// `x` is `[n, in]` BF16, `y` is `[n, width]` of BF16 or F32 (router logits),
/// updated in place; `rank_stride` is the stride of the pool's A rows and B
/// columns (at most [`BGMV_MAX_RANK`]). The launch is the rule table's
/// ([`plan::plan`]).
pub fn bgmv<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    idx: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    bgmv_with(device, x, idx, targets, rank_stride, y, DecodeOptions::default())
}

/// [`bgmv`] with the caller's promises and, optionally, an exact plan
/// (refused with a typed error where it cannot serve the call).
pub fn bgmv_with<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    idx: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
    options: DecodeOptions,
) -> Result<(), KernelError> {
    device.expect_same("idx", idx.device())?;
    check_range("idx", 0, x.n_rows, idx.len())?;
    let target_params = check_call(device, &x, targets, rank_stride, &y)?;
    if x.n_rows == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => reference(&cpu.memory, &x, idx, targets, rank_stride, y),
        Backend::Cuda(c) => {
            let plan = plan_call(c, &x, targets, rank_stride, &y, options)?;
            launch(c, &x, idx, &target_params, targets, rank_stride, &y, &plan)
        }
    }
}

/// The plan [`bgmv_with`] would run for these arguments now (for logs and
/// an engine's graph bookkeeping); `None` on the CPU, which runs the
/// reference, and for an empty batch.
pub fn bgmv_plan<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: &RowsMut<'_, Y>,
    options: DecodeOptions,
) -> Result<Option<DecodePlan>, KernelError> {
    check_call(device, &x, targets, rank_stride, y)?;
    match device.backend() {
        Backend::Cuda(c) if x.n_rows > 0 => plan_call(c, &x, targets, rank_stride, y, options).map(Some),
        _ => Ok(None),
    }
}

/// Every plan that serves these arguments on this device under the
/// caller's promise ([`plan::candidates`]: the rule table's first), for
/// benchmarks and tests of each form; empty on the CPU.
pub fn bgmv_candidates<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: &RowsMut<'_, Y>,
    overlap_previous: bool,
) -> Result<Vec<DecodePlan>, KernelError> {
    check_call(device, &x, targets, rank_stride, y)?;
    match device.backend() {
        Backend::Cuda(c) => {
            let call = DecodeCall::of(&x, targets, rank_stride, y)?;
            let ctx = DecodeContext {
                overlap_previous,
                predecessor: Predecessor::Unknown,
            };
            Ok(plan::candidates(&call, &DeviceLimits::of(c), ctx))
        }
        Backend::Cpu(_) => Ok(Vec::new()),
    }
}

/// The host checks of a call, and its targets' parameter blocks.
fn check_call<Y: OutputElem>(
    device: &Device,
    x: &Rows<'_, bf16>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: &RowsMut<'_, Y>,
) -> Result<[TargetParams; MAX_TARGETS], KernelError> {
    x.check(device, "x")?;
    y.check(device, "y")?;
    if y.n_rows != x.n_rows {
        return Err(invalid("y", format!("{} rows, x has {}", y.n_rows, x.n_rows)));
    }
    if rank_stride == 0 || rank_stride > BGMV_MAX_RANK {
        return Err(invalid(
            "rank_stride",
            format!("{rank_stride}; 1..={BGMV_MAX_RANK} allowed"),
        ));
    }
    check_targets(device, targets, y.width)
}

/// The plan of a checked call on this backend, where it stands now.
fn plan_call<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: &RowsMut<'_, Y>,
    options: DecodeOptions,
) -> Result<DecodePlan, KernelError> {
    let call = DecodeCall::of(x, targets, rank_stride, y)?;
    let limits = DeviceLimits::of(c);
    // The driver is asked only where a launch may wait first.
    let predecessor = if limits.hopper() && !options.overlap_previous {
        c.predecessor()
    } else {
        Predecessor::Unknown
    };
    let ctx = DecodeContext {
        overlap_previous: options.overlap_previous,
        predecessor,
    };
    plan::plan(&call, &limits, ctx, options.choice)
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
    // The plan's kernels, with the DoRA epilogue compiled in where a target carries one.
    let epilogue = Epilogue::of(targets);
    match plan.form {
        DecodeForm::RowRegisters { straight_line } => rows::launch_rows(
            c,
            x,
            idx.device_addr(),
            target_params,
            targets,
            y,
            chain,
            straight_line,
            epilogue,
        ),
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
            epilogue,
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
                row_form_expand_slots(c.sm_count as usize, n_targets),
            )
            .ok_or_else(|| invalid("plan", "the two-phase scratch does not hold the call"))?;
            launch_two_phase(c, x, idx, target_params, targets, stride, y, two, form, chain, epilogue)
        }
        DecodeForm::Fused(form) => launch_fused(c, x, idx, target_params, targets, stride, y, form, chain, epilogue),
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
    epilogue: Epilogue,
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
    };
    let plan = SmemPlan::choose(shape, splits, true);
    let kernel = DecodeKernel::Fused {
        cluster: cl,
        tensor_cores,
        listed: list,
        y: OutputKind::of::<Y>(),
    }
    .kernel(epilogue)?;
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
        off_r: to_i32("smem", plan.off_r)?,
        push: i32::from(form.push_sum),
        overlap: i32::from(overlap),
        b_pitch: to_i32("rank_stride", plan.b_pitch)?,
        pad: 0,
        targets: *target_params,
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
        // list only after `griddepcontrol.wait`. As a dependent
        // launch (`overlap`) `bgmv_list` reads idx and the tables before its wait
        // and writes the scratch only after it.
        unsafe {
            c.launch_chained(
                DecodeKernel::ItemList.kernel(epilogue)?,
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

/// K slices of the two-phase shrink: enough that its units (one per row
/// and slice) fill the grid once, at most `ks_max`, rounded down to a power
/// of two (whole 256-column warp passes when `in` is a multiple of 4096).
fn two_phase_slices(grid: usize, rows: usize, ks_max: usize) -> usize {
    let ks = (grid / rows.max(1)).clamp(1, ks_max.max(1));
    1 << ks.ilog2()
}

/// The two-phase decode: `bgmv2_shrink*_rows` then `bgmv2_expand_rows_*`,
/// through the backend's scratch (held for both launches).
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
    epilogue: Epilogue,
) -> Result<(), KernelError> {
    let n = x.n_rows;
    let n_targets = targets.len();
    let sms = c.sm_count as usize;
    let max_out = targets.iter().map(|t| t.out_dim).max().unwrap_or(0);
    // Every block resident at once; more units than blocks are walked in turn.
    let shrink_blocks = (n * plan.ks_max).min(sms * SHRINK_BLOCKS_PER_SM).max(1);
    let expand_blocks = (n * max_out.div_ceil(plan.cols)).min(sms * EXPAND_BLOCKS_PER_SM).max(1);
    let shrink = DecodeKernel::Shrink {
        tensor_cores: forms.shrink_tensor_cores,
    }
    .kernel(epilogue)?;
    let expand = DecodeKernel::Expand {
        y: OutputKind::of::<Y>(),
    }
    .kernel(epilogue)?;
    let row_ks = two_phase_slices(shrink_blocks, n, plan.ks_max);
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
            pad: 0,
            overlap: chain as i32,
            row_ks: to_i32("k_splits", row_ks)?,
            targets: *target_params,
        };
        // SAFETY: `Bgmv2Params` mirrors the kernels' struct (sizes asserted on both
        // sides). The host checked x, y, idx and the targets as for the fused
        // kernel; `plan` keeps every header and partial the kernels address
        // inside the scratch (`scratch_bytes <= SCRATCH_BYTES`, n <= 512 rows),
        // which `with_scratch` holds for both launches; the kernels check each
        // index and each entry's rank before reading A and B through table addresses.
        // Under the overlap (`Chain::EarlyReads`) the shrink reads x and touches
        // the scratch only after its wait; idx and the tables before it, which
        // the caller promised the previous kernel does not write. Waiting first
        // its blocks wait before any read and let the expand in only after
        // that wait. The expand checks each row's index and entry
        // itself and reads idx, the tables and B before its wait (the shrink
        // writes none of them), and y only where the shrink is not under the
        // overlap (every earlier kernel then completed before the shrink's
        // blocks let the expand in); a next kernel it lets in early waits for
        // it (the contract of `launch_chained`).
        unsafe {
            c.launch_chained(
                shrink,
                Launch {
                    grid: (to_u32("grid", shrink_blocks)?, 1, to_u32("grid", n_targets)?),
                    block: THREADS,
                    smem: 0,
                },
                &params,
                chain.dependent(),
            )?;
            let shape = Launch {
                grid: (to_u32("grid", expand_blocks)?, 1, to_u32("grid", n_targets)?),
                block: THREADS,
                smem: to_u32("smem", plan.expand_smem)?,
            };
            // The expand runs `griddepcontrol.wait` before it reads the scratch.
            c.launch_chained(expand, shape, &params, true)
        }
    })
}

/// The constants the decode kernels and this host code share, as the
/// `#define`s of every translation unit's prelude (`cuda_rt::prelude`):
/// written once here, never in the CUDA sources.
pub(crate) fn cuda_defines() -> Vec<(&'static str, usize)> {
    vec![
        ("BGMV_THREADS", THREADS as usize),
        ("BGMV_G", ITEM_ROWS),
        ("BGMV_MAX_RANK", BGMV_MAX_RANK),
        ("BGMV_WIN_MAX", WINDOW_MAX),
        ("BGMV_LIST_MAP", ITEM_LIST_MAX_ENTRIES),
        ("BGMV2_DESC_OFF", TWO_PHASE_DESC_OFF),
        ("BGMV2_MAX_SPLITS", TWO_PHASE_MAX_SPLITS),
        ("BGE_THREADS", entry::THREADS as usize),
        ("BGE_MAX_ROWS", ENTRY_MAX_ROWS),
        ("BGE_REG_MAX_ROWS", ENTRY_REGISTERS_MAX_ROWS),
        ("BGR_THREADS", rows::THREADS as usize),
        ("BGR_PIECES", rows::PIECES_PER_BLOCK),
        ("BGR_RANKS", ROWS_STRIDE),
    ]
}

#[cfg(test)]
mod tests;
