//! `lora-audit`: the gate between untrusted PEFT adapter files and the GPU.
//!
//! It reads an adapter directory (`adapter_config.json` +
//! `adapter_model.safetensors`, as PEFT 0.21 writes them with transformers
//! 4.x or 5.x) against a base model's [`ModelConfig`](lora_layout::ModelConfig) and the pool limits in
//! [`LoraOptions`], and either places every tensor exactly or refuses the
//! adapter with stable codes naming the tensor or field at fault.
//!
//! Brief overview:
//! - [`parse_peft_adapter_config`] / [`PeftAdapterConfig`]: every field that
//!   changes the math; `rank_pattern` / `alpha_pattern` kept in file order,
//!   matched as PEFT does ([`PatternTable`]).
//! - [`classify_key`], [`classify_overlay_key`], [`is_gdn_key`],
//!   [`non_text_tower`]: tensor names to (layer, target, A | B), for dense
//!   projections, transformers 4.x per-expert modules (incl. Mixtral
//!   `w1`/`w3`/`w2`), 5.x fused expert parameters (nested `ParamWrapper`s),
//!   routers and token tables; a multimodal wrapper's other towers are
//!   refused by name, never taken for the text decoder.
//! - [`audit_adapter`] → [`AuditReport`]: pairs per (layer, module) with rank
//!   (from the shapes) and scale (`alpha / r` or rsLoRA `alpha / sqrt(r)`,
//!   alpha from `alpha_pattern`), expert pairs per (layer, expert site),
//!   the model-level pairs (a LoRA on the input embedding, [`PlacedEmbedding`];
//!   on the output head, [`PlacedHead`], whose delta `probe_in::lm_head.weight`
//!   probes), overlays, skips, refusals, pool bytes.
//! - [`prepare_adapter`] → [`PreparedAdapter`]: host BF16 pairs (both expert
//!   formats normalised to per-(expert, Gate | Up | Down) pairs) and the
//!   [`HostOverlay`].
//! - [`load_adapter_safetensors`]: read whole (never mapped), F32/F16 → BF16 with rayon.
//!   [`LoadedSafetensors`] (the `safetensors` crate) and [`SafetensorsFile`]
//!   (the swap path's own fast parser) accept and refuse exactly the same
//!   files, by the `safetensors` crate's rules (a tensor named twice keeps
//!   its last entry).
//! - Served values: [`audit_adapter`] and [`prepare_adapter`] refuse any NaN
//!   or infinity in a served tensor (A, B, experts, router, token rows and
//!   tables) as served, i.e. after the BF16 conversion (`REJECT[non-finite]`).
//!   [`audit_header`] reads no data and cannot: a path that serves tensor
//!   bytes after a header-only audit checks each of
//!   [`AuditReport::served_tensors`] with [`first_non_finite_raw`] (raw
//!   F32/F16/BF16 bytes) or [`first_non_finite`] (BF16), and refuses with
//!   [`Refusal::non_finite`] through [`AuditReport::refuse`].
//! - Bounds on untrusted configs: [`MAX_ADAPTER_CONFIG_BYTES`],
//!   [`MAX_PATTERN_KEYS`], [`MAX_REGEX_PATTERN_KEYS`],
//!   [`MAX_PATTERN_KEY_BYTES`] ([`AuditError::ConfigTooLarge`],
//!   [`AuditError::PatternLimit`], `REJECT[pattern-regex]`); on probe
//!   outputs, [`MAX_PROBE_OUTPUT_BYTES`] ([`AuditError::ProbeTooLarge`]).
//! - The token-overlay host math ([`build_override_set`],
//!   [`override_source`], [`row_diff_bf16`], [`ROWDIFF_THRESH`], ...) shared
//!   with `lora-overlay`, and the pure probe path ([`probe_adapter`]) behind
//!   the `lora-audit probe` command; [`probe_adapter_at`] answers one
//!   tensor-parallel rank's part of each dense delta
//!   ([`LoraOptions::placement`]).
//!
//! - [`families`]: the adapter format of each model family added after the
//!   first set (Gemma 2 / 3 and the Gemma 3 wrapper, GLM-4.5, Phi-3 /
//!   Phi-4, gpt-oss), and what the audit does with each.
//!
//! What it must never do: touch a GPU or depend on cudarc / ibverbs; unpickle
//! anything; skip a tensor silently (skips happen only under
//! `allow_partial`, for the skippable codes, and are listed); panic on any
//! input file.
//!
//! # The command and the Python package
//!
//! The `lora-audit` command (crate `lora-audit-cli`) and the Python package
//! `lora_audit` (crate `lora-audit-py`) are this library's two faces; this
//! crate depends on neither an argument parser nor Python.
//! `lora-audit check DIR --model config.json [--max-rank N] [--experts]
//! [--allow-partial] [--json]` prints the report ([`AuditReport::to_text`],
//! or [`AuditReport::to_json`]) and exits **0** servable, **1** refused,
//! **2** bad usage or unreadable input (with `--json`, also
//! `{"error": …, "exit": 2}` on stdout); `lora-audit probe` writes the
//! served deltas ([`probe_adapter`]) with the same codes. Every error names
//! the file or directory it is about.
//!
//! # Refusal codes
//!
//! | code | meaning | skippable |
//! |---|---|---|
//! | `REJECT[peft-type]` | `peft_type` is not `LORA` | |
//! | `REJECT[pickle]` | `adapter_model.bin`: a pickle is never read | |
//! | `REJECT[dora]` | DoRA on a pool not built for it (`LORA_DORA`), or on an expert / router | |
//! | `REJECT[dora-needs-base-weights]` | DoRA offered to a pool (or probe) without the base weights | |
//! | `REJECT[lora-bias]` | `lora_bias` / `lora_B.bias`: no bias space | |
//! | `REJECT[bias]` | absolute base biases saved by `bias != "none"` | |
//! | `REJECT[init-mutates-base]` | PiSSA / OLoRA / CorDA / LoftQ / LoRA-GA or unknown init | |
//! | `REJECT[alora]` | activated LoRA | |
//! | `REJECT[layer-replication]` | replicated layers | |
//! | `REJECT[qalora]` | QALoRA | |
//! | `REJECT[bdlora]` | block-diagonal LoRA | |
//! | `REJECT[lora-variant]` | VeLoRA, MonteCLoRA, Arrow, KaSA, MiCA | |
//! | `REJECT[embedding-lora]` | LoRA on an embedding not served: not the input embedding, a tied head, or beside trainable tokens on it | |
//! | `REJECT[embedding-lora-disabled]` | `lora_embedding_A/B` while the pool has no embedding place (`LORA_EMBEDDING_LORA`) | |
//! | `REJECT[lm-head-lora-disabled]` | `lm_head.lora_A/B` while the pool has no head place (`LORA_LM_HEAD_LORA`); a tied head's pair is `REJECT[tied-head]` and head trainable tokens beside it `REJECT[trainable-tokens]` | |
//! | `REJECT[modules-to-save]` | a `modules_to_save` module other than embed_tokens / lm_head | |
//! | `REJECT[trainable-tokens]` | trainable tokens that cannot be served (other module, ids without rows) | |
//! | `REJECT[duplicate-token-id]` | a repeated trainable id | |
//! | `REJECT[token-out-of-vocab]` | a trainable id past the served vocabulary | yes |
//! | `REJECT[tied-head]` | an overlay a tied head cannot serve as PEFT merges it | |
//! | `REJECT[pattern-regex]` | a pattern key Python's `re` rejects, or outside the subset run exactly ([`peft_pattern_regex`]) | |
//! | `REJECT[non-finite-scale]` | a scale (from `lora_alpha` or an `alpha_pattern` key) not finite as served (f32) | |
//! | `REJECT[rank-mismatch]` | config rank differs from the tensor shapes | |
//! | `REJECT[rank-exceeds-max]` | a dense rank above `max_rank` | |
//! | `REJECT[expert-rank]` | an expert/router rank above `expert_rank` | |
//! | `REJECT[experts-disabled]` | expert/router tensors with expert LoRA off | yes |
//! | `REJECT[gdn-target]` | a gated-delta-net input projection | yes |
//! | `REJECT[unsupported-target]` | a LoRA target the engine does not apply | yes |
//! | `REJECT[vision-tower]` | a module of a multimodal wrapper's vision (or other non-text) tower or projector | yes |
//! | `REJECT[model-mismatch]` | a layer, expert or module the model lacks | |
//! | `REJECT[unknown-key]` | a tensor name of no known PEFT form (or outside printable ASCII) | |
//! | `REJECT[shape]` | a tensor shape that does not fit | |
//! | `REJECT[unpaired]` | `lora_A` without `lora_B` or the reverse | |
//! | `REJECT[duplicate-tensor]` | two tensors for one place | |
//! | `REJECT[dtype]` | a dtype other than F32 / F16 / BF16 | |
//! | `REJECT[non-finite]` | a served tensor holds NaN or ±inf as served (BF16; F32 past its range included) | |
//! | `REJECT[empty]` | nothing left to serve | |
//!
//! ```
//! use std::path::Path;
//! use lora_audit::{LoraOptions, RejectCode, audit_adapter};
//! use lora_layout::ModelConfig;
//!
//! let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
//! let cfg = ModelConfig::from_file(&fixtures.join("config.json"))?;
//! let report = audit_adapter(&fixtures.join("rslora"), &cfg, &LoraOptions::default())?;
//! assert!(report.is_servable());
//! let dora = audit_adapter(&fixtures.join("dora"), &cfg, &LoraOptions::default())?;
//! assert!(dora.refused.iter().all(|r| r.code == RejectCode::Dora));
//! for pair in &report.placed {
//!     println!("layer {} {}: r={} scale={}", pair.layer, pair.module, pair.rank, pair.scale);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod audit;
pub mod dora;
mod error;
pub mod families;
mod key;
mod options;
mod overlay;
mod pattern;
mod peft_config;
mod prepare;
mod probe;
mod report;
mod tensors;
#[cfg(test)]
mod test_support;

pub use audit::{ADAPTER_CONFIG, ADAPTER_PICKLE, ADAPTER_WEIGHTS, audit_adapter, audit_header, validate_peft_config};
pub use error::{AuditError, Refusal, RejectCode};
pub use key::{
    AdapterAb, FusedWrapper, LoraKey, LoraTarget, classify_key, is_gdn_key, non_text_tower, split_layer_path,
};
pub use options::{AuditArgs, DEFAULT_EXPERT_RANK, DEFAULT_MAX_LORAS, DEFAULT_MAX_RANK, LoraOptions, OptionsError};
pub use overlay::{
    CompiledOverlay, HostOverlay, LmHeadOverlay, OverlayError, OverlayModule, OverlayTensor, OverlayTensorKind,
    OverlayTensors, ROWDIFF_THRESH, TableOverlay, TableTensors, build_override_set, clamp_trainable_to_vocab,
    classify_overlay_key, id_in_vocab, override_source, row_diff_bf16,
};
pub use pattern::{
    MAX_PATTERN_KEY_BYTES, MAX_PATTERN_KEYS, MAX_REGEX_PATTERN_KEYS, MAX_REPEAT, PatternEntry, PatternTable,
    peft_pattern_regex,
};
pub use peft_config::{
    InitLoraWeights, MAX_ADAPTER_CONFIG_BYTES, PeftAdapterConfig, TargetModules, TrainableTokenIndices,
    parse_peft_adapter_config,
};
pub use prepare::{
    HostEmbeddingPair, HostExpertPair, HostHeadPair, HostPair, PreparedAdapter, prepare_adapter, split_fused,
};
pub use probe::{
    BASE_BIAS, BASE_WEIGHT, BaseTables, FusedParam, MAX_PROBE_OUTPUT_BYTES, Oracle, PROBE_IN, PROBE_OUT, PairShape,
    ProbeBase, ProbeInputs, ProbeOutputs, ProbeTensor, ROWS_IDX, ROWS_MERGED, WeightRef, apply_pair, parse_weight_name,
    probe_adapter, probe_adapter_at, probe_files, probe_files_at, read_base_tables, read_oracle, read_probe_inputs,
    write_probe_outputs,
};
pub use report::{
    AuditReport, AuditedOverlay, ExpertSlice, LmHeadMode, PlacedEmbedding, PlacedExpertPair, PlacedHead, PlacedPair,
};
pub use tensors::{
    AdapterTensors, HostTensor, LoadedSafetensors, SafetensorsFile, TensorDtype, TensorInfo, UnparsedSafetensors,
    first_non_finite, first_non_finite_raw, load_adapter_safetensors, load_bf16,
};
