//! Serving-path checks shared by the demo and `cargo xtask probe`: PEFT
//! oracle probes answered through a real pool and its kernels.

use std::collections::BTreeSet;

use half::bf16;
use lora_audit::{Oracle, ProbeTensor, WeightRef, parse_weight_name};
use lora_kernels::testing::{Rng, rel_error};
use lora_kernels::{Rows, RowsMut};
use lora_layout::LoraModule;
use lora_pool::{LoraPool, ModuleTarget, SlotCompanion};

/// How a batch reaches the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One slot per row (BGMV).
    Decode,
    /// One slot per segment (SGMV).
    Prefill,
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Dense probe weights of `oracles`, with their (layer, module).
fn dense_weights<C: SlotCompanion>(
    pool: &LoraPool<C>,
    oracles: &[(usize, &Oracle)],
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

/// Run one mixed batch per dense probe weight: for each `(slot, oracle)`,
/// its probe rows (random rows when the adapter leaves the weight alone,
/// whose delta must then be exactly zero), then `base_rows` random rows of
/// the base model, each batch through the pool in `mode`. Returns each
/// adapter's largest relative error against its oracle (f64::INFINITY for a
/// nonzero delta where none is due) and the number of rows served.
pub fn mixed_dense_errors<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    oracles: &[(usize, &Oracle)],
    base_rows: usize,
    mode: Mode,
    rng: &mut Rng,
) -> Result<(Vec<f64>, usize), String> {
    let err = |e: lora_pool::PoolError| e.to_string();
    let device = pool.device().clone();
    let mut worst = vec![0.0f64; oracles.len()];
    let mut served = 0;
    for (w, layer, module) in dense_weights(pool, oracles)? {
        let (out_dim, in_dim) = module.dims(pool.config());
        let mut x = Vec::new();
        let mut row_slot = Vec::new();
        let mut expected: Vec<(Option<usize>, Option<&[f32]>)> = Vec::new();
        let mut segments = vec![0usize];
        for (k, (slot, oracle)) in oracles.iter().enumerate() {
            let probe_out = oracle.expected.get(&format!("{}{w}", lora_audit::PROBE_OUT));
            let rows = match (oracle.inputs.inputs.get(&w), probe_out) {
                (Some(input), Some(output)) => {
                    check_shapes(&w, input, output, in_dim, out_dim)?;
                    x.extend_from_slice(&input.data);
                    let n = input.shape[0];
                    expected.extend((0..n).map(|r| (Some(k), Some(&output.data[r * out_dim..(r + 1) * out_dim]))));
                    n
                }
                _ => {
                    x.extend((0..4 * in_dim).map(|_| rng.uniform() * 2.0 - 1.0));
                    expected.extend((0..4).map(|_| (Some(k), None)));
                    4
                }
            };
            row_slot.extend(std::iter::repeat_n(*slot as i32, rows));
            segments.push(segments[segments.len() - 1] + rows);
        }
        x.extend((0..base_rows * in_dim).map(|_| rng.uniform() * 2.0 - 1.0));
        row_slot.extend(std::iter::repeat_n(-1, base_rows));
        expected.extend((0..base_rows).map(|_| (None, None)));
        segments.push(segments[segments.len() - 1] + base_rows);
        let n = row_slot.len();
        let y0: Vec<f32> = (0..n * out_dim).map(|_| rng.uniform() - 0.5).collect();
        let xb = device.upload(&to_bf16(&x)).map_err(|e| e.to_string())?;
        let mut yb = device.upload(&y0).map_err(|e| e.to_string())?;
        let target = [ModuleTarget {
            module,
            y_col_offset: 0,
        }];
        let (xr, yr) = (Rows::dense(&xb, n, in_dim), RowsMut::dense(&mut yb, n, out_dim));
        match mode {
            Mode::Decode => {
                pool.set_decode_rows(&row_slot, n).map_err(err)?;
                pool.apply_decode(layer, &target, xr, yr).map_err(err)?;
            }
            Mode::Prefill => {
                let seg_slots: Vec<i32> = oracles
                    .iter()
                    .map(|(s, _)| *s as i32)
                    .chain(std::iter::once(-1))
                    .collect();
                pool.set_prefill_segments(&segments, &seg_slots).map_err(err)?;
                pool.apply_prefill(layer, &target, xr, yr).map_err(err)?;
            }
        }
        device.check_faults().map_err(|e| e.to_string())?;
        let y = yb.download().map_err(|e| e.to_string())?;
        for (r, (adapter, want)) in expected.iter().enumerate() {
            let delta: Vec<f32> = (0..out_dim).map(|c| y[r * out_dim + c] - y0[r * out_dim + c]).collect();
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
