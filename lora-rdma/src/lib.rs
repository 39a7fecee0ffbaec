//! `lora-rdma`: land peer-staged adapters straight into a pool slot.
//!
//! A weight peer ([`peer`], the `lora-peer` binary) audits adapters, stages
//! their tensors in the slot element layout of the engine's `max_rank`, and
//! serves a manifest; the engine ([`land::Lander`]) checks the manifest
//! against its own audit and layout, lands every tensor over a
//! [`transport::Transport`] (RDMA READ under the `ibverbs` feature, or the
//! TCP transport that runs the same protocol), verifies checksums and hands
//! the images to the pool to publish.
//!
//! Brief overview:
//! - [`wire`]: versioned, size-limited frames; [`protocol`]: the messages;
//!   [`manifest`]: the manifest and its all-or-nothing check;
//!   [`fingerprint`]: the model identity a manifest carries.
//! - [`stage`]: the peer's staged bytes and checksums; [`peer`]: the store
//!   and the server.
//! - [`transport`], [`tcp`], [`verbs`]: the engine's transports;
//!   [`land`]: the landing itself; [`bench`]: the landing-rate benchmark.
//!
//! What it must never do: let the peer choose where bytes go (landing
//! offsets are always computed locally from lora-layout), write past a
//! region, publish a slot whose bytes were not all landed and checked, or
//! serve bytes the peer did not stage.
//!
//! Device memory: RDMA lands in registered host memory (the image, through a
//! registered staging buffer), and the pool's publish copies it to the GPU.
//! Landing straight into GPU memory through dmabuf (`ibv_reg_dmabuf_mr`)
//! needs a GPU and an RDMA NIC on one host to test; neither exists where
//! this is built, so this build does not claim it.

pub mod bench;
pub mod checksum;
pub mod fingerprint;
pub mod land;
pub mod manifest;
pub mod peer;
pub mod protocol;
pub mod stage;
pub mod tcp;
pub mod transport;
pub mod verbs;
pub mod wire;

#[cfg(test)]
mod test_support;
