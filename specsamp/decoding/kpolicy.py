"""Batch-aware speculation (`--k auto`): before each chunk of rounds, pick the K (0 = plain
autoregressive rounds) that maximises the batch's expected tokens per second.

A round at K costs the seconds the engine's own round program takes for the whole batch
(measured once per machine, `specsamp.decoding.costs.cost_curve`: drafting, scoring K+1
tokens, acceptance and bookkeeping; cheap in K at small batches, growing with K at large
ones), and yields, for each running row with
acceptance rate a, (1 - a^(K+1)) / (1 - a) tokens in expectation (the paper's cost model;
SmartSpec's goodput rule, here with measured batch costs). Each row's a is its running
estimate, shrunk toward the batch's pooled rate so that a fresh row starts from what its
neighbours show. Deeper draft positions need not be kept as often as the first (a trained
draft's chained guesses are worse than its first): the rate of each position d given the
ones before it, pooled over every row the engine ran, scales the row's rate there
(`depth_counts`, `expected_tokens_by_position`); before any round tested position d it is
taken to be the first position's, the plain model.

Exactness: every round is exact whatever K it runs at, and K is chosen from the past only,
so samples follow the target's distribution (checked by chi-square in the tests); greedy
output is the same token for token. A sampled row's tokens for a given seed, however, depend
on the K schedule, hence on its batch: with a fixed K they do not.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specsamp.decoding.costs import CostCurve, cost_curve
from specsamp.decoding.shapes import width_for
from specsamp.decoding.stats import expected_tokens


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


@dataclasses.dataclass
class KPolicy:
    """policy(accepted, tested) -> index into ks, from the running rows' accepted and tested
    draft tokens so far (see `specsamp.decoding.engine.Engine`)."""

    curve: CostCurve
    ks: Sequence[int]
    prior_weight: float = 4.0  # pseudo-observations of the pooled rate per row
    depth_weight: float = 16.0  # pseudo-observations of the first position's rate, per position
    # Draft only where the best K is predicted this much faster than plain rounds: the
    # cost curve is measured once on a machine whose speed drifts, and a predicted gain of
    # a few percent is within a curve's error (docs/measurements.md); plain rounds cost
    # what the baseline costs.
    margin: float = 0.05

    def __post_init__(self):
        self.chosen: list[int] = []

    def round_seconds(self, k: int) -> float:
        return self.curve.rounds[k]

    def alphas(self, accepted: np.ndarray, tested: np.ndarray) -> np.ndarray:
        pooled = (accepted.sum() + 1.0) / (tested.sum() + 2.0)
        return (accepted + self.prior_weight * pooled) / (tested + self.prior_weight)

    def position_rates(self, depth) -> np.ndarray:
        """Each draft position's rate given the ones before it, over the rate of all tested
        positions together (what a row's alpha estimates), from the pooled (accepted,
        tested) by position (one entry per position up to max(ks)); a position no round
        tested yet is taken at the first one's."""
        accepted, tested = (np.asarray(a, float) for a in depth)
        overall = (accepted.sum() + 1.0) / (tested.sum() + 2.0)
        first = (accepted[0] + 1.0) / (tested[0] + 2.0)
        rate = (accepted + self.depth_weight * first) / (tested + self.depth_weight)
        rate[0] = first
        return rate / overall

    def tokens_per_second(self, k: int, alpha: np.ndarray, rates=None) -> float:
        tokens = (expected_tokens(alpha, k) if rates is None
                  else expected_tokens_by_position(alpha, rates, k))
        return float(np.sum(tokens)) / self.round_seconds(k)

    def __call__(self, accepted: np.ndarray, tested: np.ndarray, depth=None) -> int:
        """depth: (accepted, tested) draft tokens by position, pooled over rows
        (`depth_counts`), or None for the plain model."""
        best = self._best(accepted, tested, depth)
        self.chosen.append(self.ks[best])
        return best

    def fresh_choice(self, depth=None) -> int:
        """The index chosen for rows none of which has tested a draft token yet (each at
        the pooled prior), not recorded. A run whose first chunk this puts at K = 0 stays
        there: plain rounds test no draft, so the choice's inputs never change (the
        runner then runs it without the drafter, `batching.steps`)."""
        return self._best(np.zeros(1), np.zeros(1), depth)

    def _best(self, accepted, tested, depth) -> int:
        alpha = np.minimum(self.alphas(np.asarray(accepted, float), np.asarray(tested, float)), 0.999)
        by_position = None if depth is None else self.position_rates(depth)
        speeds = [self.tokens_per_second(k, alpha, by_position) for k in self.ks]
        best = int(np.argmax(speeds))
        if 0 in self.ks and speeds[best] < (1 + self.margin) * speeds[self.ks.index(0)]:
            best = self.ks.index(0)
        return best


def auto_policy(engine, batch: int, prompts) -> KPolicy:
    """The policy for `engine` (its K values) running `batch` slots on a run of `prompts`,
    from this machine's round costs at that shape (measured on first use, then read from
    disk)."""
    return KPolicy(cost_curve(engine, batch, engine.slots_for(prompts), width_for(prompts)),
                   engine.k.ks)
