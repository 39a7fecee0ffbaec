//! Test helpers shared by the unit tests: fixtures and the disk path they
//! compare landings with.

use std::path::{Path, PathBuf};

use lora_audit::{LoraOptions, PreparedAdapter, prepare_adapter};
use lora_layout::{ExpertLayout, ModelConfig};
use lora_pool::image::{SlotImage, dense_sources, expert_sources};

/// `fixtures/<path>` at the workspace root.
pub fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(path)
}

/// The base model config of fixture model `model`.
pub fn config(model: &str) -> ModelConfig {
    ModelConfig::from_file(&fixture(model).join("config.json")).unwrap()
}

/// Options with expert LoRA on.
pub fn opts(max_rank: usize, expert_rank: usize) -> LoraOptions {
    LoraOptions {
        max_rank,
        expert_rank,
        experts: true,
        ..LoraOptions::default()
    }
}

/// The prepared adapter `model/adapter` and what the disk path packs from
/// it: the dense image and the expert image (over the adapter's own expert
/// layout at `opts.expert_rank`).
pub fn disk_images(model: &str, adapter: &str, opts: &LoraOptions) -> (PreparedAdapter, SlotImage, SlotImage) {
    let cfg = config(model);
    let p = prepare_adapter(&fixture(model).join(adapter), &cfg, opts).unwrap();
    let dense = dense_sources(&p);
    let experts = expert_sources(&p);
    let layout = opts.slot_layout(&cfg).unwrap();
    let expert_layout = ExpertLayout::new(&cfg, opts.expert_rank, p.experts.iter().map(|e| (e.layer, e.site))).unwrap();
    let dense = SlotImage::pack(&layout, &dense).unwrap();
    let experts = SlotImage::pack(&expert_layout, &experts).unwrap();
    (p, dense, experts)
}
