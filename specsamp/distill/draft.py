"""The wide, shallow draft (architecture a): n layers of the target's width, initialised
from chosen target layers, reading the target's embedding (frozen) and, for tied models,
using it as the head too. Saved as a Hugging Face Llama folder, so `load_model(PATH)` and
`--draft PATH` use it like any other draft.

Parameters are split in two trees: `trainable` (layers, final norm) and `frozen` (the
embedding, and an untied target's head). The model is the engine's own `Transformer` with
`n_layers` layers, so what is trained is exactly what the engine drafts with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from specsamp.errors import UserError
from specsamp.loading.hf import _LAYER_WEIGHTS
from specsamp.models.llama import ModelConfig

FROZEN = ("embed", "lm_head")


def draft_config(target_cfg: ModelConfig, n_layers: int) -> ModelConfig:
    return dataclasses.replace(target_cfg, n_layers=n_layers)


def init_from_target(target_params: dict, init_layers: tuple[int, ...], target_layers: int):
    """(trainable, frozen) trees: layers copied from target layers `init_layers`.

    The frozen embedding is rounded through float16, the precision it is saved in, so the
    draft that is trained and the draft that is loaded are the same function."""
    import jax
    import jax.numpy as jnp

    bad = [i for i in init_layers if not 0 <= i < target_layers]
    if bad or not init_layers:
        raise UserError(f"init_layers must be target layer indices 0..{target_layers - 1}, got {list(init_layers)}")
    from specsamp.models import Model

    idx = jnp.asarray(init_layers)
    trainable = {"layers": Model.layer_params(target_params, idx),
                 "final_norm": target_params["final_norm"]}
    frozen = {k: jax.tree.map(lambda a: a.astype(jnp.float16).astype(jnp.float32), v)
              for k, v in target_params.items() if k in FROZEN}
    return trainable, frozen


def merge(trainable: dict, frozen: dict) -> dict:
    return {**frozen, **trainable}


def own_bytes(trainable: dict) -> int:
    """Bytes of the draft's own weights at float16 (what a shipped file would hold)."""
    import jax

    return sum(int(np.prod(a.shape)) * 2 for a in jax.tree.leaves(trainable))


def hf_config(cfg: ModelConfig, tokenizer) -> dict:
    eos = list(getattr(tokenizer, "eos_ids", ()) or ())
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "bos_token_id": getattr(tokenizer, "bos_id", None),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": "float32",
    }


def save_hf(folder: str, cfg: ModelConfig, params: dict, tokenizer, extra: dict | None = None) -> None:
    """Write a Hugging Face Llama folder (config.json, model.safetensors, tokenizer files).

    The embedding is stored in float16 (28 MB for 49,152 x 576), the draft's own layers in
    float32. Written to a temporary folder and renamed, so a reader never sees half a draft."""
    from safetensors.numpy import save_file

    layers = params["layers"]
    weights = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"], np.float16),
               "model.norm.weight": np.asarray(params["final_norm"]["scale"], np.float32)}
    for suffix, path in _LAYER_WEIGHTS.items():
        node = layers
        try:
            for part in path.split("/"):
                node = node[part]
        except KeyError:
            continue  # q/k/v biases of models without them
        stack = np.asarray(node, np.float32)
        for i in range(cfg.n_layers):
            w = stack[i].T if path.endswith("kernel") else stack[i]
            weights[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(w)
    if not cfg.tie_embeddings:
        weights["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]["kernel"], np.float16).T)

    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".draft-")
    try:
        save_file(weights, os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(cfg, tokenizer), f, indent=1)
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer.to_json())
        meta = tokenizer.meta
        tok_cfg = {**(meta.special_strings or {}), "clean_up_tokenization_spaces": meta.clean_up_spaces}
        if meta.chat_template:
            tok_cfg["chat_template"] = meta.chat_template
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(tok_cfg, f, indent=1)
        if extra:
            with open(os.path.join(tmp, "distill.json"), "w") as f:
                json.dump(extra, f, indent=1)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a draft is for everyone to read
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
