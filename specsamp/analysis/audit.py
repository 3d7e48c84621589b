"""Exactness audit of a target/drafter pair, on the user's own models and settings.

Draws many short speculative continuations of one prompt and compares
  - the first token with the target's exact next-token distribution (chi-square
    goodness of fit), and
  - each later token with plain autoregressive samples of the target (chi-square test of
    homogeneity; "ended" is a category of its own),
printing total variation and a p-value per position. Rare tokens are pooled so that each
cell has an expected count of at least 5. The audit fails when any p-value is below
alpha / positions (Bonferroni): with exact sampling that happens with probability <= alpha.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from scipy import stats

from specsamp.decoding.sampling import probs_from_logits
from specsamp.models import Model

ENDED = -1


@dataclasses.dataclass(frozen=True)
class PositionResult:
    position: int
    reference: str  # 'exact' or 'autoregressive samples'
    tv: float
    p_value: float
    cells: int


def exact_next_token_probs(gen, prompt_ids: list[int]) -> np.ndarray:
    """The target's distribution of the first generated token, from a full forward pass."""
    cfg, params = gen.engine.prog.target, gen.engine.target_params
    logits = Model(cfg).full_forward(params, jnp.asarray([prompt_ids]))
    return np.asarray(probs_from_logits(logits[0, -1], gen.spec.sampling), np.float64)


def tokens_at(completions, position: int) -> np.ndarray:
    return np.array([c.token_ids[position] if len(c.token_ids) > position else ENDED
                     for c in completions])


def goodness_of_fit(sample: np.ndarray, probs: np.ndarray) -> PositionResult:
    counts = np.bincount(sample, minlength=probs.size).astype(np.float64)
    n = counts.sum()
    tv = 0.5 * np.abs(counts / n - probs).sum()
    if counts[probs == 0].sum() > 0:
        return PositionResult(1, "exact", tv, 0.0, 0)  # impossible token: certainly wrong
    expected = probs / probs.sum() * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    if keep.sum() < 2:
        return PositionResult(1, "exact", tv, 1.0, int(keep.sum()))
    return PositionResult(1, "exact", tv, float(stats.chisquare(obs[keep], exp[keep]).pvalue),
                          int(keep.sum()))


def homogeneity(a: np.ndarray, b: np.ndarray, position: int) -> PositionResult:
    values = np.union1d(a, b)
    ca = np.array([(a == v).sum() for v in values], np.float64)
    cb = np.array([(b == v).sum() for v in values], np.float64)
    tv = 0.5 * np.abs(ca / ca.sum() - cb / cb.sum()).sum()
    # Pool categories whose expected count (pooled frequency) is under 5 in either sample.
    pooled = (ca + cb) * min(ca.sum(), cb.sum()) / (ca.sum() + cb.sum()) < 5
    table = np.array([np.append(ca[~pooled], ca[pooled].sum()),
                      np.append(cb[~pooled], cb[pooled].sum())])
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return PositionResult(position, "autoregressive samples", tv, 1.0, table.shape[1])
    p = stats.chi2_contingency(table, correction=False).pvalue
    return PositionResult(position, "autoregressive samples", tv, float(p), table.shape[1])


def run_audit(spec_gen, ar_gen, prompt: str, samples: int, positions: int) -> list[PositionResult]:
    ids = spec_gen.encode_prompt(prompt)
    spec = spec_gen.generate([prompt] * samples, list(range(samples)))
    base = ar_gen.generate([prompt] * samples, list(range(samples, 2 * samples)))
    first = tokens_at(spec, 0)
    if (first == ENDED).any():
        raise RuntimeError("a speculative sample generated no token")
    results = [goodness_of_fit(first, exact_next_token_probs(spec_gen, ids))]
    for i in range(1, positions):
        results.append(homogeneity(tokens_at(spec, i), tokens_at(base, i), i + 1))
    return results


def format_results(results: list[PositionResult], alpha: float) -> str:
    threshold = alpha / len(results)
    lines = [f"{'position':>8} {'compared with':>24} {'TV':>7} {'p-value':>9} {'cells':>6}  verdict"]
    for r in results:
        verdict = "ok" if r.p_value >= threshold else "FAIL"
        lines.append(f"{r.position:>8} {r.reference:>24} {r.tv:>7.4f} {r.p_value:>9.4g} "
                     f"{r.cells:>6}  {verdict}")
    lines.append(f"(fails when p < {threshold:.2g} = alpha {alpha:g} / {len(results)} positions; "
                 "TV includes sampling noise of order sqrt(cells / samples))")
    return "\n".join(lines)
