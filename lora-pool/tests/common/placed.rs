//! Helpers of the placement tests (`tensor_parallel.rs`,
//! `fully_sharded.rs`, `vocab_parallel.rs`): the fixture families and their
//! dense adapters, every rank's pool of a world, poisoned fixture copies,
//! and the rows a model-level pair (embedding, output head) adds.

use std::path::PathBuf;

use half::bf16;
use lora_audit::{SafetensorsFile, TensorDtype, WeightRef, audit_adapter, parse_weight_name, read_oracle};
use lora_kernels::{Device, Rows, RowsMut};
use lora_layout::{ModelConfig, Placement};
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool, PoolError, SlotId, StepRow};

use super::{fixtures, model_config};

pub const MAX_RANK: usize = 16;

/// `max_loras` slots of rank `MAX_RANK` under `placement`.
pub fn options(max_loras: usize, placement: Placement) -> LoraOptions {
    LoraOptions {
        max_loras,
        max_rank: MAX_RANK,
        placement,
        ..LoraOptions::default()
    }
}

/// Every fixture family (a folder of `fixtures/` with a `config.json`).
pub fn families() -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(fixtures())
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            e.path()
                .join("config.json")
                .is_file()
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    out.sort();
    out
}

/// The family's fixture adapters a dense pool serves: servable at
/// `MAX_RANK` with expert LoRA off, and probed on dense weights only (no
/// expert, router or token-table probes).
pub fn dense_adapters(family: &str, cfg: &ModelConfig) -> Vec<String> {
    let root = fixtures().join(family);
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let dir = e.path();
            let oracle = read_oracle(&dir.join("oracle.safetensors")).ok()?;
            let dense = oracle.inputs.rows.is_empty()
                && !oracle.inputs.inputs.is_empty()
                && oracle
                    .inputs
                    .inputs
                    .keys()
                    .all(|w| matches!(parse_weight_name(w, cfg), Ok(WeightRef::Dense { .. })));
            let servable = audit_adapter(&dir, cfg, &options(1, Placement::SINGLE))
                .is_ok_and(|r| r.is_servable() && r.experts.is_empty());
            (dense && servable).then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    names.sort();
    names
}

/// Every rank's pool of a world of `world` (fully sharded or not), each
/// loaded with `adapters` of `family`.
pub fn load_ranks(
    device: &Device,
    cfg: &ModelConfig,
    family: &str,
    adapters: &[String],
    world: usize,
    fully_sharded: bool,
) -> Result<Vec<LoraPool>, PoolError> {
    let root = fixtures().join(family);
    let dirs: Vec<_> = adapters.iter().map(|a| root.join(a)).collect();
    let sources: Vec<_> = adapters
        .iter()
        .zip(&dirs)
        .map(|(name, dir)| AdapterSource {
            name,
            dir: dir.as_path(),
        })
        .collect();
    Placement::new(0, world)
        .unwrap()
        .ranks()
        .map(|p| {
            LoraPool::load(
                device,
                cfg.clone(),
                options(adapters.len(), p.with_fully_sharded(fully_sharded)),
                BatchCapacity::default(),
                &sources,
            )
        })
        .collect()
}

/// A copy of llama's fixture adapter `adapter` (its config and weights) in
/// the temporary directory `<dst>-<pid>`, with a NaN at element
/// `element(shape)` of `tensor`'s weights (`element` sees the tensor's
/// shape first, and may check it).
pub fn poisoned_copy(adapter: &str, dst: &str, tensor: &str, element: impl FnOnce(&[usize]) -> usize) -> PathBuf {
    let src = fixtures().join("llama").join(adapter);
    let dst = std::env::temp_dir().join(format!("{dst}-{}", std::process::id()));
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let weights = dst.join("adapter_model.safetensors");
    let file = SafetensorsFile::open(&weights).unwrap();
    let (dtype, shape, offset, _) = file.tensor(tensor).unwrap();
    let i = element(shape);
    let mut bytes = std::fs::read(&weights).unwrap();
    let at = offset as usize;
    match dtype {
        TensorDtype::F32 => bytes[at + 4 * i..at + 4 * i + 4].copy_from_slice(&f32::NAN.to_le_bytes()),
        TensorDtype::BF16 => bytes[at + 2 * i..at + 2 * i + 2].copy_from_slice(&bf16::NAN.to_le_bytes()),
        TensorDtype::F16 => bytes[at + 2 * i..at + 2 * i + 2].copy_from_slice(&half::f16::NAN.to_le_bytes()),
        other => panic!("{tensor}: unexpected dtype {other:?}"),
    }
    std::fs::write(&weights, bytes).unwrap();
    dst
}

/// A model-level pair place beside the (layer, module) pairs.
#[derive(Debug, Clone, Copy)]
pub enum ModelPair {
    /// The input embedding's (`LoraOptions::embedding_lora`).
    Embedding,
    /// The output head's (`LoraOptions::lm_head_lora`).
    LmHead,
}

/// `max_loras` rotatable slots of rank `MAX_RANK` and a host tier, under
/// `placement`.
pub fn tiered_options(max_loras: usize, placement: Placement) -> LoraOptions {
    LoraOptions {
        rotatable: true,
        host_tier_bytes: 1 << 24,
        ..options(max_loras, placement)
    }
}

/// Four rotatable slots with `which`'s place and a host tier, under
/// `placement`.
pub fn pair_options(which: ModelPair, placement: Placement) -> LoraOptions {
    LoraOptions {
        embedding_lora: matches!(which, ModelPair::Embedding),
        lm_head_lora: matches!(which, ModelPair::LmHead),
        ..tiered_options(4, placement)
    }
}

/// The names one adapter has in slots 0, 1, 2 and 3 of a
/// [`pair_pool_by_every_route`] pool.
pub const ROUTES: [&str; 4] = ["loaded", "disk", "prepared", "tier"];
/// The hidden rows [`pair_rows`] serves the head's pair.
pub const HEAD_ROWS: usize = 5;

/// A llama pool of `which` under `placement` on `device` holding the llama
/// fixture adapter with `which`'s pair and no token table by every route
/// into a slot: startup load (slot 0), disk swap (1), a prepared adapter
/// (2) and the host tier (3), named as [`ROUTES`].
pub fn pair_pool_by_every_route(device: &Device, which: ModelPair, placement: Placement) -> LoraPool {
    let cfg = model_config("llama");
    let dir = fixtures().join("llama").join(match which {
        ModelPair::Embedding => "embedding_lora_no_table",
        ModelPair::LmHead => "lm_head_lora_no_table",
    });
    let sources = [AdapterSource {
        name: ROUTES[0],
        dir: dir.as_path(),
    }];
    let mut pool = LoraPool::load(
        device,
        cfg.clone(),
        pair_options(which, placement),
        BatchCapacity::default(),
        &sources,
    )
    .unwrap_or_else(|e| panic!("{placement:?}: {e}"));
    pool.swap_from_disk(SlotId::new(1), ROUTES[1], &dir).unwrap();
    let prepared = lora_audit::prepare_adapter(&dir, &cfg, pool.options()).unwrap();
    pool.swap_prepared(SlotId::new(2), ROUTES[2], &prepared).unwrap();
    pool.prefetch(ROUTES[3], &dir).unwrap();
    pool.wait_for_prefetch();
    let events = pool.prefetch_events();
    let tiered = events.iter().find(|e| e.name == ROUTES[3]).map(|e| &e.outcome);
    assert!(matches!(tiered, Some(Ok(_))), "{placement:?}: {tiered:?}");
    pool.swap_from_disk(SlotId::new(3), ROUTES[3], &dir).unwrap();
    pool
}

/// The rows each of [`ROUTES`]' slots adds: the embedding's for tokens
/// `ids`, or the head's for [`HEAD_ROWS`] hidden rows.
pub fn pair_rows(pool: &mut LoraPool, which: ModelPair, ids: &[u32]) -> Vec<Vec<f32>> {
    ROUTES
        .iter()
        .map(|n| match which {
            ModelPair::Embedding => embedding_rows(pool, n, ids),
            ModelPair::LmHead => head_rows(pool, n, HEAD_ROWS),
        })
        .collect()
}

/// The embedding LoRA `name`'s slot adds to zero rows of tokens `ids`.
pub fn embedding_rows(pool: &mut LoraPool, name: &str, ids: &[u32]) -> Vec<f32> {
    let device = pool.device().clone();
    let hidden = pool.config().hidden_size;
    let lease = pool.acquire(name).unwrap();
    let n = ids.len();
    let step = pool.decode_step(&vec![StepRow::Adapter(&lease); n], n).unwrap();
    let ids_dev = device.upload(ids).unwrap();
    let mut out = device.alloc_zeros::<f32>(n * hidden).unwrap();
    pool.apply_embedding(&step, &ids_dev, RowsMut::dense(&mut out, n, hidden))
        .unwrap();
    device.check_faults().unwrap();
    out.download().unwrap()
}

/// The head LoRA `name`'s slot adds to zero logits of `n` fixed hidden
/// rows: `[n, the slot's head rows]`.
pub fn head_rows(pool: &mut LoraPool, name: &str, n: usize) -> Vec<f32> {
    let device = pool.device().clone();
    let hidden = pool.config().hidden_size;
    let vocab = pool.layout().lm_head().unwrap().vocab;
    let lease = pool.acquire(name).unwrap();
    let step = pool.decode_step(&vec![StepRow::Adapter(&lease); n], n).unwrap();
    let x: Vec<bf16> = (0..n * hidden)
        .map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 50.0))
        .collect();
    let x = device.upload(&x).unwrap();
    let mut out = device.alloc_zeros::<f32>(n * vocab).unwrap();
    pool.apply_lm_head_decode(
        &step,
        Rows::dense(&x, n, hidden),
        RowsMut::dense(&mut out, n, vocab),
        lora_kernels::DecodeOptions::default(),
    )
    .unwrap();
    device.check_faults().unwrap();
    out.download().unwrap()
}
