//! The decode rule table: which form, kernel and launch shape serves a
//! row-indexed apply ([`super::bgmv`]).
//!
//! [`plan`] is a pure function of a [`DecodeCall`] (the validated,
//! device-free description of one call), the device's [`DeviceLimits`],
//! the caller's promises and launch position ([`DecodeContext`]) and a
//! [`Choice`]. It never launches, so every decision runs and is tested on
//! the CPU (the recorded table `plan.golden`); `super::launch` then runs
//! what the [`DecodePlan`] says, with no decision of its own.
//!
//! The forms, in the order the rules try them:
//! - [`DecodeForm::RowRegisters`] (`rows.rs`, `cuda/bgmv_rows.cu`): a cluster
//!   of 2 per (row, target), A, x, B and y straight into registers; batches of
//!   mostly distinct adapters.
//! - [`DecodeForm::Entry`] (`entry.rs`, `cuda/bgmv_entry.cu`): a cluster (or
//!   the spread kernel's 4 blocks) per table entry serving all its rows.
//! - [`DecodeForm::TwoPhase`] (`cuda/bgmv.cu`, `bgmv2_*`): a shrink into the
//!   device's scratch, then an expand; mid-sized batches of large adapters.
//! - [`DecodeForm::Fused`] (`cuda/bgmv.cu`): one kernel, items of up to 8
//!   rows of one entry found by a window scan or (on tensor cores) a first
//!   launch's item list.
//!
//! How each form works: the module docs of `rows.rs`, `entry.rs` and
//! [`super`] (the fused kernel and the two launches). The measurements
//! behind every threshold: NOTES.md (its current-state table and the
//! versions it cites).
//!
//! # Launch chains ([`Chain`])
//!
//! How an apply's first launch follows the stream's previous kernel:
//!
//! - **Waiting first** ([`Chain::WaitFirst`], [`Chain::WaitFirstEarlyNext`];
//!   sm_90): the entry-clustered and row-register kernels and the two-phase
//!   shrink are launched as programmatic dependents of the previous kernel
//!   whose blocks execute `griddepcontrol.wait` before their first read.
//!   They run in a plain launch's order, whatever that kernel writes, but
//!   are resident, their launch done, when it ends. Each lets the next
//!   kernel launch early the same way (`griddepcontrol.launch_dependents`: a
//!   kernel launched so waits before it reads what this one writes, as
//!   every kernel of the crate does): as soon as its blocks waited
//!   ([`Chain::WaitFirstEarlyNext`]) where they are at most one a
//!   multiprocessor at rank strides up to 32 (`lets_next_in_early`; the
//!   row-register form and the spread kernel always), so the next kernel's
//!   blocks take the idle multiprocessors; else once their work is out
//!   ([`Chain::WaitFirst`]; the two-phase expand: before its blocks' last
//!   stores), since early blocks would land where the kernel's own
//!   placement would not put them. The two-phase shrink lets its expand in
//!   only after its wait, so the expand, which reads y before its own
//!   wait, still starts after every earlier kernel completed.
//!   Measured faster than plain launches, NOTES.md v34-v36. The fused
//!   kernel and the item list never wait first.
//! - **The root-node rule** ([`DecodeContext::predecessor`]): captured
//!   where no kernel precedes the launch ([`Predecessor::NoKernel`]: a
//!   graph's root node, or after a copy, memset or event, as the driver's
//!   capture state names the nodes the launch would follow), nothing would
//!   overlap its start, and the weight prefetch and the spread kernel that
//!   waiting first brings only cost time: the rules launch plain there,
//!   without either (`wait_first_by_default`; NOTES.md v36). Outside a
//!   capture, or with a driver too old to say ([`Predecessor::Unknown`]),
//!   a kernel may be running: the launch waits first.
//! - **The overlap promise** ([`DecodeContext::overlap_previous`], from
//!   `DecodeOptions::overlap_previous`; [`Chain::EarlyReads`]): the caller
//!   promises that the previous kernel writes neither the row indices, the
//!   pair tables nor the adapter weights (in an engine the apply follows
//!   the base projection, which writes y). The first launch is then a
//!   programmatic dependent that reads before its wait what depends only on
//!   those: the fused kernel's scanning form idx, the table entries and its
//!   first item's A and B; `bgmv_list` and the two-phase shrink idx and the
//!   tables; x, y and the device's scratch are touched only after the
//!   wait. It takes the place of waiting first. Under it the rules keep
//!   batches of one window of up to 256 rows on the scan (the list's launch
//!   would wait for the previous kernel, where every block's scan overlaps
//!   it), and rules 1 and 3 and rule 2's one-round branch do not apply
//!   (the `_full` kernels read x before the B rows; for one-row entries the
//!   fused launch's early reads measured faster, NOTES.md). Off by
//!   default: only the caller knows what the previous kernel writes.
//!
//! The weight prefetch ([`DecodeForm::Entry`]'s `prefetch`) needs a launch
//! that waits first at rank stride 16; an exact plan asking for it
//! elsewhere, or for early reads without the promise, or for waiting first
//! before sm_90, is refused ([`plan`] with [`Choice::Exact`]).

use std::fmt;

use super::entry::{self, EntryShape};
use super::rows::{self, RowsShape};
use super::{
    ITEM_LIST_MAX_ENTRIES, ITEM_ROWS, LIST_STATIC_SMEM, PlanShape, STATIC_SMEM, SmemPlan, THREADS, TWO_PHASE_ROW_COLS,
    TWO_PHASE_WIDE_OUT, TwoPhasePlan, WINDOW_LARGE, WINDOW_MAX, fused_threads, item_list_fits, piece8,
    row_form_expand_slots, row_windows,
};
use crate::cuda_rt::SCRATCH_BYTES;
use crate::error::{KernelError, invalid};
use crate::ops::limits::{Choice, DeviceLimits};
use crate::ops::{LoraTarget, MAX_TARGETS, OutputElem, Rows, RowsMut};

pub use crate::cuda_rt::Predecessor;

/// The element of y.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputKind {
    /// BF16 activations.
    Bf16,
    /// F32 (router logits).
    F32,
}

impl OutputKind {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            OutputKind::Bf16 => 2,
            OutputKind::F32 => 4,
        }
    }

    pub(super) fn of<Y: OutputElem>() -> OutputKind {
        if Y::NAME == "bf16" {
            OutputKind::Bf16
        } else {
            OutputKind::F32
        }
    }
}

/// One target of a call as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CallTarget {
    /// Outputs of the target.
    pub out_dim: usize,
    /// First column of y it writes.
    pub y_col_offset: usize,
    /// Entries of its table.
    pub n_entries: usize,
}

/// A validated, device-free description of one decode apply: what every
/// launch decision reads, and nothing else (no buffer, no address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeCall {
    rows: usize,
    in_dim: usize,
    x_stride: usize,
    /// Alignment of x's first row, bytes (a power of two, at most 16).
    x_align: u64,
    y: OutputKind,
    y_stride: usize,
    /// Alignment of y's first row, bytes (a power of two, at most 16).
    y_align: u64,
    rank_stride: usize,
    n_targets: usize,
    targets: [CallTarget; MAX_TARGETS],
}

/// The alignment of an address, bytes, capped at 16 (what any form asks for).
fn align_of(addr: u64) -> u64 {
    if addr == 0 {
        16
    } else {
        (1u64 << addr.trailing_zeros().min(4)).min(16)
    }
}

impl DecodeCall {
    /// A call on dense, 16-byte aligned x `[rows, in_dim]` and y rows of the
    /// targets' total width (what a pool's buffers are), for planning ahead
    /// of the buffers (an engine's graph bookkeeping, logs, tests).
    pub fn dense(
        rows: usize,
        in_dim: usize,
        rank_stride: usize,
        y: OutputKind,
        targets: &[CallTarget],
    ) -> Result<DecodeCall, KernelError> {
        let width = targets.iter().map(|t| t.y_col_offset + t.out_dim).max().unwrap_or(0);
        DecodeCall::new(rows, in_dim, in_dim, 16, y, width, 16, rank_stride, targets)
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        rows: usize,
        in_dim: usize,
        x_stride: usize,
        x_align: u64,
        y: OutputKind,
        y_stride: usize,
        y_align: u64,
        rank_stride: usize,
        targets: &[CallTarget],
    ) -> Result<DecodeCall, KernelError> {
        if targets.is_empty() || targets.len() > MAX_TARGETS {
            return Err(invalid(
                "targets",
                format!("{} targets; 1..={MAX_TARGETS} allowed", targets.len()),
            ));
        }
        if rank_stride == 0 || rank_stride > super::BGMV_MAX_RANK {
            return Err(invalid(
                "rank_stride",
                format!("{rank_stride}; 1..={} allowed", super::BGMV_MAX_RANK),
            ));
        }
        let mut all = [CallTarget::default(); MAX_TARGETS];
        all[..targets.len()].copy_from_slice(targets);
        Ok(DecodeCall {
            rows,
            in_dim,
            x_stride,
            x_align,
            y,
            y_stride,
            y_align,
            rank_stride,
            n_targets: targets.len(),
            targets: all,
        })
    }

    /// The call of checked arguments (`super::bgmv_planned` validated them).
    pub(super) fn of<Y: OutputElem>(
        x: &Rows<'_, half::bf16>,
        targets: &[LoraTarget<'_>],
        rank_stride: usize,
        y: &RowsMut<'_, Y>,
    ) -> Result<DecodeCall, KernelError> {
        let t: Vec<CallTarget> = targets
            .iter()
            .map(|t| CallTarget {
                out_dim: t.out_dim,
                y_col_offset: t.y_col_offset,
                n_entries: t.n_entries,
            })
            .collect();
        DecodeCall::new(
            x.n_rows,
            x.width,
            x.stride,
            align_of(x.addr()),
            OutputKind::of::<Y>(),
            y.stride,
            align_of(y.addr()),
            rank_stride,
            &t,
        )
    }

    /// Rows of the batch.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of x (the adapters' `in`).
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// The pool's rank stride.
    pub fn rank_stride(&self) -> usize {
        self.rank_stride
    }

    /// The targets.
    pub fn targets(&self) -> &[CallTarget] {
        &self.targets[..self.n_targets]
    }

    fn max_out(&self) -> usize {
        self.targets().iter().map(|t| t.out_dim).max().unwrap_or(0)
    }

    fn max_entries(&self) -> usize {
        self.targets().iter().map(|t| t.n_entries).max().unwrap_or(0)
    }

    pub(super) fn entry_shape(&self, hopper: bool) -> EntryShape {
        EntryShape {
            hopper,
            n: self.rows,
            in_dim: self.in_dim,
            stride: self.rank_stride,
            x_stride: self.x_stride,
            x_addr: self.x_align,
            y_stride: self.y_stride,
            y_addr: self.y_align,
            y_name: match self.y {
                OutputKind::Bf16 => "bf16",
                OutputKind::F32 => "f32",
            },
        }
    }

    fn rows_shape(&self, hopper: bool) -> RowsShape {
        RowsShape {
            hopper,
            n: self.rows,
            in_dim: self.in_dim,
            stride: self.rank_stride,
        }
    }

    /// Whether the row-register form's straight-line (`_full`) kernels serve
    /// the call (`rows::full_form`).
    fn rows_full(&self, overlap: bool) -> bool {
        rows::full_form(
            self.in_dim,
            self.x_stride,
            self.x_align,
            self.y_stride,
            self.y_align,
            self.y.size(),
            self.targets(),
            overlap,
        )
    }
}

/// Where a launch issued now stands and what its caller promised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeContext {
    /// The caller's promise that the stream's previous kernel writes neither
    /// the row indices, the pair tables nor the adapter weights (in an
    /// engine: the apply follows the base projection, which writes y only).
    /// Lets the first kernel read those before the previous one completed
    /// ([`Chain::EarlyReads`]).
    pub overlap_previous: bool,
    /// What the launch follows in its stream or graph.
    pub predecessor: Predecessor,
}

impl Default for DecodeContext {
    fn default() -> Self {
        DecodeContext {
            overlap_previous: false,
            predecessor: Predecessor::Unknown,
        }
    }
}

/// How a launch follows the stream's previous kernel (`overlap` in the
/// kernels' parameter blocks; the values are `CHAIN_PLAIN` ..
/// `CHAIN_WAIT_FIRST_EARLY_NEXT` in `common.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Chain {
    /// A plain launch.
    Plain = 0,
    /// Under [`DecodeContext::overlap_previous`]: a programmatic dependent
    /// that reads idx, the tables and the adapters before it waits for that
    /// kernel, x, y and the scratch after.
    EarlyReads = 1,
    /// A programmatic dependent (sm_90) whose blocks wait for that kernel
    /// before they read anything (a plain launch's order, but resident when
    /// it ends), letting the next kernel launch once their work is out.
    WaitFirst = 2,
    /// The same, letting the next kernel launch as soon as they waited.
    WaitFirstEarlyNext = 3,
}

impl Chain {
    /// The chain of a call: the overlap where promised, else waiting first
    /// where chosen (the next kernel let in early or late).
    pub(super) fn of(overlap: bool, wait_first: bool, early_next: bool) -> Chain {
        match (overlap, wait_first, early_next) {
            (true, _, _) => Chain::EarlyReads,
            (false, true, true) => Chain::WaitFirstEarlyNext,
            (false, true, false) => Chain::WaitFirst,
            (false, false, _) => Chain::Plain,
        }
    }

    /// Whether the launch is a programmatic dependent.
    pub fn dependent(self) -> bool {
        self != Chain::Plain
    }

    /// Whether the blocks wait for the previous kernel before they read anything.
    pub fn waits_first(self) -> bool {
        matches!(self, Chain::WaitFirst | Chain::WaitFirstEarlyNext)
    }

    fn label(self) -> &'static str {
        match self {
            Chain::Plain => "plain",
            Chain::EarlyReads => "overlap",
            Chain::WaitFirst => "wait",
            Chain::WaitFirstEarlyNext => "wait+early",
        }
    }
}

/// Which kernel of the entry-clustered form a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryKernel {
    /// B and y staged in shared memory where they fit; clusters of 8 or 4.
    Staged {
        /// Blocks per cluster: 8 or 4.
        cluster: usize,
    },
    /// The register kernel (rank stride 16, clusters of 8, at most
    /// [`super::ENTRY_REGISTERS_MAX_ROWS`] rows, dims up to
    /// [`super::ENTRY_REGISTERS_MAX_DIM`]).
    Registers,
    /// No clusters: 4 blocks an entry and target exchanging partials through
    /// global memory, every block resident at once, one a multiprocessor.
    Spread,
}

/// The two-phase launches' choices (every row its own item: the `_rows`
/// kernels, K slices rounded down to a power of two, the expand a
/// programmatic dependent of the shrink).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TwoPhaseForm {
    /// The shrink on tensor cores (`bgmv2_shrink_tc_rows`).
    pub shrink_tensor_cores: bool,
    /// Outputs per expand unit (a multiple of 8, up to 4096).
    pub expand_cols: usize,
}

/// How the fused kernel finds its items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ItemList {
    /// Every block scans its row window.
    Scan,
    /// A first launch (`bgmv_list`) lists the items; the fused kernel (on
    /// tensor cores) waits for it.
    Listed,
}

/// The fused kernel's launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FusedForm {
    /// Blocks per cluster sharing an item's shrink: 1, or 2, 4, 8 (sm_90).
    pub cluster: usize,
    /// Clusters serving one item, each a slice of the outputs.
    pub out_splits: usize,
    /// Clusters per row window; as many as the window's rows with scalar
    /// clusters of 2 make the form row-mapped (a cluster per row).
    pub clusters_per_window: usize,
    /// Shrink and expand on tensor cores.
    pub tensor_cores: bool,
    /// How items are found.
    pub items: ItemList,
    /// The cluster sum pushes partials (`st.async`) instead of peer loads.
    pub push_sum: bool,
}

/// The form of a decode launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecodeForm {
    /// The row-register form; `straight_line`: its `_full` kernels.
    RowRegisters {
        /// The `_full` kernels (4096 x 4096 calls, aligned rows, no overlap).
        straight_line: bool,
    },
    /// The entry-clustered form.
    Entry {
        /// The kernel.
        kernel: EntryKernel,
        /// Waiting first at rank stride 16, each block asks its weights into
        /// L2 before the wait.
        prefetch: bool,
    },
    /// Two launches through the device's scratch.
    TwoPhase(TwoPhaseForm),
    /// The fused kernel (after `bgmv_list` where its items are listed).
    Fused(FusedForm),
}

/// What a decode apply launches: a plain value, printed as the bench's label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodePlan {
    /// The form and its kernel choices.
    pub form: DecodeForm,
    /// How its first launch follows the previous kernel.
    pub chain: Chain,
}

impl fmt::Display for DecodePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.form {
            DecodeForm::RowRegisters { straight_line } => {
                write!(f, "rows{}", if straight_line { " full" } else { "" })?;
            }
            DecodeForm::Entry { kernel, prefetch } => {
                match kernel {
                    EntryKernel::Staged { cluster } => write!(f, "entry c{cluster}")?,
                    EntryKernel::Registers => write!(f, "entry reg")?,
                    EntryKernel::Spread => write!(f, "entry spread")?,
                }
                if prefetch {
                    write!(f, " pf")?;
                }
            }
            DecodeForm::TwoPhase(t) => {
                write!(
                    f,
                    "two-phase rows cols{}{}",
                    t.expand_cols,
                    if t.shrink_tensor_cores { " tc" } else { "" },
                )?;
            }
            DecodeForm::Fused(u) => {
                write!(
                    f,
                    "fused c{} s{} cpw{} {} {} {}",
                    u.cluster,
                    u.out_splits,
                    u.clusters_per_window,
                    if u.tensor_cores { "tc" } else { "scalar" },
                    match u.items {
                        ItemList::Scan => "scan",
                        ItemList::Listed => "list",
                    },
                    if u.push_sum { "push" } else { "pull" },
                )?;
            }
        }
        write!(f, " ({})", self.chain.label())
    }
}

/// The plan a call runs: the rule table's ([`Choice::Auto`]) or the given
/// one, checked against the call, the device and the caller's promises.
pub fn plan(
    call: &DecodeCall,
    limits: &DeviceLimits,
    ctx: DecodeContext,
    choice: Choice<DecodePlan>,
) -> Result<DecodePlan, KernelError> {
    match choice {
        Choice::Auto => auto_under(call, limits, ctx),
        Choice::Exact(plan) => check(&Facts::of(call, limits, ctx), plan),
    }
}

/// What the rules read, computed once per call.
struct Facts<'a> {
    call: &'a DecodeCall,
    limits: &'a DeviceLimits,
    n: usize,
    stride: usize,
    n_targets: usize,
    max_out: usize,
    max_entries: usize,
    sms: usize,
    hopper: bool,
    overlap: bool,
    /// The launch waits first by default (`wait_first_by_default`).
    wait_first: bool,
}

impl<'a> Facts<'a> {
    fn of(call: &'a DecodeCall, limits: &'a DeviceLimits, ctx: DecodeContext) -> Facts<'a> {
        let hopper = limits.hopper();
        let overlap = ctx.overlap_previous;
        Facts {
            call,
            limits,
            n: call.rows,
            stride: call.rank_stride,
            n_targets: call.n_targets,
            max_out: call.max_out(),
            max_entries: call.max_entries(),
            sms: limits.multiprocessors,
            hopper,
            overlap,
            wait_first: hopper && !overlap && wait_first_by_default(ctx.predecessor),
        }
    }

    fn targets(&self) -> &[CallTarget] {
        self.call.targets()
    }

    fn y_size(&self) -> usize {
        self.call.y.size()
    }

    /// The fused kernel's view of the call for one choice of windows, tensor cores and item list.
    fn row_shape(&self, window: usize, n_windows: usize, tensor_cores: bool, list: bool) -> RowShape {
        RowShape {
            in_dim: self.call.in_dim,
            stride: self.stride,
            y_size: self.y_size(),
            window,
            n_windows,
            tensor_cores,
            list,
        }
    }

    /// The chain of a form whose first launch may wait first.
    fn chain(&self, early_next: bool) -> Chain {
        Chain::of(self.overlap, self.wait_first, early_next)
    }

    /// The fused kernel's only chains: the overlap where promised, else plain.
    fn fused_chain(&self) -> Chain {
        if self.overlap { Chain::EarlyReads } else { Chain::Plain }
    }
}

// ---------------------------------------------------------------------------
// The rule table. The rules run in this order; the first that takes the
// call decides. Measurements behind each threshold: NOTES.md (current-state
// table and the versions it cites).
// ---------------------------------------------------------------------------

/// 0. Under the overlap promise, row registers overlapped: up to
///    [`OVERLAP_ROW_REGISTER_ROWS`] rows of at most
///    [`ROW_REGISTER_ROWS_PER_ENTRY`] a table entry, where the general
///    row-register kernel serves the call.
/// 1. Row registers: [`ROW_REGISTER_ROWS`] rows of at most
///    [`ROW_REGISTER_ROWS_PER_ENTRY`] a table entry (mostly distinct
///    adapters), in calls the straight-line kernels serve (4096 x 4096,
///    aligned rows), not under the overlap. The general kernel alone
///    measured slower than the row-mapped form, so other shapes keep theirs.
/// 2. Entry clusters: [`ENTRY_MIN_ROWS`] rows or more with at least
///    [`ENTRY_MIN_ROWS_PER_ENTRY`] per entry (each adapter's bytes read once
///    for its rows), or, not under the overlap, rank stride 16 and at most
///    [`ENTRY_ONE_ROUND_MAX_OUT`] outputs with every entry's cluster of 8
///    resident at once.
/// 3. Row-mapped fused: sm_90, [`ROW_MAPPED_MIN_ROWS`] rows or more whose
///    scalar clusters of 2 (one per row and target) fit one round, not under
///    the overlap.
/// 4. Two launches: [`TWO_PHASE_ROWS`] rows, except few adapters (more
///    than [`MULTI_ROW_ITEMS`] rows an entry), small adapters of up to 64
///    rows (rank stride 16, at most 8192 outputs and, on sm_90, at most
///    [`TWO_PHASE_SMALL_IN`] inputs) and batches the fused launch serves in
///    one round.
///    Before it (rule 4½, [`head_rule`]): a vocabulary-wide [`tall`] call
///    of 2 to `WINDOW_MAX` rows takes the two launches, and of one row
///    where it is not overlapped.
/// 5. Fused: tensor cores and the item list for [`TENSOR_CORE_MIN_ROWS`]
///    rows or more (or few adapters in the two-launch range; the list not
///    under the overlap up to 256 rows), clusters and splits by the cost
///    model ([`LaunchChoice::pick`]).
/// 6. Tall outputs (widening pairs, [`tall`]; an output head over the
///    vocabulary): where no rule above serves the call (a fused block
///    cannot stage its B and y slices beside A and x at
///    [`MAX_OUT_SPLITS`] splits), two launches up to
///    `WINDOW_MAX` rows (the expand tiles the columns: any width), else the
///    fused kernel in the fewest output splits that fit ([`tall_splits`]). It only serves calls every other rule refused, so
///    no other call's plan depends on it.
///
/// Under the overlap promise the rules run twice: with it, and as if it
/// were not given; the overlapped plan is taken only where its form was
/// measured faster than the plain plan (`overlap_wins`), else the plain
/// one (a promise permits the overlap, it never obliges it).
fn auto_under(call: &DecodeCall, limits: &DeviceLimits, ctx: DecodeContext) -> Result<DecodePlan, KernelError> {
    if ctx.overlap_previous {
        let overlapped = auto(&Facts::of(call, limits, ctx))?;
        // Measured on the H200 only: before sm_90 the overlapped plans stay.
        if !limits.hopper() || overlap_wins(&overlapped) {
            return Ok(overlapped);
        }
    }
    let plain = DecodeContext {
        overlap_previous: false,
        ..ctx
    };
    auto(&Facts::of(call, limits, plain))
}

/// The overlapped forms that beat the plain rule table's plan at every
/// bench shape where the rules choose them (H200, in a graph, NOTES.md
/// v37, run 353): the scalar fused kernel in clusters of 8 (n = 1 2.66
/// against 3.95 µs, n = 16 3.70 against 4.90, n = 32 of 32 5.58 against
/// 5.87) and the two launches (rank 64 21.50 against 22.03, 14336 outputs
/// 16.47 against 16.98). The others lost or tied (e.g. n = 64 of 8
/// adapters named in a 64-entry table: the fused clusters of 2 overlapped
/// 15.84 against the row-register form's 5.60). Rule 0's overlapped
/// row-register kernel too (NOTES.md v38).
fn overlap_wins(plan: &DecodePlan) -> bool {
    plan.chain == Chain::EarlyReads
        && match plan.form {
            DecodeForm::TwoPhase(_) | DecodeForm::RowRegisters { .. } => true,
            DecodeForm::Fused(u) => u.cluster == 8 && !u.tensor_cores,
            _ => false,
        }
}

fn auto(f: &Facts<'_>) -> Result<DecodePlan, KernelError> {
    if let Some(plan) = overlap_row_registers_rule(f) {
        return Ok(plan);
    }
    if let Some(plan) = row_registers_rule(f) {
        return Ok(plan);
    }
    if let Some(plan) = entry_rule(f) {
        return Ok(plan);
    }
    if let Some(plan) = row_mapped_rule(f) {
        return Ok(plan);
    }
    if let Some(plan) = head_rule(f) {
        return Ok(plan);
    }
    let fused = fused_default(f);
    if let Some(plan) = two_phase_rule(f, fused.as_ref().ok().map(|(_, rounds)| *rounds)) {
        return Ok(plan);
    }
    match fused {
        Ok((plan, _)) => Ok(plan),
        Err(refusal) => tall_rule(f).ok_or(refusal),
    }
}

/// Outputs from which a [`tall`] call is an output head (a vocabulary:
/// no other projection of the supported families is this wide).
pub(super) const HEAD_MIN_OUT: usize = 32_768;

/// Rows from which an output head takes the two launches ([`head_rule`]).
pub(super) const HEAD_TWO_PHASE_ROWS: std::ops::RangeInclusive<usize> = 2..=WINDOW_MAX;

/// Rule 4½, output heads: a [`tall`] call of at least [`HEAD_MIN_OUT`]
/// outputs and [`HEAD_TWO_PHASE_ROWS`] rows, or of one row not under the
/// overlap, takes the two launches (the expand tiles the vocabulary's
/// columns over every multiprocessor) where the rules above would give the
/// fused kernel, whose clusters each stage a sixth of the vocabulary.
/// Measured (H100, a Llama-3 head of 128256 outputs, rank 16, one adapter
/// a row, in a graph, BENCHMARKS.md "The output head"): n = 16 33.2 µs
/// against the fused kernel's 68.5; n = 4, 8, 15 11.2, 17.6, 30.0 against
/// 17.8, 33.4, 63.5 (overlapped 11.2, 18.2, 31.0 against 15.7, 30.5,
/// 56.3); n = 1 6.4 against 9.5, but overlapped the fused kernel's 4.8
/// against 6.6, so one overlapped row keeps the rules' plan. At n = 64 the
/// two launches were the rules' plan already.
fn head_rule(f: &Facts<'_>) -> Option<DecodePlan> {
    let rows = HEAD_TWO_PHASE_ROWS.contains(&f.n) || (f.n == 1 && !f.overlap);
    if !tall(f) || f.max_out < HEAD_MIN_OUT || !rows {
        return None;
    }
    two_launches(f)
}

/// Output splits the fused kernel takes for a call that is not [`tall`].
pub(super) const MAX_OUT_SPLITS: usize = 16;

/// Whether the call widens: its widest target has more outputs than the
/// call has inputs (an output head over the vocabulary, 32k to 256k
/// columns from a few thousand inputs, is the extreme). A block of the
/// fused kernel stages its slice of B and y, so at [`MAX_OUT_SPLITS`]
/// splits a wide enough output leaves A and x no shared memory; a
/// narrowing or square pair never needs more splits than that for its
/// width, and keeps the rule table's answers as recorded (`plan.golden`).
fn tall(f: &Facts<'_>) -> bool {
    f.max_out > f.call.in_dim
}

/// The most output splits an exact fused plan may ask for: [`MAX_OUT_SPLITS`],
/// or for a [`tall`] call one a 64-column slice of its narrowest target.
fn most_out_splits(f: &Facts<'_>) -> usize {
    if tall(f) {
        let narrowest = f.targets().iter().map(|t| t.out_dim).min().unwrap_or(0);
        (narrowest / 64).max(MAX_OUT_SPLITS)
    } else {
        MAX_OUT_SPLITS
    }
}

/// Rule 6: a [`tall`] call the rules above refused.
fn tall_rule(f: &Facts<'_>) -> Option<DecodePlan> {
    if !tall(f) {
        return None;
    }
    if let Some(plan) = two_launches(f) {
        return Some(plan);
    }
    let listed = item_list_by_default(f.n, f.max_entries, f.overlap)
        && f.targets().iter().all(|t| t.n_entries <= ITEM_LIST_MAX_ENTRIES);
    let (window, n_windows) = row_windows(f.n, listed, f.n_targets);
    let tensor_cores = many_rows(f.n, f.max_entries);
    let list = listed && item_list_fits(window, n_windows, f.n_targets);
    let rows = f.row_shape(window, n_windows, tensor_cores, list);
    let choice = tall_splits(f).find_map(|splits| {
        let fixed = Fixed {
            out_splits: Some(splits),
            ..Fixed::default()
        };
        LaunchChoice::pick(f.limits, rows, f.targets(), fixed).ok()
    })?;
    check_fused_grid(f, n_windows, choice.cpw).ok()?;
    let items = if list { ItemList::Listed } else { ItemList::Scan };
    Some(fused_plan(&choice, tensor_cores, items, f.fused_chain()))
}

/// The output splits rule 6 tries for a [`tall`] call's fused plan, the
/// first that fits taken: doubling from twice [`MAX_OUT_SPLITS`] up to
/// [`most_out_splits`]. Each split recomputes the rank vector (A and x
/// read again, `in` x rank), which for a head costs far less than the B
/// rows (vocab x rank) it no longer stages in one block.
fn tall_splits(f: &Facts<'_>) -> impl Iterator<Item = usize> {
    let most = most_out_splits(f);
    std::iter::successors(Some(MAX_OUT_SPLITS * 2), move |&s| {
        (s < most).then(|| (s * 2).min(most))
    })
    .take_while(move |&s| s <= most)
}

/// Batches rule 0 serves under the overlap promise (sm_90, rank stride 16).
pub(super) const OVERLAP_ROW_REGISTER_ROWS: std::ops::RangeInclusive<usize> = 1..=64;

/// Rule 0, under the overlap promise: the general row-register kernel
/// reading its weights before the previous kernel completes, for up to 64
/// rows of at most [`ROW_REGISTER_ROWS_PER_ENTRY`] a table entry wherever
/// the form serves the call (in up to 4096, targets up to 4096 outputs).
/// Measured faster than every other plan under the promise (H100, NOTES.md
/// v38; 32 launches in one graph, n = 64 of 64 adapters: the fused q|k|v
/// site 559.7 µs against 622.8 for the best fused plan and 753.5 for the
/// rule table's before, o 263.9 against 292.3; one launch in a graph
/// against the best other plan under the promise, same call: n = 1 2.59
/// against 2.78, n = 16 2.92 against 3.92, n = 32 3.90 against 5.90,
/// n = 64 8.37 against 9.72).
fn overlap_row_registers_rule(f: &Facts<'_>) -> Option<DecodePlan> {
    let takes = f.overlap
        && OVERLAP_ROW_REGISTER_ROWS.contains(&f.n)
        && f.n <= ROW_REGISTER_ROWS_PER_ENTRY.saturating_mul(f.max_entries)
        && f.call.rows_shape(f.hopper).check(f.targets()).is_ok();
    takes.then_some(DecodePlan {
        form: DecodeForm::RowRegisters { straight_line: false },
        chain: Chain::EarlyReads,
    })
}

/// Batches rule 1 serves (sm_90, rank stride 16).
pub(super) const ROW_REGISTER_ROWS: std::ops::RangeInclusive<usize> = 32..=64;
/// Most rows per table entry rule 1 takes: rows of one adapter each read its weights.
pub(super) const ROW_REGISTER_ROWS_PER_ENTRY: usize = 2;

fn row_registers_rule(f: &Facts<'_>) -> Option<DecodePlan> {
    let takes = !f.overlap
        && ROW_REGISTER_ROWS.contains(&f.n)
        && f.n <= ROW_REGISTER_ROWS_PER_ENTRY.saturating_mul(f.max_entries)
        && f.call.rows_shape(f.hopper).check(f.targets()).is_ok()
        && f.call.rows_full(false);
    // The form lets the next kernel in early wherever it waits first.
    takes.then(|| DecodePlan {
        form: DecodeForm::RowRegisters { straight_line: true },
        chain: f.chain(true),
    })
}

/// Rows per entry from which rule 2 serves a batch of [`ENTRY_MIN_ROWS`] rows or more.
pub(super) const ENTRY_MIN_ROWS_PER_ENTRY: usize = 2;
/// Widest output rule 2 serves with one row per entry (the one-round case).
pub(super) const ENTRY_ONE_ROUND_MAX_OUT: usize = 8192;
/// Batch sizes from which rule 2 serves batches of several rows per entry.
pub(super) const ENTRY_MIN_ROWS: usize = 32;
/// Rows per entry from which the entry form runs its register kernel.
pub(super) const ENTRY_REGISTERS_ROWS_PER_ENTRY: usize = 8;

fn entry_rule(f: &Facts<'_>) -> Option<DecodePlan> {
    let entries = f.max_entries.max(1);
    let several_rows = f.n >= ENTRY_MIN_ROWS && f.n >= ENTRY_MIN_ROWS_PER_ENTRY * entries;
    let one_round = !f.overlap
        && f.stride <= 16
        && f.max_out <= ENTRY_ONE_ROUND_MAX_OUT
        && entries * 8 * f.n_targets.max(1) <= entry::cluster_block_slots(16, f.limits);
    if !(several_rows || one_round) || f.call.entry_shape(f.hopper).check(f.targets()).is_err() {
        return None;
    }
    let cluster = entry_cluster(f.stride, f.max_entries, f.limits);
    let registers = entry::registers_serve(f.stride, cluster, f.n, f.call.in_dim, f.max_out).is_ok()
        && entry_registers_by_default(f.n, f.max_entries);
    let one_a_multiprocessor = lets_next_in_early(f.stride, cluster, f.max_entries, f.n_targets, f.sms);
    // Where clusters of 8 would be more than one block a multiprocessor and
    // the launch waits first, the spread kernel spreads them evenly.
    let spread = !one_a_multiprocessor
        && f.wait_first
        && entry::spread_serves(
            f.stride,
            f.n,
            f.call.in_dim,
            f.max_out,
            f.max_entries,
            f.n_targets,
            f.sms,
        )
        .is_ok();
    let kernel = if spread {
        EntryKernel::Spread
    } else if registers {
        EntryKernel::Registers
    } else {
        EntryKernel::Staged { cluster }
    };
    // Weights asked into L2 before the wait at rank 16 where the next
    // kernel also comes early to ask for its own.
    let prefetch = spread || (f.stride == 16 && one_a_multiprocessor);
    let chain = f.chain(spread || one_a_multiprocessor || prefetch);
    Some(DecodePlan {
        form: DecodeForm::Entry {
            kernel,
            prefetch: prefetch && chain.waits_first() && f.stride == 16,
        },
        chain,
    })
}

/// Rule 2's blocks per cluster: 8, except past rank stride 16 where
/// clusters of 8 for every entry would not all be resident at once
/// (`entry::cluster_block_slots`): clusters of 4 then take one round.
pub(super) fn entry_cluster(stride: usize, entries: usize, limits: &DeviceLimits) -> usize {
    if stride <= 16 || entries.saturating_mul(8) <= entry::cluster_block_slots(stride, limits) {
        8
    } else {
        4
    }
}

/// Rule 2's register kernel requests each block's weights before the row
/// indices arrive: worth it where few entries go unused, with
/// [`ENTRY_REGISTERS_ROWS_PER_ENTRY`] rows per entry of the largest table.
pub(super) fn entry_registers_by_default(n: usize, max_entries: usize) -> bool {
    n >= ENTRY_REGISTERS_ROWS_PER_ENTRY.saturating_mul(max_entries.max(1))
}

/// Whether an entry-form launch that waits first lets the next kernel in as
/// soon as its blocks waited: where they (`cluster` per entry and target)
/// are at most one a multiprocessor at rank strides up to 32, so the next
/// kernel's blocks take the idle ones (and, at rank 16, its weights are
/// asked into L2 before the wait).
pub(super) fn lets_next_in_early(stride: usize, cluster: usize, entries: usize, n_targets: usize, sms: usize) -> bool {
    stride <= 32 && cluster.saturating_mul(entries.max(1)).saturating_mul(n_targets.max(1)) <= sms
}

/// Rows from which rule 3 maps a cluster to each row.
pub(super) const ROW_MAPPED_MIN_ROWS: usize = 48;

fn row_mapped_rule(f: &Facts<'_>) -> Option<DecodePlan> {
    let one_round = f.n.checked_mul(2 * f.n_targets).is_some_and(|blocks| blocks <= f.sms);
    if !(f.hopper && !f.overlap && f.n >= ROW_MAPPED_MIN_ROWS && one_round) {
        return None;
    }
    let rows = f.row_shape(f.n, 1, false, false);
    let fixed = Fixed {
        cluster: Some(2),
        out_splits: Some(1),
        clusters_per_window: Some(f.n),
        ..Fixed::default()
    };
    let choice = LaunchChoice::pick(f.limits, rows, f.targets(), fixed).ok()?;
    (choice.rounds == 1).then(|| fused_plan(&choice, false, ItemList::Scan, f.fused_chain()))
}

/// Batch sizes rule 4 may serve in two launches.
pub(super) const TWO_PHASE_ROWS: std::ops::RangeInclusive<usize> = 32..=128;
/// Rows per table entry past which a batch of [`TWO_PHASE_ROWS`] rows is
/// served like a large one (tensor cores and the item list, rule 5).
pub(super) const MULTI_ROW_ITEMS: usize = 2;

fn two_phase_rule(f: &Facts<'_>, fused_rounds: Option<usize>) -> Option<DecodePlan> {
    if !two_phase_by_default(
        f.n,
        f.stride,
        f.call.in_dim,
        f.max_out,
        f.max_entries,
        fused_rounds,
        f.hopper,
    ) {
        return None;
    }
    two_launches(f)
}

/// The rules' two-launch plan for a call (rules 4, 4½ and 6): the scalar
/// shrink, the expand's default column tile, the chain by the launch
/// position. `None` where the two launches do not serve the call.
fn two_launches(f: &Facts<'_>) -> Option<DecodePlan> {
    let two = two_phase_layout(f, None)?;
    Some(DecodePlan {
        form: DecodeForm::TwoPhase(TwoPhaseForm {
            shrink_tensor_cores: false,
            expand_cols: two.cols,
        }),
        chain: f.chain(false),
    })
}

/// Rule 4's condition: [`TWO_PHASE_ROWS`] rows, not few adapters, not up
/// to 64 rows of small adapters (rank stride 16, at most 8192 outputs),
/// and not a batch the fused launch serves in one round (`fused_rounds`).
pub(super) fn two_phase_by_default(
    n: usize,
    stride: usize,
    in_dim: usize,
    max_out: usize,
    max_entries: usize,
    fused_rounds: Option<usize>,
    hopper: bool,
) -> bool {
    // The wide-input exception was measured on sm_90 only.
    let narrow = in_dim <= TWO_PHASE_SMALL_IN || !hopper;
    let small = stride <= 16 && narrow && max_out <= TWO_PHASE_WIDE_OUT;
    TWO_PHASE_ROWS.contains(&n) && !few_adapters(n, max_entries) && !(n <= 64 && small) && fused_rounds != Some(1)
}

/// Widest input of the small adapters rule 4 leaves to the fused kernel up
/// to 64 rows (with rank stride 16 and at most [`TWO_PHASE_WIDE_OUT`]
/// outputs). Past it, two launches measured faster: Llama-3.1-8B's down
/// projection (in = 14336, out = 4096), n = 64 of 64 adapters, 32 launches
/// in one graph (H100, NOTES.md v38): 626.9 µs against the fused kernel's
/// 879.6, under the overlap promise 614.8 against 862.5.
pub(super) const TWO_PHASE_SMALL_IN: usize = 4096;

/// The two launches' layout where the scratch and shared memory hold it.
fn two_phase_layout(f: &Facts<'_>, cols: Option<u32>) -> Option<TwoPhasePlan> {
    TwoPhasePlan::new(
        f.n,
        f.call.in_dim,
        f.stride,
        f.n_targets,
        f.max_out,
        f.y_size(),
        cols,
        SCRATCH_BYTES,
        row_form_expand_slots(f.sms, f.n_targets),
    )
    .filter(|two| two.expand_smem <= f.limits.smem_optin)
}

/// The fused kernel uses tensor cores (and the item list) from this many
/// rows on; below, its scalar path, whose smaller code suits a cold
/// instruction cache.
pub(super) const TENSOR_CORE_MIN_ROWS: usize = 129;

/// Items of several rows are likely: [`TENSOR_CORE_MIN_ROWS`] rows, or few
/// adapters for [`TWO_PHASE_ROWS`] rows.
fn many_rows(n: usize, max_entries: usize) -> bool {
    n >= TENSOR_CORE_MIN_ROWS || few_adapters(n, max_entries)
}

/// A batch of [`TWO_PHASE_ROWS`] rows of more than [`MULTI_ROW_ITEMS`] rows an entry.
fn few_adapters(n: usize, max_entries: usize) -> bool {
    TWO_PHASE_ROWS.contains(&n) && n > MULTI_ROW_ITEMS.saturating_mul(max_entries)
}

/// Rule 5's item list: where items hold several rows, except under the
/// overlap for one window of up to [`WINDOW_LARGE`] rows (every block's scan
/// then overlaps the previous kernel, where the list's launch would wait).
fn item_list_by_default(n: usize, max_entries: usize, overlap: bool) -> bool {
    many_rows(n, max_entries) && !(overlap && n <= WINDOW_LARGE)
}

/// Rule 5, and the rounds rule 4 compares with.
fn fused_default(f: &Facts<'_>) -> Result<(DecodePlan, usize), KernelError> {
    let listed = item_list_by_default(f.n, f.max_entries, f.overlap)
        && f.targets().iter().all(|t| t.n_entries <= ITEM_LIST_MAX_ENTRIES);
    let (window, n_windows) = row_windows(f.n, listed, f.n_targets);
    let tensor_cores = many_rows(f.n, f.max_entries);
    let list = listed && item_list_fits(window, n_windows, f.n_targets);
    let rows = f.row_shape(window, n_windows, tensor_cores, list);
    let choice = LaunchChoice::pick(f.limits, rows, f.targets(), Fixed::default())?;
    let items = if list { ItemList::Listed } else { ItemList::Scan };
    let plan = fused_plan(&choice, tensor_cores, items, f.fused_chain());
    check_fused_grid(f, n_windows, choice.cpw)?;
    Ok((plan, choice.rounds))
}

fn fused_plan(choice: &LaunchChoice, tensor_cores: bool, items: ItemList, chain: Chain) -> DecodePlan {
    DecodePlan {
        form: DecodeForm::Fused(FusedForm {
            cluster: choice.cluster,
            out_splits: choice.plan.splits,
            clusters_per_window: choice.cpw,
            tensor_cores,
            items,
            push_sum: choice.push,
        }),
        chain,
    }
}

fn check_fused_grid(f: &Facts<'_>, n_windows: usize, cpw: usize) -> Result<(), KernelError> {
    let grid_y = n_windows.saturating_mul(cpw);
    if grid_y > 65_535 {
        return Err(invalid(
            "x",
            format!("{} rows need {grid_y} cluster rows; at most 65535", f.n),
        ));
    }
    Ok(())
}

/// Waiting first is the default unless the launch is captured where no
/// kernel precedes it (a graph's root node, or after a copy or memset):
/// nothing overlaps its start there, and the prefetch and spread kernel
/// that waiting first brings only cost time.
fn wait_first_by_default(predecessor: Predecessor) -> bool {
    predecessor != Predecessor::NoKernel
}

// ---------------------------------------------------------------------------
// Exact plans: what each form serves.
// ---------------------------------------------------------------------------

/// `plan` where it serves the call on the device under the caller's
/// promises, else a typed refusal naming the plan field.
fn check(f: &Facts<'_>, plan: DecodePlan) -> Result<DecodePlan, KernelError> {
    let refuse = |field: &'static str, reason: String| Err(invalid(field, reason));
    let refused =
        |field: &'static str, what: &'static str| move |reason: String| invalid(field, format!("{what}: {reason}"));
    match plan.chain {
        Chain::EarlyReads if !f.overlap => {
            return refuse(
                "plan.chain",
                "early reads need the caller's overlap_previous promise".into(),
            );
        }
        Chain::WaitFirst | Chain::WaitFirstEarlyNext if !f.hopper => {
            return refuse("plan.chain", "waiting first needs sm_90 or newer".into());
        }
        _ => {}
    }
    match plan.form {
        DecodeForm::RowRegisters { straight_line } => {
            f.call
                .rows_shape(f.hopper)
                .check(f.targets())
                .map_err(refused("plan.form", "row registers"))?;
            if straight_line && !f.call.rows_full(plan.chain == Chain::EarlyReads) {
                return refuse(
                    "plan.straight_line",
                    "the _full kernels serve 4096 x 4096 calls of aligned rows, not under the overlap".into(),
                );
            }
        }
        DecodeForm::Entry { kernel, prefetch } => {
            f.call
                .entry_shape(f.hopper)
                .check(f.targets())
                .map_err(refused("plan.form", "entry clusters"))?;
            let (n, in_dim) = (f.n, f.call.in_dim);
            match kernel {
                EntryKernel::Staged { cluster: 4 | 8 } => {}
                EntryKernel::Staged { cluster } => {
                    return refuse("plan.kernel", format!("clusters of {cluster}; 8 or 4"));
                }
                EntryKernel::Registers => entry::registers_serve(f.stride, 8, n, in_dim, f.max_out)
                    .map_err(refused("plan.kernel", "register kernel"))?,
                EntryKernel::Spread => {
                    entry::spread_serves(f.stride, n, in_dim, f.max_out, f.max_entries, f.n_targets, f.sms)
                        .map_err(refused("plan.kernel", "spread kernel"))?
                }
            }
            if prefetch && !(plan.chain.waits_first() && f.stride == 16) {
                return refuse(
                    "plan.prefetch",
                    "weights are prefetched by launches that wait first, at rank stride 16".into(),
                );
            }
        }
        DecodeForm::TwoPhase(form) => {
            let most = *TWO_PHASE_ROW_COLS.end();
            if form.expand_cols == 0 || form.expand_cols > most || !form.expand_cols.is_multiple_of(8) {
                return refuse(
                    "plan.expand_cols",
                    format!("{}; a multiple of 8 up to {most}", form.expand_cols),
                );
            }
            let cols = u32::try_from(form.expand_cols).ok();
            if two_phase_layout(f, cols).is_none() {
                return refuse(
                    "plan.form",
                    format!(
                        "{} rows of rank stride {} do not fit the two-phase scratch",
                        f.n, f.stride
                    ),
                );
            }
        }
        DecodeForm::Fused(form) => check_fused(f, form, plan.chain)?,
    }
    Ok(plan)
}

fn check_fused(f: &Facts<'_>, form: FusedForm, chain: Chain) -> Result<(), KernelError> {
    let refuse = |field: &'static str, reason: String| Err(invalid(field, reason));
    if chain.waits_first() {
        return refuse("plan.chain", "the fused kernel does not wait first".into());
    }
    match form.cluster {
        1 => {}
        2 | 8 if f.hopper => {}
        2 | 8 => return refuse("plan.cluster", "clusters need sm_90 or newer".into()),
        c => return refuse("plan.cluster", format!("{c}; 1, 2 or 8")),
    }
    if form.push_sum && form.cluster == 1 {
        return refuse("plan.push_sum", "one block per item has no cluster sum".into());
    }
    let most = most_out_splits(f);
    if !(1..=most).contains(&form.out_splits) {
        return refuse("plan.out_splits", format!("{}; 1..={most}", form.out_splits));
    }
    let list = form.items != ItemList::Scan;
    if list && !form.tensor_cores {
        return refuse("plan.items", "the item list serves the tensor-core kernels only".into());
    }
    if list && f.targets().iter().any(|t| t.n_entries > ITEM_LIST_MAX_ENTRIES) {
        return refuse(
            "plan.items",
            format!("the item list serves tables of at most {ITEM_LIST_MAX_ENTRIES} entries"),
        );
    }
    let (window, n_windows) = row_windows(f.n, list, f.n_targets);
    if list && !item_list_fits(window, n_windows, f.n_targets) {
        return refuse("plan.items", "the item lists do not fit the launch scratch".into());
    }
    if form.clusters_per_window == 0 || form.clusters_per_window > window {
        return refuse(
            "plan.clusters_per_window",
            format!("{}; 1..={window}", form.clusters_per_window),
        );
    }
    let rows = f.row_shape(window, n_windows, form.tensor_cores, list);
    let fixed = Fixed {
        cluster: Some(form.cluster),
        out_splits: Some(form.out_splits),
        clusters_per_window: Some(form.clusters_per_window),
        push_sum: Some(form.push_sum),
    };
    LaunchChoice::pick(f.limits, rows, f.targets(), fixed)?;
    check_fused_grid(f, n_windows, form.clusters_per_window)
}

// ---------------------------------------------------------------------------
// Candidates: every form the call can run, for benchmarks and tests.
// ---------------------------------------------------------------------------

/// Every plan that serves the call on the device, the rule table's first:
/// each form and kernel, each item source (the list on tensor cores),
/// cluster size and sum of the fused kernel, each chain the caller's
/// promises allow; the continuous choices (output splits, clusters per
/// window, expand columns) by the rules' own cost model. Each is accepted by [`plan`] as
/// [`Choice::Exact`]. Empty where no form serves the call.
pub fn candidates(call: &DecodeCall, limits: &DeviceLimits, ctx: DecodeContext) -> Vec<DecodePlan> {
    let f = Facts::of(call, limits, ctx);
    let mut out: Vec<DecodePlan> = Vec::new();
    let mut offer = |plan: DecodePlan| {
        if !out.contains(&plan) && check(&f, plan).is_ok() {
            out.push(plan);
        }
    };
    if let Ok(plan) = auto_under(call, limits, ctx) {
        offer(plan);
    }
    let base = f.fused_chain();
    let waiting: &[Chain] = if f.hopper && !f.overlap {
        &[Chain::WaitFirst, Chain::WaitFirstEarlyNext]
    } else {
        &[]
    };
    let chains: Vec<Chain> = std::iter::once(base).chain(waiting.iter().copied()).collect();
    for &chain in &chains {
        for straight_line in [true, false] {
            offer(DecodePlan {
                form: DecodeForm::RowRegisters { straight_line },
                chain,
            });
        }
        for kernel in [
            EntryKernel::Staged { cluster: 8 },
            EntryKernel::Staged { cluster: 4 },
            EntryKernel::Registers,
            EntryKernel::Spread,
        ] {
            for prefetch in [false, true] {
                offer(DecodePlan {
                    form: DecodeForm::Entry { kernel, prefetch },
                    chain,
                });
            }
        }
        for shrink_tensor_cores in [false, true] {
            if let Some(two) = two_phase_layout(&f, None) {
                offer(DecodePlan {
                    form: DecodeForm::TwoPhase(TwoPhaseForm {
                        shrink_tensor_cores,
                        expand_cols: two.cols,
                    }),
                    chain,
                });
            }
        }
    }
    let clusters: &[usize] = if f.hopper { &[1, 2, 8] } else { &[1] };
    for &cluster in clusters {
        for tensor_cores in [false, true] {
            // The item list serves the tensor-core kernels only.
            let items: &[ItemList] = if tensor_cores {
                &[ItemList::Scan, ItemList::Listed]
            } else {
                &[ItemList::Scan]
            };
            for &items in items {
                for push_sum in [false, true] {
                    if let Some(plan) = fused_candidate(&f, cluster, tensor_cores, items, push_sum, false) {
                        offer(plan);
                    }
                }
            }
        }
    }
    // The row-mapped clusters of 2 (a cluster per row of one window).
    if f.hopper && f.n <= WINDOW_MAX {
        for push_sum in [true, false] {
            if let Some(plan) = fused_candidate(&f, 2, false, ItemList::Scan, push_sum, true) {
                offer(plan);
            }
        }
    }
    out
}

/// The fused plan of one discrete choice, its splits and clusters per
/// window by the cost model; `row_mapped`: a cluster per row, one split.
fn fused_candidate(
    f: &Facts<'_>,
    cluster: usize,
    tensor_cores: bool,
    items: ItemList,
    push_sum: bool,
    row_mapped: bool,
) -> Option<DecodePlan> {
    let list = items != ItemList::Scan;
    let (window, n_windows) = row_windows(f.n, list, f.n_targets);
    let rows = f.row_shape(window, n_windows, tensor_cores, list);
    let fixed = Fixed {
        cluster: Some(cluster),
        push_sum: Some(push_sum),
        clusters_per_window: row_mapped.then_some(window),
        out_splits: row_mapped.then_some(1),
    };
    let choice = LaunchChoice::pick(f.limits, rows, f.targets(), fixed).ok()?;
    Some(fused_plan(&choice, tensor_cores, items, f.fused_chain()))
}

// ---------------------------------------------------------------------------
// The fused kernel's cost model.
// ---------------------------------------------------------------------------

/// Choices of a fused launch fixed before the cost model picks the rest.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Fixed {
    pub(super) cluster: Option<usize>,
    pub(super) out_splits: Option<usize>,
    pub(super) clusters_per_window: Option<usize>,
    pub(super) push_sum: Option<bool>,
}

/// Rank strides up to which clusters sum by pushing by default: the receive
/// buffers (`push_recv_bytes`, 8 KB at 16 with clusters of 8) then cost
/// little shared memory.
pub(super) const PUSH_SUM_MAX_STRIDE: usize = 32;
/// Blocks per multiprocessor the kernel's register use allows (`__launch_bounds__(256, 3)`;
/// the 512-thread scalar clusters of 2, `__launch_bounds__(512, 1)`, one).
pub(super) const REG_BLOCKS_PER_SM: usize = 3;
/// The same for the tensor-core cluster kernels (`__launch_bounds__(256, 4)`).
pub(super) const TC_BLOCKS_PER_SM: usize = 4;

/// What of the call the launch choice depends on (besides the targets).
#[derive(Debug, Clone, Copy)]
pub(super) struct RowShape {
    pub(super) in_dim: usize,
    pub(super) stride: usize,
    pub(super) y_size: usize,
    pub(super) window: usize,
    pub(super) n_windows: usize,
    /// The tensor-core kernels (more blocks per multiprocessor with clusters).
    pub(super) tensor_cores: bool,
    /// The `_list` kernels (items from `bgmv_list`: little static shared memory).
    pub(super) list: bool,
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
pub(super) struct LaunchChoice {
    pub(super) cluster: usize,
    pub(super) cpw: usize,
    /// Rounds of resident clusters the launch needs for the most items its windows can hold.
    pub(super) rounds: usize,
    pub(super) plan: SmemPlan,
    /// The cluster sum pushes partials (st.async) instead of a barrier and peer loads.
    pub(super) push: bool,
}

impl LaunchChoice {
    /// Pick the cluster size and output splits that need the fewest rounds of
    /// latency: every block resident at once (clusters per window sized to
    /// the device), few items per cluster, few A chunks, few splits (each
    /// split re-reads A). Decode is latency-bound: a round costs the chain
    /// idx -> table entry -> weights, whatever its bytes.
    pub(super) fn pick(
        limits: &DeviceLimits,
        rows: RowShape,
        targets: &[CallTarget],
        fixed: Fixed,
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
        let clusters: Vec<usize> = match fixed.cluster {
            Some(8 | 2) if !hopper => return Err(invalid("plan.cluster", "clusters need sm_90 or newer")),
            Some(v) => vec![v],
            // Clusters of 2 (one block per multiprocessor) win
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
        let push_options: &[bool] = match fixed.push_sum {
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
                && fixed.cluster.is_none()
                && best.as_ref().is_none_or(|(_, b)| min_items <= b.cpw)
            {
                continue;
            }
            let shape = PlanShape {
                in_dim,
                max_out,
                stride,
                y_size,
                cluster: cl,
                push,
                tensor_cores: rows.tensor_cores,
            };
            let slice = piece8(in_dim, cl);
            let split_options: Vec<usize> = match fixed.out_splits {
                Some(v) => vec![v.max(1)],
                None => (1..=(min_out / (cl * 64)).clamp(1, MAX_OUT_SPLITS)).collect(),
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
                let capacity = modelled_cluster_slots(sms, cl, bps);
                let per_cluster_row = cl * s * n_targets * n_windows;
                let cpw = match fixed.clusters_per_window {
                    Some(v) => v.clamp(1, window),
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

/// The block slots the fused launch's cost model counts for clusters of
/// `cluster` at `blocks_per_sm` a multiprocessor: all of them for single
/// blocks and pairs, 7/8 of them for clusters of 8. Clusters must fit whole
/// in a GPC, so fewer are resident than the slots allow, and one past that
/// waits for a second wave. This share is the model's calibration, not the
/// device's count: the driver's exact count
/// ([`DeviceLimits::cluster8_block_slots`], 15 / 30 / 45 / 62 clusters of 8
/// at 1-4 a multiprocessor against the model's 14.4 / 28.9 / 43.3 / 57.8 on
/// a 132-multiprocessor part) made it pick slower plans at 6 of the 20
/// shapes where it changed a decision, by up to 32 %, and faster ones by at
/// most 1.3 % (H100, lora-kernels NOTES.md v39).
fn modelled_cluster_slots(sms: usize, cluster: usize, blocks_per_sm: usize) -> usize {
    let slots = sms.saturating_mul(blocks_per_sm);
    if cluster > 2 {
        slots / 8 * 7 + slots % 8 * 7 / 8
    } else {
        slots
    }
}

/// The most items a window of `window` rows can hold over a table of
/// `entries` entries: an entry's `r` rows make `ceil(r / 8)` items, so the
/// at most `min(entries, window)` entries with rows make at most
/// `(window + 7 · min(entries, window)) / 8` (and never more than the rows).
pub(super) fn window_items_bound(window: usize, entries: usize) -> usize {
    let used = entries.min(window);
    (window.saturating_add(7 * used) / ITEM_ROWS).clamp(1, window.max(1))
}

#[cfg(test)]
mod tests;
