//! Test-only helpers: tiny random checkpoints written to a temporary folder.
//!
//! The tensor names here are restated from the transformers 5 modeling files
//! independently of `model`, so a naming slip there fails a test. Never used
//! outside `#[cfg(test)]`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use safetensors::Dtype;

use crate::config::{BaseConfig, MlpKind};

/// A folder under the system temp dir, removed on drop (errors ignored).
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("lora-engine-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::create_dir_all(&dir);
        Self(dir)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small deterministic generator (64-bit LCG).
pub(crate) struct Lcg(u64);

impl Lcg {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1))
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn next_f32(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// A tiny `config.json` of `model_type` (4 heads of 4, 2 kv heads, 2 layers).
pub(crate) fn tiny_config(model_type: &str, extra: &str) -> String {
    let sep = if extra.is_empty() { "" } else { "," };
    format!(
        r#"{{"model_type": "{model_type}", "vocab_size": 40, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 4, "rms_norm_eps": 1e-6,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8{sep} {extra}}}"#
    )
}

/// One tensor to write: name, dtype, shape, f32 values (converted on write).
pub(crate) struct TensorSpec {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
}

/// Every tensor `cfg` needs, in transformers 5's fused expert layout, F32.
pub(crate) fn tensor_specs(cfg: &BaseConfig) -> Vec<TensorSpec> {
    let t = |name: String, shape: Vec<usize>| TensorSpec {
        name,
        dtype: Dtype::F32,
        shape,
    };
    let (h, v, hd) = (cfg.hidden, cfg.vocab, cfg.head_dim);
    let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
    let mut out = vec![
        t("model.embed_tokens.weight".into(), vec![v, h]),
        t("model.norm.weight".into(), vec![h]),
    ];
    if !cfg.tie_word_embeddings {
        out.push(t("lm_head.weight".into(), vec![v, h]));
    }
    for (l, layer) in cfg.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        out.push(t(format!("{p}.input_layernorm.weight"), vec![h]));
        out.push(t(format!("{p}.post_attention_layernorm.weight"), vec![h]));
        for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            out.push(t(format!("{p}.self_attn.{proj}.weight"), vec![rows, h]));
            if cfg.qkv_bias {
                out.push(t(format!("{p}.self_attn.{proj}.bias"), vec![rows]));
            }
        }
        out.push(t(format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        if cfg.o_bias {
            out.push(t(format!("{p}.self_attn.o_proj.bias"), vec![h]));
        }
        if cfg.qk_norm {
            out.push(t(format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            out.push(t(format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        match (layer.mlp, &cfg.moe) {
            (MlpKind::Moe, Some(moe)) => {
                let (e, mi) = (moe.num_experts, moe.moe_inter);
                out.push(t(format!("{p}.mlp.gate.weight"), vec![e, h]));
                out.push(t(format!("{p}.mlp.experts.gate_up_proj"), vec![e, 2 * mi, h]));
                out.push(t(format!("{p}.mlp.experts.down_proj"), vec![e, h, mi]));
            }
            _ => {
                let i = cfg.inter;
                for proj in ["gate_proj", "up_proj"] {
                    out.push(t(format!("{p}.mlp.{proj}.weight"), vec![i, h]));
                    if cfg.mlp_bias {
                        out.push(t(format!("{p}.mlp.{proj}.bias"), vec![i]));
                    }
                }
                out.push(t(format!("{p}.mlp.down_proj.weight"), vec![h, i]));
                if cfg.mlp_bias {
                    out.push(t(format!("{p}.mlp.down_proj.bias"), vec![h]));
                }
            }
        }
    }
    out
}

/// Writes `config.json` and `model.safetensors` with seeded values scaled
/// like a real model (norm weights near 1, projections ~ 1/sqrt(fan_in)).
pub(crate) fn write_model(dir: &Path, config_json: &str, specs: &[TensorSpec], seed: u64) {
    let mut rng = Lcg::new(seed);
    let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for s in specs {
        let numel: usize = s.shape.iter().product();
        let fan_in = s.shape.last().copied().unwrap_or(1).max(1) as f32;
        let values: Vec<f32> = (0..numel)
            .map(|_| {
                let r = rng.next_f32();
                if s.name.contains("norm") {
                    1.0 + 0.2 * r
                } else if s.name.contains("embed") {
                    r
                } else if s.name.ends_with("mlp.gate.weight") {
                    2.0 * r
                } else {
                    r * 1.7 / fan_in.sqrt()
                }
            })
            .collect();
        let bytes: Vec<u8> = match s.dtype {
            Dtype::BF16 | Dtype::F16 => values
                .iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        blobs.push((s.name.clone(), s.dtype, s.shape.clone(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = blobs
        .iter()
        .filter_map(|(name, dtype, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .ok()
                .map(|v| (name.clone(), v))
        })
        .collect();
    assert_eq!(views.len(), blobs.len(), "a test tensor view did not build");
    let serialized = safetensors::serialize(views, None);
    assert!(serialized.is_ok(), "serialize failed");
    if let Ok(bytes) = serialized {
        assert!(std::fs::write(dir.join("model.safetensors"), bytes).is_ok());
    }
    assert!(std::fs::write(dir.join("config.json"), config_json).is_ok());
}

/// A tiny random model of `model_type` written to a fresh temp folder.
pub(crate) fn tiny_model_dir(model_type: &str, extra: &str, seed: u64) -> (TempDir, String) {
    let json = tiny_config(model_type, extra);
    let dir = TempDir::new(model_type);
    let cfg = BaseConfig::from_json_str(&json, Path::new("tiny/config.json"));
    assert!(cfg.is_ok(), "tiny config rejected: {cfg:?}");
    if let Ok(cfg) = cfg {
        write_model(dir.path(), &json, &tensor_specs(&cfg), seed);
    }
    (dir, json)
}
