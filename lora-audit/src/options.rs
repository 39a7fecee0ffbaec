//! `LoraOptions`: the serving switches, with `from_env`, the one place that
//! reads the `LORA_*` environment variables.

use lora_layout::{LayoutError, ModelConfig, ModelPlaces, Placement, PlacementError, SlotLayout};

/// How adapters are served: pool sizes and policy switches.
///
/// Passed explicitly to every crate that needs it; [`LoraOptions::from_env`]
/// is the only reader of the `LORA_*` variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraOptions {
    /// Slots in the adapter pool (`LORA_MAX_LORAS`, default 4).
    pub max_loras: usize,
    /// Rank every dense pair is padded to (`LORA_MAX_RANK`, default 16).
    pub max_rank: usize,
    /// Leading slots that are never evicted (`LORA_PINNED`, default 0).
    pub pinned: usize,
    /// Skip targets the engine cannot apply instead of refusing the adapter,
    /// listing every skip (`LORA_ALLOW_PARTIAL`).
    pub allow_partial: bool,
    /// Serve routed-expert and router deltas (`LORA_EXPERTS`). Off, an
    /// adapter with such tensors is refused (`REJECT[experts-disabled]`).
    pub experts: bool,
    /// Rank the expert/router pool is padded to (`LORA_EXPERT_RANK`, default 16).
    pub expert_rank: usize,
    /// Bytes of one expert-pool slot, when fixed (`LORA_EXPERT_SLOT_BYTES`);
    /// `None` sizes it from the adapters loaded at startup.
    pub expert_slot_bytes: Option<usize>,
    /// Advice to the engine: run decode without CUDA graphs while an adapter
    /// is loaded (`LORA_EAGER`). Read here only; no crate of this workspace
    /// acts on it (the engine decides how it launches).
    pub eager: bool,
    /// Allow runtime rotation and swap of adapters (`LORA_ROTATE`, or set by
    /// `LORA_PEER`).
    pub rotatable: bool,
    /// `host:port` of the peer that stages adapters (`LORA_PEER`).
    pub peer: Option<String>,
    /// Bytes of pinned host memory the pool may keep audited, packed slot
    /// images in (`LORA_HOST_TIER_BYTES`, default 0: no host tier). A
    /// promotion of an adapter held there is one copy, with no read, audit
    /// or parse.
    pub host_tier_bytes: usize,
    /// Serve DoRA adapters (`LORA_DORA`). On, the pool holds a per-slot
    /// magnitude rescale (`g`, f32 per adapted output row) beside the slots
    /// and needs the engine's base weights; off, it holds nothing more and
    /// a DoRA adapter is refused (`REJECT[dora]`). Served with tensor and
    /// expert world 1 only: with a placement it is an [`OptionsError`]
    /// (the rescale's row norm spans every rank's input columns).
    pub dora: bool,
    /// The tensor-parallel rank this process serves (`LORA_TP_RANK`,
    /// default 0, of `LORA_TP_WORLD`, default 1): its pool holds only the
    /// rank's shard of each pair ([`lora_layout::ModuleShard`]); and its
    /// expert-parallel rank (`LORA_EP_RANK`, default 0, of `LORA_EP_WORLD`,
    /// default 1): its expert pool holds only the rank's block of experts
    /// and the replicated router ([`lora_layout::Placement::expert_range`]).
    /// With `LORA_FULLY_SHARDED` set, its fully-sharded option is on
    /// ([`lora_layout::Placement::with_fully_sharded`], vLLM's
    /// `fully_sharded_loras`): a column-parallel pair's A is cut by rank
    /// rows too and the ranks all-gather their shrink outputs before the
    /// expand.
    /// With `LORA_VOCAB_PARALLEL` on ([`Placement::vocab_parallel`]), the
    /// embedding and head pairs, and the token overlays, follow the base
    /// model's vocab-parallel split (the rank's block of the vocabulary);
    /// off, they are whole on every rank.
    pub placement: Placement,
    /// Give every slot a place for a LoRA on the input embedding
    /// (`LORA_EMBEDDING_LORA`): `max_rank * (vocab + hidden)` BF16 elements
    /// more per slot. Off, an adapter with `lora_embedding_A/B` is refused
    /// (`REJECT[embedding-lora-disabled]`).
    pub embedding_lora: bool,
    /// Give every slot a place for a LoRA on the output head
    /// (`LORA_LM_HEAD_LORA`): `max_rank * (hidden + vocab)` BF16 elements
    /// more per slot. Off, an adapter with `lm_head.lora_A/B` is refused
    /// (`REJECT[lm-head-lora-disabled]`).
    pub lm_head_lora: bool,
}

/// Default of [`LoraOptions::max_loras`].
pub const DEFAULT_MAX_LORAS: usize = 4;
/// Default of [`LoraOptions::max_rank`].
pub const DEFAULT_MAX_RANK: usize = 16;
/// Default of [`LoraOptions::expert_rank`].
pub const DEFAULT_EXPERT_RANK: usize = 16;

impl Default for LoraOptions {
    fn default() -> LoraOptions {
        LoraOptions {
            max_loras: DEFAULT_MAX_LORAS,
            max_rank: DEFAULT_MAX_RANK,
            pinned: 0,
            allow_partial: false,
            experts: false,
            expert_rank: DEFAULT_EXPERT_RANK,
            expert_slot_bytes: None,
            eager: false,
            rotatable: false,
            peer: None,
            host_tier_bytes: 0,
            dora: false,
            placement: Placement::SINGLE,
            embedding_lora: false,
            lm_head_lora: false,
        }
    }
}

/// What an audit's caller sets over the `LORA_*` environment: the
/// `lora-audit` command's flags, the Python package's keywords.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuditArgs {
    /// Replaces [`LoraOptions::max_rank`] (at least 1).
    pub max_rank: Option<usize>,
    /// Replaces [`LoraOptions::expert_rank`] (at least 1).
    pub expert_rank: Option<usize>,
    /// Turns [`LoraOptions::allow_partial`] on.
    pub allow_partial: bool,
    /// Turns [`LoraOptions::experts`] on.
    pub experts: bool,
    /// Turns [`LoraOptions::dora`] on.
    pub dora: bool,
    /// Replaces the tensor-parallel rank of [`LoraOptions::placement`].
    pub tp_rank: Option<usize>,
    /// Replaces the tensor-parallel world size (at least 1).
    pub tp_world: Option<usize>,
    /// Replaces the expert-parallel rank.
    pub ep_rank: Option<usize>,
    /// Replaces the expert-parallel world size (at least 1).
    pub ep_world: Option<usize>,
    /// Turns the placement's fully-sharded option on.
    pub fully_sharded: bool,
    /// Turns [`LoraOptions::embedding_lora`] on.
    pub embedding_lora: bool,
    /// Turns [`LoraOptions::lm_head_lora`] on.
    pub lm_head_lora: bool,
    /// Turns [`Placement::vocab_parallel`] of [`LoraOptions::placement`] on.
    pub vocab_parallel: bool,
}

/// A `LORA_*` variable (or an [`AuditArgs`] field over it) whose value
/// cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable}={value:?}: {reason}")]
pub struct OptionsError {
    /// The variable.
    pub variable: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl LoraOptions {
    /// Read the `LORA_*` switches from the process environment. Call it once
    /// at startup; everything else takes the returned value.
    pub fn from_env() -> Result<LoraOptions, OptionsError> {
        LoraOptions::from_vars(|name| std::env::var(name).ok())
    }

    /// These options with `args` over them; a rank of 0 is refused, naming
    /// the field.
    pub fn with_args(mut self, args: AuditArgs) -> Result<LoraOptions, OptionsError> {
        for (field, value) in [("max_rank", args.max_rank), ("expert_rank", args.expert_rank)] {
            if value == Some(0) {
                return Err(OptionsError {
                    variable: field,
                    value: "0".to_string(),
                    reason: "must be at least 1",
                });
            }
        }
        self.max_rank = args.max_rank.unwrap_or(self.max_rank);
        self.expert_rank = args.expert_rank.unwrap_or(self.expert_rank);
        self.allow_partial |= args.allow_partial;
        self.experts |= args.experts;
        self.dora |= args.dora;
        self.placement = placement_over(self.placement, args)?;
        self.embedding_lora |= args.embedding_lora;
        self.lm_head_lora |= args.lm_head_lora;
        self.dora_unplaced("dora")?;
        Ok(self)
    }

    /// DoRA is served on an unplaced pool only (tensor and expert world 1):
    /// its rescale divides by the norm of each whole weight row
    /// `‖W + s·B A‖`, whose input columns a row-parallel rank does not hold,
    /// and the per-rank rescale is not built. `variable` names the switch
    /// in the refusal.
    fn dora_unplaced(&self, variable: &'static str) -> Result<(), OptionsError> {
        if self.dora && (self.placement.tp_world() > 1 || self.placement.ep_world() > 1) {
            return Err(OptionsError {
                variable,
                value: "1".to_string(),
                reason: "DoRA is not served under tensor or expert parallelism (tp_world or ep_world above 1)",
            });
        }
        Ok(())
    }

    /// The slot layout of a pool built with these options for `cfg`: the
    /// dense pairs at `max_rank`, the embedding pair's place when
    /// [`LoraOptions::embedding_lora`] is on and the head pair's when
    /// [`LoraOptions::lm_head_lora`] is, each sized to the rank's shard of
    /// [`LoraOptions::placement`] (the embedding and head pairs whole on
    /// every rank, or the rank's vocabulary block under
    /// [`Placement::vocab_parallel`]; a column-parallel pair's A only the
    /// rank's block of rank rows under [`Placement::fully_sharded`]). Every
    /// pool, packer and lander takes
    /// its layout from here.
    pub fn slot_layout(&self, cfg: &ModelConfig) -> Result<SlotLayout, LayoutError> {
        let places = ModelPlaces {
            embedding: self.embedding_lora,
            lm_head: self.lm_head_lora,
        };
        SlotLayout::walk(cfg, self.max_rank, self.placement, places)
    }

    /// Build the options from a variable lookup (`None`: unset). Booleans are
    /// true for `1` or `true` in any case; numbers are decimal; an empty
    /// value counts as unset. `LORA_PEER` set implies `rotatable`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<LoraOptions, OptionsError> {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let defaults = LoraOptions::default();
        let number = |name: &'static str, default: usize, min: usize| -> Result<usize, OptionsError> {
            let Some(raw) = get(name) else {
                return Ok(default);
            };
            let n = raw.trim().parse::<usize>().map_err(|_| OptionsError {
                variable: name,
                value: raw.clone(),
                reason: "expected a non-negative decimal integer",
            })?;
            if n < min {
                return Err(OptionsError {
                    variable: name,
                    value: raw,
                    reason: "must be at least 1",
                });
            }
            Ok(n)
        };
        let flag = |name: &str| {
            get(name).is_some_and(|v| {
                let v = v.trim();
                v == "1" || v.eq_ignore_ascii_case("true")
            })
        };
        let peer = get("LORA_PEER").map(|p| p.trim().to_string());
        let expert_slot_bytes = match get("LORA_EXPERT_SLOT_BYTES") {
            None => None,
            Some(_) => Some(number("LORA_EXPERT_SLOT_BYTES", 0, 1)?),
        };
        let max_loras = number("LORA_MAX_LORAS", defaults.max_loras, 1)?;
        let pinned = number("LORA_PINNED", defaults.pinned, 0)?;
        if pinned > max_loras {
            return Err(OptionsError {
                variable: "LORA_PINNED",
                value: pinned.to_string(),
                reason: "exceeds LORA_MAX_LORAS",
            });
        }
        let tp_world = number("LORA_TP_WORLD", 1, 1)?;
        let tp_rank = number("LORA_TP_RANK", 0, 0)?;
        let placement = Placement::new(tp_rank, tp_world).map_err(|e| match e {
            PlacementError::ZeroWorld => OptionsError {
                variable: "LORA_TP_WORLD",
                value: tp_world.to_string(),
                reason: "must be at least 1",
            },
            _ => OptionsError {
                variable: "LORA_TP_RANK",
                value: tp_rank.to_string(),
                reason: "must be below LORA_TP_WORLD",
            },
        })?;
        let ep_world = number("LORA_EP_WORLD", 1, 1)?;
        let ep_rank = number("LORA_EP_RANK", 0, 0)?;
        let placement = placement
            .with_experts(ep_rank, ep_world)
            .map_err(|e| match e {
                PlacementError::ZeroExpertWorld => OptionsError {
                    variable: "LORA_EP_WORLD",
                    value: ep_world.to_string(),
                    reason: "must be at least 1",
                },
                _ => OptionsError {
                    variable: "LORA_EP_RANK",
                    value: ep_rank.to_string(),
                    reason: "must be below LORA_EP_WORLD",
                },
            })?
            .with_vocab_parallel(flag("LORA_VOCAB_PARALLEL"))
            .with_fully_sharded(flag("LORA_FULLY_SHARDED"));
        let options = LoraOptions {
            max_loras,
            max_rank: number("LORA_MAX_RANK", defaults.max_rank, 1)?,
            pinned,
            allow_partial: flag("LORA_ALLOW_PARTIAL"),
            experts: flag("LORA_EXPERTS"),
            expert_rank: number("LORA_EXPERT_RANK", defaults.expert_rank, 1)?,
            expert_slot_bytes,
            eager: flag("LORA_EAGER"),
            rotatable: flag("LORA_ROTATE") || peer.is_some(),
            peer,
            host_tier_bytes: number("LORA_HOST_TIER_BYTES", defaults.host_tier_bytes, 0)?,
            dora: flag("LORA_DORA"),
            placement,
            embedding_lora: flag("LORA_EMBEDDING_LORA"),
            lm_head_lora: flag("LORA_LM_HEAD_LORA"),
        };
        options.dora_unplaced("LORA_DORA")?;
        Ok(options)
    }
}

/// `placement` with the ranks and world sizes `args` sets replaced.
fn placement_over(placement: Placement, args: AuditArgs) -> Result<Placement, OptionsError> {
    let tp_rank = args.tp_rank.unwrap_or(placement.tp_rank());
    let tp_world = args.tp_world.unwrap_or(placement.tp_world());
    let ep_rank = args.ep_rank.unwrap_or(placement.ep_rank());
    let ep_world = args.ep_world.unwrap_or(placement.ep_world());
    let refuse = |variable: &'static str, value: usize, reason: &'static str| OptionsError {
        variable,
        value: value.to_string(),
        reason,
    };
    Placement::new(tp_rank, tp_world)
        .map_err(|e| match e {
            PlacementError::ZeroWorld => refuse("tp_world", tp_world, "must be at least 1"),
            _ => refuse("tp_rank", tp_rank, "must be below tp_world"),
        })?
        .with_experts(ep_rank, ep_world)
        .map_err(|e| match e {
            PlacementError::ZeroExpertWorld => refuse("ep_world", ep_world, "must be at least 1"),
            _ => refuse("ep_rank", ep_rank, "must be below ep_world"),
        })
        .map(|p| {
            p.with_vocab_parallel(placement.vocab_parallel() || args.vocab_parallel)
                .with_fully_sharded(placement.fully_sharded() || args.fully_sharded)
        })
}

#[cfg(test)]
mod tests;
