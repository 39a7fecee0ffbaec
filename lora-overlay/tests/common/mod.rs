//! Fixture access shared by the overlay integration tests: the PEFT
//! fixtures under `fixtures/`, their base token tables and oracles (PEFT's
//! own merged tables), and a real `LoraPool<TokenOverlays>` over them.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use half::bf16;
use lora_audit::{BaseTables, Oracle, OverlayModule, ROWS_IDX, ROWS_MERGED};
use lora_kernels::Device;
use lora_layout::ModelConfig;
use lora_overlay::{ServedTables, TokenOverlays};
use lora_pool::{AdapterSource, BatchCapacity, LoraOptions, LoraPool};

/// Every trainable-tokens and modules_to_save fixture (model, adapter), tied and untied heads.
pub const OVERLAY_FIXTURES: [(&str, &str); 6] = [
    ("llama", "trainable_tokens_untied_dict"),
    ("llama", "trainable_tokens_untied_list"),
    ("llama", "modules_to_save_embed_lm_head"),
    ("llama_tied", "modules_to_save_embed_tied"),
    ("llama_tied", "trainable_tokens_tied_dict"),
    ("llama_tied", "trainable_tokens_tied_list"),
];

/// The two overlaid tables.
pub const OVERLAY_MODULES: [OverlayModule; 2] = [OverlayModule::Embed, OverlayModule::LmHead];

/// `fixtures/` at the workspace root, or `LORA_FIXTURES_DIR` (the GPU bundle).
pub fn fixtures() -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
}

/// The base model config of fixture model `model`.
pub fn model_config(model: &str) -> ModelConfig {
    ModelConfig::from_file(&fixtures().join(model).join("config.json")).unwrap()
}

/// The base token tables of fixture model `model`, BF16 as served.
pub fn base_tables(model: &str) -> BaseTables {
    lora_audit::read_base_tables(&fixtures().join(model).join("tables.safetensors")).unwrap()
}

/// `fixtures/<model>/<adapter>/oracle.safetensors`.
pub fn oracle(model: &str, adapter: &str) -> Oracle {
    lora_audit::read_oracle(&fixtures().join(model).join(adapter).join("oracle.safetensors")).unwrap()
}

/// The tensor name of a token table in the fixtures.
pub fn table_name(module: OverlayModule) -> &'static str {
    match module {
        OverlayModule::Embed => "model.embed_tokens.weight",
        OverlayModule::LmHead => "lm_head.weight",
    }
}

/// The ids PEFT's merge changed in `module` (ascending) and their merged
/// rows `[ids, hidden]`; empty when the merge left the table alone.
pub fn oracle_rows(oracle: &Oracle, module: OverlayModule) -> (Vec<usize>, Vec<f32>) {
    let name = table_name(module);
    let Some(ids) = oracle.inputs.rows.get(name) else {
        assert!(!oracle.expected.contains_key(&format!("{ROWS_MERGED}{name}")));
        return (Vec::new(), Vec::new());
    };
    let merged = &oracle.expected[&format!("{ROWS_MERGED}{name}")];
    assert_eq!(merged.shape[0], ids.len(), "{ROWS_IDX}{name}");
    (
        ids.iter().map(|&i| usize::try_from(i).unwrap()).collect(),
        merged.data.clone(),
    )
}

/// The served base table of `module`: the head's own, or the embedding on a tied model.
pub fn base_table(tables: &BaseTables, module: OverlayModule) -> &[bf16] {
    match module {
        OverlayModule::Embed => tables.embed.as_deref().unwrap(),
        OverlayModule::LmHead => tables.lm_head.as_deref().or(tables.embed.as_deref()).unwrap(),
    }
}

/// An empty overlay set of `max_loras` slots over the fixture model's tables on `device`.
pub fn token_overlays(device: &Device, model: &str, max_loras: usize) -> TokenOverlays {
    let served = ServedTables::upload(device, &base_tables(model), &model_config(model)).unwrap();
    TokenOverlays::new(device, served, max_loras).unwrap()
}

/// Pool options for the overlay tests: rank 16, runtime swaps on.
pub fn options(max_loras: usize) -> LoraOptions {
    LoraOptions {
        max_loras,
        max_rank: 16,
        rotatable: true,
        ..LoraOptions::default()
    }
}

/// A small batch capacity (keeps the pool's scratch small).
pub const CAPACITY: BatchCapacity = BatchCapacity {
    max_rows: 256,
    max_segments: 4,
};

/// A pool of `max_loras` slots on `device` with `(name, adapter)` loaded
/// into slots `0..`, and token overlays as its companion.
pub fn pool(device: &Device, model: &str, max_loras: usize, adapters: &[(&str, &str)]) -> LoraPool<TokenOverlays> {
    let dirs: Vec<PathBuf> = adapters.iter().map(|(_, a)| fixtures().join(model).join(a)).collect();
    let sources: Vec<AdapterSource<'_>> = adapters
        .iter()
        .zip(&dirs)
        .map(|((name, _), dir)| AdapterSource { name, dir })
        .collect();
    let overlays = token_overlays(device, model, max_loras);
    LoraPool::load_with_companion(
        device,
        model_config(model),
        options(max_loras),
        CAPACITY,
        &sources,
        overlays,
    )
    .unwrap()
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// ‖out − ref‖ / ‖ref‖, infinite on NaN or length mismatch.
pub fn rel_error(out: &[f32], reference: &[f32]) -> f64 {
    lora_kernels::testing::rel_error(out, reference)
}

/// `[n, vocab]` logits `hidden · tableᵀ` in f32 (the base head's GEMM).
pub fn logits(hidden: &[bf16], table: &[bf16], n: usize, vocab: usize, width: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * vocab];
    for i in 0..n {
        let h = &hidden[i * width..(i + 1) * width];
        for v in 0..vocab {
            let w = &table[v * width..(v + 1) * width];
            out[i * vocab + v] = h.iter().zip(w).map(|(a, b)| a.to_f32() * b.to_f32()).sum();
        }
    }
    out
}

/// The overridden logits of one slot's rows, checked two ways:
/// against PEFT's merged rows (`‖out − ref‖ / ‖ref‖ < 1e-2` over all of
/// them: a single logit of a tiny random model can cancel to near zero,
/// where the BF16 storage of its row is relatively large), and each against
/// the exact dot with the BF16 row the overlay serves (`bf16(merged)`),
/// within FP32 accumulation plus the rounding of the logits' type.
#[derive(Debug, Default)]
pub struct OverriddenLogits {
    out: Vec<f32>,
    peft: Vec<f32>,
    served: Vec<(f64, f64)>,
}

impl OverriddenLogits {
    /// Record logit `got` of hidden row `h` for an id whose merged row is `merged`.
    pub fn push(&mut self, got: f32, h: &[bf16], merged: &[f32]) {
        self.out.push(got);
        self.peft.push(h.iter().zip(merged).map(|(a, b)| a.to_f32() * b).sum());
        let terms = h
            .iter()
            .zip(merged)
            .map(|(a, b)| f64::from(a.to_f32()) * f64::from(bf16::from_f32(*b).to_f32()));
        let (value, scale) = terms.fold((0.0, 0.0), |(v, s), t| (v + t, s + t.abs()));
        self.served.push((value, scale));
    }

    /// Assert both checks; `out_rel` is the relative rounding of the logits'
    /// type (0 for f32, 2^-8 for bf16).
    pub fn check(&self, what: &str, out_rel: f64) {
        if self.out.is_empty() {
            return;
        }
        let err = rel_error(&self.out, &self.peft);
        assert!(err < 1e-2, "{what}: overridden logits rel error {err} against PEFT");
        for (k, (&got, &(value, scale))) in self.out.iter().zip(&self.served).enumerate() {
            let diff = (f64::from(got) - value).abs();
            assert!(
                diff <= 1e-5 * scale + out_rel * value.abs() + 1e-30,
                "{what}: logit {k} is {got}, the served BF16 row gives {value} (scale {scale})"
            );
        }
    }
}
