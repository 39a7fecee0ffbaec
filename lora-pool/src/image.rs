//! Host images of one slot: the exact bytes a publish writes into a pool
//! slot, built off to the side so a failure never touches the slot.
//!
//! A [`SlotImage`] follows the one layout walk ([`SlotLayout`](lora_layout::SlotLayout)); every byte
//! of it is written exactly once: a packed pair's A rows `rank..max_rank` and
//! B columns `rank..max_rank` as zeros, an unadapted module as zeros. There is
//! no separate zeroing pass.

use std::ops::Range;

use half::bf16;
use lora_audit::{AuditError, AuditReport, PreparedAdapter, SafetensorsFile, TensorDtype};
use lora_kernels::RepackDtype;
use lora_layout::{PairKey, PairLayout, PairPlace};
use rayon::prelude::*;

/// Which half of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PairPart {
    /// A, stored `[stride, in]`.
    A,
    /// B, stored `[out, stride]`.
    B,
}

/// What the pool serves for one pair of a slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairMeta {
    /// Which pair.
    pub key: PairKey,
    /// The pair's true rank (`<=` the layout's stride).
    pub rank: usize,
    /// Its scaling (`alpha / r` or `alpha / sqrt(r)`).
    pub scale: f32,
}

impl PairMeta {
    /// The metadata of a dense pair.
    pub fn dense(layer: usize, module: lora_layout::LoraModule, rank: usize, scale: f32) -> PairMeta {
        PairMeta {
            key: PairKey::Dense { layer, module },
            rank,
            scale,
        }
    }

    /// The metadata of the input embedding's pair.
    pub fn embedding(rank: usize, scale: f32) -> PairMeta {
        PairMeta {
            key: PairKey::Embedding,
            rank,
            scale,
        }
    }

    /// The metadata of the output head's pair.
    pub fn lm_head(rank: usize, scale: f32) -> PairMeta {
        PairMeta {
            key: PairKey::LmHead,
            rank,
            scale,
        }
    }
}

/// Tensor elements to pack, as they are found: converted BF16 values, or
/// the raw little-endian bytes of a read file (converted to BF16
/// while packing, with the same rounding as lora-audit's loader).
#[derive(Debug, Clone, Copy)]
pub enum Elems<'a> {
    /// BF16 values.
    Bf16(&'a [bf16]),
    /// Little-endian BF16 bytes (any alignment).
    Bf16Bytes(&'a [u8]),
    /// Little-endian F16 bytes.
    F16Bytes(&'a [u8]),
    /// Little-endian F32 bytes.
    F32Bytes(&'a [u8]),
    /// A tensor of an opened safetensors file, read on demand straight into
    /// its destination (F32 / F16 through a small conversion buffer).
    File {
        /// The file.
        file: &'a SafetensorsFile,
        /// Absolute byte offset of the tensor's first element.
        offset: u64,
        /// Its element type (F32, F16 or BF16).
        dtype: TensorDtype,
        /// Its element count.
        len: usize,
    },
}

impl Elems<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Elems::Bf16(v) => v.len(),
            Elems::Bf16Bytes(b) | Elems::F16Bytes(b) => b.len() / 2,
            Elems::F32Bytes(b) => b.len() / 4,
            Elems::File { len, .. } => *len,
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Convert elements `start..start + dst.len()` into `dst`. The caller
    /// checked the range; only a file read can fail.
    fn write(&self, start: usize, dst: &mut [bf16]) -> std::io::Result<()> {
        let n = dst.len();
        match self {
            Elems::Bf16(v) => dst.copy_from_slice(&v[start..start + n]),
            Elems::Bf16Bytes(b) => {
                let bytes = &b[2 * start..2 * (start + n)];
                match bytemuck::try_cast_slice::<u8, bf16>(bytes) {
                    Ok(v) => dst.copy_from_slice(v),
                    Err(_) => {
                        for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                            *d = bf16::from_bits(u16::from_le_bytes([c[0], c[1]]));
                        }
                    }
                }
            }
            Elems::F16Bytes(b) => convert_f16(&b[2 * start..2 * (start + n)], dst),
            Elems::F32Bytes(b) => convert_f32(&b[4 * start..4 * (start + n)], dst),
            Elems::File {
                file, offset, dtype, ..
            } => {
                let size = if *dtype == TensorDtype::F32 { 4 } else { 2 };
                let at = offset + (size * start) as u64;
                match dtype {
                    // Little-endian BF16 on a little-endian host: the bytes
                    // land in place.
                    TensorDtype::BF16 => file.read_at(bytemuck::cast_slice_mut(dst), at)?,
                    TensorDtype::F16 => {
                        let mut raw = vec![0u8; 2 * n];
                        file.read_at(&mut raw, at)?;
                        convert_f16(&raw, dst);
                    }
                    _ => {
                        let mut raw = vec![0u8; 4 * n];
                        file.read_at(&mut raw, at)?;
                        convert_f32(&raw, dst);
                    }
                }
            }
        }
        Ok(())
    }
}

fn convert_f16(bytes: &[u8], dst: &mut [bf16]) {
    for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
        *d = bf16::from_f32(half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32());
    }
}

fn convert_f32(bytes: &[u8], dst: &mut [bf16]) {
    for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
        *d = bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    }
}

/// One pair to pack, borrowed from wherever the adapter's tensors live.
#[derive(Debug, Clone, Copy)]
pub struct PairSource<'a> {
    /// Key, rank and scale.
    pub meta: PairMeta,
    /// A `[rank, in]`, row-major: the whole projection's, also where the
    /// layout's place holds a tensor-parallel rank's shard (the packer
    /// takes the rank's columns).
    pub a: Elems<'a>,
    /// B `[out, rank]`, row-major, whole (the packer takes the rank's rows).
    pub b: Elems<'a>,
}

/// The dense pairs of a prepared adapter as pack sources.
pub fn dense_sources(adapter: &PreparedAdapter) -> Vec<PairSource<'_>> {
    let embedding = adapter.embedding.as_ref().map(|e| PairSource {
        meta: PairMeta::embedding(e.rank, e.scale),
        a: Elems::Bf16(&e.a),
        b: Elems::Bf16(&e.b),
    });
    let head = adapter.lm_head.as_ref().map(|e| PairSource {
        meta: PairMeta::lm_head(e.rank, e.scale),
        a: Elems::Bf16(&e.a),
        b: Elems::Bf16(&e.b),
    });
    adapter
        .dense
        .iter()
        .map(|p| PairSource {
            meta: PairMeta::dense(p.layer, p.module, p.rank, p.scale),
            a: Elems::Bf16(&p.a),
            b: Elems::Bf16(&p.b),
        })
        .chain(embedding)
        .chain(head)
        .collect()
}

/// The repack kernel's form of a weight dtype (F32, F16 and BF16 only).
fn repack_dtype(dtype: TensorDtype) -> Option<RepackDtype> {
    match dtype {
        TensorDtype::BF16 => Some(RepackDtype::Bf16),
        TensorDtype::F16 => Some(RepackDtype::F16),
        TensorDtype::F32 => Some(RepackDtype::F32),
        _ => None,
    }
}

/// An audit's placed slot pairs (dense, the embedding's and the head's) as pack
/// sources read on demand from their opened safetensors file (F32, F16 or
/// BF16; any other type is an error naming the tensor).
pub fn file_sources<'a>(report: &AuditReport, file: &'a SafetensorsFile) -> Result<Vec<PairSource<'a>>, AuditError> {
    let elems = |key: &str| -> Result<Elems<'a>, AuditError> {
        let (dtype, _, offset, bytes) = file.tensor(key)?;
        let size = repack_dtype(dtype)
            .map(RepackDtype::size)
            .ok_or_else(|| AuditError::Tensor {
                name: key.to_string(),
                reason: format!("dtype {dtype}; adapter weights must be F32, F16 or BF16"),
            })?;
        Ok(Elems::File {
            file,
            offset,
            dtype,
            len: bytes / size,
        })
    };
    let embedding = report
        .embedding
        .as_ref()
        .map(|e| (PairMeta::embedding(e.rank, e.scale), &e.a_key, &e.b_key));
    let head = report
        .lm_head
        .as_ref()
        .map(|e| (PairMeta::lm_head(e.rank, e.scale), &e.a_key, &e.b_key));
    report
        .placed
        .iter()
        .map(|p| (PairMeta::dense(p.layer, p.module, p.rank, p.scale), &p.a_key, &p.b_key))
        .chain(embedding)
        .chain(head)
        .map(|(meta, a, b)| {
            Ok(PairSource {
                meta,
                a: elems(a)?,
                b: elems(b)?,
            })
        })
        .collect()
}

/// The expert and router pairs of a prepared adapter as pack sources.
pub fn expert_sources(adapter: &PreparedAdapter) -> Vec<PairSource<'_>> {
    adapter
        .experts
        .iter()
        .map(|p| PairSource {
            meta: PairMeta {
                key: PairKey::Expert {
                    layer: p.layer,
                    site: p.site,
                },
                rank: p.rank,
                scale: p.scale,
            },
            a: Elems::Bf16(&p.a),
            b: Elems::Bf16(&p.b),
        })
        .collect()
}

/// A pair that does not fit the layout.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ImageError {
    /// The layout has no such pair (wrong model, wrong pool, or an expert
    /// site the adapter's expert layout does not list).
    #[error("{key}: no such pair in this layout")]
    NoSuchPair {
        /// The pair.
        key: PairKey,
    },
    /// The pair's rank is 0 or above the layout's stride.
    #[error("{key}: rank {rank} does not fit the padded rank {stride}")]
    Rank {
        /// The pair.
        key: PairKey,
        /// The pair's rank.
        rank: usize,
        /// The layout's rank stride.
        stride: usize,
    },
    /// A or B has the wrong element count.
    #[error("{key} {part:?}: {got} elements, expected {expected}")]
    Shape {
        /// The pair.
        key: PairKey,
        /// A or B.
        part: PairPart,
        /// Elements given.
        got: usize,
        /// Elements the shape needs.
        expected: usize,
    },
    /// A served value that is not finite after the BF16 conversion.
    #[error("{key} {part:?}: element {index} is {value} as served (BF16); every served value must be finite")]
    NonFinite {
        /// The pair.
        key: PairKey,
        /// A or B.
        part: PairPart,
        /// The element's index in the tensor (`[r, in]` or `[out, r]`).
        index: usize,
        /// Its served value.
        value: f32,
    },
    /// The same pair is given twice.
    #[error("{key} is given twice")]
    Duplicate {
        /// The pair.
        key: PairKey,
    },
    /// The destination of [`pack_into`] is not the layout's size.
    #[error("destination holds {got} elements, the layout needs {expected}")]
    Destination {
        /// Elements given.
        got: usize,
        /// Elements the layout needs.
        expected: usize,
    },
    /// A pair's tensor could not be read from its file.
    #[error("{key} {part:?}: reading the adapter file failed: {reason}")]
    Read {
        /// The pair.
        key: PairKey,
        /// A or B.
        part: PairPart,
        /// The I/O error.
        reason: String,
    },
    /// A landed pair was not declared first.
    #[error("{key} was not declared before landing")]
    Undeclared {
        /// The pair.
        key: PairKey,
    },
}

/// The host image of one slot (or of one adapter's part of an expert slot).
#[derive(Debug, Clone)]
pub struct SlotImage {
    data: Vec<bf16>,
    pairs: Vec<PairMeta>,
}

fn place_of(layout: &impl PairLayout, key: PairKey) -> Result<(usize, PairPlace), ImageError> {
    layout
        .position(key)
        .and_then(|i| Some((i, layout.place(i)?)))
        .ok_or(ImageError::NoSuchPair { key })
}

fn check_rank(meta: &PairMeta, stride: usize) -> Result<(), ImageError> {
    if meta.rank == 0 || meta.rank > stride {
        return Err(ImageError::Rank {
            key: meta.key,
            rank: meta.rank,
            stride,
        });
    }
    Ok(())
}

/// Elements one parallel work piece of a fill copies: a place's A or B is
/// cut into pieces this size (whole rows), so a slot of a few large places
/// still spreads over every core.
const PIECE_ELEMS: usize = 32 * 1024;

/// Write one place's region (A then B) from `src`, or zeros when `None`, in
/// row blocks of about [`PIECE_ELEMS`] elements, in parallel.
fn fill_place(
    region: &mut [bf16],
    place: &PairPlace,
    stride: usize,
    src: Option<&PairSource<'_>>,
) -> Result<(), ImageError> {
    // A holds the place's block of rank rows (all `stride` of them unless
    // the fully-sharded option cut them); the source's rows below its rank
    // in that block are copied, the rest are zeros.
    let a_rows = place.a_rows(stride);
    let (a_region, b_region) = region.split_at_mut(a_rows.len() * place.in_dim);
    let Some(src) = src else {
        a_region.par_chunks_mut(PIECE_ELEMS).for_each(|c| c.fill(bf16::ZERO));
        b_region.par_chunks_mut(PIECE_ELEMS).for_each(|c| c.fill(bf16::ZERO));
        return Ok(());
    };
    let read_err = |part| {
        move |e: std::io::Error| ImageError::Read {
            key: src.meta.key,
            part,
            reason: e.to_string(),
        }
    };
    let r = src.meta.rank;
    let shard = &place.shard;
    let (_, full_in) = shard.full_dims;
    let used = place.a_used_rows(stride, r);
    let (used_rows, first_row) = (used.len(), used.start);
    let (a_used, a_pad) = a_region.split_at_mut(used_rows * place.in_dim);
    if place.in_dim == full_in {
        // A's rows are contiguous in the source: copy them in blocks of
        // whole rows.
        let block_rows = (PIECE_ELEMS / place.in_dim.max(1)).max(1);
        a_used
            .par_chunks_mut(block_rows * place.in_dim)
            .enumerate()
            .try_for_each(|(i, block)| src.a.write((first_row + i * block_rows) * place.in_dim, block))
            .map_err(read_err(PairPart::A))?;
    } else {
        // A row-parallel rank's A: columns `in_start..in_start + in_len`
        // of each source row.
        a_used
            .par_chunks_mut(place.in_dim.max(1))
            .enumerate()
            .try_for_each(|(i, row)| src.a.write((first_row + i) * full_in + shard.in_start, row))
            .map_err(read_err(PairPart::A))?;
    }
    if let Some(index) = lora_audit::first_non_finite(a_used) {
        let (row, col) = (index / place.in_dim.max(1), index % place.in_dim.max(1));
        return Err(ImageError::NonFinite {
            key: src.meta.key,
            part: PairPart::A,
            index: (first_row + row) * full_in + shard.in_start + col,
            value: a_used[index].to_f32(),
        });
    }
    a_pad.fill(bf16::ZERO);
    // B: the rank's output rows, one block of source rows per segment (the
    // whole B when the place is unsharded).
    let mut b_rest: &mut [bf16] = &mut *b_region;
    for seg in shard.segments() {
        let (b_seg, tail) = std::mem::take(&mut b_rest).split_at_mut(seg.len * stride);
        b_rest = tail;
        fill_b_rows(b_seg, src, stride, seg.start).map_err(read_err(PairPart::B))?;
    }
    // The padding columns hold zeros, so the first non-finite element of
    // the region is one of B's own: row-major over its source `[out, r]`
    // values.
    let non_finite = lora_audit::first_non_finite(b_region).map(|i| {
        let (row, col) = (i / stride.max(1), i % stride.max(1));
        (shard.src_row(row).unwrap_or(row) * r + col, b_region[i].to_f32())
    });
    match non_finite {
        Some((index, value)) => Err(ImageError::NonFinite {
            key: src.meta.key,
            part: PairPart::B,
            index,
            value,
        }),
        None => Ok(()),
    }
}

/// Write `dst` (whole rows of `stride`) from B's source rows starting at
/// `first_src_row`, padding columns `rank..stride` with zeros, in row
/// blocks of about [`PIECE_ELEMS`] elements, in parallel.
fn fill_b_rows(dst: &mut [bf16], src: &PairSource<'_>, stride: usize, first_src_row: usize) -> std::io::Result<()> {
    let r = src.meta.rank;
    let b_rows = (PIECE_ELEMS / stride.max(1)).max(1);
    dst.par_chunks_mut(b_rows * stride)
        .enumerate()
        .try_for_each(|(i, block)| {
            let first_row = first_src_row + i * b_rows;
            if r == stride {
                // B is stored exactly as given: one copy per block.
                return src.b.write(first_row * r, block);
            }
            // One read of the block's rows, then spread them over the stride.
            let rows = block.len() / stride;
            let mut packed = vec![bf16::ZERO; rows * r];
            src.b.write(first_row * r, &mut packed)?;
            for (dst_row, src_row) in block.chunks_exact_mut(stride).zip(packed.chunks_exact(r)) {
                dst_row[..r].copy_from_slice(src_row);
                dst_row[r..].fill(bf16::ZERO);
            }
            Ok(())
        })
}

/// The places `range` of `layout`, each with its mutable region of `data`
/// (which starts at the first place of the range). The layouts tile their
/// bytes exactly (a lora-layout invariant), so the regions are consecutive.
fn place_regions<'d>(
    data: &'d mut [bf16],
    layout: &impl PairLayout,
    range: Range<usize>,
) -> Vec<(PairPlace, &'d mut [bf16])> {
    let stride = layout.stride();
    let mut rest = data;
    range
        .filter_map(|i| layout.place(i))
        .map(|place| {
            let len = place.a_rows(stride).len() * place.in_dim + stride * place.out_dim;
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            (place, head)
        })
        .collect()
}

/// The first pair of `elems` (a whole image of `layout`) holding a value
/// that is not finite: `ImageError::NonFinite` with the element's index in
/// its padded factor (`[stride, in]` or `[out, stride]`). For images built
/// elsewhere (a peer's landing), which no packer here converted.
pub fn check_finite(layout: &(impl PairLayout + Sync), elems: &[bf16]) -> Result<(), ImageError> {
    let found = (0..layout.len()).into_par_iter().find_map_first(|i| {
        let place = layout.place(i)?;
        let stride = layout.stride();
        [
            (
                PairPart::A,
                place.a_offset / 2,
                place.a_rows(stride).len() * place.in_dim,
            ),
            (PairPart::B, place.b_offset / 2, place.out_dim * stride),
        ]
        .into_iter()
        .find_map(|(part, start, len)| {
            let values = elems.get(start..start.checked_add(len)?)?;
            let index = lora_audit::first_non_finite(values)?;
            Some(ImageError::NonFinite {
                key: place.key,
                part,
                index,
                value: values[index].to_f32(),
            })
        })
    });
    found.map_or(Ok(()), Err)
}

/// Pairs checked against a layout and indexed by place: what a packer needs
/// to fill any range of the slot, in any order, without further checks.
#[derive(Debug)]
pub struct PackPlan<'a> {
    by_place: Vec<Option<PairSource<'a>>>,
    metas: Vec<PairMeta>,
}

impl<'a> PackPlan<'a> {
    /// Check every pair against `layout` (place, rank, lengths, duplicates)
    /// before anything is written.
    pub fn new(layout: &impl PairLayout, pairs: &[PairSource<'a>]) -> Result<PackPlan<'a>, ImageError> {
        let stride = layout.stride();
        let mut by_place: Vec<Option<PairSource<'a>>> = vec![None; layout.len()];
        for p in pairs {
            let m = &p.meta;
            let (index, place) = place_of(layout, m.key)?;
            check_rank(m, stride)?;
            let shape_err = |part, got, expected| ImageError::Shape {
                key: m.key,
                part,
                got,
                expected,
            };
            // The source is the whole pair; the place may hold a rank's
            // shard of it.
            let (full_out, full_in) = place.shard.full_dims;
            if p.a.len() != m.rank * full_in {
                return Err(shape_err(PairPart::A, p.a.len(), m.rank * full_in));
            }
            if p.b.len() != full_out * m.rank {
                return Err(shape_err(PairPart::B, p.b.len(), full_out * m.rank));
            }
            if by_place[index].replace(*p).is_some() {
                return Err(ImageError::Duplicate { key: m.key });
            }
        }
        let mut metas: Vec<PairMeta> = pairs.iter().map(|p| p.meta).collect();
        metas.sort_by_key(|m| m.key);
        Ok(PackPlan { by_place, metas })
    }

    /// The pairs' metadata, sorted by key.
    pub fn metas(&self) -> &[PairMeta] {
        &self.metas
    }

    /// Write places `range` of `layout` into `dst`, which holds exactly
    /// their bytes (from the first place's A to the last place's B), in
    /// parallel across places. Every element of `dst` is written once.
    pub fn fill(&self, layout: &impl PairLayout, range: Range<usize>, dst: &mut [bf16]) -> Result<(), ImageError> {
        let expected = range_elems(layout, range.clone());
        if dst.len() != expected {
            return Err(ImageError::Destination {
                got: dst.len(),
                expected,
            });
        }
        let stride = layout.stride();
        place_regions(dst, layout, range.clone())
            .into_par_iter()
            .zip(self.by_place[range].par_iter())
            .try_for_each(|((place, region), src)| fill_place(region, &place, stride, src.as_ref()))
    }
}

impl PackPlan<'_> {
    /// The pair placed at layout place `place`, if any.
    pub fn key_at(&self, place: usize) -> Option<PairKey> {
        self.by_place.get(place)?.as_ref().map(|p| p.meta.key)
    }

    /// The plan as device repack regions over one slot image (element
    /// offsets from the slot's start), reading from a copy of a file's data
    /// section: two regions per place (A, then B; unadapted places as zeros).
    /// `None` unless every pair comes from that one file ([`Elems::File`] at
    /// or after `data_start`).
    pub fn repack_regions(
        &self,
        layout: &impl PairLayout,
        file: &SafetensorsFile,
    ) -> Option<Vec<lora_kernels::RepackRegion>> {
        use lora_kernels::RepackRegion;
        let stride = layout.stride();
        let data_start = file.data_start();
        let src_of = |elems: &Elems<'_>| match elems {
            Elems::File {
                file: f, offset, dtype, ..
            } if std::ptr::eq(*f, file) => Some((offset.checked_sub(data_start)?, repack_dtype(*dtype)? as u32)),
            _ => None,
        };
        let u32_of = |v: usize| u32::try_from(v).ok();
        let mut regions = Vec::with_capacity(2 * self.by_place.len());
        for (i, src) in self.by_place.iter().enumerate() {
            let place = layout.place(i)?;
            // A tensor-parallel shard is packed on the host.
            if !place.shard.is_whole() {
                return None;
            }
            let (a_dst, b_dst) = (place.a_offset / 2, place.b_offset / 2);
            let (rank, a, b) = match src {
                Some(p) => (p.meta.rank, Some(src_of(&p.a)?), Some(src_of(&p.b)?)),
                None => (0, None, None),
            };
            let (a_byte, a_dtype) = a.unwrap_or((0, 0));
            let (b_byte, b_dtype) = b.unwrap_or((0, 0));
            regions.push(RepackRegion {
                src_byte: a_byte,
                dst_elem: a_dst as u64,
                rows: u32_of(rank)?,
                src_cols: u32_of(place.in_dim)?,
                dst_rows: u32_of(stride)?,
                dst_cols: u32_of(place.in_dim)?,
                dtype: a_dtype,
                pad: 0,
            });
            regions.push(RepackRegion {
                src_byte: b_byte,
                dst_elem: b_dst as u64,
                rows: if rank == 0 { 0 } else { u32_of(place.out_dim)? },
                src_cols: u32_of(rank)?,
                dst_rows: u32_of(place.out_dim)?,
                dst_cols: u32_of(stride)?,
                dtype: b_dtype,
                pad: 0,
            });
        }
        Some(regions)
    }
}

/// Elements of places `range` of `layout`.
pub fn range_elems(layout: &impl PairLayout, range: Range<usize>) -> usize {
    let stride = layout.stride();
    range
        .filter_map(|i| layout.place(i))
        .map(|p| p.a_rows(stride).len() * p.in_dim + stride * p.out_dim)
        .sum()
}

/// Pack `pairs` into `dst` (exactly `layout.total_bytes() / 2` elements),
/// in parallel across pairs, and return their metadata sorted by key. Every
/// pair is checked before any element is written; every element of `dst` is
/// then written exactly once (padding and unadapted places as zeros), so
/// `dst` needs no clearing first.
pub fn pack_into(
    layout: &impl PairLayout,
    pairs: &[PairSource<'_>],
    dst: &mut [bf16],
) -> Result<Vec<PairMeta>, ImageError> {
    let plan = PackPlan::new(layout, pairs)?;
    plan.fill(layout, 0..layout.len(), dst)?;
    Ok(plan.metas)
}

impl SlotImage {
    /// Pack `pairs` into a fresh image of `layout`, in parallel across
    /// pairs. Every pair is checked before any byte is written; every byte
    /// is written once (padding and unadapted places as zeros).
    pub fn pack(layout: &impl PairLayout, pairs: &[PairSource<'_>]) -> Result<SlotImage, ImageError> {
        // A zeroed allocation comes from fresh pages, so this costs no pass.
        let mut data: Vec<bf16> = bytemuck::zeroed_vec(layout.total_bytes() / 2);
        let pairs = pack_into(layout, pairs, &mut data)?;
        Ok(SlotImage { data, pairs })
    }

    /// An all-zero image to land bytes into ([`SlotImage::declare`] then
    /// [`SlotImage::region_mut`]).
    pub fn zeroed(layout: &impl PairLayout) -> SlotImage {
        SlotImage {
            data: bytemuck::zeroed_vec(layout.total_bytes() / 2),
            pairs: Vec::new(),
        }
    }

    /// Declare a pair that will be landed byte-wise.
    pub fn declare(&mut self, layout: &impl PairLayout, meta: PairMeta) -> Result<(), ImageError> {
        place_of(layout, meta.key)?;
        check_rank(&meta, layout.stride())?;
        match self.pairs.binary_search_by_key(&meta.key, |p| p.key) {
            Ok(_) => Err(ImageError::Duplicate { key: meta.key }),
            Err(at) => {
                self.pairs.insert(at, meta);
                Ok(())
            }
        }
    }

    /// The bytes a landed part occupies: A's rows holding the pair's data
    /// ([`PairPlace::a_used_rows`]: its first `rank` rows, or under the
    /// fully-sharded option the rank's block of them; `rows * in * 2`
    /// bytes, the padding rows stay zero), or the whole B `[out, stride]`
    /// (the peer stages B with its zero columns).
    pub fn region_mut(
        &mut self,
        layout: &impl PairLayout,
        key: PairKey,
        part: PairPart,
    ) -> Result<&mut [u8], ImageError> {
        let (_, place) = place_of(layout, key)?;
        let meta = self
            .pairs
            .binary_search_by_key(&key, |p| p.key)
            .ok()
            .and_then(|i| self.pairs.get(i))
            .ok_or(ImageError::Undeclared { key })?;
        let (start, len) = match part {
            PairPart::A => (
                place.a_offset / 2,
                place.a_used_rows(layout.stride(), meta.rank).len() * place.in_dim,
            ),
            PairPart::B => (place.b_offset / 2, place.out_dim * layout.stride()),
        };
        Ok(bytemuck::cast_slice_mut(&mut self.data[start..start + len]))
    }

    /// The image as bytes.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.data)
    }

    /// The image as BF16 elements.
    pub fn as_elems(&self) -> &[bf16] {
        &self.data
    }

    /// The pairs the image holds, sorted by key.
    pub fn pairs(&self) -> &[PairMeta] {
        &self.pairs
    }
}

#[cfg(test)]
mod tests;
