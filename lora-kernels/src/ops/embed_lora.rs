//! LoRA on the input embedding: a gather-expand that, for each token row
//! `i` with token `t = ids[i]` and slot `s = row_slot[i]`, adds
//! `scale · B_s · A_s[:, t]` onto `out[i, :]` (rows of slot -1 untouched).
//!
//! The pair is an ordinary [`PairEntry`]: A `[stride, vocab]` and B
//! `[hidden, stride]` (PEFT's `lora_embedding_A` / `lora_embedding_B`,
//! padded to the pool's rank), so the gather reads column `t` of A (`rank`
//! values, `vocab` apart) and the expand is one `[hidden, rank]` matrix
//! times it. BF16 weights, FP32 accumulation, the delta added to `out` in
//! FP32 and rounded once. A vocab-parallel rank's A holds only its columns
//! `vocab_start .. vocab_start + vocab` ([`EmbeddingPairs::vocab_start`]):
//! token `t` reads column `t - vocab_start`, and a token outside that range
//! (another rank's) adds nothing on this rank. A token id at or past
//! `vocab_size`, a slot past the table and a bad entry are an error on the
//! CPU (nothing written) and a fault bit on CUDA (that row left as it
//! was), never an out-of-bounds read.
//! CUDA kernel: `embed_lora_{f32,bf16}` in `cuda/overlay.cu` (the token-table
//! family).

use super::pairs::PairResolver;
use super::{OutputElem, RowsMut, to_i32, to_u32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cpu_mem::CpuMemory;
use crate::cuda_rt::{Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};
use crate::table::PairEntry;

/// Mirror of `struct EmbedLoraParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct EmbedLoraParams {
    ids: u64,
    row_slot: u64,
    table: u64,
    out: u64,
    fault: u64,
    n: i32,
    h: i32,
    vocab: i32,
    n_entries: i32,
    stride: i32,
    out_stride: i32,
    vocab_start: i32,
    vocab_size: i32,
}
const _: () = assert!(size_of::<EmbedLoraParams>() == 72);

/// The embedding pairs of a pool: `n_entries` [`PairEntry`]s (one per slot)
/// from `table_offset` of `table`, each A `[stride, vocab]`, B `[out.width,
/// stride]`.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingPairs<'a> {
    /// The pair table.
    pub table: &'a DeviceBuffer<PairEntry>,
    /// First entry of the embedding pairs.
    pub table_offset: usize,
    /// Entries (the slot count); a row's slot indexes them.
    pub n_entries: usize,
    /// The rank stride (the pool's `max_rank`): rows of A, columns of B.
    pub stride: usize,
    /// Columns of A: the whole vocabulary, or a vocab-parallel rank's
    /// block of it.
    pub vocab: usize,
    /// The token id of A's column 0 (0 unless vocab-parallel).
    pub vocab_start: usize,
    /// The model's vocabulary: a token id must be below it.
    pub vocab_size: usize,
}

impl EmbeddingPairs<'_> {
    /// A's column of token `t`, or `None` for another rank's token.
    fn column(&self, t: usize) -> Option<usize> {
        t.checked_sub(self.vocab_start).filter(|&c| c < self.vocab)
    }
}

/// Add each row's embedding LoRA delta onto `out` (`[n, hidden]`): for row
/// `i` with `s = row_slot[i] >= 0` and a pair (rank > 0) in entry `s`,
/// `out[i, :] += scale · B · A[:, ids[i] - vocab_start]` when the token is
/// one of A's columns (nothing otherwise).
pub fn embed_lora<Y: OutputElem>(
    device: &Device,
    ids: &DeviceBuffer<u32>,
    row_slot: &DeviceBuffer<i32>,
    pairs: EmbeddingPairs<'_>,
    out: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    out.check(device, "out")?;
    device.expect_same("ids", ids.device())?;
    device.expect_same("row_slot", row_slot.device())?;
    device.expect_same("pairs.table", pairs.table.device())?;
    let n = out.n_rows;
    check_range("ids", 0, n, ids.len())?;
    check_range("row_slot", 0, n, row_slot.len())?;
    check_range("pairs.table", pairs.table_offset, pairs.n_entries, pairs.table.len())?;
    if pairs.stride == 0 {
        return Err(invalid("pairs.stride", "the rank stride must be at least 1"));
    }
    if pairs
        .vocab_start
        .checked_add(pairs.vocab)
        .is_none_or(|end| end > pairs.vocab_size)
    {
        return Err(invalid(
            "pairs.vocab",
            format!(
                "columns {}..{} past the vocabulary of {}",
                pairs.vocab_start,
                pairs.vocab_start.saturating_add(pairs.vocab),
                pairs.vocab_size
            ),
        ));
    }
    if n == 0 || pairs.n_entries == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(cpu) => reference(&cpu.memory, ids, row_slot, &pairs, out),
        Backend::Cuda(c) => {
            let params = EmbedLoraParams {
                ids: ids.device_addr(),
                row_slot: row_slot.device_addr(),
                table: pairs.table.addr_at(pairs.table_offset)?,
                out: out.addr(),
                fault: c.fault_addr(),
                n: to_i32("n", n)?,
                h: to_i32("out.width", out.width)?,
                vocab: to_i32("pairs.vocab", pairs.vocab)?,
                n_entries: to_i32("pairs.n_entries", pairs.n_entries)?,
                stride: to_i32("pairs.stride", pairs.stride)?,
                out_stride: to_i32("out.stride", out.stride)?,
                vocab_start: to_i32("pairs.vocab_start", pairs.vocab_start)?,
                vocab_size: to_i32("pairs.vocab_size", pairs.vocab_size)?,
            };
            let launch = Launch {
                grid: (to_u32("grid", n.min(65_535))?, 1, 1),
                block: 128,
                smem: 0,
            };
            let name = match Y::NAME {
                "bf16" => "embed_lora_bf16",
                _ => "embed_lora_f32",
            };
            // SAFETY: params mirror the kernel's struct; ids and row_slot hold n
            // values, out covers n rows of h at its stride, the table holds
            // n_entries entries from its offset. The kernel checks slots against
            // n_entries, ranks against stride and ids against A's columns before reading
            // A and B through entry addresses (kept valid by the pool that owns
            // them: A [stride, vocab], B [h, stride]).
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

/// The CPU reference: every delta computed (every address resolved) before
/// `out` is touched, so an error leaves it as it was.
fn reference<Y: OutputElem>(
    memory: &CpuMemory,
    ids: &DeviceBuffer<u32>,
    row_slot: &DeviceBuffer<i32>,
    pairs: &EmbeddingPairs<'_>,
    mut out: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    let n = out.n_rows;
    let hidden = out.width;
    let ids = ids.download_range(0, n)?;
    let slots = row_slot.download_range(0, n)?;
    let entries = pairs.table.download_range(pairs.table_offset, pairs.n_entries)?;
    let mut resolver = PairResolver::new(memory, entries, pairs.vocab, hidden, pairs.stride);
    let mut deltas: Vec<Option<Vec<f32>>> = Vec::with_capacity(n);
    for (i, (&t, &s)) in ids.iter().zip(&slots).enumerate() {
        let Some(pair) = resolver.get("row_slot", i, i64::from(s))? else {
            deltas.push(None);
            continue;
        };
        if t as usize >= pairs.vocab_size {
            return Err(KernelError::BadIndex {
                arg: "ids",
                position: i,
                index: i64::from(t),
                n_entries: pairs.vocab_size,
            });
        }
        let Some(col) = pairs.column(t as usize) else {
            deltas.push(None);
            continue;
        };
        let mut d = vec![0f32; hidden];
        pair.column_delta(col, pairs.vocab, &mut d);
        deltas.push(Some(d));
    }
    out.cpu_for_each_row(|i, row| {
        if let Some(d) = &deltas[i] {
            for (y, v) in row.iter_mut().zip(d) {
                *y = Y::from_f32(y.to_f32() + v);
            }
        }
    })
}

#[cfg(test)]
mod tests;
