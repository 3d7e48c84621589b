"""Load a model by name or path: the embedded default, a GGUF file, or a Hugging Face folder,
local or on gs:// (any fsspec URL).

    m = load_model(None)                  # the embedded default (downloaded on first use)
    m = load_model("gs://bucket/my-hf-folder", weights="int8")
    m.cfg, m.params, m.tokenizer, m.name

Parameters come back as jax arrays in the layout of `specsamp.models.llama.Transformer(m.cfg)`.
`weights` says in which form (WEIGHTS):
- "stored" (the default): as the file stores them. GGUF matrices in Q4_0, Q4_1 and Q8_0 stay
  in their blocks (`specsamp.quant.QWeight`), the same model at a quarter of the bytes; other
  tensors, and Hugging Face checkpoints, are floats at `dtype`. Nothing is written to the cache.
- "stored-a8": "stored" with 8-bit activations: products of the Q4_1/Q8_0 matrices round each
  block of 32 inputs to bytes and sum byte products (llama.cpp's arithmetic for these
  formats, `specsamp.quant.blocks`): a slightly different model from "stored", whose extra
  scored rows (K + 1 tokens, a tree) cost about a third as much on a CPU without AMX.
  Native CPU kernels only (no tensor-parallel mesh); a float checkpoint loads as with "stored".
- "float32": everything dequantized (then held at `dtype`). A GGUF file is dequantized once and the
  float32 result kept in the cache (keyed by the file's sha256): reading it back is several
  times faster than parsing and dequantizing again.
- "int8": the float32 weights rounded to int8 per output channel (weight-only): a different
  model from its source, nearly the same; speculative sampling is exact for it as for any.

`dtype` says what the float weights (and so the activations and the KV cache, which follow
them) are held in (DTYPES): "float32", "bfloat16", or "auto": float32 on a CPU; on an
accelerator, bfloat16 for a Hugging Face checkpoint stored in bfloat16 or float16 (bfloat16
has float32's range, so a float16 checkpoint converts without overflow), float32 otherwise.
Quantized weights ("stored" GGUF blocks, "int8") stay in their blocks at any dtype; their
products come out in the run's dtype. A Hugging Face checkpoint is read tensor by tensor,
each converted once to the run's dtype (`hf.open_hf`), and placed as it is converted
(`_to_jax_tree`): the peak is the weights at the run's dtype plus one stacked tensor. A
remote folder's shards are read where they are, by ranged reads (no local copy); its small
files (config, tokenizer) are copied into the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from specsamp import fs
from specsamp.errors import UserError

if TYPE_CHECKING:  # JAX and Flax load only when a model does: `specsamp --help` stays instant
    from specsamp.loading.tokenizer import Tokenizer
    from specsamp.models.llama import ModelConfig

DEFAULT_MODEL = "smollm2"
WEIGHTS = ("stored", "stored-a8", "float32", "int8")
DTYPES = ("auto", "float32", "bfloat16")
_CACHE_FORMAT = 1  # bump when the converted layout changes, so old caches are ignored


@dataclass(frozen=True)
class LoadedModel:
    cfg: ModelConfig
    params: dict  # Transformer(cfg)'s tree: jax arrays at `dtype` or quantized QWeights
    tokenizer: Tokenizer
    name: str  # short id for reports: "smollm2" or the path as given
    load_seconds: float = 0.0
    weights: str = "float32"  # one of WEIGHTS
    dtype: str = "float32"  # the float weights' type, "auto" resolved (DTYPES)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as held in memory (what a decode step streams)."""
        import jax

        return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(self.params))


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise UserError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    return weights


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def resolve_dtype(dtype: str, stored: str | None) -> str:
    """`dtype` with "auto" resolved for a checkpoint whose floats are stored as `stored`
    (None: not a float checkpoint, e.g. GGUF blocks)."""
    if check_dtype(dtype) != "auto":
        return dtype
    import jax

    on_accelerator = jax.default_backend() != "cpu"
    return "bfloat16" if on_accelerator and stored in ("bfloat16", "float16") else "float32"


def load_model(spec: str | None = None, weights: str = "stored", dtype: str = "auto",
               mesh=None) -> LoadedModel:
    """The model named by `spec`: None or "smollm2" (the embedded default), or a local path
    or URL of a .gguf file or of a Hugging Face folder; weights as `weights` says, float
    weights at `dtype`; with a tensor-parallel mesh, each weight placed split over it as
    it is converted (`Model.shard_params`' placement)."""
    start = time.perf_counter()
    name = spec or DEFAULT_MODEL
    stored = check_weights(weights) in ("stored", "stored-a8")
    if weights == "stored-a8" and mesh is not None:
        raise UserError("weights 'stored-a8' run on one CPU's native kernels, not on a "
                        "tensor-parallel mesh: use --weights stored")
    check_dtype(dtype)
    if name == DEFAULT_MODEL:
        from specsamp.loading.download import ensure_smollm2

        cfg, flat, tokenizer = _load_gguf(ensure_smollm2(), stored)
        dtype = resolve_dtype(dtype, None)
    else:
        cfg, flat, tokenizer, dtype = _load_path(name, stored, dtype, weights == "int8")
    if weights == "int8":
        flat = _int8(flat)
    params = _to_jax_tree(flat, cfg, name, dtype, mesh,
                          "int8" if weights == "stored-a8" else "float32")
    return LoadedModel(cfg, params, tokenizer, name, time.perf_counter() - start, weights, dtype)


def _int8(flat: dict) -> dict:
    """Every weight matrix (kernels, embedding, head) as int8 per output channel."""
    from specsamp.quant import quantize_int8_rows

    out = dict(flat)
    for key, w in flat.items():
        if key.endswith("/kernel"):  # [..., in, out]: channels are the last axis
            out[key] = {**quantize_int8_rows(np.swapaxes(w, -1, -2)), "transposed": True}
        elif key == "embed/embedding":  # [V, D]: a channel is a token's row
            out[key] = {**quantize_int8_rows(w), "transposed": False}
    return out


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculative sampling compares the two models' probabilities token by token, so both
    must index the same vocabulary with the same ids. The draft's head may be smaller than
    the target's (families pad their larger models' embeddings further): its logits are
    padded (`ModelDrafter.vocab_size`). A larger one is refused."""
    t, d = target.tokenizer, draft.tokenizer
    if t.fingerprint != d.fingerprint:
        i = first_different_token(t, d)
        raise UserError(
            f"draft {draft.name} does not share the target's vocabulary: token {i} is "
            f"{t.token_text(i)!r} in the target, {d.token_text(i)!r} in the draft "
            f"({t.vocab_size} and {d.vocab_size} tokens); pick a draft from the same model family")
    check_draft_head(draft.cfg.vocab_size, target.cfg.vocab_size, draft.name)


def check_draft_head(draft_rows: int, target_rows: int, draft_name: str = "") -> None:
    """A draft's head may have fewer rows than the target's (its logits are padded), not
    more: its extra ids exist in neither vocabulary for the target. The one place this
    refusal is worded."""
    if draft_rows > target_rows:
        raise UserError(
            f"draft {draft_name or 'model'} has {draft_rows} output rows but the target has "
            f"{target_rows}; the draft's head may not be larger than the target's")


def first_different_token(a: Tokenizer, b: Tokenizer) -> int:
    """The least id whose token differs between two tokenizers (or exists in one only)."""
    for i in range(max(a.vocab_size, b.vocab_size)):
        if a.token_text(i) != b.token_text(i):
            return i
    return min(a.vocab_size, b.vocab_size)  # same tokens: they differ in what the ids mean


def _load_path(path: str, stored: bool, dtype: str, int8: bool):
    """(cfg, flat params, tokenizer, the run's dtype: `dtype` with "auto" resolved for
    what the checkpoint stores); a Hugging Face folder's floats come at that dtype, or at
    float32 for `int8` (which rounds the float32 weights; the rest is cast afterwards)."""
    path = path.removeprefix("file://")
    kind = fs.kind_of(path)
    if kind == "missing":
        raise UserError(f"no model at {path} (expected a .gguf file or a Hugging Face folder)")
    if kind == "file":
        if not path.lower().endswith(".gguf"):
            raise UserError(f"{path}: expected a .gguf file or a Hugging Face folder")
        return (*_load_gguf(fs.local_file(path), stored), resolve_dtype(dtype, None))
    return _load_hf(path, dtype, int8)


def _load_hf(path: str, dtype: str, int8: bool):
    from specsamp.loading.hf import FILES, open_hf

    shards_at = None
    if fs.is_remote(path):
        # The small files are copied; the shards are read where they are.
        names = fs.list_dir(path)
        if "config.json" not in names:
            raise UserError(f"no model at {path}: no config.json there")
        shards_at = path.rstrip("/")
        path = str(fs.mirror([f"{shards_at}/{n}" for n in names if n in FILES]))
    elif not os.path.exists(os.path.join(path, "config.json")):
        raise UserError(f"no model at {path}: a Hugging Face folder needs a config.json")
    with open_hf(path, shards_at) as ckpt:
        dtype = resolve_dtype(dtype, ckpt.stored_dtype())
        flat = ckpt.params("float32" if int8 else dtype)
        return ckpt.cfg, flat, ckpt.tokenizer(), dtype


def _load_gguf(path: str, stored: bool):
    from specsamp.loading import tokenizer as tok
    from specsamp.loading.gguf import read_gguf

    if stored:  # the blocks are read straight from the file: no float32 copy in the cache
        return read_gguf(path, stored=True)
    folder = fs.cache_dir("converted") / f"{fs.sha256_file(path)[:32]}-v{_CACHE_FORMAT}"
    if (folder / "model.json").exists():
        return _read_converted(folder)
    cfg, flat, tokenizer = read_gguf(path)
    try:
        _write_converted(folder, cfg, flat, tokenizer, tok.meta_to_json(tokenizer.meta))
    except OSError:  # a read-only or full cache only costs the next load its speed
        pass
    return cfg, flat, tokenizer


def _write_converted(folder, cfg, flat, tokenizer, tok_meta: dict) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    tmp = tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.")
    try:
        # save_file writes each array's raw buffer: strided views must be made contiguous.
        save_file({k: np.ascontiguousarray(v) for k, v in flat.items()},
                  os.path.join(tmp, "params.safetensors"))
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer.to_json())
        with open(os.path.join(tmp, "model.json"), "w", encoding="utf-8") as f:
            json.dump({"config": asdict(cfg), "tokenizer": tok_meta}, f)
        os.replace(tmp, folder)  # model.json appears with the rest or not at all
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _read_converted(folder):
    from safetensors.numpy import load_file

    from specsamp.loading import tokenizer as tok
    from specsamp.models.llama import ModelConfig

    with open(folder / "model.json", encoding="utf-8") as f:
        saved = json.load(f)
    with open(folder / "tokenizer.json", encoding="utf-8") as f:
        tokenizer = tok.from_saved(f.read(), saved["tokenizer"])
    return ModelConfig(**saved["config"]), load_file(folder / "params.safetensors"), tokenizer


def _to_jax_tree(flat: dict, cfg: ModelConfig, name: str, dtype: str = "float32",
                 mesh=None, activations: str = "float32") -> dict:
    """Nest {"a/b/c": array} into the Transformer's parameter tree, float arrays as jax
    arrays at `dtype`, after checking every shape against the model built from `cfg` (a
    checkpoint whose config disagrees with its weights is refused here rather than failing
    inside jit). `flat` is emptied as its arrays are placed: each host array is freed as
    soon as its device copy exists, so the two are never both whole. `activations` "int8"
    ("stored-a8"): quantized matrices take 8-bit activations (float checkpoints stay as
    they are, as with "stored")."""
    import jax
    import jax.numpy as jnp

    from specsamp.models import Model
    from specsamp.quant import to_qweight
    from specsamp.quant.blocks import block_bits
    from specsamp.quant.kernels import default_backend

    quantized = any(isinstance(v, dict) for v in flat.values())
    backend = default_backend() if quantized else "xla"
    if activations == "int8" and quantized and backend != "cpu":
        raise UserError(f"{name}: weights 'stored-a8' need the native CPU kernels (a CPU "
                        "backend where the package's kernels load): use --weights stored")

    def shape(v):
        if not isinstance(v, dict):
            return tuple(v.shape)
        rows, cols = v["codes"].shape[-2], block_bits(v)[1] * v["scale"].shape[-1]
        return tuple(v["codes"].shape[:-2]) + ((cols, rows) if v["transposed"] else (rows, cols))

    def to_jax(key, v):
        if mesh is not None:
            from specsamp.models.sharding import place_leaf

            v = v if isinstance(v, dict) else np.asarray(v, dtype=np.dtype(dtype))
            leaf = to_qweight(v, v["transposed"], "xla") if isinstance(v, dict) else v
            return jax.block_until_ready(place_leaf(cfg, tuple(key.split("/")), leaf, mesh))
        if not isinstance(v, dict):
            v = np.asarray(v, dtype=np.dtype(dtype))
            # A host array of our own (writeable: not a view of a mapped file) is handed
            # over: on a CPU, device_put keeps a 64-byte aligned one as it is (no copy;
            # `hf.read_hf` allocates so). Placed now: a pending transfer holds its host
            # array, and every one would stay alive until the weights' first use.
            placed = jax.device_put(v) if v.flags.writeable else jnp.asarray(v)
            return placed.block_until_ready()
        return to_qweight(v, v["transposed"], backend, activations)

    expected = Model(cfg).param_shapes()
    want = {"/".join(k.key for k in path): leaf.shape
            for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]}
    got = {k: shape(v) for k, v in flat.items()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:3]
        raise UserError(f"{name}: weights do not match the model its config describes: {diff}")
    tree: dict = {}
    for key in list(flat):
        *parents, leaf = key.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = to_jax(key, flat.pop(key))
    return tree
