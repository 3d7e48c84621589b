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
    # past 8 nodes the chain grows with N (three quarters of it, at most 12 deep)
    assert [DynamicTree.of(n).max_depth for n in (9, 12, 16, 32)] == [6, 9, 12, 12]
    assert DynamicTree.of(12).candidates.size == 27 and DynamicTree.of(32).span == 36
    assert DynamicTree.of(12).spine.size == 9
    assert parse_tree("4") == parse_tree("dyn4") == parse_tree(4) == dyn
    assert tree_text(dyn) == "dyn4" and parse_tree(tree_text(dyn)) == dyn
    for bad in ("0", "33", "dyn", "dynx"):
        with pytest.raises(UserError):
            parse_tree(bad)


def test_reduced_head_children_equal_the_full_vocabulary_s():
    """Catches a reduced index returned as a token id, a padded (repeated) id taken twice,
    a different first index among equal logits, log-probabilities of another
    normalisation: greedy children and their log-probabilities from a reduced head's rows
    against the same rows scattered over the vocabulary."""
    vocab, n = 97, 20
    ids = np.sort(np.random.default_rng(0).choice(vocab, n - 4, replace=False))
    ids = jnp.asarray(np.concatenate([ids, np.repeat(ids[-1:], 4)]), jnp.int32)  # padded
    logits = jax.random.normal(jax.random.PRNGKey(1), (2, 3, n)) * 2
    logits = logits.at[0, 0, n - 5].set(9.0)  # the padded id is the top choice
    logits = logits.at[1, 1, 2].set(logits[1, 1, 5])  # a tie
    logits = logits.at[..., n - 4:].set(logits[..., n - 5: n - 4])  # padding: the same row
    rows = Reduced(logits, ids, vocab)
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    sampling = SamplingParams(0.0)
    for width in (1, 2, 3):
        got, _, got_lp = _choose(rows, sampling, keys, width, scored=True)
        want, _, want_lp = _choose(rows.full(), sampling, keys, width, scored=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_allclose(np.asarray(got_lp), np.asarray(want_lp), rtol=1e-5, atol=1e-6)
    top = np.asarray(got[0, 0]).tolist()  # the padded id once
    assert top[0] == int(ids[n - 1]) and len(set(top)) == 3


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


def test_a_drawn_node_s_score_never_reads_its_own_token():
    """Sampled dynamic trees (`tree_draft._drawn_scores`): whether a drawn node is chosen
    must not depend on what was drawn there. Catches a score that reads the node's own
    probability (EAGLE-2's path probability, exact only for children taken, not drawn):
    changing one node's own log-probability moves only its descendants' scores; a child
    never scores above its parent, a later draw never above an earlier one."""
    from specsamp.decoding.tree_draft import _drawn_scores

    cand = DynamicTree.of(6).candidates
    rng = np.random.default_rng(5)
    logp = jnp.asarray(np.log(rng.uniform(0.01, 1, (4, cand.size))), jnp.float32)
    ranked = np.log(np.sort(rng.uniform(0.01, 1, (4, cand.size + 1, 3)), axis=2)[:, :, ::-1])
    rank = np.array([p[-1] - 1 for p in cand.rank_paths])
    parent_row = np.asarray(cand.parents) + 1  # each node's parent's largest probabilities
    slot = jnp.asarray(ranked[:, parent_row, rank], jnp.float32)  # its rank-th largest
    base = np.asarray(_drawn_scores(cand, logp, slot))
    for i in range(cand.size):
        moved = np.asarray(_drawn_scores(cand, logp.at[:, i].add(-1.5), slot))
        others = ~cand.ancestors[:, i]  # nodes below i have i among their ancestors
        others[i] = True
        np.testing.assert_array_equal(moved[:, others], base[:, others])
    parents = np.asarray(cand.parents)
    inner = parents >= 0
    assert np.all(base[:, inner] <= base[:, parents[inner]])
    for u in range(-1, cand.size):
        kids = cand.children[u + 1][cand.children[u + 1] >= 0]
        assert np.all(np.diff(base[:, kids], axis=1) <= 0)


def test_draws_without_replacement_follow_their_law():
    """`tree_draft._draw_distinct` (the sampled trees' children): the first two draws'
    joint frequencies against the exact law of two draws without replacement (p(a) p(b) /
    (1 - p(a))), zeros never drawn, a draw past the support marked -1. Catches a second
    draw from the unmasked row (repeats), from a renormalised row drawn wrongly, or a
    zero-probability token drawn."""
    from specsamp.decoding.tree_draft import _draw_distinct
    from tests.test_exactness import ALPHA, chi_square_pvalue

    p = np.array([0.5, 0.0, 0.3, 0.15, 0.05], np.float32)
    n = 20000
    probs = jnp.broadcast_to(jnp.asarray(p), (n, 1, 5))
    keys = jax.random.split(jax.random.PRNGKey(7), n)
    tokens, logp = _draw_distinct(probs, keys, 3, True)
    tokens = np.asarray(tokens)[:, 0]
    assert not np.any(tokens == 1) and np.all(tokens[:, 0] != tokens[:, 1])
    np.testing.assert_allclose(np.asarray(logp)[:, 0, 0], np.log(p[tokens[:, 0]]), rtol=1e-6)
    law = np.zeros((5, 5))
    for a in range(5):
        for b in range(5):
            if a != b and p[a] < 1:
                law[a, b] = p[a] * p[b] / (1 - p[a])
    counts = np.zeros((5, 5))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    assert chi_square_pvalue(counts, law) > ALPHA
    one = jnp.asarray([[[0.0, 1.0, 0.0]]], jnp.float32)  # support of one: the rest absent
    got, _ = _draw_distinct(one, jax.random.split(jax.random.PRNGKey(1), 1), 3, False)
    assert np.asarray(got).tolist() == [[[1, -1, -1]]]
