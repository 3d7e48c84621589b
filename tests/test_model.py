"""The decoder with its fixed-size cache against a full forward pass without cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.models.llama import ModelConfig, Transformer, init_cache, init_params

CONFIGS = {
    "tied": ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48),
    "untied-bias-mha": ModelConfig(
        vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=8, d_ff=48,
        tie_embeddings=False, qkv_bias=True, rope_theta=1e6,
    ),
}


def full_forward(cfg, params, tokens):
    """Every position at once, fresh cache exactly as long as the sequence."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = Transformer(cfg).apply({"params": params}, tokens, positions, init_cache(cfg, b, t))
    return np.asarray(logits)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_incremental_decoding_equals_full_forward(name):
    """Catches wrong cache writes, wrong causal masks and RoPE position bugs."""
    cfg = CONFIGS[name]
    params = init_params(cfg, seed=3, scale=2.0)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 12), 0, cfg.vocab_size)
    expected = full_forward(cfg, params, tokens)

    model = Transformer(cfg)
    cache = init_cache(cfg, 2, 32)
    chunks = [(0, 5), (5, 6), (6, 9), (9, 12)]  # prefill, one token, a K+1 block, another
    got = []
    for a, b in chunks:
        pos = jnp.broadcast_to(jnp.arange(a, b), (2, b - a))
        logits, cache = model.apply({"params": params}, tokens[:, a:b], pos, cache)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=2e-4, rtol=2e-4)
    assert np.abs(expected).std() > 0.5  # the check is not vacuous: logits are not flat


def test_rows_at_different_positions_and_stale_slots():
    """Rows of a batch advance independently; slots past a row's position (rejected draft
    tokens) are never read and are overwritten by the next write."""
    cfg = CONFIGS["tied"]
    params = init_params(cfg, seed=1, scale=2.0)
    model = Transformer(cfg)
    seq = jax.random.randint(jax.random.PRNGKey(5), (2, 10), 0, cfg.vocab_size)
    expected = full_forward(cfg, params, seq)

    cache = init_cache(cfg, 2, 16)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    _, cache = model.apply({"params": params}, seq[:, :6], pos, cache)
    # Row 0 writes garbage at 6..8 (a rejected draft), row 1 writes real tokens at 6..8.
    garbage = jnp.stack([jnp.array([1, 2, 3]), seq[1, 6:9]])
    pos = jnp.broadcast_to(jnp.arange(6, 9), (2, 3))
    _, cache = model.apply({"params": params}, garbage, pos, cache)
    # Row 0 rewinds to position 6, row 1 continues at 9: per-row positions.
    block = jnp.stack([seq[0, 6:8], seq[1, 8:10]])
    pos = jnp.array([[6, 7], [8, 9]])
    logits, _ = model.apply({"params": params}, block, pos, cache)
    np.testing.assert_allclose(np.asarray(logits[0]), expected[0, 6:8], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(logits[1]), expected[1, 8:10], atol=2e-4, rtol=2e-4)
