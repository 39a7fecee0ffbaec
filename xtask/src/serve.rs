//! Serving-path checks shared by the demo and `cargo xtask probe`: PEFT
//! oracle probes answered through a real pool and its kernels.

use std::collections::BTreeSet;

use half::bf16;
use lora_audit::{Oracle, ProbeTensor, WeightRef, parse_weight_name};
use lora_kernels::testing::{Rng, rel_error};
use lora_kernels::{Rows, RowsMut};
use lora_layout::LoraModule;
use lora_overlay::TokenOverlays;
use lora_pool::{FusedTargets, LoraPool, PrefillSeq, SlotCompanion, SlotId, SlotLease, StepRow};

use crate::probe::slot_lease;

/// How a batch reaches the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One slot per row (BGMV).
    Decode,
    /// One slot per segment (SGMV).
    Prefill,
}

/// Dense probe weights of `oracles`, with their (layer, module).
fn dense_weights<C: SlotCompanion>(
    pool: &LoraPool<C>,
    oracles: &[(SlotId, &Oracle)],
) -> Result<Vec<(String, usize, LoraModule)>, String> {
    let names: BTreeSet<&String> = oracles.iter().flat_map(|(_, o)| o.inputs.inputs.keys()).collect();
    let mut out = Vec::new();
    for w in names {
        if let WeightRef::Dense { layer, module } = parse_weight_name(w, pool.config()).map_err(|e| e.to_string())? {
            out.push((w.clone(), layer, module));
        }
    }
    Ok(out)
}

/// An f32 row as two BF16 rows, `hi = bf16(x)` and `lo = bf16(x - hi)`,
/// whose sum keeps about 16 bits of `x`: served as two rows of one slot,
/// their deltas add up to the delta of `x` (the apply is linear in x).
pub fn split_hi_lo(row: &[f32]) -> (Vec<bf16>, Vec<bf16>) {
    let hi: Vec<bf16> = row.iter().map(|&v| bf16::from_f32(v)).collect();
    let lo = row
        .iter()
        .zip(&hi)
        .map(|(&v, h)| bf16::from_f32(v - h.to_f32()))
        .collect();
    (hi, lo)
}

/// One probe row of a mixed batch: the adapter it belongs to (`None`: the
/// base model), PEFT's delta (`None`: exactly zero), and the batch rows
/// whose deltas add up to it.
struct LogicalRow<'a> {
    adapter: Option<usize>,
    delta: Option<&'a [f32]>,
    rows: Vec<usize>,
}

/// Run one mixed batch per dense probe weight: for each `(slot, oracle)`,
/// its probe rows (random rows when the adapter leaves the weight alone,
/// whose delta must then be exactly zero), then `base_rows` random rows of
/// the base model, each batch through the pool in `mode`. Returns each
/// adapter's largest per-row relative error against its oracle
/// (f64::INFINITY for a nonzero delta where none is due) and the number of
/// rows served.
///
/// Each f32 probe row goes in as two BF16 rows of the same slot, `hi =
/// bf16(x)` and `lo = bf16(x - hi)`, whose deltas add up (the apply is
/// linear in x): the check then measures the served pairs, not the rounding
/// of PEFT's f32 probe to BF16, which alone moves a cancelling row's delta
/// by more than 1 %.
pub fn mixed_dense_errors<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    oracles: &[(SlotId, &Oracle)],
    base_rows: usize,
    mode: Mode,
    rng: &mut Rng,
) -> Result<(Vec<f64>, usize), String> {
    let err = |e: lora_pool::PoolError| e.to_string();
    let device = pool.device().clone();
    let leases = leases(pool, oracles)?;
    let mut worst = vec![0.0f64; oracles.len()];
    let mut served = 0;
    for (w, layer, module) in dense_weights(pool, oracles)? {
        let (out_dim, in_dim) = module.dims(pool.config());
        let mut x: Vec<bf16> = Vec::new();
        let mut row_slot: Vec<StepRow<'_>> = Vec::new();
        let mut expected: Vec<LogicalRow<'_>> = Vec::new();
        let mut segments: Vec<PrefillSeq<'_>> = Vec::new();
        let random_rows = |x: &mut Vec<bf16>, expected: &mut Vec<_>, who: Option<usize>, n: usize, rng: &mut Rng| {
            for _ in 0..n {
                expected.push(LogicalRow {
                    adapter: who,
                    delta: None,
                    rows: vec![x.len() / in_dim],
                });
                x.extend((0..in_dim).map(|_| bf16::from_f32(rng.uniform() * 2.0 - 1.0)));
            }
        };
        for (k, ((_, oracle), lease)) in oracles.iter().zip(&leases).enumerate() {
            let first = x.len() / in_dim;
            let probe_out = oracle.expected.get(&format!("{}{w}", lora_audit::PROBE_OUT));
            match (oracle.inputs.inputs.get(&w), probe_out) {
                (Some(input), Some(output)) => {
                    check_shapes(&w, input, output, in_dim, out_dim)?;
                    for (r, row) in input.data.chunks_exact(in_dim).enumerate() {
                        let (hi, lo) = split_hi_lo(row);
                        let at = x.len() / in_dim;
                        x.extend(hi);
                        x.extend(lo);
                        expected.push(LogicalRow {
                            adapter: Some(k),
                            delta: Some(&output.data[r * out_dim..(r + 1) * out_dim]),
                            rows: vec![at, at + 1],
                        });
                    }
                }
                _ => random_rows(&mut x, &mut expected, Some(k), 4, rng),
            }
            let rows = x.len() / in_dim - first;
            row_slot.extend(std::iter::repeat_n(StepRow::Adapter(lease), rows));
            segments.push(PrefillSeq {
                row: StepRow::Adapter(lease),
                len: rows,
            });
        }
        random_rows(&mut x, &mut expected, None, base_rows, rng);
        row_slot.extend(std::iter::repeat_n(StepRow::Base, base_rows));
        segments.push(PrefillSeq {
            row: StepRow::Base,
            len: base_rows,
        });
        // An empty segment serves no rows; a step has none.
        segments.retain(|seq| seq.len > 0);
        let n = row_slot.len();
        let y0: Vec<f32> = (0..n * out_dim).map(|_| rng.uniform() - 0.5).collect();
        let xb = device.upload(&x).map_err(|e| e.to_string())?;
        let mut yb = device.upload(&y0).map_err(|e| e.to_string())?;
        let target = FusedTargets::single(pool.config(), module);
        let (xr, yr) = (Rows::dense(&xb, n, in_dim), RowsMut::dense(&mut yb, n, out_dim));
        match mode {
            Mode::Decode => {
                let step = pool.decode_step(&row_slot, n).map_err(err)?;
                pool.apply_decode(&step, layer, &target, xr, yr).map_err(err)?;
            }
            Mode::Prefill => {
                let step = pool.prefill_step(&segments).map_err(err)?;
                pool.apply_prefill(&step, layer, &target, xr, yr).map_err(err)?;
            }
        }
        device.check_faults().map_err(|e| e.to_string())?;
        let y = yb.download().map_err(|e| e.to_string())?;
        for LogicalRow {
            adapter,
            delta: want,
            rows,
        } in &expected
        {
            let delta: Vec<f32> = (0..out_dim)
                .map(|c| rows.iter().map(|&r| y[r * out_dim + c] - y0[r * out_dim + c]).sum())
                .collect();
            let e = match want {
                Some(reference) => rel_error(&delta, reference),
                None if delta.iter().all(|d| *d == 0.0) => 0.0,
                None => f64::INFINITY,
            };
            match adapter {
                Some(k) => worst[*k] = worst[*k].max(e),
                None if e != 0.0 => return Err(format!("{w}: a base-model row received a delta")),
                None => {}
            }
        }
        served += n;
    }
    Ok((worst, served))
}

/// A lease on each oracle's slot, in order.
fn leases<C: SlotCompanion>(pool: &LoraPool<C>, oracles: &[(SlotId, &Oracle)]) -> Result<Vec<SlotLease>, String> {
    oracles.iter().map(|(slot, _)| slot_lease(pool, *slot)).collect()
}

fn check_shapes(
    w: &str,
    input: &ProbeTensor,
    output: &ProbeTensor,
    in_dim: usize,
    out_dim: usize,
) -> Result<(), String> {
    let n = input.shape.first().copied().unwrap_or(0);
    if input.shape != [n, in_dim] || output.shape != [n, out_dim] {
        return Err(format!(
            "{w}: oracle shapes {:?} -> {:?} do not match the model's ({in_dim} -> {out_dim})",
            input.shape, output.shape
        ));
    }
    Ok(())
}

/// One batch of token ids through the embedding overlay: for each
/// `(slot, oracle)`, the ids whose embedding row PEFT's merge changed
/// (`rows_idx::…embed_tokens.weight`; none for an adapter without token
/// overlays) and 4 random ids, then `base_rows` random ids of the base
/// model. Returns each adapter's largest relative error against PEFT's
/// merged rows (f64::INFINITY when a row that must stay the base's does
/// not).
pub fn mixed_token_errors(
    pool: &mut LoraPool<TokenOverlays>,
    oracles: &[(SlotId, &Oracle)],
    base_rows: usize,
    rng: &mut Rng,
) -> Result<Vec<f64>, String> {
    let s = |e: &dyn std::fmt::Display| e.to_string();
    let device = pool.device().clone();
    let (vocab, hidden) = (pool.companion().tables().vocab(), pool.companion().tables().hidden());
    let base = pool.companion().tables().embed().download().map_err(|e| s(&e))?;
    let leases = leases(pool, oracles)?;
    let mut ids: Vec<u32> = Vec::new();
    let mut row_slot: Vec<StepRow<'_>> = Vec::new();
    let mut expected: Vec<(Option<usize>, Option<Vec<f32>>)> = Vec::new();
    let table = oracles
        .iter()
        .flat_map(|(_, o)| o.inputs.rows.keys())
        .find(|t| t.ends_with("embed_tokens.weight"))
        .cloned();
    for (k, ((_, oracle), lease)) in oracles.iter().zip(&leases).enumerate() {
        let changed: Vec<i64> = table
            .as_ref()
            .and_then(|t| oracle.inputs.rows.get(t))
            .cloned()
            .unwrap_or_default();
        let merged = table
            .as_ref()
            .and_then(|t| oracle.expected.get(&format!("{}{t}", lora_audit::ROWS_MERGED)));
        for (r, &id) in changed.iter().enumerate() {
            let row = merged.map(|m| m.data[r * hidden..(r + 1) * hidden].to_vec());
            ids.push(u32::try_from(id).map_err(|e| s(&e))?);
            expected.push((Some(k), row));
        }
        for _ in 0..4 {
            let id = loop {
                let id = rng.below(vocab) as i64;
                if !changed.contains(&id) {
                    break id;
                }
            };
            ids.push(id as u32);
            expected.push((Some(k), None));
        }
        row_slot.extend(std::iter::repeat_n(StepRow::Adapter(lease), changed.len() + 4));
    }
    for _ in 0..base_rows {
        ids.push(rng.below(vocab) as u32);
        expected.push((None, None));
    }
    row_slot.extend(std::iter::repeat_n(StepRow::Base, base_rows));
    let n = ids.len();
    let step = pool.decode_step(&row_slot, n).map_err(|e| s(&e))?;
    let rows = pool.step_slots(&step).map_err(|e| s(&e))?;
    let ids_dev = device.upload(&ids).map_err(|e| s(&e))?;
    let mut out = device.alloc_zeros::<bf16>(n * hidden).map_err(|e| s(&e))?;
    pool.companion()
        .embed(&ids_dev, Some(rows), RowsMut::dense(&mut out, n, hidden))
        .map_err(|e| s(&e))?;
    device.check_faults().map_err(|e| s(&e))?;
    let out = out.download().map_err(|e| s(&e))?;
    let mut worst = vec![0.0f64; oracles.len()];
    for (r, (adapter, want)) in expected.iter().enumerate() {
        let got: Vec<f32> = out[r * hidden..(r + 1) * hidden].iter().map(|v| v.to_f32()).collect();
        let id = ids[r] as usize;
        let e = match want {
            Some(reference) => rel_error(&got, reference),
            None if out[r * hidden..(r + 1) * hidden] == base[id * hidden..(id + 1) * hidden] => 0.0,
            None => f64::INFINITY,
        };
        match adapter {
            Some(k) => worst[*k] = worst[*k].max(e),
            None if e != 0.0 => return Err(format!("token {id} of a base-model row is not the base row")),
            None => {}
        }
    }
    Ok(worst)
}
