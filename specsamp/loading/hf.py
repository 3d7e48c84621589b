"""Hugging Face checkpoint folders -> ModelConfig, parameters at the run's dtype, Tokenizer
(the families and their weight names: `specsamp.loading.families`).

A folder holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json), tokenizer.json and optionally tokenizer_config.json,
generation_config.json and chat_template.jinja. Weights are [out, in] (PyTorch); our Dense
kernels are [in, out]. Q and K are already in rotate-half order: nothing to unpermute.
The shards of a remote folder are read where they are (`open_hf(local, shards_at=url)`),
its small files from a local copy.
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

__all__ = ["ARCHITECTURES", "FILES", "config_from_hf", "open_hf", "read_hf"]

# The files besides the shards a loader may read; of a remote folder, these (when present)
# are copied, the shards read where they are.
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "model.safetensors.index.json")
_LAYER_WEIGHTS = LAYER_WEIGHTS  # Llama's names (the draft exporter writes them)


def read_hf(folder: str, with_tokenizer: bool = True, dtype="float32"):
    """(config, flat dict of numpy arrays at `dtype`, tokenizer or None) from a local folder."""
    with open_hf(folder) as ckpt:
        params = ckpt.params(np.dtype(dtype))
        return ckpt.cfg, params, ckpt.tokenizer() if with_tokenizer else None


def open_hf(folder: str, shards_at: str | None = None) -> "HFCheckpoint":
    """The checkpoint in `folder` (config.json, tokenizer files), its shards' headers read
    once; the shards themselves in `folder`, or read remotely from the URL `shards_at`."""
    model_config = _read_json(folder, "config.json", required=True)
    cfg = config_from_hf(model_config)
    return HFCheckpoint(folder, model_config, cfg, _open_shards(folder, shards_at))


class HFCheckpoint:
    """An opened checkpoint: its config, and shards whose headers are read (`open_hf`)."""

    def __init__(self, folder: str, model_config: dict, cfg: ModelConfig, shards: list):
        self.folder, self.model_config, self.cfg, self.shards = folder, model_config, cfg, shards

    def stored_dtype(self) -> str:
        """The float type most of the model's weight bytes are stored in ('bfloat16', ...);
        tensors the model does not use (a vision tower) do not count."""
        where = _where(self.shards)
        by_type: dict = {}
        for name in _destinations(self.cfg, where).keys() & where.keys():
            dtype, _, begin, end = where[name].entries[name]
            by_type[np.dtype(dtype).name] = by_type.get(np.dtype(dtype).name, 0) + end - begin
        return max(by_type, key=by_type.get) if by_type else "float32"

    def params(self, dtype) -> dict:
        return _params(self.folder, self.shards, self.cfg, np.dtype(dtype))

    def tokenizer(self):
        folder = self.folder
        if not os.path.exists(os.path.join(folder, "tokenizer.json")):
            raise UserError(f"{folder} has no tokenizer.json")
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
            tokenizer_json = f.read()
        template_path = os.path.join(folder, "chat_template.jinja")
        template = None
        if os.path.exists(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        return tok.from_hf_files(tokenizer_json, _read_json(folder, "tokenizer_config.json"),
                                 self.model_config, _read_json(folder, "generation_config.json"),
                                 chat_template=template)

    def close(self) -> None:
        for f in self.shards:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


def _open_shards(folder: str, shards_at: str | None) -> list:
    """Each shard (listed in model.safetensors.index.json, else model.safetensors) opened,
    its header read: from `folder`, or from the URL `shards_at` without a local copy."""
    from specsamp import fs
    from specsamp.loading.safetensors_file import SafetensorsFile

    index = _read_json(folder, "model.safetensors.index.json")
    names = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    if shards_at is None:
        missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
    else:
        present = set(fs.list_dir(shards_at))
        missing = [n for n in names if n not in present]
    if missing:
        raise UserError(f"{shards_at or folder} has no {missing[0]}"
                        + (f" (and {len(missing) - 1} more shards)" if len(missing) > 1 else ""))
    shards: list = []
    try:
        for n in names:
            if shards_at is None:
                shards.append(SafetensorsFile(os.path.join(folder, n)))
            else:
                remote, path = fs.filesystem(fs.join(shards_at, n))
                shards.append(SafetensorsFile(path, remote))
    except BaseException:
        for f in shards:
            f.close()
        raise
    return shards


# Where the text model's weights are: (prefix of the body, prefix of lm_head). The second
# and third are a multimodal checkpoint's (Gemma3ForConditionalGeneration): as published
# (transformers 4.50) and as transformers >= 4.52 saves it; the tower's weights are skipped.
_LAYOUTS = (("model.", ""), ("language_model.model.", "language_model."),
            ("model.language_model.", ""))


def _where(shards: list) -> dict:
    """{tensor name: the shard holding it}."""
    return {key: f for f in shards for key in f.keys()}


def _destinations(cfg: ModelConfig, names) -> dict:
    """HF weight name -> (our flat key, layer index or None, transposed), under the layout
    whose embedding is among `names` (the first layout's if none is)."""
    body, head = next(((b, h) for b, h in _LAYOUTS if f"{b}embed_tokens.weight" in names),
                      _LAYOUTS[0])
    out = {f"{body}embed_tokens.weight": ("embed/embedding", None, False),
           f"{body}norm.weight": ("final_norm/scale", None, False)}
    for suffix, dest in layer_weights(cfg).items():
        for i in range(cfg.n_layers):
            out[f"{body}layers.{i}.{suffix}"] = (f"layers/{dest}", i, dest.endswith("kernel"))
    if not cfg.tie_embeddings:
        out[f"{head}lm_head.weight"] = ("lm_head/kernel", None, True)
    return out


def _params(folder: str, shards: list, cfg: ModelConfig, dtype) -> dict:
    """Flat {"layers/attn/q/kernel": array, ...} in the Transformer's layout, at `dtype`.

    Shard by shard, each tensor is converted once from its memory-mapped bytes (or its
    ranged reads) into its place in the result (per-layer weights into one [L, ...] array),
    then its pages are released: the peak is the result plus one tensor (plus two bounded
    pieces of a remote one). Tensors the model does not use are not read. A progress line
    per shard; each shard is closed once read."""
    where = _where(shards)
    wanted = _destinations(cfg, where)
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
    out = params[key] if layer is None else params[key][layer]
    out = out.T if transposed else out  # a view: written through in the file's row order
    shape = f.entries[name][1]
    if tuple(shape) != out.shape:
        raise UserError(f"{folder}: weight {name} has shape {tuple(shape)}, expected {out.shape}")
    for first, piece in f.pieces(name):  # one conversion, straight from the file's bytes
        if piece.ndim:
            out[first:first + len(piece)] = piece
        else:
            out[...] = piece
    f.release(name)
