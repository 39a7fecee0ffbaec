//! Segment-grouped LoRA apply (SGMV): prefill batches where rows
//! `cu_seqlens[s] .. cu_seqlens[s + 1]` share the entry `seg_slot[s]` (-1 =
//! no delta), and [`one_adapter`], the plain pair of GEMMs when every row
//! uses one entry. CUDA kernel family: `cuda/sgmv.cu` (a tensor-core shrink
//! into the workspace, then a tensor-core expand fused with the add into y;
//! warpgroup MMAs on compute capability 9.0, mma.sync elsewhere).

use half::bf16;

use super::pairs::reference_apply;
use super::workspace::MAX_K_SPLITS;
use super::{
    LoraTarget, LoraWorkspace, MAX_TARGETS, OutputElem, Rows, RowsMut, TargetParams, check_targets, to_i32, to_u32,
};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{CudaBackend, Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};

const TILE_ROWS: usize = 64;
const RANK_CHUNK: usize = 64;
const K_CHUNK: usize = 64;
/// cp.async stages of the shrink (`SG_STAGES`).
const STAGES: usize = 3;
/// cp.async stages of the shrink for rank strides up to 16 (`SG_STAGES_R16`).
const STAGES_R16: usize = 6;
/// Rank rows of the A tile of the narrow shrink (`sgmv_shrink_r16_bf16`).
const NARROW_RANK: usize = 16;
/// Outputs per item of the expand (`SG_BO`).
const OUT_TILE: usize = 128;
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

/// Launch knobs of the segment apply; `None` picks from the shape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SgmvTuning {
    /// K splits of the shrink (1..=8; by default as many as fill one wave, at least 4).
    pub k_splits: Option<u32>,
    /// Benchmarks only: launch just this phase, to time it alone. The
    /// output is then NOT the LoRA apply (the expand reads whatever the
    /// workspace holds).
    pub only_phase: Option<SgmvPhase>,
    /// Rank strides up to 16 only: the shrink with 16-row A tiles and a
    /// deeper pipeline (`true`) or the 64-row one (`false`, the default:
    /// as fast alone, and about 5 µs faster at prefill r16 when applies
    /// follow one another in a graph; NOTES.md v10).
    pub narrow_shrink: Option<bool>,
    /// Launch the expand as a programmatic dependent of the shrink (`true`,
    /// the default), so its blocks get resident and load y and B while the
    /// shrink finishes; they wait for the shrink before reading t.
    pub dependent_expand: Option<bool>,
    /// Deal the expand's items to blocks in equal runs over the tiles the
    /// segments really have (`true`, the default: each block counts them
    /// first), or in runs of `ceil(items / grid)` over the most tiles the
    /// host allows for (`false`).
    pub balanced_items: Option<bool>,
    /// The 64-row shrink only (rank strides over 16, or `narrow_shrink`
    /// off): stage the x and A pieces of one position together, the
    /// vector-path check hoisted above the piece loop (`true`, the
    /// default), or in two loops with the check per piece (`false`).
    pub paired_staging: Option<bool>,
    /// The shrink on warpgroup MMAs (`true`: `wgmma`, sm_90a only, A tiles
    /// of 16, 32 or 64 rows by the rank stride) or on `mma.sync` (`false`).
    /// `None`: wgmma where the device runs it (compute capability 9.0, an
    /// NVRTC of CUDA 12.0 or newer) and neither `narrow_shrink` nor
    /// `paired_staging` names an mma.sync kernel.
    pub wgmma_shrink: Option<bool>,
    /// The expand on warpgroup MMAs (`true`: `wgmma` with t's two bf16
    /// parts and B in swizzled shared memory, sm_90a only) or on `mma.sync`
    /// (`false`). `None`: wgmma where the device runs it.
    pub wgmma_expand: Option<bool>,
    /// The wgmma expand only: start each item's MMAs from zero as soon as
    /// its B rows land and add y once it lands (`true`), or start them from
    /// y (`false`). `None`: `true` past rank stride 32 (see
    /// `default_mma_before_y`).
    pub mma_before_y: Option<bool>,
    /// When the shrink lets a dependent expand get resident: at its start
    /// (`true`) or once its blocks are past their main loop (`false`).
    /// `None`: by [`SgmvTuning::y_buffers`] and the shrink (see
    /// `default_early_dependents`).
    pub early_dependents: Option<bool>,
    /// The expand's y tiles: one shared-memory buffer (`Some(1)`) or two
    /// (`Some(2)`: the next item's tile is requested while this one
    /// computes). `None`: one (never fewer resident blocks, and measured
    /// faster at both prefill shapes).
    pub y_buffers: Option<u32>,
}

/// One of the two launches of the segment apply.
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
const _: () = assert!(size_of::<SgmvParams>() == 216 && std::mem::offset_of!(SgmvParams, targets) == 120);

/// How rows pick their entry.
#[derive(Clone, Copy)]
enum Grouping<'a> {
    Segments(&'a Segments<'a>),
    Uniform(usize),
}

/// `y[row, target columns] += scale * B (A x[row])` where each segment's
/// rows use the entry `seg_slot[s]`. Scratch comes from `ws`.
pub fn sgmv<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    segments: &Segments<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
    ws: &mut LoraWorkspace,
) -> Result<(), KernelError> {
    sgmv_tuned(device, x, segments, targets, rank_stride, y, ws, SgmvTuning::default())
}

/// [`sgmv`] with explicit launch knobs.
#[allow(clippy::too_many_arguments)]
pub fn sgmv_tuned<Y: OutputElem>(
    device: &Device,
    x: Rows<'_, bf16>,
    segments: &Segments<'_>,
    targets: &[LoraTarget<'_>],
    rank_stride: usize,
    y: RowsMut<'_, Y>,
    ws: &mut LoraWorkspace,
    tuning: SgmvTuning,
) -> Result<(), KernelError> {
    apply(
        device,
        x,
        Grouping::Segments(segments),
        targets,
        rank_stride,
        y,
        ws,
        tuning,
    )
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
    apply(
        device,
        x,
        Grouping::Uniform(entry),
        targets,
        rank_stride,
        y,
        ws,
        SgmvTuning::default(),
    )
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
    tuning: SgmvTuning,
) -> Result<(), KernelError> {
    x.check(device, "x")?;
    y.check(device, "y")?;
    device.expect_same("ws", ws.device())?;
    if y.n_rows != x.n_rows {
        return Err(invalid("y", format!("{} rows, x has {}", y.n_rows, x.n_rows)));
    }
    let spec = *ws.spec();
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
    let target_params = check_targets(device, targets, y.width)?;
    match grouping {
        Grouping::Segments(s) => {
            device.expect_same("cu_seqlens", s.cu_seqlens.device())?;
            device.expect_same("seg_slot", s.seg_slot.device())?;
            if s.n_segments > spec.max_segments {
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
    if x.n_rows == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => reference(&cpu.memory, &x, grouping, targets, rank_stride, y),
        Backend::Cuda(c) => launch(c, &x, grouping, &target_params, targets, rank_stride, &y, ws, tuning),
    }
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
    tuning: SgmvTuning,
) -> Result<(), KernelError> {
    let n = x.n_rows;
    let n_targets = targets.len();
    let (cu_seqlens, seg_slot, n_segments, uniform_entry) = match grouping {
        Grouping::Segments(s) => (s.cu_seqlens.device_addr(), s.seg_slot.device_addr(), s.n_segments, -1),
        Grouping::Uniform(e) => (0, 0, 0, to_i32("entry", e)?),
    };
    // Segments may each end in a partial tile: at most one extra tile per segment.
    let max_tiles = n.div_ceil(TILE_ROWS) + n_segments;
    let rank_chunks = stride.div_ceil(RANK_CHUNK);
    let k_chunks = x.width.div_ceil(K_CHUNK).max(1);
    let wgmma = c.wgmma;
    let shrink = choose_shrink(&tuning, stride, wgmma)?;
    let wgmma_expand = capability_flag("tuning.wgmma_expand", tuning.wgmma_expand, wgmma, WGMMA_NEEDS, true)?;
    let mma_before_y = capability_flag(
        "tuning.mma_before_y",
        tuning.mma_before_y,
        wgmma_expand,
        "starting the MMAs before y needs the wgmma expand",
        default_mma_before_y(stride),
    )?;
    let shrink_tiles = max_tiles * n_targets * rank_chunks;
    let shrink_smem = shrink.smem();
    let shrink_resident = blocks_per_sm(shrink_smem as usize, c.smem_per_sm) * c.sm_count as usize;
    let k_splits = match tuning.k_splits {
        Some(v) => v as usize,
        None => default_k_splits(shrink_tiles, shrink_resident, least_k_splits(shrink)),
    }
    .clamp(1, MAX_K_SPLITS.min(k_chunks));
    let max_out = targets.iter().map(|t| t.out_dim).max().unwrap_or(0);
    let out_tiles = max_out.div_ceil(OUT_TILE).max(1);
    let y_size = std::mem::size_of::<Y>();
    let y_buffers = match tuning.y_buffers {
        Some(v @ (1 | 2)) => v as usize,
        Some(v) => return Err(invalid("tuning.y_buffers", format!("{v}; 1 or 2"))),
        None => DEFAULT_Y_BUFFERS,
    };
    let early_dependents = tuning
        .early_dependents
        .unwrap_or(default_early_dependents(shrink, y_buffers));
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
        k_splits: to_i32("k_splits", k_splits)?,
        ws_rows: to_i32("ws.max_rows", ws.spec().max_rows)?,
        ws_rank_pad: to_i32("ws.rank_pad", ws.rank_pad())?,
        max_tiles: to_i32("tiles", max_tiles)?,
        rank_chunks: to_i32("rank_chunks", rank_chunks)?,
        out_tiles: to_i32("out_tiles", out_tiles)?,
        balance_items: i32::from(tuning.balanced_items.unwrap_or(true)),
        y_buffers: to_i32("tuning.y_buffers", y_buffers)?,
        early_dependents: i32::from(early_dependents),
        pad: 0,
        targets: *target_params,
    };
    let shrink_grid = (to_u32("grid", shrink_tiles)?, to_u32("grid", k_splits)?, 1);
    // Persistent expand: every resident block walks a share of the (tile, target, chunk) items.
    let items = max_tiles * n_targets * out_tiles;
    to_i32("expand items", items)?;
    let smem = expand_smem_bytes(stride, y_size, y_buffers, wgmma_expand);
    let resident = blocks_per_sm(smem, c.smem_per_sm) * c.sm_count as usize;
    let expand_grid = (to_u32("grid", items.min(resident).max(1))?, 1, 1);
    let expand_smem = to_u32("expand shared memory", smem)?;
    if expand_smem as usize > c.smem_optin {
        return Err(invalid(
            "rank_stride",
            format!("{stride} needs {expand_smem} bytes of shared memory"),
        ));
    }
    // SAFETY: `SgmvParams` mirrors the kernels' struct (sizes asserted on both sides).
    // The host checked x and y cover `n_rows` rows, the segment arrays hold
    // `n_segments (+1)` values, every target's table and column ranges lie in
    // their buffers, and the workspace holds `[targets][MAX_K_SPLITS][max_rows][rank_pad]`
    // floats with `n_rows <= max_rows`, `stride <= rank_pad`, `k_splits <= MAX_K_SPLITS`.
    // The kernels check segment bounds, indices and ranks on the device before
    // reading A and B through table addresses (kept valid by the table's owner).
    // A dependent expand reads nothing the shrink writes before its
    // `griddepcontrol.wait`, and y and B are not written by the shrink.
    unsafe {
        if tuning.only_phase != Some(SgmvPhase::Expand) {
            c.launch(
                Kernel {
                    family: Family::Sgmv,
                    name: shrink.name(),
                },
                Launch {
                    grid: shrink_grid,
                    block: THREADS,
                    smem: shrink_smem,
                },
                &params,
            )?;
        }
        if tuning.only_phase == Some(SgmvPhase::Shrink) {
            return Ok(());
        }
        let expand = expand_kernel(Y::NAME == "bf16", wgmma_expand, mma_before_y);
        let kernel = Kernel {
            family: Family::Sgmv,
            name: expand,
        };
        let shape = Launch {
            grid: expand_grid,
            block: THREADS,
            smem: expand_smem,
        };
        // The expand runs `griddepcontrol.wait` before it reads the workspace.
        c.launch_chained(kernel, shape, &params, tuning.dependent_expand.unwrap_or(true))
    }
}

/// Why a wgmma kernel asked for cannot run.
const WGMMA_NEEDS: &str = "wgmma needs compute capability 9.0 and an NVRTC of CUDA 12.0 or newer (sm_90a)";

/// A tuning flag that needs a capability: `Some(true)` without it is a
/// typed error naming `field`; `None` is `default` where the capability is
/// there, else off.
fn capability_flag(
    field: &'static str,
    asked: Option<bool>,
    available: bool,
    needs: &str,
    default: bool,
) -> Result<bool, KernelError> {
    match asked {
        Some(true) if !available => Err(invalid(field, needs)),
        Some(on) => Ok(on),
        None => Ok(available && default),
    }
}

/// The expand kernel for bf16 (else f32) y: mma.sync, or wgmma starting
/// from y or (`mma_before_y`) before it.
fn expand_kernel(bf16_y: bool, wgmma: bool, mma_before_y: bool) -> &'static str {
    match (bf16_y, wgmma, mma_before_y) {
        (true, false, _) => "sgmv_expand_bf16",
        (false, false, _) => "sgmv_expand_f32",
        (true, true, false) => "sgmv_expand_wg_bf16",
        (false, true, false) => "sgmv_expand_wg_f32",
        (true, true, true) => "sgmv_expand_wgf_bf16",
        (false, true, true) => "sgmv_expand_wgf_f32",
    }
}

/// Whether the wgmma expand starts its MMAs before y lands, where the
/// tuning does not say: past rank stride 32. Measured on the H200 in a
/// graph (NOTES.md v27): prefill r64 83.5 -> 82.0 µs; r32 37.7 -> 38.1, r16
/// 34.5 -> 34.9 (the extra barrier outweighs MMAs too short to hide much).
fn default_mma_before_y(stride: usize) -> bool {
    stride > 32
}

/// A shrink kernel of `cuda/sgmv.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShrinkKernel {
    /// mma.sync with 64-row A tiles, x and A pieces staged in pairs or split.
    Wide { paired: bool },
    /// mma.sync with 16-row A tiles and a deeper pipeline (rank strides up to 16).
    Narrow,
    /// wgmma (sm_90a) with A tiles of `a_rows` (16, 32 or 64) rows.
    Wgmma { a_rows: usize },
}

impl ShrinkKernel {
    fn name(self) -> &'static str {
        match self {
            ShrinkKernel::Wide { paired: true } => "sgmv_shrink_bf16",
            ShrinkKernel::Wide { paired: false } => "sgmv_shrink_split_bf16",
            ShrinkKernel::Narrow => "sgmv_shrink_r16_bf16",
            ShrinkKernel::Wgmma { a_rows: 16 } => "sgmv_shrink_wg16_bf16",
            ShrinkKernel::Wgmma { a_rows: 32 } => "sgmv_shrink_wg32_bf16",
            ShrinkKernel::Wgmma { .. } => "sgmv_shrink_wg64_bf16",
        }
    }

    /// Dynamic shared memory of the kernel.
    fn smem(self) -> u32 {
        match self {
            ShrinkKernel::Wide { .. } => SHRINK_SMEM,
            ShrinkKernel::Narrow => SHRINK_R16_SMEM,
            ShrinkKernel::Wgmma { a_rows } => wg_shrink_smem(a_rows),
        }
    }
}

/// The shrink for a rank stride under `tuning`, where `wgmma` says whether
/// the device runs sm_90a code. The mma.sync kernels stay reachable by
/// naming them (`wgmma_shrink: Some(false)`, `narrow_shrink`, `paired_staging`).
fn choose_shrink(tuning: &SgmvTuning, stride: usize, wgmma: bool) -> Result<ShrinkKernel, KernelError> {
    let names_mma_sync = tuning.narrow_shrink.is_some() || tuning.paired_staging.is_some();
    if tuning.wgmma_shrink == Some(true) && names_mma_sync {
        return Err(invalid(
            "tuning.wgmma_shrink",
            "narrow_shrink and paired_staging choose among the mma.sync shrinks",
        ));
    }
    let use_wgmma = capability_flag(
        "tuning.wgmma_shrink",
        tuning.wgmma_shrink,
        wgmma,
        WGMMA_NEEDS,
        !names_mma_sync,
    )?;
    Ok(if use_wgmma {
        let a_rows = match stride {
            0..=16 => 16,
            17..=32 => 32,
            _ => RANK_CHUNK,
        };
        ShrinkKernel::Wgmma { a_rows }
    } else if stride <= NARROW_RANK && tuning.narrow_shrink.unwrap_or(false) {
        ShrinkKernel::Narrow
    } else {
        ShrinkKernel::Wide {
            paired: tuning.paired_staging.unwrap_or(true),
        }
    })
}

/// Stages of the wgmma shrink for A tiles of `a_rows` rows: as many x and A
/// tile pairs as fit 56 KB, so four blocks stay resident per multiprocessor
/// (`sg_wg_stages` in `cuda/sgmv.cu`).
const fn wg_shrink_stages(a_rows: usize) -> usize {
    56 * 1024 / ((TILE_ROWS + a_rows) * K_CHUNK * 2)
}

/// Dynamic shared memory of the wgmma shrink: its stages of swizzled tiles
/// (unpadded rows) and 1 KB to align them to the swizzle's 1024 bytes.
const fn wg_shrink_smem(a_rows: usize) -> u32 {
    (wg_shrink_stages(a_rows) * (TILE_ROWS + a_rows) * K_CHUNK * 2 + 1024) as u32
}

/// Dynamic shared memory of the shrink: x and A tiles, `STAGES` deep, rows padded by 8.
const SHRINK_SMEM: u32 = (2 * STAGES * TILE_ROWS * (K_CHUNK + 8) * 2) as u32;
/// Dynamic shared memory of the narrow shrink: x tiles and 16-row A tiles, `STAGES_R16` deep.
const SHRINK_R16_SMEM: u32 = (STAGES_R16 * (TILE_ROWS + NARROW_RANK) * (K_CHUNK + 8) * 2) as u32;
/// Static shared memory of the shrinks, at most: the copy of the table's
/// first 64 entries (`SG_TABLE_SMEM` in `cuda/sgmv.cu`, 1.5 KB), the tile
/// and its entry (1664 bytes under nvcc 13).
const SHRINK_STATIC_SMEM: usize = 2048;
// Three narrow-shrink blocks fit an H100 / H200 multiprocessor (228 KB, 1 KB reserved per block):
// the depth was chosen so that the 288 blocks of a 4096-row batch are resident at once.
const _: () = assert!(3 * (SHRINK_R16_SMEM as usize + SHRINK_STATIC_SMEM + 1024) <= 228 * 1024);
// Four 64-row shrink blocks fit one, as `blocks_per_sm` counts for the default K splits.
const _: () = assert!(4 * (SHRINK_SMEM as usize + SHRINK_STATIC_SMEM + 1024) <= 228 * 1024);
// So do four wgmma shrink blocks of every A tile height, each with at least three stages.
const _: () = {
    let heights = [16, 32, RANK_CHUNK];
    let mut i = 0;
    while i < heights.len() {
        assert!(4 * (wg_shrink_smem(heights[i]) as usize + SHRINK_STATIC_SMEM + 1024) <= 228 * 1024);
        assert!(wg_shrink_stages(heights[i]) >= 3);
        i += 1;
    }
};

/// Dynamic shared memory of the expand (`sB`, `sT` and `y_buffers` `sY`
/// tiles in `cuda/sgmv.cu`) for y elements of `y_size` bytes. The wgmma
/// expand stages B, and t's bf16 high and low parts in place of the f32 sT,
/// as 64-column swizzled atoms from a 1024-byte boundary.
fn expand_smem_bytes(stride: usize, y_size: usize, y_buffers: usize, wgmma: bool) -> usize {
    let r16 = stride.div_ceil(16) * 16;
    let b_and_t = if wgmma {
        let atoms = stride.div_ceil(K_CHUNK);
        atoms * (OUT_TILE + 2 * TILE_ROWS) * K_CHUNK * 2 + 1024
    } else {
        OUT_TILE * (r16 + 8) * 2 + TILE_ROWS * (r16 + 4) * 4
    };
    b_and_t + y_buffers * TILE_ROWS * (OUT_TILE * y_size + 16)
}

/// The expand's y buffers when the tuning names none: one. It never leaves
/// fewer blocks resident than two, and since whole tiles move without
/// per-piece checks it is also faster where both give four blocks (H200,
/// prefill r16 in a graph: 40.6 against 41.7 µs; r64, where one buffer
/// makes 4 blocks resident instead of 3, 106.5 against 113.3).
const DEFAULT_Y_BUFFERS: usize = 1;

/// K splits of the shrink when the tuning names none: as many as keep all
/// of its `tiles x splits` blocks resident in one wave (more blocks, each
/// with fewer K chunks, keep more copies in flight), at least `least` (the
/// best where the tiles alone fill the machine) and at most
/// [`MAX_K_SPLITS`]. Measured on the H200: prefill r16 (72 tiles, 528
/// resident) takes 7, 42.4 -> 40.5 µs (NOTES.md v10); at r64 (160 tiles)
/// the mma.sync shrink was best at 4 (v10), the wgmma shrink at 3 (v27: in
/// a graph 83.4 against 84.3 µs at 4, 89.5 at 2).
fn default_k_splits(tiles: usize, resident: usize, least: usize) -> usize {
    (resident / tiles.max(1)).clamp(least, MAX_K_SPLITS)
}

/// When the shrink lets the expand get resident, where the tuning does not
/// say: at its start, except with two y buffers after a wgmma shrink of A
/// tiles over 16 rows, where early residency was much slower (NOTES.md v27,
/// H200 in a graph, two y buffers, early against late: prefill r64 115.5
/// against 90.1 µs, r32 48.7 against 42.9; r16 36.7 against 39.3; with one
/// buffer early wins at every shape: r64 84.3 against 91.4).
fn default_early_dependents(shrink: ShrinkKernel, y_buffers: usize) -> bool {
    match shrink {
        ShrinkKernel::Wgmma { a_rows } if a_rows > 16 => y_buffers == 1,
        _ => true,
    }
}

/// The fewest K splits [`default_k_splits`] picks for a shrink kernel.
fn least_k_splits(shrink: ShrinkKernel) -> usize {
    match shrink {
        ShrinkKernel::Wgmma { .. } => 3,
        _ => 4,
    }
}

/// Blocks of `smem` bytes of shared memory resident per multiprocessor, at
/// most four (the registers of the shrinks allow four, and the expand's
/// `__launch_bounds__(128, 4)` asks for four).
fn blocks_per_sm(smem: usize, smem_per_sm: usize) -> usize {
    (smem_per_sm / (smem + 1024)).clamp(1, 4)
}

#[cfg(test)]
mod tests;
