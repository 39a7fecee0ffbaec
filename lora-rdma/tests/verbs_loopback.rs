//! RDMA READ landing on loopback: the peer process serves RDMA from the
//! device `LORA_RDMA_DEVICE` names (soft-RoCE `rxe0` works), the engine
//! lands over a queue pair on the same device, and the images equal the
//! disk pack byte for byte. Ignored unless `LORA_RDMA_DEVICE` was set when
//! the tests were built (see `build.rs`).

#![cfg(feature = "ibverbs")]
#![allow(clippy::unwrap_used)]

mod common;

use common::{PeerProcess, model_config, packed_from_disk};
use lora_pool::LoraOptions;
use lora_rdma::land::{HostLanding, Lander};
use lora_rdma::verbs::{VerbsOptions, VerbsTransport};

#[test]
#[cfg_attr(
    not(lora_rdma_device),
    ignore = "needs an RDMA device: build and run with LORA_RDMA_DEVICE=<device>"
)]
fn adapters_land_by_rdma_read_as_from_disk() {
    let device = std::env::var("LORA_RDMA_DEVICE").unwrap();
    let adapters = ["demo_r4_plain", "demo_r16_alpha_pattern"];
    let peer = PeerProcess::spawn("llama", &adapters, &["--rdma-device", &device]);
    let opts = LoraOptions {
        max_rank: 16,
        ..LoraOptions::default()
    };
    let lander = Lander::new(model_config("llama"), opts.clone()).unwrap();
    let mut options = VerbsOptions::new(&device);
    // A small staging buffer makes the landing take several batches.
    options.staging_bytes = 16 << 10;
    let mut transport = VerbsTransport::connect(&peer.addr, &options).unwrap();
    for adapter in adapters {
        let mut target = HostLanding::new(lander.layout());
        lander.land(&mut transport, adapter, &mut target).unwrap();
        let (dense, _) = packed_from_disk("llama", adapter, &opts);
        assert_eq!(target.dense().as_bytes(), dense.as_bytes(), "{adapter}");
        assert_eq!(target.dense().pairs(), dense.pairs(), "{adapter}");
    }
}
