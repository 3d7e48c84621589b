"""The agreement counts (`specsamp.analysis.draft_agreement`) against a brute-force reference.

The reference recomputes every (row, depth) node from scratch: one full forward pass of the
draft over x_0..x_t and the draft's own earlier top-1 tokens (a feature draft: the target's
hidden states for the true positions, its own guesses after), then ranks and acceptance in
numpy. It catches a chain fed the wrong tokens, positions or features (e.g. the true token
instead of the draft's top-1, the replicated cache leaking the true future), a node paired
with the wrong target token or target distribution (off by one in depth), ties ranked
differently from `first_argmax`, a wrong multi-step residual, and conditional counts taken
over the wrong rows.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.analysis import draft_agreement as da
from specsamp.decoding.config import SamplingParams
from specsamp.decoding.drafters import FeatureDrafter
from specsamp.decoding.lookup import NgramDrafter
from specsamp.models import Model
from specsamp.models.feature_draft import FeatureModel
from tests import tiny

S, DEPTH = 14, 3
ROWS = np.arange(2, S - DEPTH)


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, tiny.TARGET.vocab_size, S).astype(np.int32)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _draft_logits(drafter, params, seq, feats):
    """The draft's logits after the last token of seq: a fresh full pass over seq padded to
    S (causal, so the padding changes nothing before it; one compiled shape)."""
    n = len(seq)
    ids = jnp.asarray(np.pad(seq, (0, S - n)), jnp.int32)[None]
    if feats is None:
        return np.asarray(Model(drafter.cfg).full_forward(params, ids)[0, n - 1]), None
    model = FeatureModel(drafter.cfg)
    g = model.full_forward(params, ids, jnp.asarray(np.pad(np.stack(feats), ((0, S - n), (0, 0))))[None])
    return np.asarray(model.logits(params, g)[0, n - 1]), np.asarray(g[0, n - 1])


def _node(draft, target, truth):
    order = np.argsort(-draft, kind="stable")  # ties: the lower id first
    p, q = _softmax(target), _softmax(draft)
    kept, left = [], 1.0
    for _ in range(max(da.WIDTHS)):
        a = np.minimum(p, q).sum()
        left *= 1 - a
        kept.append(1 - left)
        p = np.maximum(p - q, 0) / max(1 - a, 1e-30) if a < 1 else p
    mass = np.cumsum(_softmax(target)[order])
    return (int(np.where(order == truth)[0][0]), int(order[0]),
            [kept[w - 1] for w in da.WIDTHS], [mass[w - 1] for w in da.WIDTHS])


def _reference(drafter, params, tokens):
    hidden, logits = (np.asarray(a[0]) for a in da.target_pass(tiny.TARGET, tiny.target_params(),
                                                                  jnp.asarray(tokens)[None]))
    feature = isinstance(drafter, FeatureDrafter)
    out = []
    for t in ROWS:
        seq = list(tokens[: t + 1])
        feats = [np.zeros_like(hidden[0])] + list(hidden[:t]) if feature else None
        nodes = []
        for i in range(DEPTH):
            dl, g = _draft_logits(drafter, params, seq, feats)
            nodes.append(_node(dl, logits[t + i], tokens[t + 1 + i]))
            seq.append(nodes[-1][1])  # the next depth reads the draft's own top-1 ...
            if feature:
                feats.append(g)  # ... and its own feature guess
        out.append(nodes)
    return out


@pytest.mark.parametrize("draft", ["early-exit:1", "tiny-feature", "tiny-feature-reduced"])
def test_records_match_brute_force(draft):
    drafter, params = tiny.drafter(draft, 1, SamplingParams())
    tokens = _tokens()
    hidden, logits = da.target_pass(tiny.TARGET, tiny.target_params(), jnp.asarray(tokens)[None])
    rec = da.measure(drafter, params, tokens[None], hidden, logits, ROWS, DEPTH)
    ref = _reference(drafter, params, tokens)
    np.testing.assert_array_equal(rec.rank, [[n[0] for n in row] for row in ref])
    np.testing.assert_array_equal(rec.top1, [[n[1] for n in row] for row in ref])
    np.testing.assert_allclose(rec.iid, [[n[2] for n in row] for row in ref], atol=2e-5)
    np.testing.assert_allclose(rec.fixed, [[n[3] for n in row] for row in ref], atol=2e-5)
    # Not vacuous: chains go on from a missed token (a chain fed the truth would differ).
    assert (rec.top1[:, :-1] != tokens[ROWS[:, None] + 1 + np.arange(DEPTH - 1)]).any()


def test_summary_conditions_on_the_top1_chain():
    """Row 0 matches at depths 1-2, row 1 misses at depth 1, row 2 is not valid."""
    truth = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    top1 = np.array([[1, 2, 0], [0, 2, 3], [1, 2, 3]])
    rank = np.array([[0, 0, 3], [1, 0, 0], [0, 0, 0]])
    w = len(da.WIDTHS)
    rec = da.Records(rank, top1, np.full((3, 3, w), 0.5), np.full((3, 3, w), 0.25))
    d1, d2, d3 = da.summarize(rec, truth, np.array([True, True, False]))
    assert (d1["rows"], d1["matched"], d2["matched"], d3["matched"]) == (2, 2, 1, 1)
    assert d1["top"][1] == {"conditional": 0.5, "unconditional": 0.5} and d1["top"][2]["conditional"] == 1.0
    assert d2["top"][1] == {"conditional": 1.0, "unconditional": 1.0}  # row 1's hit is not counted
    assert d3["top"][2] == {"conditional": 0.0, "unconditional": 0.5} and d3["top"][4]["conditional"] == 1.0
    assert d3["reach"] == 0.5 and d3["iid"][2] == 0.5 and d3["fixed"][4] == 0.25


def test_lookup_candidates_agree_with_the_lookup_drafter():
    """The latest match's next token is what `NgramDrafter` proposes; counts by hand."""
    import jax

    tokens = np.array([5, 1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 6], np.int32)
    rows = np.arange(len(tokens) - 1)
    counts, any_hit, top1_hit = da.lookup_candidates(tokens, rows, max_ngram=3, min_ngram=1)
    lookup = NgramDrafter(1, tiny.TARGET.vocab_size, max_ngram=3, min_ngram=1)
    proposal, found = jax.vmap(lookup._lookup, in_axes=(None, 0))(jnp.asarray(tokens), jnp.asarray(rows))
    assert ((counts > 0) == np.asarray(found)).all()
    truth = tokens[rows + 1]
    np.testing.assert_array_equal(top1_hit, np.asarray(found) & (np.asarray(proposal[:, 0]) == truth))
    # t = 11 (... 3 1 2 | 6): "3 1 2" ended once before, at 5 (next 4): one candidate, missed.
    # t = 7 (... 2 4 1 | 2): no earlier "2 4 1" or "4 1"; "1" at 1 and 4, both followed by 2.
    assert (counts[11], any_hit[11]) == (1, False) and (counts[7], any_hit[7]) == (1, True)
    # t = 8 (the bigram "1 2" at 1-2 and 4-5): next 3 and 4, two candidates, 3 is x_9.
    assert (counts[8], any_hit[8], top1_hit[8]) == (2, True, False)
