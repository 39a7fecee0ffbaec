//! From an audited adapter to host BF16 pairs and overlays, ready to pack.
//!
//! Both expert formats come out the same: one pair per (expert, Gate | Up |
//! Down) that the adapter adapts, plus the router. A transformers 5.x fused
//! `gate_up_proj` pair splits into a Gate pair (B rows `0..inter`) and an Up
//! pair (rows `inter..2·inter`) that share expert `e`'s A rows; expert `e`'s
//! B columns are the interleaved `k·E + e`.

use std::path::Path;

use half::bf16;
use lora_layout::{ExpertSite, LoraModule, ModelConfig};

use crate::audit::{ADAPTER_WEIGHTS, audit_with_config};
use rayon::prelude::*;

use crate::error::{AuditError, Refusal};
use crate::options::LoraOptions;
use crate::overlay::{HostOverlay, LmHeadOverlay, OverlayModule, TableOverlay, id_in_vocab};
use crate::peft_config::PeftAdapterConfig;
use crate::report::{AuditReport, ExpertSlice, LmHeadMode};
use crate::tensors::{AdapterTensors, HostTensor, LoadedSafetensors, first_non_finite, load_bf16, stored_value};

/// A dense pair on the host: `y += scale · B (A x)`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostPair {
    /// Global layer index.
    pub layer: usize,
    /// The projection.
    pub module: LoraModule,
    /// Rank.
    pub rank: usize,
    /// PEFT's scaling.
    pub scale: f32,
    /// A, `[rank, in]` row-major.
    pub a: Vec<bf16>,
    /// B, `[out, rank]` row-major.
    pub b: Vec<bf16>,
    /// DoRA: the magnitude `m [out]` as saved (f32, never rounded to BF16);
    /// `None` for a plain pair.
    pub magnitude: Option<Vec<f32>>,
}

/// An expert or router pair on the host: `y += scale · B (A x)`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostExpertPair {
    /// Global layer index.
    pub layer: usize,
    /// The routed expert's projection, or [`ExpertSite::Router`].
    pub site: ExpertSite,
    /// Rank (per expert).
    pub rank: usize,
    /// PEFT's scaling.
    pub scale: f32,
    /// A, `[rank, in]` row-major.
    pub a: Vec<bf16>,
    /// B, `[out, rank]` row-major.
    pub b: Vec<bf16>,
}

/// A LoRA on the input embedding on the host: the row of token `t` gains
/// `scale · B · A[:, t]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostEmbeddingPair {
    /// Rank.
    pub rank: usize,
    /// PEFT's scaling.
    pub scale: f32,
    /// A (`lora_embedding_A`), `[rank, vocab]` row-major.
    pub a: Vec<bf16>,
    /// B (`lora_embedding_B`), `[hidden, rank]` row-major.
    pub b: Vec<bf16>,
}

impl HostEmbeddingPair {
    /// The delta of token `t`'s row, `scale · B · A[:, t]` (`hidden` values,
    /// f32 accumulation), as the embedding kernels compute it; `None` for a
    /// token past A's columns.
    pub fn row_delta(&self, t: usize) -> Option<Vec<f32>> {
        let r = self.rank;
        if r == 0 || !self.a.len().is_multiple_of(r) {
            return None;
        }
        let vocab = self.a.len() / r;
        if t >= vocab {
            return None;
        }
        let col: Vec<f32> = (0..r).map(|k| self.a[k * vocab + t].to_f32()).collect();
        Some(
            self.b
                .chunks_exact(r)
                .map(|row| self.scale * row.iter().zip(&col).fold(0f32, |acc, (b, a)| acc + b.to_f32() * a))
                .collect(),
        )
    }
}

/// A LoRA on the output head on the host: the logits of a hidden row `h`
/// gain `scale · B · (A · h)`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostHeadPair {
    /// Rank.
    pub rank: usize,
    /// PEFT's scaling.
    pub scale: f32,
    /// A (`lm_head.lora_A`), `[rank, hidden]` row-major.
    pub a: Vec<bf16>,
    /// B (`lm_head.lora_B`), `[vocab, rank]` row-major.
    pub b: Vec<bf16>,
}

/// An audited adapter converted for packing.
#[derive(Debug, Clone)]
pub struct PreparedAdapter {
    /// The parsed config.
    pub config: PeftAdapterConfig,
    /// The audit that admitted it.
    pub report: AuditReport,
    /// Dense pairs, sorted by (layer, module).
    pub dense: Vec<HostPair>,
    /// Expert and router pairs, sorted by (layer, site).
    pub experts: Vec<HostExpertPair>,
    /// The LoRA on the input embedding, if any.
    pub embedding: Option<HostEmbeddingPair>,
    /// The LoRA on the output head, if any.
    pub lm_head: Option<HostHeadPair>,
    /// Token overlays.
    pub overlay: HostOverlay,
}

impl PreparedAdapter {
    /// The dense pair of (layer, module), if adapted.
    pub fn dense_pair(&self, layer: usize, module: LoraModule) -> Option<&HostPair> {
        self.dense
            .binary_search_by(|p| (p.layer, p.module).cmp(&(layer, module)))
            .ok()
            .map(|i| &self.dense[i])
    }

    /// The expert-pool pair of (layer, site), if adapted.
    pub fn expert_pair(&self, layer: usize, site: ExpertSite) -> Option<&HostExpertPair> {
        self.experts
            .binary_search_by(|p| (p.layer, p.site).cmp(&(layer, site)))
            .ok()
            .map(|i| &self.experts[i])
    }
}

/// Audit, load and convert the adapter in `dir`.
/// `Err(AuditError::Refused(report))` when it is not servable, including
/// when a served tensor holds a NaN or an infinity as served in BF16
/// (`REJECT[non-finite]`, the report then is [`audit_adapter`]'s).
///
/// [`audit_adapter`]: crate::audit_adapter
pub fn prepare_adapter(dir: &Path, cfg: &ModelConfig, opts: &LoraOptions) -> Result<PreparedAdapter, AuditError> {
    let (config, mut report, mapped) = audit_with_config(dir, cfg, opts)?;
    if !report.is_servable() {
        return Err(AuditError::Refused(Box::new(report)));
    }
    let needed = report.served_tensors();
    let mapped = match mapped {
        Some(m) => m,
        None => LoadedSafetensors::open(&dir.join(ADAPTER_WEIGHTS))?,
    };
    let tensors = load_bf16(&mapped, |name| needed.contains(name))?;
    // The values as served: what `audit_adapter` checks on the raw bytes,
    // checked here on the converted tensors (one pass, same verdicts).
    let non_finite: Vec<(&String, usize)> = tensors
        .par_iter()
        .filter_map(|(name, t)| first_non_finite(&t.data).map(|i| (name, i)))
        .collect();
    if !non_finite.is_empty() {
        for (name, index) in non_finite {
            report.refuse(Refusal::non_finite(name, index, stored_value(&mapped, name, index)?));
        }
        return Err(AuditError::Refused(Box::new(report)));
    }
    let dense = report
        .placed
        .iter()
        .map(|p| {
            Ok(HostPair {
                layer: p.layer,
                module: p.module,
                rank: p.rank,
                scale: p.scale,
                a: tensor(&tensors, &p.a_key)?.data.clone(),
                b: tensor(&tensors, &p.b_key)?.data.clone(),
                magnitude: p
                    .magnitude_key
                    .as_ref()
                    .map(|key| crate::tensors::load_f32(&mapped, key).map(|(_, data)| data))
                    .transpose()?,
            })
        })
        .collect::<Result<Vec<_>, AuditError>>()?;
    let experts = report
        .experts
        .iter()
        .map(|p| {
            let (a, b) = match &p.slice {
                ExpertSlice::Direct => (
                    tensor(&tensors, &p.a_key)?.data.clone(),
                    tensor(&tensors, &p.b_key)?.data.clone(),
                ),
                ExpertSlice::Fused { num_experts, .. } | ExpertSlice::FusedInterleaved { num_experts, .. } => {
                    let ExpertSite::Expert { expert, .. } = p.site else {
                        return Err(AuditError::Tensor {
                            name: p.a_key.clone(),
                            reason: "a fused slice must name an expert".into(),
                        });
                    };
                    split_fused_rows(
                        tensor(&tensors, &p.a_key)?,
                        tensor(&tensors, &p.b_key)?,
                        *num_experts,
                        expert,
                        &p.slice.out_rows(),
                    )?
                }
            };
            Ok(HostExpertPair {
                layer: p.layer,
                site: p.site,
                rank: p.rank,
                scale: p.scale,
                a,
                b,
            })
        })
        .collect::<Result<Vec<_>, AuditError>>()?;
    let embedding = report
        .embedding
        .as_ref()
        .map(|e| {
            Ok::<_, AuditError>(HostEmbeddingPair {
                rank: e.rank,
                scale: e.scale,
                a: tensor(&tensors, &e.a_key)?.data.clone(),
                b: tensor(&tensors, &e.b_key)?.data.clone(),
            })
        })
        .transpose()?;
    let lm_head = report
        .lm_head
        .as_ref()
        .map(|e| {
            Ok::<_, AuditError>(HostHeadPair {
                rank: e.rank,
                scale: e.scale,
                a: tensor(&tensors, &e.a_key)?.data.clone(),
                b: tensor(&tensors, &e.b_key)?.data.clone(),
            })
        })
        .transpose()?;
    let overlay = host_overlay(&report, &tensors, cfg)?;
    Ok(PreparedAdapter {
        config,
        report,
        dense,
        experts,
        embedding,
        lm_head,
        overlay,
    })
}

fn tensor<'t>(tensors: &'t AdapterTensors, name: &str) -> Result<&'t HostTensor, AuditError> {
    tensors.get(name).ok_or_else(|| AuditError::Tensor {
        name: name.to_string(),
        reason: "audited but absent from the weights file".into(),
    })
}

/// Expert `expert`'s A `[r, in]` and B `[out_rows.len(), r]` from a fused
/// pair: A rows `e·r..(e+1)·r`, B columns `k·E + e` of rows `out_rows`.
pub fn split_fused(
    a: &HostTensor,
    b: &HostTensor,
    num_experts: usize,
    expert: usize,
    out_rows: std::ops::Range<usize>,
) -> Result<(Vec<bf16>, Vec<bf16>), AuditError> {
    split_fused_rows(a, b, num_experts, expert, &out_rows.collect::<Vec<_>>())
}

/// [`split_fused`] for B rows `out_rows` in any order (gpt_oss's
/// interleaved gate and up rows).
fn split_fused_rows(
    a: &HostTensor,
    b: &HostTensor,
    num_experts: usize,
    expert: usize,
    out_rows: &[usize],
) -> Result<(Vec<bf16>, Vec<bf16>), AuditError> {
    let bad = |reason: String| AuditError::Tensor {
        name: "fused experts pair".into(),
        reason,
    };
    let (&[a_rows, a_in], &[b_out, b_cols]) = (&a.shape[..], &b.shape[..]) else {
        return Err(bad(format!("shapes {:?} / {:?} are not matrices", a.shape, b.shape)));
    };
    if num_experts == 0
        || a_rows % num_experts != 0
        || a_rows != b_cols
        || expert >= num_experts
        || out_rows.iter().any(|&o| o >= b_out)
    {
        return Err(bad(format!(
            "cannot cut expert {expert} of {num_experts}, rows {out_rows:?} from A {:?} / B {:?}",
            a.shape, b.shape
        )));
    }
    if a_rows.checked_mul(a_in) != Some(a.data.len()) || b_out.checked_mul(b_cols) != Some(b.data.len()) {
        return Err(bad(format!(
            "{} / {} elements for shapes {:?} / {:?}",
            a.data.len(),
            b.data.len(),
            a.shape,
            b.shape
        )));
    }
    let r = a_rows / num_experts;
    let a_e = a.data[expert * r * a_in..(expert + 1) * r * a_in].to_vec();
    let mut b_e = Vec::with_capacity(out_rows.len() * r);
    for &o in out_rows {
        let row = &b.data[o * b_cols..(o + 1) * b_cols];
        b_e.extend((0..r).map(|k| row[k * num_experts + expert]));
    }
    Ok((a_e, b_e))
}

/// The host overlay of an audited adapter: trainable rows clamped to the
/// vocabulary (a skipped id's row is dropped with it), full tables as BF16.
fn host_overlay(report: &AuditReport, tensors: &AdapterTensors, cfg: &ModelConfig) -> Result<HostOverlay, AuditError> {
    let hidden = cfg.hidden_size;
    let table_overlay = |module: OverlayModule| -> Result<Option<TableOverlay>, AuditError> {
        let names = report.overlay.tensors.table(module);
        let ids = report.overlay.ids(module);
        let (kept_ids, rows) = match &names.delta {
            Some(key) => {
                let delta = tensor(tensors, key)?;
                let mut kept = Vec::new();
                let mut rows = Vec::new();
                for (k, &id) in ids.iter().enumerate() {
                    if id_in_vocab(id, cfg.vocab_size) {
                        kept.push(id);
                        rows.extend_from_slice(delta.data.get(k * hidden..(k + 1) * hidden).ok_or_else(|| {
                            AuditError::Tensor {
                                name: key.clone(),
                                reason: format!("no row {k} for id {id}"),
                            }
                        })?);
                    }
                }
                (kept, rows)
            }
            None => (Vec::new(), Vec::new()),
        };
        let table = names
            .base_table()
            .map(|key| tensor(tensors, key).map(|t| t.data.clone()))
            .transpose()?;
        Ok((!kept_ids.is_empty() || table.is_some()).then_some(TableOverlay {
            ids: kept_ids,
            rows,
            table,
        }))
    };
    let embed = table_overlay(OverlayModule::Embed)?;
    let lm_head = match report.overlay.lm_head {
        LmHeadMode::None => LmHeadOverlay::None,
        LmHeadMode::TiedTrainableRows if embed.is_some() => LmHeadOverlay::TiedTrainableRows,
        LmHeadMode::TiedTrainableRows => LmHeadOverlay::None,
        LmHeadMode::Own => table_overlay(OverlayModule::LmHead)?.map_or(LmHeadOverlay::None, LmHeadOverlay::Own),
    };
    Ok(HostOverlay { hidden, embed, lm_head })
}

#[cfg(test)]
mod tests;
