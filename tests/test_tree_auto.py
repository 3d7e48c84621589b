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

from specsamp.decoding import tree_draft
from specsamp.decoding.config import AUTO_TREES, KChoice, SamplingParams, parse_tree, trees_for
from specsamp.decoding.costs import CostCurve
from specsamp.decoding.engine import Continuous, Engine
from specsamp.decoding.kpolicy import (
    KPolicy, branch_counts, branch_rates, expected_tree_tokens,
)
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

def _walk_law(widths, q, p):
    """Per depth d: the target's token law q[d] and the draft's p[d] (its children at a
    node: the w most likely under p[d]). Returns s[d] = P(the target's token is a child)."""
    return [float(q[d][np.argsort(-p[d], kind="stable")[:w]].sum()) for d, w in enumerate(widths)]


@pytest.mark.parametrize("widths", [(2, 1), (2, 2), (3, 1, 1)])
def test_expected_tree_tokens_matches_enumeration_and_simulation(widths):
    """1 + sum_j prod_{d<=j} s_d(w_d) equals the mean tokens of a tree round enumerated
    over every target token sequence; and the rates estimated from simulated rounds'
    `branch_counts` give the simulation's mean tokens."""
    rng = np.random.default_rng(0)
    v, depth = 4, len(widths)
    q = rng.dirichlet(np.ones(v), depth)
    p = rng.dirichlet(np.ones(v), depth)
    children = [set(np.argsort(-p[d], kind="stable")[:w]) for d, w in enumerate(widths)]

    def kept(seq):  # the accepted depth when the target's tokens are seq
        return next((d for d, x in enumerate(seq) if x not in children[d]), depth)

    exact = sum(np.prod([q[d][x] for d, x in enumerate(seq)]) * (1 + kept(seq))
                for seq in itertools.product(range(v), repeat=depth))
    s = _walk_law(widths, q, p)
    rates = np.zeros((depth, max(widths)))
    for d, w in enumerate(widths):
        rates[d, w - 1] = s[d]
    assert expected_tree_tokens(1.0, rates, widths) == pytest.approx(exact, abs=1e-9)

    n = 40000
    loops = [kept([rng.choice(v, p=q[d]) for d in range(depth)]) for _ in range(n)]
    acc, tst = branch_counts(loops, widths, (depth, max(widths)))
    estimate = expected_tree_tokens(1.0, branch_rates(acc, tst, weight=1.0), widths)
    assert estimate == pytest.approx(1 + np.mean(loops), abs=0.02)
    assert estimate == pytest.approx(exact, abs=0.03)


def test_branch_rates_start_wide_sets_at_one_child():
    """A (depth, width) no round tested counts as the width-1 rate at its depth."""
    acc = np.array([[30.0, 0.0], [10.0, 0.0]])
    tst = np.array([[40.0, 0.0], [20.0, 0.0]])
    rate = branch_rates(acc, tst, 16.0)
    np.testing.assert_allclose(rate[:, 1], rate[:, 0])
    acc[0, 1], tst[0, 1] = 95.0, 100.0
    assert branch_rates(acc, tst, 16.0)[0, 1] > rate[0, 0] + 0.1


# -- the choice ------------------------------------------------------------------------

T21, T22 = Tree.full((2, 1)), Tree.full((2, 2))


def _policy(tree_seconds: float, chain=lambda k: 1.0 + 0.02 * k):
    rounds = {k: chain(k) for k in KS}
    rounds.update({"2x1": tree_seconds, "2x2": tree_seconds})
    policy = KPolicy(CostCurve(4, rounds), KS, (T21, T22))
    return policy


def _counts(first_width2: float):
    """Chains kept position 1 at 0.6, deeper at 0.6; width 2 at depth 1 kept at
    `first_width2`, from 400 tested each."""
    depth = (np.array([240.0, 140, 80, 40]), np.array([400.0, 240, 140, 80]))
    acc, tst = np.zeros((4, 2)), np.zeros((4, 2))
    acc[0, 1], tst[0, 1] = 400 * first_width2, 400.0
    return depth, (acc, tst)


def _rows():
    return np.array([60.0, 58.0]), np.array([100.0, 100.0])


def test_untried_trees_run_once_each_then_the_rates_decide():
    """A fresh policy runs each tree one chunk where drafting pays (explore), then chooses
    by rates: equal to one child (no gain observed) the chain wins."""
    policy = _policy(1.04)
    depth, branches = _counts(0.6)  # width 2 no better than one child
    first = [policy.shapes[policy(*_rows(), depth, branches)] for _ in range(3)]
    assert first[:2] == [T21, T22] and isinstance(first[2], int) and first[2] > 0
    assert policy.chosen[:2] == ["2x1", "2x2"]


def test_a_tree_whose_rates_pay_is_chosen():
    policy = _policy(1.04)
    policy.explored.update({4, 5})
    depth, branches = _counts(0.95)
    assert policy.shapes[policy(*_rows(), depth, branches)] == T21
    depth, branches = _counts(0.6)
    assert isinstance(policy.shapes[policy(*_rows(), depth, branches)], int)


def test_a_tree_whose_measured_cost_makes_it_slower_is_not_chosen():
    depth, branches = _counts(0.95)
    dear = _policy(3.0)
    dear.explored.update({4, 5})
    assert isinstance(dear.shapes[dear(*_rows(), depth, branches)], int)
    cheap = _policy(1.04)
    cheap.explored.update({4, 5})
    assert cheap.shapes[cheap(*_rows(), depth, branches)] == T21


def test_the_tree_margin_over_the_best_chain():
    """Predicted a little faster than the best chain (under tree_margin): the chain."""
    depth, branches = _counts(0.95)
    policy = _policy(1.04)
    policy.explored.update({4, 5})
    alpha = np.minimum(policy.alphas(*_rows()), 0.999)
    rates = policy.tree_rates(depth, branches)
    tree = policy.tokens_per_second(T21, alpha, rates)
    chain = max(policy.tokens_per_second(k, alpha, rates) for k in KS)
    policy.tree_margin = tree / chain - 1 + 0.01
    assert isinstance(policy.shapes[policy(*_rows(), depth, branches)], int)
    policy.tree_margin = tree / chain - 1 - 0.01
    assert policy.shapes[policy(*_rows(), depth, branches)] == T21


def test_no_tree_where_plain_rounds_win():
    """Drafting dear everywhere: plain rounds, and no tree is explored."""
    policy = _policy(9.0, chain=lambda k: 1.0 + 5 * k)
    depth, branches = _counts(0.95)
    assert policy.shapes[policy(*_rows(), depth, branches)] == 0
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

    def __call__(self, accepted, tested, depth, branches=None):
        assert np.all(accepted <= tested) and branches is not None
        kept, tried = branches
        assert np.all(kept <= tried)
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
    kept, tried = eng.branches
    assert tried.sum() > 0 and np.all(kept <= tried)


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


_CHOOSE = tree_draft._choose


@pytest.mark.slow
def test_the_switching_check_fails_children_misdescribed(monkeypatch):
    """The control: the same run with top-w children tested as if drawn (DISTINCT) is not
    exact, and the chi-square above rejects it."""
    def top_w(logits, sampling, keys, width):
        tokens, _ = _CHOOSE(logits, SamplingParams(0.0), keys, width)
        return tokens, _CHOOSE(logits, sampling, keys, width)[1]

    monkeypatch.setattr(tree_draft, "_choose", top_w)
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
    obj = json.loads(_cli(args + ["--json"], tmp_path).stdout)
    assert obj["tree"] == "auto" and obj["k"] == -1


def test_rounds_by_shape_orders_chains_then_trees():
    """A tree-auto engine counts rounds under int K and tree names together: the bench's
    row sorts them without comparing an int to a str (a crash once a tree ran)."""
    import collections

    from specsamp.analysis.throughput import rounds_by_shape

    counts = collections.Counter({"2x1": 3, 4: 1, 0: 2, "2x1x1": 1, 2: 5})
    assert list(rounds_by_shape(counts).items()) == [
        ("0", 2), ("2", 5), ("4", 1), ("2x1", 3), ("2x1x1", 1)]


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
    assert set(tree["k_rounds"]) <= {"0", "1", "2", "4", "2x1", "2x1x1", "3x1"}
