//! Peer staging: an audited adapter's pairs laid out as the bytes an engine
//! lands, with one checksum per part.
//!
//! Every pair is staged as the engine's rank holds it: its place in the
//! rank's layouts (the slot layout `LoraOptions::slot_layout` walks for the
//! requested `max_rank` and placement, and the adapter's expert layout at
//! the expert rank) gives the rank's `ModuleShard`, the one statement of
//! the cutting rules the disk swap's packer also follows. A is staged as
//! the true-rank rows the rank holds (`PairPlace::a_used_rows`: rows
//! `0..rank`, or under the fully-sharded option the rank's block of them,
//! none when the block lies past the pair's rank) of the rank's input
//! columns (its vocabulary columns for a vocab-parallel embedding pair);
//! the engine's image keeps its padding rows zero. B is staged as the
//! rank's output rows `[out_r, stride]` (its vocabulary rows for a
//! vocab-parallel head pair) with zero columns past the rank, so it lands
//! in one piece; a DoRA pair's magnitude `m` as the f32 values of the same
//! output rows. The placement the layout is walked for is the engine's
//! whole placement, both cut options included, so every combination of
//! them stages exactly the rank's layout. Dense pairs use `stride = max_rank`, expert and router
//! pairs `expert_packed_stride(expert_rank)`: the strides of the engine's
//! own layouts.

use half::bf16;
use lora_audit::{LoraOptions, PreparedAdapter};
use lora_layout::{ExpertLayout, LayoutError, ModelConfig, PairKey, PairLayout, PairPlace};
use rayon::prelude::*;

use crate::checksum::xxh64;
use crate::manifest::WirePart;

#[cfg(target_endian = "big")]
compile_error!("staged bytes are little-endian BF16 and f32; big-endian hosts are not supported");

/// One staged part: where it sits in the staging buffer and its checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedPart {
    /// The pair.
    pub key: PairKey,
    /// A, B or the magnitude.
    pub part: WirePart,
    /// Byte offset in the staging buffer.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
    /// XXH64 of the bytes.
    pub checksum: u64,
}

/// An adapter staged for one (max_rank, expert_rank, placement).
#[derive(Debug)]
pub struct Staging {
    /// The staged bytes, parts back to back.
    pub bytes: Box<[u8]>,
    /// Every part, dense pairs first, in the adapter's order.
    pub parts: Vec<StagedPart>,
}

/// Why an adapter cannot be staged at a geometry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StageError {
    /// A pair's rank is above the stride it must be padded to.
    #[error("{key}: rank {rank} does not fit the staged stride {stride}")]
    Rank {
        /// The pair.
        key: PairKey,
        /// Its rank.
        rank: usize,
        /// The stride.
        stride: usize,
    },
    /// A pair's tensor does not have the whole pair's element count.
    #[error("{key}: {part} has {len} elements, the whole pair's needs {expected}")]
    Shape {
        /// The pair.
        key: PairKey,
        /// `A`, `B` or `magnitude`.
        part: &'static str,
        /// Its element count.
        len: usize,
        /// What the whole pair needs.
        expected: usize,
    },
    /// A pair has no place in the rank's layouts.
    #[error("{0}: no place in the rank's layout")]
    NotInLayout(PairKey),
    /// The staged size is over the peer's budget (or overflows).
    #[error("staging needs {needed} bytes, over the budget of {budget}")]
    Budget {
        /// Bytes needed (`usize::MAX` on overflow).
        needed: usize,
        /// The budget.
        budget: usize,
    },
    /// The expert rank is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// A pair to stage, borrowed from the prepared adapter, with its place in
/// the rank's layout.
struct Source<'a> {
    key: PairKey,
    rank: usize,
    stride: usize,
    place: PairPlace,
    a: &'a [bf16],
    b: &'a [bf16],
    magnitude: Option<&'a [f32]>,
}

impl Source<'_> {
    /// Write `part` of the rank's shard into `dst` (exactly its bytes).
    fn fill(&self, part: WirePart, dst: &mut [u8]) {
        let shard = &self.place.shard;
        let (_, full_in) = shard.full_dims;
        let in_r = self.place.in_dim;
        match part {
            WirePart::A => {
                let rows = self.place.a_used_rows(self.stride, self.rank);
                for (row, r) in dst.chunks_exact_mut(2 * in_r.max(1)).zip(rows) {
                    let start = r * full_in + shard.in_start;
                    row.copy_from_slice(bf16_bytes(&self.a[start..start + in_r]));
                }
            }
            WirePart::B => {
                let rows = shard.segments().iter().flat_map(|seg| seg.start..seg.start + seg.len);
                for (dst_row, src_row) in dst.chunks_exact_mut(2 * self.stride).zip(rows) {
                    let src = &self.b[src_row * self.rank..(src_row + 1) * self.rank];
                    dst_row[..2 * self.rank].copy_from_slice(bf16_bytes(src));
                }
            }
            WirePart::Magnitude => {
                let m = self.magnitude.unwrap_or(&[]);
                let rows = shard.segments().iter().flat_map(|seg| seg.start..seg.start + seg.len);
                for (dst, row) in dst.chunks_exact_mut(4).zip(rows) {
                    dst.copy_from_slice(&m[row].to_le_bytes());
                }
            }
        }
    }
}

/// Stage `adapter` for the rank `opts` describes (`max_rank`,
/// `expert_rank`, `placement`, the embedding and head places): its dense
/// pairs at the rank's slot layout, its expert and router pairs at its
/// expert layout, refusing anything over `budget` bytes before allocating.
/// Checksums are computed in parallel across parts.
pub fn stage_adapter(
    adapter: &PreparedAdapter,
    cfg: &ModelConfig,
    opts: &LoraOptions,
    budget: usize,
) -> Result<Staging, StageError> {
    Ok(plan_staging(adapter, cfg, opts, budget)?.fill())
}

/// Where every part of a staging goes, before any byte is allocated: the
/// caller learns [`StagingPlan::len`] first (to reserve memory for it),
/// then [`StagingPlan::fill`]s it.
pub struct StagingPlan<'a> {
    sources: Vec<Source<'a>>,
    /// Per part, its source.
    owners: Vec<usize>,
    parts: Vec<StagedPart>,
    len: usize,
}

impl StagingPlan<'_> {
    /// Bytes the staging will hold.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the staging holds no byte (an adapter with no pair, or none
    /// on this rank).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Allocate the staging and copy and checksum every part.
    pub fn fill(self) -> Staging {
        let StagingPlan {
            sources,
            owners,
            mut parts,
            len,
        } = self;
        let mut bytes = vec![0u8; len].into_boxed_slice();
        let mut rest: &mut [u8] = &mut bytes;
        let mut regions = Vec::with_capacity(parts.len());
        for p in &parts {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(p.len);
            regions.push(head);
            rest = tail;
        }
        regions
            .into_par_iter()
            .zip(parts.par_iter_mut())
            .zip(owners.par_iter())
            .for_each(|((region, part), &owner)| {
                sources[owner].fill(part.part, region);
                part.checksum = xxh64(region);
            });
        Staging { bytes, parts }
    }
}

/// The layout of [`stage_adapter`]'s staging, checked against `budget`,
/// with nothing allocated but the part list.
pub fn plan_staging<'a>(
    adapter: &'a PreparedAdapter,
    cfg: &ModelConfig,
    opts: &LoraOptions,
    budget: usize,
) -> Result<StagingPlan<'a>, StageError> {
    let layout = opts.slot_layout(cfg)?;
    let expert_layout = if adapter.experts.is_empty() {
        None
    } else {
        Some(ExpertLayout::new(
            cfg,
            opts.expert_rank,
            adapter.experts.iter().map(|p| (p.layer, p.site)),
        )?)
    };
    let place = |key: PairKey| -> Result<(PairPlace, usize), StageError> {
        let found = match key {
            PairKey::Expert { .. } => expert_layout.as_ref().and_then(|l| {
                let i = PairLayout::position(l, key)?;
                Some((PairLayout::place(l, i)?, PairLayout::stride(l)))
            }),
            _ => {
                let i = PairLayout::position(&layout, key);
                i.and_then(|i| Some((PairLayout::place(&layout, i)?, PairLayout::stride(&layout))))
            }
        };
        found.ok_or(StageError::NotInLayout(key))
    };
    let mut sources: Vec<Source<'a>> = Vec::new();
    let pairs = adapter
        .dense
        .iter()
        .map(|p| {
            let key = PairKey::Dense {
                layer: p.layer,
                module: p.module,
            };
            (key, p.rank, &p.a[..], &p.b[..], p.magnitude.as_deref())
        })
        .chain(
            adapter
                .embedding
                .iter()
                .map(|e| (PairKey::Embedding, e.rank, &e.a[..], &e.b[..], None)),
        )
        .chain(
            adapter
                .lm_head
                .iter()
                .map(|e| (PairKey::LmHead, e.rank, &e.a[..], &e.b[..], None)),
        )
        .chain(adapter.experts.iter().map(|p| {
            let key = PairKey::Expert {
                layer: p.layer,
                site: p.site,
            };
            (key, p.rank, &p.a[..], &p.b[..], None)
        }));
    for (key, rank, a, b, magnitude) in pairs {
        let (place, stride) = place(key)?;
        sources.push(Source {
            key,
            rank,
            stride,
            place,
            a,
            b,
            magnitude,
        });
    }
    let mut parts = Vec::with_capacity(3 * sources.len());
    let mut owners = Vec::with_capacity(3 * sources.len());
    let mut offset = 0usize;
    let over = |needed| StageError::Budget { needed, budget };
    for (owner, s) in sources.iter().enumerate() {
        if s.rank == 0 || s.rank > s.stride {
            return Err(StageError::Rank {
                key: s.key,
                rank: s.rank,
                stride: s.stride,
            });
        }
        let (full_out, full_in) = s.place.shard.full_dims;
        let shape = |part, len, expected| StageError::Shape {
            key: s.key,
            part,
            len,
            expected,
        };
        if Some(s.a.len()) != s.rank.checked_mul(full_in) {
            return Err(shape("A", s.a.len(), s.rank.saturating_mul(full_in)));
        }
        if Some(s.b.len()) != full_out.checked_mul(s.rank) {
            return Err(shape("B", s.b.len(), full_out.saturating_mul(s.rank)));
        }
        if let Some(m) = s.magnitude
            && m.len() != full_out
        {
            return Err(shape("magnitude", m.len(), full_out));
        }
        let bytes = |elems: Option<usize>, size: usize| elems.and_then(|e| e.checked_mul(size)).ok_or(over(usize::MAX));
        let a_rows = s.place.a_used_rows(s.stride, s.rank).len();
        let a_len = bytes(a_rows.checked_mul(s.place.in_dim), 2)?;
        let b_len = bytes(s.place.out_dim.checked_mul(s.stride), 2)?;
        let m_len = bytes(Some(s.place.out_dim), 4)?;
        let magnitude = s.magnitude.map(|_| (WirePart::Magnitude, m_len));
        for (part, len) in [(WirePart::A, a_len), (WirePart::B, b_len)]
            .into_iter()
            .chain(magnitude)
        {
            parts.push(StagedPart {
                key: s.key,
                part,
                offset,
                len,
                checksum: 0,
            });
            owners.push(owner);
            offset = offset.checked_add(len).ok_or(over(usize::MAX))?;
        }
    }
    if offset > budget {
        return Err(over(offset));
    }
    Ok(StagingPlan {
        sources,
        owners,
        parts,
        len: offset,
    })
}

/// BF16 elements as their little-endian bytes (the host order; see the
/// `compile_error!` above).
pub(crate) fn bf16_bytes(elems: &[bf16]) -> &[u8] {
    bytemuck::cast_slice(elems)
}

#[cfg(test)]
mod tests;
