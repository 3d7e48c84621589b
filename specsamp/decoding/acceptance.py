"""The modified rejection rule of speculative sampling (Chen et al. 2023, Algorithm 2).

Notation of the paper: q = target distribution, p = draft distribution. Given K drafted
tokens x~_1..x~_K with the full distributions p_1..p_K they were drawn from, and the
target's q_1..q_{K+1} from one scoring call:
  - keep x~_k while r_k < min(1, q_k(x~_k) / p_k(x~_k)), r_k ~ U[0, 1);
  - at the first rejection k, emit a token from (q_k - p_k)+ normalised, and stop;
  - if all K are kept, emit a bonus token from q_{K+1}.
The emitted tokens follow q exactly (Theorem 1). A point-mass p (n-gram lookup, greedy
drafting) is the special case p = one_hot(x~): keep with probability q(x~), else draw from
q with x~ removed. Greedy decoding (q one-hot) keeps x~ iff it is the target's argmax.

Block verification (`accept_block`, the default for sampled chains: Sun et al. 2024,
"Block verification accelerates speculative decoding") decides on the K tokens together.
With P_0 = 1 and P_i = min(1, P_{i-1} q_i(x~_i) / p_i(x~_i)) (how far the block so far is
under-represented by the draft),
  - h_i = S_i / (S_i + 1 - P_i) for i < K, where S_i = sum_x (P_i q_{i+1}(x) - p_{i+1}(x))+
    is the residual mass one position further; h_K = P_K;
  - keep the first tau tokens, tau the largest i with eta_i < h_i (0 if none), eta_i ~ U[0, 1);
  - emit a token from (P_tau q_{tau+1} - p_{tau+1})+ normalised, or from q_{K+1} at tau = K.
Its output follows q exactly too (docs/paper.md, "Block verification"; an exact
enumeration in tests/test_block_verification.py), and for the same drafts it keeps at
least as many tokens in expectation as the per-token rule: a token the draft
over-proposes at one position can be paid for by one it under-proposes later, where the
per-token rule would have stopped at the first. At K = 1 the two rules are one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specsamp.decoding.sampling import residual_draw, residual_mass
from specsamp.errors import UserError


def _at_draft(draft, p, point):
    """The draft's probabilities of its own tokens [K]: 1 for a point-mass draft (p None:
    every row's; point: this row's, its p rows not read)."""
    if p is None:
        return jnp.ones(draft.shape, jnp.float32)
    at = jnp.take_along_axis(p, draft[:, None], axis=-1)[:, 0]
    return at if point is None else jnp.where(point, 1.0, at)


def _draft_row(draft, p, point, n, v: int):
    """Draft row n as the residual reads it: p[n], the point mass on draft[n] for a
    point-mass draft, zeros at n = K (there the "residual" is q_{K+1} itself, the bonus)."""
    k = draft.shape[0]
    at = jnp.minimum(n, k - 1)
    if p is None:
        row = jax.nn.one_hot(draft[at], v, dtype=jnp.float32)
    elif point is None:
        row = p[at]
    else:
        row = jnp.where(point, jax.nn.one_hot(draft[at], v, dtype=jnp.float32), p[at])
    return jnp.where(n < k, row, 0.0)


def accept(
    key: jax.Array,  # [2] one row's key
    draft: jax.Array,  # [K] int32
    p: jax.Array | None,  # [K, V] float32, the arrays the draft tokens were drawn from
    q: jax.Array,  # [K+1, V] float32
    point: jax.Array | None = None,  # bool: the draft is the point mass on its tokens
) -> tuple[jax.Array, jax.Array]:
    """One row: returns (n accepted in 0..K, the token emitted after them). A point-mass
    draft (prompt lookup) needs no p rows: p None (or `point`) stands for one_hot(draft),
    the same numbers without building them."""
    k = draft.shape[0]
    key_r, key_x = jax.random.split(key)
    q_draft = jnp.take_along_axis(q[:k], draft[:, None], axis=-1)[:, 0]
    p_draft = _at_draft(draft, p, point)
    r = jax.random.uniform(key_r, (k,), dtype=jnp.float32)
    # r < q/p written without the division; p(x~) > 0 since x~ was drawn from p.
    kept = r * p_draft < q_draft
    n = jnp.sum(jnp.cumprod(kept.astype(jnp.int32)))
    # The draw is sample()'s: one uniform from key_x.
    u = jax.random.uniform(key_x, (), jnp.float32)
    return n.astype(jnp.int32), residual_draw(q[n], _draft_row(draft, p, point, n, q.shape[-1]), u)


accept_batch = jax.vmap(accept)


def block_rule(draft, p, q, eta, point=None) -> tuple[jax.Array, jax.Array]:
    """Block verification's decision for one row with its uniforms eta [K] given: (tau, the
    draft tokens kept, 0..K; P_tau, the factor on q_{tau+1} in the residual, 1 at tau = 0
    and tau = K). draft [K], p [K, V] (or None), q [K+1, V], point as in `accept`."""
    k = draft.shape[0]
    q_draft = jnp.take_along_axis(q[:k], draft[:, None], axis=-1)[:, 0]
    p_draft = _at_draft(draft, p, point)
    # p(x~) > 0 for a drawn token; 0 only in rows whose draft is not read (a hybrid's rows
    # without a match): no division by 0 there either.
    ratio = jnp.where(p_draft > 0, q_draft / jnp.where(p_draft > 0, p_draft, 1.0), 0.0)
    under, level = [], jnp.float32(1.0)
    for i in range(k):
        level = jnp.minimum(level * ratio[i], 1.0)
        under.append(level)
    under = jnp.stack(under)  # [K]: P_1..P_K
    # S_i over the whole row, i = 1..K-1 (a fixed-order sum, as every sum of a row's
    # probabilities: the same bits in any batch; one pass on the native kernels). For a
    # point mass on x it is P_i (1 - q(x)) (P_i q(x) <= 1): no pass at all.
    mass = under[:k - 1] * (1.0 - q_draft[1:])
    if p is not None:
        full = residual_mass(q, p, under[:k - 1])
        mass = full if point is None else jnp.where(point, mass, full)
    den = mass + (1.0 - under[:k - 1])
    # den = 0: S = 0 and P = 1, h's limit 1. A row the draft could not score (NaN, a
    # broken draft) has h = 0: nothing kept on its account, as the per-token rule's
    # comparisons keep nothing there.
    h = jnp.where(den > 0, mass / jnp.where(den > 0, den, 1.0), jnp.where(den == 0, 1.0, 0.0))
    h = jnp.concatenate([h, under[k - 1:]])
    tau = jnp.max(jnp.where(eta < h, jnp.arange(1, k + 1), 0)).astype(jnp.int32)
    scale = jnp.where((tau > 0) & (tau < k), under[jnp.maximum(tau - 1, 0)], 1.0)
    return tau, scale


def accept_block(key, draft, p, q, point=None) -> tuple[jax.Array, jax.Array]:
    """One row by block verification (the module's note): (n accepted in 0..K, the token
    emitted after them). The key is split as `accept`'s: K uniforms for the decision, one
    for the draw (from the residual with P_n on q_{n+1}: at n = 0 the per-token rule's
    residual, at n = K the bonus row itself). p, point as in `accept`."""
    k = draft.shape[0]
    key_r, key_x = jax.random.split(key)
    n, scale = block_rule(draft, p, q, jax.random.uniform(key_r, (k,), dtype=jnp.float32), point)
    u = jax.random.uniform(key_x, (), jnp.float32)
    return n, residual_draw(q[n], _draft_row(draft, p, point, n, q.shape[-1]), u, scale)


accept_block_batch = jax.vmap(accept_block)

VERIFY_RULES = ("block", "token")  # `--verify`: how a sampled chain's K tokens are tested


def check_verify(rule: str) -> None:
    if rule not in VERIFY_RULES:
        raise UserError(f"verify must be one of {', '.join(VERIFY_RULES)}, got {rule!r}")


def accept_greedy(draft: jax.Array, argmax: jax.Array) -> jax.Array:
    """The rule at temperature 0, for a batch: draft [B, K], argmax [B, K+1] the target's
    argmax tokens a_k (first index on ties) -> n [B], draft tokens kept. q is a point mass
    on a_k, so x~_k is kept iff it is a_k, and the token emitted after n kept ones is
    a_n (the residual of a point mass at a_n and a draft elsewhere is that point mass; at
    n = K, the bonus). `accept_batch` on the one-hot q gives the same for any p; this skips
    building and drawing from [B, K+1, V] arrays."""
    k = draft.shape[1]
    return jnp.sum(jnp.cumprod((draft == argmax[:, :k]).astype(jnp.int32), axis=1), axis=1)
