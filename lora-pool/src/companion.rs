//! Per-slot state that lives beside the pool and must change with it (token
//! overlays). The pool drives it through the same two phases as its own
//! slots: `stage` may fail and touches nothing live; `commit` only makes
//! staged state live.

use lora_audit::HostOverlay;

use crate::error::PoolError;

/// State kept per pool slot outside the pool's own buffers.
pub trait SlotCompanion {
    /// What [`SlotCompanion::stage`] builds for one adapter.
    type Staged;

    /// The companion's name, for errors.
    fn name(&self) -> &'static str;

    /// Build everything adapter `name` needs for its token overlays
    /// (allocating new device memory as required) without changing any live
    /// slot. An error leaves the companion as it was.
    fn stage(&mut self, name: &str, overlay: &HostOverlay) -> Result<Self::Staged, PoolError>;

    /// Make `staged` the live state of `slot`, replacing what it had.
    fn commit(&mut self, slot: usize, staged: Self::Staged) -> Result<(), PoolError>;

    /// Drop `slot`'s state: the slot was emptied.
    fn clear(&mut self, slot: usize) -> Result<(), PoolError>;
}

/// The companion of a pool with no per-slot state beside its own. It
/// refuses adapters with token overlays, since nothing would serve them.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoCompanion;

impl SlotCompanion for NoCompanion {
    type Staged = ();

    fn name(&self) -> &'static str {
        "token overlays"
    }

    fn stage(&mut self, name: &str, overlay: &HostOverlay) -> Result<(), PoolError> {
        if overlay.is_empty() {
            Ok(())
        } else {
            Err(PoolError::Companion {
                companion: self.name(),
                message: format!(
                    "adapter `{}` carries token overlays (trainable tokens or saved embedding/lm_head rows) \
                     and this pool has no overlay companion (lora-overlay) to serve them",
                    name
                ),
            })
        }
    }

    fn commit(&mut self, _slot: usize, _staged: ()) -> Result<(), PoolError> {
        Ok(())
    }

    fn clear(&mut self, _slot: usize) -> Result<(), PoolError> {
        Ok(())
    }
}
