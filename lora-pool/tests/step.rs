//! The step API's invariants on the CPU backend and the llama fixtures: a
//! step holds every slot it names until it drops (evict, swap, promotion
//! refused, nothing changed), only the latest step of a kind applies, a
//! lease of another pool or a malformed batch is refused with its typed
//! error and writes nothing, and a step's rows, identities and held slots
//! are exactly what its leases say.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{dir, model_config, options, pool_with, pool_with_capacity, slot, snapshot};
use half::bf16;
use lora_kernels::testing::Rng;
use lora_kernels::{DeviceBuffer, Rows, RowsMut};
use lora_layout::LoraModule;
use lora_pool::{
    BatchCapacity, DecodeStep, FusedTargets, LoraPool, PoolError, PrefillSeq, PrefillStep, RowSlot, SlotId, SlotLease,
    Step, StepKind, StepRow,
};
use proptest::prelude::*;

/// Three adapters in slots 0..3; slot 3 stays empty.
const ADAPTERS: [(&str, &str); 3] = [
    ("a", "demo_r4_plain"),
    ("b", "demo_r8_rslora"),
    ("c", "demo_r16_alpha_pattern"),
];

fn pool() -> LoraPool {
    pool_with(options(4, 0), &ADAPTERS)
}

fn seq<'l>(row: StepRow<'l>, len: usize) -> PrefillSeq<'l> {
    PrefillSeq { row, len }
}

/// The input and output of one apply call over `rows` kernel rows for
/// `targets`: random x, and y holding random "base projection" values
/// (returned too, to check what an apply added or left alone).
struct Io {
    x: DeviceBuffer<bf16>,
    y: DeviceBuffer<f32>,
    y0: Vec<f32>,
    rows: usize,
    in_dim: usize,
    width: usize,
}

impl Io {
    fn new(pool: &LoraPool, targets: &FusedTargets, rows: usize, rng: &mut Rng) -> Io {
        let in_dim = targets.targets()[0].module.dims(pool.config()).1;
        let width = targets.width();
        let x: Vec<bf16> = (0..rows * in_dim).map(|_| bf16::from_f32(rng.uniform())).collect();
        let y0: Vec<f32> = (0..rows * width).map(|_| rng.uniform()).collect();
        let device = pool.device();
        Io {
            x: device.upload(&x).unwrap(),
            y: device.upload(&y0).unwrap(),
            y0,
            rows,
            in_dim,
            width,
        }
    }

    fn decode(&mut self, pool: &LoraPool, step: &DecodeStep, targets: &FusedTargets) -> Result<(), PoolError> {
        pool.apply_decode(
            step,
            0,
            targets,
            Rows::dense(&self.x, self.rows, self.in_dim),
            RowsMut::dense(&mut self.y, self.rows, self.width),
        )
    }

    fn prefill(&mut self, pool: &LoraPool, step: &PrefillStep, targets: &FusedTargets) -> Result<(), PoolError> {
        pool.apply_prefill(
            step,
            0,
            targets,
            Rows::dense(&self.x, self.rows, self.in_dim),
            RowsMut::dense(&mut self.y, self.rows, self.width),
        )
    }

    fn one_adapter(&mut self, pool: &LoraPool, step: &PrefillStep, targets: &FusedTargets) -> Result<(), PoolError> {
        pool.apply_one_adapter(
            step,
            0,
            targets,
            Rows::dense(&self.x, self.rows, self.in_dim),
            RowsMut::dense(&mut self.y, self.rows, self.width),
        )
    }

    fn y(&self) -> Vec<f32> {
        self.y.download().unwrap()
    }

    fn unchanged(&self) -> bool {
        self.y() == self.y0
    }
}

fn in_use(err: &PoolError, held: SlotId, leases: u32) -> bool {
    matches!(err, PoolError::SlotInUse { slot, leases: l } if *slot == held && *l == leases)
}

/// The device row map of a step, as the kernels read it: the slot index,
/// -1 for the base model and padding.
fn kernel_rows(rows: &[RowSlot], per_row: &[usize], total: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(total);
    for (r, n) in rows.iter().zip(per_row) {
        let v = r.slot().map_or(-1, |s| i32::try_from(s.index()).unwrap());
        out.extend(std::iter::repeat_n(v, *n));
    }
    out.resize(total, -1);
    out
}

#[test]
fn evicting_a_slot_a_decode_step_holds_is_refused_and_changes_nothing() {
    let mut pool = pool();
    let mut rng = Rng::fresh("evicting_a_slot_a_decode_step_holds_is_refused_and_changes_nothing");
    let qkv = FusedTargets::qkv(pool.config());
    let a = pool.acquire("a").unwrap();
    let held = a.slot();
    let step = pool.decode_step(&[StepRow::Adapter(&a), StepRow::Base], 2).unwrap();
    drop(a);
    assert_eq!(pool.ref_count(held), 1, "the step alone holds the slot");
    let before = snapshot(&pool);
    let err = pool.evict(held).unwrap_err();
    assert!(in_use(&err, held, 1), "{err}");
    assert_eq!(snapshot(&pool), before, "a refused eviction changed the pool");
    // The step still serves its adapter.
    let mut io = Io::new(&pool, &qkv, 2, &mut rng);
    io.decode(&pool, &step, &qkv).unwrap();
    let y = io.y();
    assert_ne!(
        y[..qkv.width()],
        io.y0[..qkv.width()],
        "the adapter's row got its delta"
    );
    assert_eq!(y[qkv.width()..], io.y0[qkv.width()..], "the base row got none");
}

/// Every swap into `held` is refused with `SlotInUse` naming `leases`
/// leases, and leaves the pool as `before`.
fn swaps_refused(pool: &mut LoraPool, held: SlotId, leases: u32, before: &common::Snapshot) {
    let prepared = lora_audit::prepare_adapter(&dir("rslora"), &model_config("llama"), pool.options()).unwrap();
    let err = pool.swap_from_disk(held, "new", &dir("rslora")).unwrap_err();
    assert!(in_use(&err, held, leases), "{err}");
    let err = pool.swap_prepared(held, "new", &prepared).unwrap_err();
    assert!(in_use(&err, held, leases), "{err}");
    // Writing the slot's own name back into it is refused too.
    let err = pool.swap_from_disk(held, "b", &dir("demo_r8_rslora")).unwrap_err();
    assert!(in_use(&err, held, leases), "{err}");
    assert_eq!(&snapshot(pool), before, "a refused swap changed the pool");
}

#[test]
fn a_swap_onto_a_slot_a_step_holds_is_refused_and_changes_nothing() {
    let mut pool = pool();
    let b = pool.acquire("b").unwrap();
    let held = b.slot();
    let decode = pool.decode_step(&[StepRow::Base, StepRow::Adapter(&b)], 2).unwrap();
    let prefill = pool.prefill_step(&[seq(StepRow::Adapter(&b), 3)]).unwrap();
    drop(b);
    let before = snapshot(&pool);
    swaps_refused(&mut pool, held, 2, &before);
    drop(decode);
    swaps_refused(&mut pool, held, 1, &before);
    pool.check_step(&prefill).unwrap();
    drop(prefill);
    pool.swap_from_disk(held, "new", &dir("rslora")).unwrap();
    assert_eq!(pool.slot_of("new"), Some(held));
}

#[test]
fn promotion_never_picks_a_slot_a_step_holds() {
    let mut pool = pool_with(options(2, 1), &[("pinned", "demo_r4_plain"), ("b", "demo_r8_rslora")]);
    let b = pool.acquire("b").unwrap();
    let step = pool.decode_step(&[StepRow::Adapter(&b)], 1).unwrap();
    drop(b);
    let before = snapshot(&pool);
    let err = pool.promote("new", &dir("rslora")).unwrap_err();
    assert!(matches!(err, PoolError::PoolFull { .. }), "{err}");
    assert_eq!(snapshot(&pool), before);
    drop(step);
    let lease = pool.promote("new", &dir("rslora")).unwrap();
    assert_eq!((lease.slot(), pool.slot_of("b")), (slot(1), None));
}

#[test]
fn once_the_step_and_the_leases_drop_the_evict_goes_through() {
    let mut pool = pool();
    let a = pool.acquire("a").unwrap();
    let held = a.slot();
    let step = pool.decode_step(&[StepRow::Adapter(&a)], 1).unwrap();
    assert_eq!(pool.ref_count(held), 2);
    drop(step);
    // The request's own lease still holds it.
    let err = pool.evict(held).unwrap_err();
    assert!(in_use(&err, held, 1), "{err}");
    drop(a);
    assert_eq!(pool.ref_count(held), 0);
    let before = snapshot(&pool);
    pool.evict(held).unwrap();
    let after = snapshot(&pool);
    assert!(after.bytes[held.index()].iter().all(|v| v.to_f32() == 0.0));
    assert_eq!(pool.slot_of("a"), None);
    assert!(matches!(pool.acquire("a"), Err(PoolError::NotResident(_))));
    // Only the evicted slot changed.
    for s in pool.slot_ids().filter(|s| *s != held) {
        assert_eq!(after.bytes[s.index()], before.bytes[s.index()], "slot {s}");
        assert_eq!(after.slots[s.index()], before.slots[s.index()], "slot {s}");
    }
}

#[test]
fn an_old_step_is_stale_once_a_new_one_of_its_kind_is_built() {
    let mut pool = pool();
    let mut rng = Rng::fresh("an_old_step_is_stale_once_a_new_one_of_its_kind_is_built");
    let qkv = FusedTargets::qkv(pool.config());
    let (a, b) = (pool.acquire("a").unwrap(), pool.acquire("b").unwrap());
    let old = pool.decode_step(&[StepRow::Adapter(&a), StepRow::Base], 2).unwrap();
    let new = pool.decode_step(&[StepRow::Base, StepRow::Adapter(&b)], 2).unwrap();
    assert_ne!(old.id(), new.id());
    let mut io = Io::new(&pool, &qkv, 2, &mut rng);
    let err = io.decode(&pool, &old, &qkv).unwrap_err();
    assert!(matches!(err, PoolError::StaleStep { kind: StepKind::Decode }), "{err}");
    assert!(io.unchanged(), "a refused apply wrote y");
    assert!(matches!(
        pool.check_step(&old),
        Err(PoolError::StaleStep { kind: StepKind::Decode })
    ));

    // Prefill steps go stale the same way, for both of their applies.
    let p_old = pool.prefill_step(&[seq(StepRow::Adapter(&a), 2)]).unwrap();
    let p_new = pool.prefill_step(&[seq(StepRow::Adapter(&b), 2)]).unwrap();
    let mut pio = Io::new(&pool, &qkv, 2, &mut rng);
    for err in [
        pio.prefill(&pool, &p_old, &qkv).unwrap_err(),
        pio.one_adapter(&pool, &p_old, &qkv).unwrap_err(),
    ] {
        assert!(
            matches!(
                err,
                PoolError::StaleStep {
                    kind: StepKind::Prefill
                }
            ),
            "{err}"
        );
    }
    assert!(pio.unchanged(), "a refused apply wrote y");

    // A step of one kind does not stale the other kind's, and the current
    // steps apply.
    pool.check_step(&new).unwrap();
    io.decode(&pool, &new, &qkv).unwrap();
    pio.prefill(&pool, &p_new, &qkv).unwrap();

    // Another pool's step is not this pool's current step, whatever its id.
    let mut other = pool_with(options(4, 0), &ADAPTERS);
    let oa = other.acquire("a").unwrap();
    let foreign = other.decode_step(&[StepRow::Adapter(&oa), StepRow::Base], 2).unwrap();
    let before = io.y();
    let err = pool
        .apply_decode(
            &foreign,
            0,
            &qkv,
            Rows::dense(&io.x, 2, io.in_dim),
            RowsMut::dense(&mut io.y, 2, io.width),
        )
        .unwrap_err();
    assert!(matches!(err, PoolError::StaleStep { kind: StepKind::Decode }), "{err}");
    assert_eq!(io.y(), before, "a refused apply wrote y");
}

#[test]
fn a_lease_of_another_pool_is_refused_and_the_current_step_stays() {
    let mut pool = pool();
    let other = pool_with(options(4, 0), &ADAPTERS);
    let (a, b) = (pool.acquire("a").unwrap(), pool.acquire("b").unwrap());
    // The other pool's lease names the same slot and the same identity.
    let foreign = other.acquire("b").unwrap();
    assert_eq!((foreign.slot(), foreign.adapter_id()), (b.slot(), b.adapter_id()));
    let current = pool.decode_step(&[StepRow::Adapter(&a), StepRow::Base], 4).unwrap();
    let rows_before = pool
        .step_slots(&current)
        .unwrap()
        .buffer()
        .download_range(0, 4)
        .unwrap();
    let counts: Vec<u32> = pool.slot_ids().map(|s| pool.ref_count(s)).collect();
    let err = pool
        .decode_step(&[StepRow::Adapter(&b), StepRow::Base, StepRow::Adapter(&foreign)], 4)
        .unwrap_err();
    assert!(matches!(err, PoolError::ForeignLease { row: 2, .. }), "{err}");
    assert!(err.to_string().starts_with("row 2:"), "{err}");
    let p_current = pool.prefill_step(&[seq(StepRow::Base, 2)]).unwrap();
    let err = pool
        .prefill_step(&[seq(StepRow::Adapter(&foreign), 2), seq(StepRow::Adapter(&a), 1)])
        .unwrap_err();
    assert!(matches!(err, PoolError::ForeignLease { row: 0, .. }), "{err}");
    assert!(
        err.to_string().starts_with("sequence 0:"),
        "a prefill step's entries are sequences: {err}"
    );
    // A refused step writes nothing and holds nothing.
    pool.check_step(&current).unwrap();
    pool.check_step(&p_current).unwrap();
    let rows_after = pool
        .step_slots(&current)
        .unwrap()
        .buffer()
        .download_range(0, 4)
        .unwrap();
    assert_eq!(rows_after, rows_before);
    assert_eq!(pool.slot_ids().map(|s| pool.ref_count(s)).collect::<Vec<_>>(), counts);
    assert_eq!(other.ref_count(foreign.slot()), 1, "only the lease itself");
}

/// A lease pins its slot's adapter: nothing can write the slot while the
/// lease lives, so a lease naming an identity its slot no longer has
/// (`PoolError::StaleLease`) cannot be made through the public API. (The
/// pool's own unit tests reach it with a forged lease.)
#[test]
fn a_live_lease_keeps_its_slot_from_changing() {
    let mut pool = pool();
    let a = pool.acquire("a").unwrap();
    let id = a.adapter_id();
    assert_eq!(id, pool.slots()[a.slot().index()].adapter_id());
    assert!(in_use(&pool.evict(a.slot()).unwrap_err(), a.slot(), 1));
    assert!(in_use(
        &pool.swap_from_disk(a.slot(), "a", &dir("demo_r4_plain")).unwrap_err(),
        a.slot(),
        1
    ));
    assert_eq!(pool.slots()[a.slot().index()].adapter_id(), id);
    let step = pool.decode_step(&[StepRow::Adapter(&a)], 1).unwrap();
    assert_eq!(step.adapter_id(0), Some(id));
}

#[test]
fn a_prefill_sequence_of_no_tokens_is_refused() {
    let mut pool = pool();
    let a = pool.acquire("a").unwrap();
    let current = pool.prefill_step(&[seq(StepRow::Adapter(&a), 3)]).unwrap();
    for seqs in [
        vec![seq(StepRow::Adapter(&a), 0)],
        vec![seq(StepRow::Base, 0)],
        vec![
            seq(StepRow::Adapter(&a), 2),
            seq(StepRow::Base, 0),
            seq(StepRow::Base, 1),
        ],
    ] {
        let err = pool.prefill_step(&seqs).unwrap_err();
        assert!(matches!(err, PoolError::Batch(_)), "{err}");
    }
    pool.check_step(&current).unwrap();
    assert_eq!(pool.ref_count(a.slot()), 2, "the lease and the current step");
}

#[test]
fn batches_past_padded_rows_or_the_capacity_are_refused() {
    let capacity = BatchCapacity {
        max_rows: 8,
        max_segments: 2,
    };
    let mut pool = pool_with_capacity(options(4, 0), capacity, &ADAPTERS);
    let a = pool.acquire("a").unwrap();
    let rows = [StepRow::Adapter(&a), StepRow::Base, StepRow::Adapter(&a)];
    let err = pool.decode_step(&rows, 2).unwrap_err();
    // The limit named is the one passed: the padded rows, not the capacity.
    assert!(
        matches!(&err, PoolError::Batch(m) if m.contains("3 rows do not fit the 2 padded rows")),
        "more rows than padded rows: {err}"
    );
    let err = pool.decode_step(&rows, capacity.max_rows + 1).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::BatchTooLarge {
                what: "padded decode rows",
                got: 9,
                capacity: 8
            }
        ),
        "padded past the capacity: {err}"
    );
    let full = vec![StepRow::Base; capacity.max_rows + 1];
    let err = pool.decode_step(&full, capacity.max_rows + 1).unwrap_err();
    assert!(matches!(err, PoolError::BatchTooLarge { .. }), "{err}");
    let step = pool.decode_step(&rows, capacity.max_rows).unwrap();
    assert_eq!(step.kernel_rows(), capacity.max_rows);

    let three = [
        seq(StepRow::Base, 1),
        seq(StepRow::Adapter(&a), 1),
        seq(StepRow::Base, 1),
    ];
    let err = pool.prefill_step(&three).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::BatchTooLarge {
                what: "prefill segments",
                got: 3,
                capacity: 2
            }
        ),
        "{err}"
    );
    let long = [seq(StepRow::Adapter(&a), 5), seq(StepRow::Base, 4)];
    let err = pool.prefill_step(&long).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::BatchTooLarge {
                what: "prefill rows",
                got: 9,
                capacity: 8
            }
        ),
        "{err}"
    );
    let fits = pool
        .prefill_step(&[seq(StepRow::Adapter(&a), 4), seq(StepRow::Base, 4)])
        .unwrap();
    assert_eq!(fits.cu_seqlens(), &[0, 4, 8]);
}

#[test]
fn x_rows_must_equal_the_steps_kernel_rows() {
    let mut pool = pool();
    let mut rng = Rng::fresh("x_rows_must_equal_the_steps_kernel_rows");
    let qkv = FusedTargets::qkv(pool.config());
    let a = pool.acquire("a").unwrap();
    let decode = pool.decode_step(&[StepRow::Adapter(&a), StepRow::Base], 4).unwrap();
    assert_eq!((decode.kernel_rows(), decode.padded_rows()), (4, 4));
    // x holds the requests' rows only, not the padding.
    let mut io = Io::new(&pool, &qkv, 2, &mut rng);
    let err = io.decode(&pool, &decode, &qkv).unwrap_err();
    assert!(matches!(err, PoolError::Batch(_)), "{err}");
    assert!(io.unchanged());
    let mut padded = Io::new(&pool, &qkv, 4, &mut rng);
    padded.decode(&pool, &decode, &qkv).unwrap();

    let prefill = pool
        .prefill_step(&[seq(StepRow::Adapter(&a), 3), seq(StepRow::Adapter(&a), 2)])
        .unwrap();
    assert_eq!(prefill.kernel_rows(), 5);
    for rows in [4, 6] {
        let mut io = Io::new(&pool, &qkv, rows, &mut rng);
        let err = io.prefill(&pool, &prefill, &qkv).unwrap_err();
        assert!(matches!(err, PoolError::Batch(_)), "{rows} rows: {err}");
        let err = io.one_adapter(&pool, &prefill, &qkv).unwrap_err();
        assert!(matches!(err, PoolError::Batch(_)), "{rows} rows: {err}");
        assert!(io.unchanged());
    }
    // x must also be as wide as the modules' input.
    let down = FusedTargets::single(pool.config(), LoraModule::DownProj);
    let mut wide = Io::new(&pool, &qkv, 4, &mut rng);
    let err = pool
        .apply_decode(
            &decode,
            0,
            &down,
            Rows::dense(&wide.x, 4, wide.in_dim),
            RowsMut::dense(&mut wide.y, 4, down.width()),
        )
        .unwrap_err();
    assert!(matches!(err, PoolError::Batch(_)), "{err}");
    assert!(wide.unchanged());
}

#[test]
fn a_one_adapter_apply_refuses_a_mixed_step() {
    let mut pool = pool();
    let mut rng = Rng::fresh("a_one_adapter_apply_refuses_a_mixed_step");
    let qkv = FusedTargets::qkv(pool.config());
    let (a, b) = (pool.acquire("a").unwrap(), pool.acquire("b").unwrap());
    for mixed in [
        [seq(StepRow::Adapter(&a), 2), seq(StepRow::Adapter(&b), 3)],
        [seq(StepRow::Adapter(&a), 2), seq(StepRow::Base, 3)],
    ] {
        let step = pool.prefill_step(&mixed).unwrap();
        assert_eq!(step.one_adapter(), None);
        let mut io = Io::new(&pool, &qkv, 5, &mut rng);
        let err = io.one_adapter(&pool, &step, &qkv).unwrap_err();
        assert!(matches!(err, PoolError::NotOneAdapter), "{err}");
        assert!(io.unchanged(), "a refused apply wrote y");
    }
    // One adapter throughout: the one-adapter apply adds what the mixed
    // prefill apply adds.
    let step = pool
        .prefill_step(&[seq(StepRow::Adapter(&b), 2), seq(StepRow::Adapter(&b), 3)])
        .unwrap();
    assert_eq!(step.one_adapter(), Some(b.slot()));
    // The same x and y for both.
    let mut same = rng.clone();
    let mut one = Io::new(&pool, &qkv, 5, &mut rng);
    let mut mixed = Io::new(&pool, &qkv, 5, &mut same);
    one.one_adapter(&pool, &step, &qkv).unwrap();
    mixed.prefill(&pool, &step, &qkv).unwrap();
    let delta = |io: &Io| -> Vec<f32> { io.y().iter().zip(&io.y0).map(|(y, y0)| y - y0).collect() };
    let reference = delta(&mixed);
    assert!(reference.iter().any(|d| *d != 0.0));
    let err = common::rel_error(&delta(&one), &reference);
    assert!(err < 1e-3, "one-adapter against mixed prefill: relative error {err}");
    // Base rows only: nothing to add.
    let base = pool.prefill_step(&[seq(StepRow::Base, 5)]).unwrap();
    let mut io = Io::new(&pool, &qkv, 5, &mut rng);
    io.one_adapter(&pool, &base, &qkv).unwrap();
    assert!(io.unchanged());
}

#[test]
fn fused_targets_refuse_too_many_or_repeated_modules() {
    let cfg = model_config("llama");
    assert_eq!(FusedTargets::MAX, lora_kernels::MAX_TARGETS);
    let too_many = &LoraModule::ALL[..FusedTargets::MAX + 1];
    let err = FusedTargets::concat(&cfg, too_many).unwrap_err();
    assert!(
        matches!(err, PoolError::TooManyTargets { got, max } if got == FusedTargets::MAX + 1 && max == FusedTargets::MAX),
        "{err}"
    );
    let err = FusedTargets::concat(&cfg, &[]).unwrap_err();
    assert!(matches!(err, PoolError::TooManyTargets { got: 0, .. }), "{err}");
    let repeated = [LoraModule::QProj, LoraModule::KProj, LoraModule::QProj];
    let err = FusedTargets::concat(&cfg, &repeated).unwrap_err();
    assert!(matches!(err, PoolError::Batch(_)), "{err}");

    // At most MAX: each module starts where the one before it ends.
    let most = FusedTargets::concat(&cfg, &LoraModule::ALL[..FusedTargets::MAX]).unwrap();
    let mut col = 0;
    for (t, m) in most.targets().iter().zip(&LoraModule::ALL[..FusedTargets::MAX]) {
        assert_eq!((t.module, t.y_col_offset), (*m, col));
        assert_eq!(most.offset_of(*m), Some(col));
        col += m.dims(&cfg).0;
    }
    assert_eq!(most.width(), col);
    let qkv = [LoraModule::QProj, LoraModule::KProj, LoraModule::VProj];
    assert_eq!(FusedTargets::qkv(&cfg), FusedTargets::concat(&cfg, &qkv).unwrap());
    assert_eq!(FusedTargets::qkv(&cfg).offset_of(LoraModule::OProj), None);
    let gate_up = [LoraModule::GateProj, LoraModule::UpProj];
    assert_eq!(
        FusedTargets::gate_up(&cfg),
        FusedTargets::concat(&cfg, &gate_up).unwrap()
    );
}

#[test]
fn a_steps_adapter_ids_are_its_leases_and_zero_for_the_base_model() {
    let mut pool = pool();
    let (a, c) = (pool.acquire("a").unwrap(), pool.acquire("c").unwrap());
    for lease in [&a, &c] {
        assert_eq!(lease.adapter_id(), pool.slots()[lease.slot().index()].adapter_id());
        assert_ne!(lease.adapter_id(), 0);
    }
    let rows = [
        StepRow::Adapter(&a),
        StepRow::Base,
        StepRow::Adapter(&c),
        StepRow::Adapter(&a),
    ];
    let step = pool.decode_step(&rows, 6).unwrap();
    let want = [
        Some(a.adapter_id()),
        Some(0),
        Some(c.adapter_id()),
        Some(a.adapter_id()),
    ];
    assert_eq!((0..4).map(|i| step.adapter_id(i)).collect::<Vec<_>>(), want);
    assert_eq!(step.adapter_id(4), None, "padding rows are not requests");
    assert_eq!(step.requests().len(), 4);
    assert_eq!(step.held_slots(), [a.slot(), c.slot()]);

    let prefill = pool
        .prefill_step(&[seq(StepRow::Base, 2), seq(StepRow::Adapter(&c), 3)])
        .unwrap();
    assert_eq!(prefill.adapter_id(0), Some(0));
    assert_eq!(prefill.adapter_id(1), Some(c.adapter_id()));
    assert_eq!(prefill.adapter_id(2), None);
    assert_eq!(prefill.requests(), [RowSlot::Base, RowSlot::Slot(c.slot())]);
}

#[test]
fn step_slots_of_a_stale_step_are_refused() {
    let mut pool = pool();
    let (a, b) = (pool.acquire("a").unwrap(), pool.acquire("b").unwrap());
    let old = pool.decode_step(&[StepRow::Adapter(&a)], 1).unwrap();
    let new = pool
        .decode_step(&[StepRow::Adapter(&b), StepRow::Base, StepRow::Adapter(&a)], 5)
        .unwrap();
    assert!(matches!(
        pool.step_slots(&old),
        Err(PoolError::StaleStep { kind: StepKind::Decode })
    ));
    let slots = pool.step_slots(&new).unwrap();
    assert_eq!(slots.rows(), new.kernel_rows());
    assert_eq!(
        slots.buffer().download_range(0, slots.rows()).unwrap(),
        kernel_rows(new.requests(), &[1; 3], 5)
    );

    let p_old = pool.prefill_step(&[seq(StepRow::Adapter(&a), 2)]).unwrap();
    let p_new = pool
        .prefill_step(&[
            seq(StepRow::Adapter(&a), 2),
            seq(StepRow::Base, 1),
            seq(StepRow::Adapter(&b), 3),
        ])
        .unwrap();
    assert!(matches!(
        pool.step_slots(&p_old),
        Err(PoolError::StaleStep {
            kind: StepKind::Prefill
        })
    ));
    // One entry per prefill token: its sequence's slot.
    let slots = pool.step_slots(&p_new).unwrap();
    assert_eq!(slots.rows(), 6);
    assert_eq!(
        slots.buffer().download_range(0, 6).unwrap(),
        kernel_rows(p_new.requests(), &[2, 1, 3], 6)
    );
    // The decode step is still current: the kinds are separate.
    assert_eq!(pool.step_slots(&new).unwrap().rows(), 5);
}

/// The step rows a row list names: `None` the base model, `Some(k)` the
/// lease on adapter `k`.
fn rows_of<'l>(rows: &[Option<usize>], leases: &'l [SlotLease]) -> Vec<StepRow<'l>> {
    rows.iter()
        .map(|r| r.map_or(StepRow::Base, |k| StepRow::Adapter(&leases[k])))
        .collect()
}

/// The distinct slots `rows` name, in order of first use.
fn distinct_slots(rows: &[Option<usize>], leases: &[SlotLease]) -> Vec<SlotId> {
    let mut out = Vec::new();
    for k in rows.iter().flatten() {
        if !out.contains(&leases[*k].slot()) {
            out.push(leases[*k].slot());
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// For any rows over the loaded adapters and the base model, the steps
    /// name exactly those rows, each holds one lease on every slot it names
    /// while it lives, and dropping them gives every count back.
    #[test]
    fn steps_hold_exactly_the_slots_their_rows_name(
        rows in prop::collection::vec(prop::option::of(0..ADAPTERS.len()), 0..12),
        padding in 0usize..4,
        lens in prop::collection::vec(1usize..5, 12),
    ) {
        let mut pool = pool();
        let leases: Vec<SlotLease> = ADAPTERS.iter().map(|(name, _)| pool.acquire(name).unwrap()).collect();
        let before: HashMap<SlotId, u32> = pool.slot_ids().map(|s| (s, pool.ref_count(s))).collect();
        let step_rows = rows_of(&rows, &leases);
        let want: Vec<RowSlot> = rows
            .iter()
            .map(|r| r.map_or(RowSlot::Base, |k| RowSlot::Slot(leases[k].slot())))
            .collect();
        let named = distinct_slots(&rows, &leases);

        let n = rows.len() + padding;
        let decode = pool.decode_step(&step_rows, n).unwrap();
        prop_assert_eq!(decode.requests(), want.as_slice());
        prop_assert_eq!(decode.kernel_rows(), n);
        prop_assert_eq!(decode.held_slots(), named.clone());
        for (i, r) in rows.iter().enumerate() {
            prop_assert_eq!(decode.adapter_id(i), Some(r.map_or(0, |k| leases[k].adapter_id())));
        }
        prop_assert_eq!(decode.adapter_id(rows.len()), None);
        for s in pool.slot_ids() {
            let held = u32::from(named.contains(&s));
            prop_assert_eq!(pool.ref_count(s), before[&s] + held, "slot {} under the decode step", s);
            if held == 1 {
                prop_assert!(pool.ref_count(s) >= 1);
            }
        }
        let slots = pool.step_slots(&decode).unwrap();
        prop_assert_eq!(
            slots.buffer().download_range(0, n).unwrap(),
            kernel_rows(&want, &vec![1; want.len()], n)
        );

        // A prefill step of the same rows, alive beside the decode step.
        let lens = &lens[..rows.len()];
        let seqs: Vec<PrefillSeq<'_>> = step_rows.iter().zip(lens).map(|(r, len)| seq(*r, *len)).collect();
        let prefill = pool.prefill_step(&seqs).unwrap();
        prop_assert_eq!(prefill.requests(), want.as_slice());
        prop_assert_eq!(prefill.held_slots(), named.clone());
        let mut cu = vec![0];
        for len in lens {
            cu.push(cu.last().unwrap() + len);
        }
        prop_assert_eq!(prefill.cu_seqlens(), cu.as_slice());
        prop_assert_eq!(prefill.kernel_rows(), *cu.last().unwrap());
        for s in pool.slot_ids() {
            let held = u32::from(named.contains(&s));
            prop_assert_eq!(pool.ref_count(s), before[&s] + 2 * held, "slot {} under both steps", s);
        }
        pool.check_step(&decode).unwrap();

        drop(decode);
        for s in pool.slot_ids() {
            let held = u32::from(named.contains(&s));
            prop_assert_eq!(pool.ref_count(s), before[&s] + held, "slot {} under the prefill step", s);
        }
        drop(prefill);
        for s in pool.slot_ids() {
            prop_assert_eq!(pool.ref_count(s), before[&s], "slot {} after both steps", s);
        }
    }
}
