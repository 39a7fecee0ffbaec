//! [`FusedTargets`]: which modules one apply call adds deltas for, and
//! where each module's columns start in the fused output (q|k|v into one
//! qkv buffer, gate|up into one), computed from the model config — never
//! by hand. The `_at` constructors do the same for one tensor-parallel
//! rank, whose output holds only its share of each module's columns.
//!
//! One launch serves at most [`FusedTargets::MAX`] modules; a longer list
//! is a typed error when it is built, not at launch.

use lora_layout::{LoraModule, ModelConfig, ModuleShard, Placement};

use crate::error::PoolError;

/// One module of an apply call and the first column of y it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModuleTarget {
    /// The module.
    pub module: LoraModule,
    /// First column of y it writes.
    pub y_col_offset: usize,
}

/// The modules of one apply call, sharing one input x, with their column
/// ranges in one fused output row of [`width`](FusedTargets::width)
/// columns, in the order given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedTargets {
    targets: [ModuleTarget; FusedTargets::MAX],
    len: usize,
    width: usize,
    /// The tensor-parallel rank whose columns the offsets count: a pool of
    /// another placement refuses these targets.
    placement: Placement,
}

impl FusedTargets {
    /// Most modules one apply call (one launch) serves.
    pub const MAX: usize = lora_kernels::MAX_TARGETS;

    /// `modules`' outputs side by side, in order: module `i` starts where
    /// module `i - 1` ends. An error past [`FusedTargets::MAX`] modules, for
    /// none, or for a module repeated.
    pub fn concat(cfg: &ModelConfig, modules: &[LoraModule]) -> Result<FusedTargets, PoolError> {
        FusedTargets::concat_at(cfg, Placement::SINGLE, modules)
    }

    /// [`FusedTargets::concat`] for the tensor-parallel rank `placement`:
    /// each module's width is the rank's output columns
    /// ([`ModuleShard::dims`]); a cut that does not divide is
    /// [`PoolError::Layout`] naming the dimension.
    pub fn concat_at(
        cfg: &ModelConfig,
        placement: Placement,
        modules: &[LoraModule],
    ) -> Result<FusedTargets, PoolError> {
        if modules.is_empty() || modules.len() > FusedTargets::MAX {
            return Err(PoolError::TooManyTargets {
                got: modules.len(),
                max: FusedTargets::MAX,
            });
        }
        let mut targets = [ModuleTarget {
            module: modules[0],
            y_col_offset: 0,
        }; FusedTargets::MAX];
        let mut width = 0;
        for (i, &module) in modules.iter().enumerate() {
            if modules[..i].contains(&module) {
                return Err(PoolError::Batch(format!("{module} is named twice in one apply call")));
            }
            targets[i] = ModuleTarget {
                module,
                y_col_offset: width,
            };
            let shard = ModuleShard::of(module, cfg, placement).map_err(lora_layout::LayoutError::from)?;
            width += shard.dims().0;
        }
        Ok(FusedTargets {
            targets,
            len: modules.len(),
            width,
            placement,
        })
    }

    /// One module alone: its output is the whole row.
    pub fn single(cfg: &ModelConfig, module: LoraModule) -> FusedTargets {
        let width = module.dims(cfg).0;
        FusedTargets {
            targets: [ModuleTarget {
                module,
                y_col_offset: 0,
            }; FusedTargets::MAX],
            len: 1,
            width,
            placement: Placement::SINGLE,
        }
    }

    /// [`FusedTargets::single`] for the tensor-parallel rank `placement`.
    pub fn single_at(cfg: &ModelConfig, placement: Placement, module: LoraModule) -> Result<FusedTargets, PoolError> {
        FusedTargets::concat_at(cfg, placement, &[module])
    }

    /// [`FusedTargets::qkv`] for the tensor-parallel rank `placement`: the
    /// rank's `q | k | v` columns.
    pub fn qkv_at(cfg: &ModelConfig, placement: Placement) -> Result<FusedTargets, PoolError> {
        FusedTargets::concat_at(cfg, placement, LoraModule::qkv(cfg.family))
    }

    /// [`FusedTargets::gate_up`] for the tensor-parallel rank `placement`.
    pub fn gate_up_at(cfg: &ModelConfig, placement: Placement) -> Result<FusedTargets, PoolError> {
        FusedTargets::concat_at(cfg, placement, LoraModule::gate_up(cfg.family))
    }

    /// q, k and v onto one fused `q | k | v` output ([`LoraModule::qkv`]:
    /// Phi-3's single fused `qkv_proj` pair, else the three projections).
    pub fn qkv(cfg: &ModelConfig) -> FusedTargets {
        Self::fixed(cfg, LoraModule::qkv(cfg.family))
    }

    /// gate and up onto one fused `gate | up` output
    /// ([`LoraModule::gate_up`]: Phi-3's single fused `gate_up_proj` pair,
    /// else the two projections).
    pub fn gate_up(cfg: &ModelConfig) -> FusedTargets {
        Self::fixed(cfg, LoraModule::gate_up(cfg.family))
    }

    fn fixed(cfg: &ModelConfig, modules: &[LoraModule]) -> FusedTargets {
        // Distinct and within MAX by construction; `single` is the fallback
        // that cannot be reached.
        Self::concat(cfg, modules).unwrap_or_else(|_| Self::single(cfg, modules[0]))
    }

    /// The modules and their first columns, in order.
    pub fn targets(&self) -> &[ModuleTarget] {
        &self.targets[..self.len]
    }

    /// Columns of one fused output row (the sum of the modules' widths).
    pub fn width(&self) -> usize {
        self.width
    }

    /// The tensor-parallel rank the targets were built for
    /// ([`Placement::SINGLE`] for the constructors without `_at`).
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The first column of `module`, if it is one of the targets.
    pub fn offset_of(&self, module: LoraModule) -> Option<usize> {
        self.targets()
            .iter()
            .find(|t| t.module == module)
            .map(|t| t.y_col_offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig::from_hf_config(
            r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 96, "vocab_size": 32}"#,
        )
        .expect("config")
    }

    #[test]
    fn qkv_and_gate_up_follow_the_config() {
        let cfg = cfg();
        let qkv = FusedTargets::qkv(&cfg);
        assert_eq!(qkv.width(), 64 + 2 * 32);
        assert_eq!(qkv.offset_of(LoraModule::KProj), Some(64));
        assert_eq!(qkv.offset_of(LoraModule::VProj), Some(96));
        let gu = FusedTargets::gate_up(&cfg);
        assert_eq!((gu.width(), gu.offset_of(LoraModule::UpProj)), (192, Some(96)));
        assert_eq!(FusedTargets::single(&cfg, LoraModule::DownProj).width(), 64);
    }

    #[test]
    fn phi3_fused_projections_are_one_target_each() {
        let cfg = ModelConfig::from_hf_config(
            r#"{"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 96, "vocab_size": 32}"#,
        )
        .expect("config");
        let qkv = FusedTargets::qkv(&cfg);
        assert_eq!(qkv.targets().len(), 1);
        // The same q | k | v width the three projections would cover.
        assert_eq!(
            (qkv.width(), qkv.offset_of(LoraModule::QkvProj)),
            (64 + 2 * 32, Some(0))
        );
        assert_eq!(qkv.offset_of(LoraModule::KProj), None);
        let gu = FusedTargets::gate_up(&cfg);
        assert_eq!((gu.width(), gu.offset_of(LoraModule::GateUpProj)), (192, Some(0)));
    }

    #[test]
    fn a_tensor_parallel_rank_fuses_its_own_columns() {
        let cfg = cfg();
        // 4 heads of 16 over 4 ranks: q 16 columns; 2 kv heads replicated
        // over 2 ranks each: k and v 16 columns each.
        let rank = Placement::new(3, 4).expect("placement");
        let qkv = FusedTargets::qkv_at(&cfg, rank).expect("divides");
        assert_eq!(qkv.width(), 16 + 16 + 16);
        assert_eq!(qkv.offset_of(LoraModule::VProj), Some(32));
        let gu = FusedTargets::gate_up_at(&cfg, rank).expect("divides");
        assert_eq!((gu.width(), gu.offset_of(LoraModule::UpProj)), (48, Some(24)));
        // Row-parallel: the output is whole.
        let down = FusedTargets::single_at(&cfg, rank, LoraModule::DownProj).expect("divides");
        assert_eq!(down.width(), 64);
        assert_eq!(
            FusedTargets::qkv_at(&cfg, Placement::SINGLE).ok(),
            Some(FusedTargets::qkv(&cfg))
        );
        let eight = Placement::new(0, 8).expect("placement");
        assert!(matches!(
            FusedTargets::qkv_at(&cfg, eight),
            Err(PoolError::Layout(lora_layout::LayoutError::Placement(
                lora_layout::PlacementError::Indivisible {
                    dimension: "num_attention_heads",
                    ..
                }
            )))
        ));
    }

    #[test]
    fn too_many_none_or_repeated_targets_are_refused() {
        let cfg = cfg();
        let five = [
            LoraModule::QProj,
            LoraModule::KProj,
            LoraModule::VProj,
            LoraModule::GateProj,
            LoraModule::UpProj,
        ];
        assert!(matches!(
            FusedTargets::concat(&cfg, &five),
            Err(PoolError::TooManyTargets { got: 5, max: 4 })
        ));
        assert!(FusedTargets::concat(&cfg, &[]).is_err());
        assert!(FusedTargets::concat(&cfg, &[LoraModule::QProj, LoraModule::QProj]).is_err());
        assert_eq!(
            FusedTargets::concat(&cfg, &five[..4]).map(|t| t.targets().len()).ok(),
            Some(4)
        );
    }
}
