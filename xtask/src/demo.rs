//! `cargo xtask demo [--verbose]`: the whole pipeline on the bundled PEFT
//! fixtures, on the GPU when one is present and on the CPU backend otherwise.
//!
//! 1. The reference engine (`lora-engine`) serves llama's mixed request
//!    batch (base rows, three adapters in two slots, so adapters are
//!    promoted and evicted) step by step; between two steps it tries a
//!    refused adapter's swap onto an idle slot and the eviction of a held
//!    slot, both refused and changing nothing. Every request's prompt
//!    logits, step logits and greedy tokens are compared with PEFT's own
//!    (`fixtures/engine/<family>/peft.safetensors`); then the promotions,
//!    prefix hits and refusals are listed.
//! 2. The same check, one line each, for the other eight families
//!    (`llama_embed`: LoRA on the input embedding, `llama_lm_head`: LoRA on
//!    the output head, each in slots with its place).
//! 3. The pool's kernels against the PEFT probe oracles (`fixtures/llama`,
//!    `fixtures/qwen3_moe`): mixed decode and prefill batches through every
//!    adapted layer, the token overlays, the MoE experts and router, a disk
//!    swap while the other slots serve, and a broken swap that must be
//!    refused.
//!
//! `--verbose` (or `--audit`) adds the per-adapter audit tables, the slot
//! map, every engine event and every check's error. Exits non-zero when a
//! request differs from PEFT (relative error over [`ENGINE_TOL`] or a
//! different token) or a pool check exceeds [`BOUND`].

use std::path::{Path, PathBuf};
use std::time::Instant;

use lora_audit::{Oracle, audit_adapter, read_oracle};
use lora_engine::{
    ANSWER_TOLERANCE, AdapterDir, Answers, Comparison, Engine, EngineEvent, EngineOptions, Request, RequestOutput,
    TokenMatch, compare, parse_requests,
};
use lora_kernels::Device;
use lora_kernels::testing::{Rng, rel_error};
use lora_layout::ModelConfig;
use lora_overlay::TokenOverlays;
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool, PoolError, SlotId};

use crate::probe::served_tables;
use crate::serve::{Mode, mixed_dense_errors, mixed_token_errors};
use crate::util::workspace_root;

/// BF16 storage bound on ‖served − PEFT‖ / ‖PEFT‖ of the pool checks.
const BOUND: f64 = 1e-2;
/// Bound on ‖engine − PEFT‖ / ‖PEFT‖ of a request's prompt and step logits.
const ENGINE_TOL: f64 = ANSWER_TOLERANCE;
/// Served without its adapter, an adapted request must miss PEFT by more
/// than this (the match is the adapter's doing).
const CONTROL_MISS: f64 = 5.0 * ENGINE_TOL;

/// The family shown in full, then the others, one line each.
const FAMILIES: [&str; 9] = [
    "llama",
    "llama_embed",
    "llama_lm_head",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_untied",
    "qwen3_moe",
    "mixtral",
];
/// The refused adapter tried onto an idle slot of the llama engine.
const ENGINE_REFUSED: &str = "dora";

/// The dense demo adapters (ranks 4, 8, 16; plain, rsLoRA, alpha_pattern)
/// and the trainable-tokens adapter, all on the tiny llama.
const LLAMA: [&str; 4] = [
    "demo_r4_plain",
    "demo_r8_rslora",
    "demo_r16_alpha_pattern",
    "trainable_tokens_untied_list",
];
/// The MoE adapter (transformers 5.x fused experts and the router).
const MOE: (&str, &str) = ("qwen3_moe", "experts_fused_router");
/// The adapter swapped in at runtime, and the broken one tried after it.
const SWAP_IN: &str = "rank_alpha_pattern";
const BROKEN: &str = "dora";

/// The task's arguments (its usage line, `cargo xtask demo --help`).
pub(crate) const ARGS: &str = "[--verbose | --audit]";

fn fixtures() -> PathBuf {
    workspace_root().join("fixtures")
}

fn family_dir(family: &str) -> PathBuf {
    fixtures().join("engine").join(family)
}

/// Run the demo.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut verbose = false;
    for a in args {
        match a.as_str() {
            "--verbose" | "--audit" | "-v" => verbose = true,
            other => return Err(format!("unexpected argument {other}\nusage: cargo xtask demo {ARGS}")),
        }
    }
    let started = Instant::now();
    let (device, why_not_cuda) = Device::best();
    match why_not_cuda {
        Some(reason) => println!("multi-LoRA demo on {} (CPU reference backend: {reason})", device.name()),
        None => println!("multi-LoRA demo on {}", device.name()),
    }
    let mut failures: Vec<String> = Vec::new();

    // 1. The engine on llama, in full.
    let t = Instant::now();
    let llama = serve_family(&device, FAMILIES[0], true)?;
    print_detail(&llama, verbose);
    if verbose {
        print_engine_audit(FAMILIES[0])?;
    }
    failures.extend(llama.failures());
    control(&device, &llama, &mut failures)?;

    // 2. The other families.
    println!("\nthe other families, same check (fewer slots than adapters):");
    let mut served = llama.requests.len();
    for family in &FAMILIES[1..] {
        let s = serve_family(&device, family, false)?;
        println!("  {}", s.summary());
        if verbose {
            print_requests(&s);
        }
        failures.extend(s.failures());
        served += s.requests.len();
    }
    let engine_ms = t.elapsed().as_secs_f64() * 1e3;

    // 3. The pool's kernels against the probe oracles.
    let t = Instant::now();
    pool_checks(&device, verbose, &mut failures)?;
    let pool_ms = t.elapsed().as_secs_f64() * 1e3;

    let total_ms = started.elapsed().as_secs_f64() * 1e3;
    if !failures.is_empty() {
        println!("\nFAILED:");
        for f in &failures {
            println!("  {f}");
        }
        return Err(format!("{} check(s) failed", failures.len()));
    }
    println!(
        "\ndemo ok: {served} requests over {} families equal PEFT; pool checks within {BOUND:.0e} \
         (engine {engine_ms:.0} ms, pool {pool_ms:.0} ms, total {total_ms:.0} ms){}",
        FAMILIES.len(),
        if verbose {
            ""
        } else {
            "; --verbose: audit tables, slot map, every event"
        }
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// The engine against PEFT.
// ---------------------------------------------------------------------------

/// A refused pool operation tried between two steps, placed after the
/// first `at_event` engine events.
struct Intervention {
    at_event: usize,
    step: usize,
    line: String,
    ok: bool,
}

/// One family's batch, served and checked.
struct Served {
    family: String,
    requests: Vec<Request>,
    outputs: Vec<RequestOutput>,
    checks: Vec<Comparison>,
    events: Vec<EngineEvent>,
    interventions: Vec<Intervention>,
    steps: usize,
    adapters: usize,
    slots: usize,
}

impl Served {
    fn failures(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .checks
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.within(ENGINE_TOL))
            .map(|(i, c)| {
                format!(
                    "{} request {i}: prompt rel err {:.2e}, step rel err {:.2e}, tokens {}",
                    self.family,
                    c.prompt_err,
                    c.step_err,
                    tokens_word(c.tokens)
                )
            })
            .collect();
        out.extend(
            self.interventions
                .iter()
                .filter(|v| !v.ok)
                .map(|v| format!("{}: {}", self.family, v.line)),
        );
        if self.adapters > self.slots
            && !self
                .events
                .iter()
                .any(|e| matches!(e, EngineEvent::Promoted { replaced: Some(_), .. }))
        {
            out.push(format!(
                "{}: {} adapters in {} slots, but nothing was evicted",
                self.family, self.adapters, self.slots
            ));
        }
        out
    }

    fn count(&self, f: impl Fn(&EngineEvent) -> bool) -> usize {
        self.events.iter().filter(|e| f(e)).count()
    }

    fn summary(&self) -> String {
        let prompt = self.checks.iter().map(|c| c.prompt_err).fold(0.0, f64::max);
        let step = self.checks.iter().map(|c| c.step_err).fold(0.0, f64::max);
        let tokens = if self.checks.iter().all(|c| c.tokens == TokenMatch::Equal) {
            "all tokens match"
        } else if self.checks.iter().all(|c| !matches!(c.tokens, TokenMatch::Differ(_))) {
            "tokens match (up to near ties)"
        } else {
            "TOKENS DIFFER"
        };
        let promoted = self.count(|e| matches!(e, EngineEvent::Promoted { .. }));
        let hits = self.count(|e| matches!(e, EngineEvent::PrefixHit { .. }));
        let ok = self.failures().is_empty();
        format!(
            "{:<13}{:>3} requests, {} in {}, {promoted} promoted, {}: \
             max rel err {prompt:.1e} prompt, {step:.1e} steps; {tokens}  {}",
            self.family,
            self.requests.len(),
            plural(self.adapters, "adapter", "adapters"),
            plural(self.slots, "slot", "slots"),
            plural(hits, "prefix hit", "prefix hits"),
            if ok { "ok" } else { "MISMATCH" }
        )
    }
}

fn tokens_word(t: TokenMatch) -> String {
    match t {
        TokenMatch::Equal => "yes".into(),
        TokenMatch::PastTie(s) => format!("tie@{s}"),
        TokenMatch::Differ(s) => format!("NO@{s}"),
    }
}

fn engine_adapters(family: &str) -> Result<Vec<AdapterDir>, String> {
    let dir = family_dir(family).join("adapters");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    names.sort();
    Ok(names
        .into_iter()
        .map(|name| AdapterDir {
            dir: dir.join(&name),
            name,
        })
        .collect())
}

fn engine_options(family: &str, max_loras: usize) -> LoraOptions {
    LoraOptions {
        max_loras,
        max_rank: 16,
        experts: matches!(family, "qwen3_moe" | "mixtral"),
        embedding_lora: family == "llama_embed",
        lm_head_lora: family == "llama_lm_head",
        ..LoraOptions::default()
    }
}

/// PEFT's answers for `family`'s batch.
fn peft_answers(family: &str) -> Result<Answers, String> {
    Answers::read(&family_dir(family).join("peft.safetensors")).map_err(|e| format!("{family}: {e}"))
}

/// Request `i`'s output against PEFT's.
fn check(peft: &Answers, family: &str, i: usize, out: &RequestOutput, vocab: usize) -> Result<Comparison, String> {
    let reference = peft
        .request(i)
        .ok_or_else(|| format!("{family}: peft.safetensors does not answer request {i}"))?;
    Ok(compare(out, &reference, vocab))
}

/// Serve `family`'s batch with one slot fewer than adapters, step by step;
/// with `intervene`, try the refused operations between two steps.
fn serve_family(device: &Device, family: &str, intervene: bool) -> Result<Served, String> {
    let adapters = engine_adapters(family)?;
    let slots = adapters.len().saturating_sub(1).max(1);
    let path = family_dir(family).join("requests.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let requests = parse_requests(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let peft = peft_answers(family)?;
    let mut engine = Engine::load(
        &family_dir(family).join("model"),
        &adapters,
        device,
        engine_options(family, slots),
        EngineOptions::default(),
    )
    .map_err(|e| format!("{family}: {e}"))?;
    for r in &requests {
        engine.submit(r.clone()).map_err(|e| format!("{family}: {e}"))?;
    }
    let mut interventions = Vec::new();
    let (mut swap_tried, mut evict_tried) = (!intervene, !intervene);
    while !engine.is_idle() {
        engine
            .step()
            .map_err(|e| format!("{family} step {}: {e}", engine.steps()))?;
        if engine.is_idle() {
            break;
        }
        if !swap_tried && let Some(v) = refused_swap(&mut engine, family)? {
            interventions.push(v);
            swap_tried = true;
        }
        if !evict_tried && let Some(v) = held_eviction(&mut engine)? {
            interventions.push(v);
            evict_tried = true;
        }
    }
    for (tried, what) in [
        (swap_tried, "the refused swap"),
        (evict_tried, "the held slot's eviction"),
    ] {
        if !tried {
            interventions.push(Intervention {
                at_event: engine.events().len(),
                step: engine.steps(),
                line: format!("{what} was never tried: no step left a fitting slot"),
                ok: false,
            });
        }
    }
    let vocab = engine.model().config().vocab;
    let mut outputs = Vec::new();
    let mut checks = Vec::new();
    for i in 0..requests.len() {
        let out = engine
            .output(i)
            .ok_or_else(|| format!("{family}: request {i} did not finish"))?;
        checks.push(check(&peft, family, i, out, vocab)?);
        outputs.push(out.clone());
    }
    Ok(Served {
        family: family.to_string(),
        requests,
        outputs,
        checks,
        events: engine.events().to_vec(),
        interventions,
        steps: engine.steps(),
        adapters: adapters.len(),
        slots,
    })
}

fn slot_label(engine: &Engine, slot: SlotId) -> String {
    match engine.pool().slots().get(slot.index()) {
        Some(s) if s.is_filled() => s.name.clone(),
        _ => "(empty)".into(),
    }
}

fn pool_error_kind(e: &PoolError) -> &'static str {
    match e {
        PoolError::Audit { .. } => "PoolError::Audit",
        PoolError::SlotInUse { .. } => "PoolError::SlotInUse",
        PoolError::NotRotatable => "PoolError::NotRotatable",
        _ => "PoolError (other)",
    }
}

/// The refused adapter swapped onto an idle slot, when there is one:
/// refused with the audit's codes, the slot's bytes unchanged.
fn refused_swap(engine: &mut Engine, family: &str) -> Result<Option<Intervention>, String> {
    let s = |e: PoolError| e.to_string();
    let Some(idle) = engine
        .pool()
        .slot_ids()
        .find(|&id| engine.pool().ref_count(id) == 0 && engine.pool().slots()[id.index()].is_filled())
    else {
        return Ok(None);
    };
    let label = slot_label(engine, idle);
    let before = engine.pool().slot_contents(idle).map_err(s)?;
    let dir = family_dir(family).join("refused").join(ENGINE_REFUSED);
    let result = engine.pool_mut().swap_from_disk(idle, ENGINE_REFUSED, &dir);
    let unchanged = engine.pool().slot_contents(idle).map_err(s)? == before;
    let still = slot_label(engine, idle) == label;
    let (line, ok) = match result {
        Ok(_) => (
            format!("swap refused/{ENGINE_REFUSED} -> idle slot {idle}: ACCEPTED (must be refused)"),
            false,
        ),
        Err(e) => {
            let codes = e.refusal_codes();
            let ok = matches!(e, PoolError::Audit { .. }) && !codes.is_empty() && unchanged && still;
            (
                format!(
                    "swap refused/{ENGINE_REFUSED} -> idle slot {idle} ({label}): {} {}; bytes {}",
                    pool_error_kind(&e),
                    codes.join(" "),
                    if unchanged && still { "unchanged" } else { "CHANGED" }
                ),
                ok,
            )
        }
    };
    Ok(Some(Intervention {
        at_event: engine.events().len(),
        step: engine.steps(),
        line,
        ok,
    }))
}

/// The eviction of a slot that running requests hold, when there is one:
/// refused with `SlotInUse`, the slot's bytes unchanged.
fn held_eviction(engine: &mut Engine) -> Result<Option<Intervention>, String> {
    let s = |e: PoolError| e.to_string();
    let Some(held) = engine.pool().slot_ids().find(|&id| engine.pool().ref_count(id) > 0) else {
        return Ok(None);
    };
    let label = slot_label(engine, held);
    let leases = engine.pool().ref_count(held);
    let before = engine.pool().slot_contents(held).map_err(s)?;
    let result = engine.pool_mut().evict(held);
    let unchanged = engine.pool().slot_contents(held).map_err(s)? == before;
    let (line, ok) = match result {
        Ok(()) => (
            format!("evict held slot {held} ({label}): ACCEPTED (must be refused)"),
            false,
        ),
        Err(e) => (
            format!(
                "evict held slot {held} ({label}, {leases} lease(s)): {}; bytes {}",
                pool_error_kind(&e),
                if unchanged { "unchanged" } else { "CHANGED" }
            ),
            matches!(e, PoolError::SlotInUse { .. }) && unchanged,
        ),
    };
    Ok(Some(Intervention {
        at_event: engine.events().len(),
        step: engine.steps(),
        line,
        ok,
    }))
}

fn fmt_tokens(t: &[u32]) -> String {
    let parts: Vec<String> = t.iter().map(u32::to_string).collect();
    format!("[{}]", parts.join(","))
}

fn print_requests(s: &Served) {
    println!(
        "    {:>3}  {:<24}{:>6}  {:<26}{:>10}{:>10}  {:<7}",
        "req", "adapter", "prompt", "greedy tokens", "prompt", "steps", "tokens"
    );
    for (i, ((r, out), c)) in s.requests.iter().zip(&s.outputs).zip(&s.checks).enumerate() {
        println!(
            "    {i:>3}  {:<24}{:>6}  {:<26}{:>10.1e}{:>10.1e}  {:<7}{}",
            r.adapter.as_deref().unwrap_or("(base)"),
            r.prompt.len(),
            fmt_tokens(&out.tokens),
            c.prompt_err,
            c.step_err,
            tokens_word(c.tokens),
            if c.within(ENGINE_TOL) { "ok" } else { "MISMATCH" },
        );
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The full view of one family: the requests, then what happened.
fn print_detail(s: &Served, verbose: bool) {
    println!(
        "
engine: {} batch, {}, {} in {} (promotions evict), {}",
        s.family,
        plural(s.requests.len(), "request", "requests"),
        plural(s.adapters, "adapter", "adapters"),
        plural(s.slots, "slot", "slots"),
        plural(s.steps, "step", "steps"),
    );
    println!(
        "  vs PEFT: rel err ‖ours − PEFT‖/‖PEFT‖ of prompt and step logits (bound {ENGINE_TOL:.0e}), greedy tokens equal"
    );
    print_requests(s);
    println!("  what happened:");
    let mut pending: Vec<String> = Vec::new();
    let mut last_step = 0;
    let mut next = s.interventions.iter().peekable();
    for (n, e) in s.events.iter().enumerate() {
        while let Some(v) = next.next_if(|v| v.at_event <= n) {
            println!("    after step {}: {}", v.step.saturating_sub(1), v.line);
        }
        match e {
            EngineEvent::Promoted {
                adapter,
                slot,
                replaced,
            } => pending.push(format!(
                "promoted {adapter} into slot {slot} ({})",
                match replaced {
                    Some(r) => format!("evicted {r}"),
                    None => "empty".into(),
                }
            )),
            EngineEvent::Admitted { request, step } => {
                last_step = *step;
                for p in pending.drain(..) {
                    println!("    step {step}: {p} for request {request}");
                }
                if verbose {
                    println!("    step {step}: admitted request {request}");
                }
            }
            EngineEvent::PrefixHit { request } => {
                let r = &s.requests[*request];
                let twin = s.requests[..*request]
                    .iter()
                    .position(|t| t.prompt == r.prompt && t.adapter == r.adapter)
                    .map_or_else(|| "an earlier request".to_string(), |j| format!("request {j}"));
                println!(
                    "    step {last_step}: prefix hit: request {request} reuses {twin}'s prompt KV (same adapter identity), no prefill"
                );
            }
            EngineEvent::Finished { request, step } => {
                if verbose {
                    println!("    step {step}: request {request} finished");
                }
            }
        }
    }
    for v in next {
        println!("    after step {}: {}", v.step.saturating_sub(1), v.line);
    }
}

/// The audit tables of `family`'s engine adapters and refused adapters.
fn print_engine_audit(family: &str) -> Result<(), String> {
    let path = family_dir(family).join("model").join("config.json");
    let cfg = ModelConfig::from_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let opts = engine_options(family, 1);
    let refused = family_dir(family).join("refused");
    let mut dirs: Vec<PathBuf> = engine_adapters(family)?.into_iter().map(|a| a.dir).collect();
    dirs.push(refused.join(ENGINE_REFUSED));
    println!("  audit of the {family} engine's adapters:");
    for dir in dirs {
        let report = audit_adapter(&dir, &cfg, &opts).map_err(|e| format!("{}: {e}", dir.display()))?;
        print!("{}", indent(&report.to_text(&cfg)));
    }
    Ok(())
}

/// The check's teeth: the adapted requests served on the base model miss
/// PEFT by far more than the bound.
fn control(device: &Device, s: &Served, failures: &mut Vec<String>) -> Result<(), String> {
    let family = s.family.as_str();
    let mut engine = Engine::load(
        &family_dir(family).join("model"),
        &[],
        device,
        engine_options(family, 1),
        EngineOptions::default(),
    )
    .map_err(|e| format!("{family} (base only): {e}"))?;
    let mut bare = Vec::new();
    for (i, r) in s.requests.iter().enumerate() {
        if r.adapter.is_some() {
            let j = engine
                .submit(Request {
                    adapter: None,
                    ..r.clone()
                })
                .map_err(|e| format!("{family}: {e}"))?;
            bare.push((i, j));
        }
    }
    engine.run().map_err(|e| format!("{family} (base only): {e}"))?;
    let peft = peft_answers(family)?;
    let mut least = f64::INFINITY;
    for &(i, j) in &bare {
        let out = engine
            .output(j)
            .ok_or_else(|| format!("{family}: control {j} did not finish"))?;
        let reference = peft
            .request(i)
            .ok_or_else(|| format!("{family}: peft.safetensors does not answer request {i}"))?;
        least = least.min(rel_error(&out.logits_prompt, reference.logits_prompt));
    }
    let ok = !bare.is_empty() && least > CONTROL_MISS;
    println!(
        "  control: the {} adapted requests on the base model alone miss PEFT by ≥ {least:.2} (must be > {CONTROL_MISS:.0e})  {}",
        bare.len(),
        if ok { "ok" } else { "FAILED" }
    );
    if !ok {
        failures.push(format!(
            "{family}: without their adapters the requests miss PEFT by only {least:.2e}"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The pool's kernels against the probe oracles.
// ---------------------------------------------------------------------------

fn model(name: &str) -> Result<ModelConfig, String> {
    ModelConfig::from_file(&fixtures().join(name).join("config.json")).map_err(|e| e.to_string())
}

fn oracle(dir: &Path) -> Result<Oracle, String> {
    read_oracle(&dir.join("oracle.safetensors")).map_err(|e| format!("{}: {e}", dir.display()))
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("      {l}\n")).collect()
}

/// One pool check: its line, its per-adapter errors (verbose), its worst.
fn check_line(failures: &mut Vec<String>, verbose: bool, what: &str, per: &[(&str, f64)]) {
    let worst = per.iter().map(|(_, e)| *e).fold(0.0, f64::max);
    let ok = worst < BOUND && per.iter().all(|(_, e)| e.is_finite());
    println!("  {what:<70} max {worst:.2e}  {}", if ok { "ok" } else { "OVER BOUND" });
    if verbose {
        for (name, e) in per {
            println!("      {name:<40} {e:.2e}");
        }
    }
    if !ok {
        failures.push(format!("pool check `{what}`: {worst:.2e} over {BOUND:.0e}"));
    }
}

fn pool_checks(device: &Device, verbose: bool, failures: &mut Vec<String>) -> Result<(), String> {
    println!("\npool kernels vs the PEFT probe oracles (fixtures/llama, fixtures/qwen3_moe; bound {BOUND:.0e}):");
    let mut rng = Rng::new(2026);
    let cfg = model("llama")?;
    let opts = LoraOptions {
        max_loras: 5,
        max_rank: 16,
        rotatable: true,
        ..LoraOptions::default()
    };
    let moe_cfg = model(MOE.0)?;
    let moe_opts = LoraOptions {
        max_loras: 2,
        experts: true,
        ..opts.clone()
    };
    let moe_dir = fixtures().join(MOE.0).join(MOE.1);

    // Audit.
    let mut servable = 0;
    for name in LLAMA.iter().chain([&SWAP_IN, &BROKEN]) {
        let report =
            audit_adapter(&fixtures().join("llama").join(name), &cfg, &opts).map_err(|e| format!("{name}: {e}"))?;
        if verbose {
            print!("{}", indent(&report.to_text(&cfg)));
        }
        let want = *name != BROKEN;
        if report.is_servable() != want {
            failures.push(format!(
                "audit of {name}: servable {} (expected {want})",
                report.is_servable()
            ));
        }
        servable += usize::from(report.is_servable());
    }
    let report = audit_adapter(&moe_dir, &moe_cfg, &moe_opts).map_err(|e| format!("{}: {e}", MOE.1))?;
    if verbose {
        print!("{}", indent(&report.to_text(&moe_cfg)));
    }
    if !report.is_servable() {
        failures.push(format!("audit of {}: refused", MOE.1));
    }
    servable += usize::from(report.is_servable());
    println!("  audit: {servable} adapters servable, {BROKEN} refused");

    // Plan and pack.
    let dirs: Vec<PathBuf> = LLAMA.iter().map(|a| fixtures().join("llama").join(a)).collect();
    let sources: Vec<AdapterSource<'_>> = LLAMA
        .iter()
        .zip(&dirs)
        .map(|(name, dir)| AdapterSource { name, dir })
        .collect();
    let capacity = BatchCapacity {
        max_rows: 256,
        max_segments: 16,
    };
    let tables = served_tables(
        device,
        &cfg,
        &fixtures().join("llama").join("tables.safetensors"),
        opts.placement,
    )?;
    let overlays = TokenOverlays::new(device, tables, opts.max_loras).map_err(|e| e.to_string())?;
    let mut pool = LoraPool::load_with_companion(device, cfg.clone(), opts.clone(), capacity, &sources, overlays)
        .map_err(|e| e.to_string())?;
    let moe_sources = [AdapterSource {
        name: MOE.1,
        dir: &moe_dir,
    }];
    let mut moe_pool =
        LoraPool::load(device, moe_cfg.clone(), moe_opts.clone(), capacity, &moe_sources).map_err(|e| e.to_string())?;
    let experts = moe_pool.experts().ok_or("the MoE pool has no expert pool")?;
    if verbose {
        println!(
            "      llama: {} slots x {} bytes (max_rank {}, {} pairs per slot), pool at {:#x}",
            opts.max_loras,
            pool.layout().slot_bytes(),
            opts.max_rank,
            pool.layout().entries().len(),
            pool.pool_addr()
        );
        for (slot, s) in pool.slots().iter().enumerate() {
            let label = if s.is_filled() { s.name.as_str() } else { "(empty)" };
            let overlay = if s.has_overlay { "  + token overlay" } else { "" };
            println!(
                "      slot {slot}: {label:<30} pairs {:>3}  id {:#018x}{overlay}",
                s.pairs.len(),
                s.adapter_id()
            );
        }
        println!(
            "      {}: {} slots x {} bytes dense + {} slots x {} bytes expert pool (expert stride {}), {} expert/router pairs in slot 0",
            MOE.0,
            moe_opts.max_loras,
            moe_pool.layout().slot_bytes(),
            moe_opts.max_loras,
            experts.slot_bytes(),
            experts.stride(),
            moe_pool.slots()[0].expert_pairs.len()
        );
    }

    // Mixed batches through every adapted layer.
    let oracles: Vec<Oracle> = dirs.iter().map(|d| oracle(d)).collect::<Result<_, _>>()?;
    let by_slot: Vec<(SlotId, &Oracle)> = oracles.iter().enumerate().map(|(i, o)| (SlotId::new(i), o)).collect();
    for (mode, kernel) in [(Mode::Decode, "BGMV"), (Mode::Prefill, "SGMV")] {
        let (worst, rows) = mixed_dense_errors(&mut pool, &by_slot, 3, mode, &mut rng)?;
        let per: Vec<(&str, f64)> = LLAMA.iter().copied().zip(worst).collect();
        let what = format!(
            "mixed {} ({kernel}): {rows} rows, 4 adapters + base, every layer",
            format!("{mode:?}").to_lowercase()
        );
        check_line(failures, verbose, &what, &per);
    }
    let worst = mixed_token_errors(&mut pool, &by_slot, 3, &mut rng)?;
    let per: Vec<(&str, f64)> = LLAMA.iter().copied().zip(worst).collect();
    check_line(
        failures,
        verbose,
        "token embedding rows (overlay kernel), mixed batch",
        &per,
    );

    // MoE: attention, routed experts and router.
    let moe_oracle = oracle(&moe_dir)?;
    let (worst, _) = mixed_dense_errors(
        &mut moe_pool,
        &[(SlotId::new(0), &moe_oracle)],
        3,
        Mode::Decode,
        &mut rng,
    )?;
    let mut per: Vec<(String, f64)> = vec![("attention (dense rows)".into(), worst[0])];
    let lease = moe_pool.acquire(MOE.1).map_err(|e| e.to_string())?;
    let served = lora_moe::probe_expert_lora(&mut moe_pool, &lease, &moe_oracle.inputs).map_err(|e| e.to_string())?;
    drop(lease);
    for (key, got) in &served.tensors {
        let want = moe_oracle
            .expected
            .get(key)
            .ok_or_else(|| format!("the oracle has no {key}"))?;
        per.push((
            key.trim_start_matches("probe_out::").to_string(),
            rel_error(&got.data, &want.data),
        ));
    }
    let per_ref: Vec<(&str, f64)> = per.iter().map(|(k, e)| (k.as_str(), *e)).collect();
    check_line(
        failures,
        verbose,
        &format!("MoE {}: attention, routed experts, router", MOE.1),
        &per_ref,
    );

    // Swap while the others serve; then a broken swap.
    let slot = SlotId::new(4);
    let swap_dir = fixtures().join("llama").join(SWAP_IN);
    let report = pool
        .swap_from_disk(slot, SWAP_IN, &swap_dir)
        .map_err(|e| e.to_string())?;
    let again = pool
        .swap_from_disk(slot, SWAP_IN, &swap_dir)
        .map_err(|e| e.to_string())?;
    if again.adapter_id == report.adapter_id {
        failures.push(format!(
            "rewriting {SWAP_IN} kept its identity {:#018x}",
            again.adapter_id
        ));
    }
    let swapped = oracle(&swap_dir)?;
    let mut all: Vec<(SlotId, &Oracle)> = by_slot.clone();
    all.push((slot, &swapped));
    let (worst, _) = mixed_dense_errors(&mut pool, &all, 3, Mode::Decode, &mut rng)?;
    let per: Vec<(&str, f64)> = LLAMA.iter().chain([&SWAP_IN]).copied().zip(worst).collect();
    check_line(
        failures,
        verbose,
        &format!(
            "disk swap {SWAP_IN} -> slot {slot} (gen {}; again: gen {}, new id)",
            report.generation, again.generation
        ),
        &per,
    );
    let snapshot = pool.slot_contents(slot).map_err(|e| e.to_string())?;
    let codes = match pool.swap_from_disk(slot, "broken", &fixtures().join("llama").join(BROKEN)) {
        Ok(_) => return Err(format!("swapping {BROKEN} must be refused")),
        Err(e) => e.refusal_codes().join(" "),
    };
    let unchanged = pool.slot_contents(slot).map_err(|e| e.to_string())? == snapshot;
    if !unchanged {
        failures.push(format!("the refused swap of {BROKEN} changed slot {slot}"));
    }
    let (worst, _) = mixed_dense_errors(&mut pool, &[(slot, &swapped)], 3, Mode::Decode, &mut rng)?;
    check_line(
        failures,
        verbose,
        &format!(
            "broken swap {BROKEN} -> slot {slot}: {codes}, bytes {}",
            if unchanged { "unchanged" } else { "CHANGED" }
        ),
        &[(SWAP_IN, worst[0])],
    );
    Ok(())
}
