"""Checkpoint loading: logits equal an independent implementation (Hugging Face transformers,
reference data in tests/data), GGUF equals the Hugging Face folder it was converted from,
quantized tensors decode to the values llama.cpp's formulas give, and bad input gives one
clear UserError."""

import dataclasses
import functools
import json
import os
import shutil
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.errors import UserError
from specsamp.loading import check_same_vocab, load_model
from specsamp.loading import gguf as gguf_loader
from specsamp.models.llama import Transformer, init_cache
from specsamp.testing import make_tiny_checkpoint, write_gguf, write_tiny_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache, so conversions of test files never land in the user's cache."""
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@functools.cache
def _forward(cfg):
    return jax.jit(lambda params, tokens: Transformer(cfg).apply(
        {"params": params}, tokens, jnp.arange(tokens.shape[1])[None],
        init_cache(cfg, 1, tokens.shape[1]))[0][0])


def logits(model, tokens) -> np.ndarray:
    """[T, V] logits of one full forward pass."""
    return np.asarray(_forward(model.cfg)(model.params, jnp.asarray(tokens, jnp.int32)[None]))


@pytest.mark.parametrize("name", ["tiny_llama_tied", "tiny_llama_untied", "tiny_qwen2"])
def test_tiny_checkpoints_match_transformers(name, tmp_path, cache):
    """Catches a wrong weight mapping, transpose, bias or config field (rope_theta in both
    the transformers 4.x and 5.x layouts)."""
    folder = shutil.copytree(os.path.join(DATA, name), tmp_path / name)
    write_tiny_tokenizer(folder)  # the reference folders carry weights only
    ref = np.load(os.path.join(folder, "reference.npz"))
    got = logits(load_model(str(folder)), ref["tokens"])
    np.testing.assert_allclose(got, ref["logits"], atol=1e-4 * np.abs(ref["logits"]).max())


@pytest.mark.parametrize("tied,bias", [(True, False), (False, False), (False, True)])
def test_gguf_f32_equals_its_hf_folder(tied, bias, tmp_path, cache):
    """A GGUF written like llama.cpp's converter (Q/K rows permuted for 'llama') must give
    the same logits as the folder it came from; fails if the permutation is not undone."""
    folder = make_tiny_checkpoint(str(tmp_path / "hf"), seed=3, tied=tied, qkv_bias=bias)
    hf = load_model(folder)
    gg = load_model(write_gguf(folder, str(tmp_path / "m.gguf"), "F32"))
    tokens = hf.tokenizer.encode(hf.tokenizer.chat("hello there, how are you?"))
    np.testing.assert_allclose(logits(gg, tokens), logits(hf, tokens), atol=1e-5)
    assert gg.tokenizer.fingerprint == hf.tokenizer.fingerprint
    assert (gg.cfg.tie_embeddings, gg.cfg.qkv_bias) == (tied, bias)


def test_gguf_without_unpermute_differs(tmp_path, cache, monkeypatch):
    """The test above is sensitive to the pitfall: skipping the unpermute changes logits."""
    folder = make_tiny_checkpoint(str(tmp_path / "hf"), seed=3)
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "F32")
    tokens = list(range(3, 40))
    right = logits(load_model(path), tokens)
    monkeypatch.setattr(gguf_loader, "unpermute_qk", lambda w, n: w)
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "other-cache"))
    wrong = logits(load_model(path), tokens)
    assert np.abs(right - wrong).max() > 0.1


def test_sharded_bfloat16_folder(tmp_path, cache):
    """Shards listed in model.safetensors.index.json, stored as bfloat16, load as float32."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    folder = make_tiny_checkpoint(str(tmp_path / "hf"), seed=6, tied=False)
    full = load_model(folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: weights[k].astype(ml_dtypes.bfloat16) for k in keys},
                  os.path.join(folder, shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    half = load_model(folder)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(half.params)):
        assert b.dtype == jnp.float32
        np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-6)


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_heads, rows, cols in [(4, 64, 10), (3, 192, 5), (2, 32, 0)]:
        w = rng.standard_normal((rows, cols) if cols else (rows,))
        permuted = w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2)
        assert np.array_equal(gguf_loader.unpermute_qk(permuted.reshape(w.shape), n_heads), w)


@pytest.mark.parametrize("qtype,tol", [("F16", 2e-3), ("BF16", 1e-2), ("Q8_0", 1e-2),
                                       ("Q4_0", 0.15), ("Q4_1", 0.15)])
def test_quantized_gguf_weights_close_to_float(qtype, tol, tmp_path, cache):
    """Every tensor of a quantized GGUF decodes close to the float original (a layout or
    block-order mistake gives errors of order 1, quantization alone a few percent)."""
    folder = make_tiny_checkpoint(str(tmp_path / "hf"), seed=4, tied=False)
    ref = jax.tree_util.tree_leaves_with_path(load_model(folder).params)
    got = load_model(write_gguf(folder, str(tmp_path / "m.gguf"), qtype), "float32").params
    for path, want in ref:
        have = functools.reduce(lambda t, k: t[k.key], path, got)
        rel = np.sqrt(np.mean((np.asarray(have) - want) ** 2) / np.mean(np.asarray(want) ** 2))
        assert rel < tol, (jax.tree_util.keystr(path), rel)


def _blocks(qtype, rows):
    """Random raw GGUF blocks of `qtype`, and their values by llama.cpp's formulas."""
    rng = np.random.default_rng(1)
    n = rows * 2  # two 32-value blocks per row
    d = rng.uniform(0.01, 0.1, n).astype(np.float16)
    m = rng.uniform(-1, 0, n).astype(np.float16)
    if qtype == "Q8_0":
        q = rng.integers(-128, 128, (n, 32), dtype=np.int8)
        raw = np.concatenate([d.view(np.uint8).reshape(n, 2), q.view(np.uint8)], axis=1)
        return raw, d[:, None].astype(np.float32) * q
    nib = rng.integers(0, 16, (n, 32), dtype=np.uint8)  # value j low nibble, j+16 high
    packed = nib[:, :16] | (nib[:, 16:] << 4)
    head = [d.view(np.uint8).reshape(n, 2)]
    if qtype == "Q4_0":
        values = d[:, None].astype(np.float32) * (nib.astype(np.float32) - 8)
    else:
        head.append(m.view(np.uint8).reshape(n, 2))
        values = d[:, None].astype(np.float32) * nib + m[:, None].astype(np.float32)
    return np.concatenate([*head, packed], axis=1), values


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_block_formulas(qtype):
    from gguf import GGMLQuantizationType

    raw, want = _blocks(qtype, rows=3)

    class Tensor:  # what GGUFReader gives: raw bytes per row, dims fastest first
        name, tensor_type, shape = "t", GGMLQuantizationType[qtype], [64, 3]
        data = raw.reshape(3, -1)

    got = gguf_loader.dequantize(Tensor)
    np.testing.assert_allclose(got, want.reshape(3, 64), rtol=1e-6)


def test_target_and_draft_of_one_family_share_vocab(tmp_path, cache):
    target = load_model(make_tiny_checkpoint(str(tmp_path / "t"), seed=0, n_layers=2))
    draft = load_model(make_tiny_checkpoint(str(tmp_path / "d"), seed=1, n_layers=1))
    check_same_vocab(target, draft)
    assert target.cfg.n_layers == 2 and draft.cfg.n_layers == 1


def test_mismatched_vocab_is_refused(tmp_path, cache):
    target = load_model(make_tiny_checkpoint(str(tmp_path / "t")))
    other = make_tiny_checkpoint(str(tmp_path / "d"))
    with open(os.path.join(other, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two ids swapped
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with pytest.raises(UserError, match="does not share the target's vocabulary"):
        check_same_vocab(target, load_model(other))


def test_converted_gguf_is_cached(tmp_path, cache):
    """The second load reads the float32 copy (no GGUF parsing) and gives the same model."""
    path = write_gguf(make_tiny_checkpoint(str(tmp_path / "hf")), str(tmp_path / "m.gguf"), "Q8_0")
    first = load_model(path, "float32")
    assert len(list((cache / "converted").iterdir())) == 1
    second = load_model(path, "float32")
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert np.array_equal(a, b)
    assert second.cfg == first.cfg and second.tokenizer.eos_ids == first.tokenizer.eos_ids
    assert second.tokenizer.chat("hi") == first.tokenizer.chat("hi")


def _bad_inputs(tmp: str) -> dict:
    folder = make_tiny_checkpoint(os.path.join(tmp, "hf"))
    open(os.path.join(tmp, "text.gguf"), "w").write("not a gguf file")
    open(os.path.join(tmp, "weights.bin"), "w").write("x")
    os.makedirs(os.path.join(tmp, "empty"))
    gpt = shutil.copytree(folder, os.path.join(tmp, "gpt"))
    with open(os.path.join(gpt, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(gpt, "config.json"), "w") as f:
        json.dump(dict(config, architectures=["GPT2LMHeadModel"]), f)
    broken = shutil.copytree(folder, os.path.join(tmp, "broken"))
    open(os.path.join(broken, "model.safetensors"), "wb").write(b"\x00" * 10)
    return {
        os.path.join(tmp, "nope"): "no model at",
        os.path.join(tmp, "text.gguf"): "not a readable GGUF file",
        os.path.join(tmp, "weights.bin"): "expected a .gguf file",
        os.path.join(tmp, "empty"): "needs a config.json",
        gpt: "architecture 'GPT2LMHeadModel' is not supported",
        broken: "cannot read",
    }


def test_bad_paths_give_one_clear_error(tmp_path, cache):
    for path, message in _bad_inputs(str(tmp_path)).items():
        with pytest.raises(UserError, match=message) as info:
            load_model(path)
        assert "\n" not in str(info.value)


def test_unsupported_gguf_tensor_type(tmp_path, cache):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "i8.gguf"), "llama")
    writer.add_tensor("t", np.zeros((2, 4), np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(tmp_path / "i8.gguf")).tensors[0]
    with pytest.raises(UserError, match="tensor type I8 .* not supported"):
        gguf_loader.dequantize(tensor)


# --- gs:// through a local emulator ---------------------------------------------------------


@pytest.fixture
def gcs(monkeypatch, cache):
    """A fake GCS server on a free local port, with gcsfs pointed at it anonymously."""
    import fsspec.config
    from fsspec.registry import _registry
    from gcp_storage_emulator.server import create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import gcsfs.core

    # gcsfs picks its class when first imported: if that happened before the variable above
    # was set, "gs://" maps to the class that probes for hierarchical namespaces, which an
    # emulator never answers. Use the plain class whatever the import order.
    for protocol in ("gs", "gcs"):
        monkeypatch.setitem(_registry, protocol, gcsfs.core.GCSFileSystem)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon"})
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    fs = gcsfs.core.GCSFileSystem(token="anon")
    fs.mkdir("models")
    yield fs
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    server.stop()


def test_load_from_gcs(gcs, tmp_path, cache):
    """An HF folder and a GGUF file on gs:// load like their local copies."""
    folder = make_tiny_checkpoint(str(tmp_path / "hf"), seed=5, tied=False)
    gguf_file = write_gguf(folder, str(tmp_path / "m.gguf"), "F32")
    for name in os.listdir(folder):
        gcs.put(os.path.join(folder, name), f"models/tiny/{name}")
    gcs.put(gguf_file, "models/m.gguf")
    local = load_model(folder)
    tokens = local.tokenizer.encode("the quick brown fox")
    for url in ("gs://models/tiny", "gs://models/tiny/", "gs://models/m.gguf"):
        remote = load_model(url)
        assert remote.name == url and remote.tokenizer.fingerprint == local.tokenizer.fingerprint
        np.testing.assert_allclose(logits(remote, tokens), logits(local, tokens), atol=1e-5)
    with pytest.raises(UserError, match="no model at gs://models/missing"):
        load_model("gs://models/missing")


# --- the embedded default (SmolLM2-135M-Instruct) -------------------------------------------


def _reference():
    with open(os.path.join(DATA, "smollm2_reference.json")) as f:
        return json.load(f), np.load(os.path.join(DATA, "smollm2_reference.npz"))


@pytest.mark.slow
def test_smollm2_facts(smollm2):
    cfg, tok = smollm2.cfg, smollm2.tokenizer
    shape = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert shape == (30, 576, 9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.tie_embeddings, cfg.qkv_bias) == (1e5, True, False)
    assert tok.bos_id == 1 and 2 in tok.eos_ids and tok.token_text(2) == "<|im_end|>"
    assert smollm2.name == "smollm2"


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    """Logits of three prompts (prose, code, chat) against transformers on the same GGUF."""
    meta, ref = _reference()
    for i, _ in enumerate(meta["texts"]):
        got = logits(smollm2, ref[f"tokens_{i}"])
        scale = np.abs(ref[f"logits_{i}"]).max()
        np.testing.assert_allclose(got[-2:], ref[f"logits_{i}"], atol=1e-4 * scale)
        top = np.take_along_axis(got, ref[f"top20_idx_{i}"], axis=1)
        np.testing.assert_allclose(top, ref[f"top20_val_{i}"], atol=1e-4 * scale)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2):
    """40 greedy tokens with the KV cache equal transformers' greedy output (the smallest
    top-1 margin in the reference is 0.02, far above our 1e-4 error)."""
    meta, ref = _reference()
    cfg = smollm2.cfg
    step = jax.jit(lambda p, t, pos, c: Transformer(cfg).apply({"params": p}, t, pos, c))
    for i, text in enumerate(meta["texts"]):
        tokens = ref[f"tokens_{i}"].tolist()
        assert smollm2.tokenizer.encode(text["text"]) == tokens
        cache = init_cache(cfg, 1, 128)
        out, pos = [], jnp.arange(len(tokens))[None]
        x = jnp.asarray([tokens])
        for _ in range(len(ref[f"greedy_{i}"])):
            lg, cache = step(smollm2.params, x, pos, cache)
            out.append(int(jnp.argmax(lg[0, -1])))
            x, pos = jnp.asarray([[out[-1]]]), pos[:, -1:] + 1
        assert out == ref[f"greedy_{i}"].tolist()
        assert smollm2.tokenizer.decode(out) == text["greedy_text"]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_stored_blocks_are_the_float32_model(qtype, tmp_path, cache):
    """Catches a stored (quantized) load that is not the same model as the float32 load
    of the same file: every weight decodes to the identical float32 value (Q/K rows
    unpermuted alike), nothing is written to the cache, and the logits agree to float32
    rounding on both the native kernels and the XLA path."""
    from specsamp.quant import QWeight, dequantize

    folder = make_tiny_checkpoint(str(tmp_path / "hf"), seed=5, tied=False)
    path = write_gguf(folder, str(tmp_path / "m.gguf"), qtype)
    stored = load_model(path)
    assert not (cache / "converted").exists()
    full = load_model(path, "float32")
    is_q = lambda x: isinstance(x, QWeight)
    flat_s = jax.tree_util.tree_leaves_with_path(stored.params, is_leaf=is_q)
    assert sum(is_q(leaf) for _, leaf in flat_s) >= 7  # q, k, v, o, gate, up, down (+ head)
    for path_, leaf in flat_s:
        want = functools.reduce(lambda t, k: t[k.key], path_, full.params)
        np.testing.assert_array_equal(np.asarray(dequantize(leaf)), np.asarray(want))
    assert stored.weight_bytes < 0.4 * full.weight_bytes
    tokens = [3, 17, 5, 9, 30, 2, 11]
    want = logits(full, tokens)
    for backend in ("cpu", "xla"):
        params = jax.tree.map(lambda w: w.replace(backend=backend) if is_q(w) else w,
                              stored.params, is_leaf=is_q)
        got = logits(dataclasses.replace(stored, params=params), tokens)
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_int8_weights_are_close_and_smaller(tmp_path, cache):
    """Catches a broken int8 path (wrong channel axis, scale or transposition): int8
    per-channel logits stay close to the float model's, at about a quarter of its bytes."""
    folder = make_tiny_checkpoint(str(tmp_path / "hf"), seed=6, tied=True)
    full, small = load_model(folder), load_model(folder, "int8")
    assert small.weights == "int8" and small.weight_bytes < 0.35 * full.weight_bytes
    tokens = [1, 4, 9, 16, 25]
    want, got = logits(full, tokens), logits(small, tokens)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert np.abs(got - want).max() > 0  # it is another model, not the float one


def test_unknown_weight_format_is_refused(tmp_path, cache):
    with pytest.raises(UserError, match="weights must be one of"):
        load_model(make_tiny_checkpoint(str(tmp_path / "hf")), "int4")
