"""`--tree auto`: the policy weighs token tree shapes beside the chains' K values.

The estimator of a tree round's tokens against an enumeration and a simulation; the
choice follows measured costs and rates, and explores a fresh shape; chains and trees of
one drafter run one after another on one state (the draft cache where a chain expects
it); greedy output with shapes switched chunk by chunk equals greedy autoregressive
decoding, and sampled output follows the target's law (chi-square, with a control that
must fail it)."""

import dataclasses
import itertools

import numpy as np
import pytest

from specsamp.analysis.throughput import width_gains
from specsamp.decoding import tree_draft
from specsamp.decoding.config import AUTO_TREES, TREE_AUTO, KChoice, SamplingParams, parse_tree, trees_for
from specsamp.decoding.costs import CostCurve
from specsamp.decoding.engine import Continuous, Engine
from specsamp.decoding.kpolicy import KPolicy
from specsamp.decoding.position_rates import depth_counts, expected_tokens_by_position
from specsamp.decoding.tree_acceptance import accept_tree_greedy_batch, spine_kept, spine_kept_greedy
from specsamp.decoding.config import tree_widths
from specsamp.decoding.tree import Tree
from specsamp.errors import UserError
from tests import tiny
from tests.test_continuous import _distinct_prompts, _eos_engine
from tests.test_exactness import ALPHA, N_TOKENS, PROMPT, chi_square_pvalue, exact_joint, make_engine

KS = (0, 1, 2, 3)


def _tree_auto(engine: Engine, ks, trees, policy) -> Engine:
    """`engine` with its own statistics, at the K values ks and the trees, chosen by `policy`."""
    return dataclasses.replace(engine, k=KChoice(tuple(ks), auto=True, trees=tuple(trees)), policy=policy)


# -- the estimator ---------------------------------------------------------------------

def test_spine_and_what_it_kept():
    """The spine is the first-child chain; at temperature 0 it kept its leading nodes that
    match the target's argmax, even where the accepted path left it on a sibling with the
    same token; sampling, the depths down to which the accepted path is the spine."""
    t21 = Tree.full((2, 1))  # nodes 0, 1 at depth 1; 2 under 0, 3 under 1
    assert t21.spine.tolist() == [0, 2]
    assert Tree.full((2, 2)).spine.tolist() == [0, 2]
    assert Tree.chain(3).spine.tolist() == [0, 1, 2]
    assert Tree((-1, -1, 1)).spine.tolist() == [0]  # the first child is a leaf
    tokens = np.array([[5, 6, 7, 8],   # the second child and its child match: spine kept 0
                       [5, 5, 7, 8],   # both children 5, only the second's child matches
                       [5, 6, 7, 8],   # the spine matches twice
                       [-1, 6, 7, 8]])  # an absent first child never matches
    argmax = np.array([[6, 0, 8, 0, 0], [5, 9, 8, 0, 0], [5, 7, 0, 0, 0], [6, 0, 8, 0, 0]])
    acc = accept_tree_greedy_batch(tokens, argmax, tree=t21)
    assert np.asarray(acc.n).tolist() == [2, 2, 2, 2]
    assert np.asarray(spine_kept_greedy(tokens, argmax, tree=t21)).tolist() == [0, 1, 2, 0]
    assert np.asarray(spine_kept(acc.path, tree=t21)).tolist() == [0, 0, 2, 0]
    paths = np.array([[0, 2], [1, 3], [0, -1], [-1, -1]])
    assert np.asarray(spine_kept(paths, tree=t21)).tolist() == [2, 0, 1, 0]


@pytest.mark.parametrize("widths", [(2, 1), (2, 2), (3, 1, 1)])
def test_tree_tokens_predicted_from_the_spine_and_the_width_gain(widths):
    """Greedy tree rounds simulated on a law where the target's token at depth d is drawn
    from q[d] and a node's children are the w most likely under p[d], scored with the
    loop's own acceptance and spine functions: the spine kept what a chain of its length
    keeps (enumerated), and the policy's prediction from those counts (the chain model
    times the width gain) is the tree's exact mean tokens per round."""
    rng = np.random.default_rng(0)
    tree, v, depth = Tree.full(widths), 5, len(widths)
    q, p = rng.dirichlet(np.ones(v), depth), rng.dirichlet(np.ones(v), depth)
    order = [np.argsort(-p[d], kind="stable") for d in range(depth)]
    nth_child = np.zeros(tree.size, int)  # node i is the nth_child[i]-th child of its parent
    for row in tree.children:
        for j, node in enumerate(row[row >= 0]):
            nth_child[node] = j
    node_tokens = np.array([order[tree.depth[i] - 1][nth_child[i]] for i in range(tree.size)])

    def tokens_kept(seq, width):
        return next((d for d, x in enumerate(seq) if x not in order[d][:width[d]]), depth)

    def exact(width):
        return sum(np.prod([q[d][x] for d, x in enumerate(seq)]) * (1 + tokens_kept(seq, width))
                   for seq in itertools.product(range(v), repeat=depth))

    n = 20000
    seqs = np.stack([rng.choice(v, n, p=q[d]) for d in range(depth)], axis=1)  # [n, depth]
    after = np.concatenate([seqs, np.zeros((n, 1), int)], axis=1)  # after a leaf: never read
    argmax = np.concatenate([seqs[:, :1], after[:, np.asarray(tree.depth)]], axis=1)  # root, nodes
    tokens = np.broadcast_to(node_tokens, (n, tree.size))
    kept = np.asarray(accept_tree_greedy_batch(tokens, argmax, tree=tree).n)
    spine = np.asarray(spine_kept_greedy(tokens, argmax, tree=tree))
    assert np.all(spine <= kept)
    assert np.mean(1 + spine) == pytest.approx(exact((1,) * depth), abs=0.03)
    assert np.mean(1 + kept) == pytest.approx(exact(widths), abs=0.03)

    policy = KPolicy(CostCurve(1, {0: 1.0, depth: 1.0, "x".join(map(str, widths)): 1.0}), (0, depth),
                     (tree,), depth_weight=0.0)
    pooled = depth_counts(spine, depth, depth)
    rates = policy.position_rates(pooled)
    tree_tokens = {"x".join(map(str, widths)): (float(np.sum(1 + kept)), float(np.sum(1 + spine)))}
    alpha = np.array([(pooled[0].sum() + 1) / (pooled[1].sum() + 2)])
    predicted = policy.tokens_per_second(tree, alpha, rates, tree_tokens)
    assert predicted == pytest.approx(exact(widths), abs=0.05)
    chain = float(expected_tokens_by_position(alpha, rates, depth)[0])
    assert chain == pytest.approx(exact((1,) * depth), abs=0.05)


def _first_rounds(sp, prompts, tree: Tree):
    """(accepted, spine) of each row's first round from the same state, K = 2 chain rounds
    and then `tree` rounds (a drafter model, the tree's spine 2 long)."""
    import jax.numpy as jnp

    chain_eng = make_engine(sp, "model", 2, max_new=8)
    tree_eng = _tree_auto(chain_eng, (0, 2), (tree,), None)
    never = jnp.asarray(np.array([-1], np.int32))
    n = len(prompts)
    padded = np.zeros((n, max(map(len, prompts))), np.int32)
    for i, ids in enumerate(prompts):
        padded[i, : len(ids)] = ids
    lens = np.array([len(ids) for ids in prompts], np.int32)
    firsts = []
    # the spine is tested token by token (the first child first), as the per-token chain
    # rule tests its drafts; block verification keeps a little more (tests/test_block_verification.py)
    chain_prog = dataclasses.replace(chain_eng.prog, verify="token")
    for prog in (chain_prog, dataclasses.replace(tree_eng.prog, tree=tree)):
        state = tree_eng.empty(prog, n, tree_eng.slots_for(prompts))
        state, _ = tree_eng.insert(prog, state, padded, lens, np.arange(n, dtype=np.uint32),
                                   np.arange(n, dtype=np.int32), 2)
        state, _, _ = tree_eng.generate(prog, 2, state, never, never, max_rounds=1, refill_at=n)
        firsts.append((np.asarray(state.round_accepted)[:, 0], np.asarray(state.round_spine)[:, 0]))
    return firsts


def test_spine_in_the_loop_kept_what_the_chain_keeps():
    """The loop's `round_spine`: the first round of a 2x1 tree on distinct prompts, greedy,
    kept on its spine exactly the draft tokens that the K = 2 chain of the same drafter
    keeps in its first round from the same state, and never more than the tree kept."""
    (chain_kept, chain_spine), (tree_kept, tree_spine) = _first_rounds(
        SamplingParams(0.0), _distinct_prompts(48, 3), Tree.full((2, 1)))
    assert np.all(chain_spine == 0)  # chain rounds record none
    np.testing.assert_array_equal(tree_spine, chain_kept)
    assert np.all(tree_spine <= tree_kept) and np.any(tree_spine < tree_kept)
    assert len(set(chain_kept.tolist())) > 1  # rounds that kept different counts


def test_sampled_spine_keeps_as_the_chain_does():
    """Sampling (T = 1): over 6,000 seeds of one prompt, the first round's spine of a 3x1
    tree keeps 0, 1, 2 draft tokens as often as the K = 2 chain under the per-token rule
    does (the first child is tested first by that rule). A spine read as the tree's kept
    depth would keep more."""
    (chain_kept, _), (tree_kept, tree_spine) = _first_rounds(
        SamplingParams(1.0), [PROMPT] * 6000, Tree.full((3, 1)))
    chain = np.bincount(chain_kept, minlength=3) / len(chain_kept)
    spine = np.bincount(tree_spine, minlength=3) / len(tree_spine)
    kept = np.bincount(tree_kept, minlength=3) / len(tree_kept)
    np.testing.assert_allclose(spine, chain, atol=0.03)
    assert kept[0] < chain[0] - 0.05  # the tree keeps more: the check can tell them apart


# -- the choice ------------------------------------------------------------------------

T21, T22 = Tree.full((2, 1)), Tree.full((2, 2))


def _policy(tree_seconds: float, chain=lambda k: 1.0 + 0.02 * k):
    rounds = {k: chain(k) for k in KS}
    rounds.update({"2x1": tree_seconds, "2x2": tree_seconds})
    policy = KPolicy(CostCurve(4, rounds), KS, (T21, T22))
    return policy


def _counts(gain: float, spine_tokens: float = 800.0):
    """Chains kept position 1 at 0.6, deeper at 0.6 (of 400, 240, ... tested); the 2x1
    tree's rounds emitted `gain` times the tokens their spines would have."""
    depth = (np.array([240.0, 140, 80, 40]), np.array([400.0, 240, 140, 80]))
    return depth, {"2x1": (gain * spine_tokens, spine_tokens), "2x2": (0.0, 0.0)}


def _rows():
    return np.array([60.0, 58.0]), np.array([100.0, 100.0])


def test_untried_trees_run_once_each_then_the_rates_decide():
    """A fresh policy runs each tree one chunk where drafting pays (explore), then chooses
    by the width gain: no gain observed, the chain wins."""
    policy = _policy(1.04)
    depth, trees = _counts(1.0)  # width 2 no better than one child
    first = [policy.shapes[policy(*_rows(), depth, trees)] for _ in range(3)]
    assert first[:2] == [T21, T22] and isinstance(first[2], int) and first[2] > 0
    assert list(policy.chosen)[:2] == ["2x1", "2x2"]


def test_a_tree_that_could_not_beat_the_chains_is_not_explored():
    """A tree whose rounds, with every row keeping its whole depth each round, would still
    be slower than the best chain (its `_ceiling`) never runs; one that could win runs its
    exploring chunk. (At batch 32 a tree round cost 4-6 plain rounds and its one chunk ~7%
    of a run.) Without the ceiling both trees would explore first."""
    def policy():
        fresh = _policy(1.0)
        _, speeds = fresh._choice(*_rows(), depth, trees)
        best = max(speeds[: len(KS)])  # two rows keeping a depth-2 tree whole: 6 tokens
        fresh.curve.rounds.update({"2x1": 6 / best * 1.02, "2x2": 6 / best * 0.98})
        return fresh

    depth, trees = _counts(1.0)
    ceiling = policy()
    choices = [ceiling.shapes[ceiling(*_rows(), depth, trees)] for _ in range(3)]
    assert T21 not in choices
    assert choices[0] == T22 and all(isinstance(c, int) and c > 0 for c in choices[1:])
    control = policy()
    control._ceiling = lambda tree: np.inf
    assert [control.shapes[control(*_rows(), depth, trees)] for _ in range(2)] == [T21, T22]


def test_a_tree_whose_gain_pays_is_chosen():
    policy = _policy(1.04)
    policy.chunks.update({4, 5})
    depth, trees = _counts(1.5)
    assert policy.shapes[policy(*_rows(), depth, trees)] == T21
    depth, trees = _counts(1.02)
    assert isinstance(policy.shapes[policy(*_rows(), depth, trees)], int)


def test_a_gain_measured_on_few_rounds_is_shrunk_toward_one():
    """The same measured gain of 1.5 on 4 rounds' tokens (shrunk by `gain_weight`) does
    not make the tree win, on 400 rounds' it does."""
    policy = _policy(1.04)
    policy.chunks.update({4, 5})
    depth, few = _counts(1.5, spine_tokens=8.0)
    assert policy.width_gain(T21, few) < 1.15
    assert isinstance(policy.shapes[policy(*_rows(), depth, few)], int)
    depth, many = _counts(1.5)
    assert policy.width_gain(T21, many) > 1.4
    assert policy.shapes[policy(*_rows(), depth, many)] == T21


def test_easy_prompts_do_not_make_a_tree_look_better():
    """The tree explored on easy rows (its spines kept almost everything too) has a gain
    near 1 whatever its own rate: the chains' rates and the tree's gain are what count, not
    the tree's kept rate against the chains' (the bias of rates pooled over the run)."""
    policy = _policy(1.04)
    policy.chunks.update({4, 5})
    depth, _ = _counts(1.0)
    easy = {"2x1": (16 * 2.9, 16 * 2.7), "2x2": (0.0, 0.0)}  # 16 rounds kept ~1.9 of 2 drafts
    assert isinstance(policy.shapes[policy(*_rows(), depth, easy)], int)


def test_a_tree_whose_measured_cost_makes_it_slower_is_not_chosen():
    depth, trees = _counts(1.5)
    dear = _policy(3.0)
    dear.chunks.update({4, 5})
    assert isinstance(dear.shapes[dear(*_rows(), depth, trees)], int)
    cheap = _policy(1.04)
    cheap.chunks.update({4, 5})
    assert cheap.shapes[cheap(*_rows(), depth, trees)] == T21


def test_the_tree_margin_over_the_best_chain():
    """Predicted a little faster than the best chain (under tree_margin): the chain."""
    depth, trees = _counts(1.5)
    policy = _policy(1.04)
    policy.chunks.update({4, 5})
    alpha = np.minimum(policy.rows(*_rows(), pooled=tuple(float(np.sum(c)) for c in depth)), 0.999)
    rates = policy.position_rates(depth)
    tree = policy.tokens_per_second(T21, alpha, rates, trees)
    chain = max(policy.tokens_per_second(k, alpha, rates) for k in KS)
    policy.tree_margin = tree / chain - 1 + 0.01
    assert isinstance(policy.shapes[policy(*_rows(), depth, trees)], int)
    policy.tree_margin = tree / chain - 1 - 0.01
    assert policy.shapes[policy(*_rows(), depth, trees)] == T21


def test_no_tree_where_plain_rounds_win():
    """Drafting dear everywhere: plain rounds, and no tree is explored."""
    policy = _policy(9.0, chain=lambda k: 1.0 + 5 * k)
    depth, trees = _counts(1.5)
    assert policy.shapes[policy(*_rows(), depth, trees)] == 0
    assert policy.explored == {policy.ks.index(0)}  # only plain rounds ran


def test_tree_rounds_are_timed_and_keyed_by_their_shapes(tmp_path, monkeypatch):
    """The cost curve times each tree's own round program (the program with that tree, at
    K = its depth) beside the chains', keys it by the tree's widths, and caches it under a
    key that names the shapes: other trees, or none, are measured afresh."""
    from specsamp.decoding import costs

    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path))
    eng = _tree_auto(make_engine(SamplingParams(0.0), "model", 2), (0, 2), (T21,), None)
    seen = []
    real = costs.shape_program

    def spy(prog, shape):
        prog, k = real(prog, shape)
        seen.append((prog.tree, k))
        return prog, k

    monkeypatch.setattr(costs, "shape_program", spy)
    curve = costs.cost_curve(eng, 2, slots=128, width=16, repeats=1)
    assert sorted(curve.rounds, key=str) == [0, 2, "2x1"] and all(s > 0 for s in curve.rounds.values())
    assert seen == [(None, 0), (None, 2), (T21, 2)]
    assert costs.cost_curve(eng, 2, slots=128, width=16) == curve  # read back, "2x1" a str key
    assert len(seen) == 3

    def no_timing(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(costs, "time_rounds", no_timing)
    for trees in ((), (Tree.full((3, 1)),)):
        with pytest.raises(AssertionError, match="measured again"):
            costs.cost_curve(_tree_auto(eng, (0, 2), trees, None), 2, slots=128, width=16)


# -- chains and trees on one state -----------------------------------------------------

class _Shapes:
    """A policy that walks through the engine's shapes in turn (chains, trees, plain), or
    through the indices `order` over and over."""

    def __init__(self, n, order=None):
        self.order, self.i, self.seen = list(order or range(n)), -1, []

    def __call__(self, accepted, tested, depth, tree_tokens=None):
        assert np.all(accepted <= tested) and tree_tokens is not None
        assert all(kept >= spine for kept, spine in tree_tokens.values())
        self.i = (self.i + 1) % len(self.order)
        self.seen.append(self.order[self.i])
        return self.order[self.i]


def test_a_chain_after_a_tree_finds_the_draft_cache_in_place():
    """After tree rounds the draft model's cache holds, at every position before the
    current one, what feeding the row's tokens in one pass writes (a chain's pair refresh
    rewrites only the last two). Catches a tree round that leaves the accepted path's
    draft entries at the slots of its block."""
    import jax.numpy as jnp

    sp = SamplingParams(0.0)
    eng = make_engine(sp, "model", 3, max_new=24)
    tree = Tree.full((2, 1, 1))
    tree_eng = _tree_auto(eng, (0, 3), (tree,), None)
    prompts = _distinct_prompts(4, 7)
    width = 64
    state = tree_eng.empty(tree_eng.prog, 4, tree_eng.slots_for(prompts))
    padded = np.zeros((4, width), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    state, _ = tree_eng.insert(tree_eng.prog, state, padded, lens, np.arange(4, dtype=np.uint32),
                               np.arange(4, dtype=np.int32), 2)
    tree_prog = dataclasses.replace(tree_eng.prog, tree=tree)
    never = jnp.asarray(np.array([-1], np.int32))
    state, _, _ = tree_eng.generate(tree_prog, 3, state, never, never, max_rounds=8, refill_at=5)
    accepted = np.asarray(state.round_accepted)[:, :8]
    assert (accepted >= 2).sum() > 3  # paths past a depth-2 node (at another slot) were kept
    got = [np.asarray(a) for a in (state.draft.k, state.draft.v)]
    t = np.asarray(state.current)
    fresh, _ = tree_eng.resync(tree_eng.prog, state, state.tokens.shape[1])
    want = [np.asarray(a) for a in (fresh.draft.k, fresh.draft.v)]
    for g, w in zip(got, want):
        for b in range(4):  # [L, B, J, S, E]: every slot before the current one
            np.testing.assert_allclose(g[:, b, :, : t[b] - 1], w[:, b, :, : t[b] - 1], atol=1e-4)


DRAFT_SHAPES = [  # (drafter, trees): n-gram lookup (and a hybrid) drafts trees of branches only
    ("model", AUTO_TREES),
    ("feature", (Tree.full((2, 1)), Tree.full((2, 2)))),
    ("ngram", (Tree.full((2, 1)), Tree.full((3, 1)))),
    ("hybrid", (Tree.full((2, 1)), Tree.full((2, 1, 1)))),  # lookup rows and draft rows mixed
    ("hybrid-wide", (Tree.full((3, 1)), Tree.full((2, 1, 1)))),  # wide lookup rounds in K = 1 chunks
]


@pytest.mark.parametrize("drafter,trees", DRAFT_SHAPES)
def test_switching_chains_and_trees_keeps_greedy_output(drafter, trees):
    """Chunks walk through plain rounds, chains of 1 and 3 and the trees, over 3 slots
    (refills, moves into fewer slots), on distinct prompts: greedy tokens equal the
    autoregressive engine's row for row, and every shape ran. Catches a shape switch that
    corrupts the state, a stale draft cache or features, a wrong accepted path."""
    sp = SamplingParams(0.0)
    prompts, seeds = _distinct_prompts(7, 11), list(range(7))
    ar = _eos_engine(sp, "none", 1, max_new=20).run(prompts, seeds)
    policy = _Shapes(3 + len(trees))
    eng = _tree_auto(_eos_engine(sp, drafter, 3, max_new=20), (0, 1, 3), trees, policy)
    got = eng.run(prompts, seeds, batching=Continuous(3, chunk_rounds=2))
    want = [r.token_ids for r in ar]
    assert len(set(want)) > 3
    assert [r.token_ids for r in got] == want
    assert set(eng.k_rounds) == {0, 1, 3} | {"x".join(map(str, tree_widths(t))) for t in trees}
    assert {d for r in got for d in r.drafted} >= {t.size for t in trees}
    if drafter == "hybrid-wide":  # 3 lookup tokens scored: only wide rounds (trees score 6)
        assert 3 in {d for r in got for d in r.drafted}
    for key, (kept, spine) in eng.tree_tokens.items():  # the trees' tokens, and their spines'
        assert kept >= spine > 0, key
    if drafter in ("model", "feature"):  # every round drafts: somewhere a later child was kept
        assert sum(k - s for k, s in eng.tree_tokens.values()) > 0


def test_n_gram_tree_auto_shapes_are_branches():
    sp = SamplingParams(0.0)
    ngram, _ = tiny.drafter("ngram", 3, sp)
    assert trees_for(ngram, AUTO_TREES) == tuple(parse_tree(w) for w in ("2x1", "2x1x1", "3x1"))
    hybrid, _ = tiny.drafter("ngram+tiny-feature-reduced", 3, sp)
    assert trees_for(hybrid, AUTO_TREES) == trees_for(ngram, AUTO_TREES)


def test_generator_spec_tree_auto(tmp_path):
    """`GeneratorSpec(tree='auto')`: k auto with the trees (whatever k says), a hybrid's
    too; no drafter is one UserError."""
    from specsamp.decoding.config import TREE_AUTO
    from specsamp.decoding.generator import GeneratorSpec

    spec = GeneratorSpec(draft="ngram", k=2, tree="auto")
    assert (spec.k, spec.draft_k, spec.draft_tree, spec.continuous) == ("auto", TREE_AUTO, None, True)
    with pytest.raises(UserError, match="needs a drafter"):
        GeneratorSpec(draft="none", tree="auto")
    (tmp_path / "feature").mkdir()
    spec = GeneratorSpec(draft=f"ngram+{tmp_path / 'feature'}", tree="auto")
    assert (spec.k, spec.draft_k) == ("auto", TREE_AUTO)


# -- sampling --------------------------------------------------------------------------

def _switching_counts(trees, n: int = 12000):
    """Counts of the first three tokens, shapes switched every round, the two trees on
    most rounds (a width of 4 or more, for the control to show)."""
    sp = SamplingParams(1.0)
    policy = _Shapes(5, order=[3, 0, 4, 3, 1, 4, 3, 2])
    eng = _tree_auto(make_engine(sp, "model", 3, max_new=N_TOKENS), (0, 1, 3), trees, policy)
    counts = np.zeros((tiny.TARGET.vocab_size,) * N_TOKENS)
    for r in eng.run([PROMPT] * n, list(range(n)), batching=Continuous(64, chunk_rounds=1)):
        counts[tuple(r.token_ids[:N_TOKENS])] += 1
    assert set(eng.k_rounds) == {0, 1, 3} | {"x".join(map(str, tree_widths(t))) for t in trees}
    return counts, sp


@pytest.mark.slow
def test_switching_chains_and_trees_samples_exactly():
    """Shapes switched every round (chains, trees, plain) under sampling, a draft model
    whose cache must survive every switch: the joint law of the first three tokens is the
    target's (chi-square)."""
    counts, sp = _switching_counts((Tree.full((4, 1)), Tree.full((2, 2))))
    assert chi_square_pvalue(counts, exact_joint(sp)) > ALPHA


@pytest.mark.slow
def test_the_switching_check_fails_children_misdescribed(monkeypatch):
    """The control: the same run with top-w children tested as if drawn (DISTINCT) is not
    exact, and the chi-square above rejects it."""
    from tests.test_tree_loop import _top_w

    monkeypatch.setattr(tree_draft, "_choose", _top_w)
    # shapes only this test compiles (a compiled program keeps the `_choose` it was traced with)
    counts, sp = _switching_counts((Tree.full((5, 1)), Tree.full((3, 2))))
    assert chi_square_pvalue(counts, exact_joint(sp)) < ALPHA


# -- the command line ------------------------------------------------------------------

TREE_AUTO_CLI_CASES = [
    (["generate", "--prompt", "hi", "--tree", "auto", "--draft", "none"], "--tree auto needs a drafter"),
    (["bench", "--tree", "auto"], "--tree auto needs --throughput"),
    (["bench", "--throughput", "--tree", "auto,2x1"], "takes only 'auto'"),
]


@pytest.mark.parametrize("args,message", TREE_AUTO_CLI_CASES)
def test_bad_tree_auto_arguments_are_one_line(args, message, tmp_path):
    from tests.test_cli import test_bad_arguments_are_one_line

    test_bad_arguments_are_one_line(args, message, tmp_path)


@pytest.mark.slow
def test_generate_with_tree_auto_on_a_tiny_checkpoint(tmp_path):
    """`generate --tree auto`: k auto (-1) and tree 'auto' as in the tables, and the summary
    names the shapes that ran (the policy explores each tree once where drafting pays)."""
    import json

    from specsamp.testing import make_tiny_checkpoint
    from tests.test_cli import _cli

    target = make_tiny_checkpoint(str(tmp_path / "target"), n_layers=2)
    args = ["generate", "--prompt", "the quick", "--target", target, "--max-new-tokens", "12",
            "--draft", "early-exit:1", "--tree", "auto"]
    text = _cli(args, tmp_path)  # measures the cost curve, then reads it from disk below
    assert text.returncode == 0 and "tree auto (rounds by shape, a K or a tree: " in text.stderr, text.stderr
    assert "trees' tokens over their spines': " in text.stderr
    obj = json.loads(_cli(args + ["--json"], tmp_path).stdout)
    assert obj["tree"] == "auto" and obj["k"] == -1


def test_width_gains_of_the_trees_that_ran():
    assert width_gains({"2x1": (30.0, 24.0), "3x1": (0.0, 0.0)}) == {"2x1": 1.25}


def test_rounds_by_shape_orders_chains_then_trees():
    """A tree-auto engine counts rounds under int K and tree names together: the bench's
    row sorts them without comparing an int to a str (a crash once a tree ran)."""
    import collections

    from specsamp.analysis.throughput import rounds_by_shape

    counts = collections.Counter({"2x1": 3, 4: 1, 0: 2, "2x1x1": 1, 2: 5})
    assert list(rounds_by_shape(counts).items()) == [
        ("0", 2), ("2", 5), ("4", 1), ("2x1", 3), ("2x1x1", 1)]
    counts.update({1: 0, "3x1": 0})  # shapes the policy could pick that never ran
    assert list(rounds_by_shape(counts, ran_only=True)) == ["0", "2", "4", "2x1", "2x1x1"]
    assert len(rounds_by_shape(counts)) == 7


@pytest.mark.slow
def test_bench_throughput_with_tree_auto_on_a_tiny_checkpoint(tmp_path):
    """`bench --throughput --tree auto` adds a setting of K `tree-auto` (the generator that
    `--tree auto` builds: n-gram lookup, so trees of branches) beside the K values asked
    for, with its rounds per shape; it generates what the baseline does (greedy)."""
    import json

    from specsamp.testing import make_tiny_checkpoint
    from tests.test_cli import _cli

    target = make_tiny_checkpoint(str(tmp_path / "target"), n_layers=2)
    out = _cli(["bench", "--throughput", "--tree", "auto", "--k", "2", "--batch-size", "2",
                "--batching", "continuous", "--target", target, "--draft", "ngram", "--prompt",
                "one two one two one", "--prompt", "the quick brown fox", "--max-new-tokens", "12",
                "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    rows = {r["k"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == {0, 2, "tree-auto"}
    tree = rows["tree-auto"]
    assert tree["generated_tokens"] == rows[0]["generated_tokens"]
    assert sum(tree["k_rounds"].values()) == tree["rounds"] > 0
    assert set(tree["k_rounds"]) <= {str(k) for k in TREE_AUTO.ks} | {"2x1", "2x1x1", "3x1"}
    gains = tree["tree_gain"]  # each tree that ran a drafted round: its tokens over its spines'
    assert set(gains) <= {k for k in tree["k_rounds"] if "x" in k} and all(g >= 1.0 for g in gains.values())
    assert "tree_gain" not in rows[2]
