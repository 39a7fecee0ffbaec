//! The streamed decode (`cuda/bgmv_stream.cu`): `bgmv_list` lists the
//! batch's items, then one wave of blocks streams every item's A and B as
//! units of about [`DEFAULT_UNIT_BYTES`] of weights through a ring of
//! shared-memory stages (shrink units write partial rank vectors into the
//! scratch, expand units wait for their item's and add `B t` to y).
//!
//! This module plans and launches it; it never decides whether the batch
//! should take it (the caller does, from [`super::BgmvTuning`]).

use half::bf16;

use super::{BgmvParams, ITEM_LIST_MAX_ENTRIES, ITEM_ROWS, THREADS, WINDOW_MAX, item_list_stride};
use crate::cuda_rt::{CudaBackend, Family, Kernel, Launch, SCRATCH_BYTES};
use crate::error::KernelError;
use crate::ops::{LoraTarget, MAX_TARGETS, OutputElem, Rows, RowsMut, TargetParams, to_i32, to_u32};

/// Weight bytes of one unit by default: a 16-rank A slice of 1024 columns, or
/// 1024 B rows of rank stride 16.
pub(super) const DEFAULT_UNIT_BYTES: usize = 32 * 1024;
/// The smallest unit `StreamPlan::new` halves a unit to.
const MIN_UNIT_BYTES: usize = 1024;
/// Ring stages of a block at most (`STREAM_MAX_STAGES` in the kernel).
const MAX_STAGES: usize = 8;
/// Units a block serves at most (`STREAM_MAX_UNITS`): the grid is sized so
/// that even a batch of one item per row needs no more.
const MAX_UNITS_PER_BLOCK: usize = 64;
/// Blocks per multiprocessor (`__launch_bounds__(256, 2)`).
const BLOCKS_PER_SM: usize = 2;
/// Static shared memory of the kernel (the block's unit records and the
/// shrink's per-warp fragments: 9760 bytes for sm_90), rounded up.
const STATIC_SMEM: usize = 10 * 1024;

/// The device mirror of `struct BgmvStreamParams` in `cuda/bgmv_stream.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct BgmvStreamParams {
    x: u64,
    y: u64,
    list: u64,
    part: u64,
    n_rows: i32,
    in_dim: i32,
    x_stride: i32,
    y_stride: i32,
    rank_stride: i32,
    n_targets: i32,
    list_stride: i32,
    k_slice: i32,
    o_slice: i32,
    n_ks: i32,
    n_stages: i32,
    stage_bytes: i32,
    rows_off: i32,
    t_off: i32,
    kp: i32,
    bp: i32,
    targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<BgmvStreamParams>() == 192 && std::mem::offset_of!(BgmvStreamParams, targets) == 96);

/// What the plan depends on.
#[derive(Debug, Clone, Copy)]
pub(super) struct StreamShape<'a> {
    pub(super) n_rows: usize,
    pub(super) in_dim: usize,
    pub(super) stride: usize,
    pub(super) out_dims: &'a [usize],
    pub(super) y_size: usize,
    pub(super) sms: usize,
    pub(super) smem_per_sm: usize,
    pub(super) smem_optin: usize,
}

/// The launch shape of the streamed decode: unit sizes, the ring, the grid
/// and where the partial rank vectors go in the scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct StreamPlan {
    /// A columns per shrink unit, a multiple of 8.
    pub(super) k_slice: usize,
    /// Outputs per expand unit, a multiple of 8.
    pub(super) o_slice: usize,
    /// K slices of `in`.
    pub(super) n_ks: usize,
    pub(super) n_stages: usize,
    /// Bytes of one stage: weights (the stride rounded up to 16 rows of
    /// `kp`, or `o_slice` rounded up to 16 rows of `bp`), then at `rows_off`
    /// up to [`ITEM_ROWS`] x rows (of `kp`) or y rows (of `o_slice`).
    pub(super) stage_bytes: usize,
    pub(super) rows_off: usize,
    /// Offset of the rank vectors (`[ITEM_ROWS][stride8]` f32) after the stages.
    pub(super) t_off: usize,
    /// Pitch (elements) of staged A and x rows: `k_slice + 8`, so the
    /// tensor-core tiles' rows fall in distinct banks.
    pub(super) kp: usize,
    /// Pitch (elements) of staged B rows: the stride rounded up to 8, plus 8
    /// when that is a multiple of 32 (the 8 rows of a tile would share 4 or
    /// more bank groups; a 32-byte pitch shares 2 and costs less than a pad).
    pub(super) bp: usize,
    /// Dynamic shared memory of a block.
    pub(super) smem: usize,
    pub(super) grid: usize,
    /// Bytes of one item list (a 64-byte header, then one record per row).
    pub(super) list_stride: usize,
    /// Offset of the partials `[targets][n_ks][n_rows][stride]` f32 in the scratch.
    pub(super) part_off: usize,
}

fn round16(v: usize) -> usize {
    v.div_ceil(16) * 16
}

impl StreamPlan {
    /// The plan for units of at least `unit_bytes` of weights, doubled until
    /// the partials fit the scratch. `None` when the batch does not fit the
    /// path: more than one window of rows, or partials past the scratch at
    /// every unit size whose ring of two stages fits a block.
    pub(super) fn new(shape: StreamShape<'_>, unit_bytes: usize) -> Option<StreamPlan> {
        // A unit too large for two stages (outputs past the slice of a short
        // `in`, say) is halved first; then units grow until the partials fit.
        let mut unit = unit_bytes.max(MIN_UNIT_BYTES);
        while Self::layout(shape, unit).is_none() && unit > MIN_UNIT_BYTES {
            unit /= 2;
        }
        loop {
            let plan = Self::layout(shape, unit)?;
            if plan.part_off + plan.part_bytes(shape) <= SCRATCH_BYTES {
                return Some(plan);
            }
            unit = unit.checked_mul(2)?;
        }
    }

    /// Partials `[targets][n_ks][rows][stride]` f32.
    fn part_bytes(&self, shape: StreamShape<'_>) -> usize {
        shape.out_dims.len() * self.n_ks * shape.n_rows * shape.stride * 4
    }

    /// Units of one row when every row is its own item: K slices, then output slices of every target.
    fn units_per_row_of(n_ks: usize, o_slice: usize, out_dims: &[usize]) -> usize {
        out_dims.iter().map(|&o| n_ks + o.div_ceil(o_slice)).sum()
    }

    fn layout(shape: StreamShape<'_>, unit_bytes: usize) -> Option<StreamPlan> {
        let StreamShape {
            n_rows,
            in_dim,
            stride,
            out_dims,
            y_size,
            sms,
            smem_per_sm,
            smem_optin,
        } = shape;
        let max_out = out_dims.iter().copied().max()?;
        if n_rows == 0 || n_rows > WINDOW_MAX || in_dim == 0 || stride == 0 || out_dims.len() > MAX_TARGETS {
            return None;
        }
        let per_row = (unit_bytes / (2 * stride)) / 8 * 8;
        let k_slice = per_row.max(8).min(in_dim.div_ceil(8) * 8);
        let o_slice = per_row.max(8).min(max_out.div_ceil(8) * 8);
        let n_ks = in_dim.div_ceil(k_slice);
        let kp = k_slice + 8;
        let stride8 = stride.div_ceil(8) * 8;
        let bp = if stride8 % 32 == 0 { stride8 + 8 } else { stride8 };
        let rows_off = round16((round16(stride) * kp).max(round16(o_slice) * bp) * 2);
        let stage_bytes = rows_off + round16(ITEM_ROWS * (kp * 2).max(o_slice * y_size));
        let t_bytes = ITEM_ROWS * stride.div_ceil(8) * 8 * 4;
        let budget = (smem_per_sm / BLOCKS_PER_SM)
            .checked_sub(STATIC_SMEM + 1024)?
            .min(smem_optin.checked_sub(STATIC_SMEM)?);
        let n_stages = (budget.checked_sub(t_bytes)? / stage_bytes).min(MAX_STAGES);
        if n_stages < 2 {
            return None;
        }
        let t_off = n_stages * stage_bytes;
        let list_stride = item_list_stride(n_rows)?;
        let part_off = (list_stride * out_dims.len()).div_ceil(256) * 256;
        Some(StreamPlan {
            k_slice,
            o_slice,
            n_ks,
            n_stages,
            stage_bytes,
            rows_off,
            t_off,
            kp,
            bp,
            smem: t_off + t_bytes,
            // One wave, or more blocks when even that would hand a block more
            // units than it holds (every row its own item); blocks past the
            // resident ones are safe: a block waits only for blocks that
            // claimed a smaller number, so were resident before it.
            grid: (sms * BLOCKS_PER_SM)
                .max(n_rows * Self::units_per_row_of(n_ks, o_slice, out_dims).div_ceil(MAX_UNITS_PER_BLOCK))
                .max(1),
            list_stride,
            part_off,
        })
    }
}

/// Whether the streamed decode can serve these tables: `bgmv_list` counts
/// rows per entry in a shared array of [`ITEM_LIST_MAX_ENTRIES`].
pub(super) fn tables_fit(targets: &[LoraTarget<'_>]) -> bool {
    targets.iter().all(|t| t.n_entries <= ITEM_LIST_MAX_ENTRIES)
}

/// `bgmv_list`, then the streamed kernel as its programmatic dependent.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_stream<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    idx_addr: u64,
    target_params: &[TargetParams; MAX_TARGETS],
    n_targets: usize,
    stride: usize,
    y: &RowsMut<'_, Y>,
    plan: StreamPlan,
) -> Result<(), KernelError> {
    let n = x.n_rows;
    let name = match Y::NAME {
        "bf16" => "bgmv_stream_bf16",
        _ => "bgmv_stream_f32",
    };
    c.with_scratch(|scratch| {
        let list_params = BgmvParams {
            x: x.addr(),
            y: y.addr(),
            idx: idx_addr,
            fault: c.fault_addr(),
            n_rows: to_i32("x.n_rows", n)?,
            in_dim: to_i32("x.width", x.width)?,
            x_stride: to_i32("x.stride", x.stride)?,
            y_stride: to_i32("y.stride", y.stride)?,
            rank_stride: to_i32("rank_stride", stride)?,
            n_targets: to_i32("targets", n_targets)?,
            out_splits: 1,
            clusters_per_window: 1,
            window: to_i32("window", n)?,
            n_windows: 1,
            k_chunk: 0,
            lo_max: 0,
            off_y: 0,
            off_t: 0,
            off_a: 0,
            off_x: 0,
            list: scratch,
            list_stride: to_i32("window", plan.list_stride)?,
            list_flag: 0,
            targets: *target_params,
        };
        let params = BgmvStreamParams {
            x: x.addr(),
            y: y.addr(),
            list: scratch,
            part: scratch + plan.part_off as u64,
            n_rows: to_i32("x.n_rows", n)?,
            in_dim: to_i32("x.width", x.width)?,
            x_stride: to_i32("x.stride", x.stride)?,
            y_stride: to_i32("y.stride", y.stride)?,
            rank_stride: to_i32("rank_stride", stride)?,
            n_targets: to_i32("targets", n_targets)?,
            list_stride: to_i32("window", plan.list_stride)?,
            k_slice: to_i32("k_slice", plan.k_slice)?,
            o_slice: to_i32("o_slice", plan.o_slice)?,
            n_ks: to_i32("k_slices", plan.n_ks)?,
            n_stages: to_i32("stages", plan.n_stages)?,
            stage_bytes: to_i32("smem", plan.stage_bytes)?,
            rows_off: to_i32("smem", plan.rows_off)?,
            t_off: to_i32("smem", plan.t_off)?,
            kp: to_i32("smem", plan.kp)?,
            bp: to_i32("smem", plan.bp)?,
            targets: *target_params,
        };
        // SAFETY: both parameter structs mirror the kernels' (sizes asserted on
        // both sides). The caller checked x, y, idx and the targets as for the
        // fused kernel, that the batch is one window and that every table has
        // at most `ITEM_LIST_MAX_ENTRIES` entries; `StreamPlan::new` keeps the
        // item lists and the partials inside the scratch, which `with_scratch`
        // holds for both launches, and bounds the units per block. `bgmv_list`
        // checks every index and entry (the streamed kernel reads only checked
        // entries, after `griddepcontrol.wait`), and the table's owner keeps
        // their addresses pointing at live `[stride, in]` / `[out, stride]` pairs.
        unsafe {
            c.launch(
                Kernel {
                    family: Family::Bgmv,
                    name: "bgmv_list",
                },
                Launch {
                    grid: (1, 1, to_u32("grid", n_targets)?),
                    block: THREADS,
                    smem: 0,
                },
                &list_params,
            )?;
            c.launch_chained(
                Kernel {
                    family: Family::Bgmv,
                    name,
                },
                Launch {
                    grid: (to_u32("grid", plan.grid)?, 1, 1),
                    block: THREADS,
                    smem: to_u32("smem", plan.smem)?,
                },
                &params,
                true,
            )
        }
    })
}

#[cfg(test)]
mod tests;
