"""Reductions whose order never depends on how many rows share a call.

Contract: a row's result from every function here is bit for bit the same whether the
row is computed alone or among any number of other rows, and whether its tokens come in
one block (a K+1 scoring call, a prefill pass) or one at a time. That is what makes "a
sample depends only on its seed, not on its batch" and "greedy speculative equals greedy
autoregressive" exact instead of true up to near-ties.

Why: XLA is free to vectorise a reduction (jnp.sum, jnp.mean, softmax's sum, cumsum) and
a float32 dot differently for each shape, and does: on XLA:CPU an RMSNorm's sum of squares
gets other bits once a call holds 8 or more rows, and a dot's rows change from 1 row to 2.
Here sums are a fixed binary tree of element-wise adds (XLA does not reassociate
element-wise float adds), so the order is a function of the reduced length only; float
products go through a product of one fixed shape in a loop (`row_dot`).

Where the process has several devices (a tensor-parallel split), the products and XLA's
attention run batched instead: a per-row loop there would all-reduce once per row. Rows
are then equal across batches up to rounding only (the split's own cross-device sums are
not batch-invariant either).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def tree_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over `axis` as a fixed binary tree: the axis zero-padded to a power of two (x + 0
    is x exactly), then halves added until one entry is left. The order depends on the
    axis' length only."""
    axis = axis % x.ndim
    n = x.shape[axis]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - n)
        x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, half, axis=axis) + jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
    return x if keepdims else jnp.squeeze(x, axis)


def tree_mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    return tree_sum(x, axis, keepdims) / x.shape[axis]


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """jax.nn.softmax with its sum a `tree_sum` (the max is exact in any order)."""
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return e / tree_sum(e, axis, keepdims=True)


def cumsum(x: jax.Array) -> jax.Array:
    """Running sum over the last axis in a fixed order (Hillis-Steele: log2(n) rounds of
    shifted element-wise adds), the same for any leading shape."""
    n = x.shape[-1]
    shift = 1
    while shift < n:
        pad = jnp.zeros(x.shape[:-1] + (shift,), x.dtype)
        x = x + jnp.concatenate([pad, x[..., :-shift]], axis=-1)
        shift *= 2
    return x


_BATCHED = [False]  # set by `batched_products`


def per_row() -> bool:
    """Whether products go one row at a time (one device, outside `batched_products`; see
    the module's note). Read when a program is traced."""
    return jax.device_count() == 1 and not _BATCHED[0]


@contextlib.contextmanager
def batched_products():
    """Programs traced inside run their products and XLA attention batched, as on several
    devices: rows equal across batches up to rounding only, and far faster where a call
    holds many rows (a teacher-forced pass over a whole sequence, a training step, a GPU,
    where a per-row loop is one small kernel per row). For work that needs no bit-equal
    rows: distillation's data and training (`specsamp distill`), never decoding. A
    program traced inside stays batched wherever JAX reuses its trace (a module-level
    jit's cache holds no note of this flag), so use it in a process that decodes nothing
    afterwards, as the distill commands do."""
    before = _BATCHED[0]
    _BATCHED[0] = True
    try:
        yield
    finally:
        _BATCHED[0] = before


# Weights of at most this many entries go through products of TILE rows at a time (a
# fixed [TILE, C] x [C, N] shape, in which a row's bits do not depend on its place or its
# tile-mates: what XLA:CPU does, and tests/test_batch_invariance.py checks; a loop step per
# row would cost more than the product); larger ones one row at a time ([1, C] x [C, N],
# a pass over w per row where a batched product shares one).
SMALL_PRODUCT = 1 << 16
TILE = 64


def wide_type(dtype) -> jnp.dtype:
    """The type products of `dtype` operands are computed in: float32 for 16-bit floats
    (exact products, float32 sums, as accelerators run bfloat16; XLA:CPU's own bfloat16
    products round as they go and run about 100x slower), else `dtype`. Operands are
    converted before a loop over products, not inside it: XLA folds a conversion next to
    a product back into a 16-bit product."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else dtype


def row_dot(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """x [..., C] times w [C, N] (w [N, C] with `transposed`), a row's bits independent of
    the count of rows or tokens in the call: rows go through one compiled product shape
    inside a loop, chosen by w's shape only (SMALL_PRODUCT)."""
    contract = 1 if transposed else 0
    out_type = jnp.promote_types(x.dtype, w.dtype)
    x, w = x.astype(wide_type(out_type)), w.astype(wide_type(out_type))
    if not per_row():
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (contract,)), ((), ()))).astype(out_type)
    lead, c = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, c)
    m = rows.shape[0]
    tile = TILE if w.size <= SMALL_PRODUCT else 1
    rows = jnp.pad(rows, ((0, -m % tile), (0, 0))).reshape(-1, tile, c)
    dims = (((1,), (contract,)), ((), ()))
    out = jax.lax.map(lambda r: jax.lax.dot_general(r, w, dims), rows)
    return out.reshape(-1, out.shape[-1])[:m].reshape(lead + (out.shape[-1],)).astype(out_type)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping); x itself without a cap."""
    return x if cap is None else jnp.tanh(x / cap) * cap


# XLA attention runs rows in tiles of a fixed count: the largest power of two up to 64
# whose keys ([J, S, E] a row) hold at most ATTENTION_TILE_ENTRIES entries, so a small
# model's thousands of rows go through tens of loop steps, a large cache's one row a step.
ATTENTION_TILE_ENTRIES = 1 << 16


def attention_tile(k_cache: jax.Array) -> int:
    """Rows per step of `cache_attention`: a function of the cache's row shape only."""
    per_row = max(1, k_cache[0].size)
    return 1 << max(0, min(6, (ATTENTION_TILE_ENTRIES // per_row).bit_length() - 1))


def cache_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    visible: jax.Array, cap: float | None = None) -> jax.Array:
    """Grouped-query attention over a cache, one token of a tile of rows at a time: q [B,
    T, J, G, E] (already scaled), k_cache, v_cache [B, J, S, E], visible [B, T, S] -> [B,
    T, J, G, E]. Rows go in tiles of `attention_tile` rows (padded; the pad rows computed
    and dropped), tokens one at a time; each step is products of one fixed shape ([R, J,
    G, E] x [R, J, S, E], then [R, J, G, S] x [R, J, S, E]) and a `softmax` over the S
    slots, so a row's bits depend neither on the batch nor on T (a K+1 block gives each
    position the numbers of a single step). Scores are soft-capped at `cap` (if any)
    before the mask, as Gemma 2 does."""
    neg = jnp.finfo(jnp.float32).min
    # The types jnp.einsum would promote to: a float16 cache is read as q's float32.
    dt = jnp.promote_types(q.dtype, k_cache.dtype)
    wide = wide_type(dt)  # products of 16-bit operands in float32, rounded to dt after
    if not per_row():
        qw, kw, vw = (a.astype(dt).astype(wide) for a in (q, k_cache, v_cache))
        scores = jnp.einsum("btjge,bjse->bjgts", qw, kw).astype(dt).astype(jnp.float32)
        scores = jnp.where(visible[:, None, None], softcap(scores, cap), neg)
        weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype).astype(dt).astype(wide)
        return jnp.einsum("bjgts,bjse->btjge", weights, vw).astype(dt)
    b, tile = q.shape[0], attention_tile(k_cache)

    def tiles(a):  # [B, ...] -> [B / tile, tile, ...], zero rows padded
        a = jnp.pad(a, [(0, -b % tile)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape((-1, tile) + a.shape[1:])

    def one(q_t, keys, vals, vis_t):  # q_t [R, J, G, E], vis_t [R, S]
        scores = jax.lax.dot_general(q_t, keys, (((3,), (3,)), ((0, 1), (0, 1)))).astype(dt)
        scores = jnp.where(vis_t[:, None, None], softcap(scores.astype(jnp.float32), cap), neg)
        weights = softmax(scores).astype(q.dtype).astype(dt).astype(wide)
        return jax.lax.dot_general(weights, vals, (((3,), (2,)), ((0, 1), (0, 1))))

    def rows(args):
        q_r, keys, vals, vis_r = args  # q_r [R, T, J, G, E], vis_r [R, T, S]
        q_r = q_r.astype(dt).astype(wide)
        keys, vals = keys.astype(dt).astype(wide), vals.astype(dt).astype(wide)
        out = jax.lax.map(lambda a: one(a[0], keys, vals, a[1]),
                          (jnp.swapaxes(q_r, 0, 1), jnp.swapaxes(vis_r, 0, 1)))
        return jnp.swapaxes(out, 0, 1)

    out = jax.lax.map(rows, tuple(map(tiles, (q, k_cache, v_cache, visible))))
    return out.reshape((-1,) + out.shape[2:])[:b].astype(dt)  # rounded here, not in the loop
