//! `lora-overlay`: per-slot token overlays, so that adapters trained with
//! new or retrained tokens (`trainable_token_indices`) or with full
//! `embed_tokens` / `lm_head` copies (`modules_to_save`) are served per
//! slot in a mixed batch, without a copy of the vocabulary per adapter.
//!
//! Brief overview:
//! - [`TokenOverlays`]: the overlays of a whole pool, built over the
//!   engine's [`ServedTables`] (embedding, and the head: tied, quantized or
//!   its own table). It is the pool's [`lora_pool::SlotCompanion`]: a load or
//!   swap stages the adapter's overlay (new buffers only; a failure, e.g.
//!   out of memory, changes nothing) and commits it with the pool's slot.
//! - Per slot ([`SlotOverlay`], built by [`build_overlay`]): the overridden
//!   ids — trainable ids clamped to the served vocabulary, plus the rows of
//!   a saved table that differ from the served row (the `row_diff` kernel,
//!   threshold [`lora_audit::ROWDIFF_THRESH`]) — their compacted rows
//!   `[n, hidden]` in ascending id order, and `slot_map` (`i32[vocab]`,
//!   row or -1). An untied head has rows of its own; a head whose overlay
//!   is the embedding's (a tied head with trainable tokens) points at the
//!   embedding rows.
//! - Apply calls, graph-capturable: [`TokenOverlays::embed`] (embedding
//!   lookup of a step's rows, each with its slot) and
//!   [`TokenOverlays::lm_head`] (the overridden ids' logits), both over the
//!   row map of the pool's current step
//!   ([`LoraPool::step_slots`](lora_pool::LoraPool::step_slots)), one row
//!   per kernel row of the step. Two fixed-address `[max_loras]` entry
//!   tables feed the kernels; swaps change their contents, never their
//!   addresses.
//! - [`probe_token_rows`]: `rows_idx::<table>` probes answered through the
//!   overlay kernels; [`probe_served_rows`]: the same through a pool, the
//!   embedding rows with the pool's LoRA on the input embedding added after
//!   the overlay (PEFT's order), for `cargo xtask probe`.
//!
//! A LoRA on the input embedding is not an overlay: it is a pair of the
//! pool's slots (`LoraPool::apply_embedding`), applied after the lookup.
//!
//! What it must never do: read an adapter file itself (the audit in
//! `lora-audit` does); change a live slot
//! while staging; allocate or synchronise inside an apply call; serve a row
//! that differs from PEFT's merged table without overriding it.
//!
//! ```
//! use std::sync::Arc;
//! use half::bf16;
//! use lora_audit::{HostOverlay, LmHeadOverlay as HostHead, OverlayModule, TableOverlay};
//! use lora_kernels::Device;
//! use lora_overlay::{ServedHead, ServedTables, TokenOverlays};
//!
//! let (vocab, hidden) = (8, 4);
//! let dev = Device::cpu();
//! let embed = Arc::new(dev.upload(&vec![bf16::ONE; vocab * hidden])?);
//! let tables = ServedTables::new(&dev, embed, ServedHead::SharesEmbedding, vocab, hidden)?;
//! let mut overlays = TokenOverlays::new(&dev, tables, 2)?;
//! // Trainable token 5 gets an absolute row of twos.
//! let host = HostOverlay {
//!     hidden,
//!     embed: Some(TableOverlay { ids: vec![5], rows: vec![bf16::from_f32(2.0); hidden], table: None }),
//!     lm_head: HostHead::TiedTrainableRows,
//! };
//! let staged = overlays.stage_overlay(&host)?;
//! overlays.install(1, staged)?;
//! let rows = overlays.served_rows(Some(1), OverlayModule::Embed, &[4, 5])?;
//! assert_eq!(rows[..hidden], [bf16::ONE; 4]);
//! assert_eq!(rows[hidden..], [bf16::from_f32(2.0); 4]);
//! let head = overlays.served_rows(Some(1), OverlayModule::LmHead, &[5])?;
//! assert_eq!(head, [bf16::from_f32(2.0); 4]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod compile;
mod error;
mod overlays;
mod probe;
mod served;
#[cfg(test)]
mod test_support;

pub use compile::{EmbedOverlay, HeadRows, OverrideRows, SlotOverlay, build_overlay};
pub use error::{COMPANION_NAME, OverlayError};
pub use overlays::TokenOverlays;
pub use probe::{probe_served_rows, probe_token_rows};
pub use served::{ServedHead, ServedTables};
