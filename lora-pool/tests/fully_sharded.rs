//! The placement's fully-sharded option end to end (vLLM's
//! `fully_sharded_loras`): a column-parallel pair's A cut by rank rows too,
//! the ranks' shrink outputs all-gathered before the expand.
//!
//! - For world sizes 1, 2, 4 and 8 and every family fixture, every rank's
//!   fully-sharded pool is built from the same adapters: a column-parallel
//!   pair's A parts, rank after rank, concatenate to the padded A every
//!   half-sharded (default) rank holds whole; every other part of every
//!   slot is the half-sharded rank's, byte for byte; and the slot bytes add
//!   up: the half-sharded ranks' bytes less `(world - 1)` copies of each
//!   column-parallel A.
//! - For world sizes 2 and 4, ranks run as threads, each with its own pool
//!   and a host all-gather (this file's [`HostGather`]): the fully-sharded
//!   decode and prefill applies give each rank the columns the half-sharded
//!   rank computes, within 1e-3 relative, and the ranks' columns side by
//!   side equal the unsharded pool's delta within 1e-3 relative.
//! - The same with every rank's pool on one GPU, the all-gather done by
//!   device copies ([`DeviceCopyGather`]), and a world of one through a
//!   one-rank NCCL communicator (ignored without a GPU).

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Barrier, Mutex};

use common::placed::{MAX_RANK, dense_adapters, families, load_ranks, options, poisoned_copy, tiered_options};
use common::{fixtures, model_config, pool_with, rel_error};
use half::bf16;
use lora_kernels::{Device, DeviceBuffer, KernelError, Rows, RowsMut};
use lora_layout::{
    LayoutError, LoraModule, ModelConfig, ModuleShard, Placement, PlacementError, ShardKind, SlotLayout,
};
use lora_pool::{
    AdapterSource, BatchCapacity, DecodeStep, FusedTargets, LoraOptions, LoraPool, PoolError, PrefillSeq, RankGather,
    SlotLease, StepRow,
};

const TOL: f64 = 1e-3;

/// The elements of `pool`'s slot `slot` from byte `offset`, `len` of them.
fn slot_elems(pool: &LoraPool, slot: &SlotLease, offset: usize, len: usize) -> Vec<bf16> {
    pool.slot_contents(slot.slot()).unwrap()[offset / 2..offset / 2 + len].to_vec()
}

#[test]
fn a_parts_concatenate_to_the_padded_a_and_slot_bytes_add_up_for_every_family() {
    let device = Device::cpu();
    let mut checked = Vec::new();
    for family in families() {
        let cfg = model_config(&family);
        let adapters = dense_adapters(&family, &cfg);
        if adapters.is_empty() {
            continue;
        }
        for world in [1, 2, 4, 8] {
            let Ok(half) = load_ranks(&device, &cfg, &family, &adapters, world, false) else {
                // The geometry does not divide: the fully-sharded ranks are
                // refused too (tests/tensor_parallel.rs checks the error).
                assert!(load_ranks(&device, &cfg, &family, &adapters, world, true).is_err());
                continue;
            };
            let full = load_ranks(&device, &cfg, &family, &adapters, world, true).unwrap();
            let mut saved = 0;
            for (i, e) in half[0].layout().entries().iter().enumerate() {
                let column = e.module.shard_kind() == ShardKind::Column && world > 1;
                if column {
                    saved += (world - 1) * MAX_RANK * e.in_dim * 2;
                }
                for adapter in &adapters {
                    let what = format!("{family}/{adapter} x{world} layer {} {}", e.layer, e.module);
                    let mut concat = Vec::new();
                    for (h, f) in half.iter().zip(&full) {
                        let (hl, fl) = (h.acquire(adapter).unwrap(), f.acquire(adapter).unwrap());
                        let (he, fe) = (h.layout().entries()[i], f.layout().entries()[i]);
                        assert_eq!((fe.out_dim, fe.in_dim), (he.out_dim, he.in_dim), "{what}");
                        let b_len = he.out_dim * MAX_RANK;
                        assert_eq!(
                            slot_elems(f, &fl, fe.b_offset, b_len),
                            slot_elems(h, &hl, he.b_offset, b_len),
                            "{what}: B"
                        );
                        let whole_a = slot_elems(h, &hl, he.a_offset, MAX_RANK * he.in_dim);
                        let part_a = slot_elems(f, &fl, fe.a_offset, fe.a_rows * fe.in_dim);
                        if column {
                            assert_eq!(fe.a_rows, MAX_RANK / world, "{what}");
                            concat.extend(part_a);
                            // A column-parallel A is whole on every half-sharded rank.
                            if concat.len() == whole_a.len() {
                                assert_eq!(concat, whole_a, "{what}: A parts concatenated");
                            }
                        } else {
                            assert_eq!(part_a, whole_a, "{what}: A");
                        }
                        let (fp, hp) = (
                            f.entry(e.layer, e.module, fl.slot()),
                            h.entry(e.layer, e.module, hl.slot()),
                        );
                        assert_eq!(
                            fp.map(|p| (p.rank, p.scale)),
                            hp.map(|p| (p.rank, p.scale)),
                            "{what}: entry"
                        );
                    }
                }
            }
            let half_total: usize = half.iter().map(|p| p.layout().slot_bytes()).sum();
            let full_total: usize = full.iter().map(|p| p.layout().slot_bytes()).sum();
            assert_eq!(full_total + saved, half_total, "{family} x{world}: slot bytes");
            checked.push(format!("{family} x{world}"));
        }
    }
    eprintln!("{checked:?}");
    assert!(checked.iter().any(|c| c == "llama x4"), "{checked:?}");
    assert!(
        checked.iter().any(|c| c.starts_with("phi3 x")),
        "the fused family: {checked:?}"
    );
}

/// One rank of a group of ranks that are threads of one process and
/// all-gather through `shared`: each rank posts its part there, waits for
/// the others, reads every part into its `out` in rank order, and waits
/// again.
struct ThreadGather<S> {
    rank: usize,
    world: usize,
    barrier: Arc<Barrier>,
    shared: Arc<Mutex<S>>,
}

impl<S> ThreadGather<S> {
    fn group(world: usize, shared: S) -> Vec<ThreadGather<S>> {
        let barrier = Arc::new(Barrier::new(world));
        let shared = Arc::new(Mutex::new(shared));
        (0..world)
            .map(|rank| ThreadGather {
                rank,
                world,
                barrier: Arc::clone(&barrier),
                shared: Arc::clone(&shared),
            })
            .collect()
    }
}

/// Where a [`ThreadGather`] group's parts meet.
trait Exchange: Send {
    /// Rank `rank`'s part (`part_len` elements of `part`) into place.
    fn post(&mut self, rank: usize, part: &DeviceBuffer<f32>, part_len: usize) -> Result<(), PoolError>;
    /// Every rank's part, in rank order, into `out`.
    fn read(&self, world: usize, part_len: usize, out: &mut DeviceBuffer<f32>) -> Result<(), PoolError>;
}

impl<S: Exchange> RankGather for ThreadGather<S> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_gather(
        &mut self,
        part: &DeviceBuffer<f32>,
        part_len: usize,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<(), PoolError> {
        self.shared.lock().unwrap().post(self.rank, part, part_len)?;
        self.barrier.wait();
        self.shared.lock().unwrap().read(self.world, part_len, out)?;
        self.barrier.wait();
        Ok(())
    }
}

/// A host all-gather: the parts downloaded, one per rank.
type HostGather = ThreadGather<HostParts>;

struct HostParts(Vec<Vec<f32>>);

impl HostGather {
    fn host_group(world: usize) -> Vec<HostGather> {
        ThreadGather::group(world, HostParts(vec![Vec::new(); world]))
    }
}

impl Exchange for HostParts {
    fn post(&mut self, rank: usize, part: &DeviceBuffer<f32>, part_len: usize) -> Result<(), PoolError> {
        self.0[rank] = part.download_range(0, part_len)?;
        Ok(())
    }
    fn read(&self, _world: usize, _part_len: usize, out: &mut DeviceBuffer<f32>) -> Result<(), PoolError> {
        Ok(out.write(0, &self.0.concat())?)
    }
}

/// An all-gather by device copies for ranks whose pools share one device
/// (and so one stream): each rank copies its part into a shared device
/// buffer at its place, then the whole shared buffer into its `out`. The
/// stream orders every copy after the shrinks queued before it.
type DeviceCopyGather = ThreadGather<DeviceBuffer<f32>>;

impl DeviceCopyGather {
    fn device_group(device: &Device, world: usize, capacity: usize) -> Vec<DeviceCopyGather> {
        ThreadGather::group(world, device.alloc_zeros(capacity * world).unwrap())
    }
}

impl Exchange for DeviceBuffer<f32> {
    fn post(&mut self, rank: usize, part: &DeviceBuffer<f32>, part_len: usize) -> Result<(), PoolError> {
        Ok(self.copy_from(rank * part_len, part, 0, part_len)?)
    }
    fn read(&self, world: usize, part_len: usize, out: &mut DeviceBuffer<f32>) -> Result<(), PoolError> {
        Ok(out.copy_from(0, self, 0, part_len * world)?)
    }
}

/// A step's rows: every adapter, the base model, then the adapters again
/// in reverse (decode rows, or prefill sequences of 1, 3, 2, ... tokens).
fn step_rows<'l>(leases: &'l [SlotLease]) -> Vec<StepRow<'l>> {
    let mut rows: Vec<StepRow<'l>> = leases.iter().map(StepRow::Adapter).collect();
    rows.push(StepRow::Base);
    rows.extend(leases.iter().rev().map(StepRow::Adapter));
    rows
}

fn seq_len(i: usize) -> usize {
    1 + (i * 2) % 3
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Decode,
    Prefill,
}

/// One rank's delta of `targets` at `layer` for input rows `x` (`[n,
/// in]`, f32: sent as `hi = bf16(x)` and `lo = bf16(x - hi)`, whose deltas
/// add up), through the fully-sharded apply with `gather`, or the fused
/// apply when `gather` is `None`.
fn rank_delta(
    pool: &mut LoraPool,
    adapters: &[String],
    phase: Phase,
    layer: usize,
    modules: &[LoraModule],
    x: &[f32],
    gather: Option<&mut dyn RankGather>,
) -> Vec<f32> {
    let cfg = pool.config().clone();
    let targets = FusedTargets::concat_at(&cfg, pool.layout().placement(), modules).unwrap();
    let width = targets.width();
    let in_dim = pool.layout().entry(layer, modules[0]).unwrap().in_dim;
    let leases: Vec<SlotLease> = adapters.iter().map(|a| pool.acquire(a).unwrap()).collect();
    let rows = step_rows(&leases);
    let n = x.len() / in_dim;
    let device = pool.device().clone();
    let hi: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let lo: Vec<bf16> = x
        .iter()
        .zip(&hi)
        .map(|(&v, h)| bf16::from_f32(v - h.to_f32()))
        .collect();
    let mut gather = gather;
    let mut out = vec![0f32; n * width];
    for half in [hi, lo] {
        let xb = device.upload(&half).unwrap();
        let mut y = device.alloc_zeros::<f32>(n * width).unwrap();
        let (xr, yr) = (Rows::dense(&xb, n, in_dim), RowsMut::dense(&mut y, n, width));
        match phase {
            Phase::Decode => {
                let step = pool.decode_step(&rows, n).unwrap();
                match gather.as_deref_mut() {
                    Some(g) => pool.apply_fully_sharded(&step, layer, &targets, xr, yr, g).unwrap(),
                    None => pool.apply_decode(&step, layer, &targets, xr, yr).unwrap(),
                }
            }
            Phase::Prefill => {
                let seqs: Vec<PrefillSeq<'_>> = rows
                    .iter()
                    .enumerate()
                    .map(|(i, &row)| PrefillSeq { row, len: seq_len(i) })
                    .collect();
                let step = pool.prefill_step(&seqs).unwrap();
                match gather.as_deref_mut() {
                    Some(g) => pool.apply_fully_sharded(&step, layer, &targets, xr, yr, g).unwrap(),
                    None => pool.apply_prefill(&step, layer, &targets, xr, yr).unwrap(),
                }
            }
        }
        device.check_faults().unwrap();
        for (o, v) in out.iter_mut().zip(y.download().unwrap()) {
            *o += v;
        }
    }
    out
}

/// Rows of a step of `adapters` for `phase`.
fn step_len(adapters: usize, phase: Phase) -> usize {
    let rows = 2 * adapters + 1;
    match phase {
        Phase::Decode => rows,
        Phase::Prefill => (0..rows).map(seq_len).sum(),
    }
}

/// The column-parallel call sites of `layer`: the fused q | k | v and gate
/// | up where the family has them (one call of several targets), and every
/// other column-parallel module alone.
fn column_calls(cfg: &ModelConfig, layout: &SlotLayout, layer: usize) -> Vec<Vec<LoraModule>> {
    let has = |m: &LoraModule| layout.entry(layer, *m).is_some();
    let mut calls = Vec::new();
    let mut fused = Vec::new();
    for group in [LoraModule::qkv(cfg.family), LoraModule::gate_up(cfg.family)] {
        if group.len() > 1 && group.iter().all(has) {
            calls.push(group.to_vec());
            fused.extend_from_slice(group);
        }
    }
    for e in layout.entries().iter().filter(|e| e.layer == layer) {
        if e.module.shard_kind() == ShardKind::Column && !fused.contains(&e.module) {
            calls.push(vec![e.module]);
        }
    }
    calls
}

/// Deterministic inputs in `[-1, 1)`.
fn inputs(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = lora_kernels::testing::Rng::new(seed);
    (0..len).map(|_| rng.uniform()).collect()
}

/// For each family whose geometry divides `world`: every rank's
/// fully-sharded decode and prefill delta on `device` (ranks as threads,
/// `gathers` the group's all-gathers) against the half-sharded rank's on
/// `device`, and the ranks' columns side by side against the unsharded
/// pool's delta on the CPU (the reference backend).
fn fully_sharded_ranks_match(
    device: &Device,
    world: usize,
    gathers: impl Fn() -> Vec<Box<dyn RankGather + Send>>,
) -> Vec<String> {
    let mut served = Vec::new();
    for family in families() {
        let cfg = model_config(&family);
        let adapters = dense_adapters(&family, &cfg);
        if adapters.is_empty() {
            continue;
        }
        let Ok(mut half) = load_ranks(device, &cfg, &family, &adapters, world, false) else {
            continue;
        };
        let mut full = load_ranks(device, &cfg, &family, &adapters, world, true).unwrap();
        let mut whole = load_ranks(&Device::cpu(), &cfg, &family, &adapters, 1, false).unwrap();
        let layout = whole[0].layout().clone();
        let mut nonzero = 0;
        for layer in [0, cfg.num_hidden_layers - 1] {
            for modules in column_calls(&cfg, &layout, layer) {
                for phase in [Phase::Decode, Phase::Prefill] {
                    let what = format!("{family} x{world} layer {layer} {modules:?} {phase:?}");
                    let in_dim = layout.entry(layer, modules[0]).unwrap().in_dim;
                    let n = step_len(adapters.len(), phase);
                    let x = inputs(layer as u64 * 31 + n as u64, n * in_dim);
                    let unsharded = rank_delta(&mut whole[0], &adapters, phase, layer, &modules, &x, None);
                    let group = gathers();
                    let full_out: Vec<Vec<f32>> = std::thread::scope(|s| {
                        let handles: Vec<_> = full
                            .iter_mut()
                            .zip(group)
                            .map(|(pool, mut g)| {
                                let (adapters, modules, x) = (&adapters, &modules, &x);
                                s.spawn(move || rank_delta(pool, adapters, phase, layer, modules, x, Some(g.as_mut())))
                            })
                            .collect();
                        handles.into_iter().map(|h| h.join().unwrap()).collect()
                    });
                    // Each rank's columns, then the ranks side by side.
                    let width: usize = modules.iter().map(|m| m.dims(&cfg).0).sum();
                    let mut assembled = vec![f32::NAN; n * width];
                    for (r, (pool, got)) in half.iter_mut().zip(&full_out).enumerate() {
                        let want = rank_delta(pool, &adapters, phase, layer, &modules, &x, None);
                        let err = rel_error(got, &want);
                        assert!(err < TOL, "{what} rank {r}: {err} against the half-sharded rank");
                        let placement = pool.layout().placement();
                        let targets = FusedTargets::concat_at(&cfg, placement, &modules).unwrap();
                        let rank_width = targets.width();
                        let mut full_col = 0;
                        for t in targets.targets() {
                            let shard = ModuleShard::of(t.module, &cfg, placement).unwrap();
                            for j in 0..shard.dims().0 {
                                let col = full_col + shard.src_row(j).unwrap();
                                for row in 0..n {
                                    assembled[row * width + col] = got[row * rank_width + t.y_col_offset + j];
                                }
                            }
                            full_col += t.module.dims(&cfg).0;
                        }
                    }
                    let err = rel_error(&assembled, &unsharded);
                    assert!(err < TOL, "{what}: {err} against the unsharded pool");
                    nonzero += usize::from(unsharded.iter().any(|&v| v != 0.0));
                }
            }
        }
        assert!(nonzero > 0, "{family} x{world}: every delta was empty");
        served.push(family);
    }
    eprintln!("x{world}: {served:?}");
    served
}

#[test]
fn fully_sharded_applies_give_each_rank_the_half_sharded_columns_on_the_cpu() {
    let device = Device::cpu();
    for world in [2, 4] {
        let served = fully_sharded_ranks_match(&device, world, || {
            HostGather::host_group(world)
                .into_iter()
                .map(|g| Box::new(g) as Box<dyn RankGather + Send>)
                .collect()
        });
        assert!(served.iter().any(|f| f == "llama"), "{served:?}");
        assert!(served.iter().any(|f| f == "phi3"), "the fused family: {served:?}");
    }
}

/// Every rank's pool on one GPU, the all-gather by device copies; each
/// rank's CUDA result against the half-sharded rank's on the GPU, and the
/// ranks side by side against the CPU reference's unsharded delta.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn fully_sharded_applies_give_each_rank_the_half_sharded_columns_on_one_gpu() {
    let Some(device) =
        lora_kernels::testing::cuda_or_skip("fully_sharded_applies_give_each_rank_the_half_sharded_columns_on_one_gpu")
    else {
        return;
    };
    let capacity = BatchCapacity::default().max_rows * lora_kernels::MAX_TARGETS * MAX_RANK;
    for world in [2, 4] {
        let served = fully_sharded_ranks_match(&device, world, || {
            DeviceCopyGather::device_group(&device, world, capacity)
                .into_iter()
                .map(|g| Box::new(g) as Box<dyn RankGather + Send>)
                .collect()
        });
        assert!(served.iter().any(|f| f == "llama"), "{served:?}");
    }
}

/// A world of one on one GPU through a one-rank NCCL communicator: the
/// fully-sharded apply equals the CPU pool's fused apply.
#[test]
#[ignore = "needs a GPU with libnccl: run with --include-ignored where CUDA is usable"]
fn a_one_rank_nccl_fully_sharded_apply_equals_the_cpu_reference() {
    let Some(device) =
        lora_kernels::testing::cuda_or_skip("a_one_rank_nccl_fully_sharded_apply_equals_the_cpu_reference")
    else {
        return;
    };
    let mut comm = match lora_kernels::NcclComm::one_rank(&device) {
        Err(KernelError::NcclMissing) if !lora_kernels::testing::gpu_required() => {
            eprintln!("SKIPPED: libnccl is not present");
            return;
        }
        other => other.unwrap(),
    };
    let cfg = model_config("llama");
    let adapters = dense_adapters("llama", &cfg);
    let mut gpu = load_ranks(&device, &cfg, "llama", &adapters, 1, true).unwrap();
    let mut cpu = load_ranks(&Device::cpu(), &cfg, "llama", &adapters, 1, false).unwrap();
    let layout = cpu[0].layout().clone();
    for layer in 0..cfg.num_hidden_layers {
        for modules in column_calls(&cfg, &layout, layer) {
            for phase in [Phase::Decode, Phase::Prefill] {
                let in_dim = layout.entry(layer, modules[0]).unwrap().in_dim;
                let n = step_len(adapters.len(), phase);
                let x = inputs(7 + layer as u64, n * in_dim);
                let want = rank_delta(&mut cpu[0], &adapters, phase, layer, &modules, &x, None);
                let got = rank_delta(&mut gpu[0], &adapters, phase, layer, &modules, &x, Some(&mut comm));
                let err = rel_error(&got, &want);
                assert!(err < TOL, "layer {layer} {modules:?} {phase:?}: {err}");
            }
        }
    }
}

/// `pool`'s layer-0 apply of `targets` to the one row `x` (`in_dim` wide)
/// into `y`: through the fully-sharded apply with `gather`, or the fused
/// decode apply when `gather` is `None`.
fn one_row(
    pool: &LoraPool,
    step: &DecodeStep,
    targets: &FusedTargets,
    (x, in_dim): (&DeviceBuffer<bf16>, usize),
    y: &mut DeviceBuffer<f32>,
    gather: Option<&mut dyn RankGather>,
) -> Result<(), PoolError> {
    let (x, y) = (Rows::dense(x, 1, in_dim), RowsMut::dense(y, 1, targets.width()));
    match gather {
        Some(g) => pool.apply_fully_sharded(step, 0, targets, x, y, g),
        None => pool.apply_decode(step, 0, targets, x, y),
    }
}

/// `err` is the rank-split refusal naming `module`.
fn assert_rank_split(err: &PoolError, module: LoraModule) {
    assert!(
        matches!(err, PoolError::RankSplit { module: m, .. } if *m == module),
        "{err}"
    );
}

#[test]
fn the_wrong_apply_a_foreign_gather_and_an_indivisible_max_rank_are_refused() {
    let device = Device::cpu();
    let cfg = model_config("llama");
    let adapters = vec!["demo_r4_plain".to_string()];
    let mut full = load_ranks(&device, &cfg, "llama", &adapters, 2, true).unwrap();
    let pool = &mut full[0];
    let placement = pool.layout().placement();
    let lease = pool.acquire("demo_r4_plain").unwrap();
    let step = pool.decode_step(&[StepRow::Adapter(&lease)], 1).unwrap();
    let hidden = cfg.hidden_size;
    let x = device.upload(&vec![bf16::ONE; hidden]).unwrap();
    let q = FusedTargets::single_at(&cfg, placement, LoraModule::QProj).unwrap();
    let o = FusedTargets::single_at(&cfg, placement, LoraModule::OProj).unwrap();
    let mut y = device.alloc_zeros::<f32>(hidden).unwrap();
    let err = one_row(pool, &step, &q, (&x, hidden), &mut y, None).unwrap_err();
    assert_rank_split(&err, LoraModule::QProj);
    let o_in = pool.layout().entry(0, LoraModule::OProj).unwrap().in_dim;
    let mut gather = HostGather::host_group(2).remove(0);
    let err = one_row(pool, &step, &o, (&x, o_in), &mut y, Some(&mut gather)).unwrap_err();
    assert_rank_split(&err, LoraModule::OProj);
    let mut foreign = HostGather::host_group(4).remove(0);
    let err = one_row(pool, &step, &q, (&x, hidden), &mut y, Some(&mut foreign)).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::GatherGroup {
                world: 4,
                tp_world: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(y.download().unwrap().iter().all(|&v| v == 0.0), "nothing written");
    // The row-parallel module still goes through the fused apply.
    one_row(pool, &step, &o, (&x, o_in), &mut y, None).unwrap();
    // A half-sharded pool has no fully-sharded apply.
    let mut half = load_ranks(&device, &cfg, "llama", &adapters, 2, false).unwrap();
    let lease = half[0].acquire("demo_r4_plain").unwrap();
    let step = half[0].decode_step(&[StepRow::Adapter(&lease)], 1).unwrap();
    let err = one_row(&half[0], &step, &q, (&x, hidden), &mut y, Some(&mut gather)).unwrap_err();
    assert!(matches!(err, PoolError::RankSplit { .. }), "{err}");
    // max_rank 6 does not split into 4 blocks of rank rows (the heads do):
    // the layout walk, and so the pool, refuses naming max_rank.
    let l = SlotLayout::with_placement(&cfg, 6, Placement::new(1, 4).unwrap().with_fully_sharded(true));
    assert_eq!(
        l.unwrap_err(),
        LayoutError::Placement(PlacementError::IndivisibleRank {
            max_rank: 6,
            tp_world: 4
        })
    );
    let opts = LoraOptions {
        max_rank: 6,
        ..options(1, Placement::new(1, 4).unwrap().with_fully_sharded(true))
    };
    let Err(err) = LoraPool::new(&device, cfg.clone(), opts, BatchCapacity::default()) else {
        panic!("a pool was built for a max_rank that does not split");
    };
    assert!(err.to_string().contains("max_rank = 6"), "{err}");
}

/// A DoRA pool (world 1, where DoRA is served) with the fully-sharded
/// option: the fully-sharded apply has no DoRA epilogue and refuses it
/// before writing anything; the fused apply serves its column-parallel
/// modules (at world 1 their A holds every rank row).
#[test]
fn a_dora_pool_is_refused_by_the_fully_sharded_apply() {
    let device = Device::cpu();
    let cfg = model_config("llama");
    let dir = fixtures().join("llama").join("demo_r4_plain");
    let opts = LoraOptions {
        dora: true,
        ..options(1, Placement::SINGLE.with_fully_sharded(true))
    };
    let sources = [AdapterSource {
        name: "demo_r4_plain",
        dir: &dir,
    }];
    let mut pool = LoraPool::load(&device, cfg.clone(), opts, BatchCapacity::default(), &sources).unwrap();
    let lease = pool.acquire("demo_r4_plain").unwrap();
    let step = pool.decode_step(&[StepRow::Adapter(&lease)], 1).unwrap();
    let hidden = cfg.hidden_size;
    let x = device.upload(&vec![bf16::ONE; hidden]).unwrap();
    let q = FusedTargets::single_at(&cfg, Placement::SINGLE, LoraModule::QProj).unwrap();
    let mut y = device.alloc_zeros::<f32>(q.width()).unwrap();
    let mut gather = HostGather::host_group(1).remove(0);
    let err = one_row(&pool, &step, &q, (&x, hidden), &mut y, Some(&mut gather)).unwrap_err();
    assert_rank_split(&err, LoraModule::QProj);
    assert!(err.to_string().contains("DoRA"), "{err}");
    assert!(y.download().unwrap().iter().all(|&v| v == 0.0), "nothing written");
    one_row(&pool, &step, &q, (&x, hidden), &mut y, None).unwrap();
    assert!(
        y.download().unwrap().iter().any(|&v| v != 0.0),
        "the fused apply serves q"
    );
}

/// Every route into a fully-sharded slot packs the same bytes (startup
/// load, disk swap, the host tier's image), and each reads only the rank's
/// block of A's rank rows: a NaN in rank rows only rank 0 holds is refused
/// by rank 0, naming the tensor, and never seen by rank 1.
#[test]
fn every_route_into_a_fully_sharded_slot_reads_only_the_ranks_block_of_rank_rows() {
    use lora_pool::{SlotId, SwapRoute};
    // `demo_r4_plain` (rank 4) with a NaN in row 0 of layer 0's q_proj A:
    // at max_rank 16 over 2 ranks, rank 0 holds A's rank rows 0..8 (all
    // four of the adapter's), rank 1 rows 8..16 (padding only).
    let tensor = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let bad = poisoned_copy("demo_r4_plain", "lora-pool-fsh-poison-routes", tensor, |shape| {
        assert_eq!(shape[0], 4, "rank 4");
        1
    });
    let clean = fixtures().join("llama").join("rank_alpha_pattern");
    for p in Placement::new(0, 2).unwrap().ranks() {
        let opts = tiered_options(3, p.with_fully_sharded(true));
        let mut pool = pool_with(opts, &[("loaded", "rank_alpha_pattern")]);
        let swapped = pool.swap_from_disk(SlotId::new(1), "swapped", &clean).unwrap();
        pool.prefetch("tiered", &clean).unwrap();
        pool.wait_for_prefetch();
        let tiered = pool.swap_from_disk(SlotId::new(2), "tiered", &clean).unwrap();
        assert_eq!(tiered.route, SwapRoute::HostTier);
        assert_ne!(
            swapped.route,
            SwapRoute::DeviceRepack,
            "a rank-row cut packs on the host"
        );
        let loaded = pool.slot_contents(SlotId::new(0)).unwrap();
        for slot in [1, 2] {
            assert_eq!(
                pool.slot_contents(SlotId::new(slot)).unwrap(),
                loaded,
                "rank {} slot {slot}",
                p.tp_rank()
            );
        }
        // The poisoned rank rows.
        pool.evict(SlotId::new(1)).unwrap();
        let result = pool.swap_from_disk(SlotId::new(1), "bad", &bad);
        if p.tp_rank() == 0 {
            let err = result.expect_err("rank 0 holds the NaN row").to_string();
            assert!(err.contains("non-finite") && err.contains(tensor), "{err}");
        } else {
            result.expect("rank 1 never reads rank rows 0..8");
        }
    }
    let _ = std::fs::remove_dir_all(&bad);
}
