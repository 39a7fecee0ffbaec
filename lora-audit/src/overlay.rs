//! Token overlays on the host: which adapter tensors are token tables, the
//! trainable ids a slot serves, the rows it overrides, and the host
//! reference of the row diff and `slot_map` the overlay kernels reproduce.
//!
//! Two PEFT features replace token rows:
//! - trainable tokens (`…token_adapter.trainable_tokens_delta`, `[n_ids, h]`):
//!   ABSOLUTE rows for the ids of `trainable_token_indices`, in config order;
//! - `modules_to_save` tables (`…embed_tokens.weight`, `…lm_head.weight`,
//!   `[vocab, h]`): full copies; only the rows that differ from the served
//!   base in BF16 are overridden ([`ROWDIFF_THRESH`]).
//!
//! A trainable id wins over a differing table row ([`override_source`]).

use std::borrow::Cow;

use half::bf16;

use crate::error::{Refusal, RejectCode};

/// The token table an overlay tensor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OverlayModule {
    /// The input embedding (`embed_tokens`).
    Embed,
    /// The output head (`lm_head`).
    LmHead,
}

impl OverlayModule {
    /// `embed_tokens` or `lm_head`.
    pub fn name(self) -> &'static str {
        match self {
            OverlayModule::Embed => "embed_tokens",
            OverlayModule::LmHead => "lm_head",
        }
    }
}

/// The role an overlay tensor plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OverlayTensorKind {
    /// `…token_adapter.trainable_tokens_delta`: absolute rows `[n_ids, h]`.
    TrainableDelta,
    /// `…token_adapter.base_layer.weight`: the (resized) table the trainable
    /// tokens were trained on, `[vocab, h]`.
    TokenAdapterBase,
    /// `…embed_tokens.weight` / `…lm_head.weight`: a `modules_to_save` table.
    FullTable,
    /// `…lora_embedding_A` `[r, vocab]`: LoRA on the input embedding.
    LoraEmbeddingA,
    /// `…lora_embedding_B` `[hidden, r]`.
    LoraEmbeddingB,
    /// `…embed_tokens.base_layer.weight`: the table PEFT saves beside an
    /// embedding LoRA (`save_embedding_layers`) and loads back over the base
    /// table. Served as the table's full copy: its rows that differ from the
    /// served base override them, and the LoRA delta adds onto the result
    /// (PEFT's order: the wrapped layer's base lookup, then the delta).
    /// Also `…lm_head.base_layer.weight`, the head's table PEFT saves
    /// beside a LoRA on `lm_head` and loads back the same way: served as
    /// the head's own table, the pair's delta added onto its logits.
    EmbeddingBaseCopy,
}

/// A classified overlay tensor: its table and its role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OverlayTensor {
    /// The table.
    pub module: OverlayModule,
    /// The role.
    pub kind: OverlayTensorKind,
}

/// Classify a tensor name as an overlay tensor, or `None` (a LoRA pair key
/// for [`classify_key`](crate::classify_key), or something else). The
/// `base_model.model.` prefix is optional. Only the module name and the
/// suffix are matched, so `model.embed_tokens` and
/// `model.language_model.embed_tokens` both work. The `token_adapter` and
/// `lora_embedding` suffixes are tested before the bare `.weight` form, so
/// `…token_adapter.base_layer.weight` is never taken for a full table.
pub fn classify_overlay_key(key: &str) -> Option<OverlayTensor> {
    const SUFFIXES: [(&str, OverlayTensorKind); 6] = [
        (
            ".token_adapter.trainable_tokens_delta",
            OverlayTensorKind::TrainableDelta,
        ),
        (".token_adapter.base_layer.weight", OverlayTensorKind::TokenAdapterBase),
        (".lora_embedding_A", OverlayTensorKind::LoraEmbeddingA),
        (".lora_embedding_B", OverlayTensorKind::LoraEmbeddingB),
        (".base_layer.weight", OverlayTensorKind::EmbeddingBaseCopy),
        (".weight", OverlayTensorKind::FullTable),
    ];
    let path = key.strip_prefix("base_model.model.").unwrap_or(key);
    SUFFIXES.iter().find_map(|&(suffix, kind)| {
        let module_path = path.strip_suffix(suffix)?;
        let module = match module_path.rsplit('.').next()? {
            "embed_tokens" => OverlayModule::Embed,
            "lm_head" => OverlayModule::LmHead,
            _ => return None,
        };
        // PEFT only saves these forms for embeddings; on the head they would be
        // an embedding LoRA of a Linear, which PEFT never writes.
        let embedding_only = matches!(
            kind,
            OverlayTensorKind::LoraEmbeddingA | OverlayTensorKind::LoraEmbeddingB
        );
        (module == OverlayModule::Embed || !embedding_only).then_some(OverlayTensor { module, kind })
    })
}

/// One table's overlay tensor names; each role is set at most once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableTensors {
    /// `trainable_tokens_delta`.
    pub delta: Option<String>,
    /// `token_adapter.base_layer.weight`.
    pub token_base: Option<String>,
    /// The `modules_to_save` table, or the base copy saved beside an
    /// embedding LoRA.
    pub table: Option<String>,
    /// `lora_embedding_A`.
    pub lora_a: Option<String>,
    /// `lora_embedding_B`.
    pub lora_b: Option<String>,
}

impl TableTensors {
    /// The adapter's own full table, if any: the token-adapter base or a
    /// `modules_to_save` table (never both; see [`OverlayTensors::insert`]).
    pub fn base_table(&self) -> Option<&str> {
        self.token_base.as_deref().or(self.table.as_deref())
    }

    fn is_empty(&self) -> bool {
        self.delta.is_none()
            && self.token_base.is_none()
            && self.table.is_none()
            && self.lora_a.is_none()
            && self.lora_b.is_none()
    }
}

/// One adapter's overlay tensor names by (table, role).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlayTensors {
    /// The input embedding's tensors.
    pub embed: TableTensors,
    /// The output head's tensors.
    pub lm_head: TableTensors,
}

impl OverlayTensors {
    /// Record `key` in its role. A second tensor for a role, or both a
    /// token-adapter base and a `modules_to_save` table for one module, is
    /// `REJECT[duplicate-tensor]`.
    pub fn insert(&mut self, key: &str, tensor: OverlayTensor) -> Result<(), Refusal> {
        let table = match tensor.module {
            OverlayModule::Embed => &mut self.embed,
            OverlayModule::LmHead => &mut self.lm_head,
        };
        let slot = match tensor.kind {
            OverlayTensorKind::TrainableDelta => &mut table.delta,
            OverlayTensorKind::TokenAdapterBase => &mut table.token_base,
            OverlayTensorKind::FullTable | OverlayTensorKind::EmbeddingBaseCopy => &mut table.table,
            OverlayTensorKind::LoraEmbeddingA => &mut table.lora_a,
            OverlayTensorKind::LoraEmbeddingB => &mut table.lora_b,
        };
        if let Some(previous) = slot {
            return Err(Refusal::new(
                RejectCode::DuplicateTensor,
                key,
                format!(
                    "a second {:?} tensor for {} (first: `{previous}`)",
                    tensor.kind,
                    tensor.module.name()
                ),
            ));
        }
        *slot = Some(key.to_string());
        if table.token_base.is_some() && table.table.is_some() {
            return Err(Refusal::new(
                RejectCode::DuplicateTensor,
                key,
                format!(
                    "{} has both a token-adapter base and a modules_to_save table",
                    tensor.module.name()
                ),
            ));
        }
        Ok(())
    }

    /// One table's tensors.
    pub fn table(&self, module: OverlayModule) -> &TableTensors {
        match module {
            OverlayModule::Embed => &self.embed,
            OverlayModule::LmHead => &self.lm_head,
        }
    }

    /// Whether the adapter has no overlay tensor at all.
    pub fn is_empty(&self) -> bool {
        self.embed.is_empty() && self.lm_head.is_empty()
    }
}

/// A base row whose largest absolute difference from the adapter's table row
/// exceeds this is overridden. Zero: any BF16 element that differs counts,
/// so a served row equals PEFT's merged row exactly in BF16.
pub const ROWDIFF_THRESH: f32 = 0.0;

/// Host reference of `embed_rowdiff_bf16`: for each of the `base.len() / hidden`
/// rows, whether the adapter's row differs from the base row by more than
/// [`ROWDIFF_THRESH`] in some element. A NaN difference counts as differing.
/// Rows past the shorter table are reported as not differing; callers check
/// that both tables are `[vocab, hidden]`.
pub fn row_diff_bf16(base: &[bf16], adapter: &[bf16], hidden: usize) -> Vec<bool> {
    if hidden == 0 {
        return Vec::new();
    }
    base.chunks_exact(hidden)
        .zip(adapter.chunks_exact(hidden))
        .map(|(b, a)| b.iter().zip(a).any(|(x, y)| differs((x.to_f32() - y.to_f32()).abs())))
        .collect()
}

/// Whether an absolute difference exceeds [`ROWDIFF_THRESH`]; NaN does.
fn differs(abs_diff: f32) -> bool {
    use std::cmp::Ordering;
    !matches!(
        abs_diff.partial_cmp(&ROWDIFF_THRESH),
        Some(Ordering::Less | Ordering::Equal)
    )
}

/// Split trainable ids at the served vocabulary, keeping list order, since
/// delta row `k` belongs to the `k`-th id: `(kept ids, skipped count)`.
/// The rows of the kept ids are those for which [`id_in_vocab`] holds.
pub fn clamp_trainable_to_vocab(ids: &[u32], vocab: usize) -> (Vec<u32>, usize) {
    let kept: Vec<u32> = ids.iter().copied().filter(|&id| id_in_vocab(id, vocab)).collect();
    let skipped = ids.len() - kept.len();
    (kept, skipped)
}

/// Whether token `id` exists in a vocabulary of `vocab` rows.
pub fn id_in_vocab(id: u32, vocab: usize) -> bool {
    usize::try_from(id).is_ok_and(|i| i < vocab)
}

/// The vocab rows the overlay replaces: the indices `i` with `row_diff[i]`
/// set, plus `trainable`, sorted ascending without duplicates.
pub fn build_override_set(row_diff: &[bool], trainable: &[u32]) -> Vec<u32> {
    let mut ids: Vec<u32> = row_diff
        .iter()
        .enumerate()
        .filter(|(_, d)| **d)
        .filter_map(|(i, _)| u32::try_from(i).ok())
        .chain(trainable.iter().copied())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Where an overridden id's row comes from: `Some(k)`, delta row `k`, when
/// `id` is the `k`-th trainable id (this wins over a differing table row;
/// for a repeated id the last position wins, as PEFT's `index_copy` does on
/// the CPU — the audit refuses repeated ids anyway); `None`, the adapter's
/// table row `id`.
pub fn override_source(id: u32, trainable: &[u32]) -> Option<usize> {
    trainable.iter().rposition(|&t| t == id)
}

/// One table's overlay as the host holds it after the audit.
#[derive(Debug, Clone, PartialEq)]
pub struct TableOverlay {
    /// Trainable ids in config order, clamped to the served vocabulary.
    pub ids: Vec<u32>,
    /// Their ABSOLUTE rows, `[ids.len(), hidden]` BF16, row `k` for `ids[k]`.
    pub rows: Vec<bf16>,
    /// The adapter's full table (`modules_to_save`, or the token adapter's
    /// base), `[vocab, hidden]` BF16: rows that differ from the served base
    /// are overridden.
    pub table: Option<Vec<bf16>>,
}

/// How the output head is overlaid.
#[derive(Debug, Clone, PartialEq)]
pub enum LmHeadOverlay {
    /// Not overlaid: every logit comes from the base head.
    None,
    /// A tied head with trainable tokens on the embedding: PEFT ties the
    /// head's token adapter to the embedding's, so the embed overlay's
    /// trainable ids and rows (not its `modules_to_save` table) also
    /// override the head. The engine points the head's overlay at those rows.
    TiedTrainableRows,
    /// The head's own overlay: dict-form `lm_head` trainable tokens and/or a
    /// `modules_to_save` lm_head table (also on a tied model: PEFT's copy
    /// unties the head).
    Own(TableOverlay),
}

/// One adapter's token overlays, ready to stage.
#[derive(Debug, Clone, PartialEq)]
pub struct HostOverlay {
    /// Row width (`hidden_size`).
    pub hidden: usize,
    /// The embedding's overlay.
    pub embed: Option<TableOverlay>,
    /// The head's overlay.
    pub lm_head: LmHeadOverlay,
}

impl HostOverlay {
    /// An overlay that changes nothing.
    pub fn none(hidden: usize) -> HostOverlay {
        HostOverlay {
            hidden,
            embed: None,
            lm_head: LmHeadOverlay::None,
        }
    }

    /// Whether it changes any row.
    pub fn is_empty(&self) -> bool {
        self.embed.is_none() && self.lm_head == LmHeadOverlay::None
    }

    /// The head's overlay as a table overlay (the embed's trainable rows for
    /// a tied head), or `None`.
    pub fn lm_head_table(&self) -> Option<Cow<'_, TableOverlay>> {
        match &self.lm_head {
            LmHeadOverlay::None => None,
            LmHeadOverlay::Own(t) => Some(Cow::Borrowed(t)),
            LmHeadOverlay::TiedTrainableRows => self.embed.as_ref().map(|e| {
                Cow::Owned(TableOverlay {
                    ids: e.ids.clone(),
                    rows: e.rows.clone(),
                    table: None,
                })
            }),
        }
    }
}

/// A table overlay compiled against the served base table: the host
/// reference of what the overlay kernels stage per slot.
#[derive(Debug, Clone, PartialEq)]
pub struct CompiledOverlay {
    /// Overridden ids, ascending.
    pub ids: Vec<u32>,
    /// Their rows `[ids.len(), hidden]`, in `ids` order.
    pub rows: Vec<bf16>,
    /// `i32[vocab]`: the row index of an overridden id, else `-1`.
    pub slot_map: Vec<i32>,
}

/// Why an overlay cannot be compiled against a base table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverlayError {
    /// A table is not `[vocab, hidden]`.
    #[error("{what} has {len} elements, expected {vocab} x {hidden}")]
    TableSize {
        /// Which table.
        what: &'static str,
        /// Its element count.
        len: usize,
        /// Expected rows.
        vocab: usize,
        /// Expected row width.
        hidden: usize,
    },
    /// Trainable rows do not match the ids.
    #[error("{rows} trainable row elements for {ids} ids of width {hidden}")]
    RowCount {
        /// Row elements.
        rows: usize,
        /// Ids.
        ids: usize,
        /// Row width.
        hidden: usize,
    },
    /// A trainable id past the vocabulary (clamp first).
    #[error("trainable id {id} is outside the vocabulary of {vocab}")]
    IdOutOfVocab {
        /// The id.
        id: u32,
        /// The vocabulary.
        vocab: usize,
    },
    /// The vocabulary does not fit the `i32` slot map.
    #[error("vocabulary of {vocab} rows does not fit an i32 slot map")]
    VocabTooLarge {
        /// The vocabulary.
        vocab: usize,
    },
}

impl TableOverlay {
    /// Compile against the served base table `[vocab, hidden]`: row diff of
    /// the adapter's table, override set, compacted rows and `slot_map`.
    pub fn compile(&self, base: &[bf16], vocab: usize, hidden: usize) -> Result<CompiledOverlay, OverlayError> {
        let size = vocab.checked_mul(hidden);
        if size != Some(base.len()) {
            return Err(OverlayError::TableSize {
                what: "base table",
                len: base.len(),
                vocab,
                hidden,
            });
        }
        if i32::try_from(vocab).is_err() {
            return Err(OverlayError::VocabTooLarge { vocab });
        }
        if self.ids.len().checked_mul(hidden) != Some(self.rows.len()) {
            return Err(OverlayError::RowCount {
                rows: self.rows.len(),
                ids: self.ids.len(),
                hidden,
            });
        }
        if let Some(&id) = self.ids.iter().find(|&&id| !id_in_vocab(id, vocab)) {
            return Err(OverlayError::IdOutOfVocab { id, vocab });
        }
        let row_diff = match &self.table {
            Some(table) if table.len() != base.len() => {
                return Err(OverlayError::TableSize {
                    what: "adapter table",
                    len: table.len(),
                    vocab,
                    hidden,
                });
            }
            Some(table) => row_diff_bf16(base, table, hidden),
            None => Vec::new(),
        };
        let ids = build_override_set(&row_diff, &self.ids);
        let mut rows = Vec::with_capacity(ids.len() * hidden);
        let mut slot_map = vec![-1i32; vocab];
        for (n, &id) in ids.iter().enumerate() {
            let i = id as usize;
            let row = match (override_source(id, &self.ids), &self.table) {
                (Some(k), _) => &self.rows[k * hidden..(k + 1) * hidden],
                (None, Some(table)) => &table[i * hidden..(i + 1) * hidden],
                // Unreachable by construction: without a table only trainable ids are overridden.
                (None, None) => &base[i * hidden..(i + 1) * hidden],
            };
            rows.extend_from_slice(row);
            // `n < ids.len() <= vocab <= i32::MAX`, checked above.
            slot_map[i] = n as i32;
        }
        Ok(CompiledOverlay { ids, rows, slot_map })
    }
}

impl CompiledOverlay {
    /// The served row of `id`: its overlay row, or the base row.
    pub fn served_row<'a>(&'a self, id: usize, base: &'a [bf16], hidden: usize) -> Option<&'a [bf16]> {
        let slot = *self.slot_map.get(id)?;
        if slot >= 0 {
            let k = slot as usize;
            self.rows.get(k * hidden..(k + 1) * hidden)
        } else {
            base.get(id * hidden..(id + 1) * hidden)
        }
    }
}

#[cfg(test)]
mod tests;
