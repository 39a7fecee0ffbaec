//! The engine's whole peer swap on a [`LoraPool`]: make an adapter resident
//! by landing it from a weight peer into the slot the promotion cache picks,
//! then lease it.
//!
//! The pool is touched twice only: to pick the victim (a read) and to
//! publish the landed, verified images (its one-step publish). Any failure
//! before the publish leaves every slot as it was.

use lora_pool::{LoraPool, PoolError, SlotCompanion, SlotLease, SwapReport};

use crate::land::{HostLanding, LandError, Lander};
use crate::transport::Transport;

/// Why a peer promotion failed; the pool is unchanged.
#[derive(Debug, thiserror::Error)]
pub enum PeerSwapError {
    /// Landing from the peer failed.
    #[error(transparent)]
    Land(#[from] LandError),
    /// The pool refused (full, not rotatable, slot in use, no expert pool).
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// Make `name` resident and lease it: its slot if it is already there;
/// else [`swap_from_peer`] into the promotion victim.
pub fn promote_from_peer<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    transport: &mut dyn Transport,
    name: &str,
) -> Result<SlotLease, PeerSwapError> {
    if pool.slot_of(name).is_none() {
        let mut target = HostLanding::new(pool.layout());
        swap_from_peer(pool, transport, name, &mut target)?;
    }
    Ok(pool.acquire(name)?)
}

/// Land `name` from the peer behind `transport` through `target`'s images,
/// checked against the pool's own model and limits, and publish them into
/// the slot the promotion cache picks. `target` is left fresh and zeroed
/// whatever happens; on error no slot changed.
pub fn swap_from_peer<C: SlotCompanion>(
    pool: &mut LoraPool<C>,
    transport: &mut dyn Transport,
    name: &str,
    target: &mut HostLanding,
) -> Result<SwapReport, PeerSwapError> {
    let lander = Lander::new(pool.config().clone(), pool.options().clone())?;
    let victim = pool.pick_victim(name)?;
    let landed = lander.land(transport, name, target)?;
    let (dense, experts) = std::mem::replace(target, HostLanding::new(lander.layout())).into_images();
    Ok(pool.publish_landed(victim, name, landed.into_images(dense, experts))?)
}
