//! The engine's base projections as the pool's [`BaseWeights`]: what a DoRA
//! adapter's rescale `m / ‖W + s·B A‖` needs. The model's fused q|k|v and
//! gate|up weights are sliced by rows (q, then k, then v; gate, then up,
//! as `FusedTargets::qkv` / `gate_up` order their columns); routed-expert
//! layers have no dense MLP projections (`None`: a DoRA pair there is
//! refused). On CUDA the pool computes the rescale from the projections'
//! device copies (the ones cuBLAS runs), uploading nothing. Read by the
//! pool when it stages a DoRA adapter, never during a forward.

use std::sync::Arc;

use lora_layout::{LoraModule, ModelConfig};
use lora_pool::{BaseProjection, BaseWeights, DeviceProjection};

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

impl ModelBase {
    /// The projection holding `module` of `layer` and the module's rows in it.
    fn place(&self, layer: usize, module: LoraModule) -> Option<(&Projection, usize, usize)> {
        let l = self.model.layers.get(layer)?;
        let out = |m: LoraModule| m.dims(&self.cfg).0;
        let dense_mlp = match &l.mlp {
            Mlp::Dense { gate_up, down } => Some((gate_up, down)),
            Mlp::Moe { .. } => None,
        };
        let (q, k, gate) = (
            out(LoraModule::QProj),
            out(LoraModule::KProj),
            out(LoraModule::GateProj),
        );
        Some(match module {
            LoraModule::QProj => (&l.qkv, 0, q),
            LoraModule::KProj => (&l.qkv, q, k),
            LoraModule::VProj => (&l.qkv, q + k, out(LoraModule::VProj)),
            LoraModule::OProj => (&l.o, 0, l.o.out_dim),
            LoraModule::GateProj => (dense_mlp?.0, 0, gate),
            LoraModule::UpProj => (dense_mlp?.0, gate, out(LoraModule::UpProj)),
            LoraModule::DownProj => (dense_mlp?.1, 0, dense_mlp?.1.out_dim),
            _ => return None,
        })
    }
}

impl BaseWeights for ModelBase {
    fn projection(&self, layer: usize, module: LoraModule) -> Option<BaseProjection<'_>> {
        let (p, start, n) = self.place(layer, module)?;
        rows(p, start, n)
    }

    fn device_projection(&self, layer: usize, module: LoraModule) -> Option<DeviceProjection<'_>> {
        let (p, start, _) = self.place(layer, module)?;
        Some(DeviceProjection {
            weight: p.device_weight()?,
            offset: start * p.in_dim,
        })
    }
}
