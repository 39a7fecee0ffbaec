//! One slot's overlay built on the device: the row diff of a saved table
//! against the served base (the `row_diff` kernel), the override set, the
//! compacted rows in ascending id order, the `slot_map`, and their device
//! buffers. Everything here allocates new buffers only; nothing live is
//! touched, so a failure (e.g. out of memory) leaves the serving state as it
//! was.

use half::bf16;
use lora_audit::{
    CompiledOverlay, HostOverlay, ROWDIFF_THRESH, TableOverlay, build_override_set, clamp_trainable_to_vocab,
    override_source,
};
use lora_kernels::{Device, DeviceBuffer, EmbedOverlayEntry, LmHeadOverlayEntry, Rows, row_diff};

use crate::error::OverlayError;
use crate::served::ServedTables;

/// Compacted override rows on the device: the overridden vocab ids
/// (ascending) and their rows `[n, hidden]` BF16 in that order. The lm_head
/// kernel writes `dot(hidden, row)` to each overridden id's logit.
#[derive(Debug)]
pub struct OverrideRows {
    ids: Vec<u32>,
    ids_dev: DeviceBuffer<u32>,
    rows: DeviceBuffer<bf16>,
}

impl OverrideRows {
    fn upload(device: &Device, compiled: &CompiledOverlay) -> Result<OverrideRows, OverlayError> {
        Ok(OverrideRows {
            ids_dev: device.upload(&compiled.ids)?,
            rows: device.upload(&compiled.rows)?,
            ids: compiled.ids.clone(),
        })
    }

    /// The overridden vocab ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The ids on the device (`u32[n]`).
    pub fn ids_dev(&self) -> &DeviceBuffer<u32> {
        &self.ids_dev
    }

    /// The rows `[n, hidden]`, row `k` for `ids()[k]`.
    pub fn rows(&self) -> &DeviceBuffer<bf16> {
        &self.rows
    }

    /// `u32` count; the ids are fewer than the vocabulary, which
    /// [`ServedTables`] holds to `i32`.
    fn count(&self) -> u32 {
        u32::try_from(self.ids.len()).unwrap_or(u32::MAX)
    }

    /// An error unless these rows can be served from tables of `vocab` x
    /// `hidden` on `device`: the kernels read through their addresses.
    fn check_fits(&self, device: &Device, vocab: usize, hidden: usize) -> Result<(), OverlayError> {
        let fits = self.ids_dev.device().same_as(device)
            && self.rows.device().same_as(device)
            && self.ids_dev.len() == self.ids.len()
            && self.ids.len().checked_mul(hidden) == Some(self.rows.len())
            && self.ids.iter().all(|&id| (id as usize) < vocab);
        if fits {
            Ok(())
        } else {
            Err(OverlayError::Argument {
                arg: "staged overlay",
                reason: format!(
                    "built for other tables or another device than {vocab} x {hidden} on {}",
                    device.name()
                ),
            })
        }
    }

    fn head_entry(&self) -> LmHeadOverlayEntry {
        LmHeadOverlayEntry {
            ids: self.ids_dev.device_addr(),
            rows: self.rows.device_addr(),
            count: self.count(),
            pad: 0,
        }
    }
}

/// One slot's embedding overlay on the device: the override rows and
/// `slot_map` (`i32[vocab]`: the row of an overridden id, else -1), which
/// the embedding kernel indexes by token id.
#[derive(Debug)]
pub struct EmbedOverlay {
    overrides: OverrideRows,
    slot_map: DeviceBuffer<i32>,
}

impl EmbedOverlay {
    /// The overridden ids and their rows.
    pub fn overrides(&self) -> &OverrideRows {
        &self.overrides
    }

    /// `i32[vocab]`: the row index of an overridden id, else -1.
    pub fn slot_map(&self) -> &DeviceBuffer<i32> {
        &self.slot_map
    }

    fn entry(&self) -> EmbedOverlayEntry {
        EmbedOverlayEntry {
            slot_map: self.slot_map.device_addr(),
            rows: self.overrides.rows.device_addr(),
            n_rows: self.overrides.count(),
            pad: 0,
        }
    }
}

/// Where a slot's lm_head overlay rows live.
#[derive(Debug)]
pub enum HeadRows {
    /// The head is not overlaid.
    None,
    /// The head overrides exactly the embedding overlay's ids with the same
    /// rows (a tied head with trainable tokens): its entry points at the
    /// embedding overlay's ids and rows, nothing is copied.
    SharesEmbed,
    /// The head's own rows (an untied head, or a `modules_to_save` lm_head).
    Own(OverrideRows),
}

/// One slot's token overlays, built by [`build_overlay`].
#[derive(Debug)]
pub struct SlotOverlay {
    embed: Option<EmbedOverlay>,
    head: HeadRows,
}

impl SlotOverlay {
    /// The embedding overlay.
    pub fn embed(&self) -> Option<&EmbedOverlay> {
        self.embed.as_ref()
    }

    /// The head overlay.
    pub fn head(&self) -> &HeadRows {
        &self.head
    }

    /// The ids whose logits the head overlay writes, ascending.
    pub fn head_ids(&self) -> &[u32] {
        match (&self.head, &self.embed) {
            (HeadRows::Own(h), _) => h.ids(),
            (HeadRows::SharesEmbed, Some(e)) => e.overrides.ids(),
            _ => &[],
        }
    }

    /// An error unless the overlay can be served from tables of `vocab` x
    /// `hidden` on `device` (it was staged for them).
    pub fn check_fits(&self, device: &Device, vocab: usize, hidden: usize) -> Result<(), OverlayError> {
        if let Some(e) = &self.embed {
            e.overrides.check_fits(device, vocab, hidden)?;
            if !e.slot_map.device().same_as(device) || e.slot_map.len() != vocab {
                return Err(OverlayError::Argument {
                    arg: "staged overlay",
                    reason: format!("its slot_map has {} entries, the vocabulary {vocab}", e.slot_map.len()),
                });
            }
        }
        if let HeadRows::Own(h) = &self.head {
            h.check_fits(device, vocab, hidden)?;
        }
        Ok(())
    }

    /// The slot's entry in the embedding kernel's table.
    pub fn embed_entry(&self) -> EmbedOverlayEntry {
        self.embed.as_ref().map(EmbedOverlay::entry).unwrap_or_default()
    }

    /// The slot's entry in the lm_head kernel's table.
    pub fn head_entry(&self) -> LmHeadOverlayEntry {
        match (&self.head, &self.embed) {
            (HeadRows::Own(h), _) => h.head_entry(),
            (HeadRows::SharesEmbed, Some(e)) => e.overrides.head_entry(),
            _ => LmHeadOverlayEntry::default(),
        }
    }
}

/// Build one slot's overlay on `device` against the served tables: clamp
/// the trainable ids to the served vocabulary, diff saved tables against the
/// served rows with the `row_diff` kernel, compact the overridden rows,
/// build the `slot_map`, and upload. A head whose compiled overlay is the
/// embedding's (a tied head with trainable tokens) shares the embedding
/// overlay's buffers. Over a vocab-parallel rank's tables
/// ([`ServedTables::held`]) only the overridden ids of the rank's block are
/// kept (trainable ids of other ranks dropped, a saved table cut to the
/// rank's rows before the diff), indexed by `id - held().start`: an overlay
/// row replaces the base row only on the rank that holds it.
/// `Ok(None)` when nothing is overridden.
pub fn build_overlay(
    device: &Device,
    tables: &ServedTables,
    host: &HostOverlay,
) -> Result<Option<SlotOverlay>, OverlayError> {
    if host.is_empty() {
        return Ok(None);
    }
    let (vocab, hidden) = (tables.vocab(), tables.hidden());
    if host.hidden != hidden {
        return Err(OverlayError::Hidden {
            got: host.hidden,
            hidden,
        });
    }
    let held = tables.held();
    let embed = match &host.embed {
        Some(t) => Some(compile_table(
            device,
            &*held_rows(t, held.clone(), tables.vocab_size(), hidden)?,
            Some(tables.embed()),
            TableName::Embed,
            vocab,
            hidden,
        )?),
        None => None,
    }
    .filter(|c| !c.ids.is_empty());
    let head = match host.lm_head_table() {
        Some(t) => Some(compile_table(
            device,
            &*held_rows(&t, held, tables.vocab_size(), hidden)?,
            tables.head_table(),
            TableName::LmHead,
            vocab,
            hidden,
        )?),
        None => None,
    }
    .filter(|c| !c.ids.is_empty());
    let head = match head {
        None => HeadRows::None,
        Some(h) if embed.as_ref().is_some_and(|e| e.ids == h.ids && e.rows == h.rows) => HeadRows::SharesEmbed,
        Some(h) => HeadRows::Own(OverrideRows::upload(device, &h)?),
    };
    let embed = match embed {
        Some(e) => Some(EmbedOverlay {
            overrides: OverrideRows::upload(device, &e)?,
            slot_map: device.upload(&e.slot_map)?,
        }),
        None => None,
    };
    if embed.is_none() && matches!(head, HeadRows::None) {
        return Ok(None);
    }
    Ok(Some(SlotOverlay { embed, head }))
}

/// `overlay` cut to the tables' rows `held` of a vocabulary of
/// `vocab_size`: the trainable ids in `held` (as `id - held.start`, in the
/// overlay's order) with their rows, and the saved table's rows of `held`.
/// The whole overlay, as it is, when `held` is the whole vocabulary.
fn held_rows(
    overlay: &TableOverlay,
    held: std::ops::Range<usize>,
    vocab_size: usize,
    hidden: usize,
) -> Result<std::borrow::Cow<'_, TableOverlay>, OverlayError> {
    if held == (0..vocab_size) {
        return Ok(std::borrow::Cow::Borrowed(overlay));
    }
    if overlay.ids.len().checked_mul(hidden) != Some(overlay.rows.len()) {
        return Err(OverlayError::RowCount {
            table: "overlay",
            rows: overlay.rows.len(),
            ids: overlay.ids.len(),
            hidden,
        });
    }
    let mut ids = Vec::new();
    let mut rows = Vec::new();
    for (k, &id) in overlay.ids.iter().enumerate() {
        if held.contains(&(id as usize)) {
            ids.push(id - held.start as u32);
            rows.extend_from_slice(&overlay.rows[k * hidden..(k + 1) * hidden]);
        }
    }
    let table = match &overlay.table {
        None => None,
        Some(copy) => {
            if vocab_size.checked_mul(hidden) != Some(copy.len()) {
                return Err(OverlayError::TableSize {
                    table: "the adapter's saved table",
                    len: copy.len(),
                    vocab: vocab_size,
                    hidden,
                });
            }
            Some(copy[held.start * hidden..held.end * hidden].to_vec())
        }
    };
    Ok(std::borrow::Cow::Owned(TableOverlay { ids, rows, table }))
}

/// Which served table a compile is for, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TableName {
    Embed,
    LmHead,
}

impl TableName {
    fn name(self) -> &'static str {
        match self {
            TableName::Embed => "embed_tokens",
            TableName::LmHead => "lm_head",
        }
    }

    fn adapter_copy(self) -> &'static str {
        match self {
            TableName::Embed => "the adapter's embed_tokens table",
            TableName::LmHead => "the adapter's lm_head table",
        }
    }
}

/// Compile one table's overlay against the served `base` (`None`: a
/// quantized head) with the row diff on the device. The host result equals
/// [`TableOverlay::compile`] of the clamped overlay (the pure reference).
pub(crate) fn compile_table(
    device: &Device,
    overlay: &TableOverlay,
    base: Option<&DeviceBuffer<bf16>>,
    table: TableName,
    vocab: usize,
    hidden: usize,
) -> Result<CompiledOverlay, OverlayError> {
    if overlay.ids.len().checked_mul(hidden) != Some(overlay.rows.len()) {
        return Err(OverlayError::RowCount {
            table: table.name(),
            rows: overlay.rows.len(),
            ids: overlay.ids.len(),
            hidden,
        });
    }
    let (kept, _skipped) = clamp_trainable_to_vocab(&overlay.ids, vocab);
    let row_diff = match &overlay.table {
        None => Vec::new(),
        Some(copy) => {
            if vocab.checked_mul(hidden) != Some(copy.len()) {
                return Err(OverlayError::TableSize {
                    table: table.adapter_copy(),
                    len: copy.len(),
                    vocab,
                    hidden,
                });
            }
            let base = base.ok_or_else(|| OverlayError::QuantizedHead {
                what: table.adapter_copy().to_string(),
                purpose: "diff it against",
            })?;
            device_row_diff(device, base, copy, vocab, hidden)?
        }
    };
    let ids = build_override_set(&row_diff, &kept);
    let mut rows = Vec::with_capacity(ids.len().saturating_mul(hidden));
    let mut slot_map = vec![-1i32; vocab];
    for (n, &id) in ids.iter().enumerate() {
        let i = id as usize;
        let row = match (override_source(id, &overlay.ids), &overlay.table) {
            (Some(k), _) => overlay.rows.get(k * hidden..(k + 1) * hidden),
            (None, Some(copy)) => copy.get(i * hidden..(i + 1) * hidden),
            // Without a table only trainable ids are overridden, so every id has a source.
            (None, None) => None,
        };
        let row = row.ok_or(OverlayError::Argument {
            arg: "overlay",
            reason: format!("{}: no row for overridden id {id}", table.name()),
        })?;
        rows.extend_from_slice(row);
        let slot = slot_map.get_mut(i).ok_or(OverlayError::Argument {
            arg: "overlay",
            reason: format!("{}: id {id} past the vocabulary of {vocab}", table.name()),
        })?;
        *slot = i32::try_from(n).map_err(|_| OverlayError::VocabTooLarge { vocab })?;
    }
    Ok(CompiledOverlay { ids, rows, slot_map })
}

/// Which rows of the adapter's table `copy` differ from the served `base`,
/// by the `row_diff` kernel (threshold [`ROWDIFF_THRESH`]). The adapter's
/// table is uploaded to a buffer of its own, freed on return.
fn device_row_diff(
    device: &Device,
    base: &DeviceBuffer<bf16>,
    copy: &[bf16],
    vocab: usize,
    hidden: usize,
) -> Result<Vec<bool>, OverlayError> {
    let adapter = device.upload(copy)?;
    let mut flags = device.alloc_zeros::<u8>(vocab)?;
    row_diff(
        device,
        Rows::dense(&adapter, vocab, hidden),
        Rows::dense(base, vocab, hidden),
        ROWDIFF_THRESH,
        &mut flags,
    )?;
    device.check_faults()?;
    Ok(flags.download()?.into_iter().map(|f| f != 0).collect())
}

#[cfg(test)]
mod tests;
