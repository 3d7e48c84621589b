"""Exact acceptance over a token tree: the longest path the target keeps, and the next token.

Axes: B batch, N tree nodes, K depth, W width, V vocab. Rows as in `tree`: row 0 of p and
q for the root (the last accepted token), row i + 1 for node i. A node's q row is the
target's distribution after it, its p row the drafter's distribution its children came
from (a leaf's p row is not read; for `Children.FIXED` p is not read at all). The arrays
are the processed ones of `sampling.probs_from_logits`, unchanged since the draw.

The walk starts at the root. At a node u it tries the children in order, each against the
current target distribution q' (u's q row at first) and the child's draft distribution d
(the law of the child's token given the children tried before it):
  - keep child c (token x) if r_c d(x) < q'(x), r_c ~ U[0, 1), one uniform per node: that
    is, with probability min(1, q'(x) / d(x)); the walk moves to c;
  - else q' <- (q' - d)+ normalised (`sampling.residual`), and the next child is tried.
When no child is kept (or u is a leaf), the next token is drawn from the last q' and the
round ends. Each test is the chain's rule with q' in place of q, so the token emitted at u
follows u's q row exactly, whatever the draws (docs/paper.md, "Token trees"). d by how the
children were chosen (the drafter's contract: it must say how they really were chosen):
  - IID: each child drawn from u's p row independently (with replacement; SpecInfer's
    multi-step scheme): d = that row for every child;
  - DISTINCT: drawn one after another without replacement (or Gumbel top-k of log p):
    d = u's p row with the earlier children's tokens set to 0, renormalised;
  - FIXED: not drawn at all, a function of the context (the draft's top-k tokens taken
    deterministically, prompt-lookup matches): d = the point mass on x, so x is kept with
    probability q'(x) and q' loses x. Treating deterministic top-k tokens as DISTINCT
    draws is not exact (a control in tests/test_tree_acceptance.py shows it).
A node with token -1 is absent: never tested, no update (a row with fewer candidates than
the shape). So is a child whose d(x) is 0 (it cannot have been drawn: a sampled child past
the end of p's support). Presence may depend on the context, not on the target.

On a chain, every mode but FIXED is `acceptance.accept` bit for bit with the same key (the
same uniforms, comparisons and residuals); FIXED is `accept` with p one-hot on the draft.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specsamp.decoding.sampling import residual, sample
from specsamp.decoding.tree import RowTree, Tree, path_of


class Children(enum.Enum):
    """How the drafter chose each node's children (see the module docstring)."""

    IID = "iid"
    DISTINCT = "distinct"
    FIXED = "fixed"


class TreeAcceptance(NamedTuple):
    """One row's result: path [K] int32, the accepted nodes by depth padded with -1; n, how
    many were accepted (0..K); token, the token emitted after them. The round emits the
    accepted nodes' tokens, then `token`."""

    path: jax.Array
    n: jax.Array
    token: jax.Array


def _try_children(kids, tokens, p_u, q_u, r, children: Children, fixed=None):
    """The tests at one node: kids [W] node indices (-1: none), q_u, p_u [V]; fixed (a
    bool, or None for False): this row's children were chosen without drawing, whatever
    `children` says (`Children.FIXED`'s d). Returns
    (kept child or -1, q', d) where the next token, if no child is kept, is drawn from
    residual(q', d): q' is the target before the last rejected child and d that child's
    draft distribution (zeros when none was rejected, so residual(q', d) is q_u itself,
    as the chain's zero row makes its bonus)."""
    v = q_u.shape[0]

    def step(carry, kid):
        q_cur, d_last, rejected, p_left, kept = carry
        x = jnp.where(kid >= 0, tokens[jnp.maximum(kid, 0)], -1)
        x_safe = jnp.maximum(x, 0)
        q_now = jnp.where(rejected, residual(q_cur, d_last), q_cur)  # the update, applied lazily
        if children is Children.IID:
            d = p_u
        elif children is Children.DISTINCT:
            d = jnp.where(rejected, p_left / jnp.maximum(jnp.sum(p_left), 1e-30), p_u)
        else:
            d = jax.nn.one_hot(x_safe, v, dtype=q_u.dtype)
        if fixed is not None and children is not Children.FIXED:
            d = jnp.where(fixed, jax.nn.one_hot(x_safe, v, dtype=q_u.dtype), d)
        d_x = d[x_safe]
        present = (kid >= 0) & (x >= 0) & (kept < 0) & (d_x > 0)
        # r < q'/d written without the division (as the chain's rule).
        accepted = present & (r[jnp.maximum(kid, 0)] * d_x < q_now[x_safe])
        refused = present & ~accepted
        carry = (jnp.where(refused, q_now, q_cur), jnp.where(refused, d, d_last), rejected | refused,
                 jnp.where(refused, p_left.at[x_safe].set(0.0), p_left), jnp.where(accepted, kid, kept))
        return carry, None

    init = (q_u, jnp.zeros_like(q_u), jnp.asarray(False), p_u, jnp.asarray(-1, jnp.int32))
    (q_cur, d_last, _, _, kept), _ = jax.lax.scan(step, init, kids)
    return kept, q_cur, d_last


def walk(
    tokens: jax.Array,  # [N] int32, -1 for an absent node
    p: jax.Array,  # [N+1, V] float32
    q: jax.Array,  # [N+1, V] float32
    r: jax.Array,  # [N] float32 uniforms in [0, 1), node i's test uses r[i]
    *,
    tree: Tree,
    children: Children,
    fixed: jax.Array | None = None,  # bool: this row's children were chosen without drawing
) -> tuple[jax.Array, jax.Array]:
    """The rule with its uniforms given: returns (the last accepted node, -1 for none; the
    distribution [V] the next token is drawn from). `accept_tree` is this plus the draws;
    tests drive it with chosen uniforms."""
    table = jnp.asarray(tree.children)

    def level(carry, _):
        u, live, q_end, d_end = carry
        kept, q_cur, d_last = _try_children(table[u + 1], tokens, p[u + 1], q[u + 1], r, children,
                                            fixed)
        went_down = live & (kept >= 0)
        stopped = live & (kept < 0)
        # On a step down the end state is provisional: the child's own row, nothing rejected
        # (what the next level leaves it at, or the bonus if the child is a depth-K leaf).
        q_end = jnp.where(went_down, q[kept + 1], jnp.where(stopped, q_cur, q_end))
        d_end = jnp.where(went_down, jnp.zeros_like(d_end), jnp.where(stopped, d_last, d_end))
        return (jnp.where(went_down, kept, u), live & ~stopped, q_end, d_end), None

    init = (jnp.asarray(-1, jnp.int32), jnp.asarray(True), q[0], jnp.zeros_like(q[0]))
    (u, _, q_end, d_end), _ = jax.lax.scan(level, init, None, length=tree.max_depth)
    return u, residual(q_end, d_end)


def _result(tree: Tree, node: jax.Array, token: jax.Array) -> TreeAcceptance:
    n = jnp.where(node >= 0, jnp.asarray(tree.depth)[jnp.maximum(node, 0)], 0)
    return TreeAcceptance(path_of(tree, node), n.astype(jnp.int32), token.astype(jnp.int32))


def accept_tree(
    key: jax.Array,  # [2] one row's key
    tokens: jax.Array,  # [N] int32
    p: jax.Array,  # [N+1, V] float32
    q: jax.Array,  # [N+1, V] float32
    *,
    tree: Tree,
    children: Children,
    fixed: jax.Array | None = None,
) -> TreeAcceptance:
    """One row, sampling at temperature > 0 (any top-k / top-p: they are in p and q). The
    key is split as the chain's: uniforms for the tests (one per node), then the token.
    fixed (`walk`): the row's children were chosen without drawing, whatever `children`
    says (a hybrid's lookup rows)."""
    key_r, key_x = jax.random.split(key)
    r = jax.random.uniform(key_r, (tree.size,), dtype=jnp.float32)
    node, dist = walk(tokens, p, q, r, tree=tree, children=children, fixed=fixed)
    return _result(tree, node, sample(key_x, dist))


def _per_row(f, tree, *rows):
    """f(tree, *one row's arrays) over a batch: a static tree is shared, a RowTree (`tree.
    select_nodes`, batched) is each row's own."""
    if isinstance(tree, RowTree):
        return jax.vmap(f)(tree, *rows)
    return jax.vmap(lambda *a: f(tree, *a))(*rows)


def accept_tree_batch(keys, tokens, p, q, *, tree: Tree | RowTree, children: Children,
                      fixed: jax.Array | None = None) -> TreeAcceptance:
    """`accept_tree` over a batch: keys [B, 2], tokens [B, N], p, q [B, N+1, V], fixed
    [B] bool or None. A row's result depends only on its own key and arrays (and its own
    tree, for a RowTree)."""
    if fixed is None:
        one = lambda tr, k, t, pp, qq: accept_tree(k, t, pp, qq, tree=tr, children=children)  # noqa: E731
        return _per_row(one, tree, keys, tokens, p, q)
    one = lambda tr, k, t, pp, qq, f: accept_tree(k, t, pp, qq, tree=tr, children=children, fixed=f)  # noqa: E731
    return _per_row(one, tree, keys, tokens, p, q, fixed)


def accept_tree_greedy(tokens: jax.Array, argmax: jax.Array, *, tree: Tree) -> TreeAcceptance:
    """Temperature 0, one row: tokens [N] (-1 absent), argmax [N+1] the target's argmax
    after the root and after each node (first index on ties). The accepted path is the
    deepest node whose path's every token is the argmax after its parent (the first such
    node in number order on a tie: the tokens are the same); the token after it is its
    argmax. The output is plain greedy decoding token for token. On one-hot q with
    distinct siblings this is `walk`'s path (at most one child can match)."""
    parent_rows = jnp.asarray(tree.parents) + 1
    match = (tokens >= 0) & (tokens == argmax[parent_rows])  # [N]
    on_path = jnp.all(match[None, :] | ~jnp.asarray(tree.ancestors), axis=1)  # [N]
    score = jnp.where(on_path, jnp.asarray(tree.depth), 0)
    best = jnp.argmax(score).astype(jnp.int32)
    node = jnp.where(score[best] > 0, best, -1)
    return _result(tree, node, argmax[node + 1])


def accept_tree_greedy_batch(tokens: jax.Array, argmax: jax.Array, *, tree: Tree) -> TreeAcceptance:
    """`accept_tree_greedy` over a batch: tokens [B, N], argmax [B, N+1]."""
    return _per_row(lambda tr, t, a: accept_tree_greedy(t, a, tree=tr), tree, tokens, argmax)


def spine_kept(path: jax.Array, *, tree: Tree | RowTree) -> jax.Array:
    """Sampling: the draft tokens [B] the tree's spine (`Tree.spine`) kept, from the
    accepted paths [B, K]: the depths down to which the path is the spine. At every node
    the first child is tested first, by the chain's rule with the same uniform, so this is
    what a chain of the spine's drafts would have kept in the same round."""
    spine = jnp.asarray(tree.spine)  # [J], or a RowTree's [B, K] (-1 past its leaf)
    j = spine.shape[-1]
    on = ((path[:, :j] == spine) & (spine >= 0)).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(on, axis=1), axis=1).astype(jnp.int32)


def spine_kept_greedy(tokens: jax.Array, argmax: jax.Array, *, tree: Tree | RowTree) -> jax.Array:
    """Temperature 0: the draft tokens [B] the tree's spine kept, its leading nodes whose
    token is the target's argmax after their parent (tokens [B, N], argmax [B, N+1]). Not
    read off the accepted path: where a later sibling holds the same token as the spine's
    node, the deepest path may leave the spine above where it stops matching."""
    def one(tr, tok, arg):
        spine = jnp.asarray(tr.spine)
        at = jnp.maximum(spine, 0)
        parent_rows = jnp.asarray(tr.parents)[at] + 1
        return jnp.sum(jnp.cumprod(((spine >= 0) & (tok[at] >= 0) & (tok[at] == arg[parent_rows]))
                                   .astype(jnp.int32))).astype(jnp.int32)

    return _per_row(one, tree, tokens, argmax)
