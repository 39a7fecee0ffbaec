//! CPU reference side of the pair tables: resolve a [`PairEntry`] through
//! the CPU address registry into host matrices, and the reference math of
//! one row's delta. Shared by the bgmv and sgmv references.

use std::collections::HashMap;

use half::bf16;

use super::dora::HostDora;
use super::{LoraTarget, OutputElem, Rows, RowsMut};
use crate::cpu_mem::CpuMemory;
use crate::error::KernelError;
use crate::table::PairEntry;

/// The CPU reference of every LoRA apply. `rows[r] = (index, position)`:
/// row r's entry index (-1: none) and where it was read (for errors, in
/// index array `arg`). Every delta is computed, and every table address
/// resolved, before y is touched, so an error leaves y as it was; then each
/// delta is added to y in f32 and, for a row whose entry has a DoRA rescale
/// at the target (`LoraTarget::dora`), rescaled (`dora` module docs), and
/// rounded once.
pub(crate) fn reference_apply<Y: OutputElem>(
    memory: &CpuMemory,
    x: &Rows<'_, bf16>,
    rows: &[(i64, usize)],
    arg: &'static str,
    targets: &[LoraTarget<'_>],
    stride: usize,
    mut y: RowsMut<'_, Y>,
) -> Result<(), KernelError> {
    let in_dim = x.width;
    let xs: Vec<f32> = x.download_dense()?.iter().map(|v| v.to_f32()).collect();
    // Per target and row: the delta, and the DoRA rescale of its entry if it has one.
    let mut deltas: Vec<Vec<Option<RowDelta>>> = Vec::with_capacity(targets.len());
    let mut doras: Vec<Option<HostDora<'_>>> = Vec::with_capacity(targets.len());
    for t in targets {
        let entries = t.table.download_range(t.table_offset, t.n_entries)?;
        let mut pairs = PairResolver::new(memory, entries, in_dim, t.out_dim, stride);
        let dora = t
            .dora
            .as_ref()
            .map(|d| d.resolve(memory, t.n_entries, t.out_dim))
            .transpose()?;
        let mut out = Vec::with_capacity(rows.len());
        for (r, &(index, position)) in rows.iter().enumerate() {
            out.push(match pairs.get(arg, position, index)? {
                Some(pair) => {
                    let mut delta = vec![0f32; t.out_dim];
                    pair.delta(&xs[r * in_dim..(r + 1) * in_dim], &mut delta);
                    // `get` returned a pair: `index` is a checked entry.
                    let g = match &dora {
                        Some(d) => d.scale_of(index as usize)?,
                        None => None,
                    };
                    Some(RowDelta { delta, g })
                }
                None => None,
            });
        }
        deltas.push(out);
        doras.push(dora);
    }
    y.cpu_for_each_row(|r, row| {
        for ((t, rows), dora) in targets.iter().zip(&deltas).zip(&doras) {
            let Some(RowDelta { delta, g }) = &rows[r] else {
                continue;
            };
            let cols = row[t.y_col_offset..t.y_col_offset + t.out_dim].iter_mut().zip(delta);
            match (dora, g) {
                (Some(dora), Some(g)) => {
                    for (c, (yv, dv)) in cols.enumerate() {
                        *yv = Y::from_f32(dora.apply(g, c, yv.to_f32() + dv));
                    }
                }
                _ => {
                    for (yv, dv) in cols {
                        *yv = Y::from_f32(yv.to_f32() + dv);
                    }
                }
            }
        }
    })
}

/// One row's delta at one target, and its entry's DoRA rescale (`None`: plain).
struct RowDelta {
    delta: Vec<f32>,
    g: Option<Vec<f32>>,
}

/// A resolved pair: the first `rank` rows of A and columns of B, widened.
pub(crate) struct HostPair {
    rank: usize,
    scale: f32,
    /// `[rank, in]`.
    a: Vec<f32>,
    /// `[out, rank]`.
    b: Vec<f32>,
}

/// Resolves table entries of one target once each.
pub(crate) struct PairResolver<'a> {
    memory: &'a CpuMemory,
    entries: Vec<PairEntry>,
    in_dim: usize,
    out_dim: usize,
    stride: usize,
    cache: HashMap<usize, Option<HostPair>>,
}

impl<'a> PairResolver<'a> {
    pub(crate) fn new(
        memory: &'a CpuMemory,
        entries: Vec<PairEntry>,
        in_dim: usize,
        out_dim: usize,
        stride: usize,
    ) -> Self {
        PairResolver {
            memory,
            entries,
            in_dim,
            out_dim,
            stride,
            cache: HashMap::new(),
        }
    }

    /// The pair of index `index` (from position `position` of index array
    /// `arg`); `None` for "no delta" (negative index or rank 0).
    pub(crate) fn get(
        &mut self,
        arg: &'static str,
        position: usize,
        index: i64,
    ) -> Result<Option<&HostPair>, KernelError> {
        if index < 0 {
            return Ok(None);
        }
        let n_entries = self.entries.len();
        let e = usize::try_from(index)
            .ok()
            .filter(|&e| e < n_entries)
            .ok_or(KernelError::BadIndex {
                arg,
                position,
                index,
                n_entries,
            })?;
        if !self.cache.contains_key(&e) {
            let pair = self.resolve(e)?;
            self.cache.insert(e, pair);
        }
        Ok(self.cache.get(&e).and_then(|p| p.as_ref()))
    }

    fn resolve(&self, e: usize) -> Result<Option<HostPair>, KernelError> {
        let entry = self.entries[e];
        let rank = entry.rank as usize;
        if rank == 0 {
            return Ok(None);
        }
        if rank > self.stride || entry.a == 0 || entry.b == 0 {
            return Err(KernelError::BadEntry {
                entry: e,
                rank: entry.rank,
                stride: self.stride,
                a: entry.a,
                b: entry.b,
            });
        }
        let a_len = rank * self.in_dim;
        let a: Vec<bf16> = self.memory.read(&|| format!("table entry {e} A"), entry.a, a_len)?;
        // B rows are `stride` apart; only the first `rank` columns of each are read.
        let b_len = if self.out_dim == 0 {
            0
        } else {
            (self.out_dim - 1) * self.stride + rank
        };
        let b_raw: Vec<bf16> = self.memory.read(&|| format!("table entry {e} B"), entry.b, b_len)?;
        let mut b = Vec::with_capacity(self.out_dim * rank);
        for o in 0..self.out_dim {
            b.extend(
                b_raw[o * self.stride..o * self.stride + rank]
                    .iter()
                    .map(|v| v.to_f32()),
            );
        }
        Ok(Some(HostPair {
            rank,
            scale: entry.scale,
            a: a.iter().map(|v| v.to_f32()).collect(),
            b,
        }))
    }
}

impl HostPair {
    /// `delta[o] = scale * sum_k B[o, k] * A[k, col]` (A `[rank, in_dim]`):
    /// the pair applied to the one-hot input `col`, f32 accumulation.
    pub(crate) fn column_delta(&self, col: usize, in_dim: usize, delta: &mut [f32]) {
        let a: Vec<f32> = (0..self.rank).map(|k| self.a[k * in_dim + col]).collect();
        for (o, d) in delta.iter_mut().enumerate() {
            let brow = &self.b[o * self.rank..(o + 1) * self.rank];
            *d = self.scale * brow.iter().zip(&a).fold(0f32, |acc, (b, a)| acc + b * a);
        }
    }

    /// `delta[o] = scale * sum_k B[o, k] * (sum_i A[k, i] * x[i])`, f32 accumulation.
    pub(crate) fn delta(&self, x: &[f32], delta: &mut [f32]) {
        let in_dim = x.len();
        let t: Vec<f32> = (0..self.rank)
            .map(|k| {
                self.a[k * in_dim..(k + 1) * in_dim]
                    .iter()
                    .zip(x)
                    .fold(0f32, |acc, (a, x)| acc + a * x)
            })
            .collect();
        for (o, d) in delta.iter_mut().enumerate() {
            let brow = &self.b[o * self.rank..(o + 1) * self.rank];
            *d = self.scale * brow.iter().zip(&t).fold(0f32, |acc, (b, t)| acc + b * t);
        }
    }
}
