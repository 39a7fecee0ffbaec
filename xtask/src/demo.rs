//! `cargo xtask demo`: the whole pipeline on the bundled PEFT fixtures, on
//! the GPU when one is present and on the CPU backend otherwise.
//!
//! Audit every adapter, plan and pack the pool, serve a mixed decode batch
//! and a mixed prefill (rows of every adapter and of the base model) through
//! every adapted layer, swap an adapter from disk while the others serve,
//! try a broken swap, and print each adapter's largest error against PEFT's
//! own merged weights. Exits non-zero when any error exceeds its bound.

use std::path::{Path, PathBuf};
use std::time::Instant;

use lora_audit::{Oracle, audit_adapter, read_oracle};
use lora_kernels::Device;
use lora_kernels::testing::{Rng, rel_error};
use lora_layout::ModelConfig;
use lora_overlay::TokenOverlays;
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool};

use crate::probe::served_tables;
use crate::serve::{Mode, mixed_dense_errors, mixed_token_errors};
use crate::util::workspace_root;

/// BF16 storage bound on ‖served − PEFT‖ / ‖PEFT‖.
const BOUND: f64 = 1e-2;

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

struct Stages {
    started: Instant,
    total: usize,
    done: usize,
    times: Vec<(String, f64)>,
}

impl Stages {
    fn begin(&mut self, name: &str) -> Instant {
        self.done += 1;
        println!("\n[{}/{}] {name} ...", self.done, self.total);
        Instant::now()
    }

    fn end(&mut self, name: &str, t: Instant) {
        let ms = t.elapsed().as_secs_f64() * 1e3;
        println!("      {name}: {ms:.1} ms");
        self.times.push((name.to_string(), ms));
    }
}

fn fixtures() -> PathBuf {
    workspace_root().join("fixtures")
}

fn model(name: &str) -> Result<ModelConfig, String> {
    ModelConfig::from_file(&fixtures().join(name).join("config.json")).map_err(|e| e.to_string())
}

fn oracle(dir: &Path) -> Result<Oracle, String> {
    read_oracle(&dir.join("oracle.safetensors")).map_err(|e| format!("{}: {e}", dir.display()))
}

/// Run the demo.
pub fn run(_args: &[String]) -> Result<(), String> {
    let (device, why_not_cuda) = Device::best();
    println!("multi-LoRA demo on {}", device.name());
    if let Some(reason) = why_not_cuda {
        println!("  (CPU reference backend: {reason})");
    }
    let mut stages = Stages {
        started: Instant::now(),
        total: 6,
        done: 0,
        times: Vec::new(),
    };
    let mut errors: Vec<(String, f64)> = Vec::new();
    let mut rng = Rng::new(2026);

    // 1. Audit.
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
    let t = stages.begin("audit");
    for name in LLAMA.iter().chain([&SWAP_IN, &BROKEN]) {
        let report =
            audit_adapter(&fixtures().join("llama").join(name), &cfg, &opts).map_err(|e| format!("{name}: {e}"))?;
        print!("{}", indent(&report.to_text(&cfg)));
    }
    let moe_dir = fixtures().join(MOE.0).join(MOE.1);
    let report = audit_adapter(&moe_dir, &moe_cfg, &moe_opts).map_err(|e| format!("{}: {e}", MOE.1))?;
    print!("{}", indent(&report.to_text(&moe_cfg)));
    stages.end("audit", t);

    // 2. Plan and pack.
    let t = stages.begin("plan and pack the pool");
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
    let tables = served_tables(&device, &cfg, &fixtures().join("llama").join("tables.safetensors"))?;
    let overlays = TokenOverlays::new(&device, tables, opts.max_loras).map_err(|e| e.to_string())?;
    let mut pool = LoraPool::load_with_companion(&device, cfg.clone(), opts.clone(), capacity, &sources, overlays)
        .map_err(|e| e.to_string())?;
    let layout = pool.layout();
    println!(
        "      llama: {} slots x {} bytes (max_rank {}, {} pairs per slot), pool at {:#x}",
        opts.max_loras,
        layout.slot_bytes(),
        opts.max_rank,
        layout.entries().len(),
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
    let moe_sources = [AdapterSource {
        name: MOE.1,
        dir: &moe_dir,
    }];
    let mut moe_pool = LoraPool::load(&device, moe_cfg.clone(), moe_opts.clone(), capacity, &moe_sources)
        .map_err(|e| e.to_string())?;
    let experts = moe_pool.experts().ok_or("the MoE pool has no expert pool")?;
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
    stages.end("plan and pack", t);

    // 3. Serve mixed batches.
    let t = stages.begin("serve a mixed decode batch and a mixed prefill through every adapted layer");
    let oracles: Vec<Oracle> = dirs.iter().map(|d| oracle(d)).collect::<Result<_, _>>()?;
    let by_slot: Vec<(usize, &Oracle)> = oracles.iter().enumerate().collect();
    for mode in [Mode::Decode, Mode::Prefill] {
        let (worst, rows) = mixed_dense_errors(&mut pool, &by_slot, 3, mode, &mut rng)?;
        println!("      {mode:?}: {rows} rows served over every adapted (layer, module)");
        for (name, e) in LLAMA.iter().zip(worst) {
            println!("        {name:<30} max rel. error vs PEFT {e:.2e}");
            errors.push((format!("{name} ({mode:?})"), e));
        }
    }
    let worst = mixed_token_errors(&mut pool, &by_slot, 3, &mut rng)?;
    println!("      token embedding lookup (mixed batch, overlay kernel):");
    for (name, e) in LLAMA.iter().zip(worst) {
        println!("        {name:<30} max rel. error vs PEFT {e:.2e}");
        errors.push((format!("{name} (embedding rows)"), e));
    }
    stages.end("serve", t);

    let t = stages.begin("serve the MoE adapter: routed experts, router and attention");
    let moe_oracle = oracle(&moe_dir)?;
    let (worst, rows) = mixed_dense_errors(&mut moe_pool, &[(0, &moe_oracle)], 3, Mode::Decode, &mut rng)?;
    println!(
        "      dense (attention) rows: {rows}, max rel. error vs PEFT {:.2e}",
        worst[0]
    );
    errors.push((format!("{} (attention)", MOE.1), worst[0]));
    let served = lora_moe::probe_expert_lora(&moe_pool, 0, &moe_oracle.inputs).map_err(|e| e.to_string())?;
    let mut worst = 0.0f64;
    for (key, got) in &served.tensors {
        let want = moe_oracle
            .expected
            .get(key)
            .ok_or_else(|| format!("the oracle has no {key}"))?;
        let e = rel_error(&got.data, &want.data);
        println!("      {key:<52} {:?} max rel. error {e:.2e}", got.shape);
        worst = worst.max(e);
    }
    errors.push((format!("{} (experts, router)", MOE.1), worst));
    stages.end("serve MoE", t);

    // 4. Swap while the others serve; then a broken swap.
    let t = stages.begin("swap from disk while the other slots serve");
    let slot = 4;
    let before = pool.slots()[slot].adapter_id();
    let report = pool
        .swap_from_disk(slot, SWAP_IN, &fixtures().join("llama").join(SWAP_IN))
        .map_err(|e| e.to_string())?;
    println!(
        "      {SWAP_IN} -> slot {slot}: generation {}, identity {before:#018x} -> {:#018x}",
        report.generation, report.adapter_id
    );
    let again = pool
        .swap_from_disk(slot, SWAP_IN, &fixtures().join("llama").join(SWAP_IN))
        .map_err(|e| e.to_string())?;
    println!(
        "      the same adapter written again: generation {}, identity {:#018x} (prefix/KV caches never mix the two)",
        again.generation, again.adapter_id
    );
    let swapped = oracle(&fixtures().join("llama").join(SWAP_IN))?;
    let mut all: Vec<(usize, &Oracle)> = by_slot.clone();
    all.push((slot, &swapped));
    let (worst, _) = mixed_dense_errors(&mut pool, &all, 3, Mode::Decode, &mut rng)?;
    for ((_, _), (name, e)) in all.iter().zip(LLAMA.iter().chain([&SWAP_IN]).zip(&worst)) {
        println!("        {name:<30} max rel. error vs PEFT {e:.2e} (after the swap)");
        errors.push((format!("{name} (after swap)"), *e));
    }
    let snapshot = pool.slot_contents(slot).map_err(|e| e.to_string())?;
    match pool.swap_from_disk(slot, "broken", &fixtures().join("llama").join(BROKEN)) {
        Ok(_) => return Err(format!("swapping {BROKEN} must be refused")),
        Err(e) => println!(
            "      swapping `{BROKEN}` into slot {slot} is refused: {}",
            e.refusal_codes().join(", ")
        ),
    }
    let unchanged = pool.slot_contents(slot).map_err(|e| e.to_string())? == snapshot;
    let (worst, _) = mixed_dense_errors(&mut pool, &[(slot, &swapped)], 3, Mode::Decode, &mut rng)?;
    println!(
        "      slot {slot} still serves {SWAP_IN}: bytes unchanged {unchanged}, max rel. error {:.2e}",
        worst[0]
    );
    if !unchanged {
        return Err("a refused swap changed the slot".into());
    }
    errors.push((format!("{SWAP_IN} (after refused swap)"), worst[0]));
    stages.end("swap", t);

    // 5. Summary.
    let t = stages.begin("summary");
    let mut failed = false;
    println!("      {:<44} {:>10}  bound {BOUND:.0e}", "adapter (check)", "max error");
    for (name, e) in &errors {
        let ok = *e < BOUND;
        failed |= !ok;
        println!("      {name:<44} {e:>10.2e}  {}", if ok { "ok" } else { "OVER BOUND" });
    }
    stages.end("summary", t);
    println!("\nstage times:");
    for (name, ms) in &stages.times {
        println!("  {name:<16} {ms:>9.1} ms");
    }
    println!(
        "  {:<16} {:>9.1} ms",
        "total",
        stages.started.elapsed().as_secs_f64() * 1e3
    );
    if failed {
        return Err("an error exceeds its bound".into());
    }
    Ok(())
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("      {l}\n")).collect()
}
