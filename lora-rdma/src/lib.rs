//! `lora-rdma`: land peer-staged adapters straight into a pool slot.
//!
//! A weight peer ([`peer`], the `lora-peer` binary) audits adapters, stages
//! their tensors in the slot element layout of the engine's `max_rank` and
//! rank (a tensor- or expert-parallel engine's request names its whole
//! placement, the vocab-parallel and fully-sharded options included, and
//! the peer stages only that rank's cut of each pair, by the rank's own
//! layout walk; a DoRA pair's magnitude with it), and serves a
//! manifest; the engine ([`land::Lander`]) checks the manifest against its
//! own audit and layout, lands every tensor over a
//! [`transport::Transport`] (RDMA READ under the `ibverbs` feature, or the
//! TCP transport that runs the same protocol), verifies checksums and hands
//! the images to the pool to publish: the same slot bytes the rank's disk
//! swap writes.
//!
//! Brief overview:
//! - [`wire`]: versioned, size-limited frames; [`protocol`]: the messages;
//!   [`manifest`]: the manifest and its all-or-nothing check;
//!   [`fingerprint`]: the model identity a manifest carries.
//! - [`stage`]: the peer's staged bytes and checksums; [`peer`]: the store
//!   and the server.
//! - [`transport`], [`tcp`], [`verbs`]: the engine's transports;
//!   [`land`]: the landing itself; [`swap`]: promotion of a pool slot from
//!   a peer; [`bench`](mod@bench): the landing-rate benchmark.
//!
//! ```
//! use std::path::Path;
//! use lora_audit::LoraOptions;
//! use lora_layout::ModelConfig;
//! use lora_rdma::land::{HostLanding, Lander};
//! use lora_rdma::peer::{Peer, PeerOptions, PeerStore, StoreOptions};
//! use lora_rdma::tcp::{TcpOptions, TcpTransport};
//!
//! let model = Path::new("../fixtures/llama");
//! let cfg = ModelConfig::from_file(&model.join("config.json"))?;
//! // The peer: audit at startup, stage on demand, serve on loopback.
//! let mut store = PeerStore::new(cfg.clone(), StoreOptions::default());
//! store.add_adapter("r8", &model.join("demo_r8_rslora")).map_err(|r| r.reason)?;
//! let peer = Peer::bind(store, "127.0.0.1:0", PeerOptions::default())?.spawn()?;
//! // The engine: check the manifest against its own audit, land, verify.
//! let opts = LoraOptions { max_rank: 16, ..LoraOptions::default() };
//! let lander = Lander::new(cfg, opts)?;
//! let mut transport = TcpTransport::connect(&peer.addr().to_string(), TcpOptions::default())?;
//! let mut target = HostLanding::new(lander.layout());
//! let landed = lander.land(&mut transport, "r8", &mut target)?;
//! assert_eq!(target.dense().pairs(), &landed.dense[..]);
//! // `landed.into_images(dense, experts)` (the target's images) goes to
//! // `LoraPool::publish_landed`.
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! What it must never do: let the peer choose where bytes go (landing
//! offsets are always computed locally from lora-layout), write past a
//! region, publish a slot whose bytes were not all landed and checked, or
//! serve bytes the peer did not stage.
//!
//! Device memory: RDMA lands in registered host memory (the image, through a
//! registered staging buffer), and the pool's publish copies it to the GPU.
//! A host with an RDMA NIC beside the GPU would register each pool slot's
//! device memory once as a dmabuf (`ibv_reg_dmabuf_mr` on the fd the CUDA
//! driver exports for the slot's range) and post every READ straight into
//! the victim slot's region, with no host bounce: the slot leaves service
//! before the first READ and a checksum kernel replaces the host check
//! ([`verbs`] has the whole shape). That needs a GPU and an RDMA NIC on one
//! host to test; neither exists where this is built, so this build does not
//! claim it.
//!
//! Rate: over TCP the landing runs at about the rate of a plain socket copy
//! of the same bytes on the same host (`cargo xtask bench`'s `landing`
//! section measures both in one run). What it took: the landing images are
//! advised onto transparent huge pages before the first byte lands, and on
//! a host with cores to spare a helper thread faults them in ahead of the
//! bytes (first-touch faults otherwise cost as much as the copy); parts are
//! checked as they land on a host of few cores, in parallel after the read
//! on others ([`land::LandingTuning`]); the peer sends each large data
//! frame with its header in one vectored write, and neither side sets a
//! socket timeout before every read or write.

pub mod bench;
pub mod checksum;
pub mod fingerprint;
pub mod land;
pub mod manifest;
pub mod peer;
pub mod protocol;
pub mod stage;
pub mod swap;
pub mod tcp;
pub mod transport;
pub mod verbs;
pub mod wire;

#[cfg(test)]
mod test_support;
