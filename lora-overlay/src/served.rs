//! The base token tables the engine serves, which overlays are diffed
//! against and fall back to. The engine owns them; overlays share them.

use std::sync::Arc;

use half::bf16;
use lora_audit::BaseTables;
use lora_kernels::{Device, DeviceBuffer};
use lora_layout::ModelConfig;

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
/// head, checked against the vocabulary and the width.
#[derive(Debug, Clone)]
pub struct ServedTables {
    embed: Arc<DeviceBuffer<bf16>>,
    head: ServedHead,
    vocab: usize,
    hidden: usize,
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
        })
    }

    /// Upload host base tables (as `lora_audit::read_base_tables` reads
    /// them) for a model: the head's own table when given, else the
    /// embedding when the model ties them.
    pub fn upload(device: &Device, base: &BaseTables, cfg: &ModelConfig) -> Result<ServedTables, OverlayError> {
        let embed = base
            .embed
            .as_deref()
            .ok_or(OverlayError::MissingTable { table: "embed_tokens" })?;
        let head = match (&base.lm_head, cfg.tie_word_embeddings) {
            (Some(head), _) => ServedHead::Own(Arc::new(device.upload(head)?)),
            (None, true) => ServedHead::SharesEmbedding,
            (None, false) => return Err(OverlayError::MissingTable { table: "lm_head" }),
        };
        let embed = Arc::new(device.upload(embed)?);
        ServedTables::new(device, embed, head, cfg.vocab_size, cfg.hidden_size)
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

    /// Rows of the tables.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Row width.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
}

#[cfg(test)]
mod tests;
