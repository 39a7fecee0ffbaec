//! Fixture access shared by the pool's integration tests: the PEFT fixtures
//! under `fixtures/` and their oracles (PEFT's own merged weights), and
//! CPU pools loaded from the llama fixtures.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use half::bf16;
use lora_audit::Oracle;
use lora_kernels::{Device, PairEntry};
use lora_layout::{LoraModule, ModelConfig};
use lora_pool::{AdapterSlot, AdapterSource, BatchCapacity, LoraOptions, LoraPool, SlotId};

pub mod placed;

/// `fixtures/` at the workspace root.
/// (`LORA_FIXTURES_DIR` when set: the GPU bundle carries them elsewhere.)
pub fn fixtures() -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
}

/// The base model config of fixture model `model`.
pub fn model_config(model: &str) -> ModelConfig {
    ModelConfig::from_file(&fixtures().join(model).join("config.json")).unwrap()
}

/// `fixtures/<model>/<adapter>/oracle.safetensors`.
pub fn oracle(model: &str, adapter: &str) -> Oracle {
    lora_audit::read_oracle(&fixtures().join(model).join(adapter).join("oracle.safetensors")).unwrap()
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// ‖out − ref‖ / ‖ref‖, infinite on NaN or length mismatch.
pub fn rel_error(out: &[f32], reference: &[f32]) -> f64 {
    lora_kernels::testing::rel_error(out, reference)
}

/// The llama fixture adapter `adapter`'s directory.
pub fn dir(adapter: &str) -> PathBuf {
    fixtures().join("llama").join(adapter)
}

/// A rotatable pool's options: `max_loras` slots of rank 16, the first
/// `pinned` of them pinned.
pub fn options(max_loras: usize, pinned: usize) -> LoraOptions {
    LoraOptions {
        max_loras,
        max_rank: 16,
        pinned,
        rotatable: true,
        ..LoraOptions::default()
    }
}

/// A CPU pool on the llama fixture model holding `adapters` (name, fixture
/// adapter) in slots `0..`.
pub fn pool_with(opts: LoraOptions, adapters: &[(&str, &str)]) -> LoraPool {
    pool_with_capacity(opts, BatchCapacity::default(), adapters)
}

/// [`pool_with`] with routing buffers of `capacity`.
pub fn pool_with_capacity(opts: LoraOptions, capacity: BatchCapacity, adapters: &[(&str, &str)]) -> LoraPool {
    let dirs: Vec<PathBuf> = adapters.iter().map(|(_, a)| dir(a)).collect();
    let sources: Vec<AdapterSource<'_>> = adapters
        .iter()
        .zip(&dirs)
        .map(|((name, _), dir)| AdapterSource { name, dir })
        .collect();
    LoraPool::load(&Device::cpu(), model_config("llama"), opts, capacity, &sources).unwrap()
}

/// Everything a swap or eviction may change: every slot's bytes, every
/// table entry (the embedding's and the head's after the (layer, module)
/// tables), the slot registry.
#[derive(Debug, PartialEq)]
pub struct Snapshot {
    pub bytes: Vec<Vec<bf16>>,
    pub entries: Vec<PairEntry>,
    pub slots: Vec<AdapterSlot>,
}

pub fn snapshot(pool: &LoraPool) -> Snapshot {
    let cfg = pool.config();
    let mut entries = Vec::new();
    for layer in 0..cfg.num_hidden_layers {
        for module in LoraModule::ALL {
            for slot in pool.slot_ids() {
                if let Some(e) = pool.entry(layer, module, slot) {
                    entries.push(e);
                }
            }
        }
    }
    for slot in pool.slot_ids() {
        entries.extend(pool.embedding_entry(slot));
        entries.extend(pool.lm_head_entry(slot));
    }
    Snapshot {
        bytes: pool.slot_ids().map(|s| pool.slot_contents(s).unwrap()).collect(),
        entries,
        slots: pool.slots().to_vec(),
    }
}

/// Slot `i`.
pub fn slot(i: usize) -> SlotId {
    SlotId::new(i)
}

/// Keep the device's stream busy for a while (queued copies of 1 GiB).
pub fn queue_busy_work(device: &Device) {
    let n = 256 << 20;
    let src = device.alloc_zeros::<f32>(n).unwrap();
    let mut dst = device.alloc_zeros::<f32>(n).unwrap();
    for _ in 0..64 {
        dst.copy_from(0, &src, 0, n).unwrap();
    }
    // The buffers drop here; their frees are ordered after the copies.
}
