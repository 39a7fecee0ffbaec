//! A device fault at any write of a swap or an evict never serves wrong
//! bytes: the CPU backend fails each write of the operation in turn
//! (`Device::inject_write_fault_after`), and after every faulted call the
//! slot either still serves its previous adapter bit for bit or is marked
//! unservable (no lease can name it), never a mix; every other slot is
//! untouched; and a clean retry of the same operation leaves the pool as a
//! clean run does, equal to a fresh pool loaded with the new contents.
//!
//! Covered: the disk swap on both of its dense routes (device repack, host
//! pack) and the prepared route (an adapter with expert pairs), the
//! prepared swap, the landed publish, and evict, into a filled and into an
//! empty slot, each with and without a dropped step whose rows still name
//! the slot (whose reset is the first write of the operation).

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;

use common::{fixtures, model_config};
use half::bf16;
use lora_audit::{PreparedAdapter, prepare_adapter};
use lora_kernels::{KernelError, PairEntry};
use lora_layout::{ExpertLayout, LoraModule};
use lora_pool::image::{SlotImage, dense_sources, expert_sources};
use lora_pool::{
    AdapterSlot, AdapterSource, BatchCapacity, LandedImages, LoraOptions, LoraPool, PoolError, PrefillSeq, SlotId,
    StagingTuning, StepRow, SwapReport, SwapRoute,
};

fn dir(model: &str, adapter: &str) -> PathBuf {
    fixtures().join(model).join(adapter)
}

/// A small batch capacity: the tests apply nothing.
const CAPACITY: BatchCapacity = BatchCapacity {
    max_rows: 16,
    max_segments: 4,
};

/// The pool a scenario starts from: slot `k` holds `adapters[k]` = (name,
/// adapter dir) or nothing; slots past them are empty.
#[derive(Clone)]
struct Setup {
    model: &'static str,
    opts: LoraOptions,
    adapters: Vec<Option<(&'static str, &'static str)>>,
    /// Take the device-repack route for dense-only disk swaps.
    device_repack: bool,
}

impl Setup {
    fn llama(adapters: &[(&'static str, &'static str)]) -> Setup {
        Setup {
            model: "llama",
            opts: LoraOptions {
                max_loras: 3,
                max_rank: 16,
                rotatable: true,
                ..LoraOptions::default()
            },
            adapters: adapters.iter().copied().map(Some).collect(),
            device_repack: true,
        }
    }

    fn mixtral(adapters: &[(&'static str, &'static str)]) -> Setup {
        Setup {
            model: "mixtral",
            opts: LoraOptions {
                max_loras: 3,
                max_rank: 16,
                expert_rank: 16,
                experts: true,
                // Fixed, so that every pool of the scenario has the same expert slots.
                expert_slot_bytes: Some(1 << 20),
                rotatable: true,
                ..LoraOptions::default()
            },
            adapters: adapters.iter().copied().map(Some).collect(),
            device_repack: true,
        }
    }

    fn host_pack(mut self) -> Setup {
        self.device_repack = false;
        self
    }

    /// The pool, on a CPU device of its own. An empty slot before a filled
    /// one is loaded with a stand-in, then evicted.
    fn pool(&self) -> LoraPool {
        let Some(stand_in) = self.adapters.iter().flatten().next().map(|(_, a)| *a) else {
            panic!("a setup holds at least one adapter");
        };
        let gaps: Vec<String> = (0..self.adapters.len()).map(|k| format!("gap {k}")).collect();
        let loaded: Vec<(&str, PathBuf)> = self
            .adapters
            .iter()
            .zip(&gaps)
            .map(|(a, gap)| match a {
                Some((name, adapter)) => (*name, dir(self.model, adapter)),
                None => (gap.as_str(), dir(self.model, stand_in)),
            })
            .collect();
        let sources: Vec<AdapterSource<'_>> = loaded.iter().map(|(name, dir)| AdapterSource { name, dir }).collect();
        let device = lora_kernels::Device::cpu();
        let mut pool =
            LoraPool::load(&device, model_config(self.model), self.opts.clone(), CAPACITY, &sources).unwrap();
        for (k, a) in self.adapters.iter().enumerate() {
            if a.is_none() {
                pool.evict(SlotId::new(k)).unwrap();
            }
        }
        pool.tune_staging(StagingTuning {
            device_repack: self.device_repack,
            ..StagingTuning::default()
        })
        .unwrap();
        pool
    }

    /// The same setup with slot `slot` holding `adapter` (or nothing).
    fn with_slot(&self, slot: usize, adapter: Option<(&'static str, &'static str)>) -> Setup {
        let mut next = self.clone();
        if next.adapters.len() <= slot {
            next.adapters.resize(slot + 1, None);
        }
        next.adapters[slot] = adapter;
        while next.adapters.last() == Some(&None) {
            next.adapters.pop();
        }
        next
    }
}

/// Everything a write into one slot may change, for one slot.
#[derive(Debug, Clone, PartialEq)]
struct SlotState {
    registry: AdapterSlot,
    bytes: Vec<bf16>,
    /// Host table entries of every (layer, module), as `entry` reports them.
    entries: Vec<Option<PairEntry>>,
    /// The slot's entries of the device table the kernels read.
    device_entries: Vec<PairEntry>,
    /// The slot's expert bytes and device expert table entries.
    experts: Option<(Vec<bf16>, Vec<PairEntry>)>,
}

impl SlotState {
    /// The state with its generation left out (a faulted write bumps it).
    fn without_generation(&self) -> SlotState {
        let mut s = self.clone();
        s.registry.generation = 0;
        s
    }
}

/// The slot's entries of a `[.., max_loras]`-interleaved table.
fn slot_entries(table: &[PairEntry], slot: usize, max_loras: usize) -> Vec<PairEntry> {
    table.iter().skip(slot).step_by(max_loras).copied().collect()
}

fn state(pool: &LoraPool) -> Vec<SlotState> {
    let n = pool.options().max_loras;
    let layers = pool.config().num_hidden_layers;
    let table = pool.table().download().unwrap();
    let expert_table = pool.experts().map(|e| e.table().download().unwrap());
    pool.slot_ids()
        .map(|slot| {
            let i = slot.index();
            let entries = (0..layers)
                .flat_map(|layer| LoraModule::ALL.map(|m| pool.entry(layer, m, slot)))
                .collect();
            let experts = pool.experts().map(|e| {
                let table = expert_table.as_deref().unwrap_or(&[]);
                (e.slot_contents(i).unwrap(), slot_entries(table, i, n))
            });
            SlotState {
                registry: pool.slots()[i].clone(),
                bytes: pool.slot_contents(slot).unwrap(),
                entries,
                device_entries: slot_entries(&table, i, n),
                experts,
            }
        })
        .collect()
}

/// A step of each kind named `slot`'s adapter and was dropped: its rows
/// still sit in the device row buffers, which the operation resets first.
fn leave_dropped_steps(pool: &mut LoraPool, slot: SlotId) {
    let name = pool.slots()[slot.index()].name.clone();
    let lease = pool.acquire(&name).unwrap();
    let decode = pool.decode_step(&[StepRow::Base, StepRow::Adapter(&lease)], 4).unwrap();
    let prefill = pool
        .prefill_step(&[PrefillSeq {
            row: StepRow::Adapter(&lease),
            len: 3,
        }])
        .unwrap();
    drop((decode, prefill, lease));
    assert_eq!(pool.ref_count(slot), 0);
}

/// What an operation under test reports, timings and generation left out.
#[derive(Debug, PartialEq)]
struct Outcome {
    slot: SlotId,
    name: String,
    dense_pairs: usize,
    expert_pairs: usize,
    route: SwapRoute,
}

fn outcome(r: SwapReport) -> Outcome {
    Outcome {
        slot: r.slot,
        name: r.name,
        dense_pairs: r.dense_pairs,
        expert_pairs: r.expert_pairs,
        route: r.route,
    }
}

type Op<'a> = dyn Fn(&mut LoraPool) -> Result<Option<Outcome>, PoolError> + 'a;

/// One operation on one slot, and what the slot holds after it.
struct Scenario<'a> {
    what: &'a str,
    setup: Setup,
    slot: SlotId,
    /// Leave dropped steps naming the slot before the operation.
    dropped_steps: bool,
    op: Box<Op<'a>>,
    /// The pool a clean run must equal: the setup with the new contents
    /// loaded directly.
    fresh: Setup,
    /// The route a clean run takes (`None` for evict).
    route: Option<SwapRoute>,
    /// The name of the adapter the operation writes (`None` for evict).
    new_name: Option<&'a str>,
}

/// How a faulted call left the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Left {
    /// Serving its previous contents, bit for bit.
    AsItWas,
    /// Marked unservable.
    Unservable,
}

/// The scenario's pool before the operation.
fn start(sc: &Scenario<'_>) -> LoraPool {
    let mut pool = sc.setup.pool();
    if sc.dropped_steps {
        leave_dropped_steps(&mut pool, sc.slot);
    }
    pool
}

fn run(sc: &Scenario<'_>) {
    let what = sc.what;
    let i = sc.slot.index();

    // A clean run: count its device writes and keep what it leaves.
    let mut pool = start(sc);
    let written = pool.device().write_count().unwrap();
    let report = (sc.op)(&mut pool).unwrap();
    let writes = usize::try_from(pool.device().write_count().unwrap() - written).unwrap();
    assert!(writes > 0, "{what}: the operation writes the device");
    assert_eq!(report.as_ref().map(|o| o.route), sc.route, "{what}: route");
    let clean: Vec<SlotState> = state(&pool).iter().map(SlotState::without_generation).collect();

    // A clean run equals a fresh pool loaded with the new contents.
    let fresh_pool = sc.fresh.pool();
    assert_eq!(
        fresh_pool.pool_addr(),
        pool.pool_addr(),
        "{what}: pools built alike on fresh CPU devices get the same addresses"
    );
    let fresh: Vec<SlotState> = state(&fresh_pool).iter().map(SlotState::without_generation).collect();
    assert_eq!(clean, fresh, "{what}: a clean run equals the fresh pool");
    assert!(!pool.slots()[i].unservable, "{what}: the clean run completes the write");
    drop((pool, fresh_pool));

    // One more write than it issues faults nothing.
    let mut pool = start(sc);
    pool.device().inject_write_fault_after(writes).unwrap();
    (sc.op)(&mut pool).unwrap();
    assert!(
        pool.device().clear_write_fault(),
        "{what}: the clean run issues {writes} writes"
    );

    let mut left = Vec::with_capacity(writes);
    for n in 0..writes {
        let at = format!("{what}, fault at write {n} of {writes}");
        let mut pool = start(sc);
        let before = state(&pool);
        let old_name = before[i].registry.name.clone();
        pool.device().inject_write_fault_after(n).unwrap();
        let result = (sc.op)(&mut pool);
        assert!(!pool.device().clear_write_fault(), "{at}: the fault fired");
        match result {
            Err(PoolError::Kernel(KernelError::InjectedFault { .. })) => {}
            other => panic!("{at}: expected the injected fault, got {other:?}"),
        }
        let after = state(&pool);
        for (j, (b, a)) in before.iter().zip(&after).enumerate() {
            if j != i {
                assert_eq!(a, b, "{at}: slot {j}, not written, is as it was");
            }
        }
        let now = if after[i] == before[i] {
            // As it was, and still served.
            if !old_name.is_empty() {
                let lease = pool.acquire(&old_name).unwrap();
                assert_eq!(lease.adapter_id(), before[i].registry.adapter_id(), "{at}");
                pool.decode_step(&[StepRow::Adapter(&lease)], 1).unwrap();
            }
            Left::AsItWas
        } else {
            // Anything else: unservable, and nothing can name it.
            let slot = &after[i].registry;
            assert!(
                slot.unservable && !slot.is_servable(),
                "{at}: changed but not unservable: {slot:?}"
            );
            assert!(!slot.is_filled() && slot.adapter_id() == 0, "{at}: names no adapter");
            assert!(pool.moe_state(sc.slot).is_none(), "{at}: no MoE state");
            for name in [Some(old_name.as_str()), sc.new_name].into_iter().flatten() {
                if name.is_empty() {
                    continue;
                }
                assert_eq!(pool.slot_of(name), None, "{at}: `{name}` is resident nowhere");
                assert!(
                    matches!(pool.acquire(name), Err(PoolError::NotResident(_))),
                    "{at}: no lease on `{name}`"
                );
            }
            // The other slots still serve.
            for (j, s) in after.iter().enumerate() {
                if j != i && s.registry.is_servable() {
                    let lease = pool.acquire(&s.registry.name).unwrap();
                    pool.decode_step(&[StepRow::Adapter(&lease), StepRow::Base], 2).unwrap();
                }
            }
            Left::Unservable
        };
        left.push(now);

        // A clean retry completes the operation as a clean run does.
        let retried = (sc.op)(&mut pool).unwrap_or_else(|e| panic!("{at}: the retry failed: {e}"));
        assert_eq!(retried, report, "{at}: the retry reports as a clean run");
        let again: Vec<SlotState> = state(&pool).iter().map(SlotState::without_generation).collect();
        assert_eq!(again, clean, "{at}: the retry leaves the pool as a clean run");
        if let Some(name) = sc.new_name {
            let lease = pool.acquire(name).unwrap();
            pool.decode_step(&[StepRow::Adapter(&lease)], 1).unwrap();
        }
    }

    // The slot is marked unservable at one point of the write sequence:
    // every fault before it leaves the slot as it was, every one after it
    // leaves the slot unservable, and the slot's own writes come after it.
    let marked = left.iter().position(|l| *l == Left::Unservable);
    let marked = marked.unwrap_or_else(|| panic!("{what}: no fault reached the slot: {left:?}"));
    assert!(
        left[marked..].iter().all(|l| *l == Left::Unservable),
        "{what}: outcomes by fault index: {left:?}"
    );
    let stages = sc.route.is_some_and(|r| r != SwapRoute::Landed);
    if sc.dropped_steps || stages {
        assert!(
            marked > 0,
            "{what}: staging and row resets come before the mark: {left:?}"
        );
    }
}

/// The images a peer would land for `adapter` (as the disk path packs them).
fn landed_images(pool: &LoraPool, prepared: &PreparedAdapter) -> (SlotImage, Option<(ExpertLayout, SlotImage)>) {
    let dense = SlotImage::pack(pool.layout(), &dense_sources(prepared)).unwrap();
    let experts = (!prepared.experts.is_empty()).then(|| {
        let sites = prepared.experts.iter().map(|e| (e.layer, e.site));
        let layout = ExpertLayout::new(pool.config(), pool.options().expert_rank, sites).unwrap();
        let image = SlotImage::pack(&layout, &expert_sources(prepared)).unwrap();
        (layout, image)
    });
    (dense, experts)
}

/// Every operation on `slot` of `setup`, writing `new` (name, adapter dir)
/// or evicting, each with and without dropped steps naming the slot.
fn every_operation(setup: &Setup, slot: usize, new: (&'static str, &'static str), dense_route: SwapRoute) {
    let id = SlotId::new(slot);
    let filled = setup.adapters.get(slot).is_some_and(Option::is_some);
    let model = setup.model;
    let new_dir = dir(model, new.1);
    let prepared = prepare_adapter(&new_dir, &model_config(model), &setup.opts).unwrap();
    let fresh = setup.with_slot(slot, Some(new));
    let disk = |setup: Setup, route: SwapRoute, what: &'static str| Scenario {
        what,
        setup,
        slot: id,
        dropped_steps: false,
        op: Box::new(|pool: &mut LoraPool| pool.swap_from_disk(id, new.0, &new_dir).map(|r| Some(outcome(r)))),
        fresh: fresh.clone(),
        route: Some(route),
        new_name: Some(new.0),
    };
    let mut scenarios = vec![
        disk(setup.clone(), dense_route, "disk swap"),
        Scenario {
            what: "prepared swap",
            setup: setup.clone(),
            slot: id,
            dropped_steps: false,
            op: Box::new(|pool: &mut LoraPool| pool.swap_prepared(id, new.0, &prepared).map(|r| Some(outcome(r)))),
            fresh: fresh.clone(),
            route: Some(SwapRoute::Prepared),
            new_name: Some(new.0),
        },
        Scenario {
            what: "landed publish",
            setup: setup.clone(),
            slot: id,
            dropped_steps: false,
            op: Box::new(|pool: &mut LoraPool| {
                let (dense, experts) = landed_images(pool, &prepared);
                pool.publish_landed(id, new.0, LandedImages::new(dense, experts))
                    .map(|r| Some(outcome(r)))
            }),
            fresh: fresh.clone(),
            route: Some(SwapRoute::Landed),
            new_name: Some(new.0),
        },
    ];
    if dense_route == SwapRoute::DeviceRepack {
        scenarios.push(disk(
            setup.clone().host_pack(),
            SwapRoute::HostPack,
            "disk swap, host pack",
        ));
    }
    if filled {
        scenarios.push(Scenario {
            what: "evict",
            setup: setup.clone(),
            slot: id,
            dropped_steps: false,
            op: Box::new(|pool: &mut LoraPool| pool.evict(id).map(|()| None)),
            fresh: setup.with_slot(slot, None),
            route: None,
            new_name: None,
        });
        // The same again, with dropped steps whose rows name the slot.
        let with_steps: Vec<Scenario<'_>> = scenarios
            .iter()
            .map(|sc| Scenario {
                what: sc.what,
                setup: sc.setup.clone(),
                slot: id,
                dropped_steps: true,
                op: Box::new(|pool: &mut LoraPool| (sc.op)(pool)),
                fresh: sc.fresh.clone(),
                route: sc.route,
                new_name: sc.new_name,
            })
            .collect();
        for sc in &with_steps {
            run(sc);
        }
    }
    for sc in &scenarios {
        run(sc);
    }
}

#[test]
fn a_fault_at_any_write_of_a_dense_swap_or_evict_never_serves_wrong_bytes() {
    let setup = Setup::llama(&[("a", "demo_r4_plain"), ("b", "demo_r8_rslora")]);
    every_operation(&setup, 1, ("c", "dense_all_linear_bf16"), SwapRoute::DeviceRepack);
}

#[test]
fn a_fault_at_any_write_of_a_swap_into_an_empty_slot_leaves_it_empty_or_unservable() {
    let setup = Setup::llama(&[("a", "demo_r4_plain")]);
    every_operation(&setup, 1, ("c", "rank_alpha_pattern"), SwapRoute::DeviceRepack);
}

#[test]
fn a_fault_at_any_write_of_a_same_name_swap_never_serves_wrong_bytes() {
    // The slot's own name comes back with other bytes.
    let setup = Setup::llama(&[("a", "demo_r4_plain"), ("b", "demo_r8_rslora")]);
    every_operation(&setup, 0, ("a", "dense_all_linear_f16"), SwapRoute::DeviceRepack);
}

#[test]
fn a_fault_at_any_write_of_an_expert_swap_or_evict_never_serves_wrong_bytes() {
    let setup = Setup::mixtral(&[("a", "experts_converted_from_w1_w2_w3"), ("b", "experts_fused_router")]);
    every_operation(&setup, 1, ("c", "experts_converted_from_w1_w2_w3"), SwapRoute::Prepared);
}
