//! A base model's weights, loaded from a Hugging Face folder.
//!
//! [`Model::load`] reads `config.json` into a [`BaseConfig`] and every tensor
//! that config implies, by the names transformers 5 uses, into host f32 with
//! the shape checked. Projections are stored fused the way the hooks see them:
//! `q|k|v` as one `[q_dim + 2*kv_dim, hidden]` matrix, dense `gate|up` as one
//! `[2*inter, hidden]`, each routed expert as its slices of transformers 5's
//! 3-D parameters `gate_up_proj [E, 2*moe_inter, hidden]` and
//! `down_proj [E, hidden, moe_inter]`. [`Model::on_device`] puts every
//! projection's weight on a CUDA device as well (f32, uploaded once), where
//! the forward then runs the base projections ([`crate::projection`]).
//! Both on-disk expert layouts load: the fused one
//! (`mlp.experts.gate_up_proj`, written with `save_original_format=False`) and
//! the per-expert legacy one that `save_pretrained` writes by default and the
//! Hub holds (`mlp.experts.{e}.{gate,up,down}_proj.weight` for Qwen3-MoE,
//! `block_sparse_moe.experts.{e}.w1/w3/w2.weight` for Mixtral).
//!
//! This module must never guess a missing tensor (a missing lm_head of an
//! untied model is an error, not random weights), and never run the model.
//! Tensors the config does not use are ignored.

use std::path::Path;

use std::sync::Arc;

use lora_kernels::Device;
use lora_layout::Placement;

use crate::collective::Collective;

use crate::config::{BaseConfig, Family, MlpKind, MoeConfig};
use crate::error::EngineError;
use crate::math::Rope;
use crate::projection::{Projection, Site};
use crate::tensors::TensorStore;

/// A loaded base model. Run it with [`Model::forward`]: in host f32, or with
/// the base projections on a CUDA device ([`Model::on_device`]).
#[derive(Debug, Clone)]
pub struct Model {
    pub(crate) cfg: BaseConfig,
    /// `[vocab, hidden]`: the embedding table, and the lm_head when tied.
    pub(crate) embed: Projection,
    pub(crate) layers: Vec<Layer>,
    /// Final norm `[hidden]`.
    pub(crate) norm: Vec<f32>,
    /// `[vocab, hidden]`; `None`: tied to `embed`.
    pub(crate) lm_head: Option<Projection>,
    pub(crate) rope: Rope,
    /// The CUDA device the projections run on; `None`: the host.
    pub(crate) device: Option<Device>,
    /// The tensor-parallel group of a cut model ([`Model::shard`]): the
    /// forward all-reduces the row-parallel outputs through it, and an
    /// expert-parallel MoE layer dispatches its tokens through it.
    pub(crate) collective: Option<Arc<dyn Collective>>,
    /// The rank this model was cut for ([`Model::shard`]); `SINGLE`: whole.
    pub(crate) placement: Placement,
    /// A vocab-parallel cut ([`Model::shard`]): the token ids whose rows
    /// `embed` and `lm_head` hold; the forward zeroes other tokens'
    /// embedding rows and all-reduces them, and all-gathers the logits.
    /// `None`: both tables whole.
    pub(crate) vocab_held: Option<std::ops::Range<usize>>,
}

/// One decoder layer's weights.
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    /// `[q_dim + 2*kv_dim, hidden]`.
    pub(crate) qkv: Projection,
    /// `[hidden, q_dim]`.
    pub(crate) o: Projection,
    /// `[head_dim]` each, Qwen3 families only.
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) mlp: Mlp,
}

/// A layer's feed-forward weights.
#[derive(Debug, Clone)]
pub(crate) enum Mlp {
    Dense {
        /// `[2*inter, hidden]`: gate rows then up rows.
        gate_up: Projection,
        /// `[hidden, inter]`.
        down: Projection,
    },
    Moe {
        /// The expert geometry (a copy of the config's).
        moe: MoeConfig,
        /// `[num_experts, hidden]`.
        router: Projection,
        /// Per expert `[2*moe_inter, hidden]`: gate rows then up rows.
        /// Every expert, or an expert-parallel rank's block of them
        /// (`Placement::expert_range`; index 0 is the block's first).
        gate_up: Vec<Projection>,
        /// Per expert `[hidden, moe_inter]`, the same experts.
        down: Vec<Projection>,
    },
}

impl Model {
    /// Loads `dir/config.json` and `dir/model.safetensors` (or its shard
    /// index) into host f32; the forward runs on the host.
    pub fn load(dir: &Path) -> Result<Self, EngineError> {
        let cfg = BaseConfig::from_file(&dir.join("config.json"))?;
        let store = TensorStore::open(dir)?;
        Self::from_store(cfg, &store)
    }

    /// [`Model::load`], then [`Model::on_device`]: the base projections on
    /// `device` when it is a CUDA device, on the host for the CPU backend.
    pub fn load_on(dir: &Path, device: &Device) -> Result<Self, EngineError> {
        Self::load(dir)?.on_device(device)
    }

    /// The model with its base projections (q|k|v, o, gate|up, down, the
    /// router, every expert's matrices, the lm_head) run on `device`: on a
    /// CUDA device each weight is uploaded once, as f32, and every
    /// projection of [`Model::forward`] is a cuBLAS SGEMM there (its input
    /// uploaded, its output downloaded and handed to the hooks on the host,
    /// as before); on the CPU backend the model runs on the host, exactly
    /// as [`Model::load`] leaves it (a device copy from an earlier call is
    /// dropped). Everything else of the forward (embedding, norms, RoPE,
    /// attention, routing, the KV caches) stays on the host.
    ///
    /// Errors: [`EngineError::BaseProjection`] naming the weight that could
    /// not be uploaded (e.g. out of device memory).
    pub fn on_device(mut self, device: &Device) -> Result<Self, EngineError> {
        let placement = self.placement;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            layer.qkv.place(device, Site::layer("qkv", l))?;
            layer.o.place(device, Site::layer("o", l))?;
            match &mut layer.mlp {
                Mlp::Dense { gate_up, down } => {
                    gate_up.place(device, Site::layer("gate_up", l))?;
                    down.place(device, Site::layer("down", l))?;
                }
                Mlp::Moe {
                    moe,
                    router,
                    gate_up,
                    down,
                } => {
                    router.place(device, Site::layer("router", l))?;
                    let first = placement.expert_range(moe.num_experts)?.start;
                    for (e, p) in gate_up.iter_mut().enumerate() {
                        p.place(device, Site::expert("gate_up", l, first + e))?;
                    }
                    for (e, p) in down.iter_mut().enumerate() {
                        p.place(device, Site::expert("down", l, first + e))?;
                    }
                }
            }
        }
        // The embedding table is a projection only as the tied lm_head; the
        // lookup always reads the host copy.
        match &mut self.lm_head {
            Some(lm) => lm.place(device, Site::model("lm_head"))?,
            None => self.embed.place(device, Site::model("lm_head"))?,
        }
        self.device = device.is_cuda().then(|| device.clone());
        Ok(self)
    }

    /// The CUDA device the base projections run on; `None`: the host.
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// The resolved geometry (family, widths, which layers are MoE, ...).
    pub fn config(&self) -> &BaseConfig {
        &self.cfg
    }

    /// The feed-forward kind of `layer`; `None` past the last layer.
    pub fn mlp_kind(&self, layer: usize) -> Option<MlpKind> {
        self.cfg.mlp_kind(layer)
    }

    fn from_store(cfg: BaseConfig, st: &TensorStore) -> Result<Self, EngineError> {
        let (h, v) = (cfg.hidden, cfg.vocab);
        let embed_name = "model.embed_tokens.weight";
        let lm_name = "lm_head.weight";
        // transformers ties symmetrically: with tie_word_embeddings a checkpoint
        // may hold either matrix; if it holds both, both are used as stored.
        let (embed, lm_head) = if cfg.tie_word_embeddings && !st.contains(lm_name) {
            (st.load(embed_name, &[v, h])?, None)
        } else if cfg.tie_word_embeddings && !st.contains(embed_name) {
            (st.load(lm_name, &[v, h])?, None)
        } else {
            (st.load(embed_name, &[v, h])?, Some(st.load(lm_name, &[v, h])?))
        };
        let embed = Projection::new(embed, None, h);
        let lm_head = lm_head.map(|w| Projection::new(w, None, h));
        let layers = (0..cfg.n_layers)
            .map(|l| load_layer(&cfg, st, l))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = st.load("model.norm.weight", &[h])?;
        let rope = Rope::new(cfg.rope_theta, cfg.head_dim);
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            device: None,
            collective: None,
            placement: Placement::SINGLE,
            vocab_held: None,
        })
    }

    /// This model run as a rank of `collective`'s tensor-parallel group:
    /// the forward all-reduces the partial outputs of o_proj and down_proj
    /// (with their deltas) through it. For a model cut by
    /// [`Model::shard`] for the collective's rank.
    pub fn with_collective(mut self, collective: Arc<dyn Collective>) -> Model {
        self.collective = Some(collective);
        self
    }
}

/// Loads tensors of equal trailing shape and concatenates them along rows.
fn concat_rows(st: &TensorStore, parts: &[(String, Vec<usize>)]) -> Result<Vec<f32>, EngineError> {
    let mut out = Vec::new();
    for (name, shape) in parts {
        out.extend(st.load(name, shape)?);
    }
    Ok(out)
}

fn optional_concat(
    st: &TensorStore,
    present: bool,
    parts: &[(String, Vec<usize>)],
) -> Result<Option<Vec<f32>>, EngineError> {
    if present {
        concat_rows(st, parts).map(Some)
    } else {
        Ok(None)
    }
}

fn load_layer(cfg: &BaseConfig, st: &TensorStore, l: usize) -> Result<Layer, EngineError> {
    let h = cfg.hidden;
    let (q, kv, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let p = format!("model.layers.{l}");
    let attn = |proj: &str, what: &str| format!("{p}.self_attn.{proj}.{what}");
    let qkv_parts = |what: &str, trailing: &[usize]| -> Vec<(String, Vec<usize>)> {
        [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
            .into_iter()
            .map(|(proj, rows)| {
                let mut shape = vec![rows];
                shape.extend_from_slice(trailing);
                (attn(proj, what), shape)
            })
            .collect()
    };
    let qkv = Projection::new(
        concat_rows(st, &qkv_parts("weight", &[h]))?,
        optional_concat(st, cfg.qkv_bias, &qkv_parts("bias", &[]))?,
        h,
    );
    let o_b = if cfg.o_bias {
        Some(st.load(&attn("o_proj", "bias"), &[h])?)
    } else {
        None
    };
    let o = Projection::new(st.load(&attn("o_proj", "weight"), &[h, q])?, o_b, q);
    let (q_norm, k_norm) = if cfg.qk_norm {
        (
            Some(st.load(&attn("q_norm", "weight"), &[hd])?),
            Some(st.load(&attn("k_norm", "weight"), &[hd])?),
        )
    } else {
        (None, None)
    };
    let mlp = match cfg.layers[l].mlp {
        MlpKind::Dense => load_dense(cfg, st, &p)?,
        MlpKind::Moe => load_moe(cfg, st, &p)?,
    };
    Ok(Layer {
        input_norm: st.load(&format!("{p}.input_layernorm.weight"), &[h])?,
        post_norm: st.load(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
        qkv,
        o,
        q_norm,
        k_norm,
        mlp,
    })
}

fn load_dense(cfg: &BaseConfig, st: &TensorStore, p: &str) -> Result<Mlp, EngineError> {
    let (h, i) = (cfg.hidden, cfg.inter);
    let name = |proj: &str, what: &str| format!("{p}.mlp.{proj}.{what}");
    let gu = |what: &str, trailing: &[usize]| -> Vec<(String, Vec<usize>)> {
        ["gate_proj", "up_proj"]
            .into_iter()
            .map(|proj| {
                let mut shape = vec![i];
                shape.extend_from_slice(trailing);
                (name(proj, what), shape)
            })
            .collect()
    };
    let down_b = if cfg.mlp_bias {
        Some(st.load(&name("down_proj", "bias"), &[h])?)
    } else {
        None
    };
    Ok(Mlp::Dense {
        gate_up: Projection::new(
            concat_rows(st, &gu("weight", &[h]))?,
            optional_concat(st, cfg.mlp_bias, &gu("bias", &[]))?,
            h,
        ),
        down: Projection::new(st.load(&name("down_proj", "weight"), &[h, i])?, down_b, i),
    })
}

fn load_moe(cfg: &BaseConfig, st: &TensorStore, p: &str) -> Result<Mlp, EngineError> {
    let Some(moe) = cfg.moe.as_ref() else {
        // resolve() gives every config with an MoE layer an MoeConfig
        return Err(EngineError::ConfigField {
            path: st.label().to_path_buf(),
            field: "num_experts".to_string(),
            reason: "an MoE layer without expert geometry".to_string(),
        });
    };
    let (h, e, mi) = (cfg.hidden, moe.num_experts, moe.moe_inter);
    let moe = moe.clone();
    let fused_gate_up = format!("{p}.mlp.experts.gate_up_proj");
    let fused_down = format!("{p}.mlp.experts.down_proj");
    let legacy_mixtral = cfg.family == Family::Mixtral
        && !st.contains(&fused_gate_up)
        && st.contains(&format!("{p}.block_sparse_moe.gate.weight"));
    let legacy_qwen = cfg.family == Family::Qwen3Moe
        && !st.contains(&fused_gate_up)
        && st.contains(&format!("{p}.mlp.experts.0.gate_proj.weight"));
    // Per expert: gate|up `[2*mi, h]` from its two files' matrices, down `[h, mi]`.
    let legacy = |gate: &str, up: &str, down: &str, x: &dyn Fn(usize, &str) -> String| {
        let gate_up = (0..e)
            .map(|e| {
                let parts = [(x(e, gate), vec![mi, h]), (x(e, up), vec![mi, h])];
                Ok(Projection::new(concat_rows(st, &parts)?, None, h))
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let down = (0..e)
            .map(|e| Ok(Projection::new(st.load(&x(e, down), &[h, mi])?, None, mi)))
            .collect::<Result<Vec<_>, EngineError>>()?;
        Ok::<_, EngineError>((gate_up, down))
    };
    if legacy_mixtral {
        // w1 = gate, w3 = up, w2 = down (transformers' conversion mapping)
        let x = |e: usize, w: &str| format!("{p}.block_sparse_moe.experts.{e}.{w}.weight");
        let router = st.load(&format!("{p}.block_sparse_moe.gate.weight"), &[e, h])?;
        let (gate_up, down) = legacy("w1", "w3", "w2", &x)?;
        return Ok(Mlp::Moe {
            moe,
            router: Projection::new(router, None, h),
            gate_up,
            down,
        });
    }
    let router = Projection::new(st.load(&format!("{p}.mlp.gate.weight"), &[e, h])?, None, h);
    if legacy_qwen {
        let x = |e: usize, w: &str| format!("{p}.mlp.experts.{e}.{w}.weight");
        let (gate_up, down) = legacy("gate_proj", "up_proj", "down_proj", &x)?;
        return Ok(Mlp::Moe {
            moe,
            router,
            gate_up,
            down,
        });
    }
    Ok(Mlp::Moe {
        moe,
        router,
        gate_up: split_experts(st.load(&fused_gate_up, &[e, 2 * mi, h])?, e, h),
        down: split_experts(st.load(&fused_down, &[e, h, mi])?, e, mi),
    })
}

/// A fused `[num_experts, out, in_dim]` parameter as one projection per expert.
fn split_experts(all: Vec<f32>, num_experts: usize, in_dim: usize) -> Vec<Projection> {
    let per = all.len() / num_experts.max(1);
    (0..num_experts)
        .map(|e| Projection::new(all[e * per..(e + 1) * per].to_vec(), None, in_dim))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{TempDir, tensor_specs, tiny_config, tiny_model_dir, write_model};
    use safetensors::Dtype;

    fn write_with(
        model_type: &str,
        extra: &str,
        edit: impl FnOnce(&mut Vec<crate::test_support::TensorSpec>),
    ) -> TempDir {
        let json = tiny_config(model_type, extra);
        let dir = TempDir::new("bad");
        let cfg = BaseConfig::from_json_str(&json, Path::new("tiny/config.json"));
        assert!(cfg.is_ok(), "{cfg:?}");
        if let Ok(cfg) = cfg {
            let mut specs = tensor_specs(&cfg);
            edit(&mut specs);
            write_model(dir.path(), &json, &specs, 7);
        }
        dir
    }

    #[test]
    fn every_family_loads() {
        for family in ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"] {
            let (dir, _) = tiny_model_dir(family, "", 1);
            let model = Model::load(dir.path());
            assert!(model.is_ok(), "{family}: {:?}", model.err());
            if let Ok(m) = model {
                assert_eq!(m.config().family.model_type(), family);
                let moe = m.config().moe_layers();
                assert_eq!(!moe.is_empty(), m.config().family.is_moe(), "{family}");
                assert_eq!(m.mlp_kind(0), m.config().mlp_kind(0));
            }
        }
    }

    #[test]
    fn missing_tensor_is_named() {
        let name = "model.layers.1.post_attention_layernorm.weight";
        let dir = write_with("qwen3", "", |s| s.retain(|t| t.name != name));
        match Model::load(dir.path()) {
            Err(EngineError::MissingTensor { tensor, file }) => {
                assert_eq!(tensor, name);
                assert!(file.ends_with("model.safetensors"));
            }
            other => panic!("expected MissingTensor, got {other:?}"),
        }
    }

    #[test]
    fn missing_fused_expert_is_named() {
        let name = "model.layers.0.mlp.experts.down_proj";
        let dir = write_with("qwen3_moe", "", |s| s.retain(|t| t.name != name));
        assert!(matches!(Model::load(dir.path()),
            Err(EngineError::MissingTensor { tensor, .. }) if tensor == name));
    }

    #[test]
    fn untied_model_needs_lm_head_and_tied_does_not() {
        let untied = write_with("llama", "", |s| s.retain(|t| t.name != "lm_head.weight"));
        assert!(matches!(Model::load(untied.path()),
            Err(EngineError::MissingTensor { tensor, .. }) if tensor == "lm_head.weight"));
        let tied = write_with("llama", r#""tie_word_embeddings": true"#, |_| {});
        let model = Model::load(tied.path());
        assert!(matches!(&model, Ok(m) if m.lm_head.is_none()), "{:?}", model.err());
    }

    #[test]
    fn wrong_dtype_is_named() {
        let name = "model.layers.0.self_attn.k_proj.weight";
        let dir = write_with("mistral", "", |s| {
            for t in s.iter_mut().filter(|t| t.name == name) {
                t.dtype = Dtype::F16;
            }
        });
        match Model::load(dir.path()) {
            Err(EngineError::UnsupportedDtype { tensor, dtype, .. }) => {
                assert_eq!((tensor.as_str(), dtype.as_str()), (name, "F16"));
            }
            other => panic!("expected UnsupportedDtype, got {other:?}"),
        }
    }

    #[test]
    fn bf16_loads_exactly() {
        let dir = write_with("qwen2", "", |s| {
            for t in s.iter_mut() {
                t.dtype = Dtype::BF16;
            }
        });
        let model = Model::load(dir.path());
        assert!(model.is_ok(), "{:?}", model.err());
        if let Ok(m) = model {
            // every value is a widened bf16: the low 16 bits are zero
            assert!(m.embed.w.iter().all(|v| v.to_bits() & 0xffff == 0));
        }
    }

    #[test]
    fn wrong_shape_is_named() {
        let name = "model.layers.0.self_attn.o_proj.weight";
        let dir = write_with("qwen3", "", |s| {
            for t in s.iter_mut().filter(|t| t.name == name) {
                t.shape = vec![t.shape[1] * 2, t.shape[0] / 2];
            }
        });
        match Model::load(dir.path()) {
            Err(EngineError::TensorShape {
                tensor,
                expected,
                found,
                ..
            }) => {
                assert_eq!(tensor, name);
                assert_eq!(expected, vec![16, 16]);
                assert_eq!(found, vec![32, 8]);
            }
            other => panic!("expected TensorShape, got {other:?}"),
        }
    }

    #[test]
    fn bad_config_field_and_bad_files() {
        let (dir, json) = tiny_model_dir("llama", "", 3);
        let gelu = json.replacen("\"model_type\"", "\"hidden_act\": \"gelu\", \"model_type\"", 1);
        assert!(std::fs::write(dir.path().join("config.json"), gelu).is_ok());
        assert!(matches!(Model::load(dir.path()),
            Err(EngineError::ConfigField { field, .. }) if field == "hidden_act"));
        assert!(std::fs::write(dir.path().join("config.json"), json).is_ok());
        assert!(std::fs::write(dir.path().join("model.safetensors"), b"\x05\0\0\0\0\0\0\0{").is_ok());
        assert!(matches!(Model::load(dir.path()), Err(EngineError::Safetensors { .. })));
        let nowhere = dir.path().join("nowhere");
        assert!(matches!(Model::load(&nowhere), Err(EngineError::Io { path, .. }) if path.ends_with("config.json")));
    }
}
