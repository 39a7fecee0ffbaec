//! `cargo xtask probe`: the same arguments and files as `lora-audit probe`,
//! plus `--device cpu|cuda`, answered through the serving path — the pool,
//! the token overlays, the MoE folds and their kernels — instead of the pure
//! host math.
//!
//! usage: `cargo xtask probe <adapter_dir> --model <config.json>
//! --probes <in.safetensors> [--base <tables.safetensors>] --out
//! <out.safetensors> [--device cpu|cuda] [--max-rank N] [--expert-rank N]
//! [--allow-partial] [--experts] [--dora] [--embedding-lora] [--lm-head-lora]
//! [--tp-rank R --tp-world W [--vocab-parallel] [--fully-sharded]] [--ep-rank R --ep-world W] [--json]`
//!
//! DoRA pairs (`--dora`, or `LORA_DORA=1`) are module-output probes: the
//! probe file gives each DoRA projection's `base_weight::` (and
//! `base_bias::`), which the pool takes as the engine's base weights; each
//! probe row's output starts at the base output `W x + b`, and the answer is
//! the served output minus it (`lora_audit`'s probe docs). DoRA is served
//! with tensor and expert world 1 only (refused with a placement).
//!
//! With `--tp-rank R --tp-world W` (or `LORA_TP_RANK` / `LORA_TP_WORLD`)
//! the pool is rank R's (its shard of every pair) and each dense probe
//! output is the rank's part of the served delta, as `lora-audit probe`
//! writes it (`lora_audit::probe_adapter_at`): a column-parallel module
//! its output columns `[n, out_r]`, a row-parallel module the partial
//! delta `[n, out]` of its slice of the probe input, a replicated module
//! (and the output head's LoRA pair) the whole delta. With `--ep-rank R
//! --ep-world W` (or `LORA_EP_RANK` / `LORA_EP_WORLD`) the expert pool holds
//! rank R's block of experts and the router: an expert probe answers the
//! served delta of an expert the rank holds and zeros for any other (so the
//! ranks' outputs sum to the unsharded ones), a router probe the whole delta
//! on every rank.
//!
//! With `--vocab-parallel` (or `LORA_VOCAB_PARALLEL=1`) beside `--tp-rank R
//! --tp-world W`, the embedding and head pairs and the token tables follow
//! the base model's vocab-parallel split (rank R holds the token ids `R·V/W
//! .. (R+1)·V/W` of `V = vocab_size`; a `V` that does not divide is bad
//! input naming `vocab_size`), and their probes answer the rank's part:
//! an embedding `rows_idx::` probe the partial rows `[n, hidden]` (the
//! served row, overlay and embedding LoRA, of a token in the rank's block;
//! zeros for any other token, so the ranks' answers sum to the whole), an
//! lm_head `rows_idx::` probe likewise (zero rows outside the block), and
//! an lm_head LoRA probe (`probe_in::lm_head.weight`) the rank's logit
//! columns `[n, V/W]` (the ranks' answers concatenated in rank order are
//! the whole). Without it both are whole on every rank.
//! With `--fully-sharded` (or `LORA_FULLY_SHARDED=1`) the pools are built
//! with the placement's fully-sharded option: rank R's pool holds only its
//! block of rank rows of each column-parallel A, so its column-parallel
//! delta needs every rank's shrink output. The probe then loads every other
//! rank's pool too (same adapter) and runs the ranks' fully-sharded applies
//! as threads, gathered on the host (`lora_engine::HostCollective`); the
//! output contract is unchanged: rank R's output columns `[n, out_r]`.
//!
//! Exit status: 0 written, 1 the adapter is refused, 2 bad usage or input.

use std::path::PathBuf;

use lora_audit::{
    AuditArgs, AuditError, BASE_WEIGHT, LoraOptions, PROBE_OUT, ProbeBase, ProbeInputs, ProbeOutputs, ProbeTensor,
    WeightRef, parse_weight_name, read_base_tables, read_probe_inputs, write_probe_outputs,
};
use lora_engine::{CollectiveGather, HostCollective};
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::{LoraModule, ModelConfig, ModuleShard, ShardKind};
use lora_overlay::{ServedTables, TokenOverlays, probe_served_rows};
use lora_pool::{
    AdapterSource, BaseProjection, BaseWeights, BatchCapacity, FusedTargets, LoraPool, NoCompanion, PoolError,
    SlotCompanion, SlotId, SlotLease, StepRow,
};

/// Why the probe stopped: bad usage or input (exit 2), or a refused adapter
/// (exit 1, with the audit's table).
pub enum ProbeFailure {
    /// Exit 2.
    Usage(String),
    /// Exit 1.
    Refused(String),
}

struct Args {
    adapter: PathBuf,
    model: PathBuf,
    probes: PathBuf,
    base: Option<PathBuf>,
    out: PathBuf,
    device: Option<String>,
    max_rank: Option<usize>,
    expert_rank: Option<usize>,
    allow_partial: bool,
    experts: bool,
    dora: bool,
    tp_rank: Option<usize>,
    tp_world: Option<usize>,
    ep_rank: Option<usize>,
    ep_world: Option<usize>,
    fully_sharded: bool,
    embedding_lora: bool,
    lm_head_lora: bool,
    vocab_parallel: bool,
    json: bool,
}

fn parse(args: &[String]) -> Result<Args, String> {
    let mut adapter = None;
    let (mut model, mut probes, mut base, mut out, mut device) = (None, None, None, None, None);
    let (mut max_rank, mut expert_rank) = (None, None);
    let (mut tp_rank, mut tp_world, mut ep_rank, mut ep_world) = (None, None, None, None);
    let (mut allow_partial, mut experts, mut dora, mut embedding_lora, mut json) = (false, false, false, false, false);
    let (mut lm_head_lora, mut vocab_parallel, mut fully_sharded) = (false, false, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{a} needs a value"));
        let number = |v: String| v.parse::<usize>().map_err(|e| format!("{a}: {e}"));
        match a.as_str() {
            "--model" => model = Some(PathBuf::from(value()?)),
            "--probes" => probes = Some(PathBuf::from(value()?)),
            "--base" => base = Some(PathBuf::from(value()?)),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--device" => device = Some(value()?),
            "--max-rank" => max_rank = Some(number(value()?)?),
            "--expert-rank" => expert_rank = Some(number(value()?)?),
            "--tp-rank" => tp_rank = Some(number(value()?)?),
            "--tp-world" => tp_world = Some(number(value()?)?),
            "--ep-rank" => ep_rank = Some(number(value()?)?),
            "--ep-world" => ep_world = Some(number(value()?)?),
            "--allow-partial" => allow_partial = true,
            "--experts" => experts = true,
            "--dora" => dora = true,
            "--embedding-lora" => embedding_lora = true,
            "--lm-head-lora" => lm_head_lora = true,
            "--fully-sharded" => fully_sharded = true,
            "--vocab-parallel" => vocab_parallel = true,
            "--json" => json = true,
            flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}")),
            path if adapter.is_none() => adapter = Some(PathBuf::from(path)),
            extra => return Err(format!("unexpected argument {extra}")),
        }
    }
    let need = |v: Option<PathBuf>, what: &str| v.ok_or(format!("missing {what}"));
    Ok(Args {
        adapter: need(adapter, "<adapter_dir>")?,
        model: need(model, "--model")?,
        probes: need(probes, "--probes")?,
        base,
        out: need(out, "--out")?,
        device,
        max_rank,
        expert_rank,
        allow_partial,
        experts,
        dora,
        tp_rank,
        tp_world,
        ep_rank,
        ep_world,
        fully_sharded,
        embedding_lora,
        lm_head_lora,
        vocab_parallel,
        json,
    })
}

fn device(choice: Option<&str>) -> Result<Device, String> {
    match choice {
        None => Ok(Device::best().0),
        Some("cpu") => Ok(Device::cpu()),
        Some("cuda") => Device::cuda(0).map_err(|e| format!("--device cuda: {e}")),
        Some(other) => Err(format!("--device {other}: expected cpu or cuda")),
    }
}

/// Run the probe; the exit status follows `lora-audit probe`.
pub fn run(args: &[String]) -> Result<(), ProbeFailure> {
    let args = parse(args).map_err(ProbeFailure::Usage)?;
    let usage = |e: String| ProbeFailure::Usage(e);
    let overrides = AuditArgs {
        max_rank: args.max_rank,
        expert_rank: args.expert_rank,
        allow_partial: args.allow_partial,
        experts: args.experts,
        dora: args.dora,
        tp_rank: args.tp_rank,
        tp_world: args.tp_world,
        ep_rank: args.ep_rank,
        ep_world: args.ep_world,
        fully_sharded: args.fully_sharded,
        embedding_lora: args.embedding_lora,
        lm_head_lora: args.lm_head_lora,
        vocab_parallel: args.vocab_parallel,
    };
    let mut opts = LoraOptions::from_env()
        .and_then(|o| o.with_args(overrides))
        .map_err(|e| usage(e.to_string()))?;
    opts.max_loras = 1;
    opts.pinned = 0;
    let cfg = ModelConfig::from_file(&args.model).map_err(|e| usage(e.to_string()))?;
    let device = device(args.device.as_deref()).map_err(usage)?;
    let inputs = read_probe_inputs(&args.probes).map_err(|e| usage(e.to_string()))?;
    let capacity = BatchCapacity {
        max_rows: 64,
        max_segments: 4,
    };
    let base_weights = probe_base_weights(&cfg, &inputs, opts.dora).map_err(usage)?;
    let name = args.adapter.display().to_string();
    let source = [AdapterSource {
        name: &name,
        dir: &args.adapter,
    }];
    // A fully-sharded rank's column-parallel delta needs every rank's
    // shrink output: the other ranks' pools, in rank order (this rank's
    // place empty).
    let placement = opts.placement;
    let mut peers: Vec<Option<LoraPool>> = Vec::new();
    if placement.fully_sharded() && placement.tp_world() > 1 {
        for p in placement.ranks() {
            peers.push(if p == placement {
                None
            } else {
                let peer_opts = LoraOptions {
                    placement: p,
                    ..opts.clone()
                };
                let pool = LoraPool::load(&device, cfg.clone(), peer_opts, capacity, &source)
                    .map_err(|e| refused_or_usage(e, &args.adapter, &cfg))?;
                Some(pool)
            });
        }
    }
    let outputs = match &args.base {
        Some(base) => {
            let tables = served_tables(&device, &cfg, base, opts.placement).map_err(usage)?;
            let overlays = TokenOverlays::new(&device, tables, 1).map_err(|e| usage(e.to_string()))?;
            let mut pool =
                LoraPool::load_with_base_weights(&device, cfg.clone(), opts, capacity, &source, overlays, base_weights)
                    .map_err(|e| refused_or_usage(e, &args.adapter, &cfg))?;
            let mut outputs = serve_probes(&mut pool, &mut peers, &inputs)?;
            if !inputs.rows.is_empty() {
                let lease = slot_lease(&pool, SlotId::new(0)).map_err(usage)?;
                let rows = probe_served_rows(&mut pool, &lease, &inputs.rows).map_err(|e| usage(e.to_string()))?;
                outputs.tensors.extend(rows);
            }
            outputs
        }
        None => {
            if !inputs.rows.is_empty() {
                return Err(usage("rows_idx:: probes need --base <tables.safetensors>".into()));
            }
            let mut pool = LoraPool::load_with_base_weights(
                &device,
                cfg.clone(),
                opts,
                capacity,
                &source,
                NoCompanion,
                base_weights,
            )
            .map_err(|e| refused_or_usage(e, &args.adapter, &cfg))?;
            serve_probes(&mut pool, &mut peers, &inputs)?
        }
    };
    write_probe_outputs(&args.out, &outputs).map_err(|e| usage(e.to_string()))?;
    if args.json {
        let summary = serde_json::json!({
            "device": device.name(),
            "out": args.out.display().to_string(),
            "written": outputs.tensors.keys().collect::<Vec<_>>(),
            "unserved": outputs.unserved,
        });
        println!("{summary:#}");
    } else {
        println!(
            "wrote {} tensors to {} (served on {})",
            outputs.tensors.len(),
            args.out.display(),
            device.name()
        );
        for w in &outputs.unserved {
            println!("  not served (no delta written): {w}");
        }
    }
    Ok(())
}

/// The probe file's base projections (`base_weight::` / `base_bias::`) as
/// the pool's base weights, on a pool built for DoRA (`None` otherwise:
/// a DoRA adapter is then refused as it would be anywhere).
fn probe_base_weights(
    cfg: &ModelConfig,
    inputs: &ProbeInputs,
    dora: bool,
) -> Result<Option<std::sync::Arc<dyn BaseWeights>>, String> {
    if !dora {
        return Ok(None);
    }
    let mut map = std::collections::HashMap::new();
    for (weight, b) in &inputs.base {
        let WeightRef::Dense { layer, module } = parse_weight_name(weight, cfg).map_err(|e| e.to_string())? else {
            return Err(format!(
                "{BASE_WEIGHT}{weight}: only dense projections take base weights"
            ));
        };
        map.insert((layer, module), b.clone());
    }
    Ok(Some(std::sync::Arc::new(ProbeBaseWeights(map))))
}

/// Base projections read from a probe file.
struct ProbeBaseWeights(std::collections::HashMap<(usize, LoraModule), ProbeBase>);

impl BaseWeights for ProbeBaseWeights {
    fn projection(&self, layer: usize, module: LoraModule) -> Option<BaseProjection<'_>> {
        self.0.get(&(layer, module)).map(|b| BaseProjection {
            weight: &b.weight.data,
            bias: b.bias.as_ref().map(|t| t.data.as_slice()),
        })
    }
}

/// A refused adapter prints its audit table (exit 1); anything else is
/// bad input (exit 2).
fn refused_or_usage(e: PoolError, dir: &std::path::Path, cfg: &ModelConfig) -> ProbeFailure {
    if let PoolError::Audit { source, .. } = &e {
        if let AuditError::Refused(report) = source.as_ref() {
            return ProbeFailure::Refused(report.to_text(cfg));
        }
        if let AuditError::ConfigRefused(refusals) = source.as_ref() {
            let lines: Vec<String> = refusals.iter().map(|r| format!("  {r}")).collect();
            return ProbeFailure::Refused(format!("{}: REFUSED\n{}\n", dir.display(), lines.join("\n")));
        }
    }
    ProbeFailure::Usage(e.to_string())
}

/// The served base tables from `--base`: the embedding, and the head's own
/// table when the model is untied; a vocab-parallel rank's rows of them
/// under `placement`'s vocab-parallel cut.
pub fn served_tables(
    device: &Device,
    cfg: &ModelConfig,
    path: &std::path::Path,
    placement: lora_layout::Placement,
) -> Result<ServedTables, String> {
    let base = read_base_tables(path).map_err(|e| e.to_string())?;
    ServedTables::upload_at(device, &base, cfg, placement).map_err(|e| format!("{}: {e}", path.display()))
}

/// Dense probes through the pool's decode path and expert/router probes
/// through the MoE folds, all for the adapter in slot 0 (under one lease).
/// `peers`: every rank's pool but this one's (empty unless fully sharded
/// over more than one rank).
fn serve_probes<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    peers: &mut [Option<LoraPool>],
    inputs: &ProbeInputs,
) -> Result<ProbeOutputs, ProbeFailure> {
    let usage = |e: String| ProbeFailure::Usage(e);
    let lease = slot_lease(pool, SlotId::new(0)).map_err(usage)?;
    let experts = lora_moe::probe_expert_lora(pool, &lease, inputs).map_err(|e| usage(e.to_string()))?;
    let mut out = ProbeOutputs {
        tensors: experts.tensors,
        unserved: Vec::new(),
    };
    for weight in experts.not_expert {
        let x = &inputs.inputs[&weight];
        match parse_weight_name(&weight, pool.config()).map_err(|e| usage(e.to_string()))? {
            WeightRef::Dense { layer, module } => {
                let t = if peers.is_empty() || module.shard_kind() != ShardKind::Column {
                    dense_probe(pool, &lease, layer, module, x, inputs.base.get(&weight))
                } else {
                    fully_sharded_probe(pool, &lease, peers, layer, module, x)
                }
                .map_err(usage)?;
                out.tensors.insert(format!("{PROBE_OUT}{weight}"), t);
            }
            // The output head's LoRA delta, through the decode rule table's tall expand.
            WeightRef::Table(lora_audit::OverlayModule::LmHead) if pool.layout().lm_head().is_some() => {
                let t = head_probe(pool, &lease, x).map_err(usage)?;
                out.tensors.insert(format!("{PROBE_OUT}{weight}"), t);
            }
            WeightRef::Unserved => out.unserved.push(weight),
            _ => return Err(usage(format!("{weight}: token tables are probed with rows_idx::"))),
        }
    }
    Ok(out)
}

/// A lease on the adapter in `slot`, found by its name.
pub fn slot_lease<C: SlotCompanion>(pool: &LoraPool<C>, slot: SlotId) -> Result<SlotLease, String> {
    let name = pool
        .slots()
        .get(slot.index())
        .filter(|s| s.is_filled())
        .map(|s| s.name.clone())
        .ok_or_else(|| format!("slot {slot} holds no adapter"))?;
    pool.acquire(&name).map_err(|e| e.to_string())
}

/// One dense probe through the decode kernels. Each f32 probe row goes in
/// as two BF16 rows, `hi = bf16(x)` and `lo = bf16(x - hi)`, whose deltas
/// add up (the apply is linear in x): the probe then measures the served
/// pairs, not the rounding of its own input to BF16. With the projection's
/// base weight given (DoRA's module-output probes), the `hi` row starts at
/// the base output `W x + b` and the `lo` row at `b`: the served rescale
/// `g ⊙ (y − b) + b` is affine in y, so the two rows' outputs minus their
/// starts add up to `g ⊙ (W x + s·B A x) − W x`, the module output minus
/// the base output. Without it both start at zero, as a plain pair needs.
fn dense_probe<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    lease: &SlotLease,
    layer: usize,
    module: LoraModule,
    x: &ProbeTensor,
    base: Option<&ProbeBase>,
) -> Result<ProbeTensor, String> {
    let (_, full_in) = module.dims(pool.config());
    let n = probe_rows(x, full_in)?;
    // The pool's rank: its output columns and, for a row-parallel module,
    // its slice of the probe input (the whole of both at world 1).
    let placement = pool.layout().placement();
    let shard = ModuleShard::of(module, pool.config(), placement).map_err(|e| e.to_string())?;
    let (out_dim, in_dim) = shard.dims();
    if pool.layout().entry(layer, module).is_none() {
        return Ok(ProbeTensor {
            shape: vec![n, out_dim],
            data: vec![0.0; n * out_dim],
        });
    }
    let x_rank: Vec<f32> = x
        .data
        .chunks_exact(full_in.max(1))
        .flat_map(|row| row[shard.in_start..shard.in_start + in_dim].to_vec())
        .collect();
    let targets = FusedTargets::single_at(pool.config(), placement, module).map_err(|e| e.to_string())?;
    decode_probe(
        pool,
        lease,
        &x_rank,
        n,
        (out_dim, in_dim),
        base,
        |pool, step, xr, yr| pool.apply_decode(step, layer, &targets, xr, yr),
    )
}

/// One column-parallel dense probe of a fully-sharded rank: every rank's
/// fully-sharded apply of the probe rows, the ranks as threads (the peers)
/// and this thread (this rank), the shrink outputs all-gathered on the
/// host; this rank's output columns `[n, out_r]`.
fn fully_sharded_probe<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    lease: &SlotLease,
    peers: &mut [Option<LoraPool>],
    layer: usize,
    module: LoraModule,
    x: &ProbeTensor,
) -> Result<ProbeTensor, String> {
    let group = HostCollective::group(peers.len());
    let me = pool.layout().placement().tp_rank();
    std::thread::scope(|s| {
        for (r, peer) in peers.iter_mut().enumerate() {
            let Some(peer) = peer.as_mut() else { continue };
            let c = &group[r];
            s.spawn(move || {
                // Only this rank's output is written. Every rank runs the
                // same checks on the same adapter and input, so a call one
                // rank refuses, every rank refuses before its gather.
                let _ = slot_lease(peer, SlotId::new(0)).and_then(|l| rank_part(peer, &l, c, layer, module, x));
            });
        }
        rank_part(pool, lease, &group[me], layer, module, x)
    })
}

/// One rank's part of [`fully_sharded_probe`] on its pool.
fn rank_part<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    lease: &SlotLease,
    c: &HostCollective,
    layer: usize,
    module: LoraModule,
    x: &ProbeTensor,
) -> Result<ProbeTensor, String> {
    let (_, full_in) = module.dims(pool.config());
    let n = probe_rows(x, full_in)?;
    let placement = pool.layout().placement();
    let shard = ModuleShard::of(module, pool.config(), placement).map_err(|e| e.to_string())?;
    if pool.layout().entry(layer, module).is_none() {
        let out = shard.dims().0;
        return Ok(ProbeTensor {
            shape: vec![n, out],
            data: vec![0.0; n * out],
        });
    }
    let targets = FusedTargets::single_at(pool.config(), placement, module).map_err(|e| e.to_string())?;
    decode_probe(pool, lease, &x.data, n, shard.dims(), None, |pool, step, xr, yr| {
        pool.apply_fully_sharded(step, layer, &targets, xr, yr, &mut CollectiveGather(c))
    })
}

/// The output head's LoRA delta for probe rows (in = hidden, out = vocab),
/// through the pool's head apply: whole on every tensor-parallel rank (the
/// head pair is replicated), or a vocab-parallel rank's logit columns
/// `[n, V/W]` (its block of B's rows).
fn head_probe<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    lease: &SlotLease,
    x: &ProbeTensor,
) -> Result<ProbeTensor, String> {
    let vocab = pool.layout().lm_head().map_or(pool.config().vocab_size, |h| h.vocab);
    let dims = (vocab, pool.config().hidden_size);
    let n = probe_rows(x, dims.1)?;
    decode_probe(pool, lease, &x.data, n, dims, None, |pool, step, xr, yr| {
        pool.apply_lm_head_decode(step, xr, yr, lora_kernels::DecodeOptions::default())
    })
}

/// The rows of a probe `[rows, in]` of a weight that takes `in`.
fn probe_rows(x: &ProbeTensor, full_in: usize) -> Result<usize, String> {
    let [n, width] = x.shape[..] else {
        return Err(format!("probe shape {:?}; expected [rows, in]", x.shape));
    };
    if width != full_in || x.data.len() != n * width {
        return Err(format!("probe of width {width}; the weight takes {full_in}"));
    }
    Ok(n)
}

/// One probe of `n` rows `x` (`[n, in_dim]`) through a decode apply of
/// `(out_dim, in_dim)`, starting at the base output where `base` gives the
/// projection's weight (DoRA's module-output probes; see [`dense_probe`]).
fn decode_probe<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    lease: &SlotLease,
    x: &[f32],
    n: usize,
    (out_dim, in_dim): (usize, usize),
    base: Option<&ProbeBase>,
    apply: impl FnOnce(
        &LoraPool<C>,
        &lora_pool::DecodeStep,
        Rows<'_, half::bf16>,
        RowsMut<'_, f32>,
    ) -> Result<(), PoolError>,
) -> Result<ProbeTensor, String> {
    let (hi, lo) = crate::serve::split_hi_lo(x);
    let device = pool.device().clone();
    let err = |e: lora_kernels::KernelError| e.to_string();
    let xb = device.upload(&[hi, lo].concat()).map_err(err)?;
    let y0 = probe_start(base, x, n, out_dim, in_dim)?;
    let mut y = device.upload(&y0).map_err(err)?;
    let step = pool
        .decode_step(&vec![StepRow::Adapter(lease); 2 * n], 2 * n)
        .map_err(|e| e.to_string())?;
    apply(
        pool,
        &step,
        Rows::dense(&xb, 2 * n, in_dim),
        RowsMut::dense(&mut y, 2 * n, out_dim),
    )
    .map_err(|e| e.to_string())?;
    device.check_faults().map_err(err)?;
    let y: Vec<f32> = y
        .download()
        .map_err(err)?
        .iter()
        .zip(&y0)
        .map(|(y, y0)| y - y0)
        .collect();
    let (y_hi, y_lo) = y.split_at(n * out_dim);
    Ok(ProbeTensor {
        shape: vec![n, out_dim],
        data: y_hi.iter().zip(y_lo).map(|(a, b)| a + b).collect(),
    })
}

/// The probe rows' starting outputs: `W x + b` for the `n` hi rows, `b` for
/// the `n` lo rows (zeros without a base weight).
fn probe_start(base: Option<&ProbeBase>, x: &[f32], n: usize, out: usize, inp: usize) -> Result<Vec<f32>, String> {
    let mut y0 = vec![0f32; 2 * n * out];
    let Some(base) = base else {
        return Ok(y0);
    };
    if base.weight.shape != [out, inp] || base.bias.as_ref().is_some_and(|b| b.shape != [out]) {
        return Err(format!(
            "base weight {:?} / bias {:?} do not fit the projection [{out}, {inp}]",
            base.weight.shape,
            base.bias.as_ref().map(|b| &b.shape)
        ));
    }
    let bias = |o: usize| base.bias.as_ref().map_or(0.0, |b| b.data[o]);
    for r in 0..n {
        for o in 0..out {
            let w = &base.weight.data[o * inp..(o + 1) * inp];
            let wx = w
                .iter()
                .zip(&x[r * inp..(r + 1) * inp])
                .fold(0f32, |acc, (w, x)| acc + w * x);
            y0[r * out + o] = wx + bias(o);
            y0[(n + r) * out + o] = bias(o);
        }
    }
    Ok(y0)
}
