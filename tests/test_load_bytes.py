"""Hugging Face checkpoints load at the run's dtype, within their bytes, or fail in one line.

References are independent of the loader: numpy's own rounding of the float32 weights to
bfloat16 (ml_dtypes, round to nearest even), tracemalloc's count of host allocations, and
the safetensors package's writer for the files.
"""

import json
import os
import shutil
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest

from specsamp.errors import UserError
from specsamp.loading import load_model
from specsamp.testing import make_tiny_checkpoint, write_bf16_checkpoint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "cache"))


def test_bfloat16_weights_are_the_float32_weights_rounded(tmp_path, cache):
    """Catches a wrong transpose, layer order, rounding (truncation instead of nearest
    even) or a tensor left at float32 in a bfloat16 load: every leaf is exactly numpy's
    bfloat16 rounding of the float32 load's leaf."""
    folder = make_tiny_checkpoint(str(tmp_path / "hf"), seed=4, tied=False, qkv_bias=True)
    full, half = load_model(folder, dtype="float32"), load_model(folder, dtype="bfloat16")
    assert (full.dtype, half.dtype) == ("float32", "bfloat16")
    want = jax.tree_util.tree_flatten_with_path(full.params)[0]
    got = jax.tree.leaves(half.params)
    assert len(want) == len(got)
    for (path, a), b in zip(want, got):
        assert b.dtype == jnp_bf16(), path
        expect = np.asarray(a).astype(ml_dtypes.bfloat16)
        assert np.array_equal(np.asarray(b).view(np.uint16), expect.view(np.uint16)), path


def jnp_bf16():
    import jax.numpy as jnp

    return jnp.bfloat16


def test_auto_dtype_is_float32_on_cpu(tmp_path, cache):
    """The default on a CPU stays float32, for a bfloat16 checkpoint too."""
    folder = str(tmp_path / "bf16")
    write_bf16_checkpoint(folder, vocab=320, d=64, layers=1, heads=2, kv_heads=1, head_dim=32, ff=96)
    model = load_model(folder)
    assert model.dtype == "float32"
    assert {a.dtype.name for a in jax.tree.leaves(model.params)} == {"float32"}


def test_bfloat16_load_allocates_no_float32_copy(tmp_path, cache, capfd):
    """Catches a loader that goes through float32 (or keeps the file's arrays and a
    converted copy, or stacks layers into a second array): host allocations while loading
    a bfloat16 checkpoint at bfloat16 peak within 1.25x its bytes (tracemalloc counts
    numpy's buffers). One progress line per shard."""
    folder = str(tmp_path / "bf16")
    n = write_bf16_checkpoint(folder, vocab=4096, d=256, layers=4, heads=8, kv_heads=2,
                              head_dim=32, ff=512, shards=3)
    # A first load imports what loading needs (module code is traced memory too, and it
    # depends on which tests ran before); the second one is measured.
    load_model(folder, dtype="bfloat16")
    capfd.readouterr()
    tracemalloc.start()
    try:
        model = load_model(folder, dtype="bfloat16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert model.weight_bytes == 2 * n
    assert peak <= 1.25 * model.weight_bytes, (peak, model.weight_bytes)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("read ")]
    assert [line.split()[1] for line in lines] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def _truncate(folder: str) -> None:
    path = os.path.join(folder, "model-00002-of-00002.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _drop_shard(folder: str) -> None:
    os.remove(os.path.join(folder, "model-00002-of-00002.safetensors"))


def _drop_tensor(folder: str) -> None:
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        body = json.load(f)
    del body["weight_map"]["model.norm.weight"]
    path = os.path.join(folder, "model-00002-of-00002.safetensors")
    from specsamp.loading.safetensors_file import SafetensorsFile

    with SafetensorsFile(path) as f:
        kept = {k: np.array(f.tensor(k)) for k in f.keys() if k != "model.norm.weight"}
    from safetensors.numpy import save_file

    save_file(kept, path)
    with open(index, "w") as f:
        json.dump(body, f)


@pytest.mark.parametrize("spoil,message", [
    (_truncate, r"cannot read .*model-00002-of-00002.safetensors: truncated: tensor \S+ ends at byte"),
    (_drop_shard, "has no model-00002-of-00002.safetensors"),
    (_drop_tensor, "weight model.norm.weight is missing"),
])
def test_broken_checkpoints_give_one_line(spoil, message, tmp_path, cache):
    """A truncated shard, a missing shard, a missing tensor: one UserError line naming it,
    raised before anything is converted (the header checks come first)."""
    folder = str(tmp_path / "bf16")
    write_bf16_checkpoint(folder, vocab=320, d=64, layers=2, heads=2, kv_heads=1, head_dim=32, ff=96)
    spoil(folder)
    with pytest.raises(UserError, match=message) as info:
        load_model(folder, dtype="bfloat16")
    assert "\n" not in str(info.value)


def test_reader_reads_what_safetensors_wrote(tmp_path):
    """The memory-mapped reader against the safetensors package's own writer: every dtype
    a checkpoint uses, scalars and empty tensors included."""
    from safetensors.numpy import save_file

    from specsamp.loading.safetensors_file import SafetensorsFile

    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
               "f16": rng.standard_normal((7,)).astype(np.float16),
               "bf16": rng.standard_normal((2, 3, 4)).astype(ml_dtypes.bfloat16),
               "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
               "scalar": np.array(1.5, np.float32), "empty": np.zeros((0, 4), np.float32)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    shutil.copy(tmp_path / "t.safetensors", tmp_path / "u.safetensors")
    with SafetensorsFile(str(tmp_path / "u.safetensors")) as f:
        assert set(f.keys()) == set(tensors)
        for name, want in tensors.items():
            got = f.tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.tobytes() == want.tobytes(), name
            f.release(name)
            assert got.tobytes() == want.tobytes(), name  # still readable
