"""Drafting a token tree with a draft model (`drafters.ModelDrafter.propose_tree`).

Axes: B batch, N tree nodes, K depth, W width, M block rows of one draft call, V vocab.

The tree's shape is static (`tree.Tree`, nodes numbered level by level: every node of
depth d before any of depth d + 1, as `Tree.full` and `Tree.chain` number them). A round
makes K draft calls:
  - depth 1: the window of K + 1 positions ending at the root (the row's current token),
    a plain call (a feature draft's `refresh`). It (re)writes every position accepted
    since the last round, whose entries the last round's tree block left at other slots,
    and gives the root's row;
  - depth d > 1: the root and every node of depth < d, one call with the tree's attention
    (`Model.forward(..., paths=)`), so each node reads the cache and its own path only
    (a feature draft: each node fed its parent's predicted feature, as a chain's step).
    The rows of the depth d - 1 nodes give their children.
The children of a node are, under greedy, the draft's top-w tokens (`Children.FIXED`: a
function of the context); under sampling, w draws without replacement from the node's
draft distribution in draw order (Gumbel top-w, `Children.DISTINCT`), so the acceptance
rule's DISTINCT case is exactly how they came. A child drawn past the end of p's support
(probability 0) and every node below an absent node is absent (token -1).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.sampling import probs_from_logits
from specsamp.decoding.state import DecodeState, gather_window, shifted_features
from specsamp.decoding.tree import Tree, block_paths, block_positions
from specsamp.decoding.tree_acceptance import Children
from specsamp.errors import UserError


class TreeProposal(NamedTuple):
    tokens: jax.Array  # [B, N] int32, -1 for an absent node
    p: jax.Array | None  # [B, N+1, V] float32 (`tree_acceptance`'s rows); None under greedy
    draft_state: Any  # the drafter's loop state after the round
    children: Children  # how the children were chosen (static)
    calls: int | jax.Array  # draft model calls of the round (or per row [B])
    # [B] bool or None: rows whose children were chosen without drawing (`Children.FIXED`,
    # a hybrid's lookup rows) while `children` says how the other rows' were; decided
    # by each row's own tokens before any draw. None: every row as `children` says.
    fixed_rows: jax.Array | None = None


def check_level_order(tree: Tree) -> Tree:
    """The tree, if its nodes are numbered level by level (what the draft's calls over a
    prefix of the block need); else a UserError."""
    if np.any(np.diff(tree.depth) < 0):
        raise UserError("a drafted tree must number its nodes level by level "
                        f"(depths {tree.depth.tolist()})")
    return tree


def children_mode(sampling: SamplingParams) -> Children:
    return Children.FIXED if sampling.greedy else Children.DISTINCT


def _choose(logits: jax.Array, sampling: SamplingParams, keys: jax.Array, width: int):
    """width children for each of M rows: logits [B, M, V] -> (tokens [B, M, W], probs
    [B, M, V] or None under greedy). Greedy: the top-W logits; else Gumbel top-W of the
    processed probabilities (W draws without replacement, in draw order), a token of
    probability 0 marked -1."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return _top(logits, width), None
    probs = probs_from_logits(logits, sampling)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, probs.shape[1:], jnp.float32))(keys)
    score = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)) + gumbel, -jnp.inf)
    tokens = _top(score, width)
    drawn = jnp.take_along_axis(probs, tokens, axis=2) > 0
    return jnp.where(drawn, tokens, -1), probs


def _top(x: jax.Array, width: int) -> jax.Array:
    """The indices of the `width` largest of x [..., V] in decreasing order, the first
    index first among equal values, `width` distinct indices (as lax.top_k; values of
    -inf included): one max-and-first-index pass per child over the values not taken yet.
    (Measured as a full sort of the row on a CPU, ~8.6 ms: XLA:CPU rewrites a lax.top_k
    whose result is sliced into a sort, `sampling.top_k`; a few passes need no such care
    for the small widths of a tree: docs/measurements.md, token trees.)"""
    v = x.shape[-1]
    ids = jnp.arange(v, dtype=jnp.int32)
    taken = jnp.zeros(x.shape, bool)
    out = []
    for _ in range(width):
        best = jnp.max(jnp.where(taken, -jnp.inf, x), axis=-1, keepdims=True)
        top = jnp.min(jnp.where((x == best) & ~taken, ids, v), axis=-1)
        out.append(jnp.minimum(top, v - 1))
        taken |= ids == top[..., None]
    return jnp.stack(out, axis=-1)


def draft_tree(steps, params, state: DecodeState, keys: jax.Array, tree: Tree,
               sampling: SamplingParams) -> TreeProposal:
    """The drafter's calls through `steps`, a drafter's two kinds of call on its own loop
    state (state.draft, `ds`):
      first(params, state) -> (logits [B, V] after the root, carry, ds): the depth-1 call;
      block(params, tokens [B, M], positions, ds, paths [M, P], carry, frontier) ->
        (logits [B, F, V] at the block rows `frontier` (numpy), carry, ds).
    keys [B]: the rows' draft keys of this round."""
    depth_of = np.concatenate([[0], tree.depth])  # per block row
    parents = np.asarray(tree.parents) + 1  # each node's parent block row
    rank = np.array([list(tree.children[parents[i]]).index(i) for i in range(tree.size)])
    width = tree.children.shape[1]
    t = state.current
    root = gather_window(state.tokens, t, 1)
    tokens = jnp.full((t.shape[0], tree.size), -1, jnp.int32)
    p = None
    logits, carry, ds = steps.first(params, state)
    rows = logits[:, None]
    for d in range(1, tree.max_depth + 1):
        frontier = np.flatnonzero(depth_of == d - 1)  # block rows whose children are drawn now
        if d > 1:
            m = int(np.sum(depth_of < d))
            block = jnp.concatenate([root, jnp.maximum(tokens[:, : m - 1], 0)], axis=1)
            rows, carry, ds = steps.block(params, block, block_positions(tree, t)[:, :m], ds,
                                          block_paths(tree)[:m], carry, frontier)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, d)
        chosen, probs = _choose(rows, sampling, step_keys, width)  # [B, F, W]
        if probs is not None:  # leaves' rows stay 0 (never read)
            if p is None:
                p = jnp.zeros((t.shape[0], tree.size + 1, probs.shape[2]), jnp.float32)
            p = p.at[:, frontier].set(probs)
        for i in np.flatnonzero(tree.depth == d):
            x = chosen[:, int(np.flatnonzero(frontier == parents[i])[0]), rank[i]]
            if parents[i] > 0:  # below an absent node: absent
                x = jnp.where(tokens[:, parents[i] - 1] >= 0, x, -1)
            tokens = tokens.at[:, i].set(x)
    return TreeProposal(tokens, p, ds, children_mode(sampling), tree.max_depth)


class ModelSteps(NamedTuple):
    """`draft_tree`'s calls for a draft model (or early exit): forward(params, tokens,
    positions, cache, paths=None) -> (logits [B, T, V], cache) on its KV cache."""

    forward: Any
    k: int

    def first(self, params, state: DecodeState):
        """The window of K + 1 positions ending at the root: it (re)writes every position
        accepted since the last round, whose entries the last tree block left elsewhere."""
        t, k = state.current, self.k
        start = jnp.maximum(t - k, 0)
        window = gather_window(state.tokens, start, k + 1)
        logits, cache = self.forward(params, window, start[:, None] + jnp.arange(k + 1)[None], state.draft)
        return jnp.take_along_axis(logits, (t - start)[:, None, None], axis=1)[:, 0], None, cache

    def block(self, params, tokens, positions, cache, paths, carry, frontier):
        logits, cache = self.forward(params, tokens, positions, cache, paths=paths)
        return logits[:, frontier], carry, cache


class FeatureSteps(NamedTuple):
    """`draft_tree`'s calls for a feature draft (`drafters.FeatureDrafter`): the carry is
    (the target's feature before the root [B, 1, D], the draft's predicted feature at
    every block row so far [B, N+1, D])."""

    drafter: Any
    tree: Tree

    def first(self, params, state: DecodeState):
        g, fs = self.drafter.refresh(params, state)  # [B, 1, D] at the root
        b, _, d = g.shape
        gs = jnp.zeros((b, self.tree.size + 1, d), g.dtype).at[:, 0].set(g[:, 0])
        root_feature = shifted_features(fs.features, state.current, 1)
        return self._model.logits(params, g)[:, 0], (root_feature, gs), fs

    def block(self, params, tokens, positions, fs, paths, carry, frontier):
        root_feature, gs = carry
        parents = np.asarray(self.tree.parents)[: tokens.shape[1] - 1] + 1
        features = jnp.concatenate([root_feature, gs[:, parents]], axis=1)
        g, cache = self._model.forward(params, tokens, features, positions, fs.cache,
                                       self.drafter._attention(fs.cache), paths=paths)
        gs = gs.at[:, frontier].set(g[:, frontier])
        return self._model.logits(params, g[:, frontier]), (root_feature, gs), fs.replace(cache=cache)

    @property
    def _model(self):
        from specsamp.models.feature_draft import FeatureModel

        return FeatureModel(self.drafter.cfg)
