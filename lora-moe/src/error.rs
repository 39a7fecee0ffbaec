//! Why an MoE LoRA call failed. Every variant is raised before any launch:
//! a failed call leaves the device buffers it would have written as they were.

use lora_audit::AuditError;
use lora_kernels::KernelError;
use lora_layout::{RouteRefused, SeqLensError};
use lora_pool::PoolError;

/// An MoE LoRA call that could not be done.
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    /// The base model has no routed experts.
    #[error("the model has no routed experts (model_type {model_type})")]
    NotMoe {
        /// The model's `model_type`.
        model_type: &'static str,
    },
    /// A layer that does not run routed experts.
    #[error("layer {layer} does not run routed experts")]
    NotMoeLayer {
        /// The layer asked for.
        layer: usize,
    },
    /// A request whose route is `Refuse`: the batch is refused before launch.
    #[error(transparent)]
    Refused(#[from] RouteRefused),
    /// A request names a slot that does not exist.
    #[error("row {row}: slot {slot} does not exist (max_loras {max_loras})")]
    NoSuchSlot {
        /// The request.
        row: usize,
        /// The slot it names.
        slot: usize,
        /// Slots in the pool.
        max_loras: usize,
    },
    /// A request names a slot that holds no adapter.
    #[error("row {row}: slot {slot} holds no adapter")]
    EmptySlot {
        /// The request.
        row: usize,
        /// The slot it names.
        slot: usize,
    },
    /// The pool refused the step (stale, another pool's) or its rows.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A malformed `cu_seqlens`.
    #[error(transparent)]
    SeqLens(#[from] SeqLensError),
    /// A batch larger than the scratch was sized for.
    #[error("{what}: {got} exceeds the capacity of {capacity}")]
    BatchTooLarge {
        /// Tokens, expanded rows or sorted rows.
        what: &'static str,
        /// Requested.
        got: usize,
        /// What the scratch holds.
        capacity: usize,
    },
    /// An argument whose shape does not fit the call.
    #[error("{arg}: {reason}")]
    Shape {
        /// The argument.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An apply call without the batch or expert index it needs.
    #[error("{call}: {reason}")]
    NotRouted {
        /// The call.
        call: &'static str,
        /// What is missing.
        reason: String,
    },
    /// The pool is not the one (or not shaped like the one) the scratch was
    /// sized for.
    #[error("pool mismatch: {0}")]
    PoolMismatch(String),
    /// A host routing table (`topk_ids`, offsets) with an impossible value.
    #[error("{arg}[{position}] = {value}: {reason}")]
    Routing {
        /// The table.
        arg: &'static str,
        /// The offending position.
        position: usize,
        /// Its value.
        value: i64,
        /// Why it is impossible.
        reason: &'static str,
    },
    /// A probe that cannot be answered.
    #[error("probe `{name}`: {reason}")]
    Probe {
        /// The probe key.
        name: String,
        /// Why.
        reason: String,
    },
    /// A weight name the audit could not parse.
    #[error(transparent)]
    Audit(#[from] AuditError),
    /// The device failed or refused a launch.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

impl MoeError {
    pub(crate) fn shape(arg: &'static str, reason: impl Into<String>) -> MoeError {
        MoeError::Shape {
            arg,
            reason: reason.into(),
        }
    }
}
