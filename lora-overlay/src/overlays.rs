//! [`TokenOverlays`]: every pool slot's token overlays, the two
//! fixed-address `[max_loras]` entry tables the overlay kernels read, the
//! slot lifecycle the pool drives ([`SlotCompanion`]), and the apply calls.

use half::bf16;
use lora_audit::HostOverlay;
use lora_kernels::{
    Device, DeviceBuffer, EmbedOverlayEntry, LmHeadOverlayEntry, OutputElem, Rows, RowsMut, embed_overlay_at,
    lm_head_overlay,
};
use lora_pool::{PoolError, SlotCompanion, StepSlots};

use crate::compile::{SlotOverlay, build_overlay};
use crate::error::{COMPANION_NAME, OverlayError};
use crate::served::ServedTables;

/// The token overlays of a whole adapter pool: per slot, the overlay of
/// the adapter it holds (if any), and the `[max_loras]` entry tables of the
/// embedding and lm_head kernels. The tables keep their device addresses
/// for the set's life; commits change their contents only, so captured
/// CUDA graphs stay valid across swaps.
#[derive(Debug)]
pub struct TokenOverlays {
    device: Device,
    tables: ServedTables,
    slots: Vec<Option<SlotOverlay>>,
    embed_entries: DeviceBuffer<EmbedOverlayEntry>,
    head_entries: DeviceBuffer<LmHeadOverlayEntry>,
}

impl TokenOverlays {
    /// An empty overlay set of `max_loras` slots over the served tables.
    pub fn new(device: &Device, tables: ServedTables, max_loras: usize) -> Result<TokenOverlays, OverlayError> {
        if max_loras == 0 {
            return Err(OverlayError::NoSlots);
        }
        if i32::try_from(max_loras).is_err() {
            return Err(OverlayError::Argument {
                arg: "max_loras",
                reason: format!("{max_loras} slots do not fit the kernels' i32 slot ids"),
            });
        }
        if !tables.embed().device().same_as(device) {
            return Err(OverlayError::DeviceMismatch {
                table: "embed_tokens",
                found: tables.embed().device().name(),
                expected: device.name(),
            });
        }
        let embed_entries = device.alloc_zeros(max_loras)?;
        let head_entries = device.alloc_zeros(max_loras)?;
        // A refusal, not an abort, when the host cannot hold the slot list.
        let mut slots = Vec::new();
        slots.try_reserve_exact(max_loras).map_err(|e| OverlayError::Argument {
            arg: "max_loras",
            reason: format!("{max_loras} slots: {e}"),
        })?;
        slots.resize_with(max_loras, || None);
        Ok(TokenOverlays {
            device: device.clone(),
            slots,
            embed_entries,
            head_entries,
            tables,
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The served base tables.
    pub fn tables(&self) -> &ServedTables {
        &self.tables
    }

    /// Slots in the entry tables.
    pub fn max_loras(&self) -> usize {
        self.slots.len()
    }

    /// `slot`'s live overlay, if it has one.
    pub fn slot(&self, slot: usize) -> Option<&SlotOverlay> {
        self.slots.get(slot)?.as_ref()
    }

    /// Whether some slot has an overlay. An engine may skip the overlay
    /// calls while none has (but a captured graph must then be recaptured
    /// when one appears).
    pub fn any_active(&self) -> bool {
        self.slots.iter().any(Option::is_some)
    }

    /// The embedding kernel's `[max_loras]` table (its address never changes).
    pub fn embed_entries(&self) -> &DeviceBuffer<EmbedOverlayEntry> {
        &self.embed_entries
    }

    /// The lm_head kernel's `[max_loras]` table (its address never changes).
    pub fn lm_head_entries(&self) -> &DeviceBuffer<LmHeadOverlayEntry> {
        &self.head_entries
    }

    /// Build the overlay of `host` off to the side (new device buffers
    /// only). An error changes nothing.
    pub fn stage_overlay(&self, host: &HostOverlay) -> Result<Option<SlotOverlay>, OverlayError> {
        build_overlay(&self.device, &self.tables, host)
    }

    /// Make `staged` the live overlay of `slot` (`None` empties it): check
    /// that it was staged for these tables on this device, write the slot's
    /// two table entries, then drop its previous buffers. If a write fails,
    /// the slot keeps its previous overlay.
    pub fn install(&mut self, slot: usize, staged: Option<SlotOverlay>) -> Result<(), OverlayError> {
        let previous = self.slots.get(slot).ok_or(OverlayError::NoSuchSlot {
            slot,
            max_loras: self.slots.len(),
        })?;
        if let Some(overlay) = &staged {
            overlay.check_fits(&self.device, self.tables.vocab(), self.tables.hidden())?;
        }
        let old_embed = previous.as_ref().map(SlotOverlay::embed_entry).unwrap_or_default();
        let embed = staged.as_ref().map(SlotOverlay::embed_entry).unwrap_or_default();
        let head = staged.as_ref().map(SlotOverlay::head_entry).unwrap_or_default();
        self.embed_entries.write(slot, &[embed])?;
        if let Err(e) = self.head_entries.write(slot, &[head]) {
            // The previous buffers are still alive: point the embed entry back at them.
            let _ = self.embed_entries.write(slot, &[old_embed]);
            return Err(e.into());
        }
        // Stream-ordered after the entry writes, so no later launch reads the old buffers.
        self.slots[slot] = staged;
        Ok(())
    }

    /// Embedding lookup for the pool's current step: `out[i] = ` the overlay
    /// row of `ids[i]` in row `i`'s slot when that slot overrides it, else
    /// the base row (`rows` `None`, or a base row: base). `rows` comes from
    /// [`LoraPool::step_slots`](lora_pool::LoraPool::step_slots), so it is
    /// the step's own row map, held by the step; `ids` has one id per kernel
    /// row of the step. Over a vocab-parallel rank's tables, a row whose
    /// token is another rank's is a zero row (the engine's all-reduce of
    /// the embedding output sums the ranks). Allocates nothing and does not
    /// synchronise: graph-capturable.
    pub fn embed(
        &self,
        ids: &DeviceBuffer<u32>,
        rows: Option<StepSlots<'_>>,
        out: RowsMut<'_, bf16>,
    ) -> Result<(), OverlayError> {
        if let Some(rows) = rows {
            check_rows("ids", out.n_rows, rows)?;
        }
        self.embed_rows(ids, rows.map(|r| r.buffer()), out)
    }

    /// [`TokenOverlays::embed`] over a raw per-row slot map (the probes).
    pub(crate) fn embed_rows(
        &self,
        ids: &DeviceBuffer<u32>,
        row_slot: Option<&DeviceBuffer<i32>>,
        out: RowsMut<'_, bf16>,
    ) -> Result<(), OverlayError> {
        let base = Rows::dense(self.tables.embed(), self.tables.vocab(), self.tables.hidden());
        let (held, vocab_size) = (self.tables.held(), self.tables.vocab_size());
        embed_overlay_at(
            &self.device,
            ids,
            row_slot,
            base,
            held,
            vocab_size,
            &self.embed_entries,
            out,
        )?;
        Ok(())
    }

    /// lm_head overlay on the base logits `[n, >= vocab]` (bf16 or f32; a
    /// vocab-parallel rank's logit columns, `vocab` its block): for
    /// each row whose slot overlays the head, the logits of the overridden
    /// ids become `dot(hidden[row], overlay row)`; other logits are
    /// untouched. `rows` is the current step's row map from
    /// [`LoraPool::step_slots`](lora_pool::LoraPool::step_slots): one hidden
    /// row per kernel row of the step. Allocates nothing and does not
    /// synchronise: graph-capturable.
    pub fn lm_head<Y: OutputElem>(
        &self,
        hidden: Rows<'_, bf16>,
        rows: StepSlots<'_>,
        logits: RowsMut<'_, Y>,
    ) -> Result<(), OverlayError> {
        check_rows("hidden", hidden.n_rows, rows)?;
        self.lm_head_rows(hidden, rows.buffer(), logits)
    }

    /// [`TokenOverlays::lm_head`] over a raw per-row slot map (the probes).
    pub(crate) fn lm_head_rows<Y: OutputElem>(
        &self,
        hidden: Rows<'_, bf16>,
        row_slot: &DeviceBuffer<i32>,
        logits: RowsMut<'_, Y>,
    ) -> Result<(), OverlayError> {
        if hidden.width != self.tables.hidden() {
            return Err(OverlayError::Argument {
                arg: "hidden",
                reason: format!(
                    "rows are {} wide, the model's hidden size is {}",
                    hidden.width,
                    self.tables.hidden()
                ),
            });
        }
        if logits.width < self.tables.vocab() {
            return Err(OverlayError::Argument {
                arg: "logits",
                reason: format!(
                    "rows are {} wide, the vocabulary is {}",
                    logits.width,
                    self.tables.vocab()
                ),
            });
        }
        lm_head_overlay(&self.device, hidden, row_slot, &self.head_entries, logits)?;
        Ok(())
    }
}

/// Refuse an overlay call whose rows are not the step's kernel rows.
fn check_rows(arg: &'static str, n_rows: usize, rows: StepSlots<'_>) -> Result<(), OverlayError> {
    if n_rows == rows.rows() {
        Ok(())
    } else {
        Err(OverlayError::Argument {
            arg,
            reason: format!("{n_rows} rows; the step has {} kernel rows", rows.rows()),
        })
    }
}

impl SlotCompanion for TokenOverlays {
    type Staged = Option<SlotOverlay>;

    fn name(&self) -> &'static str {
        COMPANION_NAME
    }

    fn stage(&mut self, name: &str, overlay: &HostOverlay) -> Result<Option<SlotOverlay>, PoolError> {
        self.stage_overlay(overlay).map_err(|e| match e {
            OverlayError::Kernel(k) => PoolError::Kernel(k),
            other => PoolError::Companion {
                companion: COMPANION_NAME,
                message: format!("adapter `{name}`: {other}"),
            },
        })
    }

    fn commit(&mut self, slot: usize, staged: Option<SlotOverlay>) -> Result<(), PoolError> {
        Ok(self.install(slot, staged)?)
    }

    fn clear(&mut self, slot: usize) -> Result<(), PoolError> {
        Ok(self.install(slot, None)?)
    }
}

#[cfg(test)]
mod tests;
