"""Tiny random model pairs shared by the engine tests (one compiled program per shape)."""

import dataclasses
import functools

import jax

from specsamp.models.llama import ModelConfig, init_params

TARGET = ModelConfig(vocab_size=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=8, d_ff=48, max_seq_len=256)
DRAFT = ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                    head_dim=8, d_ff=32, max_seq_len=256)


@functools.cache
def target_params():
    # Scale 1: distributions spread over the 8 tokens (checked), and far from the draft's.
    return init_params(TARGET, seed=11, scale=1.0)


@functools.cache
def draft_params():
    return init_params(DRAFT, seed=12, scale=1.0)


# A draft whose head is smaller than the target's (ids 6 and 7 missing), as some families'
# small models pad their embedding less than the large ones.
SMALL_HEAD_DRAFT = dataclasses.replace(DRAFT, vocab_size=6)


@functools.cache
def small_head_draft_params():
    return init_params(SMALL_HEAD_DRAFT, seed=13, scale=1.0)


def early_exit_params(n_layers=1):
    p = target_params()
    return {**p, "layers": jax.tree.map(lambda a: a[:n_layers], p["layers"])}


@functools.cache
def feature_draft():
    """(cfg, params) of a 1-layer feature-conditioned draft on TARGET, with a random `fc`
    so that both halves of its input matter."""
    import jax.numpy as jnp

    from specsamp.models.feature_draft import init_feature_draft

    cfg, params = init_feature_draft(TARGET, target_params(), n_layers=1, init_layer=1)
    fc = jax.random.normal(jax.random.PRNGKey(5), params["fc"]["kernel"].shape) * 0.3
    return cfg, {**params, "fc": {"kernel": params["fc"]["kernel"] + fc.astype(jnp.float32)}}


@functools.cache
def feature_draft_reduced():
    """The same draft with a reduced head over 5 of the 8 tokens, padded as decoding loads
    one (to 16 rows, the last id repeated: `reduced_head(pad=True)`)."""
    from specsamp.models.feature_draft import reduced_head

    cfg, params = feature_draft()
    return cfg, {**params, **reduced_head(TARGET, target_params(), [0, 2, 3, 5, 6], pad=True)}


# Drafts by name for `specsamp.decoding.factory.build_drafter`, so that tests build their
# drafters through the same factory as users (a draft string), from these in-memory weights.
_DRAFTS = {
    "tiny-draft": lambda: ("model", DRAFT, draft_params()),
    "tiny-draft-small-head": lambda: ("model", SMALL_HEAD_DRAFT, small_head_draft_params()),
    "tiny-feature": lambda: ("feature", *feature_draft()),
    "tiny-feature-reduced": lambda: ("feature", *feature_draft_reduced()),
}


def load_draft(path: str, feature_only: bool = False, dtype: str = "float32"):
    """A draft by name; a draft model's weights at `dtype` (as the generator loads a draft
    at the target's dtype), a feature draft's as they are."""
    from specsamp.decoding.factory import DraftWeights

    kind, cfg, params = _DRAFTS[path]()
    return DraftWeights(kind, cfg, at_dtype(params, dtype) if kind == "model" else params)


def at_dtype(params, dtype: str):
    """A parameter tree with its float arrays at `dtype` (what `load_model(dtype=...)` gives);
    float32: the tree itself."""
    return params if dtype == "float32" else jax.tree.map(lambda a: a.astype(dtype), params)


def drafter(draft: str, k: int, sp, mesh=None, target_params_=None, wide: int = 0,
            dtype: str = "float32"):
    """(drafter, draft params) for a draft string on TARGET: 'ngram', 'early-exit:1',
    'tiny-draft', 'tiny-feature', 'ngram+tiny-feature-reduced', ... (wide: a hybrid's wide
    lookup rounds, as `k auto` builds it; dtype: a draft model's and the target's floats)."""
    import functools

    from specsamp.decoding.factory import build_drafter

    params = target_params() if target_params_ is None else target_params_
    return build_drafter(draft, k, sp, TARGET, at_dtype(params, dtype),
                         functools.partial(load_draft, dtype=dtype), mesh, wide=wide)


@functools.cache
def near_tie_params():
    """TARGET's weights with its (tied) embedding rows in near-equal pairs: row 2i + 1 is
    row 2i plus noise of scale 1e-6, 3e-7, 1e-7 or 3e-8 (pair i). Within a pair the two
    logits differ by a few rounding steps or less, so the argmax at nearly every position
    is decided by the last bits (the smaller scales: numerical drift, a row's numbers
    depending on its batch or on T) or by small changes of the hidden state (the larger:
    a missing or stale cache entry): both change greedy tokens, where the plain tiny
    model's far-apart logits hide them."""
    import jax.numpy as jnp
    import numpy as np

    p = target_params()
    emb = np.asarray(p["embed"]["embedding"])
    noise = np.random.default_rng(3).standard_normal(emb[1::2].shape).astype(np.float32)
    emb = emb.copy()
    emb[1::2] = emb[0::2] + np.float32([1e-6, 3e-7, 1e-7, 3e-8])[:, None] * noise
    return {**p, "embed": {"embedding": jnp.asarray(emb)}}
