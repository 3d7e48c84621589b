"""Exact acceptance over token trees: the rule is exact, and the JAX code is the rule.

1. The rule (tests/tree_reference.py, plain Python, exact enumeration, no sampling): for
   every tree shape of depth <= 3 with at most 3 nodes a level (427 shapes, so 0 to 3
   children a node), every way the children are chosen, and worlds with zeros in p and q,
   point-mass drafts, p = q and point-mass targets, one round continued by the target
   gives the target's own distribution of the first 4 tokens to 1e-12. Controls: a
   residual not updated after a rejected sibling, and deterministic top-k children tested
   as sampled ones, fail the same check.
2. The JAX code (`walk`) equals the reference case by case, driven with the same uniforms,
   on the full 3-3-3 tree with random absent nodes; a wrong residual monkeypatched into
   it fails this.
3. On a chain it is `acceptance.accept` bit for bit, with the same keys.
The sampled end to end checks (`accept_tree_batch` with its own draws) and greedy are in
tests/test_tree_sampling.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding import tree_acceptance
from specsamp.decoding.acceptance import accept_batch
from specsamp.decoding.tree import Tree
from specsamp.decoding.tree_acceptance import Children, accept_tree_batch, walk
from tests import tree_reference as ref

SHAPES = ref.shapes()
EXACT = 1e-12


def _gap(enum: ref.Enumerator, parents, length=4) -> float:
    """Largest difference between one round continued by the target and the target."""
    got = ref.extended(enum.emitted(parents), enum.world, length)
    want = ref.target(enum.world, length)
    return max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want))


@pytest.mark.parametrize("kind,v", [(k, 3) for k in ref.World.KINDS] + [("mixed", 3), ("mixed", 4)])
def test_rule_is_exact_on_every_shape(kind, v):
    """Catches a scheme that is not exact for some shape (a node with 2 or 3 children, a
    subtree under a later sibling), some way of choosing children, or some kind of
    distribution (zeros, point masses, p = q, a point-mass target)."""
    world = ref.World(kind, v=v, seed=v)
    for mode in ref.MODES:
        enum = ref.Enumerator(world, mode)
        worst = max((_gap(enum, parents), parents) for parents in SHAPES)
        assert worst[0] < EXACT, (mode, worst)


def test_rule_is_exact_on_the_full_3_3_3_tree():
    """The largest shape of the size class (39 nodes, every node 3 children), in a world
    where each context has its own kind: catches what only wide and deep trees together
    reach (a subtree under the third child of the third child)."""
    world = ref.World("mixed", v=3, seed=5)
    for mode in ref.MODES:
        assert _gap(ref.Enumerator(world, mode), Tree.full((3, 3, 3)).parents) < EXACT, mode


def test_control_stale_residual_fails():
    """The control: a target distribution not updated after a rejected sibling fails the
    exactness check on every shape with a node of two or more children (all but the
    three chains), in every mode. If this passed, the check above could not see a wrong
    residual."""
    world = ref.World("random", v=3, seed=3)
    chains = {p for p in SHAPES if p == Tree.chain(len(p)).parents}
    for mode in ref.MODES:
        enum = ref.Enumerator(world, mode, variant="stale")
        passing = {p for p in SHAPES if _gap(enum, p) < 1e-6}
        assert passing == chains, mode


def test_control_topk_tested_as_sampled_fails():
    """The second control: the draft's top tokens, taken deterministically, tested as if
    they had been drawn without replacement from p (d = p renormalised instead of a point
    mass) is not exact: already one child (the draft's argmax, kept with q/p) fails."""
    world = ref.World("random", v=3, seed=3)
    enum = ref.Enumerator(world, "fixed", variant="topk_as_sampled")
    failing = [p for p in SHAPES if _gap(enum, p) > 1e-3]
    assert (-1,) in failing and len(failing) > 0.9 * len(SHAPES)


# --- the JAX rule against the reference, case by case ---------------------------------

MODE = {"iid": Children.IID, "distinct": Children.DISTINCT, "fixed": Children.FIXED}


@functools.lru_cache(maxsize=None)
def _walk_batch(tree: Tree, mode: str):
    return jax.jit(jax.vmap(functools.partial(walk, tree=tree, children=MODE[mode])))


def _cases(tree: Tree, world: ref.World, mode: str, rows: int, seed: int):
    """Random rows of one world: tokens drawn as `mode` says (absent nodes and their
    subtrees marked -1), p and q rows of each node's context, and uniforms."""
    rng = np.random.default_rng(seed)
    n, v = tree.size, world.v
    tokens = np.full((rows, n), -1, np.int64)
    p = np.zeros((rows, n + 1, v))
    q = np.zeros((rows, n + 1, v))
    for b in range(rows):
        ctx = {-1: ()}
        for u in [-1] + list(range(n)):
            if u not in ctx:
                continue  # absent: no draft below it
            pu, qu = world.p(ctx[u]), world.q(ctx[u])
            p[b, u + 1], q[b, u + 1] = pu, qu
            kids = list(tree.children[u + 1][tree.children[u + 1] >= 0])
            drawn = _draw(rng, pu, len(kids), mode)
            for c, x in zip(kids, drawn):
                if x is not None and rng.random() > 0.2:
                    tokens[b, c] = x
                    ctx[c] = ctx[u] + (x,)
    r = rng.random((rows, n))
    return tokens, p, q, r


def _draw(rng, p, m, mode):
    if mode == "fixed":
        return ref.fixed_children(p, m)
    if mode == "iid":
        return list(rng.choice(len(p), size=m, p=p))
    left, out = np.array(p), []
    for _ in range(m):
        out.append(int(rng.choice(len(p), p=left / left.sum())) if left.sum() > 0 else None)
        if out[-1] is not None:
            left[out[-1]] = 0.0
    return out


def _mismatches(mode: str, seed: int = 0, rows: int = 150) -> int:
    tree = Tree.full((3, 3, 3))
    world = ref.World("mixed", v=4, seed=11)
    tokens, p, q, r = _cases(tree, world, mode, rows, seed)
    node, dist = _walk_batch(tree, mode)(
        jnp.asarray(tokens, jnp.int32), jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32),
        jnp.asarray(r, jnp.float32))
    node, dist = np.asarray(node), np.asarray(dist)
    bad = 0
    for b in range(rows):
        want_node, want_dist = ref.walk(tree.parents, list(tokens[b]), p[b], q[b], r[b], mode)
        bad += int(node[b] != want_node or not np.allclose(dist[b], want_dist, atol=1e-5))
    return bad


@pytest.mark.parametrize("mode", ref.MODES)
def test_jax_walk_equals_reference(mode):
    """Catches, in the JAX code only: a wrong row (parent vs node), children tried out of
    order, the lazily applied residual applied twice or not at all, DISTINCT not removing
    a rejected sibling, an absent node (-1 or zero draft mass) tested, a wrong uniform
    used, and a wrong end distribution (residual after the last refusal, the node's own q
    at a leaf)."""
    assert _mismatches(mode) == 0


def test_control_wrong_residual_in_jax_fails(monkeypatch):
    """The control of the check above: the JAX rule with a residual that ignores the draft
    (q' is never updated, so a refusal redraws from q itself) disagrees with the reference."""
    monkeypatch.setattr(tree_acceptance, "residual", lambda q, d: q / jnp.sum(q))
    _walk_batch.cache_clear()
    try:
        assert _mismatches("iid", rows=40) > 0
    finally:
        _walk_batch.cache_clear()


# --- chains ---------------------------------------------------------------------------


def test_chain_is_the_chain_rule_bit_for_bit():
    """A chain through the tree rule is `acceptance.accept` with the same key: the same n
    and the same token in every row (FIXED: accept with p one-hot on the draft). Catches
    a tree rule that changes K-chains: other uniforms, another comparison, a renormalised
    residual, a bonus drawn from anything but q_{K+1}."""
    rng = np.random.default_rng(1)
    b, k, v = 400, 3, 5
    p = rng.dirichlet(np.full(v, 0.5), size=(b, k)).astype(np.float32)
    p[: b // 4, 0] = np.eye(v, dtype=np.float32)[rng.integers(v, size=b // 4)]  # point masses
    q = rng.dirichlet(np.full(v, 0.5), size=(b, k + 1)).astype(np.float32)
    q[b // 4: b // 2, :k] = p[b // 4: b // 2]  # p == q: all kept
    draft = np.array([[rng.choice(v, p=row / row.sum()) for row in rows] for rows in p], np.int32)
    keys = jax.random.split(jax.random.PRNGKey(2), b)
    p_tree = np.concatenate([p, np.zeros_like(p[:, :1])], axis=1)  # the leaf's unused row
    one_hot = np.eye(v, dtype=np.float32)[draft]
    tree = Tree.chain(k)

    @jax.jit
    def both(keys, draft, p, one_hot, p_tree, q):  # one program: one compilation
        chain = [accept_batch(keys, draft, p, q)] * 2 + [accept_batch(keys, draft, one_hot, q)]
        trees = [accept_tree_batch(keys, draft, p_tree, q, tree=tree, children=m) for m in Children]
        return chain, trees

    chain, trees = both(keys, draft, p, one_hot, p_tree, q)
    for (n, x), got in zip(chain, trees):
        assert np.array_equal(got.n, n) and np.array_equal(got.token, x)
        want_path = np.where(np.arange(k)[None] < np.asarray(n)[:, None], np.arange(k)[None], -1)
        assert np.array_equal(got.path, want_path)
    assert 0 < np.asarray(chain[0][0]).mean() < k  # some refused, some kept


@pytest.mark.parametrize("mode", [Children.IID, Children.DISTINCT])
def test_rows_marked_fixed_take_the_fixed_rule_bit_for_bit(mode):
    """`fixed` (a hybrid's lookup rows, `TreeProposal.fixed_rows`): a marked row's result
    is the FIXED rule's, an unmarked row's the mode's, bit for bit, with the same keys.
    Catches the flag ignored, inverted, or read from another row."""
    rng = np.random.default_rng(4)
    b, v, tree = 300, 6, Tree.full((3, 1))
    p = rng.dirichlet(np.full(v, 0.5), size=(b, tree.size + 1)).astype(np.float32)
    q = rng.dirichlet(np.full(v, 0.5), size=(b, tree.size + 1)).astype(np.float32)
    tokens = rng.integers(v, size=(b, tree.size)).astype(np.int32)
    fixed = rng.random(b) < 0.5
    keys = jax.random.split(jax.random.PRNGKey(5), b)

    @jax.jit
    def three(keys, tokens, p, q, fixed):  # one program: one compilation
        run = functools.partial(accept_tree_batch, keys, tokens, p, q, tree=tree)
        return run(children=mode, fixed=fixed), run(children=Children.FIXED), run(children=mode)

    mixed, as_fixed, as_mode = three(keys, tokens, p, q, fixed)
    for got, a, m in zip(mixed, as_fixed, as_mode):
        want = np.where(fixed.reshape((-1,) + (1,) * (np.ndim(a) - 1)), a, m)
        assert np.array_equal(np.asarray(got), want)
    assert not np.array_equal(np.asarray(as_fixed.token), np.asarray(as_mode.token))  # the rules differ here
