//! The prefill rule table: which shrink and expand kernels, K splits and
//! launch shapes serve a segment apply ([`super::sgmv`], [`super::one_adapter`]).
//!
//! [`plan`] is a pure function of a [`PrefillCall`] (the validated,
//! device-free description of one call), the device's [`DeviceLimits`] and
//! a [`Choice`]: [`Choice::Auto`] runs the rules below, [`Choice::Exact`]
//! checks a given [`PrefillPlan`] against the call and device. It never
//! launches, so every decision runs and is tested on the CPU (the recorded
//! table `plan.golden`); `super::launch` then launches what the plan says,
//! with no decision of its own. [`candidates`] lists every plan the device
//! can run for a call (benchmarks and tests of each form).
//!
//! The rules of [`Choice::Auto`]:
//! - shrink: on warpgroup MMAs (`wgmma`) with A tiles of 16, 32 or 64 rows
//!   by the rank stride where the device runs sm_90a code, else the 64-row
//!   `mma.sync` shrink with paired staging (the narrow one is as fast alone
//!   and slower in a graph of applies at rank stride 16, NOTES.md v10);
//! - expand: on `wgmma` where the device runs it, its MMAs started before
//!   y lands past rank stride 32 (`default_mma_before_y`), else `mma.sync`;
//! - K splits: as many as keep the shrink's blocks resident in one wave
//!   (`default_k_splits`), within what the K chunks allow;
//! - one y buffer (`DEFAULT_Y_BUFFERS`), items dealt in balanced runs;
//! - the expand a programmatic dependent of the shrink on compute capability
//!   9.0 and newer, let resident early except after a wide wgmma shrink with
//!   two y buffers (`default_early_dependents`).

use std::fmt;

use crate::error::{KernelError, invalid};
use crate::ops::limits::{Choice, DeviceLimits};
use crate::ops::workspace::MAX_K_SPLITS;
use crate::ops::{MAX_TARGETS, OutputElem, to_i32, to_u32};

/// Rows of an x tile (`SG_BM`).
pub(super) const TILE_ROWS: usize = 64;
/// Rank rows of one shrink block (the 64-row shrinks' A tile).
const RANK_CHUNK: usize = 64;
/// In-dim columns of one K chunk (`SG_BK`).
const K_CHUNK: usize = 64;
/// cp.async stages of the shrink (`SG_STAGES`).
const STAGES: usize = 3;
/// cp.async stages of the shrink for rank strides up to 16 (`SG_STAGES_R16`).
const STAGES_R16: usize = 6;
/// Rank rows of the A tile of the narrow shrink (`sgmv_shrink_r16_bf16`).
const NARROW_RANK: usize = 16;
/// Outputs per item of the expand (`SG_BO`).
const OUT_TILE: usize = 128;

/// The element of y, as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum YKind {
    Bf16,
    F32,
}

impl YKind {
    fn of<Y: OutputElem>() -> YKind {
        if Y::NAME == "bf16" { YKind::Bf16 } else { YKind::F32 }
    }

    fn size(self) -> usize {
        match self {
            YKind::Bf16 => 2,
            YKind::F32 => 4,
        }
    }
}

/// A validated, device-free description of one segment apply: what every
/// launch decision reads, and nothing else (no buffer, no address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefillCall {
    rows: usize,
    in_dim: usize,
    rank_stride: usize,
    y: YKind,
    /// `None`: every row uses one entry ([`super::one_adapter`]).
    segments: Option<usize>,
    n_targets: usize,
    out_dims: [usize; MAX_TARGETS],
}

impl PrefillCall {
    /// A [`super::sgmv`] call: `rows` rows of `in_dim` in `n_segments`
    /// segments, rank stride `rank_stride`, y elements `Y`, one target per
    /// output width of `out_dims` (1 to [`MAX_TARGETS`]).
    pub fn segments<Y: OutputElem>(
        rows: usize,
        in_dim: usize,
        rank_stride: usize,
        n_segments: usize,
        out_dims: &[usize],
    ) -> Result<PrefillCall, KernelError> {
        PrefillCall::new(rows, in_dim, rank_stride, YKind::of::<Y>(), Some(n_segments), out_dims)
    }

    /// A [`super::one_adapter`] call: every row uses one entry.
    pub fn one_entry<Y: OutputElem>(
        rows: usize,
        in_dim: usize,
        rank_stride: usize,
        out_dims: &[usize],
    ) -> Result<PrefillCall, KernelError> {
        PrefillCall::new(rows, in_dim, rank_stride, YKind::of::<Y>(), None, out_dims)
    }

    fn new(
        rows: usize,
        in_dim: usize,
        rank_stride: usize,
        y: YKind,
        segments: Option<usize>,
        out_dims: &[usize],
    ) -> Result<PrefillCall, KernelError> {
        if rows == 0 {
            return Err(invalid("rows", "0; an empty call launches nothing"));
        }
        to_i32("rows", rows)?;
        to_i32("in_dim", in_dim)?;
        if rank_stride == 0 {
            return Err(invalid("rank_stride", "must be at least 1"));
        }
        to_i32("rank_stride", rank_stride)?;
        if let Some(s) = segments {
            to_i32("segments", s)?;
        }
        if out_dims.is_empty() || out_dims.len() > MAX_TARGETS {
            return Err(invalid(
                "targets",
                format!("{} targets; 1..={MAX_TARGETS} allowed", out_dims.len()),
            ));
        }
        let mut dims = [0; MAX_TARGETS];
        for (d, &o) in dims.iter_mut().zip(out_dims) {
            to_i32("targets.out_dim", o)?;
            *d = o;
        }
        Ok(PrefillCall {
            rows,
            in_dim,
            rank_stride,
            y,
            segments,
            n_targets: out_dims.len(),
            out_dims: dims,
        })
    }

    /// Rows (tokens) of the call.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements of an x row.
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// Rank stride of the pool's A and B.
    pub fn rank_stride(&self) -> usize {
        self.rank_stride
    }

    /// Segments of the call (`None`: one entry for every row).
    pub fn n_segments(&self) -> Option<usize> {
        self.segments
    }

    /// Output width of each target.
    pub fn out_dims(&self) -> &[usize] {
        &self.out_dims[..self.n_targets]
    }

    /// Bytes of a y element (2: bf16, 4: f32).
    pub fn y_bytes(&self) -> usize {
        self.y.size()
    }

    /// Segments may each end in a partial tile: at most one extra tile per segment.
    fn max_tiles(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS) + self.segments.unwrap_or(0)
    }

    fn rank_chunks(&self) -> usize {
        self.rank_stride.div_ceil(RANK_CHUNK)
    }

    fn k_chunks(&self) -> usize {
        self.in_dim.div_ceil(K_CHUNK).max(1)
    }

    fn out_tiles(&self) -> usize {
        let max_out = self.out_dims().iter().copied().max().unwrap_or(0);
        max_out.div_ceil(OUT_TILE).max(1)
    }

    /// The most K splits the call allows: the workspace's and one per K chunk.
    fn max_k_splits(&self) -> usize {
        MAX_K_SPLITS.min(self.k_chunks())
    }
}

/// `rows=4096 in=4096 r=16 segs=8 out=[4096] y=bf16` (`segs=one`: one entry for every row).
impl fmt::Display for PrefillCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rows={} in={} r={} segs=", self.rows, self.in_dim, self.rank_stride)?;
        match self.segments {
            Some(s) => write!(f, "{s}")?,
            None => write!(f, "one")?,
        }
        let y = match self.y {
            YKind::Bf16 => "bf16",
            YKind::F32 => "f32",
        };
        write!(f, " out={:?} y={y}", self.out_dims())
    }
}

/// A shrink kernel of `cuda/sgmv.cu` (`x A^T` into the workspace).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShrinkKernel {
    /// `mma.sync` with 64-row A tiles, the x and A pieces of one position
    /// staged together with the vector-path check hoisted above the piece
    /// loop (`paired`), or in two loops with the check per piece.
    Wide {
        /// Paired staging (`sgmv_shrink_bf16`) or split (`sgmv_shrink_split_bf16`).
        paired: bool,
    },
    /// `mma.sync` with 16-row A tiles and a deeper pipeline (rank strides up to 16).
    Narrow,
    /// Warpgroup MMAs (sm_90a) with A tiles of `a_rows` rows: 16, 32 or 64,
    /// the rank stride's ([`ShrinkKernel::wgmma_for`]).
    Wgmma {
        /// Rows of the A tile.
        a_rows: usize,
    },
}

impl ShrinkKernel {
    /// The wgmma shrink for a rank stride: A tiles of 16 rows up to stride
    /// 16, 32 up to 32, else 64 (rank chunks of 64).
    pub fn wgmma_for(rank_stride: usize) -> ShrinkKernel {
        let a_rows = match rank_stride {
            0..=16 => 16,
            17..=32 => 32,
            _ => RANK_CHUNK,
        };
        ShrinkKernel::Wgmma { a_rows }
    }

    /// The kernel's name in `cuda/sgmv.cu` (a checked plan names one of them).
    pub(super) fn name(self) -> &'static str {
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

/// `wgmma16`, `wgmma32`, `wgmma64`, `mma16` (narrow), `mma64` (paired staging), `mma64-split`.
impl fmt::Display for ShrinkKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShrinkKernel::Wgmma { a_rows } => write!(f, "wgmma{a_rows}"),
            ShrinkKernel::Narrow => write!(f, "mma16"),
            ShrinkKernel::Wide { paired: true } => write!(f, "mma64"),
            ShrinkKernel::Wide { paired: false } => write!(f, "mma64-split"),
        }
    }
}

/// An expand kernel of `cuda/sgmv.cu` (`y += scale * t B^T`, t from the workspace).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpandKernel {
    /// `mma.sync`.
    MmaSync,
    /// Warpgroup MMAs (sm_90a) with t's two bf16 parts and B in swizzled
    /// shared memory.
    Wgmma {
        /// Start each item's MMAs from zero as soon as its B rows land and
        /// add y once it lands (`true`), or start them from y (`false`).
        mma_before_y: bool,
    },
}

impl ExpandKernel {
    /// The kernel's name in `cuda/sgmv.cu` for y elements of `y`.
    fn name(self, y: YKind) -> &'static str {
        let bf16 = y == YKind::Bf16;
        match (self, bf16) {
            (ExpandKernel::MmaSync, true) => "sgmv_expand_bf16",
            (ExpandKernel::MmaSync, false) => "sgmv_expand_f32",
            (ExpandKernel::Wgmma { mma_before_y: false }, true) => "sgmv_expand_wg_bf16",
            (ExpandKernel::Wgmma { mma_before_y: false }, false) => "sgmv_expand_wg_f32",
            (ExpandKernel::Wgmma { mma_before_y: true }, true) => "sgmv_expand_wgf_bf16",
            (ExpandKernel::Wgmma { mma_before_y: true }, false) => "sgmv_expand_wgf_f32",
        }
    }

    fn wgmma(self) -> bool {
        matches!(self, ExpandKernel::Wgmma { .. })
    }
}

/// `mma`, `wgmma` (MMAs from y), `wgmma-before-y`.
impl fmt::Display for ExpandKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExpandKernel::MmaSync => "mma",
            ExpandKernel::Wgmma { mma_before_y: false } => "wgmma",
            ExpandKernel::Wgmma { mma_before_y: true } => "wgmma-before-y",
        })
    }
}

/// Every launch choice of one segment apply, resolved: the two kernels and
/// what their parameter block and launches take from the plan. The grids
/// and shared memory follow from it and the call without further choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefillPlan {
    /// The shrink kernel.
    pub shrink: ShrinkKernel,
    /// K splits of the shrink (1 to 8, at most one per 64 columns of x).
    pub k_splits: usize,
    /// The expand kernel.
    pub expand: ExpandKernel,
    /// The expand's y tiles: one shared-memory buffer (1) or two (2: the
    /// next item's tile is requested while this one computes).
    pub y_buffers: usize,
    /// When the shrink lets a dependent expand get resident: at its start
    /// (`true`) or once its blocks are past their main loop (`false`).
    /// Only read where [`PrefillPlan::dependent_expand`] holds.
    pub early_dependents: bool,
    /// Deal the expand's items to blocks in equal runs over the tiles the
    /// segments really have (`true`: each block counts them first), or in
    /// runs of `ceil(items / grid)` over the most tiles the host allows for.
    pub balanced_items: bool,
    /// Launch the expand as a programmatic dependent of the shrink (compute
    /// capability 9.0 and newer), so its blocks get resident and load y and
    /// B while the shrink finishes; they wait for the shrink before reading t.
    pub dependent_expand: bool,
}

/// A short stable label: `shrink=wgmma64 ks=3 expand=wgmma-before-y y1 dep early bal`
/// (`nodep`: a plain expand launch; `late`: dependents let resident after
/// the shrink's main loop; `unbal`: items in runs over the most tiles).
impl fmt::Display for PrefillPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shrink={} ks={} expand={} y{} {} {} {}",
            self.shrink,
            self.k_splits,
            self.expand,
            self.y_buffers,
            if self.dependent_expand { "dep" } else { "nodep" },
            if self.early_dependents { "early" } else { "late" },
            if self.balanced_items { "bal" } else { "unbal" },
        )
    }
}

/// What the launches of a checked plan take: kernels, grids, shared memory
/// and the parameter block's tile counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefillShape {
    pub(super) shrink_kernel: &'static str,
    pub(super) shrink_grid: (u32, u32, u32),
    pub(super) shrink_smem: u32,
    pub(super) expand_kernel: &'static str,
    pub(super) expand_grid: (u32, u32, u32),
    pub(super) expand_smem: u32,
    pub(super) max_tiles: usize,
    pub(super) rank_chunks: usize,
    pub(super) out_tiles: usize,
}

/// The plan for `call` on a device of `limits`: the rule table's
/// ([`Choice::Auto`]) or the given one once checked against the call and
/// device ([`Choice::Exact`]; a typed error naming the field it cannot
/// serve). Either is refused where the launch shape does not fit the device
/// (the expand's shared memory at large rank strides).
pub fn plan(
    call: &PrefillCall,
    limits: &DeviceLimits,
    choice: Choice<PrefillPlan>,
) -> Result<PrefillPlan, KernelError> {
    resolve(call, limits, choice).map(|(plan, _)| plan)
}

/// [`plan`] and the launch shape it gives.
pub(super) fn resolve(
    call: &PrefillCall,
    limits: &DeviceLimits,
    choice: Choice<PrefillPlan>,
) -> Result<(PrefillPlan, PrefillShape), KernelError> {
    let plan = match choice {
        Choice::Auto => auto(call, limits),
        Choice::Exact(p) => {
            check(call, limits, &p)?;
            p
        }
    };
    let shape = shape(call, limits, &plan)?;
    Ok((plan, shape))
}

/// Every plan the device can run for `call` at the level of the launch
/// choices: each shrink kernel it runs (the wgmma one for the rank stride,
/// the narrow one up to stride 16, the 64-row one paired and split) × each
/// expand (wgmma from y and before y, mma.sync) × one and two y buffers ×
/// dependent (early or late) or plain expand launch × balanced or not, K
/// splits by the rule for each shrink. The rule table's plan first, no two
/// alike, each accepted by [`plan`] as [`Choice::Exact`]; empty where the
/// call fits no plan on the device.
pub fn candidates(call: &PrefillCall, limits: &DeviceLimits) -> Vec<PrefillPlan> {
    let stride = call.rank_stride;
    let mut shrinks = Vec::new();
    if limits.wgmma {
        shrinks.push(ShrinkKernel::wgmma_for(stride));
    }
    if stride <= NARROW_RANK {
        shrinks.push(ShrinkKernel::Narrow);
    }
    shrinks.extend([
        ShrinkKernel::Wide { paired: true },
        ShrinkKernel::Wide { paired: false },
    ]);
    let mut expands = Vec::new();
    if limits.wgmma {
        expands.extend([false, true].map(|mma_before_y| ExpandKernel::Wgmma { mma_before_y }));
    }
    expands.push(ExpandKernel::MmaSync);
    let dependents: &[bool] = if limits.hopper() { &[true, false] } else { &[false] };
    let mut all = vec![auto(call, limits)];
    for &shrink in &shrinks {
        let k_splits = auto_k_splits(call, limits, shrink);
        for &expand in &expands {
            for y_buffers in [1, 2] {
                for &dependent_expand in dependents {
                    // Without a dependent launch the shrink's flag changes nothing: the rule's value.
                    let early: &[bool] = if dependent_expand {
                        &[true, false]
                    } else if default_early_dependents(shrink, y_buffers) {
                        &[true]
                    } else {
                        &[false]
                    };
                    for &early_dependents in early {
                        for balanced_items in [true, false] {
                            all.push(PrefillPlan {
                                shrink,
                                k_splits,
                                expand,
                                y_buffers,
                                early_dependents,
                                balanced_items,
                                dependent_expand,
                            });
                        }
                    }
                }
            }
        }
    }
    let mut out: Vec<PrefillPlan> = Vec::with_capacity(all.len());
    for p in all {
        if !out.contains(&p) && resolve(call, limits, Choice::Exact(p)).is_ok() {
            out.push(p);
        }
    }
    out
}

/// The rule table (see the module docs).
fn auto(call: &PrefillCall, limits: &DeviceLimits) -> PrefillPlan {
    let shrink = if limits.wgmma {
        ShrinkKernel::wgmma_for(call.rank_stride)
    } else {
        ShrinkKernel::Wide { paired: true }
    };
    let expand = if limits.wgmma {
        ExpandKernel::Wgmma {
            mma_before_y: default_mma_before_y(call.rank_stride),
        }
    } else {
        ExpandKernel::MmaSync
    };
    PrefillPlan {
        shrink,
        k_splits: auto_k_splits(call, limits, shrink),
        expand,
        y_buffers: DEFAULT_Y_BUFFERS,
        early_dependents: default_early_dependents(shrink, DEFAULT_Y_BUFFERS),
        balanced_items: true,
        dependent_expand: limits.hopper(),
    }
}

/// The rule's K splits for `shrink`, within what the call allows.
fn auto_k_splits(call: &PrefillCall, limits: &DeviceLimits, shrink: ShrinkKernel) -> usize {
    let tiles = call
        .max_tiles()
        .saturating_mul(call.n_targets)
        .saturating_mul(call.rank_chunks());
    let resident = blocks_per_sm(shrink.smem() as usize, limits.smem_per_sm).saturating_mul(limits.multiprocessors);
    default_k_splits(tiles, resident, least_k_splits(shrink)).clamp(1, call.max_k_splits())
}

/// Why a wgmma kernel asked for cannot run.
const WGMMA_NEEDS: &str = "wgmma needs compute capability 9.0 and an NVRTC of CUDA 12.0 or newer (sm_90a)";

/// Whether `p` can serve `call` on the device (the launch shape is checked by [`shape`]).
fn check(call: &PrefillCall, limits: &DeviceLimits, p: &PrefillPlan) -> Result<(), KernelError> {
    let stride = call.rank_stride;
    match p.shrink {
        ShrinkKernel::Wgmma { .. } if !limits.wgmma => return Err(invalid("plan.shrink", WGMMA_NEEDS)),
        ShrinkKernel::Wgmma { a_rows } => {
            let want = ShrinkKernel::wgmma_for(stride);
            if p.shrink != want {
                return Err(invalid(
                    "plan.shrink",
                    format!("wgmma{a_rows} at rank stride {stride}; the wgmma shrink for it is {want}"),
                ));
            }
        }
        ShrinkKernel::Narrow if stride > NARROW_RANK => {
            return Err(invalid(
                "plan.shrink",
                format!("the narrow shrink serves rank strides up to {NARROW_RANK}, not {stride}"),
            ));
        }
        ShrinkKernel::Narrow | ShrinkKernel::Wide { .. } => {}
    }
    if p.expand.wgmma() && !limits.wgmma {
        return Err(invalid("plan.expand", WGMMA_NEEDS));
    }
    if p.k_splits == 0 || p.k_splits > call.max_k_splits() {
        return Err(invalid(
            "plan.k_splits",
            format!(
                "{}; 1..={} for an in dim of {}",
                p.k_splits,
                call.max_k_splits(),
                call.in_dim
            ),
        ));
    }
    if !matches!(p.y_buffers, 1 | 2) {
        return Err(invalid("plan.y_buffers", format!("{}; 1 or 2", p.y_buffers)));
    }
    if p.dependent_expand && !limits.hopper() {
        return Err(invalid(
            "plan.dependent_expand",
            "a programmatic dependent launch needs compute capability 9.0 or newer",
        ));
    }
    Ok(())
}

/// The launches of `p` for `call`: kernels, grids (the expand persistent,
/// at most one wave of resident blocks walking the (tile, target, chunk)
/// items) and shared memory, refused where they exceed the device.
fn shape(call: &PrefillCall, limits: &DeviceLimits, p: &PrefillPlan) -> Result<PrefillShape, KernelError> {
    let stride = call.rank_stride;
    let max_tiles = call.max_tiles();
    let rank_chunks = call.rank_chunks();
    let out_tiles = call.out_tiles();
    to_i32("tiles", max_tiles)?;
    to_i32("rank_chunks", rank_chunks)?;
    to_i32("out_tiles", out_tiles)?;
    let overflow = || invalid("rows", "the launch's tile count overflows");
    let shrink_tiles = max_tiles
        .checked_mul(call.n_targets)
        .and_then(|v| v.checked_mul(rank_chunks))
        .ok_or_else(overflow)?;
    let shrink_grid = (to_u32("grid", shrink_tiles)?, to_u32("grid", p.k_splits)?, 1);
    let items = max_tiles
        .checked_mul(call.n_targets)
        .and_then(|v| v.checked_mul(out_tiles))
        .ok_or_else(overflow)?;
    to_i32("expand items", items)?;
    let smem = expand_smem_bytes(stride, call.y.size(), p.y_buffers, p.expand.wgmma());
    let resident = blocks_per_sm(smem, limits.smem_per_sm).saturating_mul(limits.multiprocessors);
    let expand_grid = (to_u32("grid", items.min(resident).max(1))?, 1, 1);
    let expand_smem = to_u32("expand shared memory", smem)?;
    if expand_smem as usize > limits.smem_optin {
        return Err(invalid(
            "rank_stride",
            format!("{stride} needs {expand_smem} bytes of shared memory"),
        ));
    }
    let shrink_smem = p.shrink.smem();
    if shrink_smem as usize > limits.smem_optin {
        return Err(invalid(
            "plan.shrink",
            format!("{} needs {shrink_smem} bytes of shared memory", p.shrink),
        ));
    }
    Ok(PrefillShape {
        shrink_kernel: p.shrink.name(),
        shrink_grid,
        shrink_smem,
        expand_kernel: p.expand.name(call.y),
        expand_grid,
        expand_smem,
        max_tiles,
        rank_chunks,
        out_tiles,
    })
}

/// Whether the wgmma expand starts its MMAs before y lands: past rank
/// stride 32, where the MMAs are long enough to hide y's arrival; at 32 and
/// below the extra barrier outweighs what they hide (H200 in a graph,
/// NOTES.md v27).
fn default_mma_before_y(stride: usize) -> bool {
    stride > 32
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

/// The expand's y buffers by the rule: one. It never leaves fewer blocks
/// resident than two, and since whole tiles move without per-piece checks
/// it was also faster where both give four blocks (H200, prefill r16 and
/// r64 in a graph).
const DEFAULT_Y_BUFFERS: usize = 1;

/// K splits of the shrink by the rule: as many as keep all of its `tiles x
/// splits` blocks resident in one wave (more blocks, each with fewer K
/// chunks, keep more copies in flight), at least `least` (the best where
/// the tiles alone fill the machine) and at most [`MAX_K_SPLITS`]. Measured
/// on the H200 (NOTES.md v10, v27): prefill r16 (72 tiles, 528 resident)
/// takes 7; at r64 (160 tiles) the mma.sync shrink was best at 4, the
/// wgmma shrink at 3.
fn default_k_splits(tiles: usize, resident: usize, least: usize) -> usize {
    (resident / tiles.max(1)).clamp(least, MAX_K_SPLITS)
}

/// When the shrink lets the expand get resident, by the rule: at its start,
/// except with two y buffers after a wgmma shrink of A tiles over 16 rows,
/// where early residency was much slower at prefill r32 and r64 (NOTES.md
/// v27, H200 in a graph; with one buffer early wins at every shape).
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
    (smem_per_sm / smem.saturating_add(1024)).clamp(1, 4)
}

#[cfg(test)]
mod tests;
