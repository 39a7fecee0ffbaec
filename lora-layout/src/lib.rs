//! `lora-layout`: the pure foundation of the multi-LoRA workspace.
//!
//! It answers, for a base model described by its Hugging Face `config.json`:
//! which projections a LoRA delta can target and how wide they are
//! ([`ModelConfig`], [`LoraModule`], [`ExpertProj`], [`router_dims`]); where
//! each (layer, module) pair lives inside a pool slot ([`SlotLayout`], the one
//! layout walk every packer uses), for one tensor-parallel rank when
//! asked ([`Placement`], [`ModuleShard`], [`SlotLayout::with_placement`]),
//! with the input embedding's and the output head's pair places when asked
//! ([`SlotLayout::walk`], [`ModelPlaces`], both replicated whole on every
//! rank);
//! and the small routing decisions the serving
//! path makes per batch ([`build_seq_slot_host`], [`select_victim_slot`],
//! [`resolve_moe_lora_route`], [`adapter_id_hash`], ...).
//!
//! What it must never do: touch a GPU, read adapter files, or do any I/O
//! beyond reading a config file. It has no dependency on cudarc or ibverbs and
//! builds and tests on any laptop.
//!
//! ```
//! use lora_layout::{LoraModule, ModelConfig, SlotLayout};
//! let cfg = ModelConfig::from_hf_config(r#"{
//!     "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
//!     "num_attention_heads": 4, "num_key_value_heads": 2,
//!     "intermediate_size": 128, "vocab_size": 256 }"#).unwrap();
//! assert_eq!(LoraModule::KProj.dims(&cfg), (32, 64));
//! let layout = SlotLayout::new(&cfg, 8).unwrap();
//! let q = layout.entry(1, LoraModule::QProj).unwrap();
//! assert!(q.a_offset < q.b_offset && q.b_offset < layout.slot_bytes());
//! ```

mod config;
mod layout;
mod module;
mod moe_route;
mod pair;
mod placement;
mod routing;

pub use config::{ConfigError, LayerKind, LinearAttnDims, MlaDims, ModelConfig, ModelFamily, MoeDims};
pub use layout::{
    BF16_BYTES, EmbeddingEntry, ExpertEntry, ExpertLayout, HeadEntry, LayoutError, ModelPlaces, SlotEntry, SlotLayout,
    expert_packed_stride, expert_router_bytes, module_slot_offsets, pair_bytes, pool_slot_bytes, slot_base_offset,
};
pub use module::{ExpertProj, ExpertSite, GateUpLayout, LoraModule, full_attention_layers, router_dims};
pub use moe_route::{
    ExpertWork, MoeAdapterState, MoeLoraRoute, RefuseReason, RouteRefused, SeqLensError, build_moe_row_adapter_decode,
    build_moe_row_adapter_host, ensure_batch_servable, ensure_decode_route_servable, expert_delta_workitems,
    resolve_moe_lora_route,
};
pub use pair::{PairKey, PairLayout, PairPlace};
pub use placement::{MAX_OUT_SEGMENTS, ModuleShard, OutSegment, Placement, PlacementError, ShardKind};
pub use routing::{
    LoraSites, SlotView, TooManyAdapters, VictimError, adapter_id_hash, build_seq_slot_host, routed_prefill_slot_of,
    scale_table_values, select_victim_slot, uniform_seq_slots,
};
