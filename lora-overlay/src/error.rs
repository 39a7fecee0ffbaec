//! Why an overlay could not be built, installed, applied or probed. Each
//! variant names the table, slot or argument at fault.

use lora_kernels::KernelError;
use lora_pool::PoolError;

/// The name the pool reports overlay failures under.
pub const COMPANION_NAME: &str = "token overlays";

/// An overlay operation that could not be done.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    /// The device failed (including running out of memory while staging).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The pool refused a call the probe made through it (a step, the
    /// embedding LoRA apply).
    #[error(transparent)]
    Pool(Box<PoolError>),
    /// The placement cannot cut the tables (a vocabulary that does not
    /// split over the vocab-parallel ranks, naming `vocab_size`).
    #[error(transparent)]
    Placement(#[from] lora_layout::PlacementError),
    /// A table does not have `vocab x hidden` elements.
    #[error("{table}: {len} elements, expected {vocab} x {hidden}")]
    TableSize {
        /// Which table (`embed_tokens`, `lm_head`, or the adapter's copy of one).
        table: &'static str,
        /// Its element count.
        len: usize,
        /// Rows expected.
        vocab: usize,
        /// Row width expected.
        hidden: usize,
    },
    /// Trainable rows whose length does not match their ids.
    #[error("{table}: {rows} trainable row elements for {ids} ids of width {hidden}")]
    RowCount {
        /// The table.
        table: &'static str,
        /// Row elements given.
        rows: usize,
        /// Ids given.
        ids: usize,
        /// Row width.
        hidden: usize,
    },
    /// The adapter's rows are not as wide as the served tables.
    #[error("the adapter's overlay rows are {got} wide, the served tables {hidden}")]
    Hidden {
        /// The adapter's width.
        got: usize,
        /// The served width.
        hidden: usize,
    },
    /// The vocabulary does not fit the kernels' `i32` ids and slot maps.
    #[error("a vocabulary of {vocab} rows does not fit an i32 slot map")]
    VocabTooLarge {
        /// The vocabulary.
        vocab: usize,
    },
    /// A base table the model needs is not among the tables given.
    #[error("the base tables have no {table} table")]
    MissingTable {
        /// The table.
        table: &'static str,
    },
    /// A served table lives on another device than the overlays.
    #[error("the served {table} table lives on {found}, the overlays on {expected}")]
    DeviceMismatch {
        /// The table.
        table: &'static str,
        /// Its device.
        found: String,
        /// The overlays' device.
        expected: String,
    },
    /// An overlay set with no slot.
    #[error("max_loras must be at least 1")]
    NoSlots,
    /// A slot index past the overlay tables.
    #[error("slot {slot} does not exist (max_loras {max_loras})")]
    NoSuchSlot {
        /// The slot asked for.
        slot: usize,
        /// Slots in the tables.
        max_loras: usize,
    },
    /// An lm_head overlay that needs the served BF16 head table, which a
    /// quantized head does not have.
    #[error("{what}: the lm_head is served quantized, so there is no BF16 head table to {purpose}")]
    QuantizedHead {
        /// The tensor or probe at fault.
        what: String,
        /// What the table was needed for.
        purpose: &'static str,
    },
    /// A call's arguments do not fit the overlays.
    #[error("{arg}: {reason}")]
    Argument {
        /// The argument.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A probe that cannot be answered.
    #[error("probe {name}: {reason}")]
    Probe {
        /// The probe key.
        name: String,
        /// Why.
        reason: String,
    },
}

impl From<OverlayError> for PoolError {
    /// Device failures stay typed ([`PoolError::Kernel`], e.g. out of
    /// memory); the rest are the companion's own errors.
    fn from(e: OverlayError) -> PoolError {
        match e {
            OverlayError::Kernel(k) => PoolError::Kernel(k),
            OverlayError::Pool(p) => *p,
            other => PoolError::Companion {
                companion: COMPANION_NAME,
                message: other.to_string(),
            },
        }
    }
}
