//! The hostile-input harness of issue 42, pool side: the mutants of
//! `lora-audit-cli/tests/mutants/generator.rs` (the same ones `lora-audit
//! check/probe` answer in `lora-audit-cli/tests/mutants.rs`), each swapped from
//! disk into CPU pools on both disk routes (device repack and host pack),
//! into an empty slot or over a filled one. Asserted: no panic; every
//! failed swap a typed error with a message, the pool bit for bit as before
//! (every slot's bytes, every table entry, the slot registry); every
//! successful swap a mutant the full audit finds servable, holding exactly
//! the bytes that `prepare_adapter` of the same files gives, serving a
//! decode step, and leaving the other slots alone. The model-config
//! mutants go through `ModelConfig::from_file` and a startup load instead,
//! on a CPU device with a memory limit (absurd geometry is a typed error,
//! never an abort).

#![allow(clippy::unwrap_used)]

mod common;
#[path = "../../lora-audit-cli/tests/mutants/generator.rs"]
mod generator;

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Snapshot, model_config, options, slot, snapshot};
use generator::{Expect, Mutant, Scratch, fixture_dir};
use half::bf16;
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::ModelConfig;
use lora_pool::{AdapterSource, BatchCapacity, FusedTargets, LoraPool, PoolError, StagingTuning, StepRow};

/// Longest one in-process swap (or load) may take. The swap path has no
/// cancellation of its own; a swap past this is reported as a hang.
const DEADLINE: Duration = Duration::from_secs(20);

/// The adapters the pools start with, in slots 0 and 1. Slot 2 starts
/// empty; slot 3 is where a successful mutant's prepared twin goes.
const CLEAN: [(&str, &str); 2] = [("clean0", "demo_r4_plain"), ("clean1", "dense_all_linear_bf16")];
const EMPTY_SLOT: usize = 2;
const TWIN_SLOT: usize = 3;

/// A pool on one disk route.
struct Route {
    name: &'static str,
    pool: LoraPool,
}

fn routes() -> Vec<Route> {
    [("device-repack", true), ("host-pack", false)]
        .into_iter()
        .map(|(name, device_repack)| {
            let mut pool = common::pool_with(options(4, 0), &CLEAN);
            pool.tune_staging(StagingTuning {
                device_repack,
                ..StagingTuning::default()
            })
            .unwrap();
            Route { name, pool }
        })
        .collect()
}

/// Every message of an error and its sources.
fn messages(e: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut out = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        out.push(s.to_string());
        source = s.source();
    }
    out
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

/// What a clean fixture's swap gives, for `Expect::Same`: `None` when the
/// pool refuses it.
type Baseline = Option<(Vec<bf16>, Vec<lora_pool::AdapterSlot>)>;

/// The bytes of `s` and its registry entry, less the generation (which
/// every write bumps).
fn slot_state(pool: &LoraPool, s: usize) -> (Vec<bf16>, Vec<lora_pool::AdapterSlot>) {
    let mut entry = pool.slots()[s].clone();
    entry.generation = 0;
    entry.name.clear();
    (pool.slot_contents(slot(s)).unwrap(), vec![entry])
}

/// Put the pool back as `routes()` made it (names and adapters; the
/// generations move on).
fn restore(pool: &mut LoraPool, touched: usize) -> Result<(), String> {
    if touched == EMPTY_SLOT || touched == TWIN_SLOT {
        if pool.slots()[touched].is_filled() {
            pool.evict(slot(touched)).map_err(|e| format!("evict: {e}"))?;
        }
    } else {
        let (name, adapter) = CLEAN[touched];
        pool.swap_from_disk(slot(touched), name, &fixture_dir(adapter))
            .map_err(|e| format!("restoring {adapter}: {e}"))?;
    }
    if pool.slots()[TWIN_SLOT].is_filled() {
        pool.evict(slot(TWIN_SLOT)).map_err(|e| format!("evict twin: {e}"))?;
    }
    Ok(())
}

/// A successful swap of `dir` into `target` as `name` serves: its bytes are
/// those of `prepare_adapter` of the same files (swapped into the twin slot),
/// a lease and a decode step name it, and the other slots are untouched.
fn serves(pool: &mut LoraPool, before: &Snapshot, target: usize, name: &str, dir: &Path) -> Result<(), String> {
    if pool.slot_of(name) != Some(slot(target)) || !pool.slots()[target].is_servable() {
        return Err(format!(
            "the swap returned Ok but slot {target} does not serve `{name}`"
        ));
    }
    let after = snapshot(pool);
    for s in 0..after.bytes.len() {
        if s != target && (after.bytes[s] != before.bytes[s] || after.slots[s] != before.slots[s]) {
            return Err(format!("a swap into slot {target} changed slot {s}"));
        }
    }
    let cfg = pool.config().clone();
    let prepared = lora_audit::prepare_adapter(dir, &cfg, pool.options())
        .map_err(|e| format!("the swap succeeded where prepare_adapter refuses: {e}"))?;
    let report = lora_audit::audit_adapter(dir, &cfg, pool.options()).map_err(|e| format!("audit: {e}"))?;
    if !report.is_servable() {
        return Err(format!(
            "the swap succeeded where the audit refuses: {:?}",
            report.refused_codes()
        ));
    }
    pool.swap_prepared(slot(TWIN_SLOT), "twin", &prepared)
        .map_err(|e| format!("the prepared twin does not swap: {e}"))?;
    if pool.slot_contents(slot(target)).unwrap() != pool.slot_contents(slot(TWIN_SLOT)).unwrap()
        || pool.slots()[target].pairs != pool.slots()[TWIN_SLOT].pairs
    {
        return Err("the disk swap's bytes differ from prepare_adapter's".into());
    }
    let lease = pool.acquire(name).map_err(|e| format!("acquire: {e}"))?;
    let step = pool
        .decode_step(&[StepRow::Adapter(&lease), StepRow::Base], 2)
        .map_err(|e| format!("decode_step: {e}"))?;
    let qkv = FusedTargets::qkv(&cfg);
    let device = pool.device().clone();
    let x = device.upload(&vec![bf16::from_f32(0.5); 2 * cfg.hidden_size]).unwrap();
    let mut y = device.alloc_zeros::<bf16>(2 * qkv.width()).unwrap();
    pool.apply_decode(
        &step,
        0,
        &qkv,
        Rows::dense(&x, 2, cfg.hidden_size),
        RowsMut::dense(&mut y, 2, qkv.width()),
    )
    .map_err(|e| format!("apply_decode: {e}"))?;
    let y = y.download().unwrap();
    if y[qkv.width()..].iter().any(|v| v.to_f32() != 0.0) {
        return Err("the base row got a delta".into());
    }
    Ok(())
}

/// One mutant through one route. `Ok(true)`: swapped.
fn swap_one(route: &mut Route, m: &Mutant, dir: &Path, baseline: &Baseline) -> Result<bool, String> {
    let pool = &mut route.pool;
    // Even mutants go into the empty slot, odd ones over a filled slot.
    let target = if m.id.is_multiple_of(2) {
        EMPTY_SLOT
    } else {
        (m.id / 2) % 2
    };
    let name = format!("m{}", m.id);
    let before = snapshot(pool);
    let started = Instant::now();
    let result = catch_unwind(AssertUnwindSafe(|| pool.swap_from_disk(slot(target), &name, dir)))
        .map_err(|p| format!("swap_from_disk panicked: {}", panic_text(&*p)))?;
    if started.elapsed() > DEADLINE {
        return Err(format!("swap_from_disk took {:?}", started.elapsed()));
    }
    match result {
        Err(e) => {
            let messages = messages(&e);
            if messages.iter().any(|m| m.trim().is_empty()) {
                return Err(format!("an error without a message: {e:?}"));
            }
            if snapshot(pool) != before {
                return Err(format!("a failed swap ({e}) changed the pool"));
            }
            if m.expect == Expect::Same && baseline.is_some() {
                return Err(format!("refused ({e}) where the unmutated fixture swaps"));
            }
            // A refusal or an unreadable file is the audit's error; an
            // adapter with token overlays is the companion's (these pools
            // have none); nothing else may fail a swap on a healthy device.
            if !matches!(e, PoolError::Audit { .. } | PoolError::Companion { .. }) {
                return Err(format!("neither an audit nor a companion error: {e:?}"));
            }
            Ok(false)
        }
        Ok(_) => {
            let checked = match m.expect {
                Expect::NotServable | Expect::Unreadable => Err(format!("swapped a {:?} mutant", m.expect)),
                Expect::Same if baseline.is_none() => Err("swapped where the unmutated fixture is refused".into()),
                Expect::Same if Some(slot_state(pool, target)) != *baseline => {
                    Err("swapped to other bytes than the unmutated fixture's".into())
                }
                _ => serves(pool, &before, target, &name, dir),
            };
            restore(pool, target)?;
            checked.map(|()| true)
        }
    }
}

#[test]
fn every_mutant_swaps_cleanly_or_changes_nothing() {
    let started = Instant::now();
    let seed = generator::seed();
    let mutants = generator::mutants(seed);
    let scratch = Scratch::new("pool");
    let mut routes = routes();

    // What each clean fixture's swap gives, per route.
    let mut baselines: BTreeMap<(&str, &str), Baseline> = BTreeMap::new();
    for route in &mut routes {
        for fixture in generator::FIXTURES {
            let pool = &mut route.pool;
            let state = match pool.swap_from_disk(slot(EMPTY_SLOT), "baseline", &fixture_dir(fixture)) {
                Ok(_) => {
                    let state = slot_state(pool, EMPTY_SLOT);
                    pool.evict(slot(EMPTY_SLOT)).unwrap();
                    Some(state)
                }
                Err(_) => None,
            };
            baselines.insert((route.name, fixture), state);
        }
    }
    assert!(baselines[&("host-pack", "demo_r4_plain")].is_some());
    assert!(baselines[&("device-repack", "dora")].is_none());

    let mut failures = Vec::new();
    let mut tally: BTreeMap<(&str, bool), usize> = BTreeMap::new();
    let mut swapped_mutants = 0;
    for m in mutants.iter().filter(|m| m.model.is_none()) {
        let dir: PathBuf = scratch.join(format!("m{}", m.id));
        m.write_adapter(&dir);
        for route in &mut routes {
            let baseline = &baselines[&(route.name, m.fixture)];
            match swap_one(route, m, &dir, baseline) {
                Ok(swapped) => *tally.entry((route.name, swapped)).or_default() += 1,
                Err(e) => failures.push(format!("{} ({}): {e}", m.label(), route.name)),
            }
        }
        swapped_mutants += 1;
        let _ = std::fs::remove_dir_all(&dir);
    }

    // Model-config mutants: parsed, then a startup load of the clean
    // adapters on a CPU device of 256 MiB.
    let mut model_mutants = 0;
    for m in mutants.iter().filter(|m| m.model.is_some()) {
        model_mutants += 1;
        let path = scratch.join(format!("config-{}.json", m.id));
        std::fs::write(&path, m.model.as_ref().unwrap()).unwrap();
        let t = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let cfg = ModelConfig::from_file(&path).map_err(|e| messages(&e))?;
            let dirs: Vec<PathBuf> = CLEAN.iter().map(|(_, a)| fixture_dir(a)).collect();
            let sources: Vec<AdapterSource<'_>> = CLEAN
                .iter()
                .zip(&dirs)
                .map(|((name, _), dir)| AdapterSource { name, dir })
                .collect();
            let device = Device::cpu_with_memory_limit(256 << 20);
            LoraPool::load(&device, cfg, options(4, 0), BatchCapacity::default(), &sources)
                .map(|_| ())
                .map_err(|e| messages(&e))
        }));
        let problem = match outcome {
            Err(p) => Some(format!("panicked: {}", panic_text(&*p))),
            Ok(Err(messages)) if messages.iter().any(|s| s.trim().is_empty()) => {
                Some(format!("an error without a message: {messages:?}"))
            }
            Ok(Ok(())) if matches!(m.expect, Expect::NotServable | Expect::Unreadable) => {
                Some(format!("a {:?} model config loaded", m.expect))
            }
            _ if t.elapsed() > DEADLINE => Some(format!("took {:?}", t.elapsed())),
            _ => None,
        };
        if let Some(p) = problem {
            failures.push(format!("{}: {p}", m.label()));
        }
    }
    // The fixture model itself still loads (the harness tests something).
    let _ = model_config(generator::MODEL);

    eprintln!(
        "{swapped_mutants} adapter mutants x {} routes and {model_mutants} model mutants (seed {seed}) in {:.1?}; \
         (route, swapped): {tally:?}",
        routes.len(),
        started.elapsed()
    );
    assert!(swapped_mutants >= 300, "only {swapped_mutants} adapter mutants");
    assert!(
        failures.is_empty(),
        "{} failures (MUTANTS_SEED={seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}
