//! DoRA's served arithmetic: the rescale every expand applies in its
//! epilogue, and [`dora_row_scale`], which computes a slot's rescale once
//! when it is staged.
//!
//! # The epilogue
//!
//! A target of an apply call ([`super::LoraTarget`]) may carry a
//! [`DoraEpilogue`]: a table of `g` addresses indexed like its PairEntry
//! table (the pool's `[max_loras]` per (layer, module), 0 where the slot has
//! no DoRA pair) and the projection's base bias (none: zeros). For a row
//! whose entry has a `g` there, the expand writes, per output column c,
//! `g[c] · ((y + Δ) − b[c]) + b[c]` instead of `y + Δ`, where `y + Δ` is the
//! f32 sum the form computed (y as it was, Δ the row's delta) and nothing is
//! rounded between the sum and the rescale; rows of plain-LoRA entries,
//! entries without a pair and base rows (-1) get `y + Δ` bit for bit as
//! without the epilogue. So a mixed batch of DoRA, plain-LoRA and base rows
//! is one launch of whichever form the plan picks, decode
//! ([`super::bgmv`]) and prefill ([`super::sgmv`]) alike: every form writes
//! each output element of y from exactly one thread (the fused form after
//! its cluster sum, each block its own output columns; the two-phase
//! form's expand; the row-register and entry-clustered forms, each block
//! its slice of the outputs of one row or one entry's rows; sgmv's expand,
//! one tile of one segment), which applies the epilogue to the value it
//! stores. The plan does not look at the epilogue: a call with DoRA targets
//! is planned as the same call without them.
//!
//! In the decode forms the epilogue is a property of the kernel
//! instantiation: every decode kernel that writes y is compiled twice, plain
//! and `_dora` (a `DORA` template parameter, every piece of the epilogue
//! under `if constexpr`), and a call runs the `_dora` kernel iff one of its
//! targets carries a [`DoraEpilogue`] (`Epilogue::of` in `bgmv/kernels.rs`,
//! the one rule; a DoRA pool attaches one to every call). So a plain call
//! runs kernels with no rescale lookup, branch or register in them (the
//! entry-clustered form's rank-16 kernels, at 80 registers, spill with
//! one). Inside the `_dora` entry-clustered register kernel, whose whole A
//! slice and B rows live in 80 registers, an entry with a rescale runs the
//! form's staged body instead (as an entry of unaligned weights does), and
//! the `_dora` staged kernels rescale in a non-inlined function (inlined,
//! it spilled them).
//! That function takes `g` and the bias as addresses and issues its sixteen
//! loads together. Sgmv's expand (one instantiation: a plain item loads
//! nothing more) brings a DoRA item's `g` and bias columns into shared
//! memory (the pads of its y tile's rows) with the item's B rows, so its
//! epilogue reads them there.
//!
//! The rescale is `g · (v − b) + b` in f32 with no fused multiply-add on
//! both backends (`dora_epilogue` in `cuda/common.cuh`), so for a given
//! `v` the two agree bit for bit; `v` itself is the form's sum and differs
//! from the CPU reference's by the delta's summation order, as every apply
//! does (the kernels' tests hold CUDA to the CPU reference within the
//! apply's tolerance, scaled by `g`).
//!
//! # The rescale `g`
//!
//! [`dora_row_scale`] computes a slot's rescale where its factors are, once
//! per adapter when it is staged (not an apply call): PEFT's
//! `g = m / ‖W + s·B A‖` per output row, from the base weight (f32), the
//! pair's A and B as served (BF16, B rows `stride` apart) and the magnitude
//! (f32). `B A` is summed over the rank in f32 and the squares in f64 on
//! both backends; the norm is rounded to f32 before the division, as
//! PEFT's f32 norm is. A zero or non-finite norm leaves a non-finite `g`
//! for the caller to refuse.

use super::{to_i32, to_u32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};
use crate::table::PairEntry;

/// The DoRA epilogue's inputs at one target of an apply call (see the
/// module docs): a `[n_entries]` range of a table of `g` addresses indexed
/// like the target's PairEntry table (`table[table_offset + e]`: entry e's
/// `g [out_dim]`, f32, or 0 where it has no DoRA pair) and the projection's
/// base bias, if it has one.
#[derive(Debug, Clone, Copy)]
pub struct DoraEpilogue<'a> {
    /// The `g` address table (the pool keeps every (layer, module)'s in one).
    pub table: &'a DeviceBuffer<u64>,
    /// First entry of this target's table; it holds as many entries as the
    /// target's PairEntry table.
    pub table_offset: usize,
    /// The base bias (`bias[offset..][..out_dim]`, f32); `None`: zeros.
    pub bias: Option<(&'a DeviceBuffer<f32>, usize)>,
}

impl DoraEpilogue<'_> {
    /// Check the table and bias ranges for a target of `n_entries` entries
    /// and `out_dim` outputs; their device addresses (bias 0: none).
    pub(crate) fn check(&self, device: &Device, n_entries: usize, out_dim: usize) -> Result<(u64, u64), KernelError> {
        device.expect_same("targets.dora.table", self.table.device())?;
        check_range("targets.dora.table", self.table_offset, n_entries, self.table.len())?;
        let bias = match self.bias {
            Some((buf, offset)) => {
                device.expect_same("targets.dora.bias", buf.device())?;
                check_range("targets.dora.bias", offset, out_dim, buf.len())?;
                buf.addr_at(offset)?
            }
            None => 0,
        };
        Ok((self.table.addr_at(self.table_offset)?, bias))
    }

    /// The CPU reference's view: the bias (zeros without one) and a reader
    /// of each entry's `g`.
    pub(crate) fn resolve<'m>(
        &self,
        memory: &'m CpuMemory,
        n_entries: usize,
        out_dim: usize,
    ) -> Result<HostDora<'m>, KernelError> {
        let bias = match self.bias {
            Some((buf, offset)) => buf.download_range(offset, out_dim)?,
            None => vec![0.0; out_dim],
        };
        Ok(HostDora {
            memory,
            table: self.table.download_range(self.table_offset, n_entries)?,
            bias,
            out_dim,
        })
    }
}

/// A target's DoRA epilogue on the CPU backend (see [`DoraEpilogue::resolve`]).
pub(crate) struct HostDora<'m> {
    memory: &'m CpuMemory,
    table: Vec<u64>,
    bias: Vec<f32>,
    out_dim: usize,
}

impl HostDora<'_> {
    /// Entry `e`'s rescale (`None`: no DoRA pair); `e` was checked
    /// against the target's table, which this one matches in length.
    pub(crate) fn scale_of(&self, e: usize) -> Result<Option<Vec<f32>>, KernelError> {
        match self.table.get(e).copied() {
            None | Some(0) => Ok(None),
            Some(addr) => self
                .memory
                .read(&|| format!("DoRA g of entry {e}"), addr, self.out_dim)
                .map(Some),
        }
    }

    /// The epilogue of column `c` (see the module docs): `v = y + Δ` as
    /// the apply summed it, `g · (v − b) + b` (no fused multiply-add).
    pub(crate) fn apply(&self, g: &[f32], c: usize, v: f32) -> f32 {
        g[c] * (v - self.bias[c]) + self.bias[c]
    }
}

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

#[cfg(test)]
mod tests;
