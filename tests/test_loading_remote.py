"""Hugging Face folders on gs:// (a local GCS emulator, through gcsfs) and memory:// (fsspec's
in-process filesystem, for exact allocation counts): shards read by ranged reads where
they are, never copied, bit for bit the local load."""

import os
import shutil
import tracemalloc

import jax
import numpy as np
import pytest

from specsamp.errors import UserError
from specsamp.loading import load_model
from specsamp.loading import safetensors_file as st
from specsamp.testing import write_bf16_checkpoint, write_tiny_tokenizer
from tests.test_loading import cache, gcs  # noqa: F401  (fixtures)

DATA = os.path.join(os.path.dirname(__file__), "data")


def _upload(gcs, folder: str, under: str) -> str:
    for name in os.listdir(folder):
        gcs.put(os.path.join(folder, name), f"models/{under}/{name}")
    return f"gs://models/{under}"


def _same_leaves(a, b) -> bool:
    pairs = zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params))
    return all(x.dtype == y.dtype and np.array_equal(np.asarray(x).view(np.uint8),
                                                     np.asarray(y).view(np.uint8))
               for x, y in pairs)


@pytest.fixture
def ranges(monkeypatch):
    """Every ranged read of a remote shard, as (path, start, end); pieces of 1000 bytes at
    most, so every tensor here is read in several (kernels transposed piece by piece)."""
    seen = []
    read = st.SafetensorsFile._range

    def spy(f, start, end):
        seen.append((f.path, start, end))
        return read(f, start, end)

    monkeypatch.setattr(st.SafetensorsFile, "_range", spy)
    monkeypatch.setattr(st, "CHUNK_BYTES", 1000)
    return seen


def _bf16_folder(tmp_path) -> str:
    folder = str(tmp_path / "bf16")
    write_bf16_checkpoint(folder, vocab=2048, d=128, layers=3, heads=4, kv_heads=2,
                          head_dim=32, ff=256, shards=3)
    return folder


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gs_shards_stream_bit_for_bit_without_a_copy(dtype, gcs, ranges, tmp_path, cache):
    """Catches a remote shard copied to disk, or pieces placed at the wrong rows (a
    kernel's transposed pieces): a 3-shard bfloat16 folder on gs:// loads bit for bit as
    its local copy; every ranged read of a tensor is at most one piece; the cache holds only the small
    files."""
    folder = _bf16_folder(tmp_path)
    url = _upload(gcs, folder, "bf16")
    local, remote = load_model(folder, dtype=dtype), load_model(url, dtype=dtype)
    assert remote.dtype == dtype and _same_leaves(local, remote)
    shards = {p for p, _, _ in ranges}
    assert len(shards) == 3 and all(p.startswith("models/bf16/model-0000") for p in shards)
    pieces = [end - start for _, start, end in ranges if start > 8]  # after the headers
    assert pieces and max(pieces) <= 1000
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert cached and not [p for p in cached if p.suffix == ".safetensors"], cached
    assert sum(p.stat().st_size for p in cached) < 64 << 10


def test_remote_load_peaks_within_its_bytes(tmp_path, cache, monkeypatch):
    """Catches a remote shard held whole in memory (or a float32 copy of a bfloat16
    one): host allocations while loading a 3-shard bfloat16 folder from memory:// at
    bfloat16 peak within 1.25x the weights' bytes (a shard held whole: 1.33x)."""
    import fsspec

    monkeypatch.setattr(st, "CHUNK_BYTES", 64 << 10)
    folder = str(tmp_path / "bf16")  # test_load_bytes' local case: the runtime's own is small
    write_bf16_checkpoint(folder, vocab=4096, d=256, layers=4, heads=8, kv_heads=2,
                          head_dim=32, ff=512, shards=3)
    mem = fsspec.filesystem("memory")
    mem.put(folder, "/bf16", recursive=True)
    try:
        load_model("memory://bf16", dtype="bfloat16")  # first-use allocations not counted
        tracemalloc.start()
        try:
            remote = load_model("memory://bf16", dtype="bfloat16")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        mem.rm("/bf16", recursive=True)
    assert peak <= 1.25 * remote.weight_bytes, (peak, remote.weight_bytes)


def test_gs_multimodal_reads_no_vision_bytes(gcs, ranges, tmp_path, cache):
    """Catches a remote Gemma3ForConditionalGeneration folder whose vision tower or
    projector bytes are fetched: every ranged read lies in the header or in a text
    model tensor, and the text model loads bit for bit as the local copy."""
    folder = shutil.copytree(os.path.join(DATA, "tiny_gemma3_mm"), tmp_path / "mm")
    write_tiny_tokenizer(str(folder))
    url = _upload(gcs, str(folder), "mm")
    local, remote = load_model(str(folder)), load_model(url)
    assert _same_leaves(local, remote)
    with st.SafetensorsFile(str(folder / "model.safetensors")) as f:
        header_end = f._base
        text = [(begin, end) for name, (_, _, begin, end) in f.entries.items()
                if name.startswith("language_model.model.")]
        vision = sum(end - begin for name, (_, _, begin, end) in f.entries.items()
                     if not name.startswith("language_model."))
    assert vision > 0
    for _, start, end in ranges:
        assert end <= header_end or any(b <= start and end <= e for b, e in text), (start, end)


@pytest.mark.parametrize("spoil,message", [
    (lambda gcs: gcs.rm("models/bad/model-00002-of-00002.safetensors"),
     "gs://models/bad has no model-00002-of-00002.safetensors"),
    (lambda gcs: gcs.pipe("models/bad/model-00002-of-00002.safetensors",
                          gcs.cat("models/bad/model-00002-of-00002.safetensors")[:-100]),
     r"cannot read models/bad/model-00002-of-00002.safetensors: truncated: tensor \S+ ends"),
])
def test_broken_remote_checkpoints_give_one_line(spoil, message, gcs, tmp_path, cache):
    """A missing or truncated remote shard: one UserError line naming it, before any
    tensor is read."""
    folder = str(tmp_path / "bf16")
    write_bf16_checkpoint(folder, vocab=320, d=64, layers=2, heads=2, kv_heads=1,
                          head_dim=32, ff=96)
    url = _upload(gcs, folder, "bad")
    spoil(gcs)
    with pytest.raises(UserError, match=message) as info:
        load_model(url, dtype="bfloat16")
    assert "\n" not in str(info.value)
