"""Hugging Face checkpoint folders -> ModelConfig, float32 parameters, Tokenizer.

A folder holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json), tokenizer.json and optionally tokenizer_config.json,
generation_config.json and chat_template.jinja. Weights are [out, in] (PyTorch); our Dense
kernels are [in, out]. Q and K are already in rotate-half order: nothing to unpermute.
"""

from __future__ import annotations

import json
import os

import numpy as np

from specsamp.errors import UserError
from specsamp.loading import tokenizer as tok
from specsamp.models.llama import ModelConfig

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Files a loader may read; a remote folder is copied with exactly these (when present).
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "model.safetensors", "model.safetensors.index.json")

# HF per-layer weight -> our path under `layers` (kernels are transposed to [in, out])
_LAYER_WEIGHTS = {
    "input_layernorm.weight": "attn_norm/scale",
    "self_attn.q_proj.weight": "attn/q/kernel",
    "self_attn.k_proj.weight": "attn/k/kernel",
    "self_attn.v_proj.weight": "attn/v/kernel",
    "self_attn.o_proj.weight": "attn/o/kernel",
    "self_attn.q_proj.bias": "attn/q/bias",
    "self_attn.k_proj.bias": "attn/k/bias",
    "self_attn.v_proj.bias": "attn/v/bias",
    "post_attention_layernorm.weight": "mlp_norm/scale",
    "mlp.gate_proj.weight": "mlp/gate/kernel",
    "mlp.up_proj.weight": "mlp/up/kernel",
    "mlp.down_proj.weight": "mlp/down/kernel",
}


def read_hf(folder: str, with_tokenizer: bool = True):
    """(config, flat dict of float32 numpy arrays, tokenizer or None) from a local folder."""
    model_config = _read_json(folder, "config.json", required=True)
    cfg = config_from_hf(model_config)
    weights = _load_safetensors(folder)
    params = _params(weights, cfg, folder)
    if not with_tokenizer:
        return cfg, params, None
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        raise UserError(f"{folder} has no tokenizer.json")
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer_json = f.read()
    template_path = os.path.join(folder, "chat_template.jinja")
    template = None
    if os.path.exists(template_path):
        with open(template_path, encoding="utf-8") as f:
            template = f.read()
    tokenizer = tok.from_hf_files(tokenizer_json, _read_json(folder, "tokenizer_config.json"),
                                  model_config, _read_json(folder, "generation_config.json"),
                                  chat_template=template)
    return cfg, params, tokenizer


def config_from_hf(c: dict) -> ModelConfig:
    arch = (c.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise UserError(f"architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UserError(f"RoPE scaling {rope_type!r} is not supported")
    if c.get("hidden_act", "silu") != "silu" or c.get("mlp_bias"):
        raise UserError("only SwiGLU (silu, no MLP bias) models are supported")
    n_heads = int(c["num_attention_heads"])
    max_len = int(c.get("max_position_embeddings", 8192))
    if c.get("sliding_window") and c.get("use_sliding_window", arch == "MistralForCausalLM"):
        # Within the window, sliding-window attention is full attention: stay inside it.
        max_len = min(max_len, int(c["sliding_window"]))
    return ModelConfig(
        vocab_size=int(c["vocab_size"]),
        d_model=int(c["hidden_size"]),
        n_layers=int(c["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // n_heads),
        d_ff=int(c["intermediate_size"]),
        rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama/Mistral only with attention_bias.
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(c.get("attention_bias", False)),
        max_seq_len=max_len,
    )


def _read_json(folder: str, name: str, required: bool = False) -> dict:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        if required:
            raise UserError(f"{folder} has no {name}")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def _load_safetensors(folder: str) -> dict:
    """All tensors of the folder as numpy arrays (shards included), by HF name."""
    from safetensors import safe_open

    index = _read_json(folder, "model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    weights = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise UserError(f"{folder} has no {name}")
        try:
            with safe_open(path, framework="numpy") as f:
                for key in f.keys():
                    weights[key] = f.get_tensor(key)
        except Exception as e:
            raise UserError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    return weights


def _params(w: dict, cfg: ModelConfig, folder: str) -> dict:
    """Flat {"layers/attn/q/kernel": array, ...} in the Transformer's layout."""
    def take(name):
        if name not in w:
            raise UserError(f"{folder}: weight {name} is missing")
        return np.asarray(w[name], dtype=np.float32)

    params = {"embed/embedding": take("model.embed_tokens.weight"),
              "final_norm/scale": take("model.norm.weight")}
    for suffix, dest in _LAYER_WEIGHTS.items():
        if suffix.endswith(".bias") and not cfg.qkv_bias:
            continue
        stack = [take(f"model.layers.{i}.{suffix}") for i in range(cfg.n_layers)]
        stack = [a.T if dest.endswith("kernel") else a for a in stack]
        params[f"layers/{dest}"] = np.ascontiguousarray(np.stack(stack))
    if not cfg.tie_embeddings:
        params["lm_head/kernel"] = np.ascontiguousarray(take("lm_head.weight").T)
    return params
