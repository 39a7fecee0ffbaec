//! Two back-to-back disk swaps behind a busy stream (CUDA): the second
//! swap refills the pinned staging chunks while the first swap's copies
//! from them may still be queued. Each slot must still hold exactly its own
//! adapter, bit for bit (compared with a CPU pool that loaded them
//! directly), on both staging routes.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;

use common::{dir, model_config, options, queue_busy_work, slot};
use lora_kernels::Device;
use lora_kernels::testing::cuda_or_skip;
use lora_pool::{AdapterSource, BatchCapacity, LoraPool, StagingTuning};

/// The slot contents of a CPU pool loaded with `adapters` in slots `0..`.
fn reference(adapters: &[(&str, PathBuf)]) -> Vec<Vec<half::bf16>> {
    let sources: Vec<AdapterSource<'_>> = adapters.iter().map(|(name, dir)| AdapterSource { name, dir }).collect();
    let pool = LoraPool::load(
        &Device::cpu(),
        model_config("llama"),
        options(3, 0),
        BatchCapacity::default(),
        &sources,
    )
    .unwrap();
    (0..adapters.len())
        .map(|i| pool.slot_contents(slot(i)).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn back_to_back_swaps_behind_a_busy_stream_keep_each_slots_bytes_on_cuda() {
    let Some(device) = cuda_or_skip("back_to_back_swaps_behind_a_busy_stream_keep_each_slots_bytes_on_cuda") else {
        return;
    };
    let (a, b) = (dir("demo_r4_plain"), dir("rslora"));
    let want = reference(&[("x", dir("demo_r8_rslora")), ("a", a.clone()), ("b", b.clone())]);
    for device_repack in [false, true] {
        let seed = dir("demo_r8_rslora");
        let sources = [AdapterSource { name: "x", dir: &seed }];
        let mut pool = LoraPool::load(
            &device,
            model_config("llama"),
            options(3, 0),
            BatchCapacity::default(),
            &sources,
        )
        .unwrap();
        pool.tune_staging(StagingTuning {
            device_repack,
            // Small chunks: many of them, each reused by the second swap.
            chunk_bytes: 4 << 10,
            ..StagingTuning::default()
        })
        .unwrap();
        for round in 0..4 {
            queue_busy_work(&device);
            pool.swap_from_disk(slot(1), &format!("a{round}"), &a).unwrap();
            pool.swap_from_disk(slot(2), &format!("b{round}"), &b).unwrap();
            for (i, expected) in want.iter().enumerate() {
                assert!(
                    pool.slot_contents(slot(i)).unwrap() == *expected,
                    "slot {i} differs after round {round} (device_repack {device_repack})"
                );
            }
        }
    }
}
