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
    The rows of the depth d - 1 nodes that have children give their children (a leaf
    needs no head). A feature draft on a tree whose only inner nodes are the spine's
    (`spine_only`: 1-2-11, a dynamic tree's candidates) feeds just the spine's node of
    depth d - 1 at its position, as a chain's step, and leaves its cache as a chain's
    (`TreeProposal.chain_layout`): drafting such a tree costs what the chain's does.
The children of a node are, under greedy, the draft's top-w tokens (`Children.FIXED`: a
function of the context); under sampling, w draws without replacement from the node's
draft distribution in draw order (`Children.DISTINCT`), so the acceptance
rule's DISTINCT case is exactly how they came (a `DynamicTree`'s candidates as well). A
child drawn past the end of p's support (probability 0) and every node below an absent
node is absent (token -1). A reduced draft head's rows stay reduced under greedy
(`Reduced`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.sampling import draw, probs_from_logits
from specsamp.decoding.state import DecodeState, gather_window, shifted_features
from specsamp.decoding.tree import Tree, block_paths, block_positions, path_log_probs
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
    # [B, N] float32 or None: each node's score for a `DynamicTree`'s choice of nodes
    # (`tree.select_nodes`; `draft_tree` says what it is); -inf for an absent node.
    scores: jax.Array | None = None
    # Where the drafter's cache holds the drafted nodes: False, the tree block's slots
    # (moved to the accepted path's positions after the round, `tree_round`); True, the
    # spine's nodes at their positions, as a chain's (`spine_only`): nothing to move.
    chain_layout: bool = False


def spine_only(tree: Tree) -> bool:
    """Whether the tree's only inner nodes are its spine's (a chain with leaves beside it,
    as 1-2-11 or a `DynamicTree`'s candidates): then the draft needs its model only
    along the spine, one token a call as a chain's steps (`FeatureSteps.block`)."""
    inner = np.flatnonzero(tree.children[1:, 0] >= 0)
    return bool(np.all(np.isin(inner, tree.spine)))


def check_level_order(tree: Tree) -> Tree:
    """The tree, if its nodes are numbered level by level (what the draft's calls over a
    prefix of the block need); else a UserError."""
    if np.any(np.diff(tree.depth) < 0):
        raise UserError("a drafted tree must number its nodes level by level "
                        f"(depths {tree.depth.tolist()})")
    return tree


def children_mode(sampling: SamplingParams) -> Children:
    return Children.FIXED if sampling.greedy else Children.DISTINCT


def _choose(rows, sampling: SamplingParams, keys: jax.Array, width: int, scored: bool = False):
    """width children for each of M rows: rows [B, M, V] logits (or `Reduced`) -> (tokens
    [B, M, W], probs [B, M, V] or None, logp [B, M, W] or None). Greedy: the top-W logits;
    else W draws without replacement from the processed probabilities, in draw order
    (`_draw_distinct`), a draw past the support marked -1. probs: the processed rows, where drawn
    (acceptance reads them). scored: logp, each chosen token's log-probability (the
    processed distribution's; under greedy the draft's softmax). A reduced head's rows stay
    reduced under greedy: the same tokens as over the whole vocabulary, at a sixth of the
    work for the shipped draft (a full row's scatter and passes cost a tree ~0.3 ms a round);
    sampled, its rows are processed and drawn from as they are, and only the processed
    probabilities are scattered into the vocabulary (`Reduced.scatter`), for the rule: the
    same law, every other token at probability 0 either way."""
    if isinstance(rows, Reduced):  # drawn among its own tokens, scattered for the rule
        at, probs, logp = _choose(rows.unique(), sampling, keys, width, scored)
        tokens = jnp.where(at >= 0, rows.ids[jnp.maximum(at, 0)], -1)
        return tokens, None if probs is None else rows.scatter(probs), logp
    logits = rows.astype(jnp.float32)
    if sampling.greedy:
        tokens = _top(logits, width)
        logp = (jnp.take_along_axis(logits, tokens, axis=2)
                - jax.nn.logsumexp(logits, axis=2, keepdims=True)) if scored else None
        return tokens, None, logp
    probs = probs_from_logits(logits, sampling)
    tokens, logp = _draw_distinct(probs, keys, width, scored)
    return tokens, probs, logp


def _draw_distinct(probs: jax.Array, keys: jax.Array, width: int, scored: bool):
    """width draws without replacement from each row of probs [B, M, V], in draw order:
    each by inverse CDF (`sampling.draw`: one uniform, the native one-pass kernel on long
    rows) from the row with the earlier draws' tokens set to 0, so the j-th draw has the
    law the DISTINCT rule tests it against. A draw past the row's support (mass left 0) is
    -1. Returns (tokens [B, M, W], logp [B, M, W] of the drawn tokens, or None). (Gumbel
    top-w draws the same law with V random numbers a row: ~1 ms a sampled tree round on
    a CPU, against W uniforms.)"""
    b, m, v = probs.shape
    u = jax.vmap(lambda k: jax.random.uniform(k, (m, width), jnp.float32))(keys)
    ids = jnp.arange(v, dtype=jnp.int32)
    left, tokens, logp = probs, [], []
    for j in range(width):
        x = jnp.clip(jax.vmap(jax.vmap(draw))(left, u[..., j]), 0, v - 1)  # [B, M]
        mass = jnp.take_along_axis(left, x[..., None], axis=2)[..., 0]
        tokens.append(jnp.where(mass > 0, x, -1))
        logp.append(jnp.log(mass))
        if j + 1 < width:
            left = jnp.where(ids == tokens[-1][..., None], 0.0, left)
    return jnp.stack(tokens, axis=2), (jnp.stack(logp, axis=2) if scored else None)


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
               sampling: SamplingParams, scored: bool = False) -> TreeProposal:
    """The drafter's calls through `steps`, a drafter's two kinds of call on its own loop
    state (state.draft, `ds`):
      first(params, state) -> (logits [B, V] after the root, carry, ds): the depth-1 call;
      block(params, tokens [B, M], positions, ds, paths [M, P], carry, frontier) ->
        (logits [B, F, V] at the block rows `frontier` (numpy), carry, ds).
    keys [B]: the rows' draft keys of this round. scored: the candidates of a
    `DynamicTree`, and the proposal carries each node's score for the choice of a row's
    nodes (`tree.select_nodes`), the larger the likelier the node is kept:
      - greedy (children the top choices, a function of the context): the node's path
        log-probability under the draft's softmax, its own token's included (EAGLE-2's);
      - sampling (children drawn without replacement): never the node's own token, which
        would make whether a drawn child is present depend on what was drawn, and its law
        given that it is present no longer the draft's. A node's score is its parent's path
        log-probability (the drawn ancestors' processed probabilities) plus the log of
        the draft's rank-th largest probability there (what a rank-th draw is worth before
        it is drawn), capped by its parent's score (so a chosen node's parent is chosen,
        and the children chosen at a node are its first draws)."""
    depth_of = np.concatenate([[0], tree.depth])  # per block row
    parents = np.asarray(tree.parents) + 1  # each node's parent block row
    rank = np.array([list(tree.children[parents[i]]).index(i) for i in range(tree.size)])
    width = tree.children.shape[1]
    t = state.current
    root = gather_window(state.tokens, t, 1)
    tokens = jnp.full((t.shape[0], tree.size), -1, jnp.int32)
    p = None
    logp = jnp.full((t.shape[0], tree.size), -jnp.inf, jnp.float32) if scored else None
    drawn = scored and not sampling.greedy
    slot_logp = jnp.full((t.shape[0], tree.size), -jnp.inf, jnp.float32) if drawn else None
    logits, carry, ds = steps.first(params, state)
    rows = logits._replace(logits=logits.logits[:, None]) if isinstance(logits, Reduced) else logits[:, None]
    for d in range(1, tree.max_depth + 1):
        # the block rows whose children are drawn now (a leaf's row is not read: no head)
        frontier = np.flatnonzero((depth_of == d - 1) & (tree.children[:, 0] >= 0))
        if d > 1:
            m = int(np.sum(depth_of < d))
            block = jnp.concatenate([root, jnp.maximum(tokens[:, : m - 1], 0)], axis=1)
            rows, carry, ds = steps.block(params, block, block_positions(tree, t)[:, :m], ds,
                                          block_paths(tree)[:m], carry, frontier)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, d)
        chosen, probs, chosen_logp = _choose(rows, sampling, step_keys, width, scored=scored)  # [B, F, W]
        if drawn:  # what the rank-th draw is worth before it is drawn
            ranked = jnp.log(jnp.take_along_axis(probs, _top(probs, width), axis=2))
        if probs is not None:  # leaves' rows stay 0 (never read)
            if p is None:
                p = jnp.zeros((t.shape[0], tree.size + 1, probs.shape[2]), jnp.float32)
            p = p.at[:, frontier].set(probs)
        for i in np.flatnonzero(tree.depth == d):
            at = int(np.flatnonzero(frontier == parents[i])[0]), rank[i]  # its parent's row, its rank
            x = chosen[:, at[0], at[1]]
            if parents[i] > 0:  # below an absent node: absent
                x = jnp.where(tokens[:, parents[i] - 1] >= 0, x, -1)
            tokens = tokens.at[:, i].set(x)
            if scored:
                logp = logp.at[:, i].set(jnp.where(x >= 0, chosen_logp[:, at[0], at[1]], -jnp.inf))
                if drawn:
                    slot_logp = slot_logp.at[:, i].set(jnp.where(x >= 0, ranked[:, at[0], at[1]], -jnp.inf))
    layout = getattr(steps, "chain_layout", False)
    scores = None
    if scored:
        scores = path_log_probs(tree, logp) if not drawn else _drawn_scores(tree, logp, slot_logp)
    return TreeProposal(tokens, p, ds, children_mode(sampling), tree.max_depth, scores=scores,
                        chain_layout=layout)


def _drawn_scores(tree: Tree, logp: jax.Array, slot_logp: jax.Array) -> jax.Array:
    """A sampled dynamic tree's node scores (`draft_tree`): logp [B, N] each drawn node's
    own log-probability, slot_logp [B, N] the log of its rank's probability at its parent.
    A node's score: its strict ancestors' logp summed, plus its slot_logp, capped by its
    parent's score; its own logp enters only its descendants' scores."""
    strict = tree.ancestors & ~np.eye(tree.size, dtype=bool)
    raw = jnp.maximum(logp, -1e30) @ jnp.asarray(strict.T, logp.dtype) + slot_logp
    cols = []
    for i, parent in enumerate(tree.parents):
        cols.append(raw[:, i] if parent < 0 else jnp.minimum(raw[:, i], cols[parent]))
    return jnp.stack(cols, axis=1)


class Reduced(NamedTuple):
    """A reduced head's rows: logits [..., n] over the token ids [n] (sorted; a decoding
    head repeats its last id as padding, `feature_draft.reduced_head`) of a vocabulary of
    `vocab`; every other token has logit -1e30, probability 0 (`feature_draft.draft_logits`)."""

    logits: jax.Array
    ids: jax.Array
    vocab: int

    def full(self) -> jax.Array:
        """The logits over the whole vocabulary, as `draft_logits` scatters them."""
        from specsamp.models.feature_draft import scatter_reduced

        return scatter_reduced(self.logits, self.ids, self.vocab)

    def unique(self) -> jax.Array:
        """The logits with a repeated id's copies at -1e30: each token once, as in `full`."""
        repeat = jnp.concatenate([jnp.zeros((1,), bool), self.ids[1:] == self.ids[:-1]])
        return jnp.where(repeat, -1e30, self.logits.astype(jnp.float32))

    def scatter(self, probs: jax.Array) -> jax.Array:
        """Probabilities [..., n] of `unique()`'s logits (a repeated id's copies at 0) as rows
        [..., vocab]: each token's once (adding the copies' zeros changes no bit), 0 at
        every other token."""
        full = jnp.zeros(probs.shape[:-1] + (self.vocab,), jnp.float32)
        return full.at[..., self.ids].add(probs)


def feature_head(cfg, params, g):
    """A feature draft's rows at features g [..., D]: its logits, or with a reduced head the
    reduced logits and their token ids (`Reduced`: no full-vocabulary scatter)."""
    from specsamp.models.feature_draft import FeatureModel, head_product

    if "head_ids" not in params:
        return FeatureModel(cfg).logits(params, g)
    return Reduced(head_product(g, params["head"]["kernel"]), params["head_ids"], cfg.vocab_size)


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
        return self._head(params, g[:, 0]), (root_feature, gs), fs

    @property
    def chain_layout(self) -> bool:
        """A spine-only tree (`spine_only`): each call after the first feeds the one
        inner node of its depth, the spine's, at its position, as a chain's step does
        (no tree attention, no rows for nodes already fed or for leaves)."""
        return spine_only(self.tree)

    def block(self, params, tokens, positions, fs, paths, carry, frontier):
        root_feature, gs = carry
        if self.chain_layout:
            r = int(frontier[0])  # the spine's node of this depth, as a block row
            parent = int(self.tree.parents[r - 1]) + 1
            g, cache = self._model.forward(params, tokens[:, r: r + 1], gs[:, parent: parent + 1],
                                           positions[:, r: r + 1], fs.cache,
                                           self.drafter._attention(fs.cache))
            gs = gs.at[:, r].set(g[:, 0])
            return self._head(params, g), (root_feature, gs), fs.replace(cache=cache)
        parents = np.asarray(self.tree.parents)[: tokens.shape[1] - 1] + 1
        features = jnp.concatenate([root_feature, gs[:, parents]], axis=1)
        g, cache = self._model.forward(params, tokens, features, positions, fs.cache,
                                       self.drafter._attention(fs.cache), paths=paths)
        gs = gs.at[:, frontier].set(g[:, frontier])
        return self._head(params, g[:, frontier]), (root_feature, gs), fs.replace(cache=cache)

    def _head(self, params, g):
        return feature_head(self.drafter.cfg, params, g)

    @property
    def _model(self):
        from specsamp.models.feature_draft import FeatureModel

        return FeatureModel(self.drafter.cfg)
