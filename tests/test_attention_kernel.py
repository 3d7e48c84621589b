"""The native cache-attention kernel (specsamp/quant/attention.cc) against XLA's attention:
the same numbers up to float rounding, the cache written in place at each row's positions,
slots beyond a row's position never read, and each query row computed alike whatever the
number of tokens in the call (what makes scoring K+1 tokens equal K+1 single steps)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.models.llama import ModelConfig, init_params
from specsamp.models.model import Model
from specsamp.quant import kernels

CFG = ModelConfig(vocab_size=32, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2,
                  head_dim=24, d_ff=64, max_seq_len=64)  # head width not a multiple of 16


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    error = kernels.load()
    if error:
        pytest.skip(error)


def _attend(layer, q, k, v, pos, kc, vc, scale, window=0, softcap=None):
    return jax.jit(kernels.attend, static_argnums=(7, 9))(layer, q, k, v, pos, kc, vc, scale,
                                                          window, softcap)


def _decode(model, params, rows, dtype=jnp.float32):
    """Prefill each row's prompt (different lengths: rows sit at different positions),
    then three single-token steps; returns the logits of every call and the final cache."""
    forward = jax.jit(model.forward)
    cache, outs = model.init_cache(len(rows), 32, dtype), []
    t = max(len(r) for r in rows)
    tokens = jnp.asarray([r + [0] * (t - len(r)) for r in rows], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    logits, cache = forward(params, tokens, positions, cache)
    outs.append(logits)
    nxt = jnp.asarray([len(r) for r in rows], jnp.int32)[:, None]
    for step in range(3):
        logits, cache = forward(params, jnp.full_like(nxt, step + 1), nxt + step, cache)
        outs.append(logits)
    return outs, cache


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_model_logits_match_xla_attention(dtype):
    """Catches a wrong kernel (softmax, masking, head grouping, cache offsets, the float16
    cache's rounding or reading): the whole model with the kernel gives XLA's logits on rows
    at different positions, with a cache of either type."""
    params = init_params(CFG, seed=3)
    rows = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [4, 4, 4, 4, 4]]
    got, got_cache = _decode(Model(CFG, attention="cpu"), params, rows, dtype)
    want, want_cache = _decode(Model(CFG, attention="xla"), params, rows, dtype)
    assert got_cache.k.dtype == want_cache.k.dtype == dtype
    # The two paths' keys differ by float32 rounding (their products sum in other orders);
    # rounded to half, a value that close to a rounding boundary lands one half step apart
    # (2^-11 relative), and that carries into the logits.
    tol = 2e-5 if dtype == jnp.float32 else 2e-3
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)
    for name in ("k", "v"):  # the same slots written with the same values
        np.testing.assert_allclose(np.asarray(getattr(got_cache, name), np.float32),
                                   np.asarray(getattr(want_cache, name), np.float32),
                                   rtol=tol, atol=tol)


def _inputs(b, t, h=6, j=2, e=24, layers=3, slots=32, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, t, h, e))
    k = jax.random.normal(ks[1], (b, t, j, e))
    v = jax.random.normal(ks[2], (b, t, j, e))
    kc = jax.random.normal(ks[3], (layers, b, j, slots, e)).astype(dtype)
    vc = jax.random.normal(ks[4], (layers, b, j, slots, e)).astype(dtype)
    return q, k, v, kc, vc


# Head widths: 24 (not a multiple of 16: the portable loops), 64 (the embedded model's: with
# AVX-512 the vector scores of 16 slots at once); starts such that rows cover whole blocks
# of 16 slots and a partial last one; the last entry gives every row of the batch test an
# odd count of slots (15, 37, 47, 1), so the weighted sums end on a lone even slot.
WIDTHS = [(24, 32, (5, 11)), (64, 48, (13, 37)), (64, 47, (14, 36))]
DTYPES = [jnp.float32, jnp.float16]  # what the cache holds


def _reference(q, keys, vals, scale, softcap=None):
    """Plain numpy attention of one query over its row's slots (keys, vals [n, E])."""
    s = keys.astype(np.float64) @ (q.astype(np.float64) * scale)
    if softcap:
        s = np.tanh(s / softcap) * softcap
    w = np.exp(s - s.max())
    return (w / w.sum()) @ vals.astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,slots,starts", WIDTHS)
def test_rows_alike_whatever_the_token_count(e, slots, starts, dtype):
    """Catches a kernel whose numbers depend on T (vector tails, shared partial sums):
    four tokens in one call give bit for bit the outputs of four one-token calls; and
    every output is the plain numpy attention over the row's slots (as the cache holds
    them: float16 values read back exactly)."""
    q, k, v, kc, vc = _inputs(2, 4, e=e, slots=slots, dtype=dtype)
    start = jnp.asarray([[starts[0]], [starts[1]]], jnp.int32)
    pos = start + jnp.arange(4, dtype=jnp.int32)
    out, k4, v4 = _attend(1, q, k, v, pos, kc, vc, 0.2)
    kc1, vc1, outs = kc, vc, []
    for i in range(4):
        o, kc1, vc1 = _attend(1, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], pos[:, i:i + 1],
                              kc1, vc1, 0.2)
        outs.append(o)
    assert np.array_equal(np.asarray(out), np.asarray(jnp.concatenate(outs, axis=1)))
    assert np.array_equal(np.asarray(k4), np.asarray(kc1))
    assert np.array_equal(np.asarray(v4), np.asarray(vc1))
    out, k4, v4, qn = np.asarray(out), np.asarray(k4), np.asarray(v4), np.asarray(q)
    for b in range(2):
        for i in range(4):
            n = int(pos[b, i]) + 1
            for h in range(6):
                j = h // 3
                np.testing.assert_allclose(
                    out[b, i, h], _reference(qn[b, i, h], k4[1, b, j, :n], v4[1, b, j, :n], 0.2),
                    rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,slots,starts", WIDTHS)
def test_rows_alike_whatever_the_batch(e, slots, starts, dtype):
    """Catches a row whose numbers depend on its batch: from 3 rows on, the kernel's work
    items change from (row, query head) to (row, KV head); each row of a batch of 4 gives
    bit for bit what it gives alone, and a wrong head-to-KV-head map fails the reference.
    With odd slot counts, also a grouped pass that adds a lone last slot into the other
    sum than one head alone does (`a[g][G > 1][c]` in weighted_avx512's odd tail)."""
    q, k, v, kc, vc = _inputs(4, 1, e=e, slots=slots, seed=2, dtype=dtype)
    pos = jnp.asarray([[starts[0]], [starts[1]], [slots - 1], [0]], jnp.int32)
    out, kb, vb = (np.asarray(a) for a in _attend(0, q, k, v, pos, kc, vc, 0.2))
    for b in range(4):
        one = _attend(0, q[b:b + 1], k[b:b + 1], v[b:b + 1], pos[b:b + 1], kc[:, b:b + 1],
                      vc[:, b:b + 1], 0.2)[0]
        assert np.array_equal(out[b], np.asarray(one[0]))
        n = int(pos[b, 0]) + 1
        for h in range(6):
            np.testing.assert_allclose(
                out[b, 0, h],
                _reference(np.asarray(q[b, 0, h]), kb[0, b, h // 3, :n], vb[0, b, h // 3, :n], 0.2),
                rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,slots,starts", WIDTHS)
@pytest.mark.parametrize("window,softcap", [(5, None), (20, 2.0), (1, None)])
def test_sliding_window_and_softcap(e, slots, starts, window, softcap, dtype):
    """Catches a window read from the wrong slot (off by one: a key at distance == window
    must be hidden), a window that leaks between rows or depends on the batch or on T, a
    soft cap applied wrongly or not at all: rows at different positions (one short of the
    window, several blocks of 16 past it) against the numpy reference over their window,
    each row bit for bit as alone, and four tokens in one call as four calls."""
    q, k, v, kc, vc = _inputs(3, 4, e=e, slots=slots, seed=4, dtype=dtype)
    pos = jnp.asarray([[starts[0]], [starts[1]], [0]], jnp.int32) + jnp.arange(4, dtype=jnp.int32)
    out, kw, vw = (np.asarray(a) for a in _attend(1, q, k, v, pos, kc, vc, 0.3, window, softcap))
    for b in range(3):
        one = _attend(1, q[b:b + 1], k[b:b + 1], v[b:b + 1], pos[b:b + 1], kc[:, b:b + 1],
                      vc[:, b:b + 1], 0.3, window, softcap)[0]
        assert np.array_equal(out[b], np.asarray(one[0]))
        steps = [_attend(1, q[b:b + 1, i:i + 1], k[b:b + 1, i:i + 1], v[b:b + 1, i:i + 1],
                         pos[b:b + 1, i:i + 1], kw[:, b:b + 1], vw[:, b:b + 1], 0.3, window,
                         softcap)[0] for i in range(4)]
        assert np.array_equal(out[b], np.asarray(jnp.concatenate(steps, axis=1))[0])
        for i in range(4):
            p = int(pos[b, i])
            lo = max(0, p - window + 1)
            for h in range(6):
                np.testing.assert_allclose(
                    out[b, i, h], _reference(np.asarray(q[b, i, h]), kw[1, b, h // 3, lo:p + 1],
                                             vw[1, b, h // 3, lo:p + 1], 0.3, softcap),
                    rtol=2e-5, atol=2e-6)


def test_windowed_model_matches_xla_attention():
    """Catches the kernel and XLA disagreeing on a Gemma-like model (per-layer windows and
    RoPE bases through the scan, soft cap, (1 + w) norms, q/k norms), rows at different
    positions past the window, over prefill and single steps."""
    cfg = dataclasses.replace(CFG, sliding_window=4, sliding_layers=(True, False, True),
                              local_rope_theta=100.0, attn_softcap=2.0, final_softcap=5.0,
                              norm_plus_one=True, post_norms=True, qk_norm=True,
                              embed_scale=True, activation="gelu_tanh", query_scale=0.3)
    params = init_params(cfg, seed=5)
    rows = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [4, 4, 4, 4, 4]]
    got, _ = _decode(Model(cfg, attention="cpu"), params, rows)
    want, _ = _decode(Model(cfg, attention="xla"), params, rows)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e", [24, 64])
def test_writes_in_place_and_ignores_later_slots(e, dtype):
    """Catches writes at the wrong layer/slot and reads past a row's position: slots after
    the position hold NaN and must not reach the output (the vector path computes a last,
    partial block of 16 slots whole: the slots past the position must stay in their own
    lanes); other layers are untouched."""
    q, k, v, kc, vc = _inputs(2, 2, e=e, seed=1, dtype=dtype)
    pos = jnp.asarray([[3, 4], [20, 21]], jnp.int32)
    slot = jnp.arange(32)[None, None, None, :, None]
    poison = slot > jnp.asarray([4, 21])[None, :, None, None, None]
    kc, vc = jnp.where(poison, jnp.nan, kc), jnp.where(poison, jnp.nan, vc)
    out, k2, v2 = _attend(2, q, k, v, pos, kc, vc, 0.2)
    assert np.isfinite(np.asarray(out)).all()
    k2 = np.asarray(k2)
    for b in range(2):
        for i in range(2):
            np.testing.assert_array_equal(k2[2, b, :, int(pos[b, i])],
                                          np.asarray(k[b, i].astype(dtype)))
    np.testing.assert_array_equal(k2[:2], np.asarray(kc)[:2])
    # a plain numpy reference of the attention for one row and head
    b, t, h, j = 1, 1, 4, 4 // 3
    keys = k2[2, b, j, : int(pos[b, t]) + 1].astype(np.float32)
    vals = np.asarray(v2)[2, b, j, : int(pos[b, t]) + 1].astype(np.float32)
    s = keys @ (np.asarray(q)[b, t, h] * 0.2)
    w = np.exp(s - s.max())
    np.testing.assert_allclose(np.asarray(out)[b, t, h], (w / w.sum()) @ vals, rtol=1e-5, atol=1e-6)


def test_float16_cache_rounds_as_numpy_does():
    """Catches a wrong float-to-half conversion in the cache write (rounding, ties,
    subnormals, overflow, signs, nan): the written keys are bit for bit numpy's float16
    of the new keys, the other slots untouched."""
    e = 16
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, np.inf,
                        -np.inf, 6.1e-5, 6.0e-8, 2.9e-8, 3.0e-8, 1e-9], np.float32)
    ties = np.float32(1.0) + np.float32(2.0 ** -11) * np.arange(1, 17, dtype=np.float32)
    halfway = np.float32(2.0 ** -24) * (np.arange(16, dtype=np.float32) + np.float32(0.5))
    new = np.stack([special, ties, halfway, np.random.default_rng(0).normal(size=e) * 300])
    k = jnp.asarray(new.astype(np.float32))[:, None, None, :]  # [B=4, T=1, J=1, E]
    q = jnp.zeros((4, 1, 1, e), jnp.float32)
    kc = jnp.full((1, 4, 1, 8, e), 7.0, jnp.float16)
    pos = jnp.full((4, 1), 3, jnp.int32)
    _, k2, _ = _attend(0, q, k, k, pos, kc, kc, 1.0)
    got = np.asarray(k2)[0, :, 0]
    assert got.dtype == np.float16
    with np.errstate(over="ignore"):  # 1e6 and 65520 overflow to infinity, as they must
        want = new.astype(np.float16)
    np.testing.assert_array_equal(got[:, 3].view(np.uint16), want.view(np.uint16))
    assert (np.delete(got, 3, axis=1) == 7.0).all()


def test_float16_nan_stays_nan():
    k = jnp.full((1, 1, 1, 16), jnp.nan, jnp.float32)
    kc = jnp.zeros((1, 1, 1, 4, 16), jnp.float16)
    _, k2, _ = _attend(0, jnp.zeros((1, 1, 1, 16)), k, k, jnp.zeros((1, 1), jnp.int32), kc, kc, 1.0)
    assert np.isnan(np.asarray(k2)[0, 0, 0, 0]).all()
