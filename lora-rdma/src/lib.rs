//! `lora-rdma`: land peer-staged adapters straight into a pool slot.
//!
//! A weight peer audits adapters, stages their tensors in the slot element
//! layout of the engine's `max_rank`, and serves a manifest; the engine
//! checks the manifest against its own audit and layout, lands every tensor
//! (RDMA READ, or the TCP transport that runs the same protocol), verifies
//! checksums and publishes the slot.
//!
//! What it must never do: let the peer choose where bytes go (landing
//! offsets are always computed locally from lora-layout), write past a
//! region, or publish a slot whose bytes were not all landed and checked.

pub mod checksum;
pub mod manifest;
pub mod wire;
