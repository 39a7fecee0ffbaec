//! Host images of one slot: the exact bytes a publish writes into a pool
//! slot, built off to the side so a failure never touches the slot.
//!
//! A [`SlotImage`] follows the one layout walk ([`SlotLayout`]); every byte
//! of it is written exactly once: a packed pair's A rows `rank..max_rank` and
//! B columns `rank..max_rank` as zeros, an unadapted module as zeros. There is
//! no separate zeroing pass.

use half::bf16;
use lora_layout::{LoraModule, SlotEntry, SlotLayout};
use rayon::prelude::*;

/// Which half of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PairPart {
    /// A, stored `[max_rank, in]`.
    A,
    /// B, stored `[out, max_rank]`.
    B,
}

/// What the pool serves for one (layer, module) of a slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairMeta {
    /// Global layer.
    pub layer: usize,
    /// The module.
    pub module: LoraModule,
    /// The pair's true rank (`<= max_rank`).
    pub rank: usize,
    /// Its scaling (`alpha / r` or `alpha / sqrt(r)`).
    pub scale: f32,
}

/// One pair to pack, borrowed from wherever the adapter's tensors live.
#[derive(Debug, Clone, Copy)]
pub struct PairSource<'a> {
    /// Layer, module, rank and scale.
    pub meta: PairMeta,
    /// A `[rank, in]`, row-major.
    pub a: &'a [bf16],
    /// B `[out, rank]`, row-major.
    pub b: &'a [bf16],
}

/// A pair that does not fit the slot layout.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ImageError {
    /// The model has no such (layer, module).
    #[error("layer {layer} has no {module} in this model")]
    NoSuchModule {
        /// The layer.
        layer: usize,
        /// The module.
        module: LoraModule,
    },
    /// The pair's rank is 0 or above the pool's `max_rank`.
    #[error("layer {layer} {module}: rank {rank} does not fit max_rank {max_rank}")]
    Rank {
        /// The layer.
        layer: usize,
        /// The module.
        module: LoraModule,
        /// The pair's rank.
        rank: usize,
        /// The pool's rank.
        max_rank: usize,
    },
    /// A or B has the wrong element count.
    #[error("layer {layer} {module} {part:?}: {got} elements, expected {expected}")]
    Shape {
        /// The layer.
        layer: usize,
        /// The module.
        module: LoraModule,
        /// A or B.
        part: PairPart,
        /// Elements given.
        got: usize,
        /// Elements the shape needs.
        expected: usize,
    },
    /// The same (layer, module) is given twice.
    #[error("layer {layer} {module} is given twice")]
    Duplicate {
        /// The layer.
        layer: usize,
        /// The module.
        module: LoraModule,
    },
    /// A landed pair was not declared first.
    #[error("layer {layer} {module} was not declared before landing")]
    Undeclared {
        /// The layer.
        layer: usize,
        /// The module.
        module: LoraModule,
    },
}

/// The host image of one slot.
#[derive(Debug, Clone)]
pub struct SlotImage {
    data: Vec<bf16>,
    pairs: Vec<PairMeta>,
}

fn entry_of(layout: &SlotLayout, layer: usize, module: LoraModule) -> Result<&SlotEntry, ImageError> {
    layout
        .entry(layer, module)
        .ok_or(ImageError::NoSuchModule { layer, module })
}

fn position_of(layout: &SlotLayout, layer: usize, module: LoraModule) -> Result<usize, ImageError> {
    layout
        .position(layer, module)
        .ok_or(ImageError::NoSuchModule { layer, module })
}

fn check_rank(meta: &PairMeta, max_rank: usize) -> Result<(), ImageError> {
    if meta.rank == 0 || meta.rank > max_rank {
        return Err(ImageError::Rank {
            layer: meta.layer,
            module: meta.module,
            rank: meta.rank,
            max_rank,
        });
    }
    Ok(())
}

/// Write one entry's region (A then B) from `src`, or zeros when `None`.
fn fill_entry(region: &mut [bf16], entry: &SlotEntry, max_rank: usize, src: Option<&PairSource<'_>>) {
    let (a_region, b_region) = region.split_at_mut(max_rank * entry.in_dim);
    let Some(src) = src else {
        a_region.fill(bf16::ZERO);
        b_region.fill(bf16::ZERO);
        return;
    };
    let r = src.meta.rank;
    let (a_used, a_pad) = a_region.split_at_mut(r * entry.in_dim);
    a_used.copy_from_slice(src.a);
    a_pad.fill(bf16::ZERO);
    for (dst_row, src_row) in b_region.chunks_exact_mut(max_rank).zip(src.b.chunks_exact(r)) {
        dst_row[..r].copy_from_slice(src_row);
        dst_row[r..].fill(bf16::ZERO);
    }
}

/// Split `data` into one mutable region per layout entry, in walk order.
fn entry_regions<'d>(data: &'d mut [bf16], layout: &SlotLayout) -> Vec<&'d mut [bf16]> {
    let max_rank = layout.max_rank();
    let mut rest = data;
    let mut regions = Vec::with_capacity(layout.entries().len());
    for e in layout.entries() {
        let len = max_rank * (e.in_dim + e.out_dim);
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
        regions.push(head);
        rest = tail;
    }
    regions
}

impl SlotImage {
    /// Pack `pairs` into a fresh image of `layout`, in parallel across
    /// pairs. Every pair is checked against the layout before any byte is
    /// written.
    pub fn pack(layout: &SlotLayout, pairs: &[PairSource<'_>]) -> Result<SlotImage, ImageError> {
        let max_rank = layout.max_rank();
        let n_entries = layout.entries().len();
        let mut by_entry: Vec<Option<&PairSource<'_>>> = vec![None; n_entries];
        for p in pairs {
            let m = &p.meta;
            let entry = entry_of(layout, m.layer, m.module)?;
            check_rank(m, max_rank)?;
            let shape_err = |part, got, expected| ImageError::Shape {
                layer: m.layer,
                module: m.module,
                part,
                got,
                expected,
            };
            if p.a.len() != m.rank * entry.in_dim {
                return Err(shape_err(PairPart::A, p.a.len(), m.rank * entry.in_dim));
            }
            if p.b.len() != entry.out_dim * m.rank {
                return Err(shape_err(PairPart::B, p.b.len(), entry.out_dim * m.rank));
            }
            let index = position_of(layout, m.layer, m.module)?;
            if by_entry[index].replace(p).is_some() {
                return Err(ImageError::Duplicate {
                    layer: m.layer,
                    module: m.module,
                });
            }
        }
        // A zeroed allocation comes from fresh pages, so this costs no pass.
        let mut data: Vec<bf16> = bytemuck::zeroed_vec(layout.slot_bytes() / 2);
        entry_regions(&mut data, layout)
            .into_par_iter()
            .zip(layout.entries().par_iter())
            .zip(by_entry.par_iter())
            .for_each(|((region, entry), src)| fill_entry(region, entry, max_rank, *src));
        let mut metas: Vec<PairMeta> = pairs.iter().map(|p| p.meta).collect();
        metas.sort_by_key(|m| (m.layer, m.module));
        Ok(SlotImage { data, pairs: metas })
    }

    /// An all-zero image to land bytes into ([`SlotImage::declare`] then
    /// [`SlotImage::region_mut`]).
    pub fn zeroed(layout: &SlotLayout) -> SlotImage {
        SlotImage {
            data: bytemuck::zeroed_vec(layout.slot_bytes() / 2),
            pairs: Vec::new(),
        }
    }

    /// Declare a pair that will be landed byte-wise.
    pub fn declare(&mut self, layout: &SlotLayout, meta: PairMeta) -> Result<(), ImageError> {
        entry_of(layout, meta.layer, meta.module)?;
        check_rank(&meta, layout.max_rank())?;
        if self
            .pairs
            .iter()
            .any(|p| (p.layer, p.module) == (meta.layer, meta.module))
        {
            return Err(ImageError::Duplicate {
                layer: meta.layer,
                module: meta.module,
            });
        }
        self.pairs.push(meta);
        self.pairs.sort_by_key(|m| (m.layer, m.module));
        Ok(())
    }

    /// The bytes a landed part occupies: A's first `rank` rows
    /// (`rank * in * 2` bytes; the padding rows stay zero), or the whole B
    /// `[out, max_rank]` (the peer stages B with its zero columns).
    pub fn region_mut(
        &mut self,
        layout: &SlotLayout,
        layer: usize,
        module: LoraModule,
        part: PairPart,
    ) -> Result<&mut [u8], ImageError> {
        let entry = *entry_of(layout, layer, module)?;
        let meta = *self
            .pairs
            .iter()
            .find(|p| (p.layer, p.module) == (layer, module))
            .ok_or(ImageError::Undeclared { layer, module })?;
        let (start, len) = match part {
            PairPart::A => (entry.a_offset / 2, meta.rank * entry.in_dim),
            PairPart::B => (entry.b_offset / 2, entry.out_dim * layout.max_rank()),
        };
        Ok(bytemuck::cast_slice_mut(&mut self.data[start..start + len]))
    }

    /// The image as bytes (`slot_bytes` long).
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.data)
    }

    /// The image as BF16 elements.
    pub fn as_elems(&self) -> &[bf16] {
        &self.data
    }

    /// The pairs the image holds, sorted by (layer, module).
    pub fn pairs(&self) -> &[PairMeta] {
        &self.pairs
    }
}

#[cfg(test)]
mod tests;
