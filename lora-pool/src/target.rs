//! [`FusedTargets`]: which modules one apply call adds deltas for, and
//! where each module's columns start in the fused output (q|k|v into one
//! qkv buffer, gate|up into one), computed from the model config — never
//! by hand.
//!
//! One launch serves at most [`FusedTargets::MAX`] modules; a longer list
//! is a typed error when it is built, not at launch.

use lora_layout::{LoraModule, ModelConfig};

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
}

impl FusedTargets {
    /// Most modules one apply call (one launch) serves.
    pub const MAX: usize = lora_kernels::MAX_TARGETS;

    /// `modules`' outputs side by side, in order: module `i` starts where
    /// module `i - 1` ends. An error past [`FusedTargets::MAX`] modules, for
    /// none, or for a module repeated.
    pub fn concat(cfg: &ModelConfig, modules: &[LoraModule]) -> Result<FusedTargets, PoolError> {
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
            width += module.dims(cfg).0;
        }
        Ok(FusedTargets {
            targets,
            len: modules.len(),
            width,
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
        }
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
