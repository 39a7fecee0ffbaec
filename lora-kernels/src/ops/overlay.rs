//! Token-overlay kernels (trainable tokens, `modules_to_save` tables): the
//! row diff that finds a table's overridden rows, the embedding lookup that
//! takes a slot's overlay row where it has one, and the lm_head overlay that
//! rewrites the logits of a slot's overridden ids. CUDA kernel family:
//! `cuda/overlay.cu`; entry structs [`crate::EmbedOverlayEntry`] and [`crate::LmHeadOverlayEntry`].

use half::bf16;

use super::{OutputElem, Rows, RowsMut, to_i32, to_u32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};
use crate::table::{EmbedOverlayEntry, LmHeadOverlayEntry};

/// Mirror of `struct RowDiffParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RowDiffParams {
    table: u64,
    base: u64,
    out: u64,
    vocab: i32,
    h: i32,
    table_stride: i32,
    base_stride: i32,
    thresh: f32,
    pad: i32,
}
const _: () = assert!(size_of::<RowDiffParams>() == 48);

/// Mirror of `struct EmbedParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct EmbedParams {
    ids: u64,
    row_slot: u64,
    base: u64,
    entries: u64,
    out: u64,
    fault: u64,
    n: i32,
    h: i32,
    vocab: i32,
    n_slots: i32,
    base_stride: i32,
    out_stride: i32,
    vocab_start: i32,
    vocab_size: i32,
}
const _: () = assert!(size_of::<EmbedParams>() == 80);

/// Mirror of `struct LmHeadParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LmHeadParams {
    hidden: u64,
    row_slot: u64,
    entries: u64,
    logits: u64,
    fault: u64,
    n: i32,
    h: i32,
    vocab: i32,
    n_slots: i32,
    hidden_stride: i32,
    logits_stride: i32,
}
const _: () = assert!(size_of::<LmHeadParams>() == 64);

/// The overlay entry of slot `s` (>= 0) of row `i`, or a `BadIndex` error.
fn slot_entry<E: Copy>(ents: &[E], i: usize, s: i32) -> Result<E, KernelError> {
    let index = i64::from(s);
    ents.get(s as usize).copied().ok_or(KernelError::BadIndex {
        arg: "row_slot",
        position: i,
        index,
        n_entries: ents.len(),
    })
}

/// Whether a difference counts: anything not `<= thresh`, NaN included
/// (the kernel's `!(d <= thresh)`).
fn differs(d: f32, thresh: f32) -> bool {
    d.partial_cmp(&thresh).is_none_or(|o| o == std::cmp::Ordering::Greater)
}

/// Blocks along the overlay ids of one row in the lm_head kernel.
const LMHEAD_ID_BLOCKS: u32 = 16;

/// `out[v] = 1` when row `v` of `table` differs from row `v` of `base`:
/// some `|table[v, j] - base[v, j]|` is not `<= thresh` (a NaN difference
/// counts as a difference); else 0. `table` and `base` are `[vocab, h]`.
pub fn row_diff(
    device: &Device,
    table: Rows<'_, bf16>,
    base: Rows<'_, bf16>,
    thresh: f32,
    out: &mut DeviceBuffer<u8>,
) -> Result<(), KernelError> {
    table.check(device, "table")?;
    base.check(device, "base")?;
    device.expect_same("out", out.device())?;
    if table.n_rows != base.n_rows || table.width != base.width {
        return Err(invalid(
            "base",
            format!(
                "[{}, {}] vs table [{}, {}]",
                base.n_rows, base.width, table.n_rows, table.width
            ),
        ));
    }
    let vocab = table.n_rows;
    check_range("out", 0, vocab, out.len())?;
    if vocab == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(_) => {
            let t = table.download_dense()?;
            let b = base.download_dense()?;
            let h = table.width;
            let flags: Vec<u8> = (0..vocab)
                .map(|v| {
                    let differs = t[v * h..(v + 1) * h]
                        .iter()
                        .zip(&b[v * h..(v + 1) * h])
                        .any(|(x, y)| differs((x.to_f32() - y.to_f32()).abs(), thresh));
                    u8::from(differs)
                })
                .collect();
            out.write(0, &flags)
        }
        Backend::Cuda(c) => {
            let params = RowDiffParams {
                table: table.addr(),
                base: base.addr(),
                out: out.device_addr(),
                vocab: to_i32("vocab", vocab)?,
                h: to_i32("h", table.width)?,
                table_stride: to_i32("table.stride", table.stride)?,
                base_stride: to_i32("base.stride", base.stride)?,
                thresh,
                pad: 0,
            };
            let blocks = vocab.div_ceil(8).clamp(1, 65_535);
            let launch = Launch {
                grid: (to_u32("grid", blocks)?, 1, 1),
                block: 256,
                smem: 0,
            };
            // SAFETY: params mirror the kernel's struct; table and base cover
            // `vocab` rows of `h` at their strides, out holds `vocab` bytes.
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::Overlay,
                        name: "rowdiff_bf16",
                    },
                    launch,
                    &params,
                )
            }
        }
    }
}

/// Embedding lookup with per-slot overlays: for each row `i` with token
/// `id = ids[i]` and slot `s = row_slot[i]` (`None` or -1: base only),
/// `out[i, :] = (m = slot_map_s[id]) >= 0 ? rows_s[m, :] : base[id, :]`.
/// `base` is `[vocab, h]`; `entries` holds one [`EmbedOverlayEntry`] per slot.
/// An id at or past `vocab` is an error (CPU, nothing written) or a fault
/// and a zero row (CUDA).
pub fn embed_overlay(
    device: &Device,
    ids: &DeviceBuffer<u32>,
    row_slot: Option<&DeviceBuffer<i32>>,
    base: Rows<'_, bf16>,
    entries: &DeviceBuffer<EmbedOverlayEntry>,
    out: RowsMut<'_, bf16>,
) -> Result<(), KernelError> {
    let vocab = base.n_rows;
    embed_overlay_at(device, ids, row_slot, base, 0..vocab, vocab, entries, out)
}

/// [`embed_overlay`] for a vocab-parallel rank whose tables hold the rows
/// of token ids `held` of a vocabulary of `vocab_size` (`base` is `[held.len(), h]`
/// and every slot's `slot_map` has `held.len()` entries, both indexed by
/// `id - held.start`): a row whose token is another rank's gets a zero row
/// (vLLM's masked lookup: the engine's all-reduce sums the ranks), an id at
/// or past `vocab_size` is an error (CPU, nothing written) or a fault and
/// a zero row (CUDA).
#[allow(clippy::too_many_arguments)]
pub fn embed_overlay_at(
    device: &Device,
    ids: &DeviceBuffer<u32>,
    row_slot: Option<&DeviceBuffer<i32>>,
    base: Rows<'_, bf16>,
    held: std::ops::Range<usize>,
    vocab_size: usize,
    entries: &DeviceBuffer<EmbedOverlayEntry>,
    out: RowsMut<'_, bf16>,
) -> Result<(), KernelError> {
    if held.len() != base.n_rows || held.end > vocab_size {
        return Err(invalid(
            "held",
            format!(
                "token ids {}..{} for {} base rows of a vocabulary of {vocab_size}",
                held.start, held.end, base.n_rows
            ),
        ));
    }
    base.check(device, "base")?;
    out.check(device, "out")?;
    device.expect_same("ids", ids.device())?;
    device.expect_same("entries", entries.device())?;
    let n = out.n_rows;
    check_range("ids", 0, n, ids.len())?;
    if let Some(rs) = row_slot {
        device.expect_same("row_slot", rs.device())?;
        check_range("row_slot", 0, n, rs.len())?;
    }
    if out.width != base.width {
        return Err(invalid(
            "out",
            format!("width {} vs embedding width {}", out.width, base.width),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => embed_reference(&cpu.memory, ids, row_slot, &base, (held, vocab_size), entries, out),
        Backend::Cuda(c) => {
            let params = EmbedParams {
                ids: ids.device_addr(),
                row_slot: row_slot.map_or(0, |r| r.device_addr()),
                base: base.addr(),
                entries: entries.device_addr(),
                out: out.addr(),
                fault: c.fault_addr(),
                n: to_i32("n", n)?,
                h: to_i32("h", base.width)?,
                vocab: to_i32("vocab", base.n_rows)?,
                n_slots: to_i32("entries", entries.len())?,
                base_stride: to_i32("base.stride", base.stride)?,
                out_stride: to_i32("out.stride", out.stride)?,
                vocab_start: to_i32("held.start", held.start)?,
                vocab_size: to_i32("vocab_size", vocab_size)?,
            };
            let launch = Launch {
                grid: (to_u32("grid", n.min(65_535))?, 1, 1),
                block: 128,
                smem: 0,
            };
            // SAFETY: params mirror the kernel's struct; ids (and row_slot) hold n
            // values, base covers vocab rows, out covers n rows of h. The kernel
            // checks ids against vocab_size and the held rows, slots against n_slots and overlay rows
            // against n_rows before reading through entry addresses (kept valid
            // by the overlay's owner: slot_map has vocab entries, rows n_rows x h).
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::Overlay,
                        name: "embed_overlay_bf16",
                    },
                    launch,
                    &params,
                )
            }
        }
    }
}

fn embed_reference(
    memory: &CpuMemory,
    ids: &DeviceBuffer<u32>,
    row_slot: Option<&DeviceBuffer<i32>>,
    base: &Rows<'_, bf16>,
    (held, vocab_size): (std::ops::Range<usize>, usize),
    entries: &DeviceBuffer<EmbedOverlayEntry>,
    mut out: RowsMut<'_, bf16>,
) -> Result<(), KernelError> {
    let n = out.n_rows;
    let h = base.width;
    let ids = ids.download_range(0, n)?;
    let slots = match row_slot {
        Some(rs) => rs.download_range(0, n)?,
        None => vec![-1; n],
    };
    let ents = entries.download()?;
    let mut rows: Vec<Vec<bf16>> = Vec::with_capacity(n);
    for (i, (&global, &s)) in ids.iter().zip(&slots).enumerate() {
        if global as usize >= vocab_size {
            return Err(KernelError::BadIndex {
                arg: "ids",
                position: i,
                index: i64::from(global),
                n_entries: vocab_size,
            });
        }
        // Another rank's token: a zero row here.
        if !held.contains(&(global as usize)) {
            rows.push(vec![bf16::ZERO; h]);
            continue;
        }
        let id = global - held.start as u32;
        let mut src = None;
        if s >= 0 {
            let e = slot_entry(&ents, i, s)?;
            if e.slot_map != 0 {
                let map_addr = e.slot_map + u64::from(id) * 4;
                let m: Vec<i32> = memory.read(&|| format!("slot {s} slot_map[{id}]"), map_addr, 1)?;
                if m[0] >= 0 {
                    if m[0] as u32 >= e.n_rows {
                        return Err(KernelError::BadIndex {
                            arg: "slot_map",
                            position: id as usize,
                            index: i64::from(m[0]),
                            n_entries: e.n_rows as usize,
                        });
                    }
                    let addr = e.rows + (m[0] as u64) * (h as u64) * 2;
                    src = Some(memory.read::<bf16>(&|| format!("slot {s} overlay row {}", m[0]), addr, h)?);
                }
            }
        }
        rows.push(match src {
            Some(r) => r,
            None => base.buf.download_range(base.offset + id as usize * base.stride, h)?,
        });
    }
    out.cpu_for_each_row(|i, row| row.copy_from_slice(&rows[i]))
}

/// lm_head overlay: for each row `i` whose slot `row_slot[i]` has a head
/// overlay (`count > 0`), `logits[i, ids[k]] = dot(hidden[i, :], rows[k, :])`
/// for every overridden id (FP32 dot, rounded once to the logits' type).
/// `logits` is `[n, vocab]`; rows of slot -1 are untouched.
pub fn lm_head_overlay<Y: OutputElem>(
    device: &Device,
    hidden: Rows<'_, bf16>,
    row_slot: &DeviceBuffer<i32>,
    entries: &DeviceBuffer<LmHeadOverlayEntry>,
    logits: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    hidden.check(device, "hidden")?;
    logits.check(device, "logits")?;
    device.expect_same("row_slot", row_slot.device())?;
    device.expect_same("entries", entries.device())?;
    let n = hidden.n_rows;
    if logits.n_rows != n {
        return Err(invalid("logits", format!("{} rows, hidden has {n}", logits.n_rows)));
    }
    check_range("row_slot", 0, n, row_slot.len())?;
    if n == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => lm_head_reference(&cpu.memory, &hidden, row_slot, entries, logits),
        Backend::Cuda(c) => {
            let params = LmHeadParams {
                hidden: hidden.addr(),
                row_slot: row_slot.device_addr(),
                entries: entries.device_addr(),
                logits: logits.addr(),
                fault: c.fault_addr(),
                n: to_i32("n", n)?,
                h: to_i32("h", hidden.width)?,
                vocab: to_i32("vocab", logits.width)?,
                n_slots: to_i32("entries", entries.len())?,
                hidden_stride: to_i32("hidden.stride", hidden.stride)?,
                logits_stride: to_i32("logits.stride", logits.stride)?,
            };
            let launch = Launch {
                grid: (to_u32("grid", n.min(65_535))?, LMHEAD_ID_BLOCKS, 1),
                block: 256,
                smem: 0,
            };
            let name = match Y::NAME {
                "bf16" => "lmhead_overlay_bf16",
                _ => "lmhead_overlay_f32",
            };
            // SAFETY: params mirror the kernel's struct; hidden and logits cover
            // n rows, row_slot n values; the kernel checks slots against n_slots
            // and ids against vocab before writing, and reads ids/rows through
            // entry addresses kept valid by the overlay's owner (count ids, count x h rows).
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::Overlay,
                        name,
                    },
                    launch,
                    &params,
                )
            }
        }
    }
}

fn lm_head_reference<Y: OutputElem>(
    memory: &CpuMemory,
    hidden: &Rows<'_, bf16>,
    row_slot: &DeviceBuffer<i32>,
    entries: &DeviceBuffer<LmHeadOverlayEntry>,
    mut logits: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    let n = hidden.n_rows;
    let h = hidden.width;
    let vocab = logits.width;
    let hs = hidden.download_dense()?;
    let slots = row_slot.download_range(0, n)?;
    let ents = entries.download()?;
    let mut writes: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n];
    for (i, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let e = slot_entry(&ents, i, s)?;
        if e.count == 0 || e.ids == 0 || e.rows == 0 {
            continue;
        }
        let count = e.count as usize;
        let ids: Vec<u32> = memory.read(&|| format!("slot {s} head ids"), e.ids, count)?;
        let rows: Vec<bf16> = memory.read(&|| format!("slot {s} head rows"), e.rows, count * h)?;
        let hr = &hs[i * h..(i + 1) * h];
        for (k, &id) in ids.iter().enumerate() {
            if id as usize >= vocab {
                return Err(KernelError::BadIndex {
                    arg: "head ids",
                    position: k,
                    index: i64::from(id),
                    n_entries: vocab,
                });
            }
            let dot = rows[k * h..(k + 1) * h]
                .iter()
                .zip(hr)
                .fold(0f32, |acc, (w, x)| acc + w.to_f32() * x.to_f32());
            writes[i].push((id as usize, dot));
        }
    }
    logits.cpu_for_each_row(|i, row| {
        for &(id, v) in &writes[i] {
            row[id] = Y::from_f32(v);
        }
    })
}

#[cfg(test)]
mod tests;
