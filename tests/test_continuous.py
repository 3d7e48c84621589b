"""Continuous batching: rows inserted into free slots at chunk boundaries sample exactly as
the static engine does (same tokens for the same prompt and seed), whatever their slot,
neighbours or insertion time."""

import numpy as np
import pytest

from specsamp.config import SamplingParams
from specsamp.continuous import ContinuousEngine
from tests.test_exactness import PROMPT, exact_joint, chi_square_pvalue, make_engine, ALPHA, N_TOKENS
from tests import tiny

# Prompts of three buckets' worth of lengths (the tiny model's context is 256).
PROMPTS = [PROMPT, [5, 4], [7], [3, 3, 3, 3, 3, 3, 1], list(range(1, 8)) * 6, [2, 6] * 20,
           [1, 2, 1, 2, 1, 2], [6] * 70, [4, 5, 6]]
SEEDS = list(range(100, 100 + len(PROMPTS)))


def _eos_engine(sp, drafter, k, max_new):
    """A static engine whose EOS id ends rows at different times (mixed output lengths)."""
    eng = make_engine(sp, drafter, k, max_new=max_new)
    eng.eos_ids = (5,)
    return eng


@pytest.mark.parametrize("drafter,k,temperature", [
    ("none", 1, 0.0), ("model", 3, 0.0), ("hybrid", 2, 0.0), ("feature", 3, 1.0),
    ("ngram", 2, 0.8), ("none", 1, 1.0),
])
def test_continuous_rows_equal_static_rows(drafter, k, temperature):
    """Each row, inserted into 3 slots at different times next to different rows, has the
    tokens and statistics it has when run alone in the static engine. Catches a slot that
    keeps its previous occupant's cache, features or counters, keys that depend on the
    slot, and rows that read their neighbours."""
    sp = SamplingParams(temperature, 0, 0.9 if temperature else 1.0)
    static = _eos_engine(sp, drafter, k, max_new=20)
    cont = ContinuousEngine(static, batch=3, chunk_rounds=5)
    got = cont.run(PROMPTS, SEEDS)
    lengths = set()
    for prompt, seed, row in zip(PROMPTS, SEEDS, got):
        alone = static.run([prompt], [seed])[0]
        assert row.token_ids == alone.token_ids
        assert (row.stop_reason, row.accepted, row.calls, row.draft_calls) == (
            alone.stop_reason, alone.accepted, alone.calls, alone.draft_calls)
        assert row.prefill_s > 0 and row.decode_s > 0
        lengths.add(len(row.token_ids))
    assert len(lengths) > 2  # rows really ended at different times


def test_continuous_sampling_matches_exact_target_distribution():
    """Chi-square of the joint law of the first three tokens over many rows that pass
    through 64 slots (a sampler that reused a slot's stale state would fail it)."""
    sp = SamplingParams(1.0)
    static = make_engine(sp, "model", 2, max_new=N_TOKENS)
    cont = ContinuousEngine(static, batch=64)
    n = 6000
    counts = np.zeros((tiny.TARGET.vocab_size,) * N_TOKENS)
    for r in cont.run([PROMPT] * n, list(range(n))):
        counts[tuple(r.token_ids[:N_TOKENS])] += 1
    assert chi_square_pvalue(counts, exact_joint(sp)) > ALPHA
