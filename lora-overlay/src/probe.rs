//! `rows_idx::<table>` probes answered through the serving path: the
//! overlay kernels on the pool's device, not the host math.
//!
//! - Embedding rows: the embedding lookup kernel on the probed ids, every
//!   row in the probed slot; through a pool ([`probe_served_rows`]), then the
//!   pool's embedding LoRA (`LoraPool::apply_embedding`) onto them on decode
//!   steps of the adapter's lease (PEFT's order: lookup, then delta).
//! - lm_head rows: a head row is only ever seen through the logits it
//!   produces, so the probe recovers it from logits. With one-hot hidden
//!   vectors `e_j`, the served logit of id `v` is `W[v, j]`: the base part
//!   is the base head's GEMM on `e_j` (column `j` of the base table,
//!   exact), then the lm_head overlay kernel overwrites the overridden ids
//!   with `dot(e_j, row) = row[j]` (exact in FP32). Column `j` of the
//!   logits is thus row `v`'s element `j` as served; `hidden` one-hot rows
//!   give whole rows, in chunks to bound memory.

use std::collections::BTreeMap;

use half::bf16;
use lora_audit::{OverlayModule, ProbeTensor, ROWS_IDX, ROWS_MERGED, WeightRef, parse_weight_name};
use lora_kernels::{DeviceBuffer, Rows, RowsMut};
use lora_layout::ModelConfig;
use lora_pool::{LoraPool, SlotLease, StepRow};

use crate::error::OverlayError;
use crate::overlays::TokenOverlays;

/// One-hot hidden rows per lm_head probe launch: bounds the probe's logits
/// buffer to `PROBE_CHUNK x vocab` f32.
const PROBE_CHUNK: usize = 64;

impl TokenOverlays {
    /// The rows of `module` that `slot` (`None`: the base model) serves for
    /// `ids`, `[ids.len(), hidden]`, read back through the overlay kernels.
    /// Over a vocab-parallel rank's tables, the row of another rank's token
    /// is zeros (the ranks' answers sum to the whole). Synchronises; not an
    /// apply call.
    pub fn served_rows(
        &self,
        slot: Option<usize>,
        module: OverlayModule,
        ids: &[u32],
    ) -> Result<Vec<bf16>, OverlayError> {
        let row_slot = match slot {
            Some(s) if s < self.max_loras() => i32::try_from(s).map_err(|_| OverlayError::NoSuchSlot {
                slot: s,
                max_loras: self.max_loras(),
            })?,
            Some(s) => {
                return Err(OverlayError::NoSuchSlot {
                    slot: s,
                    max_loras: self.max_loras(),
                });
            }
            None => -1,
        };
        let vocab = self.tables().vocab_size();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(OverlayError::Argument {
                arg: "ids",
                reason: format!("id {id} is outside the vocabulary of {vocab}"),
            });
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = match module {
            OverlayModule::Embed => self.probe_embed(row_slot, ids)?,
            OverlayModule::LmHead => self.probe_head(row_slot, ids)?,
        };
        self.device().check_faults()?;
        Ok(rows)
    }

    fn probe_embed(&self, row_slot: i32, ids: &[u32]) -> Result<Vec<bf16>, OverlayError> {
        let device = self.device();
        let (n, hidden) = (ids.len(), self.tables().hidden());
        let ids_dev = device.upload(ids)?;
        let slots = device.upload(&vec![row_slot; n])?;
        let mut out = device.alloc_zeros::<bf16>(rows_len(n, hidden)?)?;
        self.embed_rows(&ids_dev, Some(&slots), RowsMut::dense(&mut out, n, hidden))?;
        Ok(out.download()?)
    }

    fn probe_head(&self, row_slot: i32, all_ids: &[u32]) -> Result<Vec<bf16>, OverlayError> {
        // This rank's rows, by their table index; other ranks' stay zeros.
        let (ids, at): (Vec<u32>, Vec<usize>) = all_ids
            .iter()
            .enumerate()
            .filter_map(|(k, &id)| Some((self.tables().local_id(id)?, k)))
            .unzip();
        let hidden = self.tables().hidden();
        let mut all = vec![bf16::ZERO; rows_len(all_ids.len(), hidden)?];
        if ids.is_empty() {
            return Ok(all);
        }
        let local = self.probe_local_head(row_slot, &ids)?;
        for (i, &k) in at.iter().enumerate() {
            all[k * hidden..(k + 1) * hidden].copy_from_slice(&local[i * hidden..(i + 1) * hidden]);
        }
        Ok(all)
    }

    /// [`TokenOverlays::probe_head`] of table rows `ids` (all held).
    fn probe_local_head(&self, row_slot: i32, ids: &[u32]) -> Result<Vec<bf16>, OverlayError> {
        let device = self.device();
        let (vocab, hidden) = (self.tables().vocab(), self.tables().hidden());
        let base = self.tables().head_table().ok_or_else(|| OverlayError::QuantizedHead {
            what: format!("{ROWS_IDX}lm_head"),
            purpose: "read the base logits from",
        })?;
        let base_rows = ids
            .iter()
            .map(|&id| base.download_range(id as usize * hidden, hidden))
            .collect::<Result<Vec<_>, _>>()?;
        let chunk = hidden.min(PROBE_CHUNK);
        let mut one_hot: DeviceBuffer<bf16> = device.alloc_zeros(chunk * hidden)?;
        let mut logits: DeviceBuffer<f32> = device.alloc_zeros(chunk * vocab)?;
        let slots = device.upload(&vec![row_slot; chunk])?;
        let mut served = vec![bf16::ZERO; rows_len(ids.len(), hidden)?];
        for j0 in (0..hidden).step_by(chunk) {
            let c = chunk.min(hidden - j0);
            let mut e = vec![bf16::ZERO; c * hidden];
            let mut base_logits = vec![0f32; c * vocab];
            for r in 0..c {
                e[r * hidden + j0 + r] = bf16::ONE;
                for (&id, row) in ids.iter().zip(&base_rows) {
                    base_logits[r * vocab + id as usize] = row[j0 + r].to_f32();
                }
            }
            one_hot.write(0, &e)?;
            logits.write(0, &base_logits)?;
            self.lm_head_rows(
                Rows::dense(&one_hot, c, hidden),
                &slots,
                RowsMut::dense(&mut logits, c, vocab),
            )?;
            let out = logits.download_range(0, c * vocab)?;
            for r in 0..c {
                for (k, &id) in ids.iter().enumerate() {
                    served[k * hidden + j0 + r] = bf16::from_f32(out[r * vocab + id as usize]);
                }
            }
        }
        Ok(served)
    }
}

/// Elements of `n` rows of `hidden`, or an error when they cannot exist.
fn rows_len(n: usize, hidden: usize) -> Result<usize, OverlayError> {
    n.checked_mul(hidden).ok_or(OverlayError::Argument {
        arg: "ids",
        reason: format!("{n} rows of {hidden} overflow"),
    })
}

/// Answer `rows_idx::<table>` probes (table name -> token ids, as in
/// [`lora_audit::ProbeInputs::rows`]) for `slot` (`None`: the base model)
/// through the overlay kernels: `rows_merged::<table>` tensors `[ids, hidden]`.
pub fn probe_token_rows(
    overlays: &TokenOverlays,
    slot: Option<usize>,
    cfg: &ModelConfig,
    rows: &BTreeMap<String, Vec<i64>>,
) -> Result<BTreeMap<String, ProbeTensor>, OverlayError> {
    let hidden = overlays.tables().hidden();
    let mut out = BTreeMap::new();
    for (table, ids) in rows {
        let bad = |reason: String| OverlayError::Probe {
            name: format!("{ROWS_IDX}{table}"),
            reason,
        };
        let module = match parse_weight_name(table, cfg) {
            Ok(WeightRef::Table(m)) => m,
            Ok(_) => return Err(bad("rows can only be asked of embed_tokens or lm_head".into())),
            Err(e) => return Err(bad(e.to_string())),
        };
        let ids = ids
            .iter()
            .map(|&id| u32::try_from(id).map_err(|_| bad(format!("id {id} is not a token id"))))
            .collect::<Result<Vec<u32>, _>>()?;
        let served = overlays.served_rows(slot, module, &ids)?;
        out.insert(
            format!("{ROWS_MERGED}{table}"),
            ProbeTensor {
                shape: vec![ids.len(), hidden],
                data: served.iter().map(|v| v.to_f32()).collect(),
            },
        );
    }
    Ok(out)
}

/// [`probe_token_rows`] for the adapter `lease` holds in `pool`, with the
/// embedding rows as the pool serves them: the overlay lookup (BF16), then
/// the adapter's LoRA on the input embedding added in f32 by
/// [`LoraPool::apply_embedding`], on decode steps of at most the pool's
/// batch capacity. Synchronises; builds steps (not an apply call).
pub fn probe_served_rows(
    pool: &mut LoraPool<TokenOverlays>,
    lease: &SlotLease,
    rows: &BTreeMap<String, Vec<i64>>,
) -> Result<BTreeMap<String, ProbeTensor>, OverlayError> {
    let cfg = pool.config().clone();
    let slot = lease.slot().index();
    let mut out = probe_token_rows(pool.companion(), Some(slot), &cfg, rows)?;
    let hidden = cfg.hidden_size;
    let chunk = pool.capacity().max_rows.max(1);
    let device = pool.device().clone();
    for (table, ids) in rows {
        if !matches!(
            parse_weight_name(table, &cfg),
            Ok(WeightRef::Table(OverlayModule::Embed))
        ) {
            continue;
        }
        let Some(served) = out.get_mut(&format!("{ROWS_MERGED}{table}")) else {
            continue;
        };
        // The ids were checked against the vocabulary by the overlay probe.
        let ids: Vec<u32> = ids.iter().map(|&id| id as u32).collect();
        for (c, part) in ids.chunks(chunk).enumerate() {
            let n = part.len();
            let span = c * chunk * hidden..(c * chunk + n) * hidden;
            let step = pool
                .decode_step(&vec![StepRow::Adapter(lease); n], n)
                .map_err(|e| OverlayError::Pool(Box::new(e)))?;
            let ids_dev = device.upload(part)?;
            let mut y = device.upload(&served.data[span.clone()])?;
            pool.apply_embedding(&step, &ids_dev, RowsMut::dense(&mut y, n, hidden))
                .map_err(|e| OverlayError::Pool(Box::new(e)))?;
            device.check_faults()?;
            served.data[span].copy_from_slice(&y.download()?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
