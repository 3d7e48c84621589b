"""Batch-aware speculation (`--k auto`): before each chunk of rounds, pick the K (0 = plain
autoregressive rounds) that maximises the batch's expected tokens per second.

A round at K costs score[K+1] + K * draft seconds for the whole batch (measured once per
machine, `specsamp.decoding.costs.cost_curve`: memory-bound and nearly flat in K at small batches,
compute-bound and growing with K at large ones), and yields, for each running row with
acceptance rate a, (1 - a^(K+1)) / (1 - a) tokens in expectation (the paper's cost model;
SmartSpec's goodput rule, here with measured batch costs). Each row's a is its running
estimate, shrunk toward the batch's pooled rate so that a fresh row starts from what its
neighbours show.

Exactness: every round is exact whatever K it runs at, and K is chosen from the past only,
so samples follow the target's distribution (checked by chi-square in the tests); greedy
output is the same token for token. A sampled row's tokens for a given seed, however, depend
on the K schedule, hence on its batch: with a fixed K they do not.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specsamp.decoding.costs import CostCurve
from specsamp.decoding.stats import expected_tokens


@dataclasses.dataclass
class KPolicy:
    """policy(accepted, tested) -> index into ks, from the running rows' accepted and tested
    draft tokens so far (see `specsamp.decoding.continuous.ContinuousEngine`)."""

    curve: CostCurve
    ks: Sequence[int]
    prior_weight: float = 4.0  # pseudo-observations of the pooled rate per row

    def __post_init__(self):
        self.chosen: list[int] = []

    def round_seconds(self, k: int) -> float:
        return self.curve.score[k + 1] + k * self.curve.draft

    def alphas(self, accepted: np.ndarray, tested: np.ndarray) -> np.ndarray:
        pooled = (accepted.sum() + 1.0) / (tested.sum() + 2.0)
        return (accepted + self.prior_weight * pooled) / (tested + self.prior_weight)

    def tokens_per_second(self, k: int, alpha: np.ndarray) -> float:
        return float(expected_tokens(alpha, k).sum()) / self.round_seconds(k)

    def __call__(self, accepted: np.ndarray, tested: np.ndarray) -> int:
        alpha = np.minimum(self.alphas(np.asarray(accepted, float), np.asarray(tested, float)), 0.999)
        rates = [self.tokens_per_second(k, alpha) for k in self.ks]
        best = int(np.argmax(rates))
        self.chosen.append(self.ks[best])
        return best


K_AUTO = "auto"  # GeneratorSpec.k for this policy
AUTO_KS = (0, 1, 2, 4)  # the K values `--k auto` switches between (one program each)


def auto_policy(engine, batch: int, slots: int, ks: Sequence[int] = AUTO_KS) -> KPolicy:
    """The policy for `engine` (its drafter at any K) at `batch` slots of `slots` cache
    slots, from this machine's cost curve (measured on first use, then read from disk)."""
    from specsamp.decoding.costs import cost_curve

    return KPolicy(cost_curve(engine, batch, ks, slots), ks)
