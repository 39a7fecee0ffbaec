//! The two halves of a LoRA apply whose rank is split over tensor-parallel
//! ranks (the fully-sharded option, vLLM's `fully_sharded_loras`): each
//! rank holds a block of A's rank rows, so its shrink gives only that block
//! of the rank vector; the ranks all-gather their blocks (the caller's
//! collective, between the two calls), and each rank's expand reads the
//! whole gathered rank vector with its own B rows.
//!
//! - [`shrink_part`]: for each row `i` with slot `s = row_slot[i]` and each
//!   target `t`, `out[i, t, j] = Σ_c A_s[j, c] · x[i, c]` for the `j` of
//!   the part whose global rank row `part · len + j` is below the entry's
//!   rank, and 0 elsewhere (and on base rows, slot -1): every element of
//!   `out[..n_rows · n_targets · len]` is written, so the caller never
//!   clears it. The entry's A is the part's `[len, in]` rows
//!   (`len = stride / parts`); its rank is the adapter's whole rank.
//! - [`expand_gathered`]: `y[i, cols of t] += scale · Σ_{k < rank} B_s[o, k]
//!   · v[i, t, k]`, where rank row `k` of the gathered vector lies in part
//!   `k / len` at `(k / len) · part_len + (i · n_targets + t) · len + k % len`
//!   (`part_len = n_rows · n_targets · len`: the parts are the shrink
//!   outputs of ranks `0..parts`, in rank order, as `ncclAllGather` lays
//!   them out). B is `[out, stride]` as in every pool slot.
//!
//! A target with a DoRA epilogue ([`LoraTarget::dora`]) is refused: the
//! split halves add the plain delta only (DoRA is served on unplaced pools,
//! by the fused applies).
//!
//! The shrink output stays f32 (no rounding between the halves), and both
//! halves accumulate in f32 in the order the fused applies' reference does,
//! so on the CPU the split apply equals the fused one bit for bit; the
//! delta is added to y in f32 and rounded once. A slot past a table or a
//! bad entry is an error on the CPU (nothing written) and a fault bit on
//! CUDA. Both calls allocate nothing, synchronise nothing and keep their
//! launch shapes fixed for fixed arguments: graph-capturable (so is an NCCL
//! all-gather queued between them on the same stream). CUDA kernels:
//! `rank_shrink_part` and `rank_expand_gathered_{f32,bf16}` in
//! `cuda/rank_split.cu` (plain CUDA-core loops: one block per (row,
//! target); the tensor-core forms of bgmv/sgmv fuse the two halves and
//! keep the rank vector on chip, which a collective between them rules out).

use half::bf16;

use super::{LoraTarget, MAX_TARGETS, OutputElem, Rows, RowsMut, TargetParams, check_targets, to_i32, to_u32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};
use crate::table::PairEntry;

/// Which block of the padded rank rows a rank holds: part `part` of
/// `parts` equal blocks of `stride` (the pool's `max_rank`) rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankPart {
    /// The block this rank's A holds (its tensor-parallel rank).
    pub part: usize,
    /// Blocks (the tensor-parallel world size).
    pub parts: usize,
    /// The rank stride: rows of the whole padded A, columns of B.
    pub stride: usize,
}

impl RankPart {
    /// Rank rows per part (`stride / parts`).
    pub fn len(&self) -> usize {
        self.stride / self.parts.max(1)
    }

    /// Whether a part holds no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements of one part's shrink output for `n_rows` rows and
    /// `n_targets` targets (`n_rows · n_targets · len`).
    pub fn part_len(&self, n_rows: usize, n_targets: usize) -> Result<usize, KernelError> {
        n_rows
            .checked_mul(n_targets)
            .and_then(|v| v.checked_mul(self.len()))
            .ok_or_else(|| invalid("part", "shrink output size overflows"))
    }

    fn check(&self) -> Result<(), KernelError> {
        if self.parts == 0 || self.part >= self.parts {
            return Err(invalid("part", format!("part {} of {} parts", self.part, self.parts)));
        }
        if self.stride == 0 || !self.stride.is_multiple_of(self.parts) {
            return Err(invalid(
                "part.stride",
                format!("{} is not a positive multiple of {} parts", self.stride, self.parts),
            ));
        }
        Ok(())
    }
}

/// Mirror of `struct RankShrinkParams` (`cuda/rank_split.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RankShrinkParams {
    x: u64,
    row_slot: u64,
    out: u64,
    fault: u64,
    n_rows: i32,
    in_dim: i32,
    x_stride: i32,
    n_targets: i32,
    part: i32,
    part_rows: i32,
    stride: i32,
    pad: i32,
    targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<RankShrinkParams>() == 224 && std::mem::offset_of!(RankShrinkParams, targets) == 64);

/// Mirror of `struct RankExpandParams` (`cuda/rank_split.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RankExpandParams {
    gathered: u64,
    row_slot: u64,
    y: u64,
    fault: u64,
    n_rows: i32,
    y_stride: i32,
    n_targets: i32,
    parts: i32,
    part_rows: i32,
    stride: i32,
    part_len: i32,
    pad: i32,
    targets: [TargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<RankExpandParams>() == 224 && std::mem::offset_of!(RankExpandParams, targets) == 64);

/// Threads of every block of both kernels.
const THREADS: u32 = 128;

/// The shrink of the rank's block: writes `out[(i · n_targets + t) · len
/// + j]` for every row `i < x.n_rows`, target `t` and `j < len` (see the
/// module docs). `row_slot` holds each row's slot (-1: base).
pub fn shrink_part(
    device: &Device,
    x: Rows<'_, bf16>,
    row_slot: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    part: RankPart,
    out: &mut DeviceBuffer<f32>,
) -> Result<(), KernelError> {
    x.check(device, "x")?;
    device.expect_same("row_slot", row_slot.device())?;
    device.expect_same("out", out.device())?;
    part.check()?;
    refuse_dora(targets)?;
    let target_params = check_targets(device, targets, usize::MAX)?;
    let n = x.n_rows;
    check_range("row_slot", 0, n, row_slot.len())?;
    let part_len = part.part_len(n, targets.len())?;
    check_range("out", 0, part_len, out.len())?;
    if n == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => shrink_reference(&cpu.memory, &x, row_slot, targets, part, out),
        Backend::Cuda(c) => {
            let params = RankShrinkParams {
                x: x.addr(),
                row_slot: row_slot.device_addr(),
                out: out.device_addr(),
                fault: c.fault_addr(),
                n_rows: to_i32("x.n_rows", n)?,
                in_dim: to_i32("x.width", x.width)?,
                x_stride: to_i32("x.stride", x.stride)?,
                n_targets: to_i32("targets", targets.len())?,
                part: to_i32("part.part", part.part)?,
                part_rows: to_i32("part.len", part.len())?,
                stride: to_i32("part.stride", part.stride)?,
                pad: 0,
                targets: target_params,
            };
            to_i32("part_len", part_len)?;
            let launch = Launch {
                grid: (to_u32("grid", n.min(65_535))?, to_u32("targets", targets.len())?, 1),
                block: THREADS,
                smem: 0,
            };
            // SAFETY: params mirror the kernel's struct (sizes asserted on
            // both sides); x covers n rows of in_dim at its stride, row_slot
            // holds n values, out holds n · n_targets · len floats (checked
            // above), every target's table range lies in its buffer. The
            // kernel checks slots against n_entries and ranks against the
            // stride before reading A (the part's `[len, in]` rows) through
            // entry addresses, kept valid by the pool that owns them.
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::RankSplit,
                        name: "rank_shrink_part",
                    },
                    launch,
                    &params,
                )
            }
        }
    }
}

/// The expand of the gathered rank vectors: `y[i, cols of t] += scale ·
/// Σ_{k < rank} B[o, k] · v[i, t, k]` (see the module docs); `gathered`
/// holds `part.parts` shrink outputs of `y.n_rows` rows and
/// `targets.len()` targets each, in rank order. `part.part` is not read.
pub fn expand_gathered<Y: OutputElem>(
    device: &Device,
    gathered: &DeviceBuffer<f32>,
    row_slot: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    part: RankPart,
    y: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    y.check(device, "y")?;
    device.expect_same("gathered", gathered.device())?;
    device.expect_same("row_slot", row_slot.device())?;
    part.check()?;
    refuse_dora(targets)?;
    let target_params = check_targets(device, targets, y.width)?;
    let n = y.n_rows;
    check_range("row_slot", 0, n, row_slot.len())?;
    let part_len = part.part_len(n, targets.len())?;
    let total = part_len
        .checked_mul(part.parts)
        .ok_or_else(|| invalid("gathered", "gathered size overflows"))?;
    check_range("gathered", 0, total, gathered.len())?;
    if n == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => expand_reference(&cpu.memory, gathered, row_slot, targets, part, y),
        Backend::Cuda(c) => {
            let params = RankExpandParams {
                gathered: gathered.device_addr(),
                row_slot: row_slot.device_addr(),
                y: y.addr(),
                fault: c.fault_addr(),
                n_rows: to_i32("y.n_rows", n)?,
                y_stride: to_i32("y.stride", y.stride)?,
                n_targets: to_i32("targets", targets.len())?,
                parts: to_i32("part.parts", part.parts)?,
                part_rows: to_i32("part.len", part.len())?,
                stride: to_i32("part.stride", part.stride)?,
                part_len: to_i32("part_len", part_len)?,
                pad: 0,
                targets: target_params,
            };
            to_i32("gathered", total)?;
            let launch = Launch {
                grid: (to_u32("grid", n.min(65_535))?, to_u32("targets", targets.len())?, 1),
                block: THREADS,
                smem: u32::try_from(part.stride * 4).map_err(|_| invalid("part.stride", "too large"))?,
            };
            let name = match Y::NAME {
                "bf16" => "rank_expand_gathered_bf16",
                _ => "rank_expand_gathered_f32",
            };
            // SAFETY: params mirror the kernel's struct (sizes asserted on
            // both sides); gathered holds parts · part_len floats, row_slot
            // n values, y covers n rows at its stride and every target's
            // columns lie in y's width (checked above); the dynamic shared
            // memory holds one rank vector of `stride` floats. The kernel
            // checks slots against n_entries and ranks against the stride
            // before reading B (`[out, stride]`) through entry addresses,
            // kept valid by the pool that owns them.
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::RankSplit,
                        name,
                    },
                    launch,
                    &params,
                )
            }
        }
    }
}

/// An error for a target that carries a DoRA epilogue: the split halves
/// add the plain delta only (the pool refuses a DoRA pool before calling
/// them; DoRA is served by the fused applies at world 1 only).
fn refuse_dora(targets: &[LoraTarget<'_>]) -> Result<(), KernelError> {
    if targets.iter().any(|t| t.dora.is_some()) {
        return Err(invalid(
            "targets.dora",
            "the rank-split apply has no DoRA epilogue (use the fused applies)",
        ));
    }
    Ok(())
}

/// One entry of a target for row `i` (`s = row_slot[i]`): `None` for a
/// base row or a rank-0 entry; the entry otherwise, checked as the kernels
/// check it.
fn row_entry(entries: &[PairEntry], i: usize, s: i32, stride: usize) -> Result<Option<PairEntry>, KernelError> {
    if s < 0 {
        return Ok(None);
    }
    let e = s as usize;
    let Some(entry) = entries.get(e) else {
        return Err(KernelError::BadIndex {
            arg: "row_slot",
            position: i,
            index: i64::from(s),
            n_entries: entries.len(),
        });
    };
    if entry.rank == 0 {
        return Ok(None);
    }
    if entry.rank as usize > stride || entry.a == 0 || entry.b == 0 {
        return Err(KernelError::BadEntry {
            entry: e,
            rank: entry.rank,
            stride,
            a: entry.a,
            b: entry.b,
        });
    }
    Ok(Some(*entry))
}

fn shrink_reference(
    memory: &CpuMemory,
    x: &Rows<'_, bf16>,
    row_slot: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    part: RankPart,
    out: &mut DeviceBuffer<f32>,
) -> Result<(), KernelError> {
    let (n, in_dim, len, n_targets) = (x.n_rows, x.width, part.len(), targets.len());
    let xs: Vec<f32> = x.download_dense()?.iter().map(|v| v.to_f32()).collect();
    let slots = row_slot.download_range(0, n)?;
    let first = part.part * len;
    let mut values = vec![0f32; n * n_targets * len];
    for (t, target) in targets.iter().enumerate() {
        let entries = target.table.download_range(target.table_offset, target.n_entries)?;
        for (i, &s) in slots.iter().enumerate() {
            let Some(entry) = row_entry(&entries, i, s, part.stride)? else {
                continue;
            };
            // The part's rows below the adapter's rank; the rest stay 0.
            let rows = (entry.rank as usize).saturating_sub(first).min(len);
            let a: Vec<bf16> = memory.read(&|| format!("table entry {s} A part"), entry.a, rows * in_dim)?;
            let xr = &xs[i * in_dim..(i + 1) * in_dim];
            let dst = &mut values[(i * n_targets + t) * len..][..len];
            for (j, d) in dst.iter_mut().take(rows).enumerate() {
                *d = a[j * in_dim..(j + 1) * in_dim]
                    .iter()
                    .zip(xr)
                    .fold(0f32, |acc, (a, x)| acc + a.to_f32() * x);
            }
        }
    }
    out.write(0, &values)
}

fn expand_reference<Y: OutputElem>(
    memory: &CpuMemory,
    gathered: &DeviceBuffer<f32>,
    row_slot: &DeviceBuffer<i32>,
    targets: &[LoraTarget<'_>],
    part: RankPart,
    mut y: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    let (n, len, n_targets, stride) = (y.n_rows, part.len(), targets.len(), part.stride);
    let part_len = part.part_len(n, n_targets)?;
    let v = gathered.download_range(0, part_len * part.parts)?;
    let slots = row_slot.download_range(0, n)?;
    let mut deltas: Vec<Vec<Option<Vec<f32>>>> = Vec::with_capacity(n_targets);
    for (t, target) in targets.iter().enumerate() {
        let entries = target.table.download_range(target.table_offset, target.n_entries)?;
        let mut rows = Vec::with_capacity(n);
        for (i, &s) in slots.iter().enumerate() {
            let Some(entry) = row_entry(&entries, i, s, stride)? else {
                rows.push(None);
                continue;
            };
            let rank = entry.rank as usize;
            let out = target.out_dim;
            let b_len = if out == 0 { 0 } else { (out - 1) * stride + rank };
            let b: Vec<bf16> = memory.read(&|| format!("table entry {s} B"), entry.b, b_len)?;
            let vk: Vec<f32> = (0..rank)
                .map(|k| v[(k / len) * part_len + (i * n_targets + t) * len + k % len])
                .collect();
            let d: Vec<f32> = (0..out)
                .map(|o| {
                    entry.scale
                        * b[o * stride..o * stride + rank]
                            .iter()
                            .zip(&vk)
                            .fold(0f32, |acc, (b, v)| acc + b.to_f32() * v)
                })
                .collect();
            rows.push(Some(d));
        }
        deltas.push(rows);
    }
    y.cpu_for_each_row(|i, row| {
        for (target, rows) in targets.iter().zip(&deltas) {
            if let Some(d) = &rows[i] {
                let cols = &mut row[target.y_col_offset..target.y_col_offset + target.out_dim];
                for (yv, dv) in cols.iter_mut().zip(d) {
                    *yv = Y::from_f32(yv.to_f32() + dv);
                }
            }
        }
    })
}

#[cfg(test)]
mod tests;
