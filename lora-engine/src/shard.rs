//! A base model cut for one tensor- and expert-parallel rank, by the rules
//! the adapter pool cuts its pairs by (`lora_layout::ModuleShard`,
//! `Placement::expert_range`), so that a rank's deltas land on exactly the
//! base outputs it computes: q|k|v keep the rank's query heads and its
//! key/value heads (a key/value head shared by `tp_world /
//! num_key_value_heads` ranks when there are fewer heads than ranks),
//! gate|up the rank's block of each, o and down the rank's input columns
//! (their outputs are partial sums the forward all-reduces; a bias there is
//! added by rank 0 only). Norms are whole on every rank; the embedding and
//! the lm_head are whole on every rank too, unless the placement is
//! vocab-parallel (`Placement::vocab_parallel`, as vLLM's
//! `VocabParallelEmbedding` / `ParallelLMHead`): then both keep the rank's
//! vocabulary rows (`Placement::vocab_range`; a tied head is the same
//! rows), the embedding lookup gives zero rows for other ranks' tokens and
//! is all-reduced, and the rank's logit columns are all-gathered.
//!
//! An MoE model runs expert-parallel (`ep_world > 1`): each rank keeps the
//! routed experts of its block (`Placement::expert_range`) and the whole
//! router, and its MoE layers dispatch tokens to the ranks holding their
//! experts (`crate::expert_parallel`). Its attention and dense layers are
//! either whole on every rank (`tp_world` 1: replicated, every rank
//! computes them whole) or cut as above over the same ranks (`tp_world =
//! ep_world`, `tp_rank = ep_rank`: vLLM's expert parallelism over the
//! tensor-parallel group).
//!
//! This module must never cut a routed expert (experts are whole; under
//! `tp_world > 1` an MoE model without expert parallelism over the same
//! ranks is refused, [`EngineError::NotTensorParallel`]), nor run the
//! model.

use lora_layout::{LoraModule, ModelConfig, ModuleShard, Placement};

use crate::error::EngineError;
use crate::model::{Layer, Mlp, Model};
use crate::projection::Projection;

/// `w`'s rows `rows` (in that order), with the bias's.
fn take_rows(p: &Projection, rows: &[usize]) -> Projection {
    let d = p.in_dim;
    let w = rows
        .iter()
        .flat_map(|&r| p.w[r * d..(r + 1) * d].iter().copied())
        .collect();
    let b = p.b.as_ref().map(|b| rows.iter().map(|&r| b[r]).collect());
    Projection::new(w, b, d)
}

/// `w`'s columns `start..start + len`; the bias kept only when `bias`.
fn take_cols(p: &Projection, start: usize, len: usize, bias: bool) -> Projection {
    let w =
        p.w.chunks_exact(p.in_dim.max(1))
            .flat_map(|row| row[start..start + len].iter().copied())
            .collect();
    Projection::new(w, p.b.clone().filter(|_| bias), len)
}

/// The unsharded rows of `modules`' rank parts, each module's rows offset
/// by the widths of the modules before it (a fused q|k|v or gate|up).
fn fused_rows(cfg: &ModelConfig, placement: Placement, modules: &[LoraModule]) -> Result<Vec<usize>, EngineError> {
    let mut rows = Vec::new();
    let mut base = 0;
    for &m in modules {
        let shard = ModuleShard::of(m, cfg, placement)?;
        rows.extend((0..shard.dims().0).filter_map(|j| shard.src_row(j)).map(|r| base + r));
        base += shard.full_dims.0;
    }
    Ok(rows)
}

impl Model {
    /// This model cut for rank `placement` of the model whose adapter
    /// geometry is `cfg` (see the module docs); the whole model at world 1.
    /// Run it with a [`crate::Collective`] of the same rank
    /// ([`Model::with_collective`]; its group is the tensor-parallel one,
    /// or the expert-parallel one when `tp_world` is 1).
    ///
    /// Errors: [`EngineError::Placement`] naming the dimension that does
    /// not divide (`num_experts` for experts over `ep_world`);
    /// [`EngineError::NotTensorParallel`] for an MoE model under
    /// `tp_world > 1` whose expert-parallel ranks are not the
    /// tensor-parallel ones, or a model that is already cut.
    pub fn shard(&self, cfg: &ModelConfig, placement: Placement) -> Result<Model, EngineError> {
        if self.placement != Placement::SINGLE {
            return Err(EngineError::NotTensorParallel {
                what: format!("a model already cut for {:?}: cut the whole model", self.placement),
            });
        }
        let moe = self.cfg.moe.as_ref().filter(|_| !self.cfg.moe_layers().is_empty());
        crate::expert_parallel::group_of(placement, moe.is_some())?;
        let mut model = if placement.tp_world() == 1 {
            self.clone()
        } else {
            self.tp_cut(cfg, placement)?
        };
        if let Some(moe) = moe {
            let experts = placement.expert_range(moe.num_experts)?;
            for layer in &mut model.layers {
                if let Mlp::Moe { gate_up, down, .. } = &mut layer.mlp {
                    *gate_up = gate_up[experts.clone()].to_vec();
                    *down = down[experts.clone()].to_vec();
                }
            }
        }
        model.placement = placement;
        Ok(model)
    }

    /// The tensor-parallel cut of the attention and dense layers (routed
    /// experts and the router whole).
    fn tp_cut(&self, cfg: &ModelConfig, placement: Placement) -> Result<Model, EngineError> {
        let qkv_rows = fused_rows(
            cfg,
            placement,
            &[LoraModule::QProj, LoraModule::KProj, LoraModule::VProj],
        )?;
        let gate_up_rows = fused_rows(cfg, placement, &[LoraModule::GateProj, LoraModule::UpProj])?;
        let o = ModuleShard::of(LoraModule::OProj, cfg, placement)?;
        let down = ModuleShard::of(LoraModule::DownProj, cfg, placement)?;
        let k = ModuleShard::of(LoraModule::KProj, cfg, placement)?;
        let first = placement.tp_rank() == 0;
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                let mlp = match &layer.mlp {
                    Mlp::Dense { gate_up, down: dn } => Mlp::Dense {
                        gate_up: take_rows(gate_up, &gate_up_rows),
                        down: take_cols(dn, down.in_start, down.in_len, first),
                    },
                    moe @ Mlp::Moe { .. } => moe.clone(),
                };
                Layer {
                    input_norm: layer.input_norm.clone(),
                    post_norm: layer.post_norm.clone(),
                    qkv: take_rows(&layer.qkv, &qkv_rows),
                    o: take_cols(&layer.o, o.in_start, o.in_len, first),
                    q_norm: layer.q_norm.clone(),
                    k_norm: layer.k_norm.clone(),
                    mlp,
                }
            })
            .collect();
        let mut base = self.cfg.clone();
        base.n_heads = o.in_len / base.head_dim.max(1);
        base.n_kv_heads = k.dims().0 / base.head_dim.max(1);
        base.inter = down.in_len;
        // The vocab-parallel cut: the rank's rows of both tables.
        let vocab_held = placement
            .vocab_parallel()
            .then(|| placement.vocab_range(cfg.vocab_size))
            .transpose()?;
        let vocab_rows = |p: &Projection| match &vocab_held {
            Some(held) => take_rows(p, &held.clone().collect::<Vec<usize>>()),
            None => p.clone(),
        };
        Ok(Model {
            cfg: base,
            embed: vocab_rows(&self.embed),
            layers,
            norm: self.norm.clone(),
            lm_head: self.lm_head.as_ref().map(vocab_rows),
            rope: self.rope.clone(),
            device: None,
            collective: None,
            placement,
            vocab_held,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::NoDeltas;
    use crate::test_support::tiny_model_dir;
    use crate::{HostCollective, KvCache, SeqChunk};

    /// Every rank's cut model, run as threads with host collectives, gives
    /// the whole model's logits (the sum of partial outputs differs from
    /// the whole dot product only in summation order), with the embedding
    /// and lm_head whole or cut by the vocabulary.
    #[test]
    fn ranks_as_threads_give_the_whole_models_logits() {
        for family in ["llama", "qwen2", "qwen3"] {
            let (dir, _) = tiny_model_dir(family, "", 3);
            let whole = Model::load(dir.path()).expect("model");
            let cfg = ModelConfig::from_file(&dir.path().join("config.json")).expect("config");
            let ids = [1u32, 5, 7, 2];
            let run = |m: &Model| {
                let mut caches = vec![KvCache::new(m)];
                let chunk = SeqChunk { cache: 0, tokens: &ids };
                m.forward(&[chunk], &mut caches, &mut NoDeltas).expect("forward")
            };
            let want = run(&whole);
            for (world, vocab_parallel) in [(2usize, false), (4, false), (2, true), (4, true)] {
                let Ok(first) = Placement::new(0, world).map(|p| p.with_vocab_parallel(vocab_parallel)) else {
                    continue;
                };
                let group = HostCollective::group(world);
                let got: Vec<Vec<f32>> = std::thread::scope(|s| {
                    let handles: Vec<_> = first
                        .ranks()
                        .zip(group)
                        .map(|(p, c)| {
                            let m = whole
                                .shard(&cfg, p)
                                .expect("divides")
                                .with_collective(std::sync::Arc::new(c));
                            s.spawn(move || run(&m))
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().expect("rank")).collect()
                });
                for (r, logits) in got.iter().enumerate() {
                    let err = crate::rel_error(logits, &want);
                    assert!(err < 1e-5, "{family} x{world} ({vocab_parallel}) rank {r}: {err}");
                    assert_eq!(logits, &got[0], "{family} x{world}: ranks agree");
                }
            }
        }
    }

    /// An expert-parallel cut keeps the rank's block of experts in every
    /// MoE layer, and a cut model is not cut again.
    #[test]
    fn an_expert_parallel_cut_keeps_its_block_and_is_not_cut_again() {
        let (dir, _) = tiny_model_dir("qwen3_moe", "", 5);
        let whole = Model::load(dir.path()).expect("model");
        let cfg = ModelConfig::from_file(&dir.path().join("config.json")).expect("config");
        let ne = whole.config().moe.as_ref().map_or(0, |m| m.num_experts);
        let p = Placement::SINGLE.with_experts(1, 2).expect("placement");
        let cut = whole.shard(&cfg, p).expect("divides");
        let experts = |m: &Model| -> Vec<usize> {
            m.layers
                .iter()
                .filter_map(|l| match &l.mlp {
                    Mlp::Moe { gate_up, down, .. } => Some(gate_up.len().min(down.len())),
                    Mlp::Dense { .. } => None,
                })
                .collect()
        };
        assert!(!experts(&cut).is_empty());
        assert!(experts(&cut).iter().all(|&n| n == ne / 2), "{:?}", experts(&cut));
        assert!(experts(&whole).iter().all(|&n| n == ne));
        assert!(matches!(cut.shard(&cfg, p), Err(EngineError::NotTensorParallel { .. })));
    }
}
