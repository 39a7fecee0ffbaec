//! The engine's base projections as the pool's [`BaseWeights`]: what a DoRA
//! adapter's rescale `m / ‖W + s·B A‖` needs. The model's fused q|k|v and
//! gate|up weights are sliced by rows (q, then k, then v; gate, then up,
//! as `FusedTargets::qkv` / `gate_up` order their columns); routed-expert
//! layers have no dense MLP projections (`None`: a DoRA pair there is
//! refused). Read by the pool when it stages a DoRA adapter, never during
//! a forward.

use std::sync::Arc;

use lora_layout::{LoraModule, ModelConfig};
use lora_pool::{BaseProjection, BaseWeights};

use crate::model::{Mlp, Model};
use crate::projection::Projection;

/// The model's projections, shared with the engine.
pub(crate) struct ModelBase {
    pub(crate) model: Arc<Model>,
    pub(crate) cfg: ModelConfig,
}

/// Rows `start..start + rows` of `p` (weight and bias).
fn rows(p: &Projection, start: usize, rows: usize) -> Option<BaseProjection<'_>> {
    let w = p.w.get(start * p.in_dim..(start + rows) * p.in_dim)?;
    let bias = match &p.b {
        Some(b) => Some(b.get(start..start + rows)?),
        None => None,
    };
    Some(BaseProjection { weight: w, bias })
}

impl BaseWeights for ModelBase {
    fn projection(&self, layer: usize, module: LoraModule) -> Option<BaseProjection<'_>> {
        let l = self.model.layers.get(layer)?;
        let out = |m: LoraModule| m.dims(&self.cfg).0;
        let dense_mlp = match &l.mlp {
            Mlp::Dense { gate_up, down } => Some((gate_up, down)),
            Mlp::Moe { .. } => None,
        };
        match module {
            LoraModule::QProj => rows(&l.qkv, 0, out(LoraModule::QProj)),
            LoraModule::KProj => rows(&l.qkv, out(LoraModule::QProj), out(LoraModule::KProj)),
            LoraModule::VProj => rows(
                &l.qkv,
                out(LoraModule::QProj) + out(LoraModule::KProj),
                out(LoraModule::VProj),
            ),
            LoraModule::OProj => rows(&l.o, 0, l.o.out_dim),
            LoraModule::GateProj => rows(dense_mlp?.0, 0, out(LoraModule::GateProj)),
            LoraModule::UpProj => rows(dense_mlp?.0, out(LoraModule::GateProj), out(LoraModule::UpProj)),
            LoraModule::DownProj => rows(dense_mlp?.1, 0, dense_mlp?.1.out_dim),
            _ => None,
        }
    }
}
