//! The adapter formats of the model families added after the first set, as
//! PEFT 0.21 writes them on transformers 5.17 (read from transformers'
//! `models/<family>/modeling_*.py` and PEFT's `tuners/lora/layer.py`, and
//! checked by the fixtures under `fixtures/<family>/`, whose oracles are
//! PEFT's own merged weights). The general format (keys, `rank_pattern`,
//! the 5.x fused experts) is the workspace's `PEFT-FORMAT.md`; this page
//! says what each family adds to it and what the audit does with it.
//!
//! # Gemma 2 (`gemma2`), Gemma 3 (`gemma3_text`) and the Gemma 3 wrapper (`gemma3`)
//!
//! Decoder layers as Llama's: `self_attn.{q,k,v,o}_proj` and
//! `mlp.{gate,up,down}_proj`, all `nn.Linear` (Gemma 3 adds per-head
//! `q_norm` / `k_norm`, which take no delta). `head_dim` is explicit and is
//! not `hidden_size / num_attention_heads` (Gemma 2 9B: hidden 3584, 16
//! heads of 256), so `q_proj` is `[heads·head_dim, hidden]`, `k_proj` /
//! `v_proj` `[kv_heads·head_dim, hidden]` and `o_proj`
//! `[hidden, heads·head_dim]`. Absent fields take the config classes'
//! defaults (`head_dim` 256, 4 kv heads, tied embeddings). Sliding-window and
//! full-attention layers have the same projections. Embeddings are tied by
//! default.
//!
//! Keys: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
//! for `Gemma2ForCausalLM` / `Gemma3ForCausalLM`. The wrapper
//! (`Gemma3ForConditionalGeneration`, config `model_type: "gemma3"` with the
//! geometry in `text_config`, whose `model_type` is `gemma3_text`) puts the
//! text decoder under `model.language_model`:
//! `base_model.model.model.language_model.layers.{i}.self_attn.q_proj.lora_A.weight`;
//! its lm_head is tied by the wrapper's own top-level `tie_word_embeddings`
//! (default true). Beside it sit `model.vision_tower` (a SigLIP encoder:
//! `encoder.layers.{i}.self_attn.{q,k,v,out}_proj`, `mlp.fc1` / `fc2`,
//! `head.*`) and `model.multi_modal_projector` (a bare parameter,
//! `mm_input_projection_weight`). PEFT's `target_modules="all-linear"`, and
//! any list naming `q_proj`, also adapts the vision tower's linears; the
//! tower's `encoder.layers.{i}.self_attn.q_proj` would read as the text
//! decoder's layer `i` if the path before `layers.{i}` were ignored. Every
//! key with a path component naming another tower ([`non_text_tower`]:
//! `vision_tower`, `multi_modal_projector`, `visual`, ...) is refused by name
//! with `REJECT[vision-tower]` (skippable under `allow_partial`, listed), and
//! the probe path treats such weights as unserved. A regex target such as
//! `.*\.language_model\.layers\.\d+\.(self_attn|mlp)\..*_proj` adapts the text
//! decoder alone and is served whole.
//!
//! # GLM-4.5 (`glm4_moe`)
//!
//! Attention as Llama's with an explicit `head_dim` (GLM-4.5-Air: 96 heads
//! of 128 on hidden 4096), optional per-head q/k norms (no delta). Layers
//! `l < first_k_dense_replace` (class default 1) have a dense
//! `mlp.{gate,up,down}_proj`; the others an MoE block of
//! - `mlp.experts`: the transformers 5.x fused parameters `gate_up_proj`
//!   `[E, 2·moe_inter, hidden]` (gate rows first, its `chunk(2)`) and
//!   `down_proj` `[E, hidden, moe_inter]`, E = `n_routed_experts`;
//! - `mlp.gate`: the scored router (`Glm4MoeTopkRouter`, as DeepSeek-V3's):
//!   a bare `weight` `[E, hidden]`, logits `x·Wᵀ`, then sigmoid scores plus
//!   the buffer `e_score_correction_bias` and a grouped top-k. A delta on
//!   the weight adds to the logits before all of that, so it is served as
//!   DeepSeek-V3's router is ([`ExpertSite::Router`], folded onto the gate
//!   logits); the correction bias is a buffer PEFT cannot target;
//! - `mlp.shared_experts.{gate,up,down}_proj`: one MLP of
//!   `n_shared_experts · moe_intermediate_size` (default one expert).
//!
//! The multi-token-prediction layers (`num_nextn_predict_layers`) are not
//! built by transformers (the checkpoint's `layers.{num_hidden_layers}` is
//! ignored on load), so an adapter has none; a key for such a layer is
//! `REJECT[model-mismatch]`.
//!
//! Keys as for Qwen3-MoE on 5.x: `…self_attn.q_proj.lora_A.weight`; the
//! experts through `target_parameters` as nested `ParamWrapper`s
//! (`mlp.experts.base_layer.lora_*` inner, `mlp.experts.lora_*` outer, told
//! apart by their shapes); the router through
//! `target_parameters=["mlp.gate.weight"]`: `…mlp.gate.lora_A.weight`
//! `[r, hidden]`, `lora_B` `[E, r]`. PEFT 0.21 converts `glm4_moe` configs as
//! `qwen2_moe`'s: every `gate_proj` / `up_proj` / `down_proj` target module
//! (names, regexes and `all-linear` alike) becomes the fused experts, with r
//! and alpha doubled for `gate_up_proj` through `rank_pattern` /
//! `alpha_pattern` entries it writes itself, so the shared experts and the
//! dense first layers are only reachable through `target_parameters` on
//! their weights (`mlp.shared_experts.gate_proj.weight`,
//! `mlp.gate_proj.weight`): `…mlp.shared_experts.gate_proj.lora_A.weight`,
//! the same key and the same delta as a Linear's LoRA. PEFT then matches
//! `rank_pattern` / `alpha_pattern` against the parameter path
//! (`….gate_proj.weight`), and so does the audit.
//!
//! # Phi-3 and Phi-4 (`phi3`)
//!
//! Each layer has `self_attn.qkv_proj` `[(heads + 2·kv_heads)·head_dim,
//! hidden]` (q rows, then k, then v: the forward slices its output at
//! `heads·head_dim` and `(heads + kv_heads)·head_dim`), `self_attn.o_proj`,
//! `mlp.gate_up_proj` `[2·intermediate, hidden]` (gate rows then up, its
//! `chunk(2)`) and `mlp.down_proj`; no biases. `head_dim` is not a field of
//! the config class: it is `hidden_size / num_attention_heads` unless the
//! file sets one; a null `num_key_value_heads` means one per head.
//!
//! PEFT targets each fused `nn.Linear` as one module (`all-linear` gives
//! `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`):
//! `…self_attn.qkv_proj.lora_A.weight` `[r, hidden]`, `lora_B` `[q+k+v, r]`,
//! one delta `s·B·A` onto the whole fused output. It does not split into a
//! rank-r pair per projection (A is shared), so it is placed as it is:
//! lora-layout's [`LoraModule::QkvProj`] and [`LoraModule::GateUpProj`] hold
//! one pair of the fused width each, and the fused sites
//! ([`LoraModule::qkv`], [`LoraModule::gate_up`], which the pool's
//! `FusedTargets::qkv` / `gate_up` follow) apply that single pair onto the
//! fused output. `rank_pattern` / `alpha_pattern` keys match the fused
//! module path (`model.layers.1.mlp.gate_up_proj`). Keys of unfused
//! projections (`q_proj`, `gate_proj`) on a Phi-3 model, and of fused ones on
//! any other family, are `REJECT[model-mismatch]`. The reference engine
//! (`lora-engine`) has no Phi-3 forward and refuses the family with a typed
//! error (`EngineError::UnsupportedFamily`).
//!
//! # gpt-oss (`gpt_oss`)
//!
//! Every layer is an MoE block `mlp` of
//! - `mlp.experts` (`GptOssExperts`, marked `is_transposed`): `gate_up_proj`
//!   `[E, hidden, 2·inter]` and `down_proj` `[E, inter, hidden]` — stored
//!   `[E, in, out]`, unlike the other families' `[E, out, in]` — with
//!   `gate_up_proj_bias` `[E, 2·inter]` and `down_proj_bias` `[E, hidden]`;
//!   the forward takes gate and up INTERLEAVED along `gate_up_proj`'s output
//!   (`gate_up[..., ::2]`, `gate_up[..., 1::2]`), E = `num_local_experts`,
//!   inter = `intermediate_size`;
//! - `mlp.router` (`GptOssTopKRouter`, not an `nn.Linear`): `weight`
//!   `[E, hidden]` and `bias` `[E]`, logits `x·Wᵀ + b`, top-k, softmax over
//!   the chosen logits.
//!
//! Attention `self_attn.{q,k,v,o}_proj` with biases (a LoRA leaves them
//! alone) and per-head `sinks` (a 1-D parameter PEFT cannot target);
//! `head_dim` 64 and 8 kv heads when absent.
//!
//! PEFT reads `is_transposed`: its `ParamWrapper` keeps in = `hidden`, out =
//! `2·inter` for `gate_up_proj`, so the pairs have the usual fused shapes, A
//! `[E·r, hidden]` / B `[2·inter, E·r]` and A `[E·r, inter]` / B
//! `[hidden, E·r]`, with expert `e`'s B columns `k·E + e` as ever; its merge
//! writes `einsum("o r e, e r i -> e i o")` into the `[E, in, out]`
//! parameter. Only the order of B's rows differs: row `2j` is gate output
//! `j`, row `2j + 1` up output `j` ([`GateUpLayout::Interleaved`]). The audit
//! cuts expert `e`'s Gate pair from the even rows and its Up pair from the
//! odd rows ([`ExpertSlice::FusedInterleaved`]), so the expert pool holds
//! the same per-(expert, Gate | Up | Down) pairs as for every other family;
//! the MoE fold writes them onto a `gate | up` output, so an engine serving
//! gpt_oss de-interleaves its grouped GEMM's gate_up weights once at load
//! (`lora_moe::ExpertTarget::gate_up`). The probe path answers a
//! `gate_up_proj` probe in the parameter's own interleaved order.
//!
//! Keys: experts through `target_parameters=["mlp.experts.gate_up_proj",
//! "mlp.experts.down_proj"]` as nested wrappers (`mlp.experts.base_layer`,
//! `mlp.experts`); the router only through `target_parameters=
//! ["mlp.router.weight"]` (`target_modules=["router"]` is refused by PEFT: not
//! a supported module type): `…mlp.router.lora_A.weight` `[r, hidden]`,
//! `lora_B` `[E, r]`, folded onto the router logits before top-k as every
//! router delta; the router's bias takes none (PEFT cannot wrap a 1-D
//! parameter). A target on an expert bias parameter nests a third (or
//! fourth) wrapper, `mlp.experts.base_layer.base_layer.lora_*`, whose pair is
//! A `[r, 2·inter]` / B `[E, r]` (`[r, hidden]` for `down_proj_bias`): the
//! pool has no place for a bias delta, so it is `REJECT[unsupported-target]`
//! naming the bias parameter (skippable under `allow_partial`), and a pair
//! whose shapes fit both a weight and a bias is `REJECT[shape]`. Saved
//! absolute biases (`bias="all"` saves `…mlp.router.bias` and the attention
//! biases) are `REJECT[bias]`, and so would be a saved expert bias
//! (`…experts.gate_up_proj_bias`).
//!
//! [`non_text_tower`]: crate::non_text_tower
//! [`GateUpLayout::Interleaved`]: lora_layout::GateUpLayout::Interleaved
//! [`ExpertSlice::FusedInterleaved`]: crate::ExpertSlice::FusedInterleaved
//! [`LoraModule::QkvProj`]: lora_layout::LoraModule::QkvProj
//! [`LoraModule::GateUpProj`]: lora_layout::LoraModule::GateUpProj
//! [`LoraModule::qkv`]: lora_layout::LoraModule::qkv
//! [`LoraModule::gate_up`]: lora_layout::LoraModule::gate_up
//! [`ExpertSite::Router`]: lora_layout::ExpertSite::Router
