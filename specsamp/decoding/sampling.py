"""Logits -> float32 probabilities, and drawing from them.

Order (fixed; the draft and the target get the same transform):
  1. temperature: logits / T (T = 0 is greedy: a point mass on the argmax, first index on ties);
  2. top-k: keep the k largest tempered logits (ties at the k-th value are all kept);
  3. top-p: of what is left, keep the smallest prefix of tokens sorted by probability whose
     mass reaches p (the token crossing p is kept; ties at either cut are all kept);
  4. renormalise.
The arrays returned here are the very arrays a draft token is drawn from, the arrays in
min(1, q/p), and the arrays in the residual (q - p)+. Nothing mutates them in between.

Every sum and running sum here is `specsamp.reductions`' fixed-order one, so a row's
probabilities and draws are bit for bit the same in any batch (a sample depends only on
its seed and its logits). On one CPU device with the native kernels, a vocabulary's sums
and the draw run as kernels (`native_rows`) that compute the same operations in the same
order: the same bits, at a fraction of XLA:CPU's cost for them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specsamp.decoding.config import SamplingParams
from specsamp.models.argmax import first_argmax
from specsamp.quant import kernels
from specsamp.reductions import cumsum, tree_sum


# Rows at least this long (a vocabulary) are summed, and drawn from, by the native kernels
# where they run (`specsamp.quant.kernels`, reduce.cc): the same operations in the same
# order, so the same bits, in one pass instead of XLA:CPU's padded copy and a dozen small
# loops for a tree sum, and fused loops that recompute their inputs at every level of a
# running sum (docs/measurements.md).
NATIVE_ROWS_FROM = 4096


def native_rows(n: int) -> bool:
    """Whether a float32 row of n entries goes through the native kernels (decided when a
    program is traced; the result is the same bits either way)."""
    return n >= NATIVE_ROWS_FROM and kernels.on_one_cpu_device()


def row_sum(x: jax.Array) -> jax.Array:
    """`reductions.tree_sum` over the last axis, kept ([..., 1]): on the kernel for long
    float32 rows."""
    if x.dtype == jnp.float32 and native_rows(x.shape[-1]):
        return kernels.tree_sum(x)[..., None]
    return tree_sum(x, keepdims=True)


def softmax(x: jax.Array) -> jax.Array:
    """`reductions.softmax` over the last axis, its sum a `row_sum`. The max stays in XLA:
    XLA:CPU computes the exponentials inside the same fused operation as the max, and their
    last bits depend on the operation that computes them, so a max taken elsewhere would
    change the probabilities' bits."""
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / row_sum(e)


def probs_from_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """logits [..., V] -> probabilities [..., V] float32. `sp` is static."""
    logits = logits.astype(jnp.float32)
    if sp.greedy:
        return jax.nn.one_hot(first_argmax(logits), logits.shape[-1], dtype=jnp.float32)
    logits = logits / sp.temperature
    neg = jnp.finfo(jnp.float32).min
    if 0 < sp.top_k < logits.shape[-1]:
        logits = jnp.where(logits >= _kth_largest(logits, sp.top_k), logits, neg)
    probs = softmax(logits)
    if sp.top_p < 1.0:
        probs = _nucleus(probs, sp.top_p)
    return probs


def _kth_largest(x: jax.Array, k: int) -> jax.Array:
    """Each row's k-th largest entry, kept ([..., 1]): on the native kernel for long float32
    rows (a heap of the k largest: ~0.03 ms for 49,152 entries against ~0.1 ms for XLA's
    TopK; the same bits)."""
    if x.dtype == jnp.float32 and native_rows(x.shape[-1]):
        return kernels.top_value(x, k)[..., None]
    return top_k(x, k)[0][..., -1:]


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` behind an optimization barrier. XLA:CPU runs lax.top_k as its fast TopK
    call only while nothing slices the result inside the same program; the k-th value's
    `[..., -1:]` or a running sum's shifted slices let it rewrite top_k into a full sort of
    the row: ~7.5 ms against ~0.2 ms for a 49,152-token row (docs/measurements.md). The
    barrier changes no value."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


# The nucleus cut is looked for among the largest 256, then 4,096 tokens (lax.top_k), and
# only then in a full sort of the row (~10 ms for 49,152 tokens on a CPU).
_NUCLEUS_TIERS = (256, 4096)


def _nucleus(probs: jax.Array, top_p: float) -> jax.Array:
    """Keep the most likely tokens until their mass reaches top_p.

    A full sort of a large vocabulary's probabilities costs more than a decode step, so the
    cut is first looked for among the 256 largest (lax.top_k, far cheaper), then among the
    4,096 largest, and the whole row is sorted only when some row's nucleus is wider still.
    Every tier's running mass is the same numbers: the top 256's running sum, then the
    running sum of what follows added to its total (a running sum's entry depends only on
    the entries before it, `reductions.cumsum`), so where a smaller tier covers top_p the
    larger ones see bit-identical masses and give bit-identical cuts: which tier ran never
    changes a row's distribution.
    """
    if probs.dtype == jnp.float32 and native_rows(probs.shape[-1]):
        # The tiers in one kernel, each row on its own (a heap of the largest entries, the
        # same running sums and cut: the same bits; ~0.03 ms a row against ~0.15 for XLA)
        cut = kernels.nucleus_cut(probs, _NUCLEUS_TIERS, top_p)[..., None]
    else:
        cut = _nucleus_tiers(probs, top_p)
    kept = jnp.where(probs >= cut, probs, 0.0)
    return kept / row_sum(kept)


def _nucleus_tiers(probs: jax.Array, top_p: float) -> jax.Array:
    """`_nucleus`'s cut on the XLA operations, [..., 1]: the tiers of its note."""
    v = probs.shape[-1]
    first = min(_NUCLEUS_TIERS[0], v)
    top = top_k(probs, first)[0]
    top_mass = cumsum(top)

    def continued(rest):  # the running mass past the top 256
        return jnp.concatenate([top_mass, top_mass[..., -1:] + cumsum(rest)], axis=-1)

    def full():
        rest = -jnp.sort(-probs, axis=-1)[..., first:]
        return _smallest_kept(jnp.concatenate([top, rest], axis=-1), continued(rest), top_p)

    def tier(i: int):
        """The cut among the largest _NUCLEUS_TIERS[i] tokens, or the next tier's."""
        if i == len(_NUCLEUS_TIERS):
            return full()
        k = min(_NUCLEUS_TIERS[i], v)
        ranked = top if i == 0 else top_k(probs, k)[0]
        mass = top_mass if i == 0 else continued(ranked[..., first:])
        # Covered: the tier's own running mass (the very numbers the cut compares) reaches
        # top_p in every row, so no token past the tier can be inside any row's nucleus.
        return jax.lax.cond(jnp.all(mass[..., -1] >= top_p) | (k == v),
                            lambda: _smallest_kept(ranked, mass, top_p), lambda: tier(i + 1))

    return tier(0)


def _smallest_kept(sorted_p: jax.Array, mass: jax.Array, top_p: float) -> jax.Array:
    """The smallest kept probability, given probabilities sorted in descending order and
    their running mass: the token whose inclusion reaches top_p. Keeping every token at
    least that likely keeps ties at the cut (as top-k does)."""
    mass_before = jnp.concatenate([jnp.zeros_like(mass[..., :1]), mass[..., :-1]], axis=-1)
    return jnp.min(jnp.where(mass_before < top_p, sorted_p, jnp.inf), axis=-1, keepdims=True)


_BLOCK = 256  # inverse-CDF sampling: running mass over blocks, then within the chosen block


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row of probs [..., V] (zeros are never drawn).

    Inverse CDF with one uniform draw per row: the token whose running mass first exceeds
    u x total. Gumbel-max over the vocabulary (jax.random.categorical) draws V random
    numbers, which costs more than the rest of a quantized decode step. The
    running mass is taken in two levels (block sums, then one block of 256), which costs
    a reduction over V instead of a 49k-long prefix sum."""
    lead, v = probs.shape[:-1], probs.shape[-1]
    if not lead:
        return _sample_row(key, probs)
    keys = jax.random.split(key, math.prod(lead))
    return jax.vmap(_sample_row)(keys, probs.reshape(-1, v)).reshape(lead)


def _sample_row(key: jax.Array, p: jax.Array) -> jax.Array:
    return draw(p, jax.random.uniform(key, (), jnp.float32))


def draw(p: jax.Array, u: jax.Array) -> jax.Array:
    """The token of p [V] whose running mass first exceeds u x the total (u in [0, 1)).
    On the native kernels for a long float32 row: the same draw, bit for bit, in one pass
    (`specsamp.quant.kernels.sample`)."""
    v = p.shape[0]
    if p.dtype == jnp.float32 and native_rows(v):
        return kernels.sample(p, u)
    pad = -v % _BLOCK
    blocks = jnp.pad(p, (0, pad)).reshape(-1, _BLOCK)
    sums = tree_sum(blocks)
    mass = cumsum(sums)
    t = u * mass[-1]
    # The first block whose running mass exceeds t (the last block with mass if rounding
    # put t at the total); then the same rule inside it, against t minus the mass before.
    b = _first_above(mass, t, sums > 0)
    before = jnp.where(b > 0, mass[jnp.maximum(b - 1, 0)], 0.0)
    row = jax.lax.dynamic_index_in_dim(blocks, b, keepdims=False)
    j = _first_above(cumsum(row), t - before, row > 0)
    return (b * _BLOCK + j).astype(jnp.int32)


def _first_above(running: jax.Array, t: jax.Array, positive: jax.Array) -> jax.Array:
    """Index of the first entry with a positive increment whose running mass is above t;
    where none is (t rounded up to the total), the last entry with a positive increment.
    Entries with a zero increment are never chosen (exactly: not by way of rounding)."""
    n = running.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    idx = jnp.min(jnp.where((running > t) & positive, iota, n))
    last = jnp.max(jnp.where(positive, iota, -1))
    return jnp.where(idx >= n, last, idx)


def residual_draw(q: jax.Array, p: jax.Array, u: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """draw(residual(scale q, p), u) for rows q, p [V] (scale: a float, default 1, where
    scale q is q): on the native kernels for a long float32 row, in one kernel
    (`specsamp.quant.kernels.residual_sample`, the same bits) instead of the residual's
    passes over the row in XLA and then the draw."""
    if q.dtype == jnp.float32 and native_rows(q.shape[-1]):
        return kernels.residual_sample(q, p, u, jnp.ones_like(u) if scale is None else scale)
    return draw(residual(q if scale is None else _scaled(q, scale), p), u)


def residual_mass(q: jax.Array, p: jax.Array, scale: jax.Array) -> jax.Array:
    """The masses block verification weighs (`acceptance.block_rule`) after the first row:
    [..., m] = the sum of (scale[..., m] q[..., m + 1, :] - p[..., m + 1, :])+ for m < M,
    from q [..., Rq, V], p [..., Rp, V], scale [..., M] (Rq, Rp > M); fixed-order sums. On
    the native kernels for long float32 rows, in one pass a row read where it lies
    (`kernels.residual_mass`, the same bits)."""
    m = scale.shape[-1]
    if q.dtype == jnp.float32 and native_rows(q.shape[-1]) and m > 0:
        return kernels.residual_mass(q, p, scale)
    rows = slice(1, m + 1)
    return row_sum(jnp.maximum(_scaled(q[..., rows, :], scale) - p[..., rows, :], 0.0))[..., 0]


def _scaled(q: jax.Array, scale: jax.Array) -> jax.Array:
    """scale q as its own array: the product is rounded before anything subtracts from it
    (no fused multiply-add), as the native kernels compute it."""
    return jax.lax.optimization_barrier(jnp.asarray(scale, q.dtype)[..., None] * q)


def residual(q: jax.Array, p: jax.Array) -> jax.Array:
    """(q - p)+ normalised. Where it is all zero (q == p up to rounding: rejection then has
    probability ~0), fall back to q so the draw stays well defined."""
    diff = jnp.maximum(q - p, 0.0)
    total = row_sum(diff)
    return jnp.where(total > 0, diff / jnp.where(total > 0, total, 1.0), q)
