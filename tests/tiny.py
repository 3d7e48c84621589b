"""Tiny random model pairs shared by the engine tests (one compiled program per shape)."""

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
    """The same draft with a reduced head over 5 of the 8 tokens."""
    from specsamp.models.feature_draft import reduced_head

    cfg, params = feature_draft()
    return cfg, {**params, **reduced_head(TARGET, target_params(), [0, 2, 3, 5, 6])}


# Drafts by name for `specsamp.decoding.factory.build_drafter`, so that tests build their
# drafters through the same factory as users (a draft string), from these in-memory weights.
_DRAFTS = {
    "tiny-draft": lambda: ("model", DRAFT, draft_params()),
    "tiny-feature": lambda: ("feature", *feature_draft()),
    "tiny-feature-reduced": lambda: ("feature", *feature_draft_reduced()),
}


def load_draft(path: str, feature_only: bool = False):
    from specsamp.decoding.factory import DraftWeights

    return DraftWeights(*_DRAFTS[path]())


def drafter(draft: str, k: int, sp, mesh=None, target_params_=None, wide: int = 0):
    """(drafter, draft params) for a draft string on TARGET: 'ngram', 'early-exit:1',
    'tiny-draft', 'tiny-feature', 'ngram+tiny-feature-reduced', ... (wide: a hybrid's wide
    lookup rounds, as `k auto` builds it)."""
    from specsamp.decoding.factory import build_drafter

    params = target_params() if target_params_ is None else target_params_
    return build_drafter(draft, k, sp, TARGET, params, load_draft, mesh, wide=wide)


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
