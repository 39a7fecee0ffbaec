//! The base token tables the engine serves, which overlays are diffed
//! against and fall back to. The engine owns them; overlays share them.
//!
//! A vocab-parallel rank (`lora_layout::Placement::vocab_parallel`) serves
//! only its block of the vocabulary: its tables hold the rows of token ids
//! [`ServedTables::held`] (`vocab_start .. vocab_start + vocab` of
//! `vocab_size`), as the base model's `VocabParallelEmbedding` /
//! `ParallelLMHead` hold them, and every overlay staged over them holds
//! only those rows, indexed by `id - vocab_start`.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;
use lora_audit::BaseTables;
use lora_kernels::{Device, DeviceBuffer};
use lora_layout::{ModelConfig, Placement};

use crate::error::OverlayError;

/// How the engine serves the output head.
#[derive(Debug, Clone)]
pub enum ServedHead {
    /// The head is the embedding table (`tie_word_embeddings`): the same
    /// buffer serves both.
    SharesEmbedding,
    /// The head is served quantized: there is no BF16 table. Overlays of
    /// trainable rows (absolute rows) are served; a `modules_to_save` head
    /// table cannot be diffed and is refused.
    Quantized,
    /// The head's own BF16 table `[vocab, hidden]`.
    Own(Arc<DeviceBuffer<bf16>>),
}

/// The served base tables: the embedding `[vocab, hidden]` BF16 and the
/// head, checked against the vocabulary and the width; `vocab` rows of the
/// token ids [`ServedTables::held`] (all of them unless vocab-parallel).
#[derive(Debug, Clone)]
pub struct ServedTables {
    embed: Arc<DeviceBuffer<bf16>>,
    head: ServedHead,
    vocab: usize,
    hidden: usize,
    vocab_start: usize,
    vocab_size: usize,
}

impl ServedTables {
    /// Check the tables: both on `device`, `vocab x hidden` elements, and a
    /// vocabulary the kernels' `i32` slot maps can index.
    pub fn new(
        device: &Device,
        embed: Arc<DeviceBuffer<bf16>>,
        head: ServedHead,
        vocab: usize,
        hidden: usize,
    ) -> Result<ServedTables, OverlayError> {
        if i32::try_from(vocab).is_err() {
            return Err(OverlayError::VocabTooLarge { vocab });
        }
        let check = |table: &'static str, buf: &DeviceBuffer<bf16>| {
            if !buf.device().same_as(device) {
                return Err(OverlayError::DeviceMismatch {
                    table,
                    found: buf.device().name(),
                    expected: device.name(),
                });
            }
            if vocab.checked_mul(hidden) != Some(buf.len()) || hidden == 0 {
                return Err(OverlayError::TableSize {
                    table,
                    len: buf.len(),
                    vocab,
                    hidden,
                });
            }
            Ok(())
        };
        check("embed_tokens", &embed)?;
        if let ServedHead::Own(head) = &head {
            check("lm_head", head)?;
        }
        Ok(ServedTables {
            embed,
            head,
            vocab,
            hidden,
            vocab_start: 0,
            vocab_size: vocab,
        })
    }

    /// These tables as a vocab-parallel rank's: their `vocab` rows are the
    /// token ids `vocab_start .. vocab_start + vocab` of a vocabulary of
    /// `vocab_size` (which must hold them, and fit the kernels' `i32`).
    pub fn holding(mut self, vocab_start: usize, vocab_size: usize) -> Result<ServedTables, OverlayError> {
        if i32::try_from(vocab_size).is_err() {
            return Err(OverlayError::VocabTooLarge { vocab: vocab_size });
        }
        if vocab_start.checked_add(self.vocab).is_none_or(|end| end > vocab_size) {
            return Err(OverlayError::Argument {
                arg: "vocab_start",
                reason: format!(
                    "{} rows from id {vocab_start} are past the vocabulary of {vocab_size}",
                    self.vocab
                ),
            });
        }
        self.vocab_start = vocab_start;
        self.vocab_size = vocab_size;
        Ok(self)
    }

    /// Upload host base tables (as `lora_audit::read_base_tables` reads
    /// them) for a model: the head's own table when given, else the
    /// embedding when the model ties them.
    pub fn upload(device: &Device, base: &BaseTables, cfg: &ModelConfig) -> Result<ServedTables, OverlayError> {
        ServedTables::upload_at(device, base, cfg, Placement::SINGLE)
    }

    /// [`ServedTables::upload`] for `placement`: under the vocab-parallel
    /// cut only the rank's rows of each table
    /// ([`Placement::vocab_range`]; a vocabulary that does not divide is
    /// [`OverlayError::Placement`] naming `vocab_size`), else the whole
    /// tables. A tied head shares the embedding's rows, so it follows the
    /// same split.
    pub fn upload_at(
        device: &Device,
        base: &BaseTables,
        cfg: &ModelConfig,
        placement: Placement,
    ) -> Result<ServedTables, OverlayError> {
        let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
        let held = placement.vocab_range(vocab)?;
        let rows = |table: &'static str, t: &[bf16]| {
            if vocab.checked_mul(hidden) != Some(t.len()) || hidden == 0 {
                return Err(OverlayError::TableSize {
                    table,
                    len: t.len(),
                    vocab,
                    hidden,
                });
            }
            Ok(t[held.start * hidden..held.end * hidden].to_vec())
        };
        let embed = base
            .embed
            .as_deref()
            .ok_or(OverlayError::MissingTable { table: "embed_tokens" })?;
        let head = match (&base.lm_head, cfg.tie_word_embeddings) {
            (Some(head), _) => ServedHead::Own(Arc::new(device.upload(&rows("lm_head", head)?)?)),
            (None, true) => ServedHead::SharesEmbedding,
            (None, false) => return Err(OverlayError::MissingTable { table: "lm_head" }),
        };
        let embed = Arc::new(device.upload(&rows("embed_tokens", embed)?)?);
        ServedTables::new(device, embed, head, held.len(), hidden)?.holding(held.start, vocab)
    }

    /// The embedding table.
    pub fn embed(&self) -> &DeviceBuffer<bf16> {
        &self.embed
    }

    /// How the head is served.
    pub fn head(&self) -> &ServedHead {
        &self.head
    }

    /// The head's BF16 table: its own, or the embedding when tied; `None`
    /// when it is served quantized.
    pub fn head_table(&self) -> Option<&DeviceBuffer<bf16>> {
        match &self.head {
            ServedHead::SharesEmbedding => Some(&self.embed),
            ServedHead::Quantized => None,
            ServedHead::Own(head) => Some(head),
        }
    }

    /// Rows of the tables (the rank's block under the vocab-parallel cut).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The token ids whose rows the tables hold: `0..vocab_size` unless
    /// vocab-parallel. Row `i` is token `held().start + i`.
    pub fn held(&self) -> Range<usize> {
        self.vocab_start..self.vocab_start + self.vocab
    }

    /// The model's vocabulary (every rank's rows).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The table row of token `id`, or `None` for another rank's token.
    pub fn local_id(&self, id: u32) -> Option<u32> {
        let row = (id as usize).checked_sub(self.vocab_start)?;
        (row < self.vocab).then_some(row as u32)
    }

    /// Row width.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
}

#[cfg(test)]
mod tests;
