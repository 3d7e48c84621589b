"""Scoring a token tree in one call (`Model.forward(..., paths=)`) and moving the accepted
path (`tree_cache.keep_path`), against the same tokens fed as chains: every node's logits
are the last logits of a plain call over its path, bit for bit, and after the move the next
step is that of a run that fed the path as a chain, on XLA's attention and the native
kernel, float32 and float16 caches, one row and three rows at different positions with
their own tokens. Models: tests/tiny.py's target (head width 8: the kernel's portable
loops) and tiny_gemma2 (window 8, soft caps, head width 16: the AVX-512 loops)."""

import dataclasses
import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding.tree import Tree, block_paths, block_positions
from specsamp.models.model import Model
from specsamp.models.tree_cache import keep_path
from specsamp.quant import kernels
from tests import tiny

DATA = os.path.join(os.path.dirname(__file__), "data")
ATTENTION = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(
    kernels.load() is not None, reason="native kernels not built"))]
DTYPES = {"float32": jnp.float32, "float16": jnp.float16}
SHAPES = {
    "chain": Tree.chain(3),
    "binary2": Tree.full((2, 2)),
    "binary3": Tree.full((2, 2, 2)),
    "uneven": Tree((-1, -1, 0, 0, 2, 2, 4, -1, 7)),
}
SLOTS = 48
PROMPTS = (13, 10, 15)  # a row's prompt length: the root's slot, so rows sit apart


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from specsamp.loading import load_model
    from specsamp.testing import write_tiny_tokenizer

    tmp = tmp_path_factory.mktemp("gemma2")
    folder = shutil.copytree(os.path.join(DATA, "tiny_gemma2"), str(tmp / "tiny_gemma2"))
    write_tiny_tokenizer(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSAMP_CACHE", str(tmp / "cache"))
        m = load_model(folder)
    return m.cfg, m.params


def _model(name, gemma2):
    return (tiny.TARGET, tiny.target_params()) if name == "tiny" else gemma2


@functools.cache
def _forward(cfg, attention):
    return jax.jit(Model(cfg, attention=attention).forward)


def _prompt_cache(cfg, params, attention, dtype, batch, seed):
    """(cache with each row's prompt before its root, starts [B], the roots [B])."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(PROMPTS[:batch]) + 1  # the prompt, then the root (fed in the block)
    tokens = rng.integers(0, cfg.vocab_size, (batch, lengths.max()))
    positions = np.broadcast_to(np.arange(lengths.max()), tokens.shape)
    cache = Model(cfg).init_cache(batch, SLOTS, DTYPES[dtype])
    # The prompt at its slots, garbage from the root on (as rejected drafts leave it).
    _, cache = _forward(cfg, attention)(params, jnp.asarray(tokens, jnp.int32),
                                        jnp.asarray(positions, jnp.int32), cache)
    starts = lengths - 1
    return cache, jnp.asarray(starts, jnp.int32), tokens[np.arange(batch), starts]


def _tree_block(trees, roots, vocab, seed):
    """Per-row trees (one node count): tokens [B, N+1] (root, then random nodes), the path
    table [B, N+1, P] and depths [B, N+1]."""
    rng = np.random.default_rng(seed)
    depth = max(t.max_depth for t in trees) + 1
    paths = np.full((len(trees), trees[0].size + 1, depth), -1, np.int32)
    for b, tree in enumerate(trees):
        table = block_paths(tree)
        paths[b, :, : table.shape[1]] = table
    nodes = rng.integers(0, vocab, (len(trees), trees[0].size))
    tokens = np.concatenate([roots[:, None], nodes], 1)
    depths = np.stack([np.concatenate([[0], t.depth]) for t in trees])
    return tokens, paths, depths


def _chains(forward, params, cache, tokens, paths, depths, starts):
    """want [B, N+1, V]: for every row and block token, the last logits of a plain call
    over its path (root first) at slots start..start+depth, from the same prompt cache."""
    b, n = tokens.shape
    want = [[None] * n for _ in range(b)]
    for j in range(n):
        for length in sorted(set(depths[:, j] + 1)):
            ids = np.maximum(paths[:, j, :length], 0)  # rows of another length: any tokens
            chain = jnp.asarray(np.take_along_axis(tokens, ids, axis=1), jnp.int32)
            pos = starts[:, None] + jnp.arange(length, dtype=jnp.int32)
            logits, _ = forward(params, chain, pos, cache)
            for row in np.flatnonzero(depths[:, j] + 1 == length):
                want[row][j] = np.asarray(logits[row, -1])
    return np.asarray(want)


def _score(name, gemma2, attention, dtype, trees, seed=0):
    cfg, params = _model(name, gemma2)
    forward = _forward(cfg, attention)
    cache, starts, roots = _prompt_cache(cfg, params, attention, dtype, len(trees), seed)
    tokens, paths, depths = _tree_block(trees, roots, cfg.vocab_size, seed + 1)
    positions = starts[:, None] + jnp.asarray(depths, jnp.int32)
    got, tree_cache = forward(params, jnp.asarray(tokens, jnp.int32), positions, cache,
                              paths=jnp.asarray(paths))
    return cfg, params, forward, cache, starts, tokens, paths, depths, got, tree_cache


def _assert_nodes_equal_chains(name, gemma2, attention, dtype, trees):
    _, params, forward, cache, starts, tokens, paths, depths, got, _ = _score(
        name, gemma2, attention, dtype, trees)
    want = _chains(forward, params, cache, tokens, paths, depths, starts)
    for b in range(len(trees)):
        for j in range(tokens.shape[1]):
            assert np.array_equal(np.asarray(got[b, j]), want[b, j]), (b, j)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_logits_equal_chains(shape, batch, attention, dtype, gemma2):
    """Catches a node that sees another branch, misses an ancestor, reads its path out of
    depth order or at another slot (an off-by-one in the gather, the table ignored by the
    kernel), a block written at its positions instead of its slots, or any sum taken in
    another order than the chain's: each node's logits equal its path's chain, bit for bit."""
    _assert_nodes_equal_chains("tiny", gemma2, attention, dtype, [SHAPES[shape]] * batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attention", ATTENTION)
def test_windowed_softcapped_tree_logits_equal_chains(attention, dtype, gemma2):
    """The same on Gemma 2 (a sliding window on two of three layers, attention and final
    soft caps, the kernel's vector loops) with its window cut to 3, so that nodes at depth
    3 and below start their window inside the path; three rows with different trees of 8
    nodes (per-row path tables)."""
    cfg, params = gemma2
    small = (dataclasses.replace(cfg, sliding_window=3), params)
    trees = [Tree.full((2, 3)), Tree((-1, 0, 1, 2, 3, -1, 5, 5)), Tree((-1, -1, 0, 1, 3, 3, 5, 6))]
    _assert_nodes_equal_chains("gemma2", small, attention, dtype, trees)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ["tiny", "gemma2"])
def test_next_step_after_keep_path_equals_chain_run(name, attention, dtype, gemma2):
    """Catches an accepted path moved to the wrong slots, from the wrong nodes, or in only
    some layers or only keys: after `keep_path`, the cache up to the accepted depth and the
    next step's logits equal a run that fed the path as a chain (rows accepting different
    depths, one none)."""
    tree = SHAPES["uneven"]
    cfg, params, forward, cache, starts, tokens, _, _, _, moved = _score(
        name, gemma2, attention, dtype, [tree] * 3, seed=5)
    accepted = np.asarray([8, 4, -1])  # the last accepted node of each row
    path = jnp.asarray(tree.paths[accepted + 1])
    n = np.asarray(tree.depth)[accepted] * (accepted >= 0)
    moved = keep_path(moved, path, starts)
    # The chain run: root, the accepted tokens, filler to depth K (overwritten next).
    chain = np.take_along_axis(tokens, np.where(tree.paths[accepted + 1] >= 0,
                                                tree.paths[accepted + 1] + 1, 0), axis=1)
    chain = jnp.asarray(np.concatenate([tokens[:, :1], chain], 1), jnp.int32)
    _, ref = forward(params, chain, starts[:, None] + jnp.arange(chain.shape[1], dtype=jnp.int32),
                     cache)
    nxt = jnp.asarray([[3], [1], [2]], jnp.int32)
    pos = starts[:, None] + jnp.asarray(n + 1, jnp.int32)[:, None]
    got, got_cache = forward(params, nxt, pos, moved)
    want, want_cache = forward(params, nxt, pos, ref)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    for b in range(3):
        upto = int(pos[b, 0]) + 1
        for a, w in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
            assert np.array_equal(np.asarray(a[:, b, :, :upto]), np.asarray(w[:, b, :, :upto])), b


@pytest.mark.parametrize("dtype", DTYPES)
def test_keep_path_moves_each_rows_path(dtype):
    """keep_path against a loop over rows, depths and layers on a random cache: slot
    start + 1 + d takes slot start + 1 + path[d] for the accepted d, nothing else changes;
    a chain's path and an empty one leave the cache as it is; a path at the cache's end
    writes nothing past it."""
    from specsamp.models.llama import KVCache

    rng = np.random.default_rng(0)
    shape = (2, 4, 2, 16, 3)  # L, B, J, S, E
    k = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    path = np.asarray([[1, 4, 6], [0, 1, 2], [-1, -1, -1], [0, 1, 2]], np.int32)
    start = np.asarray([3, 5, 2, 13], np.int32)
    out = keep_path(KVCache(k=jnp.asarray(k), v=jnp.asarray(v)), path, start)
    for want, got in ((k.copy(), out.k), (v.copy(), out.v)):
        src = want.copy()
        for b in range(4):
            for d in np.flatnonzero((path[b] >= 0) & (start[b] + 1 + np.arange(3) < 16)):
                want[:, b, :, start[b] + 1 + d] = src[:, b, :, start[b] + 1 + path[b, d]]
        assert got.dtype == want.dtype
        assert np.array_equal(np.asarray(got), want)
    assert np.array_equal(np.asarray(out.k[:, 1:]), k[:, 1:])  # rows 1-3: unchanged


@pytest.mark.parametrize("shape", SHAPES)
def test_block_paths_lists_each_tokens_ancestors_by_depth(shape):
    """block_paths against the tree's ancestor matrix: row j holds the block slots of j's
    ancestors and itself (the root's 0 first), ascending, depth + 1 of them, then -1."""
    tree = SHAPES[shape]
    table = block_paths(tree)
    depth = np.concatenate([[0], tree.depth])
    assert table.shape == (tree.size + 1, tree.max_depth + 1)
    for j in range(tree.size + 1):
        want = np.flatnonzero(tree.block_ancestors[j])
        assert np.array_equal(table[j, : depth[j] + 1], want)
        assert np.all(table[j, depth[j] + 1:] == -1)
