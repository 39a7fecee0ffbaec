//! Segment-grouped LoRA apply (SGMV): prefill batches where rows
//! `cu_seqlens[s] .. cu_seqlens[s + 1]` share the entry `seg_slot[s]` (-1 =
//! no delta), and [`one_adapter`], the plain pair of GEMMs when every row
//! uses one entry. CUDA kernel family: `cuda/sgmv.cu` (a tensor-core shrink
//! into the workspace, then a tensor-core expand fused with the add into y;
//! warpgroup MMAs on compute capability 9.0, mma.sync elsewhere). A target
//! with a DoRA epilogue ([`super::dora`]) has its DoRA segments' rows
//! rescaled by the expand before it rounds them, in the same launch.
//!
//! Every launch choice (kernels, K splits, grids, shared memory) comes
//! from [`plan`], the rule table, a pure function of the call and the
//! device's limits; `launch` here runs what the plan says.

pub mod plan;

use half::bf16;

use self::plan::{PrefillCall, PrefillPlan};
use super::limits::{Choice, DeviceLimits};
use super::pairs::reference_apply;
use super::{LoraTarget, LoraWorkspace, MAX_TARGETS, OutputElem, Rows, RowsMut, TargetParams, check_targets, to_i32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{CudaBackend, Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};

/// Threads of every block of the shrinks and expands (`SG_THREADS`).
const THREADS: u32 = 128;

/// The segments of a prefill batch: `cu_seqlens` holds `n_segments + 1`
/// row offsets (non-decreasing, at most the row count), `seg_slot` holds
/// `n_segments` entry indices (-1 = no delta). Both live on the device, so
/// their contents may change between graph replays.
#[derive(Debug, Clone, Copy)]
pub struct Segments<'a> {
    /// `i32[n_segments + 1]` prefix sums of segment lengths.
    pub cu_seqlens: &'a DeviceBuffer<i32>,
    /// `i32[n_segments]` entry index of each segment.
    pub seg_slot: &'a DeviceBuffer<i32>,
    /// Number of segments.
    pub n_segments: usize,
}

/// One of the two launches of the segment apply (benchmarks time one alone:
/// [`PrefillOptions::only_phase`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SgmvPhase {
    /// `x A^T` into the workspace.
    Shrink,
    /// `y += scale * t B^T` from the workspace.
    Expand,
}

/// Mirror of `struct SgmvParams` in `cuda/sgmv.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SgmvParams {
    x: u64,
    y: u64,
    cu_seqlens: u64,
    seg_slot: u64,
    ws: u64,
    fault: u64,
    n_rows: i32,
    in_dim: i32,
    x_stride: i32,
    y_stride: i32,
    rank_stride: i32,
    n_targets: i32,
    n_segments: i32,
    uniform_entry: i32,
    k_splits: i32,
    ws_rows: i32,
    ws_rank_pad: i32,
    max_tiles: i32,
    rank_chunks: i32,
    out_tiles: i32,
    balance_items: i32,
    y_buffers: i32,
    early_dependents: i32,
    pad: i32,
    targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<SgmvParams>() == 280 && std::mem::offset_of!(SgmvParams, targets) == 120);

/// How rows pick their entry.
#[derive(Clone, Copy)]
enum Grouping<'a> {
    Segments(&'a Segments<'a>),
    Uniform(usize),
}

/// How [`sgmv_with`] runs a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefillOptions {
    /// The rule table's plan, or an exact one (one of [`sgmv_candidates`],
    /// say; refused with a typed error where it cannot serve the call on
    /// the device).
    pub choice: Choice<PrefillPlan>,
    /// Benchmarks only: launch just this phase, to time it alone. The
    /// output is then NOT the LoRA apply (the expand reads whatever the
    /// workspace holds).
    pub only_phase: Option<SgmvPhase>,
}

/// `y[row, target columns] += scale * B (A x[row])` where each segment's
/// rows use the entry `seg_slot[s]`. Scratch comes from `ws`. The launch is
/// the rule table's ([`plan::plan`]).
pub fn sgmv<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    segments: &Segments<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
    ws: &mut LoraWorkspace,
) -> Result<(), KernelError> {
    sgmv_with(
        device,
        x,
        segments,
        targets,
        rank_stride,
        y,
        ws,
        PrefillOptions::default(),
    )
}

/// [`sgmv`] with an exact plan or one phase only (`options`). On the CPU
/// the reference runs and `options` is not read.
#[allow(clippy::too_many_arguments)]
pub fn sgmv_with<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    segments: &Segments<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
    ws: &mut LoraWorkspace,
    options: PrefillOptions,
) -> Result<(), KernelError> {
    let grouping = Grouping::Segments(segments);
    apply(device, x, grouping, targets, rank_stride, y, ws, options)
}

/// One-adapter prefill: every row uses table entry `entry` of each target.
pub fn one_adapter<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    entry: usize,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
    ws: &mut LoraWorkspace,
) -> Result<(), KernelError> {
    let grouping = Grouping::Uniform(entry);
    apply(
        device,
        x,
        grouping,
        targets,
        rank_stride,
        y,
        ws,
        PrefillOptions::default(),
    )
}

/// The plan [`sgmv_with`] would launch for these arguments (the workspace
/// aside) under `choice`, for logs and bench labels; `None` on the CPU,
/// which runs the reference, and for an empty batch.
pub fn sgmv_plan<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    segments: &Segments<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: &RowsMut<'_, Y>,
    choice: Choice<PrefillPlan>,
) -> Result<Option<PrefillPlan>, KernelError> {
    let grouping = Grouping::Segments(segments);
    check_call(device, &x, grouping, targets, rank_stride, y, None)?;
    match device.backend() {
        Backend::Cuda(c) if x.n_rows > 0 => {
            let call = prefill_call::<Y>(&x, grouping, targets, rank_stride)?;
            plan::plan(&call, &DeviceLimits::of(c), choice).map(Some)
        }
        _ => Ok(None),
    }
}

/// Every plan that serves these arguments on this device
/// ([`plan::candidates`]: the rule table's first), for benchmarks and
/// tests of each form; empty on the CPU and for an empty batch.
pub fn sgmv_candidates<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    segments: &Segments<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: &RowsMut<'_, Y>,
) -> Result<Vec<PrefillPlan>, KernelError> {
    let grouping = Grouping::Segments(segments);
    check_call(device, &x, grouping, targets, rank_stride, y, None)?;
    match device.backend() {
        Backend::Cuda(c) if x.n_rows > 0 => {
            let call = prefill_call::<Y>(&x, grouping, targets, rank_stride)?;
            Ok(plan::candidates(&call, &DeviceLimits::of(c)))
        }
        _ => Ok(Vec::new()),
    }
}

/// The planner's view of checked arguments (`x.n_rows > 0`).
fn prefill_call<Y: OutputElem>(
    x: &Rows<'_, bf16>,
    grouping: Grouping<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
) -> Result<PrefillCall, KernelError> {
    let mut out_dims = [0; MAX_TARGETS];
    for (o, t) in out_dims.iter_mut().zip(targets) {
        *o = t.out_dim;
    }
    let out_dims = &out_dims[..targets.len().min(MAX_TARGETS)];
    match grouping {
        Grouping::Segments(s) => PrefillCall::segments::<Y>(x.n_rows, x.width, rank_stride, s.n_segments, out_dims),
        Grouping::Uniform(_) => PrefillCall::one_entry::<Y>(x.n_rows, x.width, rank_stride, out_dims),
    }
}

#[allow(clippy::too_many_arguments)]
fn apply<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    grouping: Grouping<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
    ws: &mut LoraWorkspace,
    options: PrefillOptions,
) -> Result<(), KernelError> {
    let target_params = check_call(device, &x, grouping, targets, rank_stride, &y, Some(ws))?;
    if x.n_rows == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => reference(&cpu.memory, &x, grouping, targets, rank_stride, y),
        Backend::Cuda(c) => launch(c, &x, grouping, &target_params, targets, rank_stride, &y, ws, options),
    }
}

/// The host checks of a call, against the workspace where given (an apply;
/// the planning entry points have none), and its targets' parameter blocks.
fn check_call<Y: OutputElem>(
    device: &Device,
    x: &Rows<'_, bf16>,
    grouping: Grouping<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: &RowsMut<'_, Y>,
    ws: Option<&LoraWorkspace>,
) -> Result<[TargetParams; MAX_TARGETS], KernelError> {
    x.check(device, "x")?;
    y.check(device, "y")?;
    if let Some(ws) = ws {
        device.expect_same("ws", ws.device())?;
    }
    if y.n_rows != x.n_rows {
        return Err(invalid("y", format!("{} rows, x has {}", y.n_rows, x.n_rows)));
    }
    let spec = ws.map(|ws| *ws.spec());
    if let Some(spec) = spec {
        if x.n_rows > spec.max_rows {
            return Err(invalid(
                "x",
                format!("{} rows; the workspace serves {}", x.n_rows, spec.max_rows),
            ));
        }
        if rank_stride == 0 || rank_stride > spec.max_rank {
            return Err(invalid(
                "rank_stride",
                format!("{rank_stride}; the workspace serves 1..={}", spec.max_rank),
            ));
        }
        if targets.len() > spec.max_targets {
            return Err(invalid(
                "targets",
                format!("{}; the workspace serves {}", targets.len(), spec.max_targets),
            ));
        }
    } else if rank_stride == 0 {
        return Err(invalid("rank_stride", "must be at least 1"));
    }
    let target_params = check_targets(device, targets, y.width)?;
    match grouping {
        Grouping::Segments(s) => {
            device.expect_same("cu_seqlens", s.cu_seqlens.device())?;
            device.expect_same("seg_slot", s.seg_slot.device())?;
            if let Some(spec) = spec
                && s.n_segments > spec.max_segments
            {
                return Err(invalid(
                    "segments",
                    format!("{}; the workspace serves {}", s.n_segments, spec.max_segments),
                ));
            }
            check_range("cu_seqlens", 0, s.n_segments + 1, s.cu_seqlens.len())?;
            check_range("seg_slot", 0, s.n_segments, s.seg_slot.len())?;
        }
        Grouping::Uniform(e) => {
            if let Some(t) = targets.iter().find(|t| e >= t.n_entries) {
                return Err(KernelError::BadIndex {
                    arg: "entry",
                    position: 0,
                    index: e as i64,
                    n_entries: t.n_entries,
                });
            }
        }
    }
    Ok(target_params)
}

/// Each row's entry index (-1: none), from the segments, checked like the kernel checks them.
fn row_entries(grouping: Grouping<'_>, n_rows: usize) -> Result<Vec<(i64, usize)>, KernelError> {
    match grouping {
        Grouping::Uniform(e) => Ok(vec![(e as i64, 0); n_rows]),
        Grouping::Segments(s) => {
            let cu = s.cu_seqlens.download_range(0, s.n_segments + 1)?;
            let slots = s.seg_slot.download_range(0, s.n_segments)?;
            let mut rows = vec![(-1i64, 0usize); n_rows];
            for seg in 0..s.n_segments {
                let (start, end) = (cu[seg], cu[seg + 1]);
                if start < 0 || end < start || end as usize > n_rows {
                    return Err(invalid(
                        "cu_seqlens",
                        format!("segment {seg} spans {start}..{end}, rows are 0..{n_rows}"),
                    ));
                }
                for r in &mut rows[start as usize..end as usize] {
                    *r = (i64::from(slots[seg]), seg);
                }
            }
            Ok(rows)
        }
    }
}

fn reference<Y: OutputElem>(
    memory: &CpuMemory,
    x: &Rows<'_, bf16>,
    grouping: Grouping<'_>,
    targets: &[LoraTarget<'_>],
    stride: usize,
    y: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    let rows = row_entries(grouping, x.n_rows)?;
    let arg = match grouping {
        Grouping::Uniform(_) => "entry",
        Grouping::Segments(_) => "seg_slot",
    };
    reference_apply(memory, x, &rows, arg, targets, stride, y)
}

/// The plan for the call (`options.choice`), launched as it says.
#[allow(clippy::too_many_arguments)]
fn launch<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    grouping: Grouping<'_>,
    target_params: &[TargetParams; MAX_TARGETS],
    targets: &[LoraTarget<'_>],
    stride: usize,
    y: &RowsMut<'_, Y>,
    ws: &LoraWorkspace,
    options: PrefillOptions,
) -> Result<(), KernelError> {
    let n = x.n_rows;
    let n_targets = targets.len();
    let (cu_seqlens, seg_slot, n_segments, uniform_entry) = match grouping {
        Grouping::Segments(s) => (s.cu_seqlens.device_addr(), s.seg_slot.device_addr(), s.n_segments, -1),
        Grouping::Uniform(e) => (0, 0, 0, to_i32("entry", e)?),
    };
    let call = prefill_call::<Y>(x, grouping, targets, stride)?;
    let (plan, shape) = plan::resolve(&call, &DeviceLimits::of(c), options.choice)?;
    let params = SgmvParams {
        x: x.addr(),
        y: y.addr(),
        cu_seqlens,
        seg_slot,
        ws: ws.addr(),
        fault: c.fault_addr(),
        n_rows: to_i32("x.n_rows", n)?,
        in_dim: to_i32("x.width", x.width)?,
        x_stride: to_i32("x.stride", x.stride)?,
        y_stride: to_i32("y.stride", y.stride)?,
        rank_stride: to_i32("rank_stride", stride)?,
        n_targets: to_i32("targets", n_targets)?,
        n_segments: to_i32("n_segments", n_segments)?,
        uniform_entry,
        k_splits: to_i32("k_splits", plan.k_splits)?,
        ws_rows: to_i32("ws.max_rows", ws.spec().max_rows)?,
        ws_rank_pad: to_i32("ws.rank_pad", ws.rank_pad())?,
        max_tiles: to_i32("tiles", shape.max_tiles)?,
        rank_chunks: to_i32("rank_chunks", shape.rank_chunks)?,
        out_tiles: to_i32("out_tiles", shape.out_tiles)?,
        balance_items: i32::from(plan.balanced_items),
        y_buffers: to_i32("plan.y_buffers", plan.y_buffers)?,
        early_dependents: i32::from(plan.early_dependents),
        pad: 0,
        targets: *target_params,
    };
    let sgmv_kernel = |name| Kernel {
        family: Family::Sgmv,
        name,
    };
    let (shrink, expand) = (sgmv_kernel(shape.shrink_kernel), sgmv_kernel(shape.expand_kernel));
    let shrink_launch = Launch {
        grid: shape.shrink_grid,
        block: THREADS,
        smem: shape.shrink_smem,
    };
    let expand_launch = Launch {
        grid: shape.expand_grid,
        block: THREADS,
        smem: shape.expand_smem,
    };
    // SAFETY: `SgmvParams` mirrors the kernels' struct (sizes asserted on both sides).
    // The host checked x and y cover `n_rows` rows, the segment arrays hold
    // `n_segments (+1)` values, every target's table and column ranges lie in
    // their buffers, and the workspace holds `[targets][MAX_K_SPLITS][max_rows][rank_pad]`
    // floats with `n_rows <= max_rows`, `stride <= rank_pad`, and the plan's
    // `k_splits <= MAX_K_SPLITS` (the rule clamps it, `plan` refuses an exact plan past it).
    // The plan names a shrink whose A tiles cover the rank stride's chunks, and
    // sizes each launch's dynamic shared memory for its kernel, rank stride,
    // y element and `y_buffers` (the same values the parameter block carries).
    // The kernels check segment bounds, indices and ranks on the device before
    // reading A and B through table addresses (kept valid by the table's owner).
    // A dependent expand reads nothing the shrink writes before its
    // `griddepcontrol.wait`, and y and B are not written by the shrink.
    unsafe {
        if options.only_phase != Some(SgmvPhase::Expand) {
            c.launch(shrink, shrink_launch, &params)?;
        }
        if options.only_phase == Some(SgmvPhase::Shrink) {
            return Ok(());
        }
        // The expand runs `griddepcontrol.wait` before it reads the workspace.
        c.launch_chained(expand, expand_launch, &params, plan.dependent_expand)
    }
}

#[cfg(test)]
mod tests;
