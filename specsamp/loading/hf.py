"""Hugging Face checkpoint folders -> ModelConfig, parameters at the run's dtype, Tokenizer
(the families and their weight names: `specsamp.loading.families`).

A folder holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json), tokenizer.json and optionally tokenizer_config.json,
generation_config.json and chat_template.jinja. Weights are [out, in] (PyTorch); our Dense
kernels are [in, out]. Q and K are already in rotate-half order: nothing to unpermute.
"""

from __future__ import annotations

import json
import os
import sys

import ml_dtypes  # noqa: F401  (registers 'bfloat16' as a numpy dtype name)
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


def read_hf(folder: str, with_tokenizer: bool = True, dtype="float32"):
    """(config, flat dict of numpy arrays at `dtype`, tokenizer or None) from a local folder."""
    model_config = _read_json(folder, "config.json", required=True)
    cfg = config_from_hf(model_config)
    params = _params(folder, cfg, np.dtype(dtype))
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


def _shard_names(folder: str) -> list[str]:
    index = _read_json(folder, "model.safetensors.index.json")
    names = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
    if missing:
        raise UserError(f"{folder} has no {missing[0]}"
                        + (f" (and {len(missing) - 1} more shards)" if len(missing) > 1 else ""))
    return names


def stored_dtype(folder: str) -> str:
    """The float type most of the folder's weight bytes are stored in ('bfloat16', ...)."""
    from specsamp.loading.safetensors_file import SafetensorsFile

    by_type: dict = {}
    for name in _shard_names(folder):
        with SafetensorsFile(os.path.join(folder, name)) as f:
            for key, (dtype, _, begin, end) in f.entries.items():
                by_type[np.dtype(dtype).name] = by_type.get(np.dtype(dtype).name, 0) + end - begin
    return max(by_type, key=by_type.get) if by_type else "float32"


def _destinations(cfg: ModelConfig) -> dict:
    """HF weight name -> (our flat key, layer index or None, transposed)."""
    out = {"model.embed_tokens.weight": ("embed/embedding", None, False),
           "model.norm.weight": ("final_norm/scale", None, False)}
    for suffix, dest in layer_weights(cfg).items():
        for i in range(cfg.n_layers):
            out[f"model.layers.{i}.{suffix}"] = (f"layers/{dest}", i, dest.endswith("kernel"))
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ("lm_head/kernel", None, True)
    return out


def _params(folder: str, cfg: ModelConfig, dtype) -> dict:
    """Flat {"layers/attn/q/kernel": array, ...} in the Transformer's layout, at `dtype`.

    Shard by shard, each tensor is converted once from its memory-mapped bytes into its
    place in the result (per-layer weights into one [L, ...] array), then its pages are
    released: the peak is the result plus one tensor. A progress line per shard."""
    from specsamp.loading.safetensors_file import SafetensorsFile

    shards = [SafetensorsFile(os.path.join(folder, n)) for n in _shard_names(folder)]
    try:
        where = {key: f for f in shards for key in f.keys()}
        wanted = _destinations(cfg)
        missing = [name for name in wanted if name not in where]
        if missing:
            raise UserError(f"{folder}: weight {missing[0]} is missing")
        params = _allocate(wanted, where, cfg, dtype)
        for n, f in enumerate(shards, 1):
            for name in f.keys():
                if name in wanted:
                    _place(params, wanted[name], f, name, folder)
            f.close()
            print(f"read {os.path.basename(f.path)} ({n}/{len(shards)}, "
                  f"{f.size / 1e9:.2f} GB)", file=sys.stderr, flush=True)
        return params
    finally:
        for f in shards:
            f.close()


def _allocate(wanted: dict, where: dict, cfg: ModelConfig, dtype) -> dict:
    """An empty array at `dtype` for every destination (pages are committed as filled)."""
    shapes = {}
    for name, (key, layer, transposed) in wanted.items():
        if key not in shapes:
            shape = where[name].entries[name][1]
            shape = shape[::-1] if transposed else shape
            shapes[key] = shape if layer is None else (cfg.n_layers, *shape)
    return {key: _aligned_empty(shape, dtype) for key, shape in shapes.items()}


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """np.empty on a 64-byte boundary, which JAX's CPU client adopts without a copy."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(size + align, np.uint8)
    start = -buf.ctypes.data % align
    return buf[start:start + size].view(dtype).reshape(shape)


def _place(params: dict, dest: tuple, f, name: str, folder: str) -> None:
    key, layer, transposed = dest
    src = f.tensor(name)
    src = src.T if transposed else src
    out = params[key] if layer is None else params[key][layer]
    if src.shape != out.shape:
        raise UserError(f"{folder}: weight {name} has shape {src.shape[::-1] if transposed else src.shape}, "
                        f"expected {out.shape[::-1] if transposed else out.shape}")
    out[...] = src  # one conversion, straight from the mapped bytes
    del src
    f.release(name)
