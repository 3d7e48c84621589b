"""Token trees through the compiled loop (`Program.tree`, `decode.tree_round`) on the tiny
models: greedy output equals greedy autoregressive decoding token for token; sampled
output follows the target's joint distribution of the first three tokens (the chi-square
of tests/test_exactness.py, its constants); a control that misstates how the children
were chosen fails that check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding import tree_draft
from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import Program
from specsamp.decoding.engine import Engine
from specsamp.decoding.lookup import HybridDrafter
from specsamp.decoding.tree import DynamicTree, Tree
from specsamp.errors import UserError
from tests import tiny
from tests.test_exactness import ALPHA, PROMPT, chi_square_pvalue, exact_joint, make_engine, sample_counts

PROMPTS = [PROMPT, [5, 4], [7], [3, 3, 3, 3, 3, 3, 1]]


def tree_engine(sp, draft: str, tree: Tree, max_new: int = 3, native: bool | None = None):
    """An engine on the tiny target drafting `tree` with `draft` (a draft string);
    native=False: XLA's attention and argmax throughout (None: the program decides)."""
    drafter, params = tiny.drafter(draft, tree.max_depth, sp)
    if native is not None:
        drafter = drafter.with_native(native)
    prog = Program(tiny.TARGET, sp, drafter, "float32", native=native, tree=tree)
    return Engine(prog, tiny.target_params(), params, eos_ids=(), max_new_tokens=max_new)


GREEDY_CASES = [  # (draft, tree, native): a chain, a width-3 root, a full binary tree
    ("tiny-draft", Tree.chain(3), None),
    ("tiny-draft", Tree.full((3, 1, 1)), None),
    ("tiny-draft", Tree.full((2, 2)), None),
    ("early-exit:1", Tree.full((3, 1, 1)), None),
    ("early-exit:1", Tree.full((1, 3)), None),
    ("tiny-draft", Tree.full((3, 1, 1)), False),
    ("tiny-feature", Tree.full((3, 1, 1)), None),
    ("tiny-feature-reduced", Tree.full((2, 2)), None),
    ("tiny-feature", Tree.chain(2), False),
    ("ngram", Tree.full((3, 1, 1)), None),
    ("ngram:2", Tree.full((2, 1, 1, 1)), False),
    # a hybrid: lookup's branches on rows with a match, the feature draft's tree elsewhere
    ("ngram+tiny-feature-reduced", Tree.full((2, 1, 1)), None),
    ("ngram+tiny-feature", Tree.full((3, 1)), False),
    # trees that are not full (`--tree 1-2-11-111`): a spine with a sibling at depth 1
    ("tiny-feature", Tree.from_paths([(1,), (2,), (1, 1), (1, 1, 1)]), None),
    ("ngram+tiny-feature", Tree.from_paths([(1,), (2,), (1, 1), (1, 1, 1)]), None),
    ("tiny-draft", Tree.from_paths([(1,), (2,), (1, 1), (1, 2), (1, 1, 1)]), False),
    # dynamic trees (`--tree N`): each row its own N nodes of the candidates
    ("tiny-feature", DynamicTree.of(3), None),
    ("tiny-feature-reduced", DynamicTree.of(6), None),
    ("tiny-draft", DynamicTree.of(4), False),
    ("ngram+tiny-feature", DynamicTree.of(4), None),
    ("tiny-feature-reduced", DynamicTree.of(12), None),  # a 9-deep spine (`spine_length`)
]


@pytest.mark.parametrize("draft,tree,native", GREEDY_CASES)
def test_greedy_tree_equals_greedy_autoregressive(draft, tree, native):
    """Catches a wrong accepted path, a cache not moved to slot = position after a branch
    was kept (`keep_path`), a draft cache left stale, a wrong bonus token."""
    sp = SamplingParams(0.0)
    ar = make_engine(sp, "none", 1, max_new=24).run(PROMPTS, [0, 1, 2, 3])
    got = tree_engine(sp, draft, tree, max_new=24, native=native).run(PROMPTS, [0, 1, 2, 3])
    for a, s in zip(ar, got):
        assert s.token_ids == a.token_ids
        # drafted = the nodes scored; accepted = the depth kept, at most the tree's depth
        assert set(s.drafted) == {tree.size}
        assert all(0 <= n <= tree.max_depth for n in s.accepted)
        assert 0 <= sum(s.accepted) + s.calls - 24 <= tree.max_depth
    if tree.size > tree.max_depth:  # a branch other than the first was kept somewhere
        assert sum(sum(s.accepted) for s in got) > 0


SAMPLED_CASES = [  # (draft, tree, temperature, top_k, top_p)
    ("tiny-draft", Tree.full((3, 1)), 1.0, 0, 1.0),
    ("early-exit:1", Tree.full((2, 2)), 0.7, 0, 0.9),
    ("tiny-feature", Tree.full((3, 1)), 1.0, 0, 1.0),
    ("tiny-feature-reduced", Tree.full((2, 2)), 0.7, 0, 0.9),
    ("ngram", Tree.full((3, 1)), 1.0, 0, 1.0),
    ("ngram", Tree.full((2, 1, 1)), 0.7, 0, 0.9),
    ("ngram+tiny-feature-reduced", Tree.full((2, 1)), 1.0, 0, 1.0),
    ("ngram+tiny-feature", Tree.full((3, 1, 1)), 0.7, 0, 0.9),
    ("tiny-feature", Tree.from_paths([(1,), (2,), (1, 1)]), 1.0, 0, 1.0),
    ("ngram+tiny-feature-reduced", Tree.from_paths([(1,), (2,), (1, 1), (1, 1, 1)]), 0.7, 0, 0.9),
    ("tiny-feature", DynamicTree.of(3), 1.0, 0, 1.0),
    ("ngram+tiny-feature-reduced", DynamicTree.of(4), 0.7, 0, 0.9),
    ("tiny-draft", DynamicTree.of(6), 1.0, 5, 1.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("draft,tree,temperature,top_k,top_p", SAMPLED_CASES)
def test_tree_joint_distribution_of_three_tokens_matches_target(draft, tree, temperature, top_k, top_p):
    sp = SamplingParams(temperature, top_k, top_p)
    counts, acceptance = sample_counts(tree_engine(sp, draft, tree))
    assert chi_square_pvalue(counts, exact_joint(sp)) > ALPHA
    assert 0.0 < acceptance < 1.0  # both branches of the rule were exercised


_CHOOSE = tree_draft._choose


def _top_w(logits, sampling, keys, width, scored=False):
    """The control's children: the draft's top-w tokens (deterministic), with the
    sampled distribution, while the drafter still says DISTINCT draws."""
    tokens, _, _ = _CHOOSE(logits, SamplingParams(0.0), keys, width)
    return tokens, _CHOOSE(logits, sampling, keys, width)[1], None


@pytest.mark.slow
def test_the_tree_check_fails_children_misdescribed(monkeypatch):
    """Top-w children (FIXED) tested as if they were DISTINCT draws are not exact: the
    chi-square above must reject them (it has power against a wrong rule)."""
    monkeypatch.setattr(tree_draft, "_choose", _top_w)
    sp = SamplingParams(1.0)
    counts, _ = sample_counts(tree_engine(sp, "tiny-draft", Tree.full((4,))))  # a shape only this test compiles
    assert chi_square_pvalue(counts, exact_joint(sp)) < ALPHA


@pytest.mark.slow
def test_the_tree_check_fails_a_dynamic_tree_chosen_by_its_draws(monkeypatch, request):
    """A sampled dynamic tree whose rows choose their drawn nodes by the nodes' own
    probabilities (EAGLE-2's path probability, exact only for children taken, not drawn):
    likely draws are kept more often than drawn, and the chi-square rejects it."""
    from specsamp.compilation import forget_executables
    from specsamp.decoding.tree import path_log_probs

    forget_executables()
    request.addfinalizer(forget_executables)
    monkeypatch.setattr(tree_draft, "_drawn_scores", lambda tree, logp, slot: path_log_probs(tree, logp))
    sp = SamplingParams(1.0)
    counts, _ = sample_counts(tree_engine(sp, "tiny-feature", DynamicTree.of(2)))
    assert chi_square_pvalue(counts, exact_joint(sp)) < ALPHA


_HYBRID_TREE = HybridDrafter.propose_tree


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["lookup rows as draws", "rows swapped"])
def test_the_tree_check_fails_a_hybrid_rows_rule_misstated(monkeypatch, request, fault):
    """A hybrid tree's rows follow two rules: lookup rows FIXED, the model's rows its draws
    (`TreeProposal.fixed_rows`). Judging the lookup rows as the model's draws (the field
    dropped) or each row by the other's rule is not exact: the chi-square rejects both.
    The program is the sampled 2x1 case's above: the process's compiled programs are
    dropped before (so that the patched drafter is traced) and after (so that no later
    test runs the patched one)."""
    from specsamp.compilation import forget_executables

    forget_executables()
    request.addfinalizer(forget_executables)

    def misstated(self, *args):
        proposal = _HYBRID_TREE(self, *args)
        rows = None if fault == "lookup rows as draws" else ~proposal.fixed_rows
        return proposal._replace(fixed_rows=rows)

    monkeypatch.setattr(HybridDrafter, "propose_tree", misstated)
    sp = SamplingParams(1.0)
    counts, _ = sample_counts(tree_engine(sp, "ngram+tiny-feature-reduced", Tree.full((2, 1))))
    assert chi_square_pvalue(counts, exact_joint(sp)) < ALPHA


def test_trees_need_a_tree_drafter_and_level_order():
    sp = SamplingParams(0.0)
    with pytest.raises(UserError, match="drafts trees"):
        Program(tiny.TARGET, sp, None, tree=Tree.full((2, 1)))
    drafter, _ = tiny.drafter("ngram+tiny-feature-reduced", 2, sp)
    with pytest.raises(UserError, match="trees of branches"):
        Program(tiny.TARGET, sp, drafter, tree=Tree.full((2, 2)))
    assert Program(tiny.TARGET, sp, drafter, tree=Tree.full((3, 1))).k == 2
    drafter, _ = tiny.drafter("ngram", 2, sp)
    with pytest.raises(UserError, match="trees of branches"):
        Program(tiny.TARGET, sp, drafter, tree=Tree.full((2, 2)))
    drafter, _ = tiny.drafter("tiny-draft", 2, sp)
    with pytest.raises(UserError, match="level by level"):
        Program(tiny.TARGET, sp, drafter, tree=Tree((-1, 0, -1)))
    assert Program(tiny.TARGET, sp, drafter, tree=Tree.full((2, 1, 1))).k == 3
    assert np.all(np.diff(Tree.full((3, 2)).depth) >= 0)


CLI_CASES = [
    (["generate", "--prompt", "hi", "--tree", "3x0"], "tree must be 'off' or widths per depth"),
    (["generate", "--prompt", "hi", "--tree", "3x1", "--k", "auto"], "--tree and --k auto"),
    (["generate", "--prompt", "hi", "--tree", "2x2", "--draft", "none"], "a token tree needs a drafter"),
    (["generate", "--prompt", "hi", "--tree", "4x4x4x4"], "at most 64"),
    (["bench", "--tree", "2x2,3xq"], "tree must be 'off' or widths per depth"),
    (["generate", "--prompt", "hi", "--tree", "1-3"], "its sibling (2,) is not in the tree"),
    (["generate", "--prompt", "hi", "--tree", "1-2-11-12", "--draft", "ngram"], "trees of branches"),
    (["bench", "--throughput", "--tree", "2x2"], "--tree is for the latency bench"),
    (["generate", "--prompt", "hi", "--tree", "0"], "a dynamic tree (--tree N) has 1 to 32 nodes"),
    (["generate", "--prompt", "hi", "--tree", "dyn40"], "a dynamic tree (--tree N) has 1 to 32 nodes"),
    (["generate", "--prompt", "hi", "--tree", "4", "--draft", "ngram"], "needs a draft model"),
]


@pytest.mark.parametrize("args,message", CLI_CASES)
def test_bad_tree_arguments_are_one_line(args, message, tmp_path):
    from tests.test_cli import test_bad_arguments_are_one_line

    test_bad_arguments_are_one_line(args, message, tmp_path)


@pytest.mark.slow  # two CLI processes; the tree's exactness is checked in-process above
def test_generate_with_a_tree_on_a_tiny_checkpoint(tmp_path):
    """`generate --tree` runs the tree round and reports it (drafted = nodes scored per
    round, accepted = depth kept); a shape the drafter cannot draft is one error line."""
    import json

    from specsamp.testing import make_tiny_checkpoint
    from tests.test_cli import _cli

    target = make_tiny_checkpoint(str(tmp_path / "target"), n_layers=2)
    args = ["generate", "--prompt", "the quick", "--target", target, "--max-new-tokens", "8"]
    out = _cli(args + ["--draft", "early-exit:1", "--tree", "2x1", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["tree"] == "2x1" and obj["k"] == 2
    assert set(obj["drafted_per_loop"]) == {4} and all(0 <= n <= 2 for n in obj["accepted_per_loop"])
    assert obj["draft_calls"] == 2 * obj["target_calls"]
    bad = _cli(args + ["--draft", "ngram", "--tree", "2x2"], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "trees of branches" in bad.stderr


def test_top_children_are_lax_top_k():
    """Catches a child choice other than lax.top_k's (the reference the passes replace):
    the order of the children, the first index among equal values, and distinct indices
    when fewer than `width` values are finite (Gumbel scores of zero-probability tokens)."""
    from specsamp.decoding.tree_draft import _top

    x = jax.random.normal(jax.random.PRNGKey(3), (2, 3, 500))
    x = x.at[0, 0, 9].set(x[0, 0].max()).at[0, 0, 4].set(x[0, 0].max())  # a tie at the top
    x = x.at[1, 2].set(-jnp.inf).at[1, 2, 7].set(0.5)  # one finite value
    for width in (1, 2, 3):
        np.testing.assert_array_equal(np.asarray(_top(x, width)), np.asarray(jax.lax.top_k(x, width)[1]))
