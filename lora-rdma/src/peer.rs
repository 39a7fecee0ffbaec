//! The weight peer: audits adapters at startup, stages them lazily per
//! requested geometry, and serves manifests and bounded reads.
//!
//! It only ever sends bytes it staged: a read of an unknown region, or one
//! leaving its region, is a refusal frame, never data. Staged memory is
//! registered for remote read only when the peer serves RDMA.

mod server;
mod store;

pub use server::{Peer, PeerFault, PeerHandle, PeerOptions};
pub use store::{PeerStore, RefusedAdapter, StoreOptions};
