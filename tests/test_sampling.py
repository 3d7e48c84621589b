"""The logits -> probabilities transform against a plain Python reference."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.config import SamplingParams
from specsamp.errors import UserError
from specsamp.sampling import probs_from_logits, residual


def reference_probs(logits, temperature, top_k, top_p):
    """Textbook version, one row, plain Python: temperature, top-k, top-p, renormalise."""
    v = len(logits)
    if temperature == 0:
        best = max(range(v), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)]
    z = [x / temperature for x in logits]
    keep = set(range(v))
    if 0 < top_k < v:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = {i for i in keep if z[i] >= kth}
    m = max(z[i] for i in keep)
    e = {i: math.exp(z[i] - m) for i in keep}
    s = sum(e.values())
    probs = {i: e[i] / s for i in keep}
    if top_p < 1.0:
        ranked = sorted(probs.values(), reverse=True)
        mass, cut = 0.0, ranked[0]
        for p in ranked:
            if mass >= top_p:
                break
            cut, mass = p, mass + p
        probs = {i: p for i, p in probs.items() if p >= cut}
        s = sum(probs.values())
        probs = {i: p / s for i, p in probs.items()}
    return [probs.get(i, 0.0) for i in range(v)]


SETTINGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
            (0.8, 7, 0.9), (1.0, 1, 1.0), (2.0, 0, 0.3)]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_matches_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 2
    got = np.asarray(probs_from_logits(jnp.asarray(logits), SamplingParams(temperature, top_k, top_p)))
    for row, out in zip(logits, got):
        want = reference_probs(row.tolist(), temperature, top_k, top_p)
        np.testing.assert_allclose(out, want, atol=1e-6)
        assert out.dtype == np.float32 and abs(out.sum() - 1) < 1e-5


def test_residual_is_positive_part_normalised_and_falls_back_to_q():
    q = jnp.array([0.5, 0.3, 0.2, 0.0])
    p = jnp.array([0.2, 0.5, 0.1, 0.2])
    np.testing.assert_allclose(residual(q, p), [0.75, 0.0, 0.25, 0.0], atol=1e-7)
    np.testing.assert_allclose(residual(q, q), q)  # (q - q)+ is empty: fall back to q


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-1), dict(temperature=float("nan"))])
def test_bad_settings_are_user_errors(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("scale", [0.5, 6.0])  # flat: nucleus wider than 256 tokens; peaky: narrower
def test_nucleus_fast_and_full_paths_match_reference(scale):
    """Over 256 tokens the nucleus cut is looked for in the top 256 first; a wide nucleus
    falls back to a full sort. Both must give the reference's distribution."""
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(3, 1000)) * scale).astype(np.float32)
    got = np.asarray(probs_from_logits(jnp.asarray(logits), SamplingParams(1.0, 0, 0.9)))
    kept = (got > 0).sum(axis=-1)
    assert (kept > 256).all() if scale < 1 else (kept < 256).all()
    for row, out in zip(logits, got):
        np.testing.assert_allclose(out, reference_probs(row.tolist(), 1.0, 0, 0.9), atol=1e-6)
