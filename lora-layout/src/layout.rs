//! The byte layout of one pool slot and of the expert/router pool.
//!
//! There is one layout walk: layers ascending, then [`LoraModule::ALL`]
//! filtered by [`LoraModule::applies_to_layer`]; for each pair, A
//! (`max_rank * in` BF16 elements, row-major `[max_rank, in]`) then B
//! (`out * max_rank`, row-major `[out, max_rank]`); then, in a layout made
//! [`SlotLayout::with_embedding`], the input embedding's pair last: A
//! `[max_rank, vocab]` then B `[hidden, max_rank]` (PEFT's
//! `lora_embedding_A` / `lora_embedding_B`, a pair whose input is the
//! one-hot token). Then, in a layout whose [`ModelPlaces`] ask for it, the
//! output head's pair (`lm_head`): A `[max_rank, hidden]` then B `[vocab,
//! max_rank]`, a dense pair whose output is the logits. Under a
//! tensor-parallel [`Placement`] each dense (layer, module) pair is sized to
//! the rank's shard, and the embedding and head pairs stay whole
//! (replicated) or, under [`Placement::vocab_parallel`], hold the rank's
//! vocabulary block: A `[max_rank, V/W]` for the embedding, B `[V/W,
//! max_rank]` for the head ([`ModuleShard::embedding`],
//! [`ModuleShard::lm_head`]); under the fully-sharded option a
//! column-parallel dense pair's A holds only the rank's block of rank rows,
//! `[max_rank / tp_world, in]` ([`SlotEntry::a_rows`],
//! [`ModuleShard::rank_rows`]), and its B stays `[out, max_rank]`. [`SlotLayout`] is
//! that walk; [`pool_slot_bytes`], [`module_slot_offsets`] and every packer
//! read it, so they cannot disagree.
//!
//! *Why the embedding and head places are opt-in:* each costs `max_rank *
//! (vocab + hidden)` elements in every slot (for a 128k vocabulary at rank
//! 16, 4 MiB a slot), which a pool that never serves such adapters should
//! not pay.

use crate::config::ModelConfig;
use crate::module::{ExpertSite, LoraModule};
use crate::placement::{ModuleShard, Placement, PlacementError};

/// Bytes of one BF16 element.
pub const BF16_BYTES: usize = 2;

/// A layout size that cannot be represented.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A byte count overflowed `usize`.
    #[error("layout size overflows: {what}")]
    Overflow {
        /// Which quantity overflowed.
        what: &'static str,
    },
    /// `max_rank` (or the expert rank) is zero.
    #[error("{what} must be at least 1")]
    ZeroRank {
        /// `max_rank` or `expert_rank`.
        what: &'static str,
    },
    /// An expert-pool site is listed twice.
    #[error("layer {layer} lists expert site {site:?} twice")]
    DuplicateExpertSite {
        /// The layer.
        layer: usize,
        /// The site.
        site: ExpertSite,
    },
    /// An expert-pool site does not exist in the model.
    #[error("layer {layer} has no expert site {site:?}")]
    NoSuchExpertSite {
        /// The layer.
        layer: usize,
        /// The site.
        site: ExpertSite,
    },
    /// The tensor-parallel placement cannot split the model's geometry.
    #[error(transparent)]
    Placement(#[from] PlacementError),
}

fn overflow(what: &'static str) -> LayoutError {
    LayoutError::Overflow { what }
}

/// Bytes of one `[max_rank, in]` A plus one `[out, max_rank]` B, in BF16.
pub fn pair_bytes(out: usize, inp: usize, rank: usize) -> Result<usize, LayoutError> {
    let a = rank.checked_mul(inp).ok_or(overflow("A elements"))?;
    let b = out.checked_mul(rank).ok_or(overflow("B elements"))?;
    a.checked_add(b)
        .and_then(|e| e.checked_mul(BF16_BYTES))
        .ok_or(overflow("pair bytes"))
}

/// One (layer, module) pair's place in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotEntry {
    /// Global layer index.
    pub layer: usize,
    /// The module.
    pub module: LoraModule,
    /// Output width the slot holds: the projection's, or the rank's rows
    /// of it under a tensor-parallel placement ([`ModuleShard::dims`]).
    pub out_dim: usize,
    /// Input width the slot holds (the rank's columns for a row cut).
    pub in_dim: usize,
    /// Rows of A the slot holds: `max_rank`, or `max_rank / tp_world` (the
    /// rank's block of rank rows) for a column-parallel module under the
    /// fully-sharded option.
    pub a_rows: usize,
    /// Byte offset of A (`[a_rows, in]`) from the slot base.
    pub a_offset: usize,
    /// Byte offset of B (`[out, max_rank]`) from the slot base.
    pub b_offset: usize,
}

impl SlotEntry {
    /// The end of B: the byte offset where the next pair starts.
    pub fn end_offset(&self, max_rank: usize) -> usize {
        self.b_offset + self.out_dim * max_rank * BF16_BYTES
    }
}

/// The input embedding's pair place in a slot: A `[max_rank, vocab]`, B
/// `[hidden, max_rank]`. Under tensor parallelism the pair is replicated
/// (every rank holds it whole), or under [`Placement::vocab_parallel`] A
/// holds the rank's vocabulary columns ([`ModuleShard::embedding`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingEntry {
    /// The token id of A's first column: 0 unless vocab-parallel.
    pub vocab_start: usize,
    /// Token ids (embedding table rows) the slot holds columns of A for:
    /// `vocab_size`, or the rank's block of it. A's width.
    pub vocab: usize,
    /// Width of an embedding row (`hidden_size`): B's height.
    pub hidden: usize,
    /// Byte offset of A (`[max_rank, vocab]`) from the slot base.
    pub a_offset: usize,
    /// Byte offset of B (`[hidden, max_rank]`) from the slot base.
    pub b_offset: usize,
}

/// The output head's pair place in a slot: A `[max_rank, hidden]`, B
/// `[vocab, max_rank]` (PEFT's `lm_head.lora_A` / `lora_B`); under
/// [`Placement::vocab_parallel`], B's rows of the rank's vocabulary block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadEntry {
    /// Width of a hidden row (`hidden_size`): A's width.
    pub hidden: usize,
    /// The token id of B's first row: 0 unless vocab-parallel.
    pub vocab_start: usize,
    /// Rows of the head the slot holds (`vocab_size`, or the rank's block
    /// of it): B's height, the width of the rank's logits.
    pub vocab: usize,
    /// Byte offset of A (`[max_rank, hidden]`) from the slot base.
    pub a_offset: usize,
    /// Byte offset of B (`[vocab, max_rank]`) from the slot base.
    pub b_offset: usize,
}

/// The model-level pair places a slot layout has beside the (layer,
/// module) pairs; both off is [`SlotLayout::new`]'s layout.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelPlaces {
    /// The input embedding's pair ([`EmbeddingEntry`]).
    pub embedding: bool,
    /// The output head's pair ([`HeadEntry`]), after the embedding's.
    pub lm_head: bool,
}

/// The layout of one pool slot for a model, a `max_rank` and a
/// tensor-parallel [`Placement`]: every (layer, module) pair in walk order
/// with its offsets, each sized to the rank's shard, and the embedding and
/// head pairs' places (whole, or the rank's vocabulary block) when the layout has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotLayout {
    max_rank: usize,
    placement: Placement,
    entries: Vec<SlotEntry>,
    /// `shards[i]`: the rank's part of the `i`-th pair in walk order (the
    /// embedding pair's then the head pair's, (whole or the rank's vocabulary block) last when the
    /// layout has them).
    shards: Vec<ModuleShard>,
    embedding: Option<EmbeddingEntry>,
    lm_head: Option<HeadEntry>,
    slot_bytes: usize,
    /// `index[layer * ALL.len() + module.index()]` = entry index, or `u32::MAX`.
    index: Vec<u32>,
}

impl SlotLayout {
    /// Walk the layout of `cfg` at `max_rank`: the dense pairs only, every
    /// pair whole ([`Placement::SINGLE`]).
    pub fn new(cfg: &ModelConfig, max_rank: usize) -> Result<SlotLayout, LayoutError> {
        SlotLayout::walk(cfg, max_rank, Placement::SINGLE, ModelPlaces::default())
    }

    /// The layout of [`SlotLayout::new`] with the input embedding's pair
    /// place after the last layer's pairs.
    pub fn with_embedding(cfg: &ModelConfig, max_rank: usize) -> Result<SlotLayout, LayoutError> {
        SlotLayout::walk(
            cfg,
            max_rank,
            Placement::SINGLE,
            ModelPlaces {
                embedding: true,
                lm_head: false,
            },
        )
    }

    /// Walk the layout of `cfg` at `max_rank` for one tensor-parallel rank:
    /// the same pairs in the same order as [`SlotLayout::new`], each sized
    /// to the rank's [`ModuleShard`]. A module whose cut does not divide is
    /// [`LayoutError::Placement`] naming the dimension.
    pub fn with_placement(cfg: &ModelConfig, max_rank: usize, placement: Placement) -> Result<SlotLayout, LayoutError> {
        SlotLayout::walk(cfg, max_rank, placement, ModelPlaces::default())
    }

    /// The layout of `cfg` at `max_rank` for `placement`, with the
    /// model-level places `places` asks for (the embedding's, then the
    /// head's, after the last layer's pairs). The embedding and head pairs
    /// are replicated on every tensor-parallel rank (the base model keeps the
    /// embedding table and the output head whole on every rank), or, under
    /// [`Placement::vocab_parallel`], hold the rank's vocabulary block
    /// ([`ModuleShard::embedding`], [`ModuleShard::lm_head`]); a vocabulary
    /// that does not divide is [`LayoutError::Placement`] naming
    /// `vocab_size`.
    pub fn walk(
        cfg: &ModelConfig,
        max_rank: usize,
        placement: Placement,
        places: ModelPlaces,
    ) -> Result<SlotLayout, LayoutError> {
        if max_rank == 0 {
            return Err(LayoutError::ZeroRank { what: "max_rank" });
        }
        let n_modules = LoraModule::ALL.len();
        let index_len = cfg
            .num_hidden_layers
            .checked_mul(n_modules)
            .ok_or(overflow("layout index"))?;
        let mut index = vec![u32::MAX; index_len];
        let mut entries = Vec::new();
        let mut shards = Vec::new();
        let mut off = 0usize;
        for layer in 0..cfg.num_hidden_layers {
            for module in LoraModule::ALL {
                if !module.applies_to_layer(cfg, layer) {
                    continue;
                }
                let shard = ModuleShard::of(module, cfg, placement)?;
                let (out_dim, in_dim) = shard.dims();
                let a_rows = shard.rank_rows(max_rank)?.len();
                let a_bytes = a_rows
                    .checked_mul(in_dim)
                    .and_then(|e| e.checked_mul(BF16_BYTES))
                    .ok_or(overflow("A bytes"))?;
                let b_bytes = out_dim
                    .checked_mul(max_rank)
                    .and_then(|e| e.checked_mul(BF16_BYTES))
                    .ok_or(overflow("B bytes"))?;
                let a_offset = off;
                let b_offset = off.checked_add(a_bytes).ok_or(overflow("slot bytes"))?;
                off = b_offset.checked_add(b_bytes).ok_or(overflow("slot bytes"))?;
                index[layer * n_modules + module.index()] =
                    u32::try_from(entries.len()).map_err(|_| overflow("layout entries"))?;
                entries.push(SlotEntry {
                    layer,
                    module,
                    out_dim,
                    in_dim,
                    a_rows,
                    a_offset,
                    b_offset,
                });
                shards.push(shard);
            }
        }
        let embedding = if places.embedding {
            let shard = ModuleShard::embedding(cfg, placement)?;
            let (hidden, vocab) = shard.dims();
            let vocab_start = shard.in_start;
            let a_bytes = max_rank
                .checked_mul(vocab)
                .and_then(|e| e.checked_mul(BF16_BYTES))
                .ok_or(overflow("embedding A bytes"))?;
            let a_offset = off;
            let b_offset = off.checked_add(a_bytes).ok_or(overflow("slot bytes"))?;
            off = off
                .checked_add(pair_bytes(hidden, vocab, max_rank)?)
                .ok_or(overflow("slot bytes"))?;
            shards.push(shard);
            Some(EmbeddingEntry {
                vocab_start,
                vocab,
                hidden,
                a_offset,
                b_offset,
            })
        } else {
            None
        };
        let lm_head = if places.lm_head {
            let shard = ModuleShard::lm_head(cfg, placement)?;
            let (vocab, hidden) = shard.dims();
            let vocab_start = shard.segments()[0].start;
            let a_bytes = max_rank
                .checked_mul(hidden)
                .and_then(|e| e.checked_mul(BF16_BYTES))
                .ok_or(overflow("head A bytes"))?;
            let a_offset = off;
            let b_offset = off.checked_add(a_bytes).ok_or(overflow("slot bytes"))?;
            off = off
                .checked_add(pair_bytes(vocab, hidden, max_rank)?)
                .ok_or(overflow("slot bytes"))?;
            shards.push(shard);
            Some(HeadEntry {
                hidden,
                vocab_start,
                vocab,
                a_offset,
                b_offset,
            })
        } else {
            None
        };
        Ok(SlotLayout {
            max_rank,
            placement,
            entries,
            shards,
            embedding,
            lm_head,
            slot_bytes: off,
            index,
        })
    }

    /// The input embedding's pair place, when the layout has one.
    pub fn embedding(&self) -> Option<&EmbeddingEntry> {
        self.embedding.as_ref()
    }

    /// The output head's pair place, when the layout has one.
    pub fn lm_head(&self) -> Option<&HeadEntry> {
        self.lm_head.as_ref()
    }

    /// The model-level places this layout has.
    pub fn places(&self) -> ModelPlaces {
        ModelPlaces {
            embedding: self.embedding.is_some(),
            lm_head: self.lm_head.is_some(),
        }
    }

    /// The rank every pair is padded to.
    pub fn max_rank(&self) -> usize {
        self.max_rank
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The tensor-parallel rank this layout is for.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The rank's part of the `i`-th pair in walk order (the embedding and
    /// head pairs', from `entries().len()` on when the layout has
    /// them).
    pub fn shard(&self, i: usize) -> Option<&ModuleShard> {
        self.shards.get(i)
    }

    /// Every (layer, module) pair in walk order (the embedding and head
    /// pairs, which follow them, are [`SlotLayout::embedding`] and
    /// [`SlotLayout::lm_head`]).
    pub fn entries(&self) -> &[SlotEntry] {
        &self.entries
    }

    /// The entry of (layer, module), or `None` when the module does not apply
    /// to that layer or the layer is out of range.
    pub fn entry(&self, layer: usize, module: LoraModule) -> Option<&SlotEntry> {
        self.entries.get(self.position(layer, module)?)
    }

    /// The index in [`SlotLayout::entries`] of (layer, module).
    pub fn position(&self, layer: usize, module: LoraModule) -> Option<usize> {
        let n_modules = LoraModule::ALL.len();
        let i = *self
            .index
            .get(layer.checked_mul(n_modules)?.checked_add(module.index())?)?;
        (i != u32::MAX).then_some(i as usize)
    }

    /// Byte offset of slot `slot` in the pool: `slot * slot_bytes`.
    pub fn slot_base_offset(&self, slot: usize) -> Result<usize, LayoutError> {
        slot.checked_mul(self.slot_bytes).ok_or(overflow("slot base offset"))
    }
}

/// Bytes of one pool slot: over every layer and every module that
/// `applies_to_layer`, `(max_rank * in + out * max_rank) * 2`.
pub fn pool_slot_bytes(cfg: &ModelConfig, max_rank: usize) -> Result<usize, LayoutError> {
    SlotLayout::new(cfg, max_rank).map(|l| l.slot_bytes())
}

/// Byte offset of slot `slot` in the pool: `slot * pool_slot_bytes`.
pub fn slot_base_offset(slot: usize, cfg: &ModelConfig, max_rank: usize) -> Result<usize, LayoutError> {
    SlotLayout::new(cfg, max_rank)?.slot_base_offset(slot)
}

/// The `(a_offset, b_offset)` of (layer, module) within a slot: the offsets
/// the packer writes that pair at. `Ok(None)` when `applies_to_layer` is
/// false for it or the layer is out of range.
pub fn module_slot_offsets(
    cfg: &ModelConfig,
    max_rank: usize,
    layer: usize,
    module: LoraModule,
) -> Result<Option<(usize, usize)>, LayoutError> {
    Ok(SlotLayout::new(cfg, max_rank)?
        .entry(layer, module)
        .map(|e| (e.a_offset, e.b_offset)))
}

/// The rank stride of the expert/router pool for an expert rank: rounded up
/// to a multiple of 8, so every B row (`stride` BF16 elements) starts on a
/// 16-byte boundary for vector loads. Pairs are stored as A `[stride, in]`
/// then B `[out, stride]`, rows past the adapter's rank zero.
pub fn expert_packed_stride(expert_rank: usize) -> Result<usize, LayoutError> {
    if expert_rank == 0 {
        return Err(LayoutError::ZeroRank { what: "expert_rank" });
    }
    expert_rank
        .checked_add(7)
        .map(|r| r / 8 * 8)
        .ok_or(overflow("expert stride"))
}

/// One expert-pool pair's place in an expert slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertEntry {
    /// Global layer index.
    pub layer: usize,
    /// The expert projection or the router.
    pub site: ExpertSite,
    /// Output width.
    pub out_dim: usize,
    /// Input width.
    pub in_dim: usize,
    /// Byte offset of A (`[stride, in]`) from the expert slot base.
    pub a_offset: usize,
    /// Byte offset of B (`[out, stride]`) from the expert slot base.
    pub b_offset: usize,
}

/// The layout of one adapter's pairs in an expert-pool slot: only the sites
/// the adapter adapts, sorted by (layer, site), each A `[stride, in]` then B
/// `[out, stride]` at `stride = expert_packed_stride(expert_rank)`. The expert
/// packer, the peer landing and [`expert_router_bytes`] all read this walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayout {
    stride: usize,
    entries: Vec<ExpertEntry>,
    bytes: usize,
}

impl ExpertLayout {
    /// Lay out `sites` (any order; duplicates are an error) at `expert_rank`.
    pub fn new(
        cfg: &ModelConfig,
        expert_rank: usize,
        sites: impl IntoIterator<Item = (usize, ExpertSite)>,
    ) -> Result<ExpertLayout, LayoutError> {
        let stride = expert_packed_stride(expert_rank)?;
        let mut sites: Vec<(usize, ExpertSite)> = sites.into_iter().collect();
        sites.sort_unstable();
        if let Some(w) = sites.windows(2).find(|w| w[0] == w[1]) {
            return Err(LayoutError::DuplicateExpertSite {
                layer: w[0].0,
                site: w[0].1,
            });
        }
        let mut entries = Vec::with_capacity(sites.len());
        let mut off = 0usize;
        for (layer, site) in sites {
            let (out_dim, in_dim) = site
                .dims(cfg)
                .filter(|_| cfg.is_moe_layer(layer))
                .ok_or(LayoutError::NoSuchExpertSite { layer, site })?;
            let a_bytes = stride
                .checked_mul(in_dim)
                .and_then(|e| e.checked_mul(BF16_BYTES))
                .ok_or(overflow("expert A bytes"))?;
            let a_offset = off;
            let b_offset = off.checked_add(a_bytes).ok_or(overflow("expert slot bytes"))?;
            off = off
                .checked_add(pair_bytes(out_dim, in_dim, stride)?)
                .ok_or(overflow("expert slot bytes"))?;
            entries.push(ExpertEntry {
                layer,
                site,
                out_dim,
                in_dim,
                a_offset,
                b_offset,
            });
        }
        Ok(ExpertLayout {
            stride,
            entries,
            bytes: off,
        })
    }

    /// The rank stride of every pair.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Bytes the adapter's pairs take in an expert slot.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Every pair, sorted by (layer, site).
    pub fn entries(&self) -> &[ExpertEntry] {
        &self.entries
    }

    /// The entry of (layer, site), if the adapter adapts it.
    pub fn entry(&self, layer: usize, site: ExpertSite) -> Option<&ExpertEntry> {
        self.entries.get(self.position(layer, site)?)
    }

    /// The index in [`ExpertLayout::entries`] of (layer, site).
    pub fn position(&self, layer: usize, site: ExpertSite) -> Option<usize> {
        self.entries
            .binary_search_by(|e| (e.layer, e.site).cmp(&(layer, site)))
            .ok()
    }
}

/// Padded bytes of the expert/router pool for one adapter's audited expert
/// and router sites: `(stride * in + out * stride) * 2` per (layer, site),
/// with `stride = expert_packed_stride(expert_rank)`: the size of their
/// [`ExpertLayout`], so it matches what is packed.
pub fn expert_router_bytes(
    cfg: &ModelConfig,
    expert_rank: usize,
    sites: impl IntoIterator<Item = (usize, ExpertSite)>,
) -> Result<usize, LayoutError> {
    ExpertLayout::new(cfg, expert_rank, sites).map(|l| l.bytes())
}

#[cfg(test)]
mod tests;
