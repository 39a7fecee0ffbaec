//! The seam through which LoRA deltas (and token overlays) enter the base forward.
//!
//! [`crate::Model::forward`] computes every base projection of the packed batch
//! and then hands the result to one [`DeltaHooks`] method, which may add to it
//! (or, for `embed`, overwrite rows) in place. The hooks see exactly the
//! tensors a PEFT LoRA wrapper sees in transformers: the input of the wrapped
//! `nn.Linear` and its base output. This module must never know about adapters,
//! slots or scaling: it is the contract only.
//!
//! # Contract (all methods)
//!
//! * All buffers are row-major f32. Row `r` of every call is the `r`-th token of
//!   the packed batch: chunk 0's tokens in order, then chunk 1's, ... — the same
//!   order as the returned logits. Expert calls expand rows token-major (below).
//! * `x` is the exact input of the projection, `y` its base output with the
//!   base bias already added. A hook adds its delta to `y`; it never resizes.
//! * Calls come in forward order, layer by layer: `embed`; then per layer `qkv`,
//!   `o`, and either `gate_up`, `down` (a [`crate::MlpKind::Dense`] layer) or
//!   `router`, `expert_gate_up`, `expert_down` (a [`crate::MlpKind::Moe`]
//!   layer); then `lm_head`. Every call of one forward covers all `n` tokens.
//! * What the base applies after a hook: `qkv` — per-head q/k RMSNorm (Qwen3
//!   families), then RoPE, then attention; `gate_up`/`expert_gate_up` —
//!   `silu(gate) * up`; `router` — softmax in f32 over all experts, top-k,
//!   renormalization (see [`DeltaHooks::router`]); `expert_down` — the routing
//!   weight, then the sum over the token's experts.
//! * An `Err` abandons the forward; every KV cache is restored to the length it
//!   had before the call. Report hook failures as [`EngineError::Hook`].
//! * An expert-parallel model (one cut by [`crate::Model::shard`] with
//!   `ep_world > 1`) calls, in each MoE layer, `router`, then
//!   `dispatch_tags` (an opaque `i32` per token that the forward sends
//!   with the token to the rank holding its expert: the hooks' per-token
//!   adapter map), then `dispatched_gate_up`, `dispatched_down` over the
//!   rows dispatched to this rank's experts, instead of `expert_gate_up`,
//!   `expert_down`. The provided methods tag nothing and add nothing.
//! * Neither Qwen3-MoE nor Mixtral has shared experts in transformers 5, so
//!   there is no shared-expert hook; a dense layer of an MoE model (Qwen3-MoE
//!   `mlp_only_layers`, `decoder_sparse_step`) calls `gate_up`/`down`.

use crate::error::EngineError;

/// Per-site delta callbacks of one forward (see the module docs for the contract).
pub trait DeltaHooks {
    /// `rows` = base embedding rows `[n, hidden]` of `ids`; may overwrite rows
    /// (token overlays) and add to them (a LoRA on the input embedding, after
    /// the overlays: PEFT's order). On a vocab-parallel rank the rows of
    /// other ranks' tokens are zeros and must stay zeros (the forward
    /// all-reduces the rows after this call).
    fn embed(&mut self, ids: &[u32], rows: &mut [f32]) -> Result<(), EngineError>;

    /// `x` = the normed layer input `[n, hidden]`; `y` = the fused q|k|v output
    /// `[n, q_dim + 2 * kv_dim]`: q columns (head-major), then k, then v; base
    /// bias already added; before q/k norm and RoPE.
    fn qkv(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError>;

    /// `x` = attention output `[n, heads * head_dim]` (head-major); `y` = o
    /// projection `[n, hidden]`, before the residual add.
    fn o(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError>;

    /// Dense MLP: `x` = normed input `[n, hidden]`; `y` = `[n, 2 * inter]`, the
    /// `intermediate_size` gate columns then the up columns.
    fn gate_up(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError>;

    /// Dense MLP: `x` = `silu(gate) * up` `[n, inter]`; `y` = `[n, hidden]`,
    /// before the residual add.
    fn down(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError>;

    /// MoE router: `x` = normed input `[n, hidden]`; `logits` = `[n, num_experts]`
    /// before softmax/top-k. The base then takes `softmax` over all experts in
    /// f32, the `top_k` largest probabilities (ties to the lower expert index,
    /// best first), and divides them by their sum when the model renormalizes
    /// (`norm_topk_prob` for Qwen3-MoE, always for Mixtral).
    fn router(&mut self, layer: usize, x: &[f32], logits: &mut [f32]) -> Result<(), EngineError>;

    /// Routed experts, rows expanded token-major: row `t * k + j` is token
    /// `t`'s `j`-th chosen expert `topk[t * k + j]` (best first). `x` = normed
    /// input `[n, hidden]` (not expanded); `topk` = `[n * k]`; `y` =
    /// `[n * k, 2 * moe_inter]`, gate columns then up columns.
    fn expert_gate_up(&mut self, layer: usize, x: &[f32], topk: &[u32], y: &mut [f32]) -> Result<(), EngineError>;

    /// Routed experts: `x` = `silu(gate) * up` `[n * k, moe_inter]`; `y` =
    /// `[n * k, hidden]`, the expert's output before its routing weight.
    fn expert_down(&mut self, layer: usize, x: &[f32], topk: &[u32], y: &mut [f32]) -> Result<(), EngineError>;

    /// `hidden` = final normed hidden states `[n, hidden]`; `logits` = base
    /// logits `[n, vocab]`, or on a vocab-parallel rank its logit columns
    /// `[n, vocab / tp_world]` (the forward all-gathers them after this call).
    fn lm_head(&mut self, hidden: &[f32], logits: &mut [f32]) -> Result<(), EngineError>;

    /// Expert parallelism, sending side: one tag per token of the batch
    /// (`n_tokens`), which the forward sends with token `t` to every rank
    /// that holds one of its experts (called after `router`, before the
    /// dispatch). The base model never reads a tag. Provided: `-1` each.
    fn dispatch_tags(&mut self, layer: usize, n_tokens: usize) -> Result<Vec<i32>, EngineError> {
        let _ = layer;
        Ok(vec![-1; n_tokens])
    }

    /// Expert parallelism, receiving side: the `m` rows dispatched to this
    /// rank's experts, each one (token, chosen expert) of some rank's
    /// batch, in source-rank order: `x` = the token's normed input
    /// `[m, hidden]`; `experts` = `[m]` (global expert indices, all this
    /// rank's); `tags` = `[m]`, what the token's rank gave
    /// [`DeltaHooks::dispatch_tags`] for it; `y` = `[m, 2 * moe_inter]`,
    /// gate columns then up columns. Provided: adds nothing.
    fn dispatched_gate_up(
        &mut self,
        layer: usize,
        x: &[f32],
        experts: &[u32],
        tags: &[i32],
        y: &mut [f32],
    ) -> Result<(), EngineError> {
        let _ = (layer, x, experts, tags, y);
        Ok(())
    }

    /// Expert parallelism, receiving side: as
    /// [`DeltaHooks::dispatched_gate_up`], with `x` = `silu(gate) * up`
    /// `[m, moe_inter]` and `y` = `[m, hidden]`, the expert's output before
    /// its routing weight. Provided: adds nothing.
    fn dispatched_down(
        &mut self,
        layer: usize,
        x: &[f32],
        experts: &[u32],
        tags: &[i32],
        y: &mut [f32],
    ) -> Result<(), EngineError> {
        let _ = (layer, x, experts, tags, y);
        Ok(())
    }
}

/// The base model alone: every hook is a no-op.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoDeltas;

impl DeltaHooks for NoDeltas {
    fn embed(&mut self, _ids: &[u32], _rows: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn qkv(&mut self, _layer: usize, _x: &[f32], _y: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn o(&mut self, _layer: usize, _x: &[f32], _y: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn gate_up(&mut self, _layer: usize, _x: &[f32], _y: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn down(&mut self, _layer: usize, _x: &[f32], _y: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn router(&mut self, _layer: usize, _x: &[f32], _logits: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn expert_gate_up(&mut self, _layer: usize, _x: &[f32], _topk: &[u32], _y: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn expert_down(&mut self, _layer: usize, _x: &[f32], _topk: &[u32], _y: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn lm_head(&mut self, _hidden: &[f32], _logits: &mut [f32]) -> Result<(), EngineError> {
        Ok(())
    }
}
