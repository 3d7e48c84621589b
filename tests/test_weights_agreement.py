"""Stored (quantized) weights against float32 on the real model: greedy output equal up
to the first near-tie (the check `python -m specsamp.analysis.weights_agreement` runs on
the bench prompts)."""

import pytest

from specsamp.analysis.weights_agreement import Agreement, first_divergence


def test_first_divergence():
    """Catches an off-by-one or a missed length difference in the comparison itself."""
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert not Agreement(0, 5, 2, 0.5).ok(0.01) and Agreement(0, 5, 2, 0.001).ok(0.01)


@pytest.mark.slow
def test_stored_greedy_equals_float32_up_to_near_ties():
    """Catches a stored-weight model that is not the float32 model (wrong block, layer
    or kernel arithmetic): on bench prompts, greedy outputs agree token for token until
    a position where the float32 logits of the two candidates are within 0.01."""
    from specsamp.analysis.bench import humaneval_prompts, prose_prompts
    from specsamp.analysis.weights_agreement import compare

    results = compare(humaneval_prompts(2) + prose_prompts(1), max_new_tokens=32)
    assert all(r.tokens >= 8 for r in results)
    assert all(r.ok(0.01) for r in results), results
