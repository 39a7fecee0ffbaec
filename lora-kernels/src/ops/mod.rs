//! The kernels: each op validates its arguments on the host, then runs the
//! CUDA kernel or the CPU reference (same signature, same math: BF16 inputs,
//! FP32 accumulation, the delta added in FP32 to y and rounded once).
//!
//! - [`bgmv`]: row-indexed LoRA apply (decode, mixed slots; MoE gather).
//! - [`sgmv`]: segment-grouped LoRA apply (prefill) and the one-adapter case.
//! - [`dora`]: DoRA's served arithmetic: the expand's epilogue
//!   `y ← g ⊙ ((y + Δ) − b) + b` per row of a DoRA entry (carried by
//!   [`LoraTarget::dora`]), and a slot's `g` computed at staging.
//! - [`moe_index`]: routed-expert entry-index builders.
//! - [`overlay`]: token overlays (row diff, embedding lookup, lm_head overlay;
//!   the lookup also over a vocab-parallel rank's rows, `embed_overlay_at`).
//! - [`embed_lora`]: LoRA on the input embedding (a gather of A's token
//!   column, an expand by B, per row's slot).
//! - [`limits`]: what the launch planners read of a device ([`limits::DeviceLimits`])
//!   and how a caller picks a plan ([`limits::Choice`]).
//! - [`launch_floor`]: an empty launch, the floor a benchmark's timing method sets.
//! - [`linear`]: f32 linear layers `x · w^T` (cuBLAS SGEMM on CUDA), the
//!   base projections of a model; not an apply call (see its docs).
//! - [`repack`]: a slot image written on the device from raw adapter-file bytes.
//! - [`rank_split`]: the shrink of a rank's block of A's rank rows and the
//!   expand of the all-gathered rank vectors (the fully-sharded option).
//!
//! Apply calls allocate nothing, never synchronise and keep every address
//! and launch shape fixed for fixed arguments, so they can be captured in a
//! CUDA graph ([`crate::Device::capture_graph`]). Bad device data (an index
//! past a table, a bad rank) is an error on the CPU and a fault bit on CUDA
//! ([`crate::Device::check_faults`]); after a fault the output is unspecified.

pub mod bgmv;
pub mod dora;
pub mod embed_lora;
#[cfg(test)]
mod golden;
pub mod launch_floor;
pub mod limits;
pub mod linear;
pub mod moe_index;
pub mod overlay;
mod pairs;
pub mod rank_split;
pub mod repack;
pub mod sgmv;
mod workspace;

pub use workspace::{LoraWorkspace, WorkspaceSpec};

use half::bf16;

use crate::buffer::{DeviceBuffer, DeviceElem, check_range};
use crate::device::Device;
use crate::error::{KernelError, invalid};
use crate::table::PairEntry;

/// The constants every kernel family and the host share (`#define`s of
/// each translation unit's prelude, `cuda_rt::prelude`).
pub(crate) fn cuda_defines() -> Vec<(&'static str, usize)> {
    let mut all = vec![("MAX_TARGETS", MAX_TARGETS)];
    all.extend(bgmv::cuda_defines());
    all
}

/// Most targets one apply call serves (q/k/v, gate/up, ...).
pub const MAX_TARGETS: usize = 4;

/// `n_rows` rows of `width` elements, `stride` apart, starting at element
/// `offset` of `buf` (a row-major matrix or a column block of one).
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a, T: DeviceElem> {
    /// The buffer.
    pub buf: &'a DeviceBuffer<T>,
    /// Element offset of row 0.
    pub offset: usize,
    /// Number of rows.
    pub n_rows: usize,
    /// Elements per row.
    pub width: usize,
    /// Elements from one row to the next.
    pub stride: usize,
}

/// The mutable counterpart of [`Rows`].
#[derive(Debug)]
pub struct RowsMut<'a, T: DeviceElem> {
    /// The buffer.
    pub buf: &'a mut DeviceBuffer<T>,
    /// Element offset of row 0.
    pub offset: usize,
    /// Number of rows.
    pub n_rows: usize,
    /// Elements per row.
    pub width: usize,
    /// Elements from one row to the next.
    pub stride: usize,
}

impl<'a, T: DeviceElem> Rows<'a, T> {
    /// A dense `[n_rows, width]` matrix at the start of `buf`.
    pub fn dense(buf: &'a DeviceBuffer<T>, n_rows: usize, width: usize) -> Self {
        Rows {
            buf,
            offset: 0,
            n_rows,
            width,
            stride: width,
        }
    }
}

impl<'a, T: DeviceElem> RowsMut<'a, T> {
    /// A dense `[n_rows, width]` matrix at the start of `buf`.
    pub fn dense(buf: &'a mut DeviceBuffer<T>, n_rows: usize, width: usize) -> Self {
        RowsMut {
            buf,
            offset: 0,
            n_rows,
            width,
            stride: width,
        }
    }
}

/// Elements spanned by `n_rows` rows of `width`, `stride` apart.
fn span(arg: &'static str, n_rows: usize, width: usize, stride: usize) -> Result<usize, KernelError> {
    if n_rows == 0 {
        return Ok(0);
    }
    if n_rows > 1 && stride < width {
        return Err(invalid(
            arg,
            format!("row stride {stride} is below the row width {width}"),
        ));
    }
    (n_rows - 1)
        .checked_mul(stride)
        .and_then(|s| s.checked_add(width))
        .ok_or_else(|| invalid(arg, "row span overflows"))
}

/// Check a row view against its buffer and the call's device.
fn check_rows<T: DeviceElem>(
    device: &Device,
    arg: &'static str,
    buf: &DeviceBuffer<T>,
    offset: usize,
    n_rows: usize,
    width: usize,
    stride: usize,
) -> Result<(), KernelError> {
    device.expect_same(arg, buf.device())?;
    let span = span(arg, n_rows, width, stride)?;
    check_range(arg, offset, span, buf.len())?;
    fits_i32(arg, stride)?;
    fits_i32(arg, width)?;
    fits_i32(arg, n_rows)
}

impl<T: DeviceElem> Rows<'_, T> {
    pub(crate) fn check(&self, device: &Device, arg: &'static str) -> Result<(), KernelError> {
        check_rows(device, arg, self.buf, self.offset, self.n_rows, self.width, self.stride)
    }

    /// Device address of row 0.
    pub(crate) fn addr(&self) -> u64 {
        self.buf.device_addr() + (self.offset * std::mem::size_of::<T>()) as u64
    }

    /// The rows, gathered densely (`n_rows * width`), on the host.
    pub(crate) fn download_dense(&self) -> Result<Vec<T>, KernelError> {
        let span = span("rows", self.n_rows, self.width, self.stride)?;
        let raw = self.buf.download_range(self.offset, span)?;
        let mut out = Vec::with_capacity(self.n_rows * self.width);
        for r in 0..self.n_rows {
            out.extend_from_slice(&raw[r * self.stride..r * self.stride + self.width]);
        }
        Ok(out)
    }
}

impl<T: DeviceElem> RowsMut<'_, T> {
    pub(crate) fn check(&self, device: &Device, arg: &'static str) -> Result<(), KernelError> {
        check_rows(device, arg, self.buf, self.offset, self.n_rows, self.width, self.stride)
    }

    /// Device address of row 0.
    pub(crate) fn addr(&self) -> u64 {
        self.buf.device_addr() + (self.offset * std::mem::size_of::<T>()) as u64
    }

    /// Run `f(row, row_slice)` on every row, in place (CPU backend).
    pub(crate) fn cpu_for_each_row(&mut self, mut f: impl FnMut(usize, &mut [T])) -> Result<(), KernelError> {
        let span = span("rows", self.n_rows, self.width, self.stride)?;
        let (n_rows, width, stride) = (self.n_rows, self.width, self.stride);
        self.buf.cpu_modify(self.offset, span, |elems| {
            for r in 0..n_rows {
                f(r, &mut elems[r * stride..r * stride + width]);
            }
        })
    }
}

/// One output of an apply call: a `[n_entries]` range of a PairEntry table
/// (`table[table_offset..table_offset + n_entries]`), the output width, and
/// where its columns start in y.
#[derive(Debug, Clone, Copy)]
pub struct LoraTarget<'a> {
    /// The table buffer (the pool keeps all (layer, module) tables in one).
    pub table: &'a DeviceBuffer<PairEntry>,
    /// First entry of this (layer, module)'s table.
    pub table_offset: usize,
    /// Entries in the table (`max_loras`, or `num_experts * max_loras`).
    pub n_entries: usize,
    /// Output width of the projection.
    pub out_dim: usize,
    /// Column of y where this target's outputs start.
    pub y_col_offset: usize,
    /// The DoRA epilogue's inputs at this target ([`dora::DoraEpilogue`]),
    /// or `None`: every row gets `y + delta`.
    pub dora: Option<dora::DoraEpilogue<'a>>,
}

/// The device mirror of [`LoraTarget`] (`struct LoraTarget` in `common.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TargetParams {
    pub(crate) table: u64,
    pub(crate) n_entries: i32,
    pub(crate) out_dim: i32,
    pub(crate) y_col_off: i32,
    pub(crate) pad: i32,
    /// The DoRA `g` address table (0: none).
    pub(crate) dora: u64,
    /// The base bias (0: none).
    pub(crate) bias: u64,
}
const _: () = assert!(size_of::<TargetParams>() == 40);

/// Validate targets against the device and y's width; their device mirrors.
pub(crate) fn check_targets(
    device: &Device,
    targets: &[LoraTarget<'_>],
    y_width: usize,
) -> Result<[TargetParams; MAX_TARGETS], KernelError> {
    if targets.is_empty() || targets.len() > MAX_TARGETS {
        return Err(invalid(
            "targets",
            format!("{} targets; 1..={MAX_TARGETS} allowed", targets.len()),
        ));
    }
    for (i, a) in targets.iter().enumerate() {
        for b in &targets[i + 1..] {
            let disjoint = a.y_col_offset.saturating_add(a.out_dim) <= b.y_col_offset
                || b.y_col_offset.saturating_add(b.out_dim) <= a.y_col_offset;
            if !disjoint {
                return Err(invalid("targets", "two targets write overlapping columns of y"));
            }
        }
    }
    let mut out = [TargetParams::default(); MAX_TARGETS];
    for (t, p) in targets.iter().zip(out.iter_mut()) {
        device.expect_same("targets.table", t.table.device())?;
        check_range("targets.table", t.table_offset, t.n_entries, t.table.len())?;
        let end = t
            .y_col_offset
            .checked_add(t.out_dim)
            .ok_or_else(|| invalid("targets", "column range overflows"))?;
        if end > y_width {
            return Err(invalid(
                "targets",
                format!("columns {}..{end} are past y's width {y_width}", t.y_col_offset),
            ));
        }
        let (dora, bias) = match &t.dora {
            Some(d) => d.check(device, t.n_entries, t.out_dim)?,
            None => (0, 0),
        };
        *p = TargetParams {
            table: t.table.addr_at(t.table_offset)?,
            n_entries: to_i32("targets.n_entries", t.n_entries)?,
            out_dim: to_i32("targets.out_dim", t.out_dim)?,
            y_col_off: to_i32("targets.y_col_offset", t.y_col_offset)?,
            pad: 0,
            dora,
            bias,
        };
    }
    Ok(out)
}

pub(crate) fn fits_i32(arg: &'static str, v: usize) -> Result<(), KernelError> {
    to_i32(arg, v).map(|_| ())
}

pub(crate) fn to_i32(arg: &'static str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| invalid(arg, format!("{v} does not fit the kernels' 32-bit indices")))
}

pub(crate) fn to_u32(arg: &'static str, v: usize) -> Result<u32, KernelError> {
    u32::try_from(v).map_err(|_| invalid(arg, format!("{v} exceeds a launch dimension")))
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// An element type y (the output being updated) may have: BF16 or F32 (F32
/// for router logits).
pub trait OutputElem: DeviceElem + sealed::Sealed {
    /// Widen to f32.
    fn to_f32(self) -> f32;
    /// Round from f32 (round to nearest even for BF16).
    fn from_f32(v: f32) -> Self;
}

impl OutputElem for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl OutputElem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

#[cfg(test)]
mod tests;
