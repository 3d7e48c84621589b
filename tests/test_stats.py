"""The statistics' formulas (`specsamp.decoding.stats`), against their definitions and a
simulation of the cost model's i.i.d. acceptance: a wrong count or formula here would change
every table, report and policy that shows or uses them."""

import math

import numpy as np
import pytest

from specsamp.decoding import stats


def test_paper_cost_model():
    """Expected tokens per round and the predicted speed-up, at the edges and in between."""
    assert stats.expected_tokens(0.0, 4) == 1.0 and stats.expected_tokens(1.0, 4) == 5.0
    a = 0.8
    assert stats.expected_tokens(a, 4) == pytest.approx((1 - a**5) / (1 - a))
    assert stats.predicted_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert stats.predicted_speedup(0.5, 2, 0.25, 1.5) == pytest.approx(1.75 / 2.0)
    assert math.isnan(stats.predicted_speedup(math.nan, 2, 0.1))
    assert math.isnan(stats.predicted_speedup(0.5, 0, 0.1))  # nothing drafted: no prediction


def test_loop_counts_and_ratios():
    """accepted / drafted / tested of loops at K = 3: a loop that kept fewer than K tested one
    more token (its rejection); ratios over nothing are NaN, not an error."""
    assert stats.loop_counts([3, 1, 0, 2], 3) == (6, 12, 9)
    assert stats.loop_counts(np.array([2, 2]), 2) == (4, 4, 4)
    # k auto: each loop at its own K; a loop that kept all of its K had no rejection
    assert stats.loop_counts([1, 1, 2, 0], [1, 3, 2, 4]) == (4, 10, 6)
    with pytest.raises(ValueError):
        stats.loop_counts([1, 2], [1])
    assert stats.acceptance_rate(6, 12) == 0.5 and stats.alpha(6, 9) == pytest.approx(2 / 3)
    assert math.isnan(stats.acceptance_rate(0, 0)) and math.isnan(stats.tokens_per_call(3, 0))
    assert stats.ms_per_token(0.5, 100) == pytest.approx(5.0)
    assert stats.speedup(20.0, 10.0) == 2.0


def test_alpha_recovers_the_simulated_acceptance_and_the_model_distribution():
    """Loops simulated with i.i.d. acceptance at a = 0.7, K = 4: alpha (accepted / tested)
    recovers a, the acceptance rate is lower, and the shares of accepted counts follow
    `accepted_distribution`, whose mean is expected_tokens - 1."""
    rng = np.random.default_rng(0)
    a, k, n = 0.7, 4, 200_000
    kept = rng.random((n, k)) < a
    loops = np.where(kept.all(axis=1), k, np.argmin(kept, axis=1))  # first rejection's index
    accepted, drafted, tested = stats.loop_counts(loops, k)
    assert stats.alpha(accepted, tested) == pytest.approx(a, abs=0.005)
    assert stats.acceptance_rate(accepted, drafted) < a - 0.1
    model = stats.accepted_distribution(a, k)
    assert sum(model) == pytest.approx(1.0)
    assert np.bincount(loops, minlength=k + 1) / n == pytest.approx(model, abs=0.005)
    assert sum(j * p for j, p in enumerate(model)) == pytest.approx(stats.expected_tokens(a, k) - 1)
    assert [np.mean(loops >= i) for i in range(1, k + 1)] == pytest.approx(stats.kept_by_position(a, k), abs=0.005)
