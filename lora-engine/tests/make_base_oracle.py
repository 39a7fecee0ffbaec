#!/usr/bin/env python3
"""Build the base-model oracle data for `lora-engine/tests/base_oracle.rs`.

For each family this script builds a tiny random model with transformers,
saves it with `save_pretrained(safe_serialization=True)` into
`lora-engine/tests/data/<name>/`, reloads it from that folder the way a user
would (`from_pretrained`, fp32, eager attention) and writes
`base_logits.safetensors` with transformers' own fp32 logits of a full forward
over two prompts:

    prompt{p}.ids              I32 [len]
    prompt{p}.logits           F32 [len, vocab]
    prompt{p}.topk.layer{l}    I32 [len, top_k]   (MoE layers only; experts chosen by
                                                  transformers' router, best first)

Every weight is drawn from a fixed seed with a scale that makes the logits,
attention patterns and routing non-trivial (router weights large enough that
tokens pick different experts; the seed is advanced until every MoE layer routes
at least three distinct expert sets per prompt and no top-k choice is within
1e-3 of a tie, so f32 rounding cannot flip a routing decision).

Run from the repository root:

    /work/pyenv/bin/python lora-engine/tests/make_base_oracle.py

The outputs are deterministic for a given torch/transformers version and are
meant to be committed.
"""

import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")

VOCAB = 128
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
INTER = 64
PROMPT_LENS = (9, 6)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=256,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

# name -> (config class, model class, config kwargs, options)
CASES = {
    # Biases on every projection (attention_bias, mlp_bias); the RoPE base is
    # written the pre-transformers-5 way (top-level rope_theta) after saving.
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5),
        dict(legacy_rope_theta=500000.0),
    ),
    # Explicit head_dim != hidden/heads and a sliding window shorter than the prompts.
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(head_dim=16, sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        dict(),
    ),
    # q/k/v biases (always on in Qwen2), o_proj without.
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        dict(),
    ),
    # q_norm/k_norm, explicit head_dim, untied lm_head.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=16, tie_word_embeddings=False),
        dict(),
    ),
    # Tied lm_head (no lm_head tensor in the file), weights stored as BF16.
    "qwen3_tied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=8, tie_word_embeddings=True),
        dict(bf16=True),
    ),
    # Fused experts (transformers 5 layout), a dense layer from mlp_only_layers,
    # renormalized top-k.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
        dict(fused=True),
    ),
    # Per-expert legacy layout (what save_pretrained writes by default),
    # decoder_sparse_step 2 (layer 0 dense, layer 1 MoE), top-k not renormalized.
    "qwen3_moe_legacy": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            norm_topk_prob=False,
        ),
        dict(fused=False),
    ),
    # Fused experts; Mixtral's experts use intermediate_size.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        dict(fused=True),
    ),
    # Legacy block_sparse_moe.experts.N.w1/w2/w3 layout.
    "mixtral_legacy": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        dict(fused=False),
    ),
}


def impl_kwargs(cfg):
    """The reference implementations: eager attention and, for MoE, the eager per-expert loop."""
    kwargs = dict(attn_implementation="eager")
    if getattr(cfg, "num_experts_per_tok", 0):
        kwargs["experts_implementation"] = "eager"
    return kwargs


def randomize(model, gen):
    """Every parameter gets a seeded value with a scale that keeps activations O(1)."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                # router: logits with a spread of several units
                p.copy_(0.6 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)


def moe_layers(model):
    out = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            out.append(i)
    return out


def routing(model, ids):
    """Per MoE layer: (probs [len, E], topk indices [len, k]) from transformers' own router."""
    records = {}
    hooks = []
    for i in moe_layers(model):
        router = model.model.layers[i].mlp.gate

        def hook(module, args, output, i=i):
            logits, _scores, indices = output
            records[i] = (torch.softmax(logits.float(), dim=-1), indices)

        hooks.append(router.register_forward_hook(hook))
    with torch.no_grad():
        out = model(input_ids=ids[None, :])
    for h in hooks:
        h.remove()
    return out.logits[0].float(), records


def routing_ok(records, top_k):
    for probs, indices in records.values():
        sets = {tuple(sorted(row.tolist())) for row in indices}
        if len(sets) < 3:
            return False
        sorted_p = probs.sort(dim=-1, descending=True).values
        gap = sorted_p[:, top_k - 1] - sorted_p[:, top_k]
        if gap.min().item() < 1e-3:
            return False
    return True


def build(name, cfg_cls, model_cls, cfg_kwargs, opts):
    kwargs = dict(COMMON)
    kwargs.update(cfg_kwargs)
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    top_k = getattr(cfg, "num_experts_per_tok", 0)
    for attempt in range(200):
        seed = 1000 + attempt
        gen = torch.Generator().manual_seed(seed)
        model = getattr(transformers, model_cls)._from_config(cfg, **impl_kwargs(cfg)).eval()
        randomize(model, gen)
        if opts.get("bf16"):
            # round the weights to bf16 now, so the in-memory model is exactly the saved one
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]
        if top_k and not all(routing_ok(routing(model, ids)[1], top_k) for ids in prompts):
            continue
        return model, prompts, seed
    sys.exit(f"{name}: no seed gave well-separated routing")


def main():
    torch.set_grad_enabled(False)
    os.makedirs(DATA, exist_ok=True)
    summary = {}
    for name, (cfg_cls, model_cls, cfg_kwargs, opts) in CASES.items():
        model, prompts, seed = build(name, cfg_cls, model_cls, cfg_kwargs, opts)
        out_dir = os.path.join(DATA, name)
        shutil.rmtree(out_dir, ignore_errors=True)
        if opts.get("bf16"):
            model = model.to(torch.bfloat16)
        model.save_pretrained(
            out_dir, safe_serialization=True, save_original_format=not opts.get("fused", False)
        )
        gen_cfg = os.path.join(out_dir, "generation_config.json")
        if os.path.exists(gen_cfg):
            os.remove(gen_cfg)
        if "legacy_rope_theta" in opts:
            path = os.path.join(out_dir, "config.json")
            with open(path) as f:
                cfg_json = json.load(f)
            cfg_json.pop("rope_parameters", None)
            cfg_json["rope_theta"] = opts["legacy_rope_theta"]
            with open(path, "w") as f:
                json.dump(cfg_json, f, indent=2, sort_keys=True)
                f.write("\n")

        # The oracle is the model as transformers loads it back from the folder.
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            out_dir, dtype=torch.float32, **impl_kwargs(model.config)
        ).eval()
        if "legacy_rope_theta" in opts:
            assert loaded.config.rope_parameters["rope_theta"] == opts["legacy_rope_theta"]
        # saving/loading (incl. the legacy expert conversion) is lossless
        saved, reloaded = model.state_dict(), loaded.state_dict()
        assert sorted(saved) == sorted(reloaded), f"{name}: reload changed the parameter names"
        for key, value in saved.items():
            assert torch.equal(value.float(), reloaded[key]), f"{name}: reload changed {key}"
        tensors = {}
        for p, ids in enumerate(prompts):
            logits, records = routing(loaded, ids)
            tensors[f"prompt{p}.ids"] = ids.to(torch.int32).contiguous()
            tensors[f"prompt{p}.logits"] = logits.contiguous()
            for layer, (_probs, indices) in sorted(records.items()):
                tensors[f"prompt{p}.topk.layer{layer}"] = indices.to(torch.int32).contiguous()
        save_file(tensors, os.path.join(out_dir, "base_logits.safetensors"))
        size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
        summary[name] = dict(seed=seed, bytes=size, files=sorted(os.listdir(out_dir)))
        print(f"{name}: seed {seed}, {size} bytes, moe layers {moe_layers(loaded)}")
    total = sum(v["bytes"] for v in summary.values())
    print(f"total {total} bytes; torch {torch.__version__}, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
