"""The chain model's acceptance by draft position, for the K policy
(`specsamp.decoding.kpolicy`): a trained draft's chained guesses are kept less often than
its first, so each position d has its own rate given the positions before it, pooled over
the rounds an engine ran (`depth_counts`), shrunk toward the first position's where few
rounds tested it (`shrunk_rates`), and a chain of K drafts yields 1 + the sum over j <= K
of the products of the rates up to j (`expected_tokens_by_position`; all rates equal: the
paper's geometric sum, `stats.expected_tokens`).

numpy only: the runner (`specsamp.decoding.batching`) counts every chunk's rounds here.
"""

from __future__ import annotations

import numpy as np


def depth_counts(accepted_per_loop, drafted, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(accepted, tested) draft tokens of loops by position in the draft (index d - 1 for
    position d, d <= k): a loop of draft length K (`drafted`: one per loop, or one for all)
    that kept n draft tokens tested positions 1..min(n + 1, K) and accepted 1..n."""
    loops = np.asarray(accepted_per_loop, int)
    lengths = np.broadcast_to(np.asarray(drafted, int), loops.shape)
    d = np.arange(1, k + 1)[None, :]
    accepted = (d <= loops[:, None]).sum(axis=0).astype(float)
    tested = (d <= np.minimum(loops + 1, lengths)[:, None]).sum(axis=0).astype(float)
    return accepted, tested


def shrunk_rates(accepted, tested, weight: float) -> np.ndarray:
    """Each position's rate given the ones before it, from pooled (accepted, tested) [D]:
    the first position's with a uniform prior; deeper ones shrunk toward it with `weight`
    pseudo-observations (untested: the first position's)."""
    accepted, tested = np.asarray(accepted, float), np.asarray(tested, float)
    first = (accepted[0] + 1.0) / (tested[0] + 2.0)
    rate = (accepted + weight * first) / (tested + weight)
    rate[0] = first
    return rate


def expected_tokens_by_position(a, rates, k: int):
    """E[tokens per round] when draft position d is kept with probability a * rates[d - 1]
    given the positions before it were: 1 + the sum over j <= K of the products up to j
    (all rates 1: the geometric sum of `expected_tokens`). `a`: a float or a numpy array."""
    a = np.asarray(a, float)
    total, kept = np.ones_like(a), np.ones_like(a)  # one token per row at K = 0
    for d in range(k):
        kept = kept * np.minimum(a * rates[d], 0.999)
        total = total + kept
    return total
