"""Model families (Llama 3 RoPE scaling, Qwen3, Mistral's window, Gemma 2 and 3) against
transformers: tiny checkpoints in tests/data made by tools/make_reference_data.py with
transformers' own classes, random weights, and its logits and greedy continuations.

Every windowed checkpoint has a window of 8 and a 32-token prompt, so a window that is cut,
ignored or off by one changes the logits; greedy runs 64 tokens further, through the
compiled decoding loop, on XLA's attention and on the native kernel."""

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import Program
from specsamp.decoding.engine import Engine
from specsamp.decoding.factory import build_drafter
from specsamp.errors import UserError
from specsamp.loading import load_model
from specsamp.loading.families import config_from_hf
from specsamp.loading.hf import open_hf
from specsamp.models.config import ModelConfig
from specsamp.models.model import Model
from specsamp.quant import kernels
from specsamp.testing import write_gguf, write_tiny_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")
FAMILIES = ["tiny_llama3", "tiny_qwen3", "tiny_qwen3_yarn", "tiny_mistral", "tiny_gemma2",
            "tiny_gemma3", "tiny_gemma3_mm"]
ATTENTION = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(
    kernels.load() is not None, reason="native kernels not built"))]


@functools.cache
def _loaded(name, tmp):
    folder = shutil.copytree(os.path.join(DATA, name), os.path.join(tmp, name))
    write_tiny_tokenizer(folder)  # the reference folders carry weights only
    return load_model(folder), np.load(os.path.join(folder, "reference.npz"))


@pytest.fixture
def family(request, tmp_path_factory, monkeypatch):
    tmp = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp / "cache"))
    return _loaded(request.param, str(tmp))


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_logits_match_transformers(family, attention):
    """Catches any feature computed unlike transformers: RoPE scaling (llama3's smoothing,
    linear, yarn's ramp and attention factor), q/k norms, (1 + w) norms, post-norms, the
    embedding scale, GeGLU, the query scale, soft-capping, the window's bounds (a key at
    distance == window must be hidden), the local RoPE base; on either attention. The cache
    has spare slots filled with garbage, which the mask must keep out."""
    m, ref = family
    model = Model(m.cfg, attention=attention)
    tokens = jnp.asarray(ref["tokens"])[None]
    t = tokens.shape[1]
    cache = model.init_cache(1, t + 16)
    cache = cache.replace(k=cache.k + 3.0, v=cache.v - 2.0)
    logits, _ = model.forward(m.params, tokens, jnp.arange(t)[None], cache)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], atol=1e-4, rtol=0)



# bfloat16 keeps 8 significant bits: each rounding moves a value by up to 2^-9 of itself,
# and a few layers of them move a logit by a few percent of the logits' range (the figures
# on these checkpoints: docs/dtype.md). The bound is 0.1 x max|logit|, with room for another
# machine's bfloat16 products; a feature computed wrongly moves logits by a sizeable part
# of their range.
BFLOAT16_TOLERANCE = 0.1


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_bfloat16_logits_within_stated_tolerance(family, request, tmp_path_factory):
    """The bfloat16 model (weights, activations and cache at bfloat16) against transformers'
    float32 logits, within BFLOAT16_TOLERANCE x the largest logit: catches a bfloat16 path
    that drops or misplaces a family's feature (the float32 test covers the features
    themselves), e.g. a scale or soft cap applied in float32 only."""
    _, ref = family  # the fixture copied the folder (with a tokenizer) here:
    folder = os.path.join(str(tmp_path_factory.getbasetemp()), request.node.callspec.params["family"])
    m = load_model(folder, dtype="bfloat16")
    assert m.params["embed"]["embedding"].dtype == jnp.bfloat16
    model = Model(m.cfg)
    tokens = jnp.asarray(ref["tokens"])[None]
    t = tokens.shape[1]
    logits, _ = model.forward(m.params, tokens, jnp.arange(t)[None], model.init_cache(1, t))
    diff = np.abs(np.asarray(logits[0], np.float32) - ref["logits"]).max()
    assert diff <= BFLOAT16_TOLERANCE * np.abs(ref["logits"]).max(), diff

def _engine(cfg, params, draft, k=3):
    sp = SamplingParams(0.0)
    drafter, draft_params = build_drafter(draft, k, sp, cfg, params, None)
    return Engine(Program(cfg, sp, drafter, "float32"), params, draft_params, eos_ids=(),
                  max_new_tokens=64)


@pytest.mark.parametrize("family,backend", [(f, "default") for f in FAMILIES]
                         + [("tiny_gemma2", "xla")], indirect=["family"])
def test_greedy_matches_transformers_and_speculative(family, backend, monkeypatch):
    """Catches a decoding-time fault the one-pass logits miss (a window or RoPE wrong only
    at positions past the prompt, per-layer features lost when the early-exit draft cuts
    the layers): 64 greedy tokens of the compiled loop equal transformers', and speculative
    greedy (an early-exit draft) equals them too; on the native attention kernel where it
    is built, and on XLA's (one windowed, soft-capped family)."""
    if backend == "xla":  # the attention is chosen when the loop is traced: trace afresh
        monkeypatch.setenv("SPECSAMP_QUANT_BACKEND", "xla")
        jax.clear_caches()
        assert Model(family[0].cfg).attention == "xla"
    try:
        m, ref = family
        prompt = [int(t) for t in ref["tokens"]]
        ar = _engine(m.cfg, m.params, "none").run([prompt], [0])[0]
        assert list(ar.token_ids) == ref["greedy"].tolist()
        spec = _engine(m.cfg, m.params, "early-exit:1").run([prompt], [0])[0]
        assert spec.token_ids == ar.token_ids
        assert sum(spec.drafted) > 0
    finally:
        if backend == "xla":
            jax.clear_caches()


@pytest.mark.parametrize("family", ["tiny_llama3", "tiny_qwen3", "tiny_qwen3_yarn", "tiny_gemma2",
                                    "tiny_gemma3"], indirect=True)
def test_gguf_equals_its_hf_folder(family, tmp_path):
    """Catches a GGUF family read unlike its Hugging Face folder: Gemma's norms stored plus
    one (read as 1 + w twice, or not at all), post-norm and q/k-norm names, the window and
    its layers, soft caps, Gemma 3's linear scaling and local base, Llama 3's rope_freqs
    divisors, yarn's parameters. The file is written as llama.cpp's converter writes it
    (`write_gguf`); it cannot carry Gemma's query_pre_attn_scalar (llama.cpp takes the
    head width), so the folder's model is compared with that scale."""
    m, ref = family
    path = write_gguf(m.name, str(tmp_path / "m.gguf"))
    g = load_model(path)
    assert g.cfg.norm_plus_one is False and g.cfg.sliding_layers == m.cfg.sliding_layers
    cfg = dataclasses.replace(m.cfg, query_scale=None) if m.cfg.embed_scale else m.cfg
    tokens = jnp.asarray(ref["tokens"])[None]
    t = tokens.shape[1]
    positions = jnp.arange(t)[None]
    want, _ = Model(cfg).forward(m.params, tokens, positions, Model(cfg).init_cache(1, t))
    got, _ = Model(g.cfg).forward(g.params, tokens, positions, Model(g.cfg).init_cache(1, t))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_gemma3_multimodal_reads_the_text_model_only(tmp_path, monkeypatch):
    """Catches a Gemma3ForConditionalGeneration folder read beyond its text model (the
    vision tower's bytes touched, or its float32 bytes deciding the stored type) or only
    under one naming: the published names (language_model.model.*) and transformers >=
    4.52's (model.language_model.*) give the same parameters, and no vision_tower or
    multi_modal_projector tensor is read."""
    from safetensors.numpy import load_file, save_file

    from specsamp.loading.safetensors_file import SafetensorsFile

    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "cache"))
    read = []
    pieces = SafetensorsFile.pieces
    monkeypatch.setattr(SafetensorsFile, "pieces", lambda f, name: read.append(name) or pieces(f, name))
    hub = shutil.copytree(os.path.join(DATA, "tiny_gemma3_mm"), tmp_path / "hub")
    write_tiny_tokenizer(str(hub))
    renamed = shutil.copytree(hub, tmp_path / "v5")
    weights = load_file(str(hub / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in weights)
    big = {"vision_tower.vision_model.unused": np.zeros((512, 1024), np.float32)}
    save_file({k.replace("language_model.model.", "model.language_model.", 1): v
               for k, v in {**weights, **big}.items()}, str(renamed / "model.safetensors"))
    a = load_model(str(hub))
    assert read and not [n for n in read if not n.startswith("language_model.model.")]
    b = load_model(str(renamed))
    assert a.cfg == b.cfg and a.cfg.n_layers == 2 and a.cfg.vocab_size == 300
    with open_hf(str(renamed)) as ckpt:
        assert ckpt.stored_dtype() == "bfloat16"
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a.params, b.params))


def _config(name):
    with open(os.path.join(DATA, name, "config.json")) as f:
        return json.load(f)


def test_gemma3_config_layouts_agree():
    """Catches a misread config layout: tiny_gemma3's config.json is in the 4.x layout
    (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern); the same
    model in the 5.x layout (rope_parameters per layer type, layer_types) reads the same."""
    old = _config("tiny_gemma3")
    new = {k: v for k, v in old.items() if k not in (
        "rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")}
    new["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    new["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"]
    cfg = config_from_hf(old)
    assert cfg == config_from_hf(new)
    assert cfg.sliding_layers == (True, True, False) and cfg.local_rope_theta == 10000.0
    assert dict(cfg.rope_scaling)["rope_type"] == "linear"


def test_config_survives_json():
    """Catches a converted model's cached config that reads back unequal (tuples become
    JSON lists): a cache hit would then compile another program, or fail."""
    cfg = config_from_hf(_config("tiny_gemma2"))
    again = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg and hash(again) == hash(cfg)
    assert again.truncated(1).sliding_layers == (True,)


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["Phi3ForCausalLM"]}, "architecture 'Phi3ForCausalLM' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "RoPE scaling 'longrope'"),
    ({"layer_types": ["chunked_attention"] * 2, "sliding_window": 8, "use_sliding_window": True},
     "layer types"),
])
def test_unsupported_configs_are_one_line(change, message):
    """Catches a config we cannot run being half-read (a traceback, or silently wrong
    logits): one UserError naming what is not supported."""
    c = {**_config("tiny_qwen3"), **change}
    c.pop("rope_parameters", None) if "rope_scaling" in change else None
    with pytest.raises(UserError, match=message) as e:
        config_from_hf(c)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # a CLI process; no exactness property
def test_unsupported_architecture_exits_2(tmp_path):
    """Catches an unsupported checkpoint reaching the model (a traceback) or leaving files
    behind: the CLI says in one line which architecture and what is supported, exit 2,
    and writes nothing to the cache."""
    from tests.test_cli import _cli

    folder = shutil.copytree(os.path.join(DATA, "tiny_qwen3"), tmp_path / "phi")
    write_tiny_tokenizer(str(folder))
    c = {**_config("tiny_qwen3"), "architectures": ["Phi3ForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(c))
    out = _cli(["generate", "--prompt", "hi", "--target", str(folder)], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "'Phi3ForCausalLM' is not supported" in errors[0], out.stderr
    assert "Gemma3ForCausalLM" in errors[0]
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))


class _Meta:
    """GGUF metadata as the loader reads it (`get`), from a dict."""

    def __init__(self, fields):
        self.fields = fields

    def get(self, key, default=None):
        return self.fields.get(key, default)


@pytest.mark.parametrize("arch,layers,flags,scale", [
    ("gemma2", 4, (True, False, True, False), None),
    ("gemma3", 12, ((True,) * 5 + (False,)) * 2, None),
    ("gemma2", 46, (True, False) * 23, (4608 / 32) ** -0.5),  # the 27B: D / H
])
def test_gguf_gemma_rules_follow_llama_cpp(arch, layers, flags, scale):
    """Catches GGUF Gemma files read with other fixed rules than llama.cpp's where the
    format carries nothing (the written test files list their window layers): every other
    layer (Gemma 2) or five of six (Gemma 3) has the window; the 27B models scale queries
    by D / H, the others by the head width."""
    from specsamp.loading import gguf as gguf_loader

    family = gguf_loader._FAMILIES[arch]
    meta = _Meta({f"{arch}.attention.sliding_window": 512})
    assert gguf_loader._windows(meta, arch, family, layers) == (512, flags)
    assert gguf_loader._query_scale(meta, arch, family, layers, 4608 // 32) == scale
