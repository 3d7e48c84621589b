"""Tree acceptance end to end with its own draws, and greedy trees.

`accept_tree_batch` with real keys (its uniforms and its `sampling.sample` of the next
token), on children drafted as each mode says, must emit token sequences distributed as
the exact enumeration of tests/tree_reference.py says (chi-square, false-alarm rate 1e-4
per check, fixed seeds so it is deterministic). Greedy trees must emit what greedy
decoding emits, with the longest path the target agrees with.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from specsamp.decoding.tree import Tree
from specsamp.decoding.tree_acceptance import Children, accept_tree_batch, accept_tree_greedy_batch
from tests import tree_reference as ref

ALPHA = 1e-4
# Root with 3 children; below them 2, 1 and 0; one grandchild with 2 children, another 1.
SHAPE = Tree((-1, -1, -1, 0, 0, 1, 3, 3, 4))
MODE = {"iid": Children.IID, "distinct": Children.DISTINCT, "fixed": Children.FIXED}


class Tables:
    """A world as arrays: P, Q [C, V] by context index, CHILD [C, V] the index of the
    context one token longer (-1 past the deepest)."""

    def __init__(self, world: ref.World, depth: int):
        ctxs = [c for n in range(depth + 1) for c in _contexts(world.v, n)]
        index = {c: i for i, c in enumerate(ctxs)}
        self.p = np.array([world.p(c) for c in ctxs])
        self.q = np.array([world.q(c) for c in ctxs])
        self.child = np.array([[index.get(c + (x,), -1) for x in range(world.v)] for c in ctxs])


def _contexts(v, n):
    return [tuple(int(d) for d in np.unravel_index(i, (v,) * n)) for i in range(v**n)]


def _inverse_cdf(rng, probs):
    """One token a row of probs [B, V] (rows summing to 0 give token 0)."""
    total = probs.sum(axis=1, keepdims=True)
    u = rng.random((probs.shape[0], 1)) * total
    x = (np.cumsum(probs, axis=1) <= u).sum(axis=1)
    return np.where(total[:, 0] > 0, np.minimum(x, probs.shape[1] - 1), 0)


def draft_rows(tree: Tree, tab: Tables, mode: str, rows: int, seed: int):
    """Children drafted for `rows` rows at once, each node's from its parent's context:
    tokens [B, N], p, q [B, N+1, V] (root row 0)."""
    rng = np.random.default_rng(seed)
    n = tree.size
    ctx = np.zeros((rows, n + 1), np.int64)  # context index of the root (0) and each node
    tokens = np.zeros((rows, n), np.int64)
    left = {}  # DISTINCT: the draft mass not drawn yet, per parent
    order = {}  # FIXED: each parent's tokens by descending draft probability
    for i, parent in enumerate(tree.parents):
        p_par = tab.p[ctx[:, parent + 1]]
        slot = list(tree.children[parent + 1]).index(i)
        if mode == "iid":
            x = _inverse_cdf(rng, p_par)
        elif mode == "distinct":
            rest = left.setdefault(parent, p_par.copy())
            x = _inverse_cdf(rng, rest)
            rest[np.arange(rows), x] = 0.0
        else:
            x = order.setdefault(parent, np.argsort(-p_par, axis=1, kind="stable"))[:, slot]
        tokens[:, i] = x
        ctx[:, i + 1] = tab.child[ctx[:, parent + 1], x]
    return tokens, tab.p[ctx], tab.q[ctx]


ROWS = 10_000


@functools.lru_cache(maxsize=None)
def _accept_all():
    """accept_tree_batch on SHAPE for the three modes, each on its own rows, as one
    program (one compilation instead of three)."""

    def run(keys, tokens, p, q):  # tokens [3, B, N], p, q [3, B, N+1, V]: one per mode
        return [accept_tree_batch(keys, tokens[i], p[i], q[i], tree=SHAPE, children=MODE[m])
                for i, m in enumerate(ref.MODES)]

    return jax.jit(run)


def _run_all(keys, tokens, p, q):
    out = _accept_all()(keys, jnp.asarray(np.stack(tokens), jnp.int32), jnp.asarray(np.stack(p), jnp.float32),
                        jnp.asarray(np.stack(q), jnp.float32))
    return [[np.asarray(a) for a in o] for o in out]


def _counts(tokens, out):
    path, n, token = out
    counts = {}
    for b in range(tokens.shape[0]):
        seq = tuple(int(tokens[b, j]) for j in path[b, : n[b]]) + (int(token[b]),)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def _pvalue(counts: dict, probs: dict) -> float:
    """Chi-square of observed sequences against exact probabilities; cells expected under
    5 times are pooled. A sequence of probability 0 observed fails outright."""
    assert all(probs.get(s, 0.0) > 0 for s in counts), "emitted a sequence of probability 0"
    total = sum(counts.values())
    big = [s for s in probs if probs[s] * total >= 5]
    obs = [counts.get(s, 0) for s in big]
    exp = [probs[s] * total for s in big]
    pooled = total - sum(obs)
    if pooled or total - sum(exp) > 1e-9 * total:
        obs.append(pooled)
        exp.append(total - sum(exp))
    if len(obs) < 2:
        return 1.0  # one possible outcome, and it is what was seen
    return stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue


def test_emitted_sequences_follow_the_exact_distribution():
    """Catches, with the real draws, in every mode: uniforms reused across nodes or drawn
    from the wrong key, the next token drawn from the wrong distribution by `sample`, and
    anything that biases which path is kept. The control: the same samples tested against
    the output of the stale-residual rule are rejected, so the check can see that fault.
    Also a row's result moves with the row when the batch is reordered."""
    world = ref.World("random", v=3, seed=7)
    tab = Tables(world, SHAPE.max_depth)
    rows = [draft_rows(SHAPE, tab, mode, ROWS, seed=3 + i) for i, mode in enumerate(ref.MODES)]
    tokens, p, q = (list(x) for x in zip(*rows))
    keys = jax.random.split(jax.random.PRNGKey(3), ROWS)
    outs = _run_all(keys, tokens, p, q)
    for mode, tok, out in zip(ref.MODES, tokens, outs):
        counts = _counts(tok, out)
        assert _pvalue(counts, ref.Enumerator(world, mode).emitted(SHAPE.parents)) > ALPHA, mode
        stale = ref.Enumerator(world, mode, variant="stale").emitted(SHAPE.parents)
        assert _pvalue(counts, stale) < ALPHA, mode
    roll = lambda xs: [np.roll(x, 1, axis=0) for x in xs]  # noqa: E731
    moved = _run_all(np.roll(np.asarray(keys), 1, axis=0), roll(tokens), roll(p), roll(q))
    for got, out in zip(moved, outs):
        for a, b in zip(got, out):
            assert np.array_equal(a, np.roll(b, 1, axis=0))


def test_greedy_is_greedy_decoding_with_the_longest_path():
    """Catches a greedy rule that keeps a token the target would not have produced, stops
    short of a longer agreeing path (in another branch, or under a later sibling), takes
    the bonus from the wrong node, or matches an absent node (-1)."""
    rng = np.random.default_rng(4)
    tree, v, rows = Tree.full((3, 3, 3)), 4, 300
    tab = Tables(ref.World("random", v=v, seed=1), tree.max_depth)
    best = tab.q.argmax(axis=1)  # the target's argmax after each context
    ctx = np.zeros((rows, tree.size + 1), np.int64)
    tokens = np.zeros((rows, tree.size), np.int64)
    for i, parent in enumerate(tree.parents):
        agree = best[ctx[:, parent + 1]]
        tokens[:, i] = np.where(rng.random(rows) < 0.45, agree, rng.integers(v, size=rows))
        ctx[:, i + 1] = tab.child[ctx[:, parent + 1], tokens[:, i]]
    tokens[rng.random(tokens.shape) < 0.1] = -1  # absent nodes (their subtrees stay, unreachable)
    argmax = best[ctx]  # [B, N+1]
    got = jax.jit(functools.partial(accept_tree_greedy_batch, tree=tree))(
        jnp.asarray(tokens, jnp.int32), jnp.asarray(argmax, jnp.int32))
    path, n, token = (np.asarray(a) for a in got)
    for b in range(rows):
        ok = [all(tokens[b, j] >= 0 and tokens[b, j] == argmax[b, tree.parents[j] + 1]
                  for j in np.flatnonzero(tree.ancestors[i])) for i in range(tree.size)]
        longest = max([int(tree.depth[i]) for i in range(tree.size) if ok[i]], default=0)
        assert n[b] == longest
        emitted = [int(tokens[b, j]) for j in path[b, : n[b]]] + [int(token[b])]
        decoded, c = [], 0
        for _ in range(n[b] + 1):
            decoded.append(int(best[c]))
            c = tab.child[c, best[c]] if len(decoded) <= tree.max_depth else c
        assert emitted == decoded


def test_greedy_is_the_sampling_rule_on_one_hot_q():
    """With distinct siblings (the draft's top tokens) and q one-hot on the argmax, the
    sampling rule in every mode and the greedy rule keep the same path and emit the same
    token: catches a greedy rule that drifts from the rule it is the temperature-0 case of
    (and a sampling rule that keeps a token of target probability 0)."""
    world = ref.World("random", v=3, seed=9)
    tokens, p, q = draft_rows(SHAPE, Tables(world, SHAPE.max_depth), "fixed", ROWS, seed=5)
    argmax = q.argmax(axis=2)
    one_hot = np.eye(3)[argmax]
    keys = jax.random.split(jax.random.PRNGKey(0), ROWS)
    sampled = _run_all(keys, [tokens] * 3, [p] * 3, [one_hot] * 3)
    greedy = jax.jit(functools.partial(accept_tree_greedy_batch, tree=SHAPE))(
        jnp.asarray(tokens, jnp.int32), jnp.asarray(argmax, jnp.int32))
    for out in sampled:
        for a, b in zip(out, greedy):
            assert np.array_equal(a, np.asarray(b))
    assert 0 < np.asarray(greedy.n).mean() < SHAPE.max_depth  # both kept and refused paths
