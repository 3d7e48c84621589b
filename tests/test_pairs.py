"""Target and draft pairs: same vocabulary (the draft's head may be smaller), or one line.

The exactness of a pair whose draft head is smaller is checked statistically in
tests/test_exactness.py ('model-small-head'); here: what the draft proposes, loading pairs
from folders, and the refusals.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding.config import SamplingParams
from specsamp.errors import UserError
from specsamp.testing import write_bf16_checkpoint
from tests import tiny

SHAPE = dict(d=64, heads=2, kv_heads=1, head_dim=32, ff=96)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "cache"))


def test_smaller_draft_head_never_drafts_the_missing_ids():
    """Catches padding that gives the target's extra ids draft mass (a zero logit instead
    of the least float): the draft's logits span the target's 8 ids and its probabilities
    on ids 6, 7 are exactly 0, at any temperature."""
    from specsamp.decoding.sampling import probs_from_logits

    drafter, params = tiny.drafter("tiny-draft-small-head", 2, SamplingParams(1.0))
    assert drafter.vocab_size == tiny.TARGET.vocab_size == 8 and drafter.cfg.vocab_size == 6
    cache = drafter.init_state(1, 16)
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    logits, _ = drafter.forward(params, tokens, jnp.arange(4)[None], cache)
    assert logits.shape == (1, 4, 8)
    for t in (0.5, 1.0, 3.0):
        p = np.asarray(probs_from_logits(logits, SamplingParams(t)))
        assert (p[..., 6:] == 0).all() and np.allclose(p.sum(-1), 1, atol=1e-6)


def test_smaller_draft_reads_the_ids_it_lacks_without_nan():
    """The target may emit an id past the draft's embedding (from the residual). Looked up
    as it is, it read NaN into the draft's cache, and every later draft of the row was NaN
    (block verification then kept the NaN drafts' tokens). The draft reads it as its last
    id: finite logits, at that position and after it."""
    drafter, params = tiny.drafter("tiny-draft-small-head", 2, SamplingParams(1.0))
    cache = drafter.init_state(1, 16)
    cache = drafter.prefill(params, jnp.asarray([[1, 7, 2]], jnp.int32), cache, jnp.zeros((1,), jnp.int32))
    logits, _ = drafter.forward(params, jnp.asarray([[6, 3]], jnp.int32), jnp.asarray([[3, 4]]), cache)
    assert np.isfinite(np.asarray(logits[..., :6])).all()


def _pair(tmp_path, target_vocab: int, draft_vocab: int):
    """Two bfloat16 folders sharing the tiny tokenizer (300 tokens), heads padded to
    target_vocab and draft_vocab rows."""
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    write_bf16_checkpoint(target, vocab=target_vocab, layers=2, seed=1, **SHAPE)
    write_bf16_checkpoint(draft, vocab=draft_vocab, layers=1, seed=2, **SHAPE)
    return target, draft


def _first_layer_draft(target: str, path: str, rows: int) -> str:
    """The target's first layer as a draft folder, its embedding cut to `rows` rows: a
    draft that agrees with the target often, so that drafts get accepted."""
    import shutil

    from safetensors.numpy import save_file

    from specsamp.loading.safetensors_file import SafetensorsFile

    os.makedirs(path)
    kept = {}
    for name in sorted(os.listdir(target)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(target, name)) as f:
                kept.update({k: np.array(f.tensor(k)) for k in f.keys()
                             if not k.startswith("model.layers.") or k.startswith("model.layers.0.")})
        elif name != "model.safetensors.index.json":
            shutil.copy(os.path.join(target, name), path)
    kept["model.embed_tokens.weight"] = kept["model.embed_tokens.weight"][:rows]
    save_file(kept, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config, num_hidden_layers=1, vocab_size=rows), f)
    return path


def test_pair_with_smaller_draft_head_equals_autoregressive(tmp_path, cache):
    """A bfloat16 pair loaded from folders, the draft's head 16 rows short of the target's:
    greedy speculative decoding gives the autoregressive tokens (the whole path: loading
    at the target's dtype, the vocabulary check, the padded draft)."""
    from specsamp.decoding.generator import GeneratorSpec, load_generator

    target = str(tmp_path / "target")
    write_bf16_checkpoint(target, vocab=320, layers=2, seed=1, **SHAPE)
    draft = _first_layer_draft(target, str(tmp_path / "draft"), 304)
    spec = dict(target=target, dtype="bfloat16", max_new_tokens=16)
    ar = load_generator(GeneratorSpec(draft="none", **spec))
    sp = load_generator(GeneratorSpec(draft=draft, k=3, **spec))
    assert sp.drafter.vocab_size == 320 and sp.drafter.cache_dtype == "bfloat16"
    prompts = ["the quick brown fox", "def add(a, b):"]
    for a, s in zip(ar.generate(prompts, [0, 1]), sp.generate(prompts, [0, 1])):
        assert s.token_ids == a.token_ids and len(s.token_ids) == 16
        assert s.target_calls < 16  # drafts were accepted: the draft ran


def test_larger_draft_head_is_refused(tmp_path, cache):
    from specsamp.decoding.generator import GeneratorSpec, load_generator

    target, draft = _pair(tmp_path, 304, 320)
    with pytest.raises(UserError, match="320 output rows but the target has 304") as info:
        load_generator(GeneratorSpec(target=target, draft=draft))
    assert "\n" not in str(info.value)


def test_vocab_mismatch_names_the_first_differing_token(tmp_path, cache):
    """Catches a check that compares only sizes, or names the wrong token: two tokens of
    the draft's vocabulary swapped, the message names the lower id and both its texts."""
    from specsamp.loading import check_same_vocab, load_model

    target, draft = _pair(tmp_path, 320, 320)
    path = os.path.join(draft, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[120:122]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(path, "w") as f:
        json.dump(tok, f)
    t, d = load_model(target), load_model(draft)
    with pytest.raises(UserError, match=f"token 120 is {a!r} in the target, {b!r} in the draft"):
        check_same_vocab(t, d)
