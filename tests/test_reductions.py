"""`cache_attention` on its own, where tiles hold several rows: a row's output is bit for
bit the same alone, at any place among other rows (other tile-mates, other tiles), and as
one token of a block or a single step (`specsamp.reductions` states the contract;
tests/test_batch_invariance.py checks whole models of one tile)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.reductions import attention_tile, cache_attention

# (J, G, E, S, cache type): tiles of 64, 4 and 1 rows (by the entries a row's keys hold)
SHAPES = [(2, 2, 8, 32, jnp.float32), (3, 3, 64, 64, jnp.bfloat16), (3, 3, 64, 256, jnp.float32)]
ROWS, T = 150, 5
WATCHED = (0, 77, 149)


def _inputs(j, g, e, s, dtype):
    rng = np.random.default_rng(s + e)
    q = rng.standard_normal((ROWS, T, j, g, e)).astype(np.float32)
    k, v = (rng.standard_normal((ROWS, j, s, e)).astype(np.float32) for _ in range(2))
    ends = rng.integers(T, s, ROWS)  # the block's last position, per row
    visible = np.arange(s)[None, None] <= (ends[:, None] - T + 1 + np.arange(T))[..., None]
    qdt = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    return jnp.asarray(q, qdt), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(visible)


attend = jax.jit(cache_attention)


@pytest.mark.parametrize("j,g,e,s,dtype", SHAPES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_rows_attention_is_bit_equal_alone_in_any_batch_and_as_single_steps(j, g, e, s, dtype):
    """Catches a tile whose product's rows depend on their tile-mates or their place in it,
    a tile size chosen from the batch (its bits would change with the row count), and
    tokens of a block computed together (a block's position against its single step)."""
    q, k, v, vis = _inputs(j, g, e, s, dtype)
    tile = attention_tile(k)
    assert tile == attention_tile(k[:1]) and tile in (1, 4, 64) and ROWS > 2 * tile
    alone = {r: np.asarray(attend(q[r:r + 1], k[r:r + 1], v[r:r + 1], vis[r:r + 1]), np.float32)[0]
             for r in WATCHED}
    for size in (tile + 3, ROWS):  # two tiles, the last one padded; many tiles
        rest = [r for r in np.random.default_rng(size).permutation(ROWS) if r not in WATCHED]
        rows = np.random.default_rng(size + 1).permutation((list(WATCHED) + rest)[:size])
        got = np.asarray(attend(q[rows], k[rows], v[rows], vis[rows]), np.float32)
        steps = np.concatenate([np.asarray(attend(q[rows, t:t + 1], k[rows], v[rows], vis[rows, t:t + 1]),
                                           np.float32) for t in range(T)], axis=1)
        for r in WATCHED:
            if r in rows:
                at = list(rows).index(r)
                np.testing.assert_array_equal(got[at], alone[r], err_msg=f"row {r} of {size}, block")
                np.testing.assert_array_equal(steps[at], alone[r], err_msg=f"row {r} of {size}, steps")


def test_attention_equals_softmax_attention():
    """The tiled loop computes attention: against a float64 reference of the same inputs."""
    q, k, v, vis = _inputs(3, 3, 64, 64, jnp.float32)
    qn, kn, vn, visn = (np.asarray(a, np.float64) for a in (q, k, v, vis))
    scores = np.einsum("btjge,bjse->btjgs", qn, kn)
    scores = np.where(visn[:, :, None, None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("btjgs,bjse->btjge", w / w.sum(-1, keepdims=True), vn)
    np.testing.assert_allclose(np.asarray(attend(q, k, v, vis)), want, rtol=1e-4, atol=1e-4)
