//! The row-register form of [`super::bgmv`]
//! ([`DecodeForm::RowRegisters`](super::plan::DecodeForm::RowRegisters),
//! `cuda/bgmv_rows.cu`): one launch, a cluster of 2 blocks of 512 threads
//! per (row, target), serving one-row items without shared memory. Each
//! block loads its half of the row's A slice, x, B rows and y values
//! straight into registers as soon as the row's entry is known (8 A and 8 B
//! loads of 16 bytes in flight a thread), pushes its partial rank vector to
//! its peer (the pair's sum), and expands from the registers. Rows of one
//! adapter each read its A and B (from L2 after the first), so the form
//! suits batches of mostly distinct adapters: the rule table's rule 1 takes
//! it for 32 to 64 rows of at most 2 a table entry, in the calls its
//! straight-line kernels serve ([`super::plan`]); elsewhere it serves exact
//! plans.
//!
//! The straight-line (`_full`) kernels
//! (`DecodeForm::RowRegisters { straight_line: true }`) serve 4096 x 4096
//! calls with x rows 16-byte aligned and y rows aligned to 4 outputs, not
//! under the overlap (their straight-line form reads x before the B rows;
//! `full_form`): every thread's piece and outputs lie inside its block's
//! halves, so the loads need no guards. They take that form for rows whose
//! entry is of rank 16 with A and B 16-byte aligned, and run the general
//! body for the others. Each guard or mask of the general kernel costs
//! time though it adds no load, so the general kernel alone measured slower
//! than the row-mapped fused form and serves no default (NOTES.md v29-v30).
//!
//! Waiting first, the rule table always lets the next kernel in as soon as
//! the form's blocks waited ([`Chain::WaitFirstEarlyNext`]; measured faster
//! than letting it in once their work is out at every shape it takes,
//! NOTES.md v34).
//!
//! It serves rank stride 16, `in` a multiple of 8 up to [`ROWS_MAX_IN`] and
//! outputs up to [`ROWS_MAX_OUT`] per target (`RowsShape::check`), any
//! alignment of A, B, x and y, bf16 or f32 y, on sm_90 or newer; it never
//! guesses: a call it cannot serve is refused, before any launch.

use half::bf16;

use super::entry::BgeParams;
use super::kernels::Epilogue;
use super::plan::{CallTarget, Chain};
use super::{Rows, RowsMut, piece8};
use crate::cuda_rt::{CudaBackend, Launch};
use crate::error::KernelError;
use crate::ops::{LoraTarget, MAX_TARGETS, OutputElem, TargetParams, to_u32};

/// Threads per block (`BGR_THREADS`).
pub(super) const THREADS: u32 = 512;
/// Blocks per (row, target): the kernel's cluster.
const CLUSTER: usize = 2;
/// The one rank stride the kernel serves (`BGR_RANKS`).
pub const ROWS_STRIDE: usize = 16;
/// 8-column pieces of `in` a block holds, one a thread of each rank group (`BGR_PIECES`).
pub(super) const PIECES_PER_BLOCK: usize = 256;
/// Outputs a block serves: 4 a thread (`BGR_OUT_PER_THREAD`).
const OUTS_PER_BLOCK: usize = 4 * THREADS as usize;
/// Widest `in` the form serves (`BGR_MAX_IN`): two blocks' pieces.
pub const ROWS_MAX_IN: usize = CLUSTER * 8 * PIECES_PER_BLOCK;
/// Widest target the form serves (`BGR_MAX_OUT`).
pub const ROWS_MAX_OUT: usize = CLUSTER * OUTS_PER_BLOCK;
/// Most rows of one launch: the grid's y extent.
const MAX_ROWS: usize = 65_535;

/// What of a call the form's eligibility depends on.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowsShape {
    pub(super) hopper: bool,
    pub(super) n: usize,
    pub(super) in_dim: usize,
    pub(super) stride: usize,
}

impl RowsShape {
    /// Why the form cannot serve this call, or `Ok` when it can.
    pub(super) fn check(&self, targets: &[CallTarget]) -> Result<(), String> {
        if !self.hopper {
            return Err("clusters need sm_90 or newer".into());
        }
        if self.stride != ROWS_STRIDE {
            return Err(format!("rank stride {} ({ROWS_STRIDE} only)", self.stride));
        }
        if self.n > MAX_ROWS {
            return Err(format!("{} rows (at most {MAX_ROWS})", self.n));
        }
        let widest = targets.iter().map(|t| t.out_dim).max().unwrap_or(0);
        fits_blocks(self.in_dim, widest)
    }
}

/// Whether `in` and the widest target fit the pair's blocks: `in` a
/// multiple of 8 whose halves (the kernel's `split8`) are at most a block's
/// pieces, and the target's halves at most a block's outputs.
fn fits_blocks(in_dim: usize, widest_out: usize) -> Result<(), String> {
    if !in_dim.is_multiple_of(8) || piece8(in_dim, CLUSTER) / 8 > PIECES_PER_BLOCK {
        return Err(format!("in = {in_dim} (a multiple of 8 up to {ROWS_MAX_IN})"));
    }
    if piece8(widest_out, CLUSTER) > OUTS_PER_BLOCK {
        return Err(format!("a target of {widest_out} outputs (at most {ROWS_MAX_OUT})"));
    }
    Ok(())
}

/// Whether the `_full` kernels serve the call: `in` and every target
/// exactly [`ROWS_MAX_IN`] and [`ROWS_MAX_OUT`] wide (every thread's piece
/// and outputs inside its block's halves), x rows 16-byte aligned, y rows
/// and column offsets aligned to 4 outputs, and no overlap (their
/// straight-line form reads x before the B rows). They take that form for
/// rows whose entry is of rank 16 with A and B 16-byte aligned, the general
/// one for the others; measured faster than the general kernel alone
/// (NOTES.md v29).
#[allow(clippy::too_many_arguments)]
pub(super) fn full_form(
    in_dim: usize,
    x_stride: usize,
    x_align: u64,
    y_stride: usize,
    y_align: u64,
    y_size: usize,
    targets: &[CallTarget],
    overlap: bool,
) -> bool {
    let y_align_needed = 4 * y_size as u64;
    !overlap
        && in_dim == ROWS_MAX_IN
        && x_stride.is_multiple_of(8)
        && x_align.is_multiple_of(16)
        && y_stride.is_multiple_of(4)
        && y_align.is_multiple_of(y_align_needed)
        && targets
            .iter()
            .all(|t| t.out_dim == ROWS_MAX_OUT && t.y_col_offset.is_multiple_of(4))
}

/// Launch the form (the caller checked `RowsShape::check`).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_rows<Y: OutputElem>(
    c: &CudaBackend,
    x: &Rows<'_, bf16>,
    idx_addr: u64,
    target_params: &[TargetParams; MAX_TARGETS],
    targets: &[LoraTarget<'_>],
    y: &RowsMut<'_, Y>,
    chain: Chain,
    straight_line: bool,
    epilogue: Epilogue,
) -> Result<(), KernelError> {
    let n = x.n_rows;
    let params = BgeParams::new(c, x, idx_addr, target_params, y, chain, 0)?;
    let shape = Launch {
        grid: (
            to_u32("grid", CLUSTER)?,
            to_u32("grid", n)?,
            to_u32("grid", targets.len())?,
        ),
        block: THREADS,
        smem: 0,
    };
    let kernel = super::kernels::DecodeKernel::Rows {
        straight_line,
        y: super::plan::OutputKind::of::<Y>(),
    }
    .kernel(epilogue)?;
    // SAFETY: `BgeParams` mirrors the kernel's struct (sizes asserted on both
    // sides). The host checked that x and y cover `n_rows` rows of their widths
    // and strides, that idx holds `n_rows` values (the grid has one row of
    // clusters per row), that each target's table range and column range lie
    // inside their buffers, and (`RowsShape::check`) that the stride is the
    // kernel's, `in` a multiple of 8 whose halves fit a block's pieces and every
    // target's halves a block's outputs (`fits_blocks`), so no thread reads
    // past its row; the `_full` kernels' unguarded form only where `full_form`
    // holds (every piece and output of every thread inside the row, x and y
    // aligned for its vector loads, no overlap), and only for rows whose entry
    // the kernel found of rank 16 with A and B 16-byte aligned. The kernel checks each index against `n_entries` and each
    // entry's rank against the stride before it reads A and B through table
    // addresses, which the table's owner keeps pointing at live `[stride, in]`
    // / `[out, stride]` pairs, and reads A rows and B columns below the rank
    // only. As a dependent launch it reads x and y only after
    // `griddepcontrol.wait` (and, waiting first, nothing before it).
    unsafe { c.launch_chained(kernel, shape, &params, chain.dependent()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The blocks' geometry accepts exactly the documented limits.
        #[test]
        fn the_limits_are_what_fits_the_blocks(in_dim in 1usize..=2 * ROWS_MAX_IN, out in 0usize..=2 * ROWS_MAX_OUT) {
            let documented = in_dim.is_multiple_of(8) && in_dim <= ROWS_MAX_IN && out <= ROWS_MAX_OUT;
            prop_assert_eq!(fits_blocks(in_dim, out).is_ok(), documented);
        }
    }

    #[test]
    fn refusals_name_what_does_not_fit() {
        let err = fits_blocks(4104, 8).unwrap_err();
        assert!(err.contains("in = 4104"), "{err}");
        let err = fits_blocks(2050, 8).unwrap_err();
        assert!(err.contains("in = 2050"), "{err}");
        let err = fits_blocks(4096, 4097).unwrap_err();
        assert!(err.contains("4097 outputs"), "{err}");
        let shape = RowsShape {
            hopper: true,
            n: 64,
            in_dim: 4096,
            stride: 32,
        };
        assert!(shape.check(&[]).unwrap_err().contains("rank stride 32"));
        let shape = RowsShape { hopper: false, ..shape };
        assert!(shape.check(&[]).unwrap_err().contains("sm_90"));
        let shape = RowsShape {
            hopper: true,
            stride: ROWS_STRIDE,
            n: MAX_ROWS + 1,
            ..shape
        };
        assert!(shape.check(&[]).unwrap_err().contains("rows"));
        assert!(RowsShape { n: 64, ..shape }.check(&[]).is_ok());
    }
}
