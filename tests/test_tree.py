"""The static tree description and the scoring block's mask, against brute force.

Brute force here follows parent pointers one node at a time (no tables), for every tree
shape of depth <= 3 with at most 3 nodes a level (tests/tree_reference.shapes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding.tree import Tree, block_positions, block_visibility, path_of, path_slots
from tests.tree_reference import shapes

SHAPES = shapes() + [Tree.full((3, 3, 3)).parents, Tree.full((2, 1, 2)).parents, (-1, -1, 0, 1, 0, 3)]


def _up(parents, i):
    """Node i and its ancestors, from i up to the root's child."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


def test_tables_equal_parent_walks():
    """Catches a wrong depth, an ancestor mask missing indirect ancestors, children out of
    order or in the wrong row, and paths not listed by depth."""
    for parents in SHAPES:
        tree = Tree(parents)
        n = len(parents)
        for i in range(n):
            up = _up(parents, i)
            assert tree.depth[i] == len(up)
            assert set(np.flatnonzero(tree.ancestors[i])) == set(up)
            assert list(tree.paths[i + 1][: len(up)]) == up[::-1]
            assert (tree.paths[i + 1][len(up):] == -1).all()
        for u in range(-1, n):
            kids = [i for i in range(n) if parents[i] == u]
            row = tree.children[u + 1]
            assert list(row[: len(kids)]) == kids and (row[len(kids):] == -1).all()
        assert tree.max_depth == max(len(_up(parents, i)) for i in range(n))
        assert (tree.paths[0] == -1).all()


def test_constructors_and_validation():
    """Catches a chain or full tree numbered wrong, and a tree whose parent follows its
    child (the walk and the tables assume parents come first)."""
    assert Tree.chain(4).parents == (-1, 0, 1, 2)
    assert Tree.full((2, 2)).parents == (-1, -1, 0, 0, 1, 1)
    for bad in [(), (0,), (-1, 1), (-1, -2)]:
        with pytest.raises(ValueError):
            Tree(bad)
    assert hash(Tree((-1, 0))) == hash(Tree([-1, 0]))  # usable as a static jit argument


def _level_order(parents) -> bool:
    depth = Tree(parents).depth
    return bool(np.all(np.diff(depth) >= 0))


def test_rank_paths_round_trip():
    """Catches a rank counted among the wrong siblings, a parent looked up by the wrong
    prefix, nodes not numbered level by level, and a tree text that does not parse back:
    every level-ordered shape (depth <= 3, width <= 3) through its rank paths and its text."""
    from specsamp.decoding.config import parse_tree, tree_text

    for parents in SHAPES:
        tree = Tree(parents)
        for i, path in enumerate(tree.rank_paths):  # brute force: ranks along the parent walk
            up = _up(parents, i)[::-1]
            assert len(path) == len(up)
            for node, rank in zip(up, path):
                assert rank == 1 + sum(1 for j in range(node) if parents[j] == parents[node])
        if _level_order(parents):  # the same nodes, numbered level by level then by path
            again = Tree.from_paths(tree.rank_paths)
            assert sorted(again.rank_paths) == sorted(tree.rank_paths)
            assert parse_tree(tree_text(tree)) == again
            assert again == tree or parents not in shapes()
    assert parse_tree("1-2-11-111").parents == (-1, -1, 0, 2)
    assert tree_text(Tree((-1, -1, 0, 2))) == "1-2-11-111"
    assert tree_text(Tree.full((2, 1))) == "2x1"  # full trees keep their widths
    for bad in [[(1,), (3,)], [(1,), (1, 2)], [(2, 1)], [()]]:
        with pytest.raises(ValueError):
            Tree.from_paths(bad)


def _brute_visible(parents, start, slots):
    n = len(parents)
    vis = np.zeros((n + 1, slots), bool)
    for row in range(n + 1):
        seen = {0} | {i + 1 for i in (_up(parents, row - 1) if row else [])}
        for s in range(slots):
            vis[row, s] = s < start or (s - start in seen and s - start <= n)
    return vis


def test_block_visibility_equals_brute_force():
    """Catches a node seeing a sibling's branch or a later node, a row not seeing the root
    or the cache before the block, seeing past the block, an off-by-one at either edge,
    and a batch of starts mixed up between rows (one call with per-row starts)."""
    starts = np.array([0, 1, 5, 9])
    slots = 20
    visibility = jax.jit(block_visibility, static_argnums=(0, 2))  # one program a shape
    for parents in SHAPES[::60] + SHAPES[-2:]:
        tree = Tree(parents)
        assert len(parents) + 1 + starts.max() <= slots
        got = np.asarray(visibility(tree, jnp.asarray(starts), slots))
        for b, start in enumerate(starts):
            assert np.array_equal(got[b], _brute_visible(parents, start, slots)), (parents, start)
        pos = np.asarray(block_positions(tree, jnp.asarray(starts)))
        want = starts[:, None] + np.array([0] + [len(_up(parents, i)) for i in range(len(parents))])
        assert np.array_equal(pos, want)


def test_chain_block_is_the_causal_block():
    """A chain's mask and positions are the chain's today (slot <= position, positions
    t..t+K): catches a tree helper that would change the K-chain path."""
    tree = Tree.chain(4)
    pos = np.asarray(block_positions(tree, jnp.asarray(3)))
    assert np.array_equal(pos, 3 + np.arange(5))
    causal = np.arange(16)[None, :] <= pos[:, None]
    assert np.array_equal(np.asarray(jax.jit(block_visibility, static_argnums=(0, 2))(tree, 3, 16)), causal)


def test_path_of_traced_nodes():
    """Catches path_of failing under jit/vmap or mishandling 'none accepted' (-1)."""
    tree = Tree.full((2, 2))
    got = jax.jit(jax.vmap(lambda u: path_of(tree, u)))(jnp.asarray([-1, 0, 5]))
    assert np.array_equal(np.asarray(got), [[-1, -1], [0, -1], [1, 5]])


def test_path_slots():
    """Catches the accepted path's cache slots off by one (the root's slot is `start`, node
    i's start + 1 + i) or filled past the accepted nodes; a chain's path is in place."""
    got = path_slots(jnp.asarray([[1, 5], [0, -1], [-1, -1]]), jnp.asarray([10, 3, 7]))
    assert np.array_equal(np.asarray(got), [[12, 16], [4, -1], [-1, -1]])
    chain = path_slots(jnp.asarray([0, 1, 2, -1]), 7)
    assert np.array_equal(np.asarray(chain)[:3], 7 + 1 + np.arange(3))
