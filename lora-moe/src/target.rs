//! Which expert projections an expert fold writes, and where their columns
//! start in the grouped-GEMM output.

use lora_kernels::{LoraTarget, MAX_TARGETS};
use lora_layout::{ExpertProj, ModelConfig};
use lora_pool::ExpertPool;

use crate::error::MoeError;

/// One projection of an expert fold and its first column in `y`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertTarget {
    /// The projection.
    pub proj: ExpertProj,
    /// First column of `y` it writes.
    pub y_col_offset: usize,
}

impl ExpertTarget {
    /// A fused `gate_up` output in transformers' order (its `chunk(2)`):
    /// the Gate delta onto columns `0..inter`, the Up delta onto
    /// `inter..2·inter`. A grouped GEMM that orders them otherwise passes its
    /// own offsets (or permutes its output). gpt_oss's `gate_up_proj`
    /// interleaves them (Gate output `j` at `2j`, Up at `2j + 1`,
    /// [`GateUpLayout::Interleaved`]), which no pair of column offsets
    /// describes: an engine serving gpt_oss folds onto a `gate | up` output,
    /// i.e. de-interleaves its gate_up weights (a fixed column permutation,
    /// done once at load) before its grouped GEMM.
    ///
    /// [`GateUpLayout::Interleaved`]: lora_layout::GateUpLayout::Interleaved
    pub fn gate_up(expert_inter: usize) -> [ExpertTarget; 2] {
        [
            ExpertTarget {
                proj: ExpertProj::Gate,
                y_col_offset: 0,
            },
            ExpertTarget {
                proj: ExpertProj::Up,
                y_col_offset: expert_inter,
            },
        ]
    }

    /// The `down` output: the Down delta onto columns `0..hidden`.
    pub fn down() -> [ExpertTarget; 1] {
        [ExpertTarget {
            proj: ExpertProj::Down,
            y_col_offset: 0,
        }]
    }
}

/// Check `targets` against the model: 1..=[`MAX_TARGETS`] distinct
/// projections, each reading an input `x_width` wide (Gate and Up share one;
/// Down takes another). Returns each target's output width.
pub(crate) fn check_targets(
    cfg: &ModelConfig,
    targets: &[ExpertTarget],
    x_width: usize,
) -> Result<Vec<usize>, MoeError> {
    if targets.is_empty() || targets.len() > MAX_TARGETS {
        return Err(MoeError::shape(
            "targets",
            format!("{} targets; 1..={MAX_TARGETS} allowed", targets.len()),
        ));
    }
    targets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if targets[..i].iter().any(|u| u.proj == t.proj) {
                return Err(MoeError::shape("targets", format!("{} is listed twice", t.proj)));
            }
            let (out_dim, in_dim) = t
                .proj
                .dims(cfg)
                .ok_or_else(|| MoeError::shape("targets", format!("the model has no expert {}", t.proj)))?;
            if in_dim != x_width {
                return Err(MoeError::shape(
                    "x",
                    format!("rows are {x_width} wide; expert {} takes {in_dim}", t.proj),
                ));
            }
            Ok(out_dim)
        })
        .collect()
}

/// The kernel targets of `targets` at `layer`: each projection's
/// `[num_experts * max_loras]` block of the expert table.
pub(crate) fn kernel_targets<'t>(
    cfg: &ModelConfig,
    experts: &'t ExpertPool,
    max_loras: usize,
    layer: usize,
    targets: &[ExpertTarget],
    x_width: usize,
) -> Result<Vec<LoraTarget<'t>>, MoeError> {
    let out_dims = check_targets(cfg, targets, x_width)?;
    let n_entries = experts
        .num_experts()
        .checked_mul(max_loras)
        .ok_or_else(|| MoeError::shape("targets", "expert table size overflows"))?;
    targets
        .iter()
        .zip(out_dims)
        .map(|(t, out_dim)| {
            let table_offset = experts
                .proj_table_offset(layer, t.proj)
                .ok_or(MoeError::NotMoeLayer { layer })?;
            Ok(LoraTarget {
                table: experts.table(),
                table_offset,
                n_entries,
                out_dim,
                y_col_offset: t.y_col_offset,
                dora: None,
            })
        })
        .collect()
}
