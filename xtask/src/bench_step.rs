//! The `step` section of `cargo xtask bench`: the LoRA work of one whole
//! decode step at the Llama-3.1-8B geometry, against its bytes floor and
//! against the base projections of the same step.
//!
//! A [`LoraPool`] on the device (64 slots, rank 16) holds 64 distinct random
//! rank-16 adapters on every linear projection of every layer (q, k, v, o,
//! gate, up, down). For n = 1, 16 and 64, a decode step of n rows of n
//! distinct adapters is built from the adapters' leases, and one CUDA graph
//! captures the whole step's LoRA work: 32 layers × {qkv (q|k|v fused), o,
//! gate_up (gate|up fused), down} apply calls, 128 launches, on fixed x and
//! y buffers (one per site). The graph is replayed after an L2 flush, timed
//! with device events, median of many, as every isolated row of the kernels
//! section.
//!
//! Floor: every A and B of the step's distinct adapters read once (rank ×
//! (in + out) × 2 bytes per module and layer), each apply's x read and y
//! read and written, over the copy bandwidth of the same run (or the FLOPs
//! over the matrix rate, whichever is larger). Base: the step's base
//! projections (`x @ Wqkv`, `attn @ Wo`, `x @ Wgate_up`, `h @ Wdown` per
//! layer, cuBLAS through `torch.matmul`) captured in one graph by the
//! PyTorch baseline script in the same call and timed the same way; without
//! it the ratio is reported as not measured.
//!
//! Each step is timed twice: with plain applies, and with the applies an
//! engine makes ([`DecodeOptions::overlap_previous`]: each apply's first
//! reads of indices, tables and weights run under the kernel before it,
//! which an engine may promise because that kernel is the base projection
//! and writes only y). Beside each step, its sites one at a time (one graph
//! of the site's 32 launches, the same applies) against their own floors.

use half::bf16;
use lora_kernels::testing::Rng;
use lora_kernels::{Choice, DecodeOptions, DecodePlan, Device, DeviceBuffer, DeviceGraph, KernelError, Rows, RowsMut};
use lora_layout::{LoraModule, ModelConfig, SlotLayout};
use lora_pool::image::{Elems, PairMeta, PairSource, SlotImage};
use lora_pool::{
    BatchCapacity, DecodeStep, FusedTargets, LandedImages, LoraOptions, LoraPool, PoolError, SlotId, StepRow,
};
use serde_json::{Value, json};

use super::{Ctx, Stats, err};
use lora_rdma::bench::{LLAMA_8B, MODULES};

/// Rank of every adapter, and the pool's rank stride.
pub(super) const RANK: usize = 16;
/// Adapters in the pool (one slot each).
const ADAPTERS: usize = 64;
/// Rows of the steps timed; row `i` runs adapter `i`.
const ROWS: [usize; 3] = [1, 16, 64];
/// At this many rows the step must run within [`FLOOR_RATIO_TARGET`] × its floor.
const TARGET_ROWS: usize = 64;
const FLOOR_RATIO_TARGET: f64 = 1.5;
/// Every adapter's scale (`lora_alpha` 32 over rank 16).
const SCALE: f32 = 2.0;

/// One timed step.
#[derive(Debug, Clone)]
pub(super) struct StepTiming {
    name: String,
    n: usize,
    distinct: usize,
    layers: usize,
    /// The applies carry the overlap promise (as the engine's do).
    overlap: bool,
    /// The step graph's replay time.
    stats: Stats,
    /// Each site alone (its 32 launches in one graph): name, time, floor bytes.
    site_times: Vec<(&'static str, Stats, f64)>,
    floor_bytes: f64,
    flops: f64,
    /// The apply sites of one layer: (name, in, out).
    sites: Vec<(&'static str, usize, usize)>,
    /// The same step's base projections (PyTorch, cuBLAS), µs.
    base_us: Option<f64>,
}

impl StepTiming {
    fn floor_us(&self, copy_gbps: f64, matrix_tflops: Option<f64>) -> f64 {
        let bytes_us = bytes_floor_us(self.floor_bytes, copy_gbps);
        let flops_us = matrix_tflops.map_or(0.0, |t| self.flops / (t * 1e6));
        bytes_us.max(flops_us)
    }

    fn target_met(&self, floor_us: f64) -> Option<bool> {
        (self.n == TARGET_ROWS).then_some(self.stats.median_us <= FLOOR_RATIO_TARGET * floor_us)
    }
}

/// The time `bytes` take at the copy bandwidth, µs.
fn bytes_floor_us(bytes: f64, copy_gbps: f64) -> f64 {
    bytes / (copy_gbps * 1e3)
}

fn case_name(n: usize) -> String {
    format!("llama-8b decode step n={n} r={RANK} d={n}")
}

/// The options of one timed variant's applies.
pub(super) fn decode_options(overlap: bool) -> DecodeOptions {
    DecodeOptions {
        overlap_previous: overlap,
        ..DecodeOptions::default()
    }
}

fn adapter_name(a: usize) -> String {
    format!("step-{a}")
}

/// The four apply sites of one layer, in step order.
fn sites(cfg: &ModelConfig) -> [(&'static str, FusedTargets); 4] {
    [
        ("qkv", FusedTargets::qkv(cfg)),
        ("o", FusedTargets::single(cfg, LoraModule::OProj)),
        ("gate_up", FusedTargets::gate_up(cfg)),
        ("down", FusedTargets::single(cfg, LoraModule::DownProj)),
    ]
}

/// The input width of a site (its modules share x).
fn site_in(cfg: &ModelConfig, targets: &FusedTargets) -> usize {
    targets.targets().first().map_or(0, |t| t.module.dims(cfg).1)
}

/// Bytes the step must move at least: at every layer and site, each
/// distinct adapter's A and B of every module of the site, x read once, y
/// (the site's fused width) read and written, BF16.
fn step_floor_bytes(cfg: &ModelConfig, n: usize, distinct: usize, r: usize) -> f64 {
    sites(cfg)
        .iter()
        .map(|(_, t)| site_floor_bytes(cfg, t, n, distinct, r))
        .sum()
}

/// The part of [`step_floor_bytes`] one site moves over all layers.
fn site_floor_bytes(cfg: &ModelConfig, t: &FusedTargets, n: usize, distinct: usize, r: usize) -> f64 {
    let weights: usize = t
        .targets()
        .iter()
        .map(|m| {
            let (out, inp) = m.module.dims(cfg);
            r * (inp + out)
        })
        .sum();
    (cfg.num_hidden_layers * (distinct * weights * 2 + n * (site_in(cfg, t) * 2 + t.width() * 4))) as f64
}

/// The step's FLOPs: shrink `2·n·in·r` and expand `2·n·r·out` per module and layer.
fn step_flops(cfg: &ModelConfig, n: usize, r: usize) -> f64 {
    let per_layer: usize = MODULES
        .iter()
        .map(|m| {
            let (out, inp) = m.dims(cfg);
            2 * n * r * (inp + out)
        })
        .sum();
    (cfg.num_hidden_layers * per_layer) as f64
}

/// Random values the adapters' pairs are cut from: each pair a window at a
/// random start, so every adapter's values differ without generating 84 MB
/// of random numbers per adapter.
pub(super) struct Banks {
    a: Vec<bf16>,
    b: Vec<bf16>,
}

impl Banks {
    pub(super) fn new(cfg: &ModelConfig, rng: &mut Rng) -> Banks {
        let widest = MODULES
            .iter()
            .map(|m| {
                let (out, inp) = m.dims(cfg);
                out.max(inp)
            })
            .max()
            .unwrap_or(1);
        let len = 2 * RANK * widest;
        let amp_a = 1.0 / (cfg.hidden_size.max(1) as f32).sqrt();
        let amp_b = 1.0 / (RANK as f32).sqrt();
        Banks {
            a: rng.bf16_vec(len, amp_a),
            b: rng.bf16_vec(len, amp_b),
        }
    }
}

/// `len` values of `bank` from a random start.
fn window<'b>(bank: &'b [bf16], rng: &mut Rng, len: usize) -> &'b [bf16] {
    let start = rng.below(bank.len().saturating_sub(len) + 1);
    &bank[start..start + len]
}

/// One random adapter's slot image: a rank-16 pair on every module of every layer.
pub(super) fn adapter_image(
    layout: &SlotLayout,
    cfg: &ModelConfig,
    banks: &Banks,
    rng: &mut Rng,
) -> Result<SlotImage, String> {
    let mut sources = Vec::with_capacity(cfg.num_hidden_layers * MODULES.len());
    for layer in 0..cfg.num_hidden_layers {
        for module in MODULES.into_iter().filter(|m| m.applies_to_layer(cfg, layer)) {
            let (out, inp) = module.dims(cfg);
            sources.push(PairSource {
                meta: PairMeta::dense(layer, module, RANK, SCALE),
                a: Elems::Bf16(window(&banks.a, rng, RANK * inp)),
                b: Elems::Bf16(window(&banks.b, rng, out * RANK)),
            });
        }
    }
    SlotImage::pack(layout, &sources).map_err(|e| e.to_string())
}

/// A pool of `adapters` slots at rank 16 on `device`, every slot holding a
/// distinct random adapter named [`adapter_name`], published as a landed
/// image (no file, no audit: the values are made here).
fn filled_pool(
    device: &Device,
    cfg: &ModelConfig,
    adapters: usize,
    max_rows: usize,
    rng: &mut Rng,
) -> Result<LoraPool, String> {
    let opts = LoraOptions {
        max_loras: adapters,
        max_rank: RANK,
        rotatable: true,
        ..LoraOptions::default()
    };
    let capacity = BatchCapacity {
        max_rows,
        max_segments: 1,
    };
    let mut pool = LoraPool::new(device, cfg.clone(), opts, capacity).map_err(|e| e.to_string())?;
    let banks = Banks::new(cfg, rng);
    for a in 0..adapters {
        let image = adapter_image(pool.layout(), cfg, &banks, rng)?;
        pool.publish_landed(SlotId::new(a), &adapter_name(a), LandedImages::new(image, None))
            .map_err(|e| format!("adapter {a}: {e}"))?;
    }
    Ok(pool)
}

/// One apply site's fixed buffers.
pub(super) struct SiteBuffers {
    name: &'static str,
    targets: FusedTargets,
    in_dim: usize,
    x: DeviceBuffer<bf16>,
    y: DeviceBuffer<bf16>,
}

pub(super) fn site_buffers(
    device: &Device,
    cfg: &ModelConfig,
    n: usize,
    rng: &mut Rng,
) -> Result<Vec<SiteBuffers>, KernelError> {
    sites(cfg)
        .into_iter()
        .map(|(name, targets)| {
            let in_dim = site_in(cfg, &targets);
            Ok(SiteBuffers {
                name,
                targets,
                in_dim,
                x: device.upload(&rng.bf16_vec(n * in_dim, 1.0))?,
                y: device.alloc_zeros(n * targets.width())?,
            })
        })
        .collect()
}

/// The whole step's LoRA work: every layer's sites, in order.
pub(super) fn apply_step(
    pool: &LoraPool,
    step: &DecodeStep,
    n: usize,
    layers: usize,
    bufs: &mut [SiteBuffers],
    options: DecodeOptions,
) -> Result<(), PoolError> {
    for layer in 0..layers {
        for s in bufs.iter_mut() {
            apply_site(pool, step, n, layer, s, options)?;
        }
    }
    Ok(())
}

fn apply_site(
    pool: &LoraPool,
    step: &DecodeStep,
    n: usize,
    layer: usize,
    s: &mut SiteBuffers,
    options: DecodeOptions,
) -> Result<(), PoolError> {
    let width = s.targets.width();
    pool.apply_decode_with(
        step,
        layer,
        &s.targets,
        Rows::dense(&s.x, n, s.in_dim),
        RowsMut::dense(&mut s.y, n, width),
        options,
    )
}

/// Each site's plan (layer 0), for the log.
fn site_plans(pool: &LoraPool, step: &DecodeStep, n: usize, bufs: &mut [SiteBuffers], overlap: bool) -> String {
    bufs.iter_mut()
        .map(|s| {
            let width = s.targets.width();
            let y = RowsMut::dense(&mut s.y, n, width);
            let plan = pool.decode_plan(
                step,
                0,
                &s.targets,
                Rows::dense(&s.x, n, s.in_dim),
                &y,
                decode_options(overlap),
            );
            match plan {
                Ok(Some(p)) => format!("{}: {p}", s.name),
                Ok(None) => format!("{}: (no plan)", s.name),
                Err(e) => format!("{}: {e}", s.name),
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

pub(super) fn kernel_err(e: PoolError) -> KernelError {
    match e {
        PoolError::Kernel(k) => k,
        other => KernelError::InvalidArgument {
            arg: "pool",
            reason: other.to_string(),
        },
    }
}

/// Every site's y holds finite values, some of them not zero: the step's
/// deltas landed (a step of base rows would add nothing and time nothing).
fn check_deltas(bufs: &[SiteBuffers]) -> Result<(), String> {
    for s in bufs {
        let (name, y) = (s.name, s.y.download().map_err(err)?);
        if y.iter().any(|v| !v.is_finite()) {
            return Err(format!("step: the {name} output holds a non-finite value"));
        }
        if y.iter().all(|v| v.to_f32() == 0.0) {
            return Err(format!("step: the {name} output got no delta"));
        }
    }
    Ok(())
}

/// The `step` section.
pub(super) fn section(ctx: &mut Ctx<'_>) -> Result<(), String> {
    let wanted: Vec<usize> = ROWS
        .into_iter()
        .filter(|&n| ctx.opts.wants_case(&case_name(n)))
        .collect();
    let Some(&max_rows) = wanted.iter().max() else {
        return Ok(());
    };
    let cfg = ModelConfig::from_hf_config(LLAMA_8B).map_err(|e| e.to_string())?;
    let device = ctx.device;
    let mut rng = Rng::new(0x5eed_0041);
    let started = std::time::Instant::now();
    let mut pool = filled_pool(device, &cfg, ADAPTERS, max_rows, &mut rng)?;
    eprintln!(
        "bench: step: {ADAPTERS} random rank-{RANK} adapters of {:.1} MB published in {:.1} s",
        pool.layout().slot_bytes() as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    let leases = (0..ADAPTERS)
        .map(|a| pool.acquire(&adapter_name(a)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let layers = cfg.num_hidden_layers;
    for n in wanted {
        let rows: Vec<StepRow<'_>> = leases[..n].iter().map(StepRow::Adapter).collect();
        let step = pool.decode_step(&rows, n).map_err(|e| e.to_string())?;
        let mut bufs = site_buffers(device, &cfg, n, &mut rng).map_err(err)?;
        for overlap in [false, true] {
            let options = decode_options(overlap);
            eprintln!(
                "bench: step n={n}{}: {}",
                if overlap { " (overlap)" } else { "" },
                site_plans(&pool, &step, n, &mut bufs, overlap)
            );
            let graph = {
                let (pool, step, bufs) = (&pool, &step, &mut bufs);
                device
                    .capture_graph(|| apply_step(pool, step, n, layers, bufs, options).map_err(kernel_err))
                    .map_err(err)?
            };
            graph.replay().map_err(err)?;
            device.synchronize().map_err(err)?;
            device.check_faults().map_err(err)?;
            check_deltas(&bufs)?;
            let stats = ctx.time_graph(&graph)?;
            let mut site_times = Vec::new();
            for s in bufs.iter_mut() {
                let graph = site_graph(device, &pool, &step, n, layers, s, options)?;
                let site_stats = ctx.time_graph(&graph)?;
                let floor_bytes = site_floor_bytes(&cfg, &s.targets, n, n, RANK);
                if ctx.opts.sweep {
                    sweep_site(
                        ctx,
                        &pool,
                        &step,
                        n,
                        layers,
                        s,
                        overlap,
                        (site_stats.median_us, floor_bytes),
                    )?;
                }
                site_times.push((s.name, site_stats, floor_bytes));
            }
            ctx.steps.push(StepTiming {
                name: case_name(n),
                n,
                distinct: n,
                layers,
                overlap,
                stats,
                site_times,
                floor_bytes: step_floor_bytes(&cfg, n, n, RANK),
                flops: step_flops(&cfg, n, RANK),
                sites: sites(&cfg)
                    .iter()
                    .map(|(name, t)| (*name, site_in(&cfg, t), t.width()))
                    .collect(),
                base_us: None,
            });
        }
    }
    Ok(())
}

/// One graph of a site's applies at every layer.
fn site_graph(
    device: &Device,
    pool: &LoraPool,
    step: &DecodeStep,
    n: usize,
    layers: usize,
    s: &mut SiteBuffers,
    options: DecodeOptions,
) -> Result<DeviceGraph, String> {
    device
        .capture_graph(|| {
            (0..layers).try_for_each(|layer| apply_site(pool, step, n, layer, s, options).map_err(kernel_err))
        })
        .map_err(err)
}

/// `--sweep`: the site's 32 launches under every candidate plan (as exact
/// plans), printed fastest first beside the rule table's time.
#[allow(clippy::too_many_arguments)]
fn sweep_site(
    ctx: &mut Ctx<'_>,
    pool: &LoraPool,
    step: &DecodeStep,
    n: usize,
    layers: usize,
    s: &mut SiteBuffers,
    overlap: bool,
    (default_us, floor_bytes): (f64, f64),
) -> Result<(), String> {
    let device = ctx.device;
    let plans: Vec<DecodePlan> = {
        let width = s.targets.width();
        let y = RowsMut::dense(&mut s.y, n, width);
        pool.decode_candidates(step, 0, &s.targets, Rows::dense(&s.x, n, s.in_dim), &y, overlap)
            .map_err(|e| e.to_string())?
    };
    let floor_us = bytes_floor_us(floor_bytes, ctx.copy_gbps);
    let mut times = Vec::with_capacity(plans.len());
    for plan in plans {
        let options = DecodeOptions {
            choice: Choice::Exact(plan),
            overlap_previous: overlap,
        };
        let graph = site_graph(device, pool, step, n, layers, s, options)?;
        times.push((ctx.time_graph(&graph)?.median_us, plan));
    }
    times.sort_by(|a, b| a.0.total_cmp(&b.0));
    eprintln!(
        "bench: step sweep n={n} site {}{}: default {default_us:.1} µs, floor {floor_us:.1}",
        s.name,
        if overlap { " (overlap)" } else { "" }
    );
    for (us, plan) in times.iter().take(8) {
        eprintln!("    {us:>9.1} µs  {:>5.2}x floor  {plan}", us / floor_us);
    }
    Ok(())
}

// ---- the PyTorch baseline: the step's base projections -----------------------

/// One `base_step` shape per timed step, for the baseline script.
pub(super) fn torch_shapes(ctx: &Ctx<'_>) -> Vec<Value> {
    ctx.steps.iter().filter(|t| !t.overlap).map(base_shape).collect()
}

fn base_shape(t: &StepTiming) -> Value {
    json!({
        "kind": "base_step",
        "name": t.name,
        "n": t.n,
        "layers": t.layers,
        "sites": t.sites.iter().map(|(name, inp, out)| json!({"name": name, "in": inp, "out": out})).collect::<Vec<_>>(),
    })
}

/// The base times the script measured (nothing where it measured none).
pub(super) fn read_torch(ctx: &mut Ctx<'_>, results: &Value) {
    for t in &mut ctx.steps {
        t.base_us = results[&t.name]["median_us"].as_f64();
    }
}

// ---- output ----------------------------------------------------------------------

pub(super) fn print_table(ctx: &Ctx<'_>) {
    print!("{}", table(&ctx.steps, ctx.copy_gbps, ctx.matrix_tflops));
}

/// The section's table: LoRA time, floor, floor share, LoRA / base.
fn table(steps: &[StepTiming], copy_gbps: f64, matrix_tflops: Option<f64>) -> String {
    use std::fmt::Write;
    let Some(first) = steps.first() else {
        return String::new();
    };
    let mut out = format!(
        "\n{:<46} {:>9} {:>20} {:>9} {:>7} {:>8} {:>10} {:>10}  verdict\n",
        "decode step (32 layers x qkv,o,gate_up,down)",
        "LoRA µs",
        "p10..p90",
        "floor µs",
        "%floor",
        "x floor",
        "base µs",
        "LoRA/base"
    );
    for t in steps {
        let floor = t.floor_us(copy_gbps, matrix_tflops);
        let time = t.stats.median_us;
        let label = if t.overlap {
            format!("{} overlap", t.name)
        } else {
            t.name.clone()
        };
        let _ = writeln!(
            out,
            "{:<46} {:>9.1} {:>9.1}..{:<9.1} {:>9.1} {:>6.1}% {:>8.2} {:>10} {:>10}  {}",
            label,
            time,
            t.stats.p10_us,
            t.stats.p90_us,
            floor,
            floor / time * 100.0,
            time / floor,
            t.base_us.map_or("-".to_string(), |b| format!("{b:.1}")),
            t.base_us
                .map_or("not meas.".to_string(), |b| format!("{:.3}", time / b)),
            match t.target_met(floor) {
                Some(true) => format!("ok (<= {FLOOR_RATIO_TARGET}x floor)"),
                Some(false) => format!("FAR from floor (target <= {FLOOR_RATIO_TARGET}x)"),
                None => "-".to_string(),
            }
        );
        for (site, stats, bytes) in &t.site_times {
            let floor = bytes_floor_us(*bytes, copy_gbps);
            let _ = writeln!(
                out,
                "  {:<44} {:>9.1} {:>9.1}..{:<9.1} {:>9.1} {:>6.1}% {:>8.2}",
                format!("site {site} alone ({} launches)", t.layers),
                stats.median_us,
                stats.p10_us,
                stats.p90_us,
                floor,
                floor / stats.median_us * 100.0,
                stats.median_us / floor
            );
        }
    }
    let _ = writeln!(
        out,
        "one graph of {} apply calls per step over {ADAPTERS} resident rank-{RANK} adapters, L2 flushed before each \
         replay; floor = step bytes (each distinct adapter's A and B, x, y read + written) / copy bandwidth; \
         base = the step's base projections in PyTorch (cuBLAS) in one graph{}",
        first.layers * first.sites.len(),
        if steps.iter().any(|t| t.base_us.is_some()) {
            ""
        } else {
            " (not measured in this run)"
        }
    );
    out
}

pub(super) fn to_json(ctx: &Ctx<'_>) -> Value {
    let rows: Vec<Value> = ctx
        .steps
        .iter()
        .map(|t| {
            let floor = t.floor_us(ctx.copy_gbps, ctx.matrix_tflops);
            json!({
                "name": t.name,
                "overlap": t.overlap,
                "n": t.n,
                "distinct": t.distinct,
                "rank": RANK,
                "layers": t.layers,
                "sites": t.sites.iter().map(|(name, inp, out)| json!({"name": name, "in": inp, "out": out})).collect::<Vec<_>>(),
                "median_us": t.stats.median_us,
                "p10_us": t.stats.p10_us,
                "p90_us": t.stats.p90_us,
                "floor_bytes": t.floor_bytes,
                "flops": t.flops,
                "floor_us": floor,
                "share_of_floor": floor / t.stats.median_us,
                "floor_ratio_target": (t.n == TARGET_ROWS).then_some(FLOOR_RATIO_TARGET),
                "target_met": t.target_met(floor),
                "base_us": t.base_us,
                "lora_over_base": t.base_us.map(|b| t.stats.median_us / b),
                "site_times": t.site_times.iter().map(|(site, st, bytes)| json!({
                    "site": site, "median_us": st.median_us, "floor_bytes": bytes,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    Value::Array(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_8b() -> ModelConfig {
        ModelConfig::from_hf_config(LLAMA_8B).expect("config")
    }

    #[test]
    fn the_sites_cover_every_module_once_with_the_base_widths() {
        let cfg = llama_8b();
        let mut modules: Vec<LoraModule> = sites(&cfg)
            .iter()
            .flat_map(|(_, t)| t.targets().iter().map(|m| m.module))
            .collect();
        modules.sort_by_key(|m| m.index());
        assert_eq!(modules, MODULES.to_vec());
        let shape: Vec<(usize, usize)> = sites(&cfg).iter().map(|(_, t)| (site_in(&cfg, t), t.width())).collect();
        assert_eq!(shape, [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]);
    }

    #[test]
    fn the_floor_reads_every_distinct_slot_once_plus_the_activations() {
        let cfg = llama_8b();
        let slot = SlotLayout::new(&cfg, RANK).expect("layout").slot_bytes();
        for n in ROWS {
            let activations = cfg.num_hidden_layers * n * ((3 * 4096 + 14336) * 2 + (6144 + 4096 + 28672 + 4096) * 4);
            assert_eq!(step_floor_bytes(&cfg, n, n, RANK), (n * slot + activations) as f64);
        }
        // About 84 MB of adapter per row.
        assert!((80e6..90e6).contains(&(slot as f64)));
    }

    #[test]
    fn the_base_shape_names_the_step_and_its_sites() {
        let cfg = llama_8b();
        let t = StepTiming {
            name: case_name(16),
            n: 16,
            distinct: 16,
            layers: cfg.num_hidden_layers,
            overlap: false,
            site_times: Vec::new(),
            stats: Stats {
                median_us: 1.0,
                p10_us: 1.0,
                p90_us: 1.0,
            },
            floor_bytes: 0.0,
            flops: 0.0,
            sites: sites(&cfg)
                .iter()
                .map(|(name, t)| (*name, site_in(&cfg, t), t.width()))
                .collect(),
            base_us: None,
        };
        let s = base_shape(&t);
        assert_eq!(s["kind"], "base_step");
        assert_eq!(s["name"], case_name(16));
        assert_eq!((s["n"].as_u64(), s["layers"].as_u64()), (Some(16), Some(32)));
        assert_eq!(s["sites"][2]["out"].as_u64(), Some(28672));
        assert_eq!(s["sites"][3]["in"].as_u64(), Some(14336));
        // A missing or failed baseline leaves the ratio unmeasured; one read
        // back fills it.
        let mut steps = vec![t];
        let text = table(&steps, 4000.0, None);
        assert!(
            text.contains("not meas.") && text.contains("(not measured in this run)"),
            "{text}"
        );
        let results = json!({ case_name(16): {"median_us": 4.0} });
        for t in &mut steps {
            t.base_us = results[&t.name]["median_us"].as_f64();
        }
        let text = table(&steps, 4000.0, None);
        assert!(text.contains("0.250") && !text.contains("not meas"), "{text}");
        let missing = json!({"other": {"median_us": 4.0}});
        assert_eq!(missing[&steps[0].name]["median_us"].as_f64(), None);
    }

    /// The pool fill and the step's applies on the CPU backend at a tiny
    /// geometry: every site of every layer gets a delta from each row's own
    /// adapter (no graph, no timing).
    #[test]
    fn a_step_of_distinct_adapters_lands_a_delta_at_every_site() {
        let cfg = ModelConfig::from_hf_config(
            r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 96, "vocab_size": 32}"#,
        )
        .expect("config");
        let device = Device::cpu();
        let mut rng = Rng::new(7);
        let (adapters, n) = (4, 3);
        let mut pool = filled_pool(&device, &cfg, adapters, n, &mut rng).expect("pool");
        let leases: Vec<_> = (0..adapters)
            .map(|a| pool.acquire(&adapter_name(a)).expect("lease"))
            .collect();
        let rows: Vec<StepRow<'_>> = leases[..n].iter().map(StepRow::Adapter).collect();
        let step = pool.decode_step(&rows, n).expect("step");
        let mut bufs = site_buffers(&device, &cfg, n, &mut rng).expect("buffers");
        apply_step(&pool, &step, n, cfg.num_hidden_layers, &mut bufs, decode_options(true)).expect("apply");
        check_deltas(&bufs).expect("deltas");
        // Every row got its own delta: no two rows of the down output alike.
        let y = bufs[3].y.download().expect("download");
        let row = |i: usize| &y[i * 64..(i + 1) * 64];
        assert!(row(0) != row(1) && row(1) != row(2));
    }
}
