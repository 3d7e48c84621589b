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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specsamp.decoding.sampling import residual_draw


def accept(
    key: jax.Array,  # [2] one row's key
    draft: jax.Array,  # [K] int32
    p: jax.Array,  # [K, V] float32, the arrays the draft tokens were drawn from
    q: jax.Array,  # [K+1, V] float32
) -> tuple[jax.Array, jax.Array]:
    """One row: returns (n accepted in 0..K, the token emitted after them)."""
    k = draft.shape[0]
    key_r, key_x = jax.random.split(key)
    q_draft = jnp.take_along_axis(q[:k], draft[:, None], axis=-1)[:, 0]
    p_draft = jnp.take_along_axis(p, draft[:, None], axis=-1)[:, 0]
    r = jax.random.uniform(key_r, (k,), dtype=jnp.float32)
    # r < q/p written without the division; p(x~) > 0 since x~ was drawn from p.
    kept = r * p_draft < q_draft
    n = jnp.sum(jnp.cumprod(kept.astype(jnp.int32)))
    # Row n of p, zeros at n == K: there the "residual" is q_{K+1} itself (the bonus). The
    # draw is sample()'s: one uniform from key_x.
    p_n = jnp.where(n < k, p[jnp.minimum(n, k - 1)], 0.0)
    u = jax.random.uniform(key_x, (), jnp.float32)
    return n.astype(jnp.int32), residual_draw(q[n], p_n, u)


accept_batch = jax.vmap(accept)


def accept_greedy(draft: jax.Array, argmax: jax.Array) -> jax.Array:
    """The rule at temperature 0, for a batch: draft [B, K], argmax [B, K+1] the target's
    argmax tokens a_k (first index on ties) -> n [B], draft tokens kept. q is a point mass
    on a_k, so x~_k is kept iff it is a_k, and the token emitted after n kept ones is
    a_n (the residual of a point mass at a_n and a draft elsewhere is that point mass; at
    n = K, the bonus). `accept_batch` on the one-hot q gives the same for any p; this skips
    building and drawing from [B, K+1, V] arrays."""
    k = draft.shape[1]
    return jnp.sum(jnp.cumprod((draft == argmax[:, :k]).astype(jnp.int32), axis=1), axis=1)
