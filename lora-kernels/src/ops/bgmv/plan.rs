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
//!   rows of one entry found by a window scan or a first launch's item list.

use std::fmt;

use super::entry::{self, EntryShape};
use super::rows::{self, RowsShape};
use super::{
    ITEM_LIST_MAX_ENTRIES, LaunchChoice, MULTI_ROW_ITEMS, PUSH_SUM_MAX_STRIDE, RowShape, TENSOR_CORE_MIN_ROWS,
    TWO_PHASE_ROWS, TWO_PHASE_WIDE_OUT, TwoPhasePlan, WINDOW_MAX, item_list_fits, row_form_expand_slots, row_windows,
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

    fn of<Y: OutputElem>() -> OutputKind {
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

/// The two-phase launches' choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TwoPhaseForm {
    /// Every row its own item (`_rows` kernels: no window scan, no
    /// descriptors), or items of up to 8 rows listed by the shrink.
    pub row_items: bool,
    /// The shrink on tensor cores (`bgmv2_shrink_tc*`).
    pub shrink_tensor_cores: bool,
    /// K slices rounded down to a power of two.
    pub pow2_slices: bool,
    /// The expand a programmatic dependent of the shrink.
    pub dependent_expand: bool,
    /// Outputs per expand unit (a multiple of 8; up to 4096 with row items, else 1024).
    pub expand_cols: usize,
}

/// How the fused kernel finds its items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ItemList {
    /// Every block scans its row window.
    Scan,
    /// A first launch (`bgmv_list`) lists the items; the fused kernel waits for it.
    Listed,
    /// The same, the fused blocks polling a ready flag instead of waiting.
    ListedFlag,
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
    /// Row-mapped at rank stride 16 with pushed partials: B in registers.
    pub b_registers: bool,
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
                    "two-phase {} cols{}{}{}{}",
                    if t.row_items { "rows" } else { "items" },
                    t.expand_cols,
                    if t.shrink_tensor_cores { " tc" } else { "" },
                    if t.pow2_slices { "" } else { " any-slices" },
                    if t.dependent_expand { "" } else { " plain-expand" },
                )?;
            }
            DecodeForm::Fused(u) => {
                write!(
                    f,
                    "fused c{} s{} cpw{} {} {} {}{}",
                    u.cluster,
                    u.out_splits,
                    u.clusters_per_window,
                    if u.tensor_cores { "tc" } else { "scalar" },
                    match u.items {
                        ItemList::Scan => "scan",
                        ItemList::Listed => "list",
                        ItemList::ListedFlag => "list-flag",
                    },
                    if u.push_sum { "push" } else { "pull" },
                    if u.b_registers { " breg" } else { "" },
                )?;
            }
        }
        write!(f, " | {}", self.chain.label())
    }
}

/// Today's decisions, knob by knob (recorded into `plan.golden` before the rule table replaces it).
pub(super) fn legacy(
    call: &DecodeCall,
    limits: &DeviceLimits,
    ctx: DecodeContext,
    tuning: super::BgmvTuning,
) -> Result<DecodePlan, KernelError> {
    use super::{
        EntryCall, entry_by_default, item_list_by_default, many_rows, row_mapped_tuning, row_registers_by_default,
        two_phase_by_default, wait_first_by_default,
    };
    let n = call.rows;
    let targets = call.targets();
    let n_targets = targets.len();
    let max_out = call.max_out();
    let max_entries = call.max_entries();
    let hopper = limits.hopper();
    let stride = call.rank_stride;
    let overlap = tuning.overlap_previous.unwrap_or(false);
    let wait_first = hopper
        && !overlap
        && tuning
            .wait_first
            .unwrap_or_else(|| wait_first_by_default(ctx.predecessor));
    let entry_shape = call.entry_shape(hopper);
    let rows_shape = call.rows_shape(hopper);
    let rows_wanted = match tuning.row_registers {
        Some(true) => {
            if tuning.entry_clusters == Some(true) || tuning.entry_registers == Some(true) {
                return Err(invalid(
                    "tuning.row_registers",
                    "with entry_clusters or entry_registers: one form per call",
                ));
            }
            rows_shape
                .check(targets)
                .map_err(|reason| invalid("tuning.row_registers", reason))?;
            true
        }
        Some(false) => false,
        None => {
            row_registers_by_default(n, max_entries, tuning)
                && rows_shape.check(targets).is_ok()
                && call.rows_full(overlap)
        }
    };
    if rows_wanted {
        let chain = Chain::of(overlap, wait_first, true);
        return Ok(DecodePlan {
            form: DecodeForm::RowRegisters {
                straight_line: call.rows_full(chain == Chain::EarlyReads),
            },
            chain,
        });
    }
    if tuning.entry_registers == Some(true) && tuning.entry_clusters == Some(false) {
        return Err(invalid(
            "tuning.entry_registers",
            "with entry_clusters off: the register kernel is the entry-clustered form's",
        ));
    }
    if tuning.entry_spread == Some(true) {
        if tuning.entry_clusters == Some(false) {
            return Err(invalid(
                "tuning.entry_spread",
                "with entry_clusters off: the spread kernel is the entry-clustered form's",
            ));
        }
        if tuning.entry_registers == Some(true) {
            return Err(invalid(
                "tuning.entry_spread",
                "with entry_registers: one kernel per call",
            ));
        }
    }
    let sms = limits.multiprocessors;
    let entry_wanted = match tuning.entry_clusters {
        Some(true) => {
            entry_shape
                .check(targets)
                .map_err(|reason| invalid("tuning.entry_clusters", reason))?;
            true
        }
        Some(false) => false,
        None if tuning.entry_registers == Some(true) => {
            entry_shape
                .check(targets)
                .map_err(|reason| invalid("tuning.entry_registers", reason))?;
            true
        }
        None if tuning.entry_spread == Some(true) => {
            entry_shape
                .check(targets)
                .map_err(|reason| invalid("tuning.entry_spread", reason))?;
            true
        }
        None => {
            let ec = EntryCall {
                n,
                max_entries,
                n_targets,
                stride,
                max_out,
                sms,
                overlap,
            };
            entry_by_default(ec, tuning) && entry_shape.check(targets).is_ok()
        }
    };
    if entry_wanted {
        let cluster = match tuning.cluster {
            None => entry::default_cluster(stride, max_entries, sms),
            Some(v) => v as usize,
        };
        let serves = entry::registers_serve(stride, cluster, n, call.in_dim, max_out);
        let registers = match tuning.entry_registers {
            Some(true) => {
                serves.map_err(|reason| invalid("tuning.entry_registers", reason))?;
                true
            }
            Some(false) => false,
            None => serves.is_ok() && entry::registers_by_default(n, max_entries),
        };
        let early_by_shape = entry::early_next(stride, cluster, max_entries, n_targets, sms);
        let spread_serves = entry::spread_serves(stride, n, call.in_dim, max_out, max_entries, n_targets, sms);
        let spread = match tuning.entry_spread {
            Some(true) => {
                spread_serves.map_err(|reason| invalid("tuning.entry_spread", reason))?;
                true
            }
            Some(false) => false,
            None => {
                tuning.entry_registers.is_none()
                    && tuning.cluster.is_none()
                    && spread_serves.is_ok()
                    && entry::spread_by_default(early_by_shape, wait_first)
            }
        };
        let kernel = if spread {
            EntryKernel::Spread
        } else if registers {
            EntryKernel::Registers
        } else {
            EntryKernel::Staged { cluster }
        };
        let prefetch = tuning
            .prefetch_weights
            .unwrap_or_else(|| spread || entry::prefetch_by_default(stride, early_by_shape));
        let early_next = tuning.early_next.unwrap_or(spread || early_by_shape || prefetch);
        let chain = Chain::of(overlap, wait_first, early_next);
        let prefetch = prefetch && chain.waits_first() && stride == 16;
        if let EntryKernel::Staged { cluster: c } = kernel
            && !matches!(c, 4 | 8)
        {
            return Err(invalid("tuning.cluster", format!("{kernel:?} at rank stride {stride}")));
        }
        return Ok(DecodePlan {
            form: DecodeForm::Entry { kernel, prefetch },
            chain,
        });
    }
    let mapped = row_mapped_tuning(n, n_targets, sms, hopper, tuning).and_then(|mapped| {
        let rows = RowShape {
            in_dim: call.in_dim,
            stride,
            y_size: call.y.size(),
            window: n,
            n_windows: 1,
            tensor_cores: false,
            list: false,
        };
        let choice = LaunchChoice::pick(limits, rows, targets, mapped).ok()?;
        (choice.rounds == 1).then_some((mapped, choice))
    });
    let tuning = mapped.map_or(tuning, |(mapped, _)| mapped);
    let list_wanted = tuning
        .item_list_pass
        .unwrap_or_else(|| item_list_by_default(n, max_entries, overlap))
        && targets.iter().all(|t| t.n_entries <= ITEM_LIST_MAX_ENTRIES);
    let (window, n_windows) = row_windows(n, list_wanted, n_targets);
    let tensor_cores = tuning.tensor_cores.unwrap_or_else(|| many_rows(n, max_entries));
    let list = list_wanted && item_list_fits(window, n_windows, n_targets);
    let rows = RowShape {
        in_dim: call.in_dim,
        stride,
        y_size: call.y.size(),
        window,
        n_windows,
        tensor_cores,
        list,
    };
    let fused = match mapped {
        Some((_, choice)) => Ok(choice),
        None => LaunchChoice::pick(limits, rows, targets, tuning),
    };
    let fused_rounds = fused.as_ref().ok().map(|f| f.rounds);
    if tuning
        .two_phase
        .unwrap_or_else(|| two_phase_by_default(n, stride, max_out, max_entries, fused_rounds))
    {
        let row_items = tuning.two_phase_row_items.unwrap_or(true);
        let form = TwoPhaseForm {
            row_items,
            shrink_tensor_cores: tuning.shrink_tensor_cores.unwrap_or(false),
            pow2_slices: tuning.pow2_slices.unwrap_or(true),
            dependent_expand: tuning.dependent_launch.unwrap_or(true),
            expand_cols: 0,
        };
        let tp = TwoPhasePlan::new(
            n,
            call.in_dim,
            stride,
            n_targets,
            max_out,
            call.y.size(),
            tuning.expand_cols,
            SCRATCH_BYTES,
            row_items.then_some(row_form_expand_slots(sms, n_targets)),
        );
        match tp {
            Some(tp) if tp.expand_smem <= limits.smem_optin => {
                return Ok(DecodePlan {
                    form: DecodeForm::TwoPhase(TwoPhaseForm {
                        expand_cols: tp.cols,
                        ..form
                    }),
                    chain: Chain::of(overlap, wait_first, tuning.early_next.unwrap_or(false)),
                });
            }
            _ if tuning.two_phase == Some(true) => {
                return Err(invalid(
                    "tuning.two_phase",
                    format!("{n} rows of rank stride {stride} do not fit the two-phase scratch"),
                ));
            }
            _ => {}
        }
    }
    let config = fused?;
    if !matches!(config.cluster, 1 | 2 | 4 | 8) {
        return Err(invalid("tuning.cluster", format!("{}; 1, 2, 4 or 8", config.cluster)));
    }
    let grid_y = n_windows * config.cpw;
    if grid_y > 65_535 {
        return Err(invalid(
            "x",
            format!("{n} rows need {grid_y} cluster rows; at most 65535"),
        ));
    }
    let items = match (list, tuning.list_ready_flag.unwrap_or(false)) {
        (false, _) => ItemList::Scan,
        (true, false) => ItemList::Listed,
        (true, true) => ItemList::ListedFlag,
    };
    Ok(DecodePlan {
        form: DecodeForm::Fused(FusedForm {
            cluster: config.cluster,
            out_splits: config.plan.splits,
            clusters_per_window: config.cpw,
            tensor_cores,
            items,
            push_sum: config.push,
            b_registers: config.requested_b_registers,
        }),
        chain: if overlap { Chain::EarlyReads } else { Chain::Plain },
    })
}

#[cfg(test)]
mod tests;
