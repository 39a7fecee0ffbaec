//! DoRA serving state: the engine's base weights ([`BaseWeights`]) and,
//! beside the slots, each slot's per-output-row rescale `g = m / ‖W + s·B A‖`
//! (PEFT's `mag_norm_scale`, [`lora_audit::dora`]) with the `[max_loras]`
//! table of `g` addresses per (layer, module) and the base biases kept
//! outside the rescale: every apply call's targets carry them
//! ([`lora_kernels::DoraEpilogue`]), and the expand rescales the rows of
//! DoRA slots in its epilogue, so a mixed batch stays one launch.
//!
//! Allocated only for a pool built with [`LoraOptions::dora`]
//! (`LORA_DORA=1`); a plain pool holds none of it and its targets carry no
//! epilogue.
//! Buffers are allocated once and never move (graphs stay valid): `g` is
//! `[max_loras, total_out]` f32 (`total_out` the sum of every adapted
//! projection's output width over the slot layout walk), the biases
//! `[total_out]` f32 (zeros where a projection has none), the table
//! `[layers · modules · max_loras]` u64 (0: no DoRA pair).
//!
//! `g` is computed when an adapter is staged (phase one, fallible: a missing
//! or misshapen base weight, a zero row norm) by every route (disk swap,
//! host tier, peer landing: the latter two carry the magnitudes,
//! [`DoraMagnitudes`], and put their packed image in the staging slot
//! first), on the pool's device
//! ([`lora_kernels::dora_row_scale`]) from the pair's A and B as packed in
//! the staging slot, the base weight (the engine's device copy when it
//! gives one, else an upload of its host weight) and the magnitude; read
//! back, checked finite, and written at publish after the slot was marked
//! unservable, like the slot's pairs. The staging slot is filled on the
//! device's copy lane and these kernels run on the compute lane: the pool
//! makes the compute lane wait for the copies before them, and the copy
//! lane wait for them before any later staging copy (`LoraPool::stage`);
//! the publish writes (`finish_publish`, on the compute lane) come after
//! the compute lane waited for the slot's bytes.
//!
//! Never built for a placed pool (tensor or expert world above 1,
//! `PoolError::DoraPlaced`): the norm spans every input column of a row,
//! which a row-parallel rank does not hold.
//!
//! What it must never do: read the base weights during an apply (only at
//! staging), hold a `g` for a slot whose table entries say otherwise after
//! a publish or eviction.

use std::sync::Arc;

use half::bf16;
use lora_audit::dora::BaseProjection;
use lora_audit::{AuditError, AuditReport, LoraOptions, PreparedAdapter, Refusal, RejectCode};
use lora_kernels::{Device, DeviceBuffer, DoraEpilogue, DoraNorm, PairEntry, dora_row_scale};
use lora_layout::{LoraModule, ModelConfig, SlotLayout};

use crate::error::PoolError;
use crate::pool::module_table_offset;

/// The base model's projection weights, as the engine holds them: what a
/// DoRA adapter's rescale needs. The engine passes it to the pool once
/// ([`crate::LoraPool::set_base_weights`]), before loading or swapping a
/// DoRA adapter; the pool reads it when it stages one and never during an
/// apply.
pub trait BaseWeights: Send + Sync {
    /// The weight `[out, in]` (row-major, f32) and bias of `module` in
    /// `layer`; `None` where the engine holds no such projection (a DoRA
    /// pair there is refused, `REJECT[dora-needs-base-weights]`).
    fn projection(&self, layer: usize, module: LoraModule) -> Option<BaseProjection<'_>>;

    /// The same weight where it already lives on the pool's device, if it
    /// does (an engine whose projections run there); the rescale is then
    /// computed from it without an upload. `None` (the default): the pool
    /// uploads [`BaseWeights::projection`]'s weight while staging.
    fn device_projection(&self, _layer: usize, _module: LoraModule) -> Option<DeviceProjection<'_>> {
        None
    }
}

/// A base weight `[out, in]` (f32, row-major) on the pool's device, from
/// element `offset` of `weight`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceProjection<'a> {
    /// The buffer.
    pub weight: &'a DeviceBuffer<f32>,
    /// First element of the projection's weight.
    pub offset: usize,
}

/// One DoRA pair as the rescale's staging reads it: its place, rank and
/// scale, and its magnitude `m` (f32 `[out]`, as saved).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DoraInput<'a> {
    pub(crate) layer: usize,
    pub(crate) module: LoraModule,
    pub(crate) rank: usize,
    pub(crate) scale: f32,
    pub(crate) magnitude: &'a [f32],
}

impl<'a> DoraInput<'a> {
    /// The DoRA pairs of a prepared adapter.
    pub(crate) fn of_prepared(adapter: &'a PreparedAdapter) -> impl Iterator<Item = DoraInput<'a>> {
        adapter.dense.iter().filter_map(|p| {
            Some(DoraInput {
                layer: p.layer,
                module: p.module,
                rank: p.rank,
                scale: p.scale,
                magnitude: p.magnitude.as_deref()?,
            })
        })
    }
}

/// A DoRA adapter's magnitude vectors as a route other than a disk swap
/// carries them to the pool (the host tier keeps them beside its image, a
/// peer landing lands them beside the pairs): the pool computes each
/// pair's rescale from them, the pairs and its own base weights when it
/// stages the adapter, exactly as a disk swap does.
#[derive(Debug, Clone, PartialEq)]
pub struct DoraMagnitudes {
    /// The audit that admitted the adapter: refusals (a missing base
    /// weight, a zero row norm) name its tensors.
    pub report: AuditReport,
    /// One entry per DoRA pair, in the report's (layer, module) order.
    pub pairs: Vec<DoraMagnitude>,
}

/// One DoRA pair's magnitude `m` (f32 `[out]`).
#[derive(Debug, Clone, PartialEq)]
pub struct DoraMagnitude {
    /// The layer.
    pub layer: usize,
    /// The projection.
    pub module: LoraModule,
    /// `m`, one value per output row of the whole projection.
    pub magnitude: Vec<f32>,
}

impl DoraMagnitudes {
    /// The magnitudes of a prepared adapter's DoRA pairs (`None` for a
    /// plain adapter).
    pub fn of_prepared(adapter: &PreparedAdapter) -> Option<DoraMagnitudes> {
        let pairs: Vec<DoraMagnitude> = DoraInput::of_prepared(adapter)
            .map(|p| DoraMagnitude {
                layer: p.layer,
                module: p.module,
                magnitude: p.magnitude.to_vec(),
            })
            .collect();
        (!pairs.is_empty()).then(|| DoraMagnitudes {
            report: adapter.report.clone(),
            pairs,
        })
    }

    /// The staging inputs: rank and scale of each pair from the report.
    /// A magnitude whose pair the report does not place is
    /// [`PoolError::NoSuchModule`].
    pub(crate) fn inputs(&self) -> Result<Vec<DoraInput<'_>>, PoolError> {
        self.pairs
            .iter()
            .map(|m| {
                let placed = self
                    .report
                    .placed
                    .iter()
                    .find(|p| (p.layer, p.module) == (m.layer, m.module) && p.magnitude_key.is_some())
                    .ok_or(PoolError::NoSuchModule {
                        layer: m.layer,
                        module: m.module,
                    })?;
                Ok(DoraInput {
                    layer: m.layer,
                    module: m.module,
                    rank: placed.rank,
                    scale: placed.scale,
                    magnitude: &m.magnitude,
                })
            })
            .collect()
    }
}

/// One DoRA pair's staged rescale.
#[derive(Debug, Clone)]
pub(crate) struct StagedScale {
    pub(crate) layer: usize,
    pub(crate) module: LoraModule,
    pub(crate) g: Vec<f32>,
}

/// The DoRA state of a pool built for it.
pub(crate) struct DoraState {
    max_loras: usize,
    total_out: usize,
    /// Per slot-layout entry: its first row in a slot's `g` and in the biases.
    row_offsets: Vec<usize>,
    g: DeviceBuffer<f32>,
    bias: DeviceBuffer<f32>,
    table: DeviceBuffer<u64>,
    host_table: Vec<u64>,
    base: Option<Arc<dyn BaseWeights>>,
}

/// Device bytes the DoRA state of `layout` takes (0 unless `opts.dora`).
pub(crate) fn dora_bytes(cfg: &ModelConfig, layout: &SlotLayout, opts: &LoraOptions) -> Option<usize> {
    if !opts.dora {
        return Some(0);
    }
    let total_out = layout.entries().iter().map(|e| e.out_dim).sum::<usize>();
    let g = total_out
        .checked_mul(opts.max_loras)?
        .checked_add(total_out)?
        .checked_mul(4)?;
    let table = cfg
        .num_hidden_layers
        .checked_mul(LoraModule::ALL.len())?
        .checked_mul(opts.max_loras)?
        .checked_mul(8)?;
    g.checked_add(table)
}

impl DoraState {
    pub(crate) fn new(
        device: &Device,
        cfg: &ModelConfig,
        layout: &SlotLayout,
        max_loras: usize,
    ) -> Result<DoraState, PoolError> {
        let mut row_offsets = Vec::with_capacity(layout.entries().len());
        let mut total_out = 0usize;
        for e in layout.entries() {
            row_offsets.push(total_out);
            total_out = total_out.checked_add(e.out_dim).ok_or(overflow())?;
        }
        let table_len = cfg
            .num_hidden_layers
            .checked_mul(LoraModule::ALL.len())
            .and_then(|n| n.checked_mul(max_loras))
            .ok_or(overflow())?;
        let g_len = total_out.checked_mul(max_loras).ok_or(overflow())?;
        Ok(DoraState {
            max_loras,
            total_out,
            row_offsets,
            g: device.alloc_zeros(g_len.max(1))?,
            bias: device.alloc_zeros(total_out.max(1))?,
            table: device.alloc_zeros(table_len.max(1))?,
            host_table: vec![0; table_len],
            base: None,
        })
    }

    /// Take the engine's base weights: check every projection it gives
    /// against the layout and upload the biases. On an error nothing
    /// changed.
    pub(crate) fn set_base(&mut self, layout: &SlotLayout, base: Arc<dyn BaseWeights>) -> Result<(), PoolError> {
        let dora_slots = (0..self.max_loras).filter(|&s| self.pairs(s) > 0).count();
        if dora_slots > 0 {
            return Err(PoolError::BaseWeightsInUse { dora_slots });
        }
        let mut bias = vec![0f32; self.total_out];
        for (e, &row) in layout.entries().iter().zip(&self.row_offsets) {
            let Some(p) = base.projection(e.layer, e.module) else {
                continue;
            };
            let bad = |what: &'static str, got: usize, expected: usize| PoolError::BaseWeights {
                layer: e.layer,
                module: e.module,
                reason: format!("{what} has {got} values; the projection needs {expected}"),
            };
            if Some(p.weight.len()) != e.out_dim.checked_mul(e.in_dim) {
                return Err(bad("the weight", p.weight.len(), e.out_dim * e.in_dim));
            }
            if let Some(b) = p.bias {
                if b.len() != e.out_dim {
                    return Err(bad("the bias", b.len(), e.out_dim));
                }
                bias[row..row + e.out_dim].copy_from_slice(b);
            }
        }
        self.bias.write(0, &bias)?;
        self.base = Some(base);
        Ok(())
    }

    /// Phase one, after the adapter was packed into the staging slot
    /// (`staging`): the rescale of every DoRA pair of `adapter`, computed
    /// on the device from the packed pairs. Refused
    /// (`REJECT[dora-needs-base-weights]`, naming the magnitude) without the
    /// base weight of a DoRA pair's projection; `REJECT[non-finite]` where
    /// a row's rescale is not finite (a zero norm). Writes only buffers it
    /// allocates here.
    pub(crate) fn stage<'m>(
        &self,
        name: &str,
        device: &Device,
        layout: &SlotLayout,
        staging: &DeviceBuffer<bf16>,
        report: &AuditReport,
        pairs: impl IntoIterator<Item = DoraInput<'m>>,
    ) -> Result<Vec<StagedScale>, PoolError> {
        let refuse = |key: String, code, reason: String| {
            let mut report = report.clone();
            report.refuse(Refusal::new(code, key, reason));
            PoolError::Audit {
                adapter: name.to_string(),
                source: Box::new(AuditError::Refused(Box::new(report))),
            }
        };
        let mut out = Vec::new();
        let mut uploads = Vec::new();
        for pair in pairs {
            let m = pair.magnitude;
            let key = magnitude_key(report, pair.layer, pair.module);
            let entry = layout.entry(pair.layer, pair.module).ok_or(PoolError::NoSuchModule {
                layer: pair.layer,
                module: pair.module,
            })?;
            if m.len() != entry.out_dim {
                return Err(refuse(
                    key,
                    RejectCode::Shape,
                    format!(
                        "the magnitude has {} values; the projection has {} output rows",
                        m.len(),
                        entry.out_dim
                    ),
                ));
            }
            let base = self.base.as_ref();
            let on_device = base.and_then(|b| b.device_projection(pair.layer, pair.module));
            let host = base.and_then(|b| b.projection(pair.layer, pair.module));
            let no_base = || {
                refuse(
                    key.clone(),
                    RejectCode::DoraNeedsBaseWeights,
                    format!(
                        "the pool was given no base weight of layer {} {}; DoRA's rescale needs it",
                        pair.layer, pair.module
                    ),
                )
            };
            let uploaded = match (on_device, host) {
                (Some(_), _) => None,
                (None, Some(p)) => Some(device.upload(p.weight)?),
                (None, None) => return Err(no_base()),
            };
            let (weight, weight_offset) = match (&uploaded, on_device) {
                (Some(w), _) => (w, 0),
                (None, Some(d)) => (d.weight, d.offset),
                (None, None) => return Err(no_base()),
            };
            let magnitude = device.upload(m)?;
            let mut g = device.alloc_zeros::<f32>(entry.out_dim.max(1))?;
            let args = DoraNorm {
                weight,
                weight_offset,
                pair: PairEntry {
                    a: staging.addr_at(entry.a_offset / 2)?,
                    b: staging.addr_at(entry.b_offset / 2)?,
                    scale: pair.scale,
                    rank: pair.rank as u32,
                },
                stride: layout.max_rank(),
                magnitude: &magnitude,
                magnitude_offset: 0,
                out_dim: entry.out_dim,
                in_dim: entry.in_dim,
            };
            dora_row_scale(device, &args, &mut g, 0)?;
            uploads.push((key, pair.layer, pair.module, g, uploaded, magnitude));
        }
        for (key, layer, module, g, _weight, _magnitude) in uploads {
            // The read waits for the kernels; the inputs live until then.
            let values = g.download()?;
            if let Some((row, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(refuse(
                    key,
                    RejectCode::NonFinite,
                    format!("DoRA rescale of row {row} is {v}: its row norm ‖W + s·B A‖ is zero or not finite"),
                ));
            }
            out.push(StagedScale {
                layer,
                module,
                g: values,
            });
        }
        Ok(out)
    }

    /// Phase two, after the slot was marked unservable: write `slot`'s
    /// rescales and its table entries (0 for every pair not in `scales`).
    pub(crate) fn publish(
        &mut self,
        layout: &SlotLayout,
        slot: usize,
        scales: &[StagedScale],
    ) -> Result<(), PoolError> {
        let mut table = self.host_table.clone();
        for entry in table.iter_mut().skip(slot).step_by(self.max_loras.max(1)) {
            *entry = 0;
        }
        let slot_base = slot * self.total_out;
        let mut slot_g = vec![0f32; self.total_out];
        for s in scales {
            let (Some(i), Some(offset)) = (
                layout.position(s.layer, s.module),
                module_table_offset(s.layer, s.module, self.max_loras),
            ) else {
                return Err(PoolError::NoSuchModule {
                    layer: s.layer,
                    module: s.module,
                });
            };
            let row = self.row_offsets[i];
            slot_g[row..row + s.g.len()].copy_from_slice(&s.g);
            if let Some(e) = table.get_mut(offset + slot) {
                *e = self.g.addr_at(slot_base + row)?;
            }
        }
        if !scales.is_empty() {
            self.g.write(slot_base, &slot_g)?;
        }
        self.table.write(0, &table)?;
        self.host_table = table;
        Ok(())
    }

    /// Clear `slot`'s table entries (its `g` values are then never read).
    pub(crate) fn clear(&mut self, slot: usize) -> Result<(), PoolError> {
        if self
            .host_table
            .iter()
            .skip(slot)
            .step_by(self.max_loras.max(1))
            .all(|e| *e == 0)
        {
            return Ok(());
        }
        let mut table = self.host_table.clone();
        for entry in table.iter_mut().skip(slot).step_by(self.max_loras.max(1)) {
            *entry = 0;
        }
        self.table.write(0, &table)?;
        self.host_table = table;
        Ok(())
    }

    /// The rescales of the DoRA pairs `slot` holds now, in layout order.
    pub(crate) fn slot_scales(
        &self,
        layout: &SlotLayout,
        slot: usize,
    ) -> Result<Vec<(usize, LoraModule, Vec<f32>)>, PoolError> {
        let mut out = Vec::new();
        for (e, &row) in layout.entries().iter().zip(&self.row_offsets) {
            let held = module_table_offset(e.layer, e.module, self.max_loras)
                .and_then(|o| self.host_table.get(o + slot))
                .is_some_and(|&addr| addr != 0);
            if held {
                let g = self.g.download_range(slot * self.total_out + row, e.out_dim)?;
                out.push((e.layer, e.module, g));
            }
        }
        Ok(out)
    }

    /// The DoRA pairs `slot` holds now.
    pub(crate) fn pairs(&self, slot: usize) -> usize {
        self.host_table
            .iter()
            .skip(slot)
            .step_by(self.max_loras.max(1))
            .filter(|e| **e != 0)
            .count()
    }

    /// The DoRA epilogue of (layer, module) for an apply call's target:
    /// its `[max_loras]` range of `g` addresses (indexed by slot, as the
    /// pair table is) and its base bias.
    pub(crate) fn epilogue(
        &self,
        layout: &SlotLayout,
        layer: usize,
        module: LoraModule,
    ) -> Result<DoraEpilogue<'_>, PoolError> {
        let i = layout
            .position(layer, module)
            .ok_or(PoolError::NoSuchModule { layer, module })?;
        Ok(DoraEpilogue {
            table: &self.table,
            table_offset: module_table_offset(layer, module, self.max_loras).ok_or(overflow())?,
            bias: Some((&self.bias, self.row_offsets[i])),
        })
    }
}

fn overflow() -> PoolError {
    PoolError::Layout(lora_layout::LayoutError::Overflow { what: "DoRA state" })
}

/// The magnitude tensor the audit placed for (layer, module).
fn magnitude_key(report: &AuditReport, layer: usize, module: LoraModule) -> String {
    report
        .placed
        .iter()
        .find(|p| (p.layer, p.module) == (layer, module))
        .and_then(|p| p.magnitude_key.clone())
        .unwrap_or_else(|| format!("layer {layer} {module} lora_magnitude_vector"))
}

/// The refusal of a DoRA adapter by a pool not built for DoRA.
pub(crate) fn refuse_not_built(name: &str, report: &AuditReport) -> PoolError {
    let mut report = report.clone();
    report.refuse(Refusal::new(
        RejectCode::Dora,
        "use_dora",
        "this pool is not built for DoRA (LoraOptions::dora, LORA_DORA=1)",
    ));
    PoolError::Audit {
        adapter: name.to_string(),
        source: Box::new(AuditError::Refused(Box::new(report))),
    }
}
