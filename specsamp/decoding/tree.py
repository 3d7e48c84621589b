"""A static token tree: the shape of one round's draft, shared by every row of a batch.

Axes: B batch, N tree nodes, K depth (the most tokens a round can accept), W width (the
most children of one node), S cache slots.

A tree is its parents: `parents[i]` is the node whose token node i follows, or -1 for a
child of the root (the root is the last accepted token: it is not a node and holds no
draft). Nodes are numbered so that a parent comes before its children (parents[i] < i),
and the children of a node are tried in the order of their numbers: for drafts sampled one
after another, number the children in the order they were drawn. A chain of K drafts is
the tree with one child per node (`Tree.chain(K)`), so one code path serves both.

Per-node arrays of the target and the drafter have N + 1 rows, row 0 for the root and row
i + 1 for node i: the row of a node holds the distribution of the token after it, which is
the distribution its children are tested against (target) or were drawn from (draft).
For a chain this is the chain's own layout (q_1..q_{K+1}); the draft's p_1..p_K gain one
unused row at the end (the leaf's).

The shape is static (a compiled program serves one shape: the tables below are numpy, so
they are constants under jit); the tokens at the nodes vary per row. A row that has fewer
candidates than the shape marks the missing nodes with token -1 (see `tree_acceptance`).

The scoring call feeds a block of N + 1 tokens, the root then the nodes in order, written
at cache slots start..start+N (start: the root's position) at positions start + depth
(`block_positions`); each attends to the cache before the block and to its ancestors and
itself within it, never to another branch (`block_visibility`). After acceptance the
accepted path's entries (`path_slots`) belong at slots start + 1 + d; for a chain they
are there already.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tree:
    """parents: (N,) ints, -1 for a child of the root, else an earlier node's index.
    Hashable, so it can be a static argument of a compiled function."""

    parents: tuple[int, ...]

    def __post_init__(self):
        parents = tuple(int(x) for x in self.parents)
        object.__setattr__(self, "parents", parents)
        if not parents:
            raise ValueError("a tree needs at least one node")
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} is not -1 or an earlier node")

    @classmethod
    def chain(cls, k: int) -> "Tree":
        """K drafts one after another: node i is the child of node i - 1."""
        return cls(tuple(range(-1, k - 1)))

    @classmethod
    def full(cls, widths: tuple[int, ...]) -> "Tree":
        """Every node at depth d has widths[d] children (the root is depth 0), numbered
        level by level: Tree.full((3, 2)) is 3 children of the root with 2 children each."""
        parents, level = [], [-1]
        for width in widths:
            nxt = []
            for parent in level:
                for _ in range(width):
                    nxt.append(len(parents))
                    parents.append(parent)
            level = nxt
        return cls(tuple(parents))

    @classmethod
    def from_paths(cls, paths) -> "Tree":
        """A tree from its nodes, each the 1-based ranks of the choices on its path from
        the root: ((1,), (2,), (1, 1)) is the root's first two choices and the first
        choice after the first. Every node's parent and earlier siblings must be there;
        nodes are numbered level by level, siblings by rank."""
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not paths or any(not p or min(p) < 1 for p in paths):
            raise ValueError(f"tree paths must be non-empty ranks >= 1, got {paths}")
        index = {p: i for i, p in enumerate(paths)}
        for p in paths:
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"node {p}: its parent {p[:-1]} is not in the tree")
            if p[-1] > 1 and p[:-1] + (p[-1] - 1,) not in index:
                raise ValueError(f"node {p}: its sibling {p[:-1] + (p[-1] - 1,)} is not in the tree")
        return cls(tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths))

    @functools.cached_property
    def rank_paths(self) -> tuple[tuple[int, ...], ...]:
        """Each node as `from_paths` reads it: the 1-based ranks of the choices on its path."""
        out: list[tuple[int, ...]] = []
        for i, parent in enumerate(self.parents):
            rank = 1 + int(np.flatnonzero(self.children[parent + 1] == i)[0])  # children in order
            out.append((out[parent] if parent >= 0 else ()) + (rank,))
        return tuple(out)

    @property
    def size(self) -> int:
        """N, the number of nodes."""
        return len(self.parents)

    @property
    def span(self) -> int:
        """The most nodes a round writes to a cache past the root."""
        return self.size

    @functools.cached_property
    def depth(self) -> np.ndarray:
        """[N] int32: 1 for the root's children, parent's depth + 1 below."""
        depth = np.zeros(self.size, np.int32)
        for i, parent in enumerate(self.parents):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        return depth

    @property
    def max_depth(self) -> int:
        """K: the most drafts one path holds, so the most a round accepts."""
        return int(self.depth.max())

    @functools.cached_property
    def ancestors(self) -> np.ndarray:
        """[N, N] bool: ancestors[i, j] when node j is on the path from the root to node i,
        node i itself included."""
        anc = np.eye(self.size, dtype=bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                anc[i] |= anc[parent]
        return anc

    @functools.cached_property
    def block_ancestors(self) -> np.ndarray:
        """[N + 1, N + 1] bool: `ancestors` over the scoring block, row 0 the root (an
        ancestor of every node), row i + 1 node i."""
        anc = np.eye(self.size + 1, dtype=bool)
        anc[1:, 0] = True
        anc[1:, 1:] = self.ancestors
        return anc

    @functools.cached_property
    def children(self) -> np.ndarray:
        """[N + 1, W] int32: row 0 the root's children, row i + 1 node i's, in order,
        padded with -1 (a leaf's row is all -1). W is at least 1."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        width = max(1, max(len(k) for k in kids))
        return np.array([k + [-1] * (width - len(k)) for k in kids], np.int32)

    @functools.cached_property
    def spine(self) -> np.ndarray:
        """[J] int32: the first-child chain, the root's first child, then its first child,
        and so on down to a leaf. Children are the drafter's choices in order, so the spine
        is what a chain of J drafts would propose: what a tree keeps beyond what its spine
        keeps is what its width gains (`tree_acceptance.spine_kept`)."""
        nodes, node = [], -1
        while self.children[node + 1, 0] >= 0:
            node = int(self.children[node + 1, 0])
            nodes.append(node)
        return np.array(nodes, np.int32)

    @functools.cached_property
    def paths(self) -> np.ndarray:
        """[N + 1, K] int32: row 0 (the root) all -1, row i + 1 the nodes from the root's
        child down to node i, by depth, padded with -1."""
        table = np.full((self.size + 1, self.max_depth), -1, np.int32)
        for i in range(self.size):
            on_path = np.flatnonzero(self.ancestors[i])  # ascending = by depth (parents first)
            table[i + 1, : on_path.size] = on_path
        return table


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A tree chosen per row (EAGLE-2's dynamic tree): the drafter drafts every node of
    `candidates` (a static tree, level by level) and each row scores only the `nodes`
    candidates its draft scores highest (`select_nodes`; under greedy, the product of the
    draft's probabilities along the node's path). The scoring block has nodes + 1 rows whatever
    the row's shape; where the draft is sure the row's tree runs deep, where it hesitates
    it spreads. The choice reads the draft alone (never the target or the tests' uniforms):
    under greedy the children are the draft's top choices (`Children.FIXED`) and a node's
    score is its path probability; under sampling they are draws without replacement
    (`Children.DISTINCT`) and a node's score never reads its own drawn token
    (`tree_draft.draft_tree`), so acceptance is the rule of how each row's children came,
    on that row's own tree: exact either way."""

    nodes: int
    candidates: Tree

    def __post_init__(self):
        if not 1 <= self.nodes <= self.candidates.size:
            raise ValueError(f"{self.nodes} nodes of {self.candidates.size} candidates")

    @classmethod
    def of(cls, nodes: int) -> "DynamicTree":
        """N nodes out of the default candidates: the draft's chain of `spine_length(N)`
        tokens and, beside each of its tokens, the draft's runners-up there (its second
        choice, up to its third for N >= 6) as leaves. A row's tree is then its chain cut
        where the draft's path probability falls below that of a runner-up, and the
        runners-up where the draft hesitates most. Leaves need no draft head, so drafting
        costs about what the chain's does (`tree_draft.draft_tree`)."""
        depth, width = cls.spine_length(nodes), 2 if nodes < 6 else 3
        paths = [(1,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in range(1, width + 1)]
        return cls(nodes, Tree.from_paths(paths))

    @staticmethod
    def spine_length(nodes: int) -> int:
        """The candidates' chain: N up to 6 nodes, 6 up to 8, then three quarters of N,
        at most 12 (each is a draft call a round). Past 8 nodes the 6-deep candidates ran
        out of nodes worth scoring (greedy, embedded model, stored-a8, HumanEval: dyn8,
        dyn12 and dyn16 kept 2.69, 2.72 and 2.72 tokens a call); a 9-deep spine lifted dyn12
        to 2.83 at the same ms/token, a 12-deep one to 2.87 at a tenth more
        (docs/measurements.md)."""
        return min(nodes, 6) if nodes <= 8 else min(nodes * 3 // 4, 12)

    @property
    def size(self) -> int:
        """N, the nodes the target scores (a static tree's `size`)."""
        return self.nodes

    @property
    def max_depth(self) -> int:
        return self.candidates.max_depth

    @property
    def span(self) -> int:
        """The drafter writes every candidate (`Tree.span`)."""
        return self.candidates.size

    @property
    def spine(self) -> np.ndarray:
        """The candidates' first-child chain: the chain a row's tree holds at most."""
        return self.candidates.spine


class RowTree(NamedTuple):
    """One row's tree as arrays (a batch of them under a leading axis): the tables of
    `Tree` of the same names, for trees that differ per row (`DynamicTree`). An absent
    node (token -1) is a child of nothing, at depth 1, its own only ancestor."""

    parents: jax.Array  # [N] int32
    depth: jax.Array  # [N] int32
    children: jax.Array  # [N + 1, W] int32
    ancestors: jax.Array  # [N, N] bool
    paths: jax.Array  # [N + 1, K] int32
    spine: jax.Array  # [K] int32, the first-child chain, -1 padded

    @property
    def size(self) -> int:
        return self.parents.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[-1]


def select_nodes(dyn: DynamicTree, tokens: jax.Array, score: jax.Array):
    """Each row's tree of a DynamicTree's round: tokens [B, Nc] the candidates' (-1
    absent), score [B, Nc] each candidate's score from the draft (`tree_draft.draft_tree`:
    under greedy its path log-probability), never above its parent's. Returns
    (RowTree with a leading [B], sel [B, N] the candidate behind each node, tokens [B, N]).
    The N best-scored present candidates, numbered as among the candidates (so parents
    first, siblings in the draft's order); a child scores below its parent (a small
    penalty per depth breaks a tie at probability 1), so a chosen node's parent is chosen.
    A row with fewer present candidates marks the rest absent."""
    cand = dyn.candidates
    n, k, width = dyn.nodes, cand.max_depth, cand.children.shape[1]
    c_parents, c_depth = jnp.asarray(cand.parents, jnp.int32), jnp.asarray(cand.depth)
    c_anc, c_paths = jnp.asarray(cand.ancestors), jnp.asarray(cand.paths)

    def one(tok, sc):
        key = jnp.where(tok >= 0, sc.astype(jnp.float32) - 1e-4 * c_depth, -jnp.inf)
        sel = jnp.sort(jax.lax.top_k(key, n)[1]).astype(jnp.int32)
        present = key[sel] > -jnp.inf
        inv = jnp.full(cand.size, -1, jnp.int32).at[sel].set(jnp.arange(n, dtype=jnp.int32))
        cp = c_parents[sel]
        parents = jnp.where(present & (cp >= 0), inv[jnp.maximum(cp, 0)], -1)
        depth = jnp.where(present, c_depth[sel], 1)
        both = present[:, None] & present[None, :]
        ancestors = (c_anc[sel][:, sel] & both) | jnp.eye(n, dtype=bool)
        on = c_paths[sel + 1]  # [N, K] candidate nodes by depth
        mapped = jnp.where(on >= 0, inv[jnp.maximum(on, 0)], -1)
        own = jnp.full((n, k), -1, jnp.int32).at[:, 0].set(jnp.arange(n, dtype=jnp.int32))
        paths = jnp.concatenate([jnp.full((1, k), -1, jnp.int32),
                                 jnp.where(present[:, None], mapped, own)], axis=0)
        is_kid = (parents[None, :] + 1 == jnp.arange(n + 1)[:, None]) & present[None, :]  # [N+1, N]
        rank = jnp.cumsum(is_kid, axis=1) - 1
        slot = is_kid[:, None, :] & (rank[:, None, :] == jnp.arange(width)[None, :, None])
        children = jnp.max(jnp.where(slot, jnp.arange(n)[None, None, :], -1), axis=2).astype(jnp.int32)
        spine, node = [], jnp.asarray(-1, jnp.int32)
        for _ in range(k):
            kid = jnp.where(node >= -1, children[node + 1, 0], -1)
            spine.append(kid)
            node = jnp.where(kid >= 0, kid, -2)  # -2: below a leaf, the rest -1
        tree = RowTree(parents, depth, children, ancestors, paths, jnp.stack(spine))
        return tree, sel, jnp.where(present, tok[sel], -1)

    return jax.vmap(one)(tokens, score)


def path_log_probs(tree: Tree, logp: jax.Array) -> jax.Array:
    """Each node's path log-probability: logp [B, N] of each node's own token (given its
    parent) -> [B, N], the sums down each node's path (`select_nodes`' score)."""
    logp = jnp.maximum(logp, -1e30)  # an absent node's -inf: no 0 * inf in the sums
    return logp @ jnp.asarray(tree.ancestors.T, logp.dtype)


def path_of(tree: Tree, node: jax.Array) -> jax.Array:
    """The accepted path ending at `node` (-1: none accepted): int32 [K], node indices by
    depth, padded with -1. Works on traced nodes (a table lookup)."""
    return jnp.asarray(tree.paths)[node + 1]


def path_slots(path: jax.Array, start: jax.Array) -> jax.Array:
    """Where the accepted path's cache entries are: path [..., K] (from the acceptance,
    -1 padded), start [...] the root's slot -> int32 [..., K], the slot of the accepted
    node at depth d (start + 1 + path[d]), -1 past the accepted ones. Its entries belong
    at start + 1 + d (a gather of these slots into those, before the next round); for a
    chain the two are equal."""
    path = jnp.asarray(path, jnp.int32)
    start = jnp.asarray(start, jnp.int32)[..., None]
    return jnp.where(path >= 0, start + 1 + path, -1)


def block_positions(tree: Tree, start: jax.Array) -> jax.Array:
    """Positions of the scoring block, the root then the nodes: start [...] (the root's
    position, the last accepted token's) -> int32 [..., N + 1], start + depth (0 for the
    root). For a chain: start, start + 1, ..., start + K, the chain's block."""
    start = jnp.asarray(start, jnp.int32)
    if isinstance(tree, RowTree):  # per row: start [B], depth [B, N]
        return start[:, None] + jnp.pad(jnp.asarray(tree.depth, jnp.int32), ((0, 0), (1, 0)))
    return start[..., None] + jnp.asarray(np.concatenate([[0], tree.depth]).astype(np.int32))


def block_visibility(tree: Tree, start: jax.Array, slots: int) -> jax.Array:
    """The attention mask of the scoring block, the root then the nodes written at cache
    slots start..start+N (row j at slot start + j): start [...] int -> bool [..., N+1, S]
    with S = `slots`. Every row sees the slots before the block and the root's; node i
    sees, in the block, its ancestors and itself, never another branch; no row sees past
    the block (stale entries there are never read). For a chain this is the causal mask
    of the K+1 block (slot <= position)."""
    start = jnp.asarray(start, jnp.int32)[..., None, None]
    n = tree.size + 1
    rel = jnp.arange(slots, dtype=jnp.int32) - start  # [..., 1, S]: the slot's row in the block
    in_block = (rel >= 0) & (rel < n)
    cols = jnp.clip(rel, 0, n - 1)[..., 0, :]  # [..., S]
    seen = jnp.moveaxis(jnp.asarray(tree.block_ancestors)[:, cols], 0, -2)  # [..., N+1, S]
    return (rel < 0) | (in_block & seen)


def block_paths(tree: Tree) -> np.ndarray:
    """The scoring call's path table (`Model.forward(..., paths=)`): [N + 1, K + 1] int32,
    row j for block token j (0 the root, i + 1 node i): the block-relative slots of its
    path by depth, the root's 0 first and itself last, padded with -1. Row j's entry d
    is the slot (less start) whose key/value the token at depth d on j's path reads.
    A RowTree's (batched): [B, N + 1, K + 1], each row's own."""
    if isinstance(tree, RowTree):
        rows = jnp.where(tree.paths >= 0, tree.paths + 1, -1)
        return jnp.concatenate([jnp.zeros_like(rows[..., :1]), rows], axis=-1)
    table = np.full((tree.size + 1, tree.max_depth + 1), -1, np.int32)
    table[:, 0] = 0
    table[:, 1:] = np.where(tree.paths >= 0, tree.paths + 1, -1)
    return table
