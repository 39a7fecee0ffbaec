//! The base projections and where they run.
//!
//! A [`Projection`] is one `nn.Linear` of the base model (or one expert's
//! matrix, the router, the lm_head): its weight `[out_dim, in_dim]` in
//! PyTorch's layout and its bias, as host f32. On the host it runs
//! [`crate::math::linear`]. Once the model is put on a CUDA device
//! ([`crate::Model::on_device`]) it also holds an f32 copy of the weight
//! there, uploaded once, and every call runs on the device instead: `x` is
//! uploaded, `lora_kernels::linear_f32` (one cuBLAS SGEMM) computes
//! `x · w^T`, `y` is downloaded and the bias added on the host, in f32, as
//! the host path adds it. Both paths are f32 throughout; they differ only
//! in the order of each dot product's sum.
//!
//! This module must never hold a device copy of a weight on the CPU
//! backend (a CPU model's numbers are the host path's, bit for bit), nor
//! keep state between calls other than the weights.

use std::fmt;
use std::sync::Arc;

use lora_kernels::{Device, DeviceBuffer, KernelError, linear_f32};

use crate::error::EngineError;
use crate::math::linear;

/// One base projection's weights (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Projection {
    /// `[out_dim, in_dim]`, row-major.
    pub(crate) w: Vec<f32>,
    /// `[out_dim]`, added to every output row.
    pub(crate) b: Option<Vec<f32>>,
    pub(crate) in_dim: usize,
    pub(crate) out_dim: usize,
    /// `w` resident on a CUDA device; `None`: the projection runs on the host.
    device_w: Option<Arc<DeviceBuffer<f32>>>,
}

/// Where a projection sits, for errors: `layer 3 qkv`, `layer 1 expert 5
/// gate_up`, `lm_head`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Site {
    pub(crate) name: &'static str,
    pub(crate) layer: Option<usize>,
    pub(crate) expert: Option<usize>,
}

impl Site {
    /// A projection of the model outside the layers.
    pub(crate) fn model(name: &'static str) -> Site {
        Site {
            name,
            layer: None,
            expert: None,
        }
    }

    /// A projection of layer `layer`.
    pub(crate) fn layer(name: &'static str, layer: usize) -> Site {
        Site {
            name,
            layer: Some(layer),
            expert: None,
        }
    }

    /// A matrix of expert `expert` in layer `layer`.
    pub(crate) fn expert(name: &'static str, layer: usize, expert: usize) -> Site {
        Site {
            name,
            layer: Some(layer),
            expert: Some(expert),
        }
    }

    /// The engine error of a device failure at this site.
    pub(crate) fn failed(self) -> impl FnOnce(KernelError) -> EngineError {
        move |source| EngineError::BaseProjection {
            site: self.to_string(),
            source,
        }
    }
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(l) = self.layer {
            write!(f, "layer {l} ")?;
        }
        if let Some(e) = self.expert {
            write!(f, "expert {e} ")?;
        }
        f.write_str(self.name)
    }
}

impl Projection {
    /// A host projection of weight `w` (`[w.len() / in_dim, in_dim]`) and bias `b`.
    pub(crate) fn new(w: Vec<f32>, b: Option<Vec<f32>>, in_dim: usize) -> Projection {
        let out_dim = w.len() / in_dim.max(1);
        Projection {
            w,
            b,
            in_dim,
            out_dim,
            device_w: None,
        }
    }

    /// The weight's device copy, when the projection runs on a CUDA device.
    pub(crate) fn device_weight(&self) -> Option<&DeviceBuffer<f32>> {
        self.device_w.as_deref()
    }

    /// Run on `device` from now on: a CUDA device gets an f32 copy of the
    /// weight (uploaded here, once); the CPU backend means the host path,
    /// and any device copy is dropped.
    pub(crate) fn place(&mut self, device: &Device, site: Site) -> Result<(), EngineError> {
        self.device_w = if device.is_cuda() {
            Some(Arc::new(device.upload(&self.w).map_err(site.failed())?))
        } else {
            None
        };
        Ok(())
    }

    /// `y = x · w^T (+ b)` for `x` `[n, in_dim]` and `y` `[n, out_dim]`
    /// (`nn.functional.linear`), on the host or on the projection's device.
    pub(crate) fn apply(&self, site: Site, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
        let Some(w) = self.device_w.as_deref() else {
            linear(x, &self.w, self.b.as_deref(), self.in_dim, y);
            return Ok(());
        };
        let n = y.len() / self.out_dim.max(1);
        debug_assert_eq!(x.len(), n * self.in_dim);
        debug_assert_eq!(y.len(), n * self.out_dim);
        let device = w.device();
        let run = || -> Result<Vec<f32>, KernelError> {
            let xb = device.upload(x)?;
            let mut yb = device.alloc_zeros::<f32>(y.len())?;
            linear_f32(device, &xb, w, n, self.in_dim, self.out_dim, &mut yb)?;
            yb.download()
        };
        let out = run().map_err(site.failed())?;
        for (d, s) in y.iter_mut().zip(out) {
            *d = s;
        }
        if let Some(b) = &self.b {
            for row in y.chunks_exact_mut(self.out_dim.max(1)) {
                for (v, &bias) in row.iter_mut().zip(b) {
                    *v += bias;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_backend_keeps_the_host_path() {
        let w: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
        let mut p = Projection::new(w.clone(), Some(vec![0.5, -0.5, 1.0]), 4);
        assert_eq!((p.in_dim, p.out_dim), (4, 3));
        assert!(p.place(&Device::cpu(), Site::model("test")).is_ok());
        assert!(p.device_w.is_none());
        let x = [1.0, 2.0, 3.0, 4.0, -1.0, 0.0, 1.0, 2.0];
        let mut got = vec![0.0; 6];
        assert!(p.apply(Site::model("test"), &x, &mut got).is_ok());
        let mut want = vec![0.0; 6];
        linear(&x, &w, Some(&[0.5, -0.5, 1.0]), 4, &mut want);
        assert_eq!(got, want);
    }

    #[test]
    fn sites_name_layer_expert_and_projection() {
        assert_eq!(Site::model("lm_head").to_string(), "lm_head");
        assert_eq!(Site::layer("qkv", 3).to_string(), "layer 3 qkv");
        assert_eq!(Site::expert("gate_up", 1, 5).to_string(), "layer 1 expert 5 gate_up");
    }
}
