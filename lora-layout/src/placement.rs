//! Tensor-parallel placement: which part of each LoRA pair a rank holds.
//!
//! A [`Placement`] names one rank of a tensor-parallel group
//! (`tp_rank < tp_world`). Each dense module is split the way the base
//! model's own projection is split (vLLM's `ColumnParallelLinear`,
//! `QKVParallelLinear`, `MergedColumnParallelLinear`, `RowParallelLinear`,
//! `ReplicatedLinear`; transformers' `base_model_tp_plan` says `colwise` /
//! `rowwise` for the same modules), so a rank's delta lands on exactly the
//! base output that rank computes:
//!
//! - [`ShardKind::Column`] (q, k, v, gate, up, Phi-3's fused `qkv_proj` and
//!   `gate_up_proj`, MLA `q_proj` / `q_b_proj` / `kv_b_proj`, the shared
//!   expert's gate and up): B is cut by output rows, A is whole. The rank's
//!   delta is its own output columns. A fused module's rank part is one
//!   block of each fused part (q, k, v; gate, up), in the fused order, as
//!   vLLM's merged loaders cut them: not one contiguous block of the fused
//!   width.
//! - [`ShardKind::Row`] (o, down, the shared expert's down, Qwen3-Next's
//!   `linear_attn.out_proj`): A is cut by input columns, B is whole. The
//!   rank's delta is a partial sum over its input slice, added to its
//!   partial base output; the base model's all-reduce sums the ranks.
//! - [`ShardKind::Replicated`] (MLA `q_a_proj` and `kv_a_proj_with_mqa`,
//!   vLLM's `ReplicatedLinear`; `shared_expert_gate`, `[1, hidden]`): every
//!   rank holds the whole pair and computes the whole delta.
//! - The input embedding's pair (`PairKey::Embedding`, in a layout made
//!   with the embedding place) and the output head's pair
//!   (`PairKey::LmHead`, with the head place) follow the base model's
//!   vocabulary split ([`ModuleShard::embedding`], [`ModuleShard::lm_head`]).
//!   By default ([`Placement::vocab_parallel`] off) both are replicated:
//!   the base model keeps the embedding table and `lm_head` whole on every
//!   rank, so every rank holds both pairs whole, adds the whole embedding
//!   delta to its whole rows and the whole head delta to its whole logits.
//!   With the vocab-parallel cut on (vLLM's `VocabParallelEmbedding` /
//!   `ParallelLMHead`), rank `r` holds the vocabulary rows `r·V/W ..
//!   (r+1)·V/W` of both tables ([`Placement::vocab_range`], `V =
//!   vocab_size`, `W = tp_world`; a `V` that does not divide is refused
//!   naming `vocab_size`, [`PlacementError::IndivisibleVocab`]: no padding
//!   rule). The embedding pair is then cut like a row-parallel module:
//!   `lora_embedding_A [r, V]` by the rank's vocabulary columns, B whole; a
//!   token of the rank's range gets `scale·B·A[:, t]` there, a token
//!   outside gets nothing on that rank (its base embedding row is zeros
//!   there too), and the engine's all-reduce of the embedding output sums
//!   the ranks. The head pair is cut like a column-parallel module:
//!   `lm_head.lora_B [V, r]` by the rank's vocabulary rows, A whole; the
//!   rank's delta is its own logit columns, which the engine all-gathers.
//!   A tied head follows the embedding table's split (the same rows).
//!
//! Units of a cut, per family (the base model's): attention projections are
//! cut by heads (`num_attention_heads` for q, o and the MLA projections;
//! each head is `head_dim` wide, `2·head_dim` for Qwen3-Next's query-and-gate
//! `q_proj`, `qk_head_dim` for MLA queries, `qk_nope + v_head_dim` for
//! `kv_b_proj`, `v_head_dim` for MLA `o_proj`), key and value projections by
//! `num_key_value_heads`, the gated delta net's `out_proj` by
//! `linear_num_value_heads`, MLPs by elements of `intermediate_size` (the
//! shared expert's width for shared experts). A unit count must be a
//! multiple of `tp_world`, or the placement is refused naming the dimension
//! ([`PlacementError::Indivisible`]). Key/value heads fewer than ranks are
//! replicated as vLLM's `QKVParallelLinear` replicates them: `tp_world` must
//! then be a multiple of `num_key_value_heads`, and rank `r` holds head
//! `r / (tp_world / num_key_value_heads)`; each head is held by
//! `tp_world / num_key_value_heads` ranks ([`OutSegment::replicas`]).
//!
//! The fully-sharded option ([`Placement::with_fully_sharded`], vLLM's
//! `fully_sharded_loras`) cuts A of every [`ShardKind::Column`] module by
//! rank rows too: rank `r` holds rows `r·R/W .. (r+1)·R/W` of A padded to
//! `R = max_rank` ([`ModuleShard::rank_rows`]; an adapter of rank below
//! `max_rank` is zero-padded first, so every rank's cut is defined), and B's
//! rank output rows with every rank column. The rank's shrink gives `[n,
//! R/W]`; the ranks all-gather their shrink outputs into `[n, R]` before
//! the expand by the rank's B rows, so the rank's delta is still its own
//! output columns. `max_rank` must be a multiple of `tp_world`, or the
//! layout is refused naming `max_rank` ([`PlacementError::IndivisibleRank`]).
//! Row-parallel and replicated modules keep the rule above under the option
//! (vLLM also all-reduces row-parallel shrink outputs; that is not built
//! here: a row-parallel rank's A is already cut by input columns);
//! the embedding and head pairs keep their rule too: the vocab-parallel
//! head pair's A stays whole, only its B is cut by vocabulary rows).
//!
//! Expert parallelism is the placement's second axis (`ep_rank <
//! ep_world`, independent of the tensor-parallel one): routed experts are
//! never cut by tensor parallelism here; an expert-parallel rank holds
//! whole experts, a contiguous block of them, as vLLM's expert map assigns
//! them without a placement strategy: rank `r` holds experts `r·E/W ..
//! (r+1)·E/W` of `E = num_experts` ([`Placement::expert_range`]); `E` must
//! be a multiple of `ep_world`, or the placement is refused naming
//! `num_experts` ([`PlacementError::IndivisibleExperts`]). The router (gate)
//! is replicated: every rank holds its whole pair
//! ([`Placement::holds_expert_site`]). Routed experts with `tp_world > 1`
//! and `ep_world == 1` (experts cut by their intermediate width) are not
//! built: the pool refuses them.

use std::ops::Range;

use crate::config::{ModelConfig, ModelFamily};
use crate::module::{ExpertSite, LoraModule};

/// How a module's pair is split across tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardKind {
    /// B cut by output rows, A whole: the rank's delta is its output columns.
    Column,
    /// A cut by input columns, B whole: the rank's delta is a partial sum.
    Row,
    /// Both whole on every rank: every rank computes the whole delta.
    Replicated,
}

impl LoraModule {
    /// How the base model splits this projection across tensor-parallel
    /// ranks (the same for every family that has it).
    pub fn shard_kind(self) -> ShardKind {
        match self {
            LoraModule::QProj
            | LoraModule::KProj
            | LoraModule::VProj
            | LoraModule::QBProj
            | LoraModule::KvBProj
            | LoraModule::GateProj
            | LoraModule::UpProj
            | LoraModule::SharedGateProj
            | LoraModule::SharedUpProj
            | LoraModule::QkvProj
            | LoraModule::GateUpProj => ShardKind::Column,
            LoraModule::OProj | LoraModule::DownProj | LoraModule::SharedDownProj | LoraModule::LinearAttnOutProj => {
                ShardKind::Row
            }
            LoraModule::QAProj | LoraModule::KvAProjWithMqa | LoraModule::SharedExpertGate => ShardKind::Replicated,
        }
    }
}

/// A placement that cannot be built, or a model geometry it cannot split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// `tp_world` is 0.
    #[error("tp_world must be at least 1")]
    ZeroWorld,
    /// `tp_rank` is not below `tp_world`.
    #[error("tp_rank {tp_rank} is not below tp_world {tp_world}")]
    RankOutOfRange {
        /// The rank.
        tp_rank: usize,
        /// The world size.
        tp_world: usize,
    },
    /// `ep_world` is 0.
    #[error("ep_world must be at least 1")]
    ZeroExpertWorld,
    /// `ep_rank` is not below `ep_world`.
    #[error("ep_rank {ep_rank} is not below ep_world {ep_world}")]
    ExpertRankOutOfRange {
        /// The rank.
        ep_rank: usize,
        /// The world size.
        ep_world: usize,
    },
    /// The routed experts do not split into equal blocks over the
    /// expert-parallel ranks.
    #[error("num_experts = {num_experts} is not a multiple of ep_world = {ep_world}")]
    IndivisibleExperts {
        /// The model's routed experts per layer.
        num_experts: usize,
        /// The expert-parallel world size.
        ep_world: usize,
    },
    /// Under the fully-sharded option, the rank every pair is padded to does
    /// not split into equal blocks of A's rows over the ranks.
    #[error("max_rank = {max_rank} is not a multiple of tp_world = {tp_world} (fully-sharded A is cut by rank rows)")]
    IndivisibleRank {
        /// The pool's `max_rank`.
        max_rank: usize,
        /// The tensor-parallel world size.
        tp_world: usize,
    },
    /// The vocabulary does not split into equal blocks over the
    /// tensor-parallel ranks under the vocab-parallel cut.
    #[error(
        "vocab_size = {vocab_size} is not a multiple of tp_world = {tp_world} (vocab-parallel embedding and lm_head)"
    )]
    IndivisibleVocab {
        /// The model's vocabulary.
        vocab_size: usize,
        /// The tensor-parallel world size.
        tp_world: usize,
    },
    /// A dimension the placement cuts does not split over the ranks.
    #[error("{module}: {dimension} = {size} {rule} tp_world = {tp_world}")]
    Indivisible {
        /// The module whose cut needs it.
        module: LoraModule,
        /// The config field (or derived width) that is cut.
        dimension: &'static str,
        /// Its value.
        size: usize,
        /// What it must be: `is not a multiple of`, or for replicated key /
        /// value heads `neither is a multiple nor a divisor of`.
        rule: &'static str,
        /// The world size.
        tp_world: usize,
    },
}

/// One rank of a tensor-parallel group, and of an expert-parallel group;
/// with [`Placement::vocab_parallel`], the embedding and head pairs follow
/// the base model's vocab-parallel split; with [`Placement::fully_sharded`],
/// A of every column-parallel module is cut by rank rows too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    tp_rank: usize,
    tp_world: usize,
    ep_rank: usize,
    ep_world: usize,
    fully_sharded: bool,
    vocab_parallel: bool,
}

impl Default for Placement {
    fn default() -> Placement {
        Placement::SINGLE
    }
}

impl Placement {
    /// No tensor or expert parallelism: rank 0 of 1, every pair whole.
    pub const SINGLE: Placement = Placement {
        tp_rank: 0,
        tp_world: 1,
        ep_rank: 0,
        ep_world: 1,
        fully_sharded: false,
        vocab_parallel: false,
    };

    /// Tensor-parallel rank `tp_rank` of `tp_world`, every expert held.
    pub fn new(tp_rank: usize, tp_world: usize) -> Result<Placement, PlacementError> {
        if tp_world == 0 {
            return Err(PlacementError::ZeroWorld);
        }
        if tp_rank >= tp_world {
            return Err(PlacementError::RankOutOfRange { tp_rank, tp_world });
        }
        Ok(Placement {
            tp_rank,
            tp_world,
            ..Placement::SINGLE
        })
    }

    /// This placement as expert-parallel rank `ep_rank` of `ep_world`.
    pub fn with_experts(self, ep_rank: usize, ep_world: usize) -> Result<Placement, PlacementError> {
        if ep_world == 0 {
            return Err(PlacementError::ZeroExpertWorld);
        }
        if ep_rank >= ep_world {
            return Err(PlacementError::ExpertRankOutOfRange { ep_rank, ep_world });
        }
        Ok(Placement {
            ep_rank,
            ep_world,
            ..self
        })
    }

    /// This placement with the fully-sharded option on or off: A of every
    /// column-parallel module cut by rank rows too, the shrink outputs
    /// all-gathered before the expand (see the module docs).
    pub fn with_fully_sharded(self, fully_sharded: bool) -> Placement {
        Placement { fully_sharded, ..self }
    }

    /// Whether the fully-sharded option is on.
    pub fn fully_sharded(self) -> bool {
        self.fully_sharded
    }

    /// This placement with the vocab-parallel cut of the embedding and
    /// head pairs on or off (see the module docs; off: replicated).
    pub fn with_vocab_parallel(self, on: bool) -> Placement {
        Placement {
            vocab_parallel: on,
            ..self
        }
    }

    /// Whether the embedding and head pairs follow the vocab-parallel cut.
    pub fn vocab_parallel(self) -> bool {
        self.vocab_parallel
    }

    /// The vocabulary rows (token ids) this rank holds of `vocab_size`: the
    /// contiguous block `tp_rank·V/tp_world .. (tp_rank+1)·V/tp_world` under
    /// the vocab-parallel cut, every row otherwise (and at world 1); or
    /// [`PlacementError::IndivisibleVocab`] naming `vocab_size`.
    pub fn vocab_range(self, vocab_size: usize) -> Result<Range<usize>, PlacementError> {
        if !self.vocab_parallel {
            return Ok(0..vocab_size);
        }
        if !vocab_size.is_multiple_of(self.tp_world) {
            return Err(PlacementError::IndivisibleVocab {
                vocab_size,
                tp_world: self.tp_world,
            });
        }
        let per = vocab_size / self.tp_world;
        Ok(self.tp_rank * per..(self.tp_rank + 1) * per)
    }

    /// The expert-parallel rank.
    pub fn ep_rank(self) -> usize {
        self.ep_rank
    }

    /// The expert-parallel world size.
    pub fn ep_world(self) -> usize {
        self.ep_world
    }

    /// The routed experts this rank holds of `num_experts`: the contiguous
    /// block `ep_rank·E/ep_world .. (ep_rank+1)·E/ep_world`, or
    /// [`PlacementError::IndivisibleExperts`] naming `num_experts`.
    pub fn expert_range(self, num_experts: usize) -> Result<Range<usize>, PlacementError> {
        if !num_experts.is_multiple_of(self.ep_world) {
            return Err(PlacementError::IndivisibleExperts {
                num_experts,
                ep_world: self.ep_world,
            });
        }
        let per = num_experts / self.ep_world;
        Ok(self.ep_rank * per..(self.ep_rank + 1) * per)
    }

    /// Whether this rank's expert pool holds `site` of a model with
    /// `num_experts` routed experts: the router always (replicated), an
    /// expert when it is in [`Placement::expert_range`].
    pub fn holds_expert_site(self, site: ExpertSite, num_experts: usize) -> Result<bool, PlacementError> {
        let range = self.expert_range(num_experts)?;
        Ok(match site {
            ExpertSite::Router => true,
            ExpertSite::Expert { expert, .. } => range.contains(&expert),
        })
    }

    /// Every expert-parallel rank of this placement's group (same
    /// tensor-parallel rank), in rank order.
    pub fn expert_ranks(self) -> impl Iterator<Item = Placement> {
        (0..self.ep_world).map(move |ep_rank| Placement { ep_rank, ..self })
    }

    /// The rank.
    pub fn tp_rank(self) -> usize {
        self.tp_rank
    }

    /// The world size.
    pub fn tp_world(self) -> usize {
        self.tp_world
    }

    /// Every tensor-parallel rank of this placement's group (same
    /// expert-parallel rank), in rank order.
    pub fn ranks(self) -> impl Iterator<Item = Placement> {
        (0..self.tp_world).map(move |tp_rank| Placement { tp_rank, ..self })
    }
}

/// A block of B's output rows a rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OutSegment {
    /// First output row of the unsharded B.
    pub start: usize,
    /// Rows.
    pub len: usize,
    /// How many ranks hold these same rows: 1 for a cut, `tp_world /
    /// num_key_value_heads` for a replicated key/value head, `tp_world` for
    /// a whole factor.
    pub replicas: usize,
}

/// At most this many output segments: Phi-3's fused q | k | v.
pub const MAX_OUT_SEGMENTS: usize = 3;

/// The part of one module's pair that a rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModuleShard {
    /// How the module is split.
    pub kind: ShardKind,
    /// `(out, in)` of the unsharded projection.
    pub full_dims: (usize, usize),
    /// First input column of A the rank holds.
    pub in_start: usize,
    /// Input columns the rank holds (`in` unless [`ShardKind::Row`]).
    pub in_len: usize,
    segments: [OutSegment; MAX_OUT_SEGMENTS],
    n_segments: usize,
    /// Ranks holding the same A columns: 1 for a row cut, `tp_world` when A
    /// is whole.
    pub in_replicas: usize,
    /// Equal blocks A's (padded) rank rows are cut into: 1 (A holds every
    /// rank row), or `tp_world` for a column-parallel module under the
    /// fully-sharded option.
    pub rank_parts: usize,
    /// The block of A's rank rows this rank holds (below `rank_parts`).
    pub rank_part: usize,
}

impl ModuleShard {
    /// The whole pair on a single rank (the unsharded case; also the expert
    /// pool's places).
    pub fn whole(kind: ShardKind, out: usize, inp: usize) -> ModuleShard {
        ModuleShard::replicated(kind, out, inp, 1)
    }

    fn replicated(kind: ShardKind, out: usize, inp: usize, replicas: usize) -> ModuleShard {
        let seg = OutSegment {
            start: 0,
            len: out,
            replicas,
        };
        ModuleShard {
            kind,
            full_dims: (out, inp),
            in_start: 0,
            in_len: inp,
            segments: [seg, seg, seg],
            n_segments: 1,
            in_replicas: replicas,
            rank_parts: 1,
            rank_part: 0,
        }
    }

    /// B's output rows the rank holds, in the order it stores them.
    pub fn segments(&self) -> &[OutSegment] {
        &self.segments[..self.n_segments]
    }

    /// `(out, in)` the rank stores: rows of its B, columns of its A.
    pub fn dims(&self) -> (usize, usize) {
        (self.segments().iter().map(|s| s.len).sum(), self.in_len)
    }

    /// Whether the rank holds the whole pair.
    pub fn is_whole(&self) -> bool {
        self.dims() == self.full_dims && self.rank_parts == 1
    }

    /// The rows of A (padded to `stride`) the rank holds: all of them, or
    /// under the fully-sharded option block `rank_part` of `rank_parts`
    /// equal blocks. [`PlacementError::IndivisibleRank`] when the blocks
    /// are not equal.
    pub fn rank_rows(&self, stride: usize) -> Result<Range<usize>, PlacementError> {
        if !stride.is_multiple_of(self.rank_parts) {
            return Err(PlacementError::IndivisibleRank {
                max_rank: stride,
                tp_world: self.rank_parts,
            });
        }
        let per = stride / self.rank_parts;
        Ok(self.rank_part * per..(self.rank_part + 1) * per)
    }

    /// The unsharded B row of the rank's stored row `row`.
    pub fn src_row(&self, row: usize) -> Option<usize> {
        let mut rest = row;
        for s in self.segments() {
            if rest < s.len {
                return Some(s.start + rest);
            }
            rest -= s.len;
        }
        None
    }

    /// The input embedding pair's shard for `placement` on `cfg`
    /// (`(hidden_size, vocab_size)`): replicated, whole on every rank,
    /// unless the placement is [`Placement::vocab_parallel`]; then A is cut
    /// to the rank's vocabulary columns ([`Placement::vocab_range`]) and B
    /// is whole, as a row-parallel module's (the ranks' deltas sum).
    pub fn embedding(cfg: &ModelConfig, placement: Placement) -> Result<ModuleShard, PlacementError> {
        let (hidden, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let range = placement.vocab_range(vocab)?;
        if !placement.vocab_parallel || placement.tp_world == 1 {
            return Ok(ModuleShard::replicated(
                ShardKind::Replicated,
                hidden,
                vocab,
                placement.tp_world,
            ));
        }
        let shard = ModuleShard::replicated(ShardKind::Row, hidden, vocab, placement.tp_world);
        Ok(shard.row_cut(OutSegment {
            start: range.start,
            len: range.len(),
            replicas: 1,
        }))
    }

    /// The output head pair's shard for `placement` on `cfg`
    /// (`(vocab_size, hidden_size)`): replicated, whole on every rank,
    /// unless the placement is [`Placement::vocab_parallel`]; then B is cut
    /// to the rank's vocabulary rows ([`Placement::vocab_range`]) and A is
    /// whole, as a column-parallel module's (the rank's delta is its logit
    /// columns).
    pub fn lm_head(cfg: &ModelConfig, placement: Placement) -> Result<ModuleShard, PlacementError> {
        let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
        let range = placement.vocab_range(vocab)?;
        if !placement.vocab_parallel || placement.tp_world == 1 {
            return Ok(ModuleShard::replicated(
                ShardKind::Replicated,
                vocab,
                hidden,
                placement.tp_world,
            ));
        }
        let mut shard = ModuleShard::replicated(ShardKind::Column, vocab, hidden, placement.tp_world);
        shard.segments[0] = OutSegment {
            start: range.start,
            len: range.len(),
            replicas: 1,
        };
        Ok(shard)
    }

    /// The shard of `module` for `placement` on `cfg`.
    pub fn of(module: LoraModule, cfg: &ModelConfig, placement: Placement) -> Result<ModuleShard, PlacementError> {
        let (out, inp) = module.dims(cfg);
        let kind = module.shard_kind();
        let world = placement.tp_world;
        if world == 1 {
            return Ok(ModuleShard::whole(kind, out, inp));
        }
        let rank = placement.tp_rank;
        let heads = cfg.num_attention_heads;
        let kv = cfg.num_key_value_heads;
        let inter = cfg.intermediate_size;
        let indivisible = |dimension: &'static str, size: usize| PlacementError::Indivisible {
            module,
            dimension,
            size,
            rule: "is not a multiple of",
            tp_world: world,
        };
        // `units` units of `width` rows (or columns) each, cut into
        // `world` equal blocks; rank's block, offset by `base`.
        let cut = |dimension: &'static str, units: usize, width: usize, base: usize| {
            if !units.is_multiple_of(world) {
                return Err(indivisible(dimension, units));
            }
            let per = units / world * width;
            Ok(OutSegment {
                start: base + rank * per,
                len: per,
                replicas: 1,
            })
        };
        // Key/value heads: cut when there are at least as many as ranks,
        // else each rank holds one head, shared by world / kv ranks.
        let kv_cut = |base: usize| {
            if kv >= world {
                return cut("num_key_value_heads", kv, cfg.head_dim, base);
            }
            if !world.is_multiple_of(kv) {
                return Err(PlacementError::Indivisible {
                    module,
                    dimension: "num_key_value_heads",
                    size: kv,
                    rule: "neither is a multiple nor a divisor of",
                    tp_world: world,
                });
            }
            let replicas = world / kv;
            Ok(OutSegment {
                start: base + rank / replicas * cfg.head_dim,
                len: cfg.head_dim,
                replicas,
            })
        };
        let shared_field = match cfg.family {
            ModelFamily::DeepseekV3 | ModelFamily::Glm4Moe => "moe_intermediate_size * n_shared_experts",
            _ => "shared_expert_intermediate_size",
        };
        let mut shard = ModuleShard::replicated(kind, out, inp, world);
        let segments: Vec<OutSegment> = match module {
            LoraModule::QProj | LoraModule::QBProj | LoraModule::KvBProj => {
                vec![cut("num_attention_heads", heads, out / heads, 0)?]
            }
            LoraModule::KProj | LoraModule::VProj => vec![kv_cut(0)?],
            LoraModule::GateProj | LoraModule::UpProj => vec![cut("intermediate_size", inter, 1, 0)?],
            LoraModule::SharedGateProj | LoraModule::SharedUpProj => vec![cut(shared_field, out, 1, 0)?],
            LoraModule::QkvProj => {
                let q_width = heads * cfg.head_dim;
                let kv_width = kv * cfg.head_dim;
                vec![
                    cut("num_attention_heads", heads, cfg.head_dim, 0)?,
                    kv_cut(q_width)?,
                    kv_cut(q_width + kv_width)?,
                ]
            }
            LoraModule::GateUpProj => vec![
                cut("intermediate_size", inter, 1, 0)?,
                cut("intermediate_size", inter, 1, inter)?,
            ],
            LoraModule::OProj => {
                let cols = cut("num_attention_heads", heads, inp / heads, 0)?;
                return Ok(shard.row_cut(cols));
            }
            LoraModule::DownProj => return Ok(shard.row_cut(cut("intermediate_size", inter, 1, 0)?)),
            LoraModule::SharedDownProj => return Ok(shard.row_cut(cut(shared_field, inp, 1, 0)?)),
            LoraModule::LinearAttnOutProj => {
                let units = cfg.linear_attn.as_ref().map_or(1, |l| l.num_value_heads);
                let cols = cut("linear_num_value_heads", units, inp / units.max(1), 0)?;
                return Ok(shard.row_cut(cols));
            }
            LoraModule::QAProj | LoraModule::KvAProjWithMqa | LoraModule::SharedExpertGate => return Ok(shard),
        };
        for (i, s) in segments.iter().enumerate() {
            shard.segments[i] = *s;
        }
        shard.n_segments = segments.len();
        if placement.fully_sharded {
            shard.rank_parts = world;
            shard.rank_part = rank;
        }
        Ok(shard)
    }

    /// This (whole, `tp_world`-replicated) shard with A cut to `cols` and B
    /// whole on every rank.
    fn row_cut(mut self, cols: OutSegment) -> ModuleShard {
        self.in_start = cols.start;
        self.in_len = cols.len;
        self.in_replicas = 1;
        self
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod vocab_tests;
