//! `cargo xtask bench`: timings on a CUDA device, written as a table on
//! stdout and a JSON report.
//!
//! Method: each op is
//! captured once in a CUDA graph and replayed; before every timed replay the
//! L2 is flushed by streaming two tables of 2x L2 each through the row-diff
//! kernel (reads only, so no dirty lines are left to write back during the
//! timed replay); device events bracket each replay; the median of many is
//! reported, with p10/p90. Beside each time: the bytes floor (each distinct
//! adapter's A and B, x, and y read and written) over the device-to-device
//! copy bandwidth measured in the same run, and the same op through PyTorch
//! (gather + bmm; a per-segment matmul loop for prefill), timed the same way
//! by `xtask/bench/torch_lora_baseline.py` in the same call.
//!
//! A second time per case, "in a graph": the op captured many times in one
//! graph over rotating copies of its inputs (enough copies that one pass
//! streams at least 4x L2, so each op finds its inputs cold), the replay's
//! time divided by the ops in it. That is the cost an op adds inside an
//! engine's captured decode step, where one graph launch serves hundreds of
//! kernels, and the form of vLLM's LoRA kernel benchmark (an argument pool
//! rotated inside a graph of many calls). The isolated time above also pays
//! the graph's own launch (the empty-kernel row measures that). PyTorch is
//! timed both ways, over the same rotation.
//!
//! Sections: `kernels` (device-event timings above), `step` (the LoRA work
//! of one whole Llama-3.1-8B decode step in one graph, against its floor and
//! the same step's base projections: [`step`]), and the I/O sections
//! `swap` (a disk swap into a slot against a pinned host-to-device copy),
//! `tier` (a promotion from the host tier against the same copy:
//! [`bench_tier`]), `beside` (decode step graphs replayed while a promotion
//! lands on the copy lane, against the same steps alone) and `landing` (a peer landing over TCP loopback against a
//! plain socket copy), timed on the host clock in `bench_io`. A new device section is one function of the
//! [`Section`] signature added to [`SECTIONS`]; it appends rows to the shared
//! report.
//!
//! usage: `cargo xtask bench [--out PATH] [--torch-script PATH] [--reps N]
//! [--sections a,b] [--sweep] [--variant SUBSTRING] [--without-default] [--quick] [--only SUBSTRING]`
//! (`--variant`: the sweep's launch choices whose label contains it, or one of its `|`-separated pieces (a piece
//! `=label`: that label exactly), beside the default unless `--without-default`; `--only` likewise for the cases)

use std::path::PathBuf;
use std::process::Command;

use half::bf16;
use lora_kernels::ops::launch_floor::empty_launch;
use lora_kernels::testing::{PairPool, RandomPairs, Rng};
use lora_kernels::{
    Choice, DecodeOptions, DecodePlan, Device, DeviceBuffer, DeviceGraph, DoraEpilogue, KernelError, LoraTarget,
    LoraWorkspace, PairEntry, Rows, RowsMut, Segments, SgmvPhase, WorkspaceSpec, bgmv_candidates, bgmv_plan, bgmv_with,
    row_diff,
};
use lora_kernels::{PrefillOptions, PrefillPlan, sgmv_candidates, sgmv_plan, sgmv_with};
use serde_json::{Value, json};

use crate::bench_io::{self, IoRow};

#[path = "bench_tier.rs"]
mod bench_tier;
#[path = "bench_plot.rs"]
pub(crate) mod plot;
#[path = "bench_step.rs"]
mod step;

/// One bench section: runs its cases and appends rows to the report.
type Section = fn(&mut Ctx<'_>) -> Result<(), String>;

/// Sections in run order.
const SECTIONS: &[(&str, Section)] = &[("kernels", kernels_section), ("step", step::section)];

struct Options {
    out: PathBuf,
    torch_script: Option<PathBuf>,
    reps: usize,
    sections: Option<Vec<String>>,
    sweep: bool,
    /// Only cases whose name contains this.
    only: Option<String>,
    /// Only sweep variants whose label contains this, or one of its
    /// `|`-separated pieces, or equals a piece `=label` (and the default,
    /// unless `without_default`).
    variant: Option<String>,
    /// With `--variant`: leave the default out too (one variant's launches
    /// alone, for a profiler).
    without_default: bool,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options, String> {
        let mut o = Options {
            out: PathBuf::from("bench-out/bench.json"),
            torch_script: None,
            reps: 200,
            sections: None,
            sweep: false,
            only: None,
            variant: None,
            without_default: false,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut value = || it.next().cloned().ok_or(format!("{a} needs a value"));
            match a.as_str() {
                "--out" => o.out = PathBuf::from(value()?),
                "--torch-script" => o.torch_script = Some(PathBuf::from(value()?)),
                "--reps" => o.reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
                "--sections" => o.sections = Some(value()?.split(',').map(String::from).collect()),
                "--sweep" => o.sweep = true,
                "--only" => o.only = Some(value()?),
                "--variant" => {
                    o.variant = Some(value()?);
                    o.sweep = true;
                }
                "--quick" => o.reps = 30,
                "--without-default" => o.without_default = true,
                other => return Err(format!("unknown bench argument {other}")),
            }
        }
        Ok(o)
    }

    fn wants_case(&self, name: &str) -> bool {
        self.only.as_ref().is_none_or(|o| contains_any(name, o))
    }

    /// Keep the default and the sweep variants `--variant` asks for.
    fn filter_variants<T>(&self, variants: &mut Vec<(String, T)>) {
        if let Some(v) = &self.variant {
            let keep_default = !self.without_default;
            variants.retain(|(label, _)| (keep_default && label == "default") || contains_any(label, v));
        }
    }

    fn wants(&self, section: &str) -> bool {
        self.sections.as_ref().is_none_or(|s| s.iter().any(|x| x == section))
    }
}

/// One measured case.
#[derive(Debug, Clone)]
struct Row {
    section: &'static str,
    name: String,
    variant: String,
    stats: Stats,
    /// Bytes the op must move at least.
    floor_bytes: f64,
    /// The figure to beat, µs, and the target time (peer / speed-up), µs.
    peer_us: Option<f64>,
    target_us: Option<f64>,
    /// Share of the floor the op must reach (0.5 decode with n >= 64, 0.67 prefill).
    floor_share_target: Option<f64>,
    /// Shape fields for the JSON and the PyTorch script.
    shape: Value,
    torch_us: Option<f64>,
    /// The per-op time inside a graph of many over rotating inputs.
    in_graph: Option<InGraph>,
    torch_in_graph_us: Option<f64>,
}

/// What every row of one kernels-section case shares: its name, floor and targets.
struct KernelCase {
    name: String,
    floor_bytes: f64,
    peer_us: Option<f64>,
    target_us: Option<f64>,
    floor_share_target: Option<f64>,
    shape: Value,
}

impl KernelCase {
    /// The row of one launch choice of the case, timed in isolation.
    fn row(&self, variant: &str, stats: Stats) -> Row {
        Row {
            section: "kernels",
            name: self.name.clone(),
            variant: variant.to_string(),
            stats,
            floor_bytes: self.floor_bytes,
            peer_us: self.peer_us,
            target_us: self.target_us,
            floor_share_target: self.floor_share_target,
            shape: self.shape.clone(),
            torch_us: None,
            in_graph: None,
            torch_in_graph_us: None,
        }
    }
}

/// A per-op time from [`Ctx::time_in_graph`], with its rotation.
#[derive(Debug, Clone, Copy)]
struct InGraph {
    stats: Stats,
    /// Input copies rotated through, and ops captured in the graph.
    sets: usize,
    ops: usize,
}

#[derive(Debug, Clone, Copy)]
struct Stats {
    median_us: f64,
    p10_us: f64,
    p90_us: f64,
}

/// Everything sections share: the device, the L2 flusher, options, rows.
struct Ctx<'a> {
    device: &'a Device,
    opts: &'a Options,
    flusher: Flusher,
    copy_gbps: f64,
    /// The bf16 matrix rate measured by the baseline script, TFLOP/s.
    matrix_tflops: Option<f64>,
    rows: Vec<Row>,
    /// The `step` section's timings.
    steps: Vec<step::StepTiming>,
}

/// Streams 2 x 2 L2 worth of bytes through the row-diff kernel.
struct Flusher {
    a: DeviceBuffer<bf16>,
    b: DeviceBuffer<bf16>,
    out: DeviceBuffer<u8>,
    vocab: usize,
    width: usize,
}

impl Flusher {
    fn new(device: &Device) -> Result<Flusher, KernelError> {
        let width = 2048;
        let bytes = (2 * device.l2_bytes()).max(128 << 20);
        let vocab = bytes / (width * 2);
        Ok(Flusher {
            a: device.alloc_zeros(vocab * width)?,
            b: device.alloc_zeros(vocab * width)?,
            out: device.alloc_zeros(vocab)?,
            vocab,
            width,
        })
    }

    fn flush(&mut self, device: &Device) -> Result<(), KernelError> {
        let (a, b) = (
            Rows::dense(&self.a, self.vocab, self.width),
            Rows::dense(&self.b, self.vocab, self.width),
        );
        row_diff(device, a, b, 0.0, &mut self.out)
    }
}

fn err(e: KernelError) -> String {
    e.to_string()
}

impl Ctx<'_> {
    /// Replay `graph` `reps` times, each after an L2 flush, timed with events.
    fn time_graph(&mut self, graph: &DeviceGraph) -> Result<Stats, String> {
        let (device, flusher) = (self.device, &mut self.flusher);
        let us = replay_times(device, graph, 3, self.opts.reps, || flusher.flush(device))?;
        Ok(stats(us))
    }

    /// Capture `op(0..ops)` in one graph (op `i` works on input copy
    /// `i % sets`), replay it back to back and return the per-op time: each
    /// replay's time over `ops`, median of many. No flush: the rotation keeps
    /// every op's inputs out of L2 (see [`rotation`]).
    fn time_in_graph<F>(&mut self, sets: usize, ops: usize, mut op: F) -> Result<InGraph, String>
    where
        F: FnMut(usize) -> Result<(), KernelError>,
    {
        let graph = self
            .device
            .capture_graph(|| (0..ops).try_for_each(&mut op))
            .map_err(err)?;
        let reps = self.opts.reps.div_ceil(4).max(25);
        let us = replay_times(self.device, &graph, 2, reps, || Ok(()))?;
        Ok(InGraph {
            stats: stats(us.into_iter().map(|t| t / ops as f64).collect()),
            sets,
            ops,
        })
    }
}

/// `warm` replays of `graph`, then `reps` timed ones, each after `before`
/// (outside the events): µs per replay, once the device checked no fault.
fn replay_times(
    device: &Device,
    graph: &DeviceGraph,
    warm: usize,
    reps: usize,
    mut before: impl FnMut() -> Result<(), KernelError>,
) -> Result<Vec<f64>, String> {
    for _ in 0..warm {
        graph.replay().map_err(err)?;
    }
    let mut events = Vec::with_capacity(reps);
    for _ in 0..reps {
        before().map_err(err)?;
        let start = device.record_event().map_err(err)?;
        graph.replay().map_err(err)?;
        let end = device.record_event().map_err(err)?;
        events.push((start, end));
    }
    device.synchronize().map_err(err)?;
    device.check_faults().map_err(err)?;
    events
        .iter()
        .map(|(s, e)| Ok(f64::from(s.elapsed_ms(e).map_err(err)?) * 1e3))
        .collect()
}

/// Most ops captured in one in-graph timing, and the fewest (so the graph's
/// own launch is spread thin even when a few input copies fill 4x L2).
const IN_GRAPH_MAX_OPS: usize = 1024;
const IN_GRAPH_MIN_OPS: usize = 32;

/// `(sets, ops)` for an op that moves `set_bytes`: enough input copies that
/// one pass over them streams at least 4x L2 (so by the time an op's copy
/// comes round again it has long left the cache), and a whole number of
/// passes of at least [`IN_GRAPH_MIN_OPS`] ops.
fn rotation(l2_bytes: usize, set_bytes: f64) -> (usize, usize) {
    let sets = ((4.0 * l2_bytes as f64 / set_bytes.max(1.0)).ceil() as usize + 1).clamp(2, IN_GRAPH_MAX_OPS);
    let passes = IN_GRAPH_MIN_OPS.div_ceil(sets);
    (sets, sets * passes)
}

fn stats(mut us: Vec<f64>) -> Stats {
    us.sort_by(f64::total_cmp);
    let at = |q: f64| {
        us.get(((us.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    Stats {
        median_us: at(0.5),
        p10_us: at(0.1),
        p90_us: at(0.9),
    }
}

/// Device-to-device copy bandwidth (bytes read + written per second), GB/s.
fn copy_bandwidth(device: &Device) -> Result<f64, String> {
    let elems = (1usize << 30) / 8;
    let src = device.alloc_zeros::<u64>(elems).map_err(err)?;
    let mut dst = device.alloc_zeros::<u64>(elems).map_err(err)?;
    dst.copy_from(0, &src, 0, elems).map_err(err)?;
    let mut us = Vec::new();
    for _ in 0..10 {
        let s = device.record_event().map_err(err)?;
        dst.copy_from(0, &src, 0, elems).map_err(err)?;
        let e = device.record_event().map_err(err)?;
        us.push(f64::from(s.elapsed_ms(&e).map_err(err)?) * 1e3);
    }
    let t = stats(us).median_us;
    Ok(2.0 * (elems * 8) as f64 / (t * 1e3))
}

/// Run the bench.
pub fn run(args: &[String]) -> Result<(), String> {
    let opts = Options::parse(args)?;
    let device = Device::cuda(0).map_err(|e| format!("the bench needs a CUDA device: {e}"))?;
    device.preload_kernels().map_err(err)?;
    let copy_gbps = copy_bandwidth(&device)?;
    eprintln!(
        "bench: {} — copy bandwidth {copy_gbps:.0} GB/s, L2 {} MB",
        device.name(),
        device.l2_bytes() >> 20
    );
    let flusher = Flusher::new(&device).map_err(err)?;
    let mut ctx = Ctx {
        device: &device,
        opts: &opts,
        flusher,
        copy_gbps,
        matrix_tflops: None,
        rows: Vec::new(),
        steps: Vec::new(),
    };
    for (name, section) in SECTIONS {
        if opts.wants(name) {
            section(&mut ctx)?;
        }
    }
    if let Some(script) = &opts.torch_script
        && let Err(e) = torch_baseline(script, &mut ctx)
    {
        eprintln!("bench: PyTorch baseline not measured: {e}");
    }
    print_table(&ctx);
    step::print_table(&ctx);
    let io = io_sections(&device, &opts)?;
    write_json(&ctx, &device, &io)
}

/// The I/O sections (`swap`, `tier`, `landing`), timed on the host clock around
/// whole operations, each beside its baseline from the same run.
fn io_sections(device: &Device, opts: &Options) -> Result<Vec<IoRow>, String> {
    let reps = opts.reps.clamp(5, 30);
    let mut rows = Vec::new();
    if opts.wants("swap") {
        rows.push(bench_io::swap(device, reps, opts.sweep)?);
    }
    if opts.wants("tier") {
        rows.push(bench_tier::promotion(device, reps)?);
    }
    if opts.wants("beside") {
        rows.push(bench_tier::promotion_beside_decode(device, reps)?);
    }
    if opts.wants("landing") {
        rows.push(bench_io::peer_landing(reps.min(10))?);
    }
    if !rows.is_empty() {
        println!(
            "\n{:<44} {:>10} {:>34} {:>10} {:>7} {:>7}  spread",
            "I/O case", "ours µs", "baseline", "base µs", "ratio", "target"
        );
    }
    for r in &rows {
        let ratio = r.median_us / r.baseline_us;
        println!(
            "{:<44} {:>10.0} {:>34} {:>10.0} {:>7.2} {:>7}  {}",
            r.name,
            r.median_us,
            r.baseline,
            r.baseline_us,
            ratio,
            r.target_ratio.map_or("-".to_string(), |t| format!("<={t:.1}")),
            r.spread,
        );
    }
    Ok(rows)
}

// ---- the kernels section -------------------------------------------------

/// Whether `text` contains one of the `|`-separated pieces of `pattern`,
/// or equals a piece written `=label` (`--only`, `--variant`).
fn contains_any(text: &str, pattern: &str) -> bool {
    pattern.split('|').any(|piece| match piece.strip_prefix('=') {
        Some(label) => text == label,
        None => text.contains(piece),
    })
}

/// A decode case: rows, in, out, rank, distinct adapters, and the best peer µs.
type DecodeCase = (usize, usize, usize, usize, usize, Option<f64>);

/// Issue 4's decode shapes, then (no peer figures) a batch of several row
/// windows (the launch choices past one window) and four of items of
/// several rows in the two-phase range (few adapters for many rows).
const DECODE: &[DecodeCase] = &[
    (1, 4096, 4096, 16, 1, Some(15.2)),
    (16, 4096, 4096, 16, 16, Some(20.1)),
    (64, 4096, 4096, 16, 64, Some(29.5)),
    (64, 4096, 4096, 64, 64, Some(74.0)),
    (256, 4096, 4096, 16, 32, Some(26.8)),
    (64, 4096, 14336, 16, 64, Some(52.1)),
    (1024, 4096, 4096, 16, 64, None),
    // Large batches of several rows per adapter: where the fused launch's
    // clusters of 8 need several rounds (no peer figure).
    (512, 4096, 4096, 16, 64, None),
    (256, 4096, 4096, 16, 64, None),
    // The smallest batch of the two-phase range, one-row items (no peer
    // figure): the fused launch serves it in one round of clusters of 8.
    (32, 4096, 4096, 16, 32, None),
    // Items of 8 rows in the two-phase range (no peer figure), and of 2 and
    // 2.7: either side of the few-adapters rule.
    (128, 4096, 4096, 16, 16, None),
    (64, 4096, 4096, 16, 8, None),
    (64, 4096, 4096, 16, 32, None),
    (64, 4096, 4096, 16, 24, None),
    // Rank 64 with 8 rows per adapter (the entry-clustered form's pull sum).
    (256, 4096, 4096, 64, 32, None),
    // Rank 32 with 8 rows per adapter over 16: the entry-clustered form in
    // clusters of 8 with B and y staged (its rank-32 staged expand).
    (128, 4096, 4096, 32, 16, None),
    // The output head of a Llama-3 vocabulary (LoRA on lm_head): the tall
    // expand of the rule table's tall-output rule (no peer figure).
    (1, 4096, 128_256, 16, 1, None),
    (16, 4096, 128_256, 16, 16, None),
    (64, 4096, 128_256, 16, 64, None),
    (16, 4096, 128_256, 64, 4, None),
];
/// Decode cases over a table of more entries than the batch uses (the
/// second field), as an engine's table of every resident adapter is: the
/// launch is sized by the table, not by the adapters the rows name.
const DECODE_WIDE_TABLE: &[(DecodeCase, usize)] = &[
    ((64, 4096, 4096, 16, 8, None), 64),
    ((64, 4096, 4096, 16, 32, None), 64),
];
/// Decode cases of several targets in one launch (q, k and v: each its own
/// adapters' pairs, outputs side by side in y), and their target count.
const DECODE_TARGETS: &[(DecodeCase, usize)] = &[((64, 4096, 4096, 16, 64, None), 3)];
/// Decode cases timed only under `--sweep` (no peer figure), and their
/// table sizes: shapes whose H200 plan depends on how many clusters of 8
/// are resident at once (the entry form's cluster size past rank 16, the
/// fused launch's cost model), so a change of that count is timed where it
/// changes a decision.
const DECODE_SWEEP: &[(DecodeCase, usize)] = &[
    ((64, 4096, 4096, 64, 29, None), 29),
    ((64, 4096, 4096, 64, 30, None), 30),
    ((128, 4096, 4096, 64, 30, None), 30),
    ((64, 4096, 4096, 32, 30, None), 30),
    ((16, 4096, 4096, 64, 16, None), 32),
    ((31, 4096, 4096, 64, 31, None), 32),
    ((16, 4096, 4096, 64, 16, None), 64),
    ((31, 4096, 4096, 64, 31, None), 64),
    ((512, 4096, 4096, 8, 8, None), 8),
    ((513, 4096, 4096, 8, 8, None), 8),
    ((1024, 4096, 4096, 8, 8, None), 8),
    ((2048, 4096, 4096, 8, 8, None), 8),
    ((256, 4096, 4096, 8, 32, None), 32),
    ((512, 4096, 4096, 8, 32, None), 32),
    ((513, 4096, 4096, 8, 32, None), 32),
    ((1024, 4096, 4096, 8, 32, None), 32),
    ((129, 4096, 4096, 8, 64, None), 64),
    ((256, 4096, 4096, 8, 64, None), 64),
    ((512, 4096, 4096, 8, 64, None), 64),
    ((513, 4096, 4096, 8, 64, None), 64),
    ((1024, 4096, 4096, 8, 64, None), 64),
    ((2048, 4096, 4096, 8, 64, None), 64),
    ((31, 14336, 4096, 16, 31, None), 64),
    ((2048, 2048, 2048, 32, 8, None), 8),
    // Output heads (LoRA on lm_head) either side of rule 4½'s 16 rows, and
    // past its window of 512 (where the tall-output rule 6 serves it).
    ((4, 4096, 128_256, 16, 4, None), 4),
    ((8, 4096, 128_256, 16, 8, None), 8),
    ((15, 4096, 128_256, 16, 15, None), 15),
    ((1024, 4096, 128_256, 16, 64, None), 64),
];
/// Prefill (rows, segments, in, out, r) and the best peer µs.
const PREFILL: &[(usize, usize, usize, usize, usize, f64)] =
    &[(4096, 8, 4096, 4096, 16, 69.4), (8192, 32, 4096, 4096, 64, 445.9)];

/// More prefill shapes (rows, segments, in, out, r), timed only under
/// `--sweep` and with no target: to check a default (the shrink's K
/// splits, say) beyond the two shapes above.
const PREFILL_SWEEP: &[(usize, usize, usize, usize, usize)] = &[
    (1024, 8, 4096, 4096, 16),
    (2048, 4, 4096, 4096, 16),
    (4096, 32, 4096, 4096, 16),
    (8192, 8, 4096, 4096, 16),
    (4096, 8, 4096, 4096, 32),
    (4096, 16, 4096, 4096, 64),
];

/// Each target's distinct adapters' A and B, x read once, every target's y read and written.
fn floor_bytes(n: usize, in_dim: usize, out: usize, r: usize, distinct: usize, targets: usize) -> f64 {
    (targets * distinct * (r * in_dim + out * r) * 2 + n * (in_dim * 2 + targets * out * 4)) as f64
}

fn kernels_section(ctx: &mut Ctx<'_>) -> Result<(), String> {
    let mut rng = Rng::new(0x5eed_0004);
    launch_floor_row(ctx)?;
    let sweep = ctx.opts.sweep;
    let cases = DECODE
        .iter()
        .map(|&case| (case, case.4, 1))
        .chain(DECODE_WIDE_TABLE.iter().map(|&(case, entries)| (case, entries, 1)))
        .chain(DECODE_TARGETS.iter().map(|&(case, targets)| (case, case.4, targets)))
        .chain(
            DECODE_SWEEP
                .iter()
                .filter(|_| sweep)
                .map(|&(case, entries)| (case, entries, 1)),
        );
    for ((n, in_dim, out, r, distinct, peer), entries, targets) in cases {
        let mut name = format!("decode n={n} in={in_dim} out={out} r={r} d={distinct}");
        if entries > distinct {
            name += &format!(" of {entries}");
        }
        if targets > 1 {
            name += &format!(" x{targets} targets");
        }
        if !ctx.opts.wants_case(&name) {
            continue;
        }
        // Pairs, inputs and the variants: the default (the rule table's plan,
        // named in the row), and under `--sweep` every plan that serves the
        // call ([`bgmv_candidates`]), plain and under the overlap promise.
        let pairs = RandomPairs::new(&mut rng, in_dim, out, r, &vec![r as u32; entries * targets]);
        let (x_host, y_host) = (rng.bf16_vec(n * in_dim, 1.0), rng.bf16_vec(n * out * targets, 1.0));
        let idx_host: Vec<i32> = (0..n).map(|i| (i % distinct) as i32).collect();
        let upload = |device: &Device| -> Result<DecodeInputs, KernelError> {
            Ok(DecodeInputs {
                pool: pairs.upload(device)?,
                x: device.upload(&x_host)?,
                y: device.upload(&y_host)?,
                idx: device.upload(&idx_host)?,
            })
        };
        let shape = DecodeShape {
            n,
            in_dim,
            out,
            r,
            entries,
            targets,
        };
        let device = ctx.device;
        let case = KernelCase {
            name: name.clone(),
            floor_bytes: floor_bytes(n, in_dim, out, r, distinct, targets),
            peer_us: peer,
            target_us: peer.map(|p| p / 3.0),
            floor_share_target: (peer.is_some() && n >= 64).then_some(0.5),
            shape: json!({"kind": "decode", "n": n, "in": in_dim, "out": out, "r": r, "distinct": distinct, "targets": targets}),
        };
        // The isolated time uses the first copy; the in-graph one rotates through all.
        let (mut copies, ops) = rotating_copies(device, case.floor_bytes, &upload)?;
        let sets = copies.len();
        let default_plan = copies[0].plan(device, shape, DecodeOptions::default()).map_err(err)?;
        // The default row keeps its label; the plan it ran is printed beside it.
        if let Some(plan) = default_plan {
            eprintln!("bench: {name}: default plan {plan}");
        }
        // The rule table's plan under the overlap promise (what the engine's
        // decode applies pass): a row of its own, beside the default.
        let overlap = DecodeOptions {
            overlap_previous: true,
            ..DecodeOptions::default()
        };
        if let Some(plan) = copies[0].plan(device, shape, overlap).map_err(err)? {
            eprintln!("bench: {name}: overlap plan {plan}");
        }
        let mut variants = vec![
            ("default".to_string(), DecodeOptions::default()),
            ("overlap".to_string(), overlap),
        ];
        if ctx.opts.sweep {
            for overlap_previous in [false, true] {
                for plan in copies[0].candidates(device, shape, overlap_previous).map_err(err)? {
                    let options = DecodeOptions {
                        choice: Choice::Exact(plan),
                        overlap_previous,
                    };
                    variants.push((plan.to_string(), options));
                }
            }
        }
        ctx.opts.filter_variants(&mut variants);
        for &(ref variant, options) in &variants {
            let graph = match device.capture_graph(|| copies[0].apply(device, shape, options)) {
                Ok(g) => g,
                Err(e) => {
                    eprintln!("bench: {name} {variant}: {e}");
                    continue;
                }
            };
            let stats = ctx.time_graph(&graph)?;
            ctx.rows.push(case.row(variant, stats));
        }
        for &(ref variant, options) in &variants {
            match ctx.time_in_graph(sets, ops, |i| copies[i % sets].apply(device, shape, options)) {
                Ok(t) => attach_in_graph(ctx, &name, variant, t),
                // As for the isolated time: a launch choice this shape cannot take.
                Err(e) => eprintln!("bench: {name} {variant} in a graph: {e}"),
            }
        }
    }
    prefill_cases(ctx, &mut rng)?;
    dora_cases(ctx, &mut rng)
}

/// DoRA epilogue cases (rows, out, DoRA slots, slots the rows cycle over):
/// decode and prefill shapes of a 4096-wide projection (in 4096, rank 16),
/// half the slots DoRA or fewer. DoRA is the expand's epilogue
/// (`lora_kernels::ops::dora`): each case times the same apply (the rule
/// table's plan: the epilogue does not change it) without the epilogue
/// (`plain`) and with it (`epilogue`), so the difference is all DoRA adds.
const DORA: &[(usize, usize, usize, usize)] = &[
    (1, 4096, 1, 1),
    (64, 4096, 32, 64),
    (256, 4096, 16, 32),
    (4096, 4096, 4, 8),
    (8192, 4096, 16, 32),
];
const DORA_IN: usize = 4096;
const DORA_RANK: usize = 16;

/// One DoRA epilogue case's inputs on the device.
struct DoraInputs {
    pool: PairPool,
    x: DeviceBuffer<bf16>,
    y: DeviceBuffer<bf16>,
    /// Decode: each row's slot; prefill: each segment's.
    idx: DeviceBuffer<i32>,
    cu: DeviceBuffer<i32>,
    g_table: DeviceBuffer<u64>,
    bias: DeviceBuffer<f32>,
    _g: DeviceBuffer<f32>,
}

impl DoraInputs {
    /// The decode (bgmv) or prefill (sgmv, one segment per slot) apply of
    /// `n` rows, with the DoRA epilogue or without.
    fn apply(
        &mut self,
        device: &Device,
        n: usize,
        slots: usize,
        out: usize,
        epilogue: bool,
        ws: &mut LoraWorkspace,
    ) -> Result<(), KernelError> {
        let target = [LoraTarget {
            table: &self.pool.table,
            table_offset: 0,
            n_entries: slots,
            out_dim: out,
            y_col_offset: 0,
            dora: epilogue.then_some(DoraEpilogue {
                table: &self.g_table,
                table_offset: 0,
                bias: Some((&self.bias, 0)),
            }),
        }];
        let x = Rows::dense(&self.x, n, DORA_IN);
        let y = RowsMut::dense(&mut self.y, n, out);
        if n < 1024 {
            bgmv_with(device, x, &self.idx, &target, DORA_RANK, y, DecodeOptions::default())
        } else {
            let segments = Segments {
                cu_seqlens: &self.cu,
                seg_slot: &self.idx,
                n_segments: slots,
            };
            sgmv_with(
                device,
                x,
                &segments,
                &target,
                DORA_RANK,
                y,
                ws,
                PrefillOptions::default(),
            )
        }
    }
}

fn dora_cases(ctx: &mut Ctx<'_>, rng: &mut Rng) -> Result<(), String> {
    for &(n, out, dora_slots, slots) in DORA {
        let kind = if n >= 1024 { "prefill" } else { "decode" };
        let name = format!(
            "dora epilogue {kind} n={n} in={DORA_IN} out={out} r={DORA_RANK} dora slots {dora_slots} of {slots}"
        );
        if !ctx.opts.wants_case(&name) {
            continue;
        }
        let device = ctx.device;
        let pairs = RandomPairs::new(rng, DORA_IN, out, DORA_RANK, &vec![DORA_RANK as u32; slots]);
        let g: Vec<f32> = (0..slots * out).map(|_| 1.0 + 0.1 * rng.uniform()).collect();
        let g = device.upload(&g).map_err(err)?;
        let table: Vec<u64> = (0..slots)
            .map(|s| if s < dora_slots { g.addr_at(s * out) } else { Ok(0) })
            .collect::<Result<_, _>>()
            .map_err(err)?;
        // Decode: rows cycle over the slots; prefill: one segment per slot, equal lengths.
        let idx: Vec<i32> = if n < 1024 {
            (0..n).map(|i| (i % slots) as i32).collect()
        } else {
            (0..slots as i32).collect()
        };
        let cu: Vec<i32> = (0..=slots).map(|s| (s * n / slots) as i32).collect();
        let mut inputs = DoraInputs {
            pool: pairs.upload(device).map_err(err)?,
            x: device.upload(&rng.bf16_vec(n * DORA_IN, 1.0)).map_err(err)?,
            y: device.upload(&rng.bf16_vec(n * out, 1.0)).map_err(err)?,
            idx: device.upload(&idx).map_err(err)?,
            cu: device.upload(&cu).map_err(err)?,
            g_table: device.upload(&table).map_err(err)?,
            bias: device.upload(&vec![0.5f32; out]).map_err(err)?,
            _g: g,
        };
        let spec = WorkspaceSpec {
            max_rows: n,
            max_rank: DORA_RANK,
            max_segments: slots,
            max_targets: 1,
        };
        let mut ws = LoraWorkspace::new(device, spec).map_err(err)?;
        let plain_bytes = floor_bytes(n, DORA_IN, out, DORA_RANK, slots, 1);
        for (variant, epilogue) in [("plain", false), ("epilogue", true)] {
            let case = KernelCase {
                name: name.clone(),
                // The apply's bytes, and with the epilogue each DoRA slot's g and the bias.
                floor_bytes: plain_bytes
                    + if epilogue {
                        (dora_slots * out * 4 + out * 4) as f64
                    } else {
                        0.0
                    },
                peer_us: None,
                target_us: None,
                floor_share_target: None,
                shape: json!({"kind": "dora", "apply": kind, "n": n, "in": DORA_IN, "out": out, "r": DORA_RANK,
                              "dora_slots": dora_slots, "slots": slots}),
            };
            let graph = device
                .capture_graph(|| inputs.apply(device, n, slots, out, epilogue, &mut ws))
                .map_err(err)?;
            let stats = ctx.time_graph(&graph)?;
            drop(graph);
            // Not "default": the PyTorch baseline has no counterpart to time.
            ctx.rows.push(case.row(variant, stats));
            // In a graph of many, one set of inputs (the same for both variants).
            let timed = ctx.time_in_graph(1, IN_GRAPH_MIN_OPS, |_| {
                inputs.apply(device, n, slots, out, epilogue, &mut ws)
            })?;
            attach_in_graph(ctx, &name, variant, timed);
        }
    }
    Ok(())
}

/// One copy of a decode case's inputs.
struct DecodeInputs {
    pool: PairPool,
    x: DeviceBuffer<bf16>,
    y: DeviceBuffer<bf16>,
    idx: DeviceBuffer<i32>,
}

/// The one target of a bench case: all of `table`, `out` columns from 0.
fn whole_table(table: &DeviceBuffer<PairEntry>, n_entries: usize, out: usize) -> [LoraTarget<'_>; 1] {
    [LoraTarget {
        table,
        table_offset: 0,
        n_entries,
        out_dim: out,
        y_col_offset: 0,
        dora: None,
    }]
}

/// The shape of a decode case: `targets` targets of `out` outputs each
/// (side by side in y), each over its own `entries` table entries.
#[derive(Debug, Clone, Copy)]
struct DecodeShape {
    n: usize,
    in_dim: usize,
    out: usize,
    r: usize,
    entries: usize,
    targets: usize,
}

impl DecodeInputs {
    /// Run `f` on the arguments of `shape`'s apply over this copy.
    fn with_call<R>(
        &mut self,
        shape: DecodeShape,
        f: impl FnOnce(Rows<'_, bf16>, &DeviceBuffer<i32>, &[LoraTarget<'_>], RowsMut<'_, bf16>) -> R,
    ) -> R {
        let DecodeInputs { pool, x, y, idx } = self;
        let targets: Vec<LoraTarget<'_>> = (0..shape.targets)
            .map(|t| LoraTarget {
                table: &pool.table,
                table_offset: t * shape.entries,
                n_entries: shape.entries,
                out_dim: shape.out,
                y_col_offset: t * shape.out,
                dora: None,
            })
            .collect();
        let x = Rows::dense(x, shape.n, shape.in_dim);
        let y = RowsMut::dense(y, shape.n, shape.out * shape.targets);
        f(x, idx, &targets, y)
    }

    /// The decode apply of `shape` on these inputs.
    fn apply(&mut self, device: &Device, shape: DecodeShape, options: DecodeOptions) -> Result<(), KernelError> {
        self.with_call(shape, |x, idx, targets, y| {
            bgmv_with(device, x, idx, targets, shape.r, y, options)
        })
    }

    /// The plan of `shape`'s apply with `options` (`None` on the CPU).
    fn plan(
        &mut self,
        device: &Device,
        shape: DecodeShape,
        options: DecodeOptions,
    ) -> Result<Option<DecodePlan>, KernelError> {
        self.with_call(shape, |x, _, targets, y| {
            bgmv_plan(device, x, targets, shape.r, &y, options)
        })
    }

    /// Every plan that serves `shape`'s apply.
    fn candidates(
        &mut self,
        device: &Device,
        shape: DecodeShape,
        overlap_previous: bool,
    ) -> Result<Vec<DecodePlan>, KernelError> {
        self.with_call(shape, |x, _, targets, y| {
            bgmv_candidates(device, x, targets, shape.r, &y, overlap_previous)
        })
    }
}

/// The input copies of a case that moves `set_bytes` per op, each made by
/// `upload` (as many as [`rotation`] asks for), and the ops of its in-graph
/// timing.
fn rotating_copies<T>(
    device: &Device,
    set_bytes: f64,
    upload: &dyn Fn(&Device) -> Result<T, KernelError>,
) -> Result<(Vec<T>, usize), String> {
    let (sets, ops) = rotation(device.l2_bytes(), set_bytes);
    let copies = (0..sets).map(|_| upload(device)).collect::<Result<Vec<_>, _>>();
    Ok((copies.map_err(err)?, ops))
}

/// Record an in-graph time on the row of `name` and `variant`.
fn attach_in_graph(ctx: &mut Ctx<'_>, name: &str, variant: &str, timed: InGraph) {
    if let Some(row) = ctx.rows.iter_mut().find(|r| r.name == name && r.variant == variant) {
        row.shape["in_graph"] = json!({"sets": timed.sets, "ops": timed.ops});
        row.in_graph = Some(timed);
    }
}

fn prefill_cases(ctx: &mut Ctx<'_>, rng: &mut Rng) -> Result<(), String> {
    let extra: &[(usize, usize, usize, usize, usize)] = if ctx.opts.sweep { PREFILL_SWEEP } else { &[] };
    let shapes = PREFILL
        .iter()
        .map(|&(rows, segs, in_dim, out, r, peer)| (rows, segs, in_dim, out, r, Some(peer)))
        .chain(
            extra
                .iter()
                .map(|&(rows, segs, in_dim, out, r)| (rows, segs, in_dim, out, r, None)),
        );
    for (rows, segs, in_dim, out, r, peer) in shapes {
        let name = format!("prefill rows={rows} segs={segs} in={in_dim} out={out} r={r}");
        if !ctx.opts.wants_case(&name) {
            continue;
        }
        let pairs = RandomPairs::new(rng, in_dim, out, r, &vec![r as u32; segs]);
        let (x_host, y_host) = (rng.bf16_vec(rows * in_dim, 1.0), rng.bf16_vec(rows * out, 1.0));
        let cu_host: Vec<i32> = (0..=segs).map(|s| (s * rows / segs) as i32).collect();
        let slot_host: Vec<i32> = (0..segs as i32).collect();
        let upload = |device: &Device| -> Result<PrefillInputs, KernelError> {
            Ok(PrefillInputs {
                pool: pairs.upload(device)?,
                x: device.upload(&x_host)?,
                y: device.upload(&y_host)?,
                cu: device.upload(&cu_host)?,
                slot: device.upload(&slot_host)?,
            })
        };
        let shape = (rows, segs, in_dim, out, r);
        let case = KernelCase {
            name: name.clone(),
            floor_bytes: floor_bytes(rows, in_dim, out, r, segs, 1),
            peer_us: peer,
            target_us: peer.map(|p| p / 1.5),
            floor_share_target: peer.map(|_| 0.67),
            shape: json!({"kind": "prefill", "n": rows, "segments": segs, "in": in_dim, "out": out, "r": r, "distinct": segs}),
        };
        let device = ctx.device;
        // The isolated time uses the first copy; the in-graph one rotates through all.
        let (mut copies, ops) = rotating_copies(device, case.floor_bytes, &upload)?;
        let sets = copies.len();
        let spec = WorkspaceSpec {
            max_rows: rows,
            max_rank: r,
            max_segments: segs,
            max_targets: 1,
        };
        let mut ws = LoraWorkspace::new(device, spec).map_err(err)?;
        // The default (the rule table's plan) and under `--sweep` every plan
        // that serves the call, the other K splits and each phase alone.
        let mut variants = vec![("default".to_string(), PrefillOptions::default())];
        if ctx.opts.sweep {
            variants.extend(prefill_sweep(&mut copies[0], device, shape)?);
        }
        ctx.opts.filter_variants(&mut variants);
        for &(ref variant, options) in &variants {
            let graph = device
                .capture_graph(|| copies[0].apply(device, shape, &mut ws, options))
                .map_err(err)?;
            let stats = ctx.time_graph(&graph)?;
            ctx.rows.push(case.row(variant, stats));
        }
        // In a graph: every whole apply of a sweep (the y written back to
        // DRAM during the next op is a cost the isolated time leaves out).
        for &(ref variant, options) in variants.iter().filter(|(_, o)| o.only_phase.is_none()) {
            let timed = ctx.time_in_graph(sets, ops, |i| copies[i % sets].apply(device, shape, &mut ws, options))?;
            attach_in_graph(ctx, &name, variant, timed);
        }
    }
    Ok(())
}

/// The `--sweep` variants of a prefill case beside the default, each
/// labelled by its plan: every plan that serves the call
/// ([`sgmv_candidates`], the rule table's first), the rule table's plan with
/// each other K split, and each phase alone: the default's ("shrink only",
/// "expand only") and each other shrink's and expand's (with its y buffers
/// and way of dealing items) the candidates have.
fn prefill_sweep(
    inputs: &mut PrefillInputs,
    device: &Device,
    shape: PrefillShape,
) -> Result<Vec<(String, PrefillOptions)>, String> {
    let options = |plan, only_phase| PrefillOptions {
        choice: Choice::Exact(plan),
        only_phase,
    };
    let Some(auto) = inputs.plan(device, shape, Choice::Auto).map_err(err)? else {
        return Ok(Vec::new());
    };
    let candidates = inputs.candidates(device, shape).map_err(err)?;
    let mut variants = vec![
        ("shrink only".to_string(), options(auto, Some(SgmvPhase::Shrink))),
        ("expand only".to_string(), options(auto, Some(SgmvPhase::Expand))),
    ];
    variants.extend(candidates.iter().map(|&plan| (plan.to_string(), options(plan, None))));
    for k_splits in 1..=8 {
        let plan = PrefillPlan { k_splits, ..auto };
        if k_splits != auto.k_splits && inputs.plan(device, shape, Choice::Exact(plan)).is_ok() {
            variants.push((plan.to_string(), options(plan, None)));
        }
    }
    // The expand alone reads the plan's kernel, y buffers and way of dealing items.
    let expand_of = |p: &PrefillPlan| (p.expand, p.y_buffers, p.balanced_items);
    let (mut shrinks, mut expands) = (vec![(auto.shrink, auto.k_splits)], vec![expand_of(&auto)]);
    for &plan in &candidates {
        if !shrinks.contains(&(plan.shrink, plan.k_splits)) {
            shrinks.push((plan.shrink, plan.k_splits));
            variants.push((format!("shrink only {plan}"), options(plan, Some(SgmvPhase::Shrink))));
        }
        if !expands.contains(&expand_of(&plan)) {
            expands.push(expand_of(&plan));
            variants.push((format!("expand only {plan}"), options(plan, Some(SgmvPhase::Expand))));
        }
    }
    Ok(variants)
}

/// A prefill case's (rows, segments, in, out, r).
type PrefillShape = (usize, usize, usize, usize, usize);

/// One copy of a prefill case's inputs.
struct PrefillInputs {
    pool: PairPool,
    x: DeviceBuffer<bf16>,
    y: DeviceBuffer<bf16>,
    cu: DeviceBuffer<i32>,
    slot: DeviceBuffer<i32>,
}

impl PrefillInputs {
    /// Run `f` on the arguments of `shape`'s segment apply over this copy.
    fn with_call<R>(
        &mut self,
        (rows, segs, in_dim, out, _): PrefillShape,
        f: impl FnOnce(Rows<'_, bf16>, &Segments<'_>, &[LoraTarget<'_>], RowsMut<'_, bf16>) -> R,
    ) -> R {
        let target = whole_table(&self.pool.table, segs, out);
        let segments = Segments {
            cu_seqlens: &self.cu,
            seg_slot: &self.slot,
            n_segments: segs,
        };
        let x = Rows::dense(&self.x, rows, in_dim);
        f(x, &segments, &target, RowsMut::dense(&mut self.y, rows, out))
    }

    /// The segment apply of `shape` on these inputs.
    fn apply(
        &mut self,
        device: &Device,
        shape: PrefillShape,
        ws: &mut LoraWorkspace,
        options: PrefillOptions,
    ) -> Result<(), KernelError> {
        let r = shape.4;
        self.with_call(shape, |x, s, t, y| sgmv_with(device, x, s, t, r, y, ws, options))
    }

    /// The plan the apply of `shape` runs under `choice` (`None` on the CPU).
    fn plan(
        &mut self,
        device: &Device,
        shape: PrefillShape,
        choice: Choice<PrefillPlan>,
    ) -> Result<Option<PrefillPlan>, KernelError> {
        let r = shape.4;
        self.with_call(shape, |x, s, t, y| sgmv_plan(device, x, s, t, r, &y, choice))
    }

    /// Every plan that serves the apply of `shape`.
    fn candidates(&mut self, device: &Device, shape: PrefillShape) -> Result<Vec<PrefillPlan>, KernelError> {
        let r = shape.4;
        self.with_call(shape, |x, s, t, y| sgmv_candidates(device, x, s, t, r, &y))
    }
}

/// The launch floor of this method: one block of an empty kernel, captured
/// and replayed after an L2 flush like every case, so a reader sees how much
/// of a small batch's time is launch and cold start rather than kernel work.
fn launch_floor_row(ctx: &mut Ctx<'_>) -> Result<(), String> {
    let name = "launch floor: empty kernel, 1 block";
    if !ctx.opts.wants_case(name) && !ctx.opts.wants_case("decode") {
        return Ok(());
    }
    let device = ctx.device;
    let graph = device.capture_graph(|| empty_launch(device)).map_err(err)?;
    let stats = ctx.time_graph(&graph)?;
    // In a graph: an empty kernel node after another, nothing to rotate.
    let in_graph = ctx.time_in_graph(1, IN_GRAPH_MIN_OPS * 2, |_| empty_launch(device))?;
    let case = KernelCase {
        name: name.to_string(),
        floor_bytes: 0.0,
        peer_us: None,
        target_us: None,
        floor_share_target: None,
        shape: json!({"kind": "empty", "n": 0}),
    };
    // Not "default": the PyTorch baseline has no counterpart to time.
    let mut row = case.row("floor", stats);
    row.in_graph = Some(in_graph);
    ctx.rows.push(row);
    Ok(())
}

// ---- PyTorch baseline ----------------------------------------------------

fn torch_baseline(script: &PathBuf, ctx: &mut Ctx<'_>) -> Result<(), String> {
    let mut shapes: Vec<Value> = Vec::new();
    for row in ctx
        .rows
        .iter()
        .filter(|r| r.section == "kernels" && r.variant == "default")
    {
        let mut s = row.shape.clone();
        s["name"] = json!(row.name);
        shapes.push(s);
    }
    shapes.extend(step::torch_shapes(ctx));
    let out = std::env::temp_dir().join(format!("lora-torch-bench-{}.json", std::process::id()));
    let status = Command::new("python3")
        .arg(script)
        .args([
            "--shapes",
            &Value::Array(shapes).to_string(),
            "--reps",
            &ctx.opts.reps.to_string(),
            "--out",
        ])
        .arg(&out)
        .env("PYTHONUNBUFFERED", "1")
        .status()
        .map_err(|e| format!("cannot start python3: {e}"))?;
    if !status.success() {
        return Err(format!("{} exited with {status}", script.display()));
    }
    let text = std::fs::read_to_string(&out).map_err(|e| format!("cannot read {}: {e}", out.display()))?;
    let results: Value = serde_json::from_str(&text).map_err(|e| format!("baseline JSON: {e}"))?;
    for row in &mut ctx.rows {
        if let Some(us) = results[&row.name]["median_us"].as_f64() {
            row.torch_us = Some(us);
        }
        row.torch_in_graph_us = results[&row.name]["in_graph_us"].as_f64();
    }
    ctx.matrix_tflops = results["__matrix_rate__"]["tflops"].as_f64();
    step::read_torch(ctx, &results);
    Ok(())
}

// ---- output ----------------------------------------------------------------

/// The physical floor of a row: the larger of its bytes over the copy
/// bandwidth and its FLOPs (shrink `2·n·in·r` plus expand `2·n·r·out`) over
/// the matrix rate, both measured in this run.
fn floor_us(row: &Row, copy_gbps: f64, matrix_tflops: Option<f64>) -> f64 {
    let bytes_us = row.floor_bytes / (copy_gbps * 1e3);
    let dim = |k: &str| row.shape[k].as_f64().unwrap_or(0.0);
    let flops = 2.0 * dim("n") * dim("r") * (dim("in") + dim("out"));
    let flops_us = matrix_tflops.map_or(0.0, |t| flops / (t * 1e6));
    bytes_us.max(flops_us)
}

fn print_table(ctx: &Ctx<'_>) {
    println!(
        "\n{:<52} {:>8} {:>9} {:>15} {:>8} {:>7} {:>8} {:>7} {:>8} {:>9} {:>9} {:>9}  verdict",
        "case",
        "variant",
        "ours µs",
        "p10..p90",
        "floor µs",
        "%floor",
        "target",
        "peer",
        "torch",
        "in-graph",
        "%floor",
        "torch ig"
    );
    for r in &ctx.rows {
        let floor = floor_us(r, ctx.copy_gbps, ctx.matrix_tflops);
        let share = floor / r.stats.median_us;
        let fast = r.target_us.is_none_or(|t| r.stats.median_us <= t);
        let near = r.floor_share_target.is_none_or(|s| share >= s);
        let opt = |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |t| format!("{t:.digits$}"));
        let in_graph_us = r.in_graph.map(|g| g.stats.median_us);
        println!(
            "{:<52} {:>8} {:>9.2} {:>7.2}..{:<7.2} {:>8.2} {:>6.0}% {:>8.2} {:>7.1} {:>8} {:>9} {:>8} {:>9}  {}",
            r.name,
            r.variant,
            r.stats.median_us,
            r.stats.p10_us,
            r.stats.p90_us,
            floor,
            share * 100.0,
            r.target_us.unwrap_or(f64::NAN),
            r.peer_us.unwrap_or(f64::NAN),
            opt(r.torch_us, 1),
            opt(in_graph_us, 2),
            opt(in_graph_us.filter(|_| floor > 0.0).map(|t| floor / t * 100.0), 0),
            opt(r.torch_in_graph_us, 1),
            match (fast, near) {
                (true, true) => "ok",
                (false, true) => "SLOW vs target",
                (true, false) => "FAR from floor",
                (false, false) => "SLOW, FAR from floor",
            }
        );
    }
    println!(
        "copy bandwidth {:.0} GB/s (bytes read + written); bf16 matrix rate {}; floor = max(bytes / copy, FLOPs / matrix rate)",
        ctx.copy_gbps,
        ctx.matrix_tflops
            .map_or("not measured".to_string(), |t| format!("{t:.0} TFLOP/s"))
    );
}

fn write_json(ctx: &Ctx<'_>, device: &Device, io: &[IoRow]) -> Result<(), String> {
    let rows: Vec<Value> = ctx
        .rows
        .iter()
        .map(|r| {
            let floor = floor_us(r, ctx.copy_gbps, ctx.matrix_tflops);
            json!({
                "section": r.section,
                "name": r.name,
                "variant": r.variant,
                "shape": r.shape,
                "median_us": r.stats.median_us,
                "p10_us": r.stats.p10_us,
                "p90_us": r.stats.p90_us,
                "floor_bytes": r.floor_bytes,
                "floor_us": floor,
                "share_of_floor": floor / r.stats.median_us,
                "floor_share_target": r.floor_share_target,
                "peer_us": r.peer_us,
                "target_us": r.target_us,
                "torch_us": r.torch_us,
                "in_graph": r.in_graph.map(|g| json!({
                    "median_us": g.stats.median_us,
                    "p10_us": g.stats.p10_us,
                    "p90_us": g.stats.p90_us,
                    "share_of_floor": floor / g.stats.median_us,
                    "sets": g.sets,
                    "ops": g.ops,
                })),
                "torch_in_graph_us": r.torch_in_graph_us,
            })
        })
        .collect();
    let report = json!({
        "device": device.name(),
        "copy_gbps": ctx.copy_gbps,
        "matrix_tflops": ctx.matrix_tflops,
        "l2_bytes": device.l2_bytes(),
        "reps": ctx.opts.reps,
        "method": "CUDA graph replay, L2 flushed before each replay, device events, median",
        "method_in_graph": "the op captured `ops` times in one graph over `sets` rotating input copies (one pass >= 4x L2), replayed back to back, device events, median of replay time / ops",
        "rows": rows,
        "steps": step::to_json(ctx),
        "io": io.iter().map(|r| json!({
            "name": r.name,
            "bytes": r.bytes,
            "median_us": r.median_us,
            "spread": r.spread,
            "baseline": r.baseline,
            "baseline_us": r.baseline_us,
            "ratio": r.median_us / r.baseline_us,
            "target_ratio": r.target_ratio,
        })).collect::<Vec<_>>(),
    });
    if let Some(dir) = ctx.opts.out.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&ctx.opts.out, text).map_err(|e| format!("cannot write {}: {e}", ctx.opts.out.display()))?;
    eprintln!("bench: wrote {}", ctx.opts.out.display());
    let dir = ctx
        .opts
        .out
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default();
    for path in plot::write_plots(&report, &dir)? {
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A pass over the copies streams at least 4x L2 (unless capped),
        /// and the graph holds whole passes of at least the minimum ops.
        #[test]
        fn rotation_covers_four_l2_in_whole_passes(l2 in 1usize << 20..1 << 28, set in 1.0f64..1e9) {
            let (sets, ops) = rotation(l2, set);
            prop_assert!((2..=IN_GRAPH_MAX_OPS).contains(&sets));
            prop_assert!(sets == IN_GRAPH_MAX_OPS || sets as f64 * set >= 4.0 * l2 as f64);
            prop_assert!(ops % sets == 0 && ops >= IN_GRAPH_MIN_OPS);
            prop_assert!(ops < sets + IN_GRAPH_MIN_OPS);
        }
    }

    #[test]
    fn variant_pieces_match_by_substring_or_exactly() {
        assert!(contains_any("overlap 2p", "overlap"));
        assert!(contains_any("overlap 2p", "rows|2p"));
        assert!(!contains_any("overlap 2p", "=overlap"));
        assert!(contains_any("overlap", "=overlap"));
        assert!(contains_any("overlap", "x|=overlap"));
    }
}
