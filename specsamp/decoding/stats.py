"""The statistics of speculative decoding, each defined once (docs/report.md, docs/paper.md).

Every table, report, benchmark and policy that shows or uses one of these calls this module:
the per-sample columns (`Completion`), `specsamp report`, the run summary, `specsamp bench`
(latency and throughput) and the `--k auto` policy.

- acceptance rate: accepted draft tokens / drafted tokens (each loop's K, which `k auto`
  chooses per round); NaN when nothing was drafted.
- alpha, the cost model's per-token acceptance: accepted / tested draft tokens, where a
  loop tests its draft tokens up to and including its first rejection (a loop that kept
  fewer than K has one rejection). Under the model's i.i.d. assumption it is the maximum
  likelihood estimate; the acceptance rate is lower (untested tokens count as lost).
- expected tokens per round at alpha and K: 1 + alpha + ... + alpha^K
  = (1 - alpha^(K+1)) / (1 - alpha), K + 1 at alpha = 1.
- predicted speed-up (the cost model): expected tokens / (K c + s), c the draft step's cost
  and s the K+1-token scoring call's, both in target steps (s = 1 in the paper's model).
- tokens per call: generated tokens / target calls; ms per token: decode ms / generated
  tokens; speed-up: the baseline's ms per token over the setting's (equivalently, the
  setting's tokens per second over the baseline's).

Plain Python on purpose: the functions take floats or numpy arrays alike, and importing
this module (through `specsamp.Completion`) costs nothing.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable

NAN = float("nan")


def ratio(num: float, den: float) -> float:
    """num / den, NaN when den is 0 (or NaN): a statistic over nothing is undefined."""
    return num / den if den else NAN


def loop_counts(accepted_per_loop: Iterable[int], drafted: int | Iterable[int]) -> tuple[int, int, int]:
    """(accepted, drafted, tested) draft tokens of a sample's loops; `drafted`: each loop's
    draft length (its K, `drafted_per_loop`), or one K for all of them."""
    loops = list(accepted_per_loop)
    ks = [int(drafted)] * len(loops) if isinstance(drafted, numbers.Integral) else [int(k) for k in drafted]
    if len(ks) != len(loops):
        raise ValueError(f"{len(loops)} loops but {len(ks)} draft lengths")
    accepted = int(sum(loops))
    rejections = sum(1 for a, k in zip(loops, ks) if a < k)
    return accepted, int(sum(ks)), accepted + rejections


def acceptance_rate(accepted: float, drafted: float) -> float:
    return ratio(accepted, drafted)


def alpha(accepted: float, tested: float) -> float:
    return ratio(accepted, tested)


def tokens_per_call(tokens: float, calls: float) -> float:
    return ratio(tokens, calls)


def ms_per_token(seconds: float, tokens: float) -> float:
    return ratio(1000.0 * seconds, tokens)


def speedup(base_ms_per_token: float, ms_per_token_: float) -> float:
    """The baseline's ms per token over the setting's."""
    return ratio(base_ms_per_token, ms_per_token_)


def expected_tokens(a, k: int):
    """E[tokens per round] = 1 + a + ... + a^K, for a float or a numpy array of a."""
    return sum(a**i for i in range(k + 1))


def predicted_speedup(a: float, k: int, c: float, score_ratio: float = 1.0) -> float:
    """The cost model: E[tokens per round] / (K c + score_ratio), in units of one target
    step; NaN when alpha or c is unknown or nothing is drafted (K = 0)."""
    if k <= 0 or math.isnan(a) or math.isnan(c):
        return NAN
    return expected_tokens(a, k) / (k * c + score_ratio)


def accepted_distribution(a: float, k: int) -> list[float]:
    """P(j draft tokens kept in a loop), j = 0..K, under the i.i.d. model: a^j (1 - a) for
    j < K, a^K at j = K (a truncated geometric distribution)."""
    return [a**j * (1 - a) for j in range(k)] + [a**k]


def kept_by_position(a: float, k: int) -> list[float]:
    """P(draft position i is kept), i = 1..K, under the i.i.d. model: a^i."""
    return [a**i for i in range(1, k + 1)]
