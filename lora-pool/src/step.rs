//! Steps: the only way rows reach the kernels.
//!
//! A [`DecodeStep`] (one row per request) or [`PrefillStep`] (one segment
//! per sequence) is built by the pool from what the requests hold: a
//! [`SlotLease`] per adapted request, or [`StepRow::Base`]. The step keeps a
//! lease on every slot it names until it is dropped, so while it lives no
//! eviction, disk swap, peer landing or promotion can change what those
//! slots serve (each is refused with [`PoolError::SlotInUse`]). It also
//! carries what every other part of the forward pass needs about its rows —
//! each row's adapter identity hash (for prefix and KV caches) and MoE
//! route — so an engine cannot mix one step's rows with another's.
//!
//! Every apply call takes the step, and the pool refuses a step that is not
//! its latest of that kind ([`PoolError::StaleStep`]): the device row
//! buffers hold exactly the rows of the step passed in.
//!
//! [`PoolError::SlotInUse`]: crate::PoolError::SlotInUse
//! [`PoolError::StaleStep`]: crate::PoolError::StaleStep

use lora_kernels::DeviceBuffer;
use lora_layout::MoeLoraRoute;

use crate::lease::SlotLease;
use crate::slot::{RowSlot, SlotId};

/// One row (decode) or sequence (prefill) of a step, as the engine states
/// it: the request's lease, or the base model, explicitly.
#[derive(Debug, Clone, Copy)]
pub enum StepRow<'l> {
    /// The base model: no delta, no overlay, no MoE fold.
    Base,
    /// The adapter the request holds a lease on.
    Adapter(&'l SlotLease),
}

/// One sequence of a prefill step: its adapter and its number of tokens.
#[derive(Debug, Clone, Copy)]
pub struct PrefillSeq<'l> {
    /// The sequence's adapter.
    pub row: StepRow<'l>,
    /// Tokens of the sequence in this step (at least 1).
    pub len: usize,
}

/// Which kind of step, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// A decode step.
    Decode,
    /// A prefill step.
    Prefill,
}

impl StepKind {
    /// What one entry of such a step is: a decode row, a prefill sequence.
    pub fn entry(self) -> &'static str {
        match self {
            StepKind::Decode => "row",
            StepKind::Prefill => "sequence",
        }
    }
}

impl std::fmt::Display for StepKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StepKind::Decode => "decode",
            StepKind::Prefill => "prefill",
        })
    }
}

/// What every step holds: which pool and which step it is, its rows'
/// resolution, and one lease per distinct slot it names.
#[derive(Debug)]
pub struct StepRows {
    pub(crate) pool: u64,
    pub(crate) id: u64,
    pub(crate) rows: Vec<RowSlot>,
    pub(crate) adapter_ids: Vec<u64>,
    pub(crate) routes: Vec<MoeLoraRoute>,
    pub(crate) leases: Vec<SlotLease>,
}

impl StepRows {
    pub(crate) fn slots(&self) -> impl Iterator<Item = SlotId> + '_ {
        self.leases.iter().map(SlotLease::slot)
    }
}

/// The rows of one decode batch, each holding its adapter. Built by
/// [`LoraPool::decode_step`](crate::LoraPool::decode_step).
#[derive(Debug)]
pub struct DecodeStep {
    pub(crate) rows: StepRows,
    pub(crate) padded_rows: usize,
}

/// The segments of one prefill batch, each holding its adapter. Built by
/// [`LoraPool::prefill_step`](crate::LoraPool::prefill_step).
#[derive(Debug)]
pub struct PrefillStep {
    pub(crate) rows: StepRows,
    pub(crate) cu_seqlens: Vec<usize>,
}

/// Which step of which pool: equal only for the same step. Parts of the
/// forward pass that keep per-step state (the MoE rows) record it when set
/// and refuse any other step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StepId {
    pool: u64,
    step: u64,
}

/// What both kinds of step answer.
pub trait Step: sealed::Sealed {
    /// Decode or prefill.
    fn kind(&self) -> StepKind;

    /// This step's identity.
    fn id(&self) -> StepId {
        let rows = sealed::Sealed::step_rows(self);
        StepId {
            pool: rows.pool,
            step: rows.id,
        }
    }

    /// The adapter of each request (decode rows or prefill sequences), in
    /// order; padding rows are not included.
    fn requests(&self) -> &[RowSlot] {
        &sealed::Sealed::step_rows(self).rows
    }

    /// The adapter identity hash of request `i` (0: the base model), the
    /// key for prefix and KV caches; `None` past the requests.
    fn adapter_id(&self, i: usize) -> Option<u64> {
        sealed::Sealed::step_rows(self).adapter_ids.get(i).copied()
    }

    /// The MoE route of each request (`Fold` or `Skip`: a step with a
    /// `Refuse` route is never built).
    fn moe_routes(&self) -> &[MoeLoraRoute] {
        &sealed::Sealed::step_rows(self).routes
    }

    /// The distinct slots the step names, each held until the step drops.
    fn held_slots(&self) -> Vec<SlotId> {
        sealed::Sealed::step_rows(self).slots().collect()
    }

    /// Rows the kernels see: padded decode rows, or prefill tokens.
    fn kernel_rows(&self) -> usize;
}

impl Step for DecodeStep {
    fn kind(&self) -> StepKind {
        StepKind::Decode
    }
    fn kernel_rows(&self) -> usize {
        self.padded_rows
    }
}

impl Step for PrefillStep {
    fn kind(&self) -> StepKind {
        StepKind::Prefill
    }
    fn kernel_rows(&self) -> usize {
        self.cu_seqlens.last().copied().unwrap_or(0)
    }
}

impl DecodeStep {
    /// Rows of the batch, padding included (the kernels' row count).
    pub fn padded_rows(&self) -> usize {
        self.padded_rows
    }
}

impl PrefillStep {
    /// The `[n + 1]` prefix sum of the sequences' token counts.
    pub fn cu_seqlens(&self) -> &[usize] {
        &self.cu_seqlens
    }

    /// The one slot every sequence runs with, if they all run the same
    /// adapter (the one-adapter prefill).
    pub fn one_adapter(&self) -> Option<SlotId> {
        let first = self.rows.rows.first()?.slot()?;
        self.rows
            .rows
            .iter()
            .all(|r| *r == RowSlot::Slot(first))
            .then_some(first)
    }
}

/// The device row map of the pool's current step (`i32` per kernel row:
/// the slot, or `-1` for the base model and padding), for companion
/// kernels such as token overlays. Only the pool hands one out, for its
/// current step, so it always matches the step it was asked for.
#[derive(Debug, Clone, Copy)]
pub struct StepSlots<'p> {
    pub(crate) buffer: &'p DeviceBuffer<i32>,
    pub(crate) rows: usize,
}

impl<'p> StepSlots<'p> {
    /// The per-row slot buffer (its address never changes).
    pub fn buffer(&self) -> &'p DeviceBuffer<i32> {
        self.buffer
    }

    /// Rows it describes.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

pub(crate) mod sealed {
    use super::StepRows;

    /// Only this crate's steps are steps.
    pub trait Sealed {
        fn step_rows(&self) -> &StepRows;
    }
    impl Sealed for super::DecodeStep {
        fn step_rows(&self) -> &StepRows {
            &self.rows
        }
    }
    impl Sealed for super::PrefillStep {
        fn step_rows(&self) -> &StepRows {
            &self.rows
        }
    }
}
