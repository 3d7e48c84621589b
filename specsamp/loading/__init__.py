"""Load a model by name or path: the embedded default, a GGUF file, or a Hugging Face folder,
local or on gs:// (any fsspec URL).

    m = load_model(None)                  # the embedded default (downloaded on first use)
    m = load_model("gs://bucket/my-hf-folder")
    m.cfg, m.params, m.tokenizer, m.name

Parameters come back as float32 jax arrays in the layout of
`specsamp.models.llama.Transformer(m.cfg)`. A GGUF file is dequantized once and the float32
result kept in the cache (keyed by the file's sha256): reading it back is several times
faster than parsing and dequantizing again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from specsamp.errors import UserError
from specsamp.loading import fs

if TYPE_CHECKING:  # JAX and Flax load only when a model does: `specsamp --help` stays instant
    from specsamp.models.llama import ModelConfig
    from specsamp.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2"
_CACHE_FORMAT = 1  # bump when the converted layout changes, so old caches are ignored


@dataclass(frozen=True)
class LoadedModel:
    cfg: ModelConfig
    params: dict  # nested dict of float32 jax arrays, Transformer(cfg)'s tree
    tokenizer: Tokenizer
    name: str  # short id for reports: "smollm2" or the path as given
    load_seconds: float = 0.0


def load_model(spec: str | None = None) -> LoadedModel:
    """The model named by `spec`: None or "smollm2" (the embedded default), or a local path
    or URL of a .gguf file or of a Hugging Face folder."""
    start = time.perf_counter()
    name = spec or DEFAULT_MODEL
    if name == DEFAULT_MODEL:
        from specsamp.download import ensure_smollm2

        cfg, flat, tokenizer = _load_gguf(ensure_smollm2())
    else:
        cfg, flat, tokenizer = _load_path(name)
    params = _to_jax_tree(flat, cfg, name)
    return LoadedModel(cfg, params, tokenizer, name, time.perf_counter() - start)


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculative sampling compares the two models' probabilities token by token, so both
    must index the same vocabulary with the same ids."""
    t, d = target.tokenizer, draft.tokenizer
    if t.fingerprint != d.fingerprint:
        raise UserError(
            f"draft {draft.name} does not share the target's vocabulary "
            f"({d.vocab_size} tokens, fingerprint {d.fingerprint} vs {t.vocab_size} tokens, "
            f"fingerprint {t.fingerprint}); pick a draft from the same model family")
    if target.cfg.vocab_size != draft.cfg.vocab_size:
        raise UserError(
            f"draft {draft.name} has {draft.cfg.vocab_size} output rows but the target has "
            f"{target.cfg.vocab_size}; both heads must have the same size")


def _load_path(path: str):
    path = path.removeprefix("file://")
    kind = fs.kind_of(path)
    if kind == "missing":
        raise UserError(f"no model at {path} (expected a .gguf file or a Hugging Face folder)")
    if kind == "file":
        if not path.lower().endswith(".gguf"):
            raise UserError(f"{path}: expected a .gguf file or a Hugging Face folder")
        return _load_gguf(fs.local_file(path))
    return _load_hf(path)


def _load_hf(path: str):
    from specsamp.loading.hf import FILES, read_hf

    if fs.is_remote(path):
        # Copy the files the loader reads (shards included) and read the local copy.
        names = fs.list_dir(path)
        if "config.json" not in names:
            raise UserError(f"no model at {path}: no config.json there")
        wanted = [n for n in names if n in FILES or n.endswith(".safetensors")]
        path = str(fs.mirror([f"{path.rstrip('/')}/{n}" for n in wanted]))
    elif not os.path.exists(os.path.join(path, "config.json")):
        raise UserError(f"no model at {path}: a Hugging Face folder needs a config.json")
    return read_hf(path)


def _load_gguf(path: str):
    from specsamp import tokenizer as tok

    folder = fs.cache_dir("converted") / f"{fs.sha256_file(path)[:32]}-v{_CACHE_FORMAT}"
    if (folder / "model.json").exists():
        return _read_converted(folder)
    from specsamp.loading.gguf import read_gguf

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

    from specsamp import tokenizer as tok
    from specsamp.models.llama import ModelConfig

    with open(folder / "model.json", encoding="utf-8") as f:
        saved = json.load(f)
    with open(folder / "tokenizer.json", encoding="utf-8") as f:
        tokenizer = tok.from_saved(f.read(), saved["tokenizer"])
    return ModelConfig(**saved["config"]), load_file(folder / "params.safetensors"), tokenizer


def _to_jax_tree(flat: dict, cfg: ModelConfig, name: str) -> dict:
    """Nest {"a/b/c": array} into the Transformer's parameter tree, as float32 jax arrays,
    after checking every shape against the model built from `cfg` (a checkpoint whose
    config disagrees with its weights is refused here rather than failing inside jit)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specsamp.models.llama import Transformer, init_cache

    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    expected = jax.eval_shape(
        lambda t: Transformer(cfg).init(jax.random.PRNGKey(0), t, t, init_cache(cfg, 1, 1)), tokens
    )["params"]
    want = {"/".join(k.key for k in path): leaf.shape
            for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]}
    got = {k: tuple(v.shape) for k, v in flat.items()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:3]
        raise UserError(f"{name}: weights do not match the model its config describes: {diff}")
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jnp.asarray(np.asarray(value, dtype=np.float32))
    return tree
