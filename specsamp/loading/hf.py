"""Hugging Face checkpoint folders -> ModelConfig, float32 parameters, Tokenizer (the
families and their weight names: `specsamp.loading.families`).

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
from specsamp.loading.families import ARCHITECTURES, LAYER_WEIGHTS, config_from_hf, layer_weights
from specsamp.models.llama import ModelConfig

__all__ = ["ARCHITECTURES", "FILES", "config_from_hf", "read_hf"]

# Files a loader may read; a remote folder is copied with exactly these (when present).
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "model.safetensors", "model.safetensors.index.json")
_LAYER_WEIGHTS = LAYER_WEIGHTS  # Llama's names (the draft exporter writes them)


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
    for suffix, dest in layer_weights(cfg).items():
        stack = [take(f"model.layers.{i}.{suffix}") for i in range(cfg.n_layers)]
        stack = [a.T if dest.endswith("kernel") else a for a in stack]
        params[f"layers/{dest}"] = np.ascontiguousarray(np.stack(stack))
    if not cfg.tie_embeddings:
        params["lm_head/kernel"] = np.ascontiguousarray(take("lm_head.weight").T)
    return params
