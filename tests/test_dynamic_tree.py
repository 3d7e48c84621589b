"""Dynamic token trees (`tree.DynamicTree`, `--tree N`): each row's N nodes are the
candidates its draft scores likeliest (`tree.select_nodes`), checked against a plain
Python reference; the draft's choices on a reduced head against the full vocabulary's
(`tree_draft._choose`). Exactness through the loop: tests/test_tree_loop.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding.config import SamplingParams, parse_tree, tree_text
from specsamp.decoding.tree import DynamicTree, Tree, path_log_probs, select_nodes
from specsamp.decoding.tree_draft import Reduced, _choose
from specsamp.errors import UserError


def _reference(cand: Tree, tokens, score, n):
    """The chosen candidates and their tree, by hand: present nodes by score (less 1e-4
    per depth), best first, the first index on ties; numbered as among the candidates."""
    key = [score[i] - 1e-4 * cand.depth[i] if tokens[i] >= 0 else -np.inf for i in range(cand.size)]
    order = sorted(range(cand.size), key=lambda i: (-key[i], i))[:n]
    sel = sorted(order)
    assert all(key[i] > -np.inf for i in sel)  # the cases below have N present nodes
    parents = tuple(sel.index(cand.parents[i]) if cand.parents[i] >= 0 else -1 for i in sel)
    return sel, Tree(parents)


@pytest.mark.parametrize("nodes", [1, 3, 4, 6, 9])
def test_select_nodes_matches_a_reference(nodes):
    """Catches a node chosen without its parent, parents numbered by the candidates'
    indices instead of the chosen ones', wrong depths, paths, children order or spine:
    every table of each row's tree against `Tree`'s tables of the reference's parents."""
    dyn = DynamicTree.of(nodes)
    cand = dyn.candidates
    rng = np.random.default_rng(nodes)
    b = 16
    logp = np.log(rng.dirichlet(np.ones(3), size=(b, cand.size))[..., 0]).astype(np.float32)
    logp[0] = 0.0  # probability 1 everywhere: ties broken toward the shallower node
    tokens = rng.integers(0, 50, (b, cand.size)).astype(np.int32)
    tokens[1, cand.size - 1] = -1  # an absent leaf
    score = np.asarray(path_log_probs(cand, jnp.asarray(logp)))
    np.testing.assert_allclose(score, logp @ cand.ancestors.T.astype(np.float32), rtol=1e-6)
    trees, sel, got = select_nodes(dyn, jnp.asarray(tokens), jnp.asarray(score))
    for r in range(b):
        want_sel, want = _reference(cand, tokens[r], score[r], nodes)
        np.testing.assert_array_equal(np.asarray(sel[r]), want_sel)
        np.testing.assert_array_equal(np.asarray(got[r]), tokens[r][want_sel])
        row = jax.tree.map(lambda a: np.asarray(a[r]), trees)
        np.testing.assert_array_equal(row.parents, want.parents)
        np.testing.assert_array_equal(row.depth, want.depth)
        np.testing.assert_array_equal(row.ancestors, want.ancestors)
        np.testing.assert_array_equal(row.paths[:, : want.max_depth], want.paths)
        assert np.all(row.paths[:, want.max_depth:] == -1)
        kids = want.children
        np.testing.assert_array_equal(row.children[:, : kids.shape[1]], kids)
        assert np.all(row.children[:, kids.shape[1]:] == -1)
        spine = np.full(dyn.max_depth, -1)
        spine[: want.spine.size] = want.spine
        np.testing.assert_array_equal(row.spine, spine)
    if nodes > 1:  # the draft's scores shape each row's tree: not one shape for all
        assert len({tuple(np.asarray(trees.parents[r])) for r in range(b)}) > 1


def test_select_nodes_marks_missing_candidates_absent():
    """A row with fewer present candidates than N: the rest absent (token -1), children of
    nothing, at depth 1, each its own only ancestor; the present ones keep their tree."""
    dyn = DynamicTree.of(4)
    cand = dyn.candidates
    tokens = np.full((1, cand.size), -1, np.int32)
    tokens[0, 0] = 7  # only the draft's first choice
    score = jnp.zeros((1, cand.size))
    trees, sel, got = select_nodes(dyn, jnp.asarray(tokens), score)
    assert int(sel[0, 0]) == 0 and got[0].tolist() == [7, -1, -1, -1]
    assert trees.depth[0].tolist() == [1, 1, 1, 1] and trees.parents[0].tolist() == [-1] * 4
    assert trees.children[0, 0].tolist() == [0, -1] and trees.children[0, 1:].max() == -1
    np.testing.assert_array_equal(np.asarray(trees.ancestors[0]), np.eye(4, dtype=bool))
    assert trees.spine[0].tolist() == [0] + [-1] * (dyn.max_depth - 1)


def test_candidates_and_their_text():
    """The default candidates: the chain and its runners-up as leaves, level by level;
    `--tree N` and 'dynN' parse to it and print as 'dynN' (never a bare K)."""
    dyn = DynamicTree.of(4)
    assert dyn.size == 4 and dyn.max_depth == 4 and dyn.span == 8
    assert sorted(dyn.candidates.rank_paths) == sorted(
        [(1,), (2,), (1, 1), (1, 2), (1, 1, 1), (1, 1, 2), (1, 1, 1, 1), (1, 1, 1, 2)])
    assert np.all(np.diff(dyn.candidates.depth) >= 0)
    assert DynamicTree.of(8).candidates.size == 18 and DynamicTree.of(8).max_depth == 6
    assert parse_tree("4") == parse_tree("dyn4") == parse_tree(4) == dyn
    assert tree_text(dyn) == "dyn4" and parse_tree(tree_text(dyn)) == dyn
    for bad in ("0", "33", "dyn", "dynx"):
        with pytest.raises(UserError):
            parse_tree(bad)


@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(0.7, 0, 0.9),
                                      SamplingParams(1.0, 3, 1.0)])
def test_reduced_head_children_equal_the_full_vocabulary_s(sampling):
    """Catches a reduced index returned as a token id, a padded (repeated) id taken twice,
    a different first index among equal logits, log-probabilities of another
    normalisation: the children (top choices, not drawn) and their log-probabilities
    from a reduced head's rows against the same rows scattered over the vocabulary."""
    vocab, n = 97, 20
    ids = np.sort(np.random.default_rng(0).choice(vocab, n - 4, replace=False))
    ids = jnp.asarray(np.concatenate([ids, np.repeat(ids[-1:], 4)]), jnp.int32)  # padded
    logits = jax.random.normal(jax.random.PRNGKey(1), (2, 3, n)) * 2
    logits = logits.at[0, 0, n - 5].set(9.0)  # the padded id is the top choice
    logits = logits.at[1, 1, 2].set(logits[1, 1, 5])  # a tie
    logits = logits.at[..., n - 4:].set(logits[..., n - 5: n - 4])  # padding: the same row
    rows = Reduced(logits, ids, vocab)
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    for width in (1, 2, 3):
        got, _, got_lp = _choose(rows, sampling, keys, width, fixed=True, scored=True)
        want, _, want_lp = _choose(rows.full(), sampling, keys, width, fixed=True, scored=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_allclose(np.asarray(got_lp), np.asarray(want_lp), rtol=1e-5, atol=1e-6)
    top = [t for t in np.asarray(got[0, 0]).tolist() if t >= 0]  # the padded id once
    assert top[0] == int(ids[n - 1]) and len(set(top)) == len(top)


@pytest.mark.parametrize("draft,tree", [
    ("tiny-feature", Tree.from_paths([(1,), (2,), (1, 1), (1, 2), (1, 1, 1)])),
    ("tiny-feature-reduced", DynamicTree.of(4)),
    ("ngram+tiny-feature", DynamicTree.of(3)),
])
def test_spine_fed_as_a_chain_drafts_what_the_tree_block_drafts(monkeypatch, draft, tree):
    """A tree whose only inner nodes are its spine's is drafted one spine token a call at
    its position (`FeatureSteps.chain_layout`), its cache left as a chain's. Catches a
    spine token fed with another node's feature, at the wrong position, or a cache left
    where the next round does not find it: every round keeps what the same rounds keep
    when the tree is drafted by tree-attention blocks (whose cache is moved after), and
    both decode greedy decoding."""
    from specsamp.compilation import forget_executables
    from specsamp.decoding import tree_draft
    from tests.test_exactness import make_engine
    from tests.test_tree_loop import PROMPTS, tree_engine

    sp = SamplingParams(0.0)
    cand = getattr(tree, "candidates", tree)
    assert tree_draft.spine_only(cand)
    fast = tree_engine(sp, draft, tree, max_new=24).run(PROMPTS, [0, 1, 2, 3])
    forget_executables()  # the programs below trace the block drafting
    monkeypatch.setattr(tree_draft.FeatureSteps, "chain_layout", property(lambda self: False))
    try:
        blocks = tree_engine(sp, draft, tree, max_new=24).run(PROMPTS, [0, 1, 2, 3])
    finally:
        forget_executables()
    ar = make_engine(sp, "none", 1, max_new=24).run(PROMPTS, [0, 1, 2, 3])
    for a, f, b in zip(ar, fast, blocks):
        assert f.token_ids == b.token_ids == a.token_ids
        assert f.accepted == b.accepted
    assert sum(sum(f.accepted) for f in fast) > 0
