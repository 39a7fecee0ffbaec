//! Peer staging: an audited adapter's pairs laid out as the bytes an engine
//! lands, with one checksum per part.
//!
//! A is staged as its true-rank rows `[rank, in]` (the engine's image keeps
//! its padding rows zero), B as `[out, stride]` with zero columns past the
//! rank, so it lands in one piece. Dense pairs use `stride = max_rank`,
//! expert and router pairs `expert_packed_stride(expert_rank)`: the strides
//! of the engine's own layouts.

use half::bf16;
use lora_audit::PreparedAdapter;
use lora_layout::{LayoutError, PairKey, expert_packed_stride};
use lora_pool::image::PairPart;
use rayon::prelude::*;

use crate::checksum::xxh64;

#[cfg(target_endian = "big")]
compile_error!("staged bytes are little-endian BF16; big-endian hosts are not supported");

/// One staged part: where it sits in the staging buffer and its checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedPart {
    /// The pair.
    pub key: PairKey,
    /// A or B.
    pub part: PairPart,
    /// Byte offset in the staging buffer.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
    /// XXH64 of the bytes.
    pub checksum: u64,
}

/// An adapter staged for one (max_rank, expert_rank).
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
    /// A pair's B is not `[out, rank]`.
    #[error("{key}: B has {len} elements, not a multiple of rank {rank}")]
    Shape {
        /// The pair.
        key: PairKey,
        /// B's element count.
        len: usize,
        /// The rank.
        rank: usize,
    },
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

/// A pair to stage, borrowed from the prepared adapter.
struct Source<'a> {
    key: PairKey,
    rank: usize,
    stride: usize,
    a: &'a [bf16],
    b: &'a [bf16],
}

impl Source<'_> {
    fn out(&self) -> usize {
        self.b.len() / self.rank
    }
}

/// Stage `adapter`'s dense pairs at `max_rank` and its expert and router
/// pairs at `expert_rank`, refusing anything over `budget` bytes before
/// allocating. Checksums are computed in parallel across parts.
pub fn stage_adapter(
    adapter: &PreparedAdapter,
    max_rank: usize,
    expert_rank: usize,
    budget: usize,
) -> Result<Staging, StageError> {
    Ok(plan_staging(adapter, max_rank, expert_rank, budget)?.fill())
}

/// Where every part of a staging goes, before any byte is allocated: the
/// caller learns [`StagingPlan::len`] first (to reserve memory for it),
/// then [`StagingPlan::fill`]s it.
pub struct StagingPlan<'a> {
    sources: Vec<Source<'a>>,
    parts: Vec<StagedPart>,
    len: usize,
}

impl StagingPlan<'_> {
    /// Bytes the staging will hold.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the staging holds no byte (an adapter with no pair).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Allocate the staging and copy and checksum every part.
    pub fn fill(self) -> Staging {
        let StagingPlan {
            sources,
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
            .enumerate()
            .for_each(|(i, (region, part))| {
                let s = &sources[i / 2];
                match part.part {
                    PairPart::A => region.copy_from_slice(bf16_bytes(s.a)),
                    PairPart::B => {
                        for (dst, src) in region.chunks_exact_mut(2 * s.stride).zip(s.b.chunks_exact(s.rank)) {
                            dst[..2 * s.rank].copy_from_slice(bf16_bytes(src));
                        }
                    }
                }
                part.checksum = xxh64(region);
            });
        Staging { bytes, parts }
    }
}

/// The layout of [`stage_adapter`]'s staging, checked against `budget`,
/// with nothing allocated but the part list.
pub fn plan_staging(
    adapter: &PreparedAdapter,
    max_rank: usize,
    expert_rank: usize,
    budget: usize,
) -> Result<StagingPlan<'_>, StageError> {
    let expert_stride = if adapter.experts.is_empty() {
        0
    } else {
        expert_packed_stride(expert_rank)?
    };
    let dense = adapter.dense.iter().map(|p| Source {
        key: PairKey::Dense {
            layer: p.layer,
            module: p.module,
        },
        rank: p.rank,
        stride: max_rank,
        a: &p.a,
        b: &p.b,
    });
    let experts = adapter.experts.iter().map(|p| Source {
        key: PairKey::Expert {
            layer: p.layer,
            site: p.site,
        },
        rank: p.rank,
        stride: expert_stride,
        a: &p.a,
        b: &p.b,
    });
    let embedding = adapter.embedding.iter().map(|e| Source {
        key: PairKey::Embedding,
        rank: e.rank,
        stride: max_rank,
        a: &e.a,
        b: &e.b,
    });
    let head = adapter.lm_head.iter().map(|e| Source {
        key: PairKey::LmHead,
        rank: e.rank,
        stride: max_rank,
        a: &e.a,
        b: &e.b,
    });
    let sources: Vec<Source<'_>> = dense.chain(embedding).chain(head).chain(experts).collect();
    let mut parts = Vec::with_capacity(2 * sources.len());
    let mut offset = 0usize;
    let over = |needed| StageError::Budget { needed, budget };
    for s in &sources {
        if s.rank == 0 || s.rank > s.stride {
            return Err(StageError::Rank {
                key: s.key,
                rank: s.rank,
                stride: s.stride,
            });
        }
        if s.b.len() % s.rank != 0 {
            return Err(StageError::Shape {
                key: s.key,
                len: s.b.len(),
                rank: s.rank,
            });
        }
        let a_len = s.a.len().checked_mul(2).ok_or(over(usize::MAX))?;
        let b_len = s
            .out()
            .checked_mul(s.stride)
            .and_then(|e| e.checked_mul(2))
            .ok_or(over(usize::MAX))?;
        for (part, len) in [(PairPart::A, a_len), (PairPart::B, b_len)] {
            parts.push(StagedPart {
                key: s.key,
                part,
                offset,
                len,
                checksum: 0,
            });
            offset = offset.checked_add(len).ok_or(over(usize::MAX))?;
        }
    }
    if offset > budget {
        return Err(over(offset));
    }
    Ok(StagingPlan {
        sources,
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
