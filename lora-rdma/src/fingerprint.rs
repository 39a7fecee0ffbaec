//! The model-geometry fingerprint a manifest carries: a peer staged for one
//! model must never land into an engine serving another.
//!
//! XXH64 over an explicit, versioned encoding of every [`ModelConfig`]
//! field, written field by field rather than through `Debug` or serde, so
//! the value does not change with a formatting or derive detail. Every
//! struct is destructured without `..`: a field added to `ModelConfig` fails
//! to compile here until it is encoded.

use lora_layout::{LayerKind, LinearAttnDims, MlaDims, ModelConfig, MoeDims};

use crate::checksum::xxh64;

/// Version of the encoding; bumped whenever the encoding changes.
const ENCODING_VERSION: u8 = 1;

/// The canonical byte encoding: integers as u64 LE, booleans as one byte,
/// options as a presence byte then the value, sequences as a u64 LE length
/// then the items, the family as its length-prefixed `model_type`.
#[derive(Default)]
struct Encoder(Vec<u8>);

impl Encoder {
    fn uint(&mut self, v: usize) {
        self.0.extend_from_slice(&(v as u64).to_le_bytes());
    }

    fn flag(&mut self, v: bool) {
        self.0.push(u8::from(v));
    }

    fn str(&mut self, s: &str) {
        self.uint(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }

    fn opt_uint(&mut self, v: Option<usize>) {
        self.flag(v.is_some());
        if let Some(v) = v {
            self.uint(v);
        }
    }
}

/// The fingerprint of `cfg`'s geometry.
pub fn model_fingerprint(cfg: &ModelConfig) -> u64 {
    xxh64(&canonical_encoding(cfg))
}

/// The bytes [`model_fingerprint`] hashes.
fn canonical_encoding(cfg: &ModelConfig) -> Vec<u8> {
    let ModelConfig {
        family,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        intermediate_size,
        vocab_size,
        tie_word_embeddings,
        layer_types,
        moe,
        mla,
        linear_attn,
    } = cfg;
    let mut e = Encoder::default();
    e.0.push(ENCODING_VERSION);
    e.str(family.model_type());
    for v in [
        *hidden_size,
        *num_hidden_layers,
        *num_attention_heads,
        *num_key_value_heads,
        *head_dim,
        *intermediate_size,
        *vocab_size,
    ] {
        e.uint(v);
    }
    e.flag(*tie_word_embeddings);
    e.uint(layer_types.len());
    for kind in layer_types {
        e.0.push(match kind {
            LayerKind::FullAttention => 0,
            LayerKind::LinearAttention => 1,
        });
    }
    e.flag(moe.is_some());
    if let Some(MoeDims {
        num_experts,
        top_k,
        expert_intermediate_size,
        shared_expert_intermediate_size,
        shared_expert_gate,
        dense_layers,
    }) = moe
    {
        e.uint(*num_experts);
        e.uint(*top_k);
        e.uint(*expert_intermediate_size);
        e.opt_uint(*shared_expert_intermediate_size);
        e.flag(*shared_expert_gate);
        e.uint(dense_layers.len());
        for &dense in dense_layers {
            e.flag(dense);
        }
    }
    e.flag(mla.is_some());
    if let Some(MlaDims {
        q_lora_rank,
        kv_lora_rank,
        qk_rope_head_dim,
        qk_nope_head_dim,
        v_head_dim,
    }) = mla
    {
        e.opt_uint(*q_lora_rank);
        for v in [*kv_lora_rank, *qk_rope_head_dim, *qk_nope_head_dim, *v_head_dim] {
            e.uint(v);
        }
    }
    e.flag(linear_attn.is_some());
    if let Some(LinearAttnDims {
        num_value_heads,
        value_head_dim,
    }) = linear_attn
    {
        e.uint(*num_value_heads);
        e.uint(*value_head_dim);
    }
    e.0
}

#[cfg(test)]
mod tests;
