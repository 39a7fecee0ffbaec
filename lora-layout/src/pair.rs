//! One name for every LoRA pair a pool holds, dense or expert, and one view
//! of both slot layouts, so packers and landers treat them alike.

use crate::layout::{ExpertLayout, SlotLayout};
use crate::module::{ExpertSite, LoraModule};
use crate::placement::{ModuleShard, ShardKind};

/// Where a pair acts: a dense module of the slot pool, or an expert/router
/// site of the expert pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PairKey {
    /// A dense projection.
    Dense {
        /// Global layer.
        layer: usize,
        /// The module.
        module: LoraModule,
    },
    /// A routed-expert projection or a router.
    Expert {
        /// Global layer.
        layer: usize,
        /// The site.
        site: ExpertSite,
    },
    /// The input embedding (`lora_embedding_A` `[r, vocab]`,
    /// `lora_embedding_B` `[hidden, r]`), in a slot layout made
    /// [`SlotLayout::with_embedding`].
    Embedding,
    /// The output head (`lm_head.lora_A` `[r, hidden]`, `lora_B` `[vocab,
    /// r]`), in a slot layout whose [`ModelPlaces`](crate::ModelPlaces) ask
    /// for it.
    LmHead,
}

impl PairKey {
    /// The pair's layer (`None` for the embedding and the head, which are
    /// outside the decoder layers).
    pub fn layer(self) -> Option<usize> {
        match self {
            PairKey::Dense { layer, .. } | PairKey::Expert { layer, .. } => Some(layer),
            PairKey::Embedding | PairKey::LmHead => None,
        }
    }
}

impl std::fmt::Display for PairKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PairKey::Dense { layer, module } => write!(f, "layer {layer} {module}"),
            PairKey::Expert {
                layer,
                site: ExpertSite::Expert { expert, proj },
            } => write!(f, "layer {layer} expert {expert} {proj}"),
            PairKey::Expert {
                layer,
                site: ExpertSite::Router,
            } => write!(f, "layer {layer} router"),
            PairKey::Embedding => write!(f, "embedding"),
            PairKey::LmHead => write!(f, "lm_head"),
        }
    }
}

/// A pair's place in a slot: its dims and byte offsets from the slot base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairPlace {
    /// Which pair.
    pub key: PairKey,
    /// Output width.
    pub out_dim: usize,
    /// Input width.
    pub in_dim: usize,
    /// Byte offset of A (`[stride, in]`).
    pub a_offset: usize,
    /// Byte offset of B (`[out, stride]`).
    pub b_offset: usize,
    /// Which part of the source pair the place holds (`out_dim`, `in_dim`
    /// are its dims; the source tensors have `shard.full_dims`).
    pub shard: ModuleShard,
}

impl PairPlace {
    /// The rows of A (padded to `stride`) the place holds
    /// ([`ModuleShard::rank_rows`]): `0..stride` unless the fully-sharded
    /// option cut them. Its A is `[rows.len(), in]`.
    pub fn a_rows(&self, stride: usize) -> std::ops::Range<usize> {
        // A layout refuses a cut that does not divide; a place of one holds
        // equal blocks.
        self.shard.rank_rows(stride).unwrap_or(0..stride)
    }

    /// The rows of a rank-`rank` pair's A the place holds with data: its
    /// [`PairPlace::a_rows`] below `rank` (the rest of its block is zero
    /// padding). A packer copies these source rows to the start of the
    /// place's A; a peer stages and a lander lands exactly them. Empty on a
    /// fully-sharded rank whose block lies past the pair's rank.
    pub fn a_used_rows(&self, stride: usize, rank: usize) -> std::ops::Range<usize> {
        let rows = self.a_rows(stride);
        rows.start.min(rank)..rows.end.min(rank)
    }
}

/// A slot layout seen as a list of pair places: [`SlotLayout`] (stride
/// `max_rank`) and [`ExpertLayout`] (stride `expert_packed_stride`).
pub trait PairLayout {
    /// The rank stride: rows of A, columns of B.
    fn stride(&self) -> usize;
    /// Bytes of the slot (or of the adapter's part of an expert slot).
    fn total_bytes(&self) -> usize;
    /// Number of places.
    fn len(&self) -> usize;
    /// Whether the layout has no places.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The `i`-th place in walk order.
    fn place(&self, i: usize) -> Option<PairPlace>;
    /// The walk index of `key`.
    fn position(&self, key: PairKey) -> Option<usize>;
}

impl PairLayout for SlotLayout {
    fn stride(&self) -> usize {
        self.max_rank()
    }
    fn total_bytes(&self) -> usize {
        self.slot_bytes()
    }
    fn len(&self) -> usize {
        self.entries().len() + usize::from(self.embedding().is_some()) + usize::from(self.lm_head().is_some())
    }
    fn place(&self, i: usize) -> Option<PairPlace> {
        if let Some(e) = self.entries().get(i) {
            return Some(PairPlace {
                key: PairKey::Dense {
                    layer: e.layer,
                    module: e.module,
                },
                out_dim: e.out_dim,
                in_dim: e.in_dim,
                a_offset: e.a_offset,
                b_offset: e.b_offset,
                shard: *self.shard(i)?,
            });
        }
        // The embedding's place follows the dense pairs, the head's it; the
        // layout's shards list both, in that order, after the dense pairs'.
        let embedding = self.embedding().map(|e| PairPlace {
            key: PairKey::Embedding,
            out_dim: e.hidden,
            in_dim: e.vocab,
            a_offset: e.a_offset,
            b_offset: e.b_offset,
            shard: ModuleShard::whole(ShardKind::Replicated, e.hidden, e.vocab),
        });
        let head = self.lm_head().map(|e| PairPlace {
            key: PairKey::LmHead,
            out_dim: e.vocab,
            in_dim: e.hidden,
            a_offset: e.a_offset,
            b_offset: e.b_offset,
            shard: ModuleShard::whole(ShardKind::Replicated, e.vocab, e.hidden),
        });
        let place = embedding
            .into_iter()
            .chain(head)
            .nth(i.checked_sub(self.entries().len())?)?;
        Some(PairPlace {
            shard: *self.shard(i)?,
            ..place
        })
    }
    fn position(&self, key: PairKey) -> Option<usize> {
        match key {
            PairKey::Dense { layer, module } => SlotLayout::position(self, layer, module),
            PairKey::Embedding => self.embedding().map(|_| self.entries().len()),
            PairKey::LmHead => self
                .lm_head()
                .map(|_| self.entries().len() + usize::from(self.embedding().is_some())),
            PairKey::Expert { .. } => None,
        }
    }
}

impl PairLayout for ExpertLayout {
    fn stride(&self) -> usize {
        ExpertLayout::stride(self)
    }
    fn total_bytes(&self) -> usize {
        self.bytes()
    }
    fn len(&self) -> usize {
        self.entries().len()
    }
    fn place(&self, i: usize) -> Option<PairPlace> {
        self.entries().get(i).map(|e| PairPlace {
            key: PairKey::Expert {
                layer: e.layer,
                site: e.site,
            },
            out_dim: e.out_dim,
            in_dim: e.in_dim,
            a_offset: e.a_offset,
            b_offset: e.b_offset,
            shard: ModuleShard::whole(ShardKind::Replicated, e.out_dim, e.in_dim),
        })
    }
    fn position(&self, key: PairKey) -> Option<usize> {
        match key {
            PairKey::Expert { layer, site } => ExpertLayout::position(self, layer, site),
            PairKey::Dense { .. } | PairKey::Embedding | PairKey::LmHead => None,
        }
    }
}
