//! The DoRA rescale: one general per-row pass over a mixed batch, run after
//! the LoRA expand has written `y = W x + b + s·B A x` in place. For each
//! row whose slot has a DoRA pair at a target, `y ← g ⊙ (y − b) + b` over
//! that target's columns (`g` the slot's per-output-row rescale, `b` the
//! projection's base bias, zeros where it has none); rows of plain-LoRA
//! slots, rows of slots without a pair there, and base rows (-1) are not
//! touched, bit for bit. CUDA kernel family: `cuda/dora.cu`.
//!
//! Why a separate pass rather than an epilogue in every expand form: the
//! decode forms that split the rank or the output over several blocks
//! accumulate into y from more than one block (two-phase, entry-clustered),
//! so no single block sees a finished value of y to rescale; one pass after
//! the expand is exact for every form, decode and prefill alike, and costs
//! one read and one write of the rescaled columns of y. Its arithmetic is
//! rounded the same way on both backends (`g · (y − b) + b`, no fused
//! multiply-add), so CPU and CUDA results are equal bit for bit.
//!
//! Allocates nothing, synchronises nothing, keeps its launch shape fixed for
//! fixed arguments: graph-capturable. A slot past a table is an error on
//! the CPU and a fault bit on CUDA.
//!
//! [`dora_row_scale`] computes a slot's rescale where its factors are, once
//! per adapter when it is staged (not an apply call): PEFT's
//! `g = m / ‖W + s·B A‖` per output row, from the base weight (f32), the
//! pair's A and B as served (BF16, B rows `stride` apart) and the magnitude
//! (f32). `B A` is summed over the rank in f32 and the squares in f64 on
//! both backends; the norm is rounded to f32 before the division, as
//! PEFT's f32 norm is. A zero or non-finite norm leaves a non-finite `g`
//! for the caller to refuse.

use super::{MAX_TARGETS, OutputElem, RowsMut, to_i32, to_u32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cuda_rt::{Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};
use crate::table::PairEntry;

/// One output of a DoRA rescale: a `[n_entries]` range of a table of `g`
/// addresses (`table[table_offset + slot]`: the slot's `g [out_dim]`, f32,
/// or 0 where the slot has no DoRA pair), the projection's bias
/// (`bias[bias_offset..][..out_dim]`, f32), its width and first column of y.
#[derive(Debug, Clone, Copy)]
pub struct DoraTarget<'a> {
    /// The `g` address table (the pool keeps every (layer, module)'s in one).
    pub table: &'a DeviceBuffer<u64>,
    /// First entry of this (layer, module)'s table.
    pub table_offset: usize,
    /// Entries in the table (`max_loras`).
    pub n_entries: usize,
    /// The bias buffer.
    pub bias: &'a DeviceBuffer<f32>,
    /// First element of this projection's bias.
    pub bias_offset: usize,
    /// Output width of the projection.
    pub out_dim: usize,
    /// Column of y where this target's outputs start.
    pub y_col_offset: usize,
}

/// Mirror of `struct DoraTargetParams` (`cuda/dora.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DoraTargetParams {
    table: u64,
    bias: u64,
    n_entries: i32,
    out_dim: i32,
    y_col_off: i32,
    pad: i32,
}
const _: () = assert!(size_of::<DoraTargetParams>() == 32);

/// Mirror of `struct DoraParams` (`cuda/dora.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DoraParams {
    row_slot: u64,
    y: u64,
    fault: u64,
    n_rows: i32,
    y_stride: i32,
    n_targets: i32,
    pad: i32,
    targets: [DoraTargetParams; MAX_TARGETS],
}
const _: () = assert!(size_of::<DoraParams>() == 40 + 32 * MAX_TARGETS);

/// One DoRA pair's rescale inputs (see [`dora_row_scale`]).
#[derive(Debug, Clone, Copy)]
pub struct DoraNorm<'a> {
    /// The base weight `[out_dim, in_dim]` (row-major f32), from `weight_offset`.
    pub weight: &'a DeviceBuffer<f32>,
    /// First element of the weight.
    pub weight_offset: usize,
    /// The pair: addresses of A `[rank, in_dim]` and B `[out_dim, stride]`
    /// (BF16), its scale and rank.
    pub pair: PairEntry,
    /// Elements from one row of B to the next (the pool's `max_rank`).
    pub stride: usize,
    /// The magnitude `[out_dim]`, from `magnitude_offset`.
    pub magnitude: &'a DeviceBuffer<f32>,
    /// First element of the magnitude.
    pub magnitude_offset: usize,
    /// Output rows.
    pub out_dim: usize,
    /// Input width.
    pub in_dim: usize,
}

/// Mirror of `struct DoraNormParams` (`cuda/dora.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DoraNormParams {
    w: u64,
    a: u64,
    b: u64,
    m: u64,
    g: u64,
    out_dim: i32,
    in_dim: i32,
    rank: i32,
    stride: i32,
    scale: f32,
    pad: i32,
}
const _: () = assert!(size_of::<DoraNormParams>() == 64);

/// `g[g_offset + o] = m[o] / ‖W[o, :] + scale · (B A)[o, :]‖₂` for every
/// output row `o` of one DoRA pair (see the module docs).
pub fn dora_row_scale(
    device: &Device,
    args: &DoraNorm<'_>,
    g: &mut DeviceBuffer<f32>,
    g_offset: usize,
) -> Result<(), KernelError> {
    let (out, inp, rank) = (args.out_dim, args.in_dim, args.pair.rank as usize);
    device.expect_same("weight", args.weight.device())?;
    device.expect_same("magnitude", args.magnitude.device())?;
    device.expect_same("g", g.device())?;
    let w_len = out
        .checked_mul(inp)
        .ok_or_else(|| invalid("weight", "[out, in] overflows"))?;
    check_range("weight", args.weight_offset, w_len, args.weight.len())?;
    check_range("magnitude", args.magnitude_offset, out, args.magnitude.len())?;
    check_range("g", g_offset, out, g.len())?;
    if rank == 0 || rank > args.stride || args.pair.a == 0 || args.pair.b == 0 {
        return Err(KernelError::BadEntry {
            entry: 0,
            rank: args.pair.rank,
            stride: args.stride,
            a: args.pair.a,
            b: args.pair.b,
        });
    }
    if out == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => {
            let w = args.weight.download_range(args.weight_offset, w_len)?;
            let m = args.magnitude.download_range(args.magnitude_offset, out)?;
            let a: Vec<half::bf16> = cpu.memory.read(&|| "DoRA pair A".into(), args.pair.a, rank * inp)?;
            let b_len = (out - 1) * args.stride + rank;
            let b: Vec<half::bf16> = cpu.memory.read(&|| "DoRA pair B".into(), args.pair.b, b_len)?;
            let a: Vec<f32> = a.iter().map(|v| v.to_f32()).collect();
            let scale = args.pair.scale;
            let values: Vec<f32> = (0..out)
                .map(|o| {
                    let brow: Vec<f32> = b[o * args.stride..o * args.stride + rank]
                        .iter()
                        .map(|v| v.to_f32())
                        .collect();
                    let mut sum = 0f64;
                    for (i, wv) in w[o * inp..(o + 1) * inp].iter().enumerate() {
                        let lora = brow
                            .iter()
                            .enumerate()
                            .fold(0f32, |acc, (k, bv)| acc + bv * a[k * inp + i]);
                        let v = f64::from(wv + scale * lora);
                        sum += v * v;
                    }
                    m[o] / (sum.sqrt() as f32)
                })
                .collect();
            g.write(g_offset, &values)
        }
        Backend::Cuda(c) => {
            let p = DoraNormParams {
                w: args.weight.addr_at(args.weight_offset)?,
                a: args.pair.a,
                b: args.pair.b,
                m: args.magnitude.addr_at(args.magnitude_offset)?,
                g: g.addr_at(g_offset)?,
                out_dim: to_i32("out_dim", out)?,
                in_dim: to_i32("in_dim", inp)?,
                rank: to_i32("rank", rank)?,
                stride: to_i32("stride", args.stride)?,
                scale: args.pair.scale,
                pad: 0,
            };
            let launch = Launch {
                grid: (to_u32("grid", out.min(65_535))?, 1, 1),
                block: 256,
                smem: 0,
            };
            // SAFETY: params mirror the kernel's struct (sizes asserted on both
            // sides); the weight holds out x in values and the magnitude and g
            // out each from their offsets (checked above); A holds rank rows of
            // in and B out rows `stride` apart with rank <= stride, at addresses
            // the caller keeps alive until the launch has run (its staging slot).
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::Dora,
                        name: "dora_row_scale",
                    },
                    launch,
                    &p,
                )
            }
        }
    }
}

/// One target's resolved CPU-reference inputs: its bias and each row's `g`.
struct Resolved {
    bias: Vec<f32>,
    g: Vec<Option<Vec<f32>>>,
}

/// `y ← g ⊙ (y − b) + b` per row of a DoRA slot (see the module docs):
/// `row_slot[r]` is row r's slot (-1: base), for `y.n_rows` rows.
pub fn dora_rescale<Y: OutputElem>(
    device: &Device,
    row_slot: &DeviceBuffer<i32>,
    targets: &[DoraTarget<'_>],
    mut y: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    y.check(device, "y")?;
    device.expect_same("row_slot", row_slot.device())?;
    check_range("row_slot", 0, y.n_rows, row_slot.len())?;
    if targets.is_empty() || targets.len() > MAX_TARGETS {
        return Err(invalid(
            "targets",
            format!("{} targets; 1..={MAX_TARGETS} allowed", targets.len()),
        ));
    }
    let mut params = [DoraTargetParams::default(); MAX_TARGETS];
    for (t, p) in targets.iter().zip(params.iter_mut()) {
        device.expect_same("targets.table", t.table.device())?;
        device.expect_same("targets.bias", t.bias.device())?;
        check_range("targets.table", t.table_offset, t.n_entries, t.table.len())?;
        check_range("targets.bias", t.bias_offset, t.out_dim, t.bias.len())?;
        let end = t
            .y_col_offset
            .checked_add(t.out_dim)
            .ok_or_else(|| invalid("targets", "column range overflows"))?;
        if end > y.width {
            return Err(invalid(
                "targets",
                format!("columns {}..{end} are past y's width {}", t.y_col_offset, y.width),
            ));
        }
        *p = DoraTargetParams {
            table: t.table.addr_at(t.table_offset)?,
            bias: t.bias.addr_at(t.bias_offset)?,
            n_entries: to_i32("targets.n_entries", t.n_entries)?,
            out_dim: to_i32("targets.out_dim", t.out_dim)?,
            y_col_off: to_i32("targets.y_col_offset", t.y_col_offset)?,
            pad: 0,
        };
    }
    if y.n_rows == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => {
            let slots = row_slot.download_range(0, y.n_rows)?;
            // Every address resolved before y is touched: an error leaves y as it was.
            let mut resolved: Vec<Resolved> = Vec::with_capacity(targets.len());
            for t in targets {
                let table = t.table.download_range(t.table_offset, t.n_entries)?;
                let bias = t.bias.download_range(t.bias_offset, t.out_dim)?;
                let mut per_row = Vec::with_capacity(slots.len());
                for (r, &s) in slots.iter().enumerate() {
                    if s < 0 {
                        per_row.push(None);
                        continue;
                    }
                    let addr = *table.get(s as usize).ok_or(KernelError::BadIndex {
                        arg: "row_slot",
                        position: r,
                        index: i64::from(s),
                        n_entries: t.n_entries,
                    })?;
                    if addr == 0 {
                        per_row.push(None);
                        continue;
                    }
                    let g: Vec<f32> = cpu.memory.read(&|| format!("DoRA g of slot {s}"), addr, t.out_dim)?;
                    per_row.push(Some(g));
                }
                resolved.push(Resolved { bias, g: per_row });
            }
            y.cpu_for_each_row(|r, row| {
                for (t, res) in targets.iter().zip(&resolved) {
                    if let Some(g) = &res.g[r] {
                        let cols = &mut row[t.y_col_offset..t.y_col_offset + t.out_dim];
                        for ((v, g), b) in cols.iter_mut().zip(g).zip(&res.bias) {
                            *v = Y::from_f32(g * (v.to_f32() - b) + b);
                        }
                    }
                }
            })
        }
        Backend::Cuda(c) => {
            let p = DoraParams {
                row_slot: row_slot.device_addr(),
                y: y.addr(),
                fault: c.fault_addr(),
                n_rows: to_i32("y.n_rows", y.n_rows)?,
                y_stride: to_i32("y.stride", y.stride)?,
                n_targets: to_i32("targets", targets.len())?,
                pad: 0,
                targets: params,
            };
            let launch = Launch {
                grid: (to_u32("grid", y.n_rows.min(65_535))?, 1, 1),
                block: 256,
                smem: 0,
            };
            let name = if Y::NAME == "bf16" {
                "dora_rescale_bf16"
            } else {
                "dora_rescale_f32"
            };
            // SAFETY: params mirror the kernel's struct (sizes asserted on both
            // sides); row_slot holds n_rows values, y covers n_rows rows at its
            // stride with every target's columns inside its width, each table
            // range and bias range lies in its buffer (checked above). The kernel
            // checks each slot against n_entries before reading a table entry;
            // a non-zero entry is the address of `out_dim` f32 values the pool
            // keeps alive for the table's life.
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::Dora,
                        name,
                    },
                    launch,
                    &p,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests;
