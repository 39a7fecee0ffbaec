//! Why a pool operation failed. Every failure before publish leaves every
//! slot as it was; the variants say which input or limit was at fault.

use lora_audit::AuditError;
use lora_kernels::KernelError;
use lora_layout::{LayoutError, RefuseReason, VictimError};

use crate::image::ImageError;
use crate::slot::SlotId;
use crate::step::StepKind;

/// A pool operation that could not be done.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The adapter could not be read, or the audit refused it.
    #[error("adapter `{adapter}`: {source}")]
    Audit {
        /// The adapter's name.
        adapter: String,
        /// The audit's error (a refusal carries the full report).
        #[source]
        source: Box<AuditError>,
    },
    /// The adapter's pairs do not fit the slot layout.
    #[error("adapter `{adapter}`: {source}")]
    Image {
        /// The adapter's name.
        adapter: String,
        /// What did not fit.
        #[source]
        source: ImageError,
    },
    /// A layout size could not be computed, or the tensor-parallel
    /// placement does not divide the model's geometry.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Routed-expert and router deltas with a tensor-parallel placement and
    /// no expert parallelism: the expert pool holds whole experts only
    /// (experts cut by tensor parallelism are not built), so a rank would
    /// fold deltas onto outputs it does not have.
    #[error(
        "LORA_EXPERTS with LORA_TP_WORLD={tp_world} and LORA_EP_WORLD=1: experts are placed by expert parallelism only, never cut across tensor-parallel ranks"
    )]
    ExpertsUnderTensorParallel {
        /// The world size.
        tp_world: usize,
    },
    /// DoRA on a tensor- or expert-parallel rank's pool: the rescale
    /// divides by the norm of each whole weight row `‖W + s·B A‖`, whose
    /// input columns a row-parallel rank does not hold, and a per-rank
    /// rescale is not built; DoRA is served by unplaced pools only.
    #[error(
        "LORA_DORA on a placed pool (tp_world {tp_world}, ep_world {ep_world}): DoRA is served only with tensor and expert world 1"
    )]
    DoraPlaced {
        /// The tensor-parallel world size.
        tp_world: usize,
        /// The expert-parallel world size.
        ep_world: usize,
    },
    /// The device failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The pool does not fit in the device's free memory.
    #[error("the pool needs {needed} bytes of device memory, {free} are free")]
    OutOfMemory {
        /// Bytes the pool would allocate.
        needed: usize,
        /// Bytes the device reports free.
        free: usize,
    },
    /// More startup adapters than slots.
    #[error("{adapters} adapters do not fit {max_loras} slots")]
    TooManyAdapters {
        /// Adapters given.
        adapters: usize,
        /// Slots.
        max_loras: usize,
    },
    /// Two adapters share a name.
    #[error("adapter name `{0}` is already resident in another slot")]
    DuplicateName(String),
    /// An adapter name is empty (the empty name marks a placeholder).
    #[error("an adapter name must not be empty")]
    EmptyName,
    /// A slot index past the pool.
    #[error("slot {slot} does not exist (max_loras {max_loras})")]
    NoSuchSlot {
        /// The slot asked for.
        slot: usize,
        /// Slots in the pool.
        max_loras: usize,
    },
    /// A slot still serves requests (a lease, or a step naming it).
    #[error("slot {slot} is held by {leases} lease(s) of running requests or steps")]
    SlotInUse {
        /// The slot.
        slot: SlotId,
        /// Live leases.
        leases: u32,
    },
    /// A swap begun with [`crate::LoraPool::begin_swap`] is still landing:
    /// finish it ([`crate::LoraPool::finish_swap`]) before the next swap,
    /// eviction or landing.
    #[error("a swap into slot {slot} is still landing; finish it first")]
    SwapPending {
        /// The slot the pending swap writes.
        slot: SlotId,
    },
    /// The swap path cut a staging chunk into parts that do not tile it
    /// (an internal error: nothing was read or copied).
    #[error("staging chunk {chunk}: part {start}..{end} is outside the chunk or overlaps another")]
    StagingParts {
        /// The chunk.
        chunk: usize,
        /// The part's first byte.
        start: usize,
        /// The part's end.
        end: usize,
    },
    /// [`crate::LoraPool::finish_swap`] with no swap begun.
    #[error("no swap is pending")]
    NoPendingSwap,
    /// A slot is pinned and promotion may not evict it.
    #[error("slot {0} is pinned")]
    Pinned(usize),
    /// Every promotion candidate is in use.
    #[error("cannot promote `{adapter}`: {source}")]
    PoolFull {
        /// The adapter to promote.
        adapter: String,
        /// The victim selection's verdict.
        #[source]
        source: VictimError,
    },
    /// No slot holds the adapter.
    #[error("adapter `{0}` is not resident")]
    NotResident(String),
    /// A step row names a slot that holds no adapter, or whose last write
    /// failed part way.
    #[error("{} {row} names slot {slot}, which holds no servable adapter", kind.entry())]
    EmptySlot {
        /// Decode (rows) or prefill (sequences).
        kind: StepKind,
        /// The row or sequence.
        row: usize,
        /// The slot.
        slot: SlotId,
    },
    /// A step row's lease is from another pool.
    #[error("{} {row}: the lease was taken from another pool", kind.entry())]
    ForeignLease {
        /// Decode (rows) or prefill (sequences).
        kind: StepKind,
        /// The row or sequence.
        row: usize,
    },
    /// A lease names an adapter identity its slot no longer has.
    #[error("{} {row}: the lease on slot {slot} names an adapter the slot no longer serves", kind.entry())]
    StaleLease {
        /// Decode (rows) or prefill (sequences).
        kind: StepKind,
        /// The row or sequence.
        row: usize,
        /// The slot.
        slot: SlotId,
    },
    /// A step row's MoE deltas cannot be applied.
    #[error("{} {row}: its adapter's MoE deltas cannot be served ({reason:?})", kind.entry())]
    RouteRefused {
        /// Decode (rows) or prefill (sequences).
        kind: StepKind,
        /// The row or sequence.
        row: usize,
        /// Why.
        reason: RefuseReason,
    },
    /// An apply call was given a step that is not the pool's latest of its
    /// kind (or is another pool's).
    #[error("the {kind} step is not this pool's current {kind} step")]
    StaleStep {
        /// Decode or prefill.
        kind: StepKind,
    },
    /// A one-adapter apply was given a step that mixes adapters.
    #[error("the prefill step mixes adapters: a one-adapter apply needs every sequence on one slot")]
    NotOneAdapter,
    /// More targets than one launch serves.
    #[error("{got} targets in one apply call: from 1 to {max} are served")]
    TooManyTargets {
        /// Targets given.
        got: usize,
        /// The most one launch serves.
        max: usize,
    },
    /// Runtime swaps are switched off.
    #[error("runtime swaps are disabled: set LoraOptions::rotatable (LORA_ROTATE=1 or LORA_PEER)")]
    NotRotatable,
    /// The adapter has expert or router deltas and the pool has no expert pool.
    #[error("adapter `{0}` has expert/router deltas and this pool serves none (experts disabled or a dense model)")]
    NoExpertPool(String),
    /// The adapter's expert pairs exceed an expert slot.
    #[error("adapter `{adapter}` needs {needed} bytes of expert pool, a slot holds {capacity}")]
    ExpertSlotTooSmall {
        /// The adapter.
        adapter: String,
        /// Bytes it needs.
        needed: usize,
        /// Bytes a slot holds.
        capacity: usize,
    },
    /// A batch is larger than the pool's routing buffers.
    #[error("{what}: {got} exceeds the pool's capacity of {capacity}")]
    BatchTooLarge {
        /// Rows or segments.
        what: &'static str,
        /// Requested.
        got: usize,
        /// Capacity.
        capacity: usize,
    },
    /// A batch description is malformed.
    #[error("batch: {0}")]
    Batch(String),
    /// A module whose A holds only the rank's block of rank rows (the
    /// fully-sharded option) given to an apply that runs the whole rank on
    /// one rank, or a module whose A is whole given to the fully-sharded
    /// apply.
    #[error("layer {layer} {module}: {reason}")]
    RankSplit {
        /// The layer.
        layer: usize,
        /// The module.
        module: lora_layout::LoraModule,
        /// Which apply serves it.
        reason: &'static str,
    },
    /// A [`crate::RankGather`]'s communicator failed (its own words).
    #[error("all-gather: {0}")]
    Gather(String),
    /// The gather given to the fully-sharded apply is not the pool's
    /// tensor-parallel group.
    #[error("a gather of rank {rank} of {world} for a pool of tensor-parallel rank {tp_rank} of {tp_world}")]
    GatherGroup {
        /// The gather's rank.
        rank: usize,
        /// The gather's world size.
        world: usize,
        /// The pool's rank.
        tp_rank: usize,
        /// The pool's world size.
        tp_world: usize,
    },
    /// Base weights given to a pool not built for DoRA.
    #[error("this pool is not built for DoRA (LoraOptions::dora, LORA_DORA=1): it takes no base weights")]
    DoraDisabled,
    /// New base weights while slots serve DoRA rescales computed from the
    /// old ones: evict or swap those slots first.
    #[error("{dora_slots} slot(s) serve DoRA rescales computed from the current base weights")]
    BaseWeightsInUse {
        /// Slots holding DoRA pairs.
        dora_slots: usize,
    },
    /// A base projection the engine gave does not fit the model.
    #[error("base weights of layer {layer} {module}: {reason}")]
    BaseWeights {
        /// The layer.
        layer: usize,
        /// The module.
        module: lora_layout::LoraModule,
        /// What does not fit.
        reason: String,
    },
    /// A module asked of a layer that does not have it.
    #[error("layer {layer} has no {module}")]
    NoSuchModule {
        /// The layer.
        layer: usize,
        /// The module.
        module: lora_layout::LoraModule,
    },
    /// A slot companion (e.g. token overlays) failed.
    #[error("{companion}: {message}")]
    Companion {
        /// The companion's name.
        companion: &'static str,
        /// What failed.
        message: String,
    },
    /// The swap path's reader threads could not be started.
    #[error("cannot start {threads} staging reader threads: {message}")]
    StagingThreads {
        /// Threads asked for.
        threads: usize,
        /// The thread pool's error.
        message: String,
    },
    /// The host tier cannot hold an image, or the pool has none.
    #[error(transparent)]
    HostTier(#[from] crate::host_tier::TierError),
    /// The prefetch worker is gone (it panicked); the pool still swaps
    /// from disk.
    #[error("the prefetch worker has stopped")]
    PrefetchStopped,
}

impl PoolError {
    /// A refusal's stable codes (`REJECT[...]`), if the audit refused.
    pub fn refusal_codes(&self) -> Vec<&'static str> {
        match self {
            PoolError::Audit { source, .. } => match source.as_ref() {
                AuditError::Refused(report) => report.refused_codes().into_iter().map(|c| c.as_str()).collect(),
                AuditError::ConfigRefused(refusals) => refusals.iter().map(|r| r.code.as_str()).collect(),
                _ => Vec::new(),
            },
            _ => Vec::new(),
        }
    }
}
