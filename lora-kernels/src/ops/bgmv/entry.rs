//! The entry-clustered form of [`super::bgmv`]: one launch, a cluster of
//! blocks per (table entry, target) serving every row that names the entry,
//! shrink and expand on tensor cores with fragments loaded straight from
//! global memory (`cuda/bgmv_entry.cu`). An entry's A and B are read once
//! for all of its rows, and no item list or window scan runs first. Its
//! spread kernel serves the same calls without clusters: 4 blocks an entry
//! exchanging partials through zeroed inboxes in global memory, every block
//! of the launch resident at once (it must never be launched with more
//! blocks than multiprocessors: its blocks wait for one another).
//!
//! It serves BF16 y, rank strides 16, 32 and 64, and 16-byte aligned rows
//! (`EntryShape::check`); it never guesses: a batch it cannot serve is
//! refused here, before any launch. Which kernel, cluster size, prefetch and
//! chain a call gets is the rule table's (rule 2 of [`super::plan`]); this
//! module launches [`DecodeForm::Entry`](super::plan::DecodeForm::Entry).
//!
//! # The staged kernel ([`EntryKernel::Staged`])
//!
//! A cluster of 8 blocks (or 4, past rank stride 16 where clusters of 8 for
//! every entry would not all be resident at once) per (entry, target). Each
//! block lists the rows naming its entry by a ballot per warp and serves
//! them 16 rows a pass: it shrinks and expands on tensor cores with
//! fragments loaded straight from global memory (the k order of both
//! operands permuted alike; the expand's output columns permuted so a lane
//! holds 8 consecutive outputs of a row: one 16-byte load and store of y).
//! While the shrink runs it copies its B rows and y values into shared
//! memory, where that costs no resident block (`smem_plan`; else nothing is
//! staged). At rank stride 64 a staged call expands with the outputs as the
//! mma's M instead: B's rows through `ldmatrix`, y's staged values
//! transposed through `ldmatrix.trans` and back through `stmatrix.trans`;
//! the other expand is then built unstaged at that stride, within its
//! registers. The cluster sums its partials by pushing them into its peers'
//! shared memory up to rank stride 32 (`PUSH_MAX_STRIDE`), at rank 64 by a
//! barrier and peer loads.
//!
//! # The register kernel ([`EntryKernel::Registers`])
//!
//! `bge_reg_body` (rank stride 16, clusters of 8, at most
//! [`ENTRY_REGISTERS_MAX_ROWS`] rows, `in` and targets up to
//! [`ENTRY_REGISTERS_MAX_DIM`]: `registers_serve`): each block requests its
//! A slice and B rows into registers as soon as its entry is known, before
//! the row indices arrive (so also where no row names the entry, which is
//! why the rule table takes it only from 8 rows per entry of the largest
//! table), keeps them for every pass, and loads each pass's x and y (8 rows)
//! into registers; nothing is staged in shared memory. Every mma sits
//! behind a fence (a branch on a value read with a volatile load after a
//! barrier that follows the block's last load), so ptxas cannot start one,
//! and wait for its loads, before the block's last load is out. Weights not
//! 16- and 8-byte aligned go to the staged body.
//!
//! # The spread kernel ([`EntryKernel::Spread`])
//!
//! For calls where clusters of 8 for every entry would be more than one
//! block a multiprocessor (so some multiprocessors would hold three of
//! them while others idle): no clusters, 4 blocks an entry and target
//! (`SPREAD_BLOCKS`), each loading its quarter of A and B into registers as
//! the register kernel does (rank stride 16, at most 256 rows, `in` and
//! targets up to [`ENTRY_SPREAD_MAX_DIM`]). The blocks exchange their
//! partial rank vectors through per-block inboxes in global memory (the
//! backend's, `CudaBackend::with_spread_inbox`): each 64-bit word carries
//! the pass in its upper half, every block zeroes the words it was sent
//! before it exits, so the inboxes (allocated zeroed) are zero between
//! launches, and each block asks its own inbox into L2 at its start. A
//! block spin-waits for its peers' words, so every block must be resident:
//! `spread_serves` keeps the grid to at most one block a multiprocessor; a
//! plain launch is cooperative (`launch_resident`), and waiting first the
//! next kernel is let in only once every block has waited. A kernel of
//! another stream that holds multiprocessors while it spins on this
//! stream's results could keep some of its blocks from starting: an exact
//! plan should not pick it beside such kernels.
//!
//! # Weights asked into L2 before the wait (`prefetch`)
//!
//! `DecodeForm::Entry { prefetch: true }`, at rank stride 16 in a launch
//! that waits first ([`Chain::WaitFirstEarlyNext`]): each block reads its
//! table entry before `griddepcontrol.wait` and asks L2 for its slice of A
//! and B (`cp.async.bulk.prefetch.L2`), so DRAM streams them while the
//! previous kernel ends. Read before that kernel completed, the entry may
//! be stale; a prefetch returns nothing to the block, so what it reads
//! after the wait is the plain launch's (at worst L2 holds bytes the block
//! then does not read). The staged and register kernels prefetch in
//! separate `_pf` kernels, so the others keep their machine code; the spread
//! kernel's prefetch is a flag of its chain code (`SPREAD_PREFETCH`). The
//! rule table prefetches where the launch's blocks are at most one a
//! multiprocessor (it then also lets the next kernel in at once, whose
//! blocks come early to ask for their own weights) and in the spread
//! kernel; where blocks share multiprocessors it measured slower (NOTES.md
//! v35).

use half::bf16;

use super::kernels::Epilogue;
use super::plan::{CallTarget, Chain, EntryKernel};
use super::{Rows, RowsMut};
use crate::cuda_rt::{CudaBackend, Kernel, Launch};
use crate::error::{KernelError, invalid};
use crate::ops::limits::DeviceLimits;
use crate::ops::{LoraTarget, MAX_TARGETS, OutputElem, TargetParams, to_i32, to_u32};

/// Threads per block (`BGE_THREADS` in the kernel).
pub(super) const THREADS: u32 = 256;
/// Warps per block, rows per pass (`BGE_WARPS`, `BGE_ROWS`).
const WARPS: usize = 8;
const PASS_ROWS: usize = 16;
/// Most rows of one launch (`BGE_MAX_ROWS`: each thread holds four row indices).
pub const ENTRY_MAX_ROWS: usize = 1024;
/// Most table entries per target: the grid's y extent.
const MAX_ENTRIES: usize = 65_535;

/// Mirror of `struct BgeParams` in `cuda/bgmv_entry.cu` (also the
/// row-register form's, `rows`, which leaves `stage_cols` unread).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct BgeParams {
    pub(super) x: u64,
    pub(super) y: u64,
    pub(super) idx: u64,
    pub(super) fault: u64,
    pub(super) n_rows: i32,
    pub(super) in_dim: i32,
    pub(super) x_stride: i32,
    pub(super) y_stride: i32,
    /// How the launch follows the stream's previous kernel (`Chain as i32`).
    pub(super) overlap: i32,
    /// Outputs per block whose B rows and y values are staged in shared memory (0: none).
    pub(super) stage_cols: i32,
    pub(super) targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<BgeParams>() == 216 && std::mem::offset_of!(BgeParams, targets) == 56);

impl BgeParams {
    /// The parameter block of a call: x, y and idx as given, the device's
    /// fault word, `stage_cols` staged outputs per block (0 for the
    /// row-register form, which leaves it unread).
    pub(super) fn new<Y: OutputElem>(
        c: &CudaBackend,
        x: &Rows<'_, bf16>,
        idx_addr: u64,
        target_params: &[TargetParams; MAX_TARGETS],
        y: &RowsMut<'_, Y>,
        chain: Chain,
        stage_cols: usize,
    ) -> Result<BgeParams, KernelError> {
        Ok(BgeParams {
            x: x.addr(),
            y: y.addr(),
            idx: idx_addr,
            fault: c.fault_addr(),
            n_rows: to_i32("x.n_rows", x.n_rows)?,
            in_dim: to_i32("x.width", x.width)?,
            x_stride: to_i32("x.stride", x.stride)?,
            y_stride: to_i32("y.stride", y.stride)?,
            overlap: chain as i32,
            stage_cols: to_i32("stage_cols", stage_cols)?,
            targets: *target_params,
        })
    }
}

/// What of a call the form's eligibility depends on.
#[derive(Debug, Clone, Copy)]
pub(super) struct EntryShape {
    pub(super) hopper: bool,
    pub(super) n: usize,
    pub(super) in_dim: usize,
    pub(super) stride: usize,
    pub(super) x_stride: usize,
    pub(super) x_addr: u64,
    pub(super) y_stride: usize,
    pub(super) y_addr: u64,
    /// Y's element name (`OutputElem::NAME`).
    pub(super) y_name: &'static str,
}

impl EntryShape {
    /// Why the form cannot serve this call, or `Ok` when it can.
    pub(super) fn check(&self, targets: &[CallTarget]) -> Result<(), String> {
        let eight = |v: usize| v.is_multiple_of(8);
        if !self.hopper {
            return Err("clusters need sm_90 or newer".into());
        }
        if self.y_name != "bf16" {
            return Err(format!("y of {} (bf16 only)", self.y_name));
        }
        if !matches!(self.stride, 16 | 32 | 64) {
            return Err(format!("rank stride {} (16, 32 or 64)", self.stride));
        }
        if self.n > ENTRY_MAX_ROWS {
            return Err(format!("{} rows (at most {ENTRY_MAX_ROWS})", self.n));
        }
        if !eight(self.in_dim) || !eight(self.x_stride) || !self.x_addr.is_multiple_of(16) {
            return Err("x rows not 16-byte aligned multiples of 8 columns".into());
        }
        if !eight(self.y_stride) || !self.y_addr.is_multiple_of(16) {
            return Err("y rows not 16-byte aligned".into());
        }
        for t in targets {
            if !eight(t.out_dim) || !eight(t.y_col_offset) {
                return Err(format!(
                    "target of {} outputs at column {} (multiples of 8 only)",
                    t.out_dim, t.y_col_offset
                ));
            }
            if t.n_entries > MAX_ENTRIES {
                return Err(format!("a table of {} entries (at most {MAX_ENTRIES})", t.n_entries));
            }
        }
        Ok(())
    }
}

/// Rank strides up to which the cluster sums by pushing partials into
/// receive buffers (`PUSH` in the kernel; two buffers of a partial per block).
const PUSH_MAX_STRIDE: usize = 32;

/// Blocks per multiprocessor of the kernels (`__launch_bounds__` in the
/// kernel): three at rank stride 16 (80 registers), else two.
fn blocks_per_sm(stride: usize) -> usize {
    if stride <= 16 { 3 } else { 2 }
}

/// Block slots of the device that the kernels' clusters of 8 fill at once
/// ([`DeviceLimits::cluster8_block_slots`] at the kernels' blocks per
/// multiprocessor).
pub(super) fn cluster_block_slots(stride: usize, limits: &DeviceLimits) -> usize {
    limits.cluster8_block_slots(blocks_per_sm(stride))
}

/// Dynamic shared memory of a launch without staging: the warps' partial
/// tiles, the block's partial (or the push form's receive buffers), t, and
/// the row list (`bge_body`), rounded to 16 bytes.
fn base_smem_bytes(stride: usize, n: usize, cluster: usize) -> usize {
    let parts = if cluster > 1 && stride <= PUSH_MAX_STRIDE {
        2 * cluster
    } else {
        1
    };
    (4 * ((WARPS + parts) * stride * PASS_ROWS + PASS_ROWS * (stride + 4) + n)).div_ceil(16) * 16
}

/// Bytes of the staged B rows (`cols` of them) and of 16 rows of y values (64 bytes of padding each).
fn stage_bytes(stride: usize, cols: usize) -> usize {
    cols * stride * 2 + PASS_ROWS * (cols + 32) * 2
}

/// Most dynamic shared memory per block with staging: the register bound's
/// blocks per multiprocessor must still fit (the driver reserves 1 KB per
/// block; 256 bytes cover the static shared memory).
fn staged_smem_max(stride: usize, smem_per_sm: usize) -> usize {
    (smem_per_sm / blocks_per_sm(stride)).saturating_sub(1024 + 256)
}

/// The outputs per block staged in shared memory (every block's whole
/// slice of the widest target), and the launch's dynamic shared memory; no
/// staging where it would cost a resident block.
fn smem_plan(stride: usize, n: usize, max_out: usize, cluster: usize, smem_per_sm: usize) -> (usize, usize) {
    let base = base_smem_bytes(stride, n, cluster);
    let cols = max_out.div_ceil(cluster).div_ceil(8) * 8;
    let staged = base + stage_bytes(stride, cols);
    if staged <= staged_smem_max(stride, smem_per_sm) {
        (cols, staged)
    } else {
        (0, base)
    }
}

/// Widest `in` and target the register kernel serves: a block's K slice and
/// output slice of at most 512 (`BGE_REG_CHUNKS` and `BGE_REG_GROUPS` pieces
/// of 32 per warp, 8 warps, clusters of 8).
pub const ENTRY_REGISTERS_MAX_DIM: usize = 4096;

/// Most rows the register kernel serves (`BGE_REG_MAX_ROWS`: one row index
/// per thread; more would spill).
pub const ENTRY_REGISTERS_MAX_ROWS: usize = 256;

/// Why the register kernel cannot serve a call of the entry-clustered form,
/// or `Ok` when it can: rank stride 16, clusters of 8, at most
/// [`ENTRY_REGISTERS_MAX_ROWS`] rows, `in` and every target at most
/// [`ENTRY_REGISTERS_MAX_DIM`].
pub(super) fn registers_serve(
    stride: usize,
    cluster: usize,
    n: usize,
    in_dim: usize,
    max_out: usize,
) -> Result<(), String> {
    if stride != 16 {
        return Err(format!("rank stride {stride} (16 only)"));
    }
    if cluster != 8 {
        return Err(format!("clusters of {cluster} (8 only)"));
    }
    if n > ENTRY_REGISTERS_MAX_ROWS {
        return Err(format!("{n} rows (at most {ENTRY_REGISTERS_MAX_ROWS})"));
    }
    if in_dim > ENTRY_REGISTERS_MAX_DIM || max_out > ENTRY_REGISTERS_MAX_DIM {
        return Err(format!(
            "in {in_dim}, widest target {max_out} (at most {ENTRY_REGISTERS_MAX_DIM} each)"
        ));
    }
    Ok(())
}

/// Blocks per (entry, target) group of the spread form (its grid's x).
const SPREAD_BLOCKS: usize = 4;

/// Widest `in` and target the spread form serves: a block's K slice and
/// output slice of at most 1024 (`BGS_CHUNKS` and `BGS_GROUPS` pieces of 32
/// per warp, 8 warps, [`SPREAD_BLOCKS`] blocks a group).
pub const ENTRY_SPREAD_MAX_DIM: usize = 4096;

/// Or'd into the spread form's launch-chain code (`BGS_PREFETCH`): waiting
/// first, its blocks ask their weights into L2 before the wait.
const SPREAD_PREFETCH: i32 = 4;

/// Mirror of `struct BgsParams` in `cuda/bgmv_entry.cu`: the form's
/// parameter block and the inboxes (`CudaBackend::with_spread_inbox`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SpreadParams {
    base: BgeParams,
    inbox: u64,
}
const _: () = assert!(size_of::<SpreadParams>() == 224);

/// Why the spread form cannot serve a call of the entry-clustered form, or
/// `Ok` when it can: rank stride 16, at most [`ENTRY_REGISTERS_MAX_ROWS`]
/// rows (one row index a thread), `in` and every target at most
/// [`ENTRY_SPREAD_MAX_DIM`], and every block of the launch resident at once,
/// one a multiprocessor ([`SPREAD_BLOCKS`] per entry and target): its blocks
/// wait for one another's partials.
pub(super) fn spread_serves(
    stride: usize,
    n: usize,
    in_dim: usize,
    max_out: usize,
    entries: usize,
    n_targets: usize,
    sms: usize,
) -> Result<(), String> {
    if stride != 16 {
        return Err(format!("rank stride {stride} (16 only)"));
    }
    if n > ENTRY_REGISTERS_MAX_ROWS {
        return Err(format!("{n} rows (at most {ENTRY_REGISTERS_MAX_ROWS})"));
    }
    if in_dim > ENTRY_SPREAD_MAX_DIM || max_out > ENTRY_SPREAD_MAX_DIM {
        return Err(format!(
            "in {in_dim}, widest target {max_out} (at most {ENTRY_SPREAD_MAX_DIM} each)"
        ));
    }
    let blocks = SPREAD_BLOCKS
        .saturating_mul(entries.max(1))
        .saturating_mul(n_targets.max(1));
    if blocks > sms {
        return Err(format!(
            "{blocks} blocks ({SPREAD_BLOCKS} per entry and target) on {sms} multiprocessors"
        ));
    }
    Ok(())
}

/// The kernel of a launch; `prefetch`: the one that asks its weights into L2
/// before it waits (rank stride 16 only).
fn entry_kernel(kernel: EntryKernel, stride: usize, prefetch: bool) -> super::kernels::DecodeKernel {
    super::kernels::DecodeKernel::Entry {
        kernel,
        stride,
        prefetch,
    }
}

/// The name of [`entry_kernel`] in `epilogue`'s instantiation, if the form has one there.
fn kernel_name(kernel: EntryKernel, stride: usize, prefetch: bool, epilogue: Epilogue) -> Option<&'static str> {
    entry_kernel(kernel, stride, prefetch).name(epilogue)
}

/// Launch the form (the caller checked `EntryShape::check`, and
/// `registers_serve` for `EntryKernel::Registers`).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_entry<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    idx_addr: u64,
    target_params: &[TargetParams; MAX_TARGETS],
    targets: &[LoraTarget<'_>],
    stride: usize,
    y: &RowsMut<'_, Y>,
    kernel: EntryKernel,
    chain: Chain,
    prefetch_weights: bool,
    epilogue: Epilogue,
) -> Result<(), KernelError> {
    // Prefetching kernels exist for waiting-first launches at rank stride 16.
    let prefetch = prefetch_weights && chain.waits_first() && stride == 16;
    if kernel_name(kernel, stride, prefetch, epilogue).is_none() {
        return Err(invalid("tuning.cluster", format!("{kernel:?} at rank stride {stride}")));
    }
    let function = entry_kernel(kernel, stride, prefetch).kernel(epilogue)?;
    let n = x.n_rows;
    let entries = targets.iter().map(|t| t.n_entries).max().unwrap_or(0).max(1);
    let max_out = targets.iter().map(|t| t.out_dim).max().unwrap_or(0);
    // The register kernel stages nothing: the push form's base layout in
    // clusters of 8 (which holds its smaller one, and its fallback's).
    let (cluster, (stage_cols, smem)) = match kernel {
        EntryKernel::Registers => (8, (0, base_smem_bytes(stride, n, 8))),
        EntryKernel::Staged { cluster } => (cluster, smem_plan(stride, n, max_out, cluster, c.smem_per_sm)),
        EntryKernel::Spread => {
            let spread = SpreadLaunch {
                n_targets: targets.len(),
                entries,
                chain,
                prefetch,
                function,
            };
            return launch_spread(c, x, idx_addr, target_params, y, spread);
        }
    };
    let params = BgeParams::new(c, x, idx_addr, target_params, y, chain, stage_cols)?;
    let shape = Launch {
        grid: (
            to_u32("grid", cluster)?,
            to_u32("grid", entries)?,
            to_u32("grid", targets.len())?,
        ),
        block: THREADS,
        smem: to_u32("smem", smem)?,
    };
    // SAFETY: `BgeParams` mirrors the kernel's struct (sizes asserted on both
    // sides). The host checked that x and y cover `n_rows` rows of their widths
    // and strides, that idx holds `n_rows` values, that each target's table
    // range and column range lie inside their buffers, and (`EntryShape::check`)
    // that rows are 16-byte aligned multiples of 8 columns, y is bf16, the
    // stride is the kernel's and the rows fit its index registers; the shared
    // memory holds the row list of `n_rows` rows. The kernel checks each index
    // against `n_entries` and each entry's rank against the stride before it
    // reads A and B through table addresses, which the table's owner keeps
    // pointing at live `[stride, in]` / `[out, stride]` pairs. As a dependent
    // launch it reads x and y only after `griddepcontrol.wait` (and, waiting
    // first, nothing before it).
    unsafe { c.launch_chained(function, shape, &params, chain.dependent()) }
}

/// Dynamic shared memory of a spread launch: the kernel's partials, t and
/// row list (`bgs_body`). Its registers (`__launch_bounds__(256, 1)`) keep
/// it to about one block a multiprocessor; asking for more than half a
/// multiprocessor's shared memory as well changed nothing (NOTES.md v35).
/// Residency needs only the grid's bound (`spread_serves`).
fn spread_smem_bytes(n: usize) -> usize {
    (4 * ((WARPS + 1) * 128 + 8 * 20 + n)).next_multiple_of(16)
}

/// What `launch_entry` settled for a spread launch.
struct SpreadLaunch {
    n_targets: usize,
    /// Entries of the largest table (the grid's y).
    entries: usize,
    chain: Chain,
    /// Whether the blocks ask their weights into L2 before they wait.
    prefetch: bool,
    function: Kernel,
}

/// Launch the spread form (the caller checked `EntryShape::check` and
/// `spread_serves`): waiting first, the next kernel let in at once (its
/// blocks are one a multiprocessor), or a plain launch made cooperative.
fn launch_spread<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    idx_addr: u64,
    target_params: &[TargetParams; MAX_TARGETS],
    y: &RowsMut<'_, Y>,
    spread: SpreadLaunch,
) -> Result<(), KernelError> {
    let SpreadLaunch {
        n_targets,
        entries,
        chain,
        prefetch,
        function,
    } = spread;
    let mut base = BgeParams::new(c, x, idx_addr, target_params, y, chain, 0)?;
    if prefetch {
        base.overlap |= SPREAD_PREFETCH;
    }
    let shape = Launch {
        grid: (
            to_u32("grid", SPREAD_BLOCKS)?,
            to_u32("grid", entries)?,
            to_u32("grid", n_targets)?,
        ),
        block: THREADS,
        smem: to_u32("smem", spread_smem_bytes(x.n_rows))?,
    };
    c.with_spread_inbox(|inbox| {
        let params = SpreadParams { base, inbox };
        // SAFETY: `SpreadParams` mirrors the kernel's struct (sizes asserted on
        // both sides); what `launch_entry` says of `BgeParams` holds of its
        // base. The inboxes hold `sm_count` blocks' words, zero between
        // launches, and `spread_serves` kept the grid to `sm_count` blocks, one
        // a multiprocessor and all resident at once: waiting first, the next
        // kernel of the stream launches only once every block let it in
        // (after its wait, so resident); a plain launch is cooperative. The
        // one stream orders launches, so no two share the inboxes at once.
        unsafe { c.launch_resident(function, shape, &params, chain.dependent()) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the call, a spread launch the host accepts is at most
        /// one block a multiprocessor, so all of it is resident and every
        /// block's inbox lies inside the backend's (`sm_count` of them).
        #[test]
        fn a_served_spread_launch_fits_the_multiprocessors_and_the_inboxes(
            n in 1usize..400,
            in_dim in 1usize..6000,
            out in 1usize..6000,
            entries in 0usize..80,
            n_targets in 1usize..=MAX_TARGETS,
            sms in 1usize..200,
        ) {
            if spread_serves(16, n, in_dim, out, entries, n_targets, sms).is_ok() {
                let blocks = SPREAD_BLOCKS * entries.max(1) * n_targets;
                prop_assert!(blocks <= sms);
                // The last block's inbox: (target, entry, rank) in grid order.
                let last = ((n_targets - 1) * entries.max(1) + entries.max(1) - 1) * SPREAD_BLOCKS + SPREAD_BLOCKS - 1;
                prop_assert!(last < sms);
                prop_assert!(n <= ENTRY_REGISTERS_MAX_ROWS && in_dim <= ENTRY_SPREAD_MAX_DIM && out <= ENTRY_SPREAD_MAX_DIM);
            }
            prop_assert!(spread_serves(32, n, in_dim, out, entries, n_targets, sms).is_err());
        }

        /// Whatever the call, the plan keeps the kernel's blocks per
        /// multiprocessor, stages every block's whole output slice or
        /// nothing, and holds the row list of every row.
        #[test]
        fn the_shared_memory_plan_keeps_the_resident_blocks(
            stride in prop::sample::select(vec![16usize, 32, 64]),
            n in 1usize..=ENTRY_MAX_ROWS,
            out in 1usize..20_000,
            cluster in prop::sample::select(vec![4usize, 8]),
            sm_kb in prop::sample::select(vec![100usize, 164, 228]),
        ) {
            let out = out.div_ceil(8) * 8;
            let sm = sm_kb * 1024;
            let (cols, smem) = smem_plan(stride, n, out, cluster, sm);
            let base = base_smem_bytes(stride, n, cluster);
            prop_assert!(base >= 4 * n, "the row list fits");
            if cols == 0 {
                prop_assert_eq!(smem, base);
            } else {
                prop_assert!(blocks_per_sm(stride) * (smem + 1024 + 256) <= sm);
                prop_assert!(cols * cluster >= out && cols % 8 == 0);
                prop_assert_eq!(smem, base + stage_bytes(stride, cols));
            }
            let cl = super::super::plan::entry_cluster(stride, n, &DeviceLimits::H200);
            prop_assert!(cl == 8 || cl == 4);
            let staged = EntryKernel::Staged { cluster: cl };
            prop_assert!(kernel_name(staged, stride, false, Epilogue::Plain).is_some());
        }
    }

    #[test]
    fn shared_memory_holds_the_partials_the_row_list_and_the_stage() {
        // Rank 16, 256 rows, clusters of 8: 8 warps' and 2 x 8 receive slots' 16 x 16, 16 x 20 floats, 256 rows.
        assert_eq!(base_smem_bytes(16, 256, 8), 4 * (24 * 256 + 320 + 256));
        // Rank 64 sums by pulling: one partial.
        assert_eq!(base_smem_bytes(64, 256, 8), 4 * (9 * 1024 + 16 * 68 + 256));
        assert!(base_smem_bytes(64, ENTRY_MAX_ROWS, 8) < 64 * 1024);
        // The H200's 228 KB per multiprocessor. 4096 outputs in clusters of
        // 8: 512 staged outputs per block.
        let sm = 228 * 1024;
        let (cols, smem) = smem_plan(16, 256, 4096, 8, sm);
        assert_eq!(cols, 512);
        assert_eq!(smem, base_smem_bytes(16, 256, 8) + 512 * 32 + 16 * 544 * 2);
        // In clusters of 4 three blocks of 1024 staged outputs would not fit.
        assert_eq!(smem_plan(16, 256, 4096, 4, sm).0, 0);
        // Staging never costs a resident block.
        for (stride, n, out, cl) in [
            (64, 1024, 4096, 4),
            (16, 1024, 14336, 4),
            (64, 256, 14336, 8),
            (32, 64, 4096, 8),
        ] {
            let (cols, smem) = smem_plan(stride, n, out, cl, sm);
            assert!(
                blocks_per_sm(stride) * (smem + 1024 + 256) <= sm,
                "{stride} {n} {out} {cl}"
            );
            assert!(cols == 0 || cols * cl >= out);
        }
    }

    #[test]
    fn calls_the_form_cannot_serve_are_refused_with_the_reason() {
        let target = |out_dim, y_col_offset| CallTarget {
            n_entries: 4,
            out_dim,
            y_col_offset,
        };
        let ok = EntryShape {
            hopper: true,
            n: 256,
            in_dim: 4096,
            stride: 16,
            x_stride: 4096,
            x_addr: 1 << 20,
            y_stride: 4096,
            y_addr: 2 << 20,
            y_name: "bf16",
        };
        assert_eq!(ok.check(&[target(4096, 0)]), Ok(()));
        let refusals = [
            (EntryShape { hopper: false, ..ok }, "sm_90"),
            (EntryShape { y_name: "f32", ..ok }, "bf16 only"),
            (EntryShape { stride: 48, ..ok }, "rank stride 48"),
            (
                EntryShape {
                    n: ENTRY_MAX_ROWS + 1,
                    ..ok
                },
                "1025 rows",
            ),
            (EntryShape { in_dim: 4095, ..ok }, "x rows"),
            (
                EntryShape {
                    x_addr: (1 << 20) + 8,
                    ..ok
                },
                "x rows",
            ),
            (EntryShape { y_stride: 4100, ..ok }, "y rows"),
        ];
        for (shape, why) in refusals {
            let err = shape.check(&[target(4096, 0)]).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
        let err = ok.check(&[target(4096, 0), target(100, 4096)]).unwrap_err();
        assert!(err.contains("100 outputs"), "{err}");
    }

    #[test]
    fn the_spread_form_serves_one_resident_block_a_multiprocessor() {
        assert_eq!(spread_serves(16, 256, 4096, 4096, 32, 1, 132), Ok(()));
        assert_eq!(spread_serves(16, 1, 8, 8, 33, 1, 132), Ok(()));
        assert!(
            spread_serves(16, 256, 4096, 4096, 34, 1, 132)
                .unwrap_err()
                .contains("136 blocks")
        );
        assert!(
            spread_serves(16, 256, 4096, 4096, 16, 3, 132)
                .unwrap_err()
                .contains("192 blocks")
        );
        assert!(
            spread_serves(32, 256, 4096, 4096, 8, 1, 132)
                .unwrap_err()
                .contains("stride 32")
        );
        assert!(
            spread_serves(16, 257, 4096, 4096, 8, 1, 132)
                .unwrap_err()
                .contains("257 rows")
        );
        assert!(
            spread_serves(16, 64, 4104, 4096, 8, 1, 132)
                .unwrap_err()
                .contains("in 4104")
        );
        assert!(
            spread_serves(16, 64, 4096, 14336, 8, 1, 132)
                .unwrap_err()
                .contains("14336")
        );
        assert!(spread_serves(16, 64, 64, 64, usize::MAX, 2, 132).is_err());
        assert_eq!(
            kernel_name(EntryKernel::Spread, 16, true, Epilogue::Plain),
            Some("bgmv_entry_spread_r16")
        );
        assert!(kernel_name(EntryKernel::Spread, 32, false, Epilogue::Plain).is_none());
        // The partials (9 x 128 floats), t (8 x 20) and the row list.
        assert_eq!(spread_smem_bytes(256), 4 * (1152 + 160 + 256));
        assert_eq!(
            spread_smem_bytes(1),
            (4 * (1152 + 160 + 1) as usize).next_multiple_of(16)
        );
    }

    #[test]
    fn every_served_stride_and_cluster_has_a_kernel() {
        let staged = |cluster| EntryKernel::Staged { cluster };
        for epilogue in [Epilogue::Plain, Epilogue::Dora] {
            for cl in [8, 4] {
                for s in [16, 32, 64] {
                    assert!(kernel_name(staged(cl), s, false, epilogue).is_some());
                    assert_eq!(kernel_name(staged(cl), s, true, epilogue).is_some(), s == 16);
                }
            }
            assert!(kernel_name(staged(2), 16, false, epilogue).is_none());
            assert!(kernel_name(staged(8), 48, false, epilogue).is_none());
        }
        // The register kernel: rank stride 16 in clusters of 8 only, as `registers_serve` says.
        assert_eq!(
            kernel_name(EntryKernel::Registers, 16, false, Epilogue::Plain),
            Some("bgmv_entry_c8_r16_reg")
        );
        assert_eq!(
            kernel_name(EntryKernel::Registers, 16, true, Epilogue::Plain),
            Some("bgmv_entry_c8_r16_reg_pf")
        );
        assert_eq!(
            kernel_name(EntryKernel::Registers, 16, true, Epilogue::Dora),
            Some("bgmv_entry_c8_r16_reg_pf_dora")
        );
        assert!(kernel_name(EntryKernel::Registers, 32, false, Epilogue::Plain).is_none());
        assert!(kernel_name(EntryKernel::Registers, 32, true, Epilogue::Plain).is_none());
        for (cl, s) in [(4, 16), (8, 32), (8, 64)] {
            assert!(registers_serve(s, cl, 256, 4096, 4096).is_err());
        }
        assert_eq!(registers_serve(16, 8, 256, 4096, 4096), Ok(()));
        assert!(
            registers_serve(16, 8, 257, 4096, 4096)
                .unwrap_err()
                .contains("257 rows")
        );
        assert!(registers_serve(16, 8, 256, 4104, 4096).unwrap_err().contains("in 4104"));
        assert!(registers_serve(16, 8, 256, 4096, 14336).unwrap_err().contains("14336"));
    }
}
