"""Measured step costs: the cost model's c = (draft step time) / (target step time).

Both are timed the same way, as they run inside the decoding loop: a compiled loop of
`_INNER` forwards (batch 1, same cache size) that updates its cache in place and consumes
the logits, divided by `_INNER`; median of several calls after a warm-up. (Timing single
jitted calls instead adds the host dispatch and a copy of the whole cache to every call,
~10 ms here, which inflates step costs and flattens their ratios.) N-gram costs ~0.

`cost_curve` measures the same at a batch size: the seconds of a plain step, of scoring K+1
tokens and of a draft call, for the batch-aware K policy (`specsamp.decoding.kpolicy`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from specsamp.models import ModelConfig, init_cache


_INNER = 8


@jax.jit(static_argnames=("model",))
def _steps(model, params, tokens, positions, cache):
    def body(i, carry):
        cache, acc = carry
        logits, cache = model.forward(params, tokens, positions + i, cache)
        return cache, acc + jnp.max(logits)  # consume the logits, as sampling does

    return jax.lax.fori_loop(0, _INNER, body, (cache, jnp.float32(0)))


def _plain(cfg: ModelConfig):
    """The plain decoder's forward, in the drafters' `forward` form."""
    from specsamp.decoding.config import SamplingParams
    from specsamp.decoding.drafters import ModelDrafter

    return ModelDrafter(cfg, 1, SamplingParams())


def _timer(model, params, tokens_per_call: int, slots: int, batch: int = 1,
           kv_cache: str = "float32"):
    """model: a drafter (its own `forward`, e.g. a reduced head) or `_plain(cfg)`;
    kv_cache: the type its cache holds (`config.KV_CACHES`)."""
    cache = init_cache(model.cfg, batch, slots, jnp.dtype(kv_cache))
    tokens = jnp.zeros((batch, tokens_per_call), jnp.int32)
    positions = jnp.broadcast_to(100 + jnp.arange(tokens_per_call, dtype=jnp.int32)[None],
                                 (batch, tokens_per_call))
    jax.block_until_ready(_steps(model, params, tokens, positions, cache))  # compile

    def once() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(_steps(model, params, tokens, positions, cache))
        return (time.perf_counter() - t0) / _INNER

    return once


def time_ratio(a, b, repeats: int = 9) -> float:
    """Median of a()/b() over interleaved calls: robust to a machine whose load changes."""
    return statistics.median(a() / b() for _ in range(repeats))


def scoring_ratio(cfg: ModelConfig, params, k: int, slots: int = 512) -> float:
    """Time of scoring K+1 tokens in one call / time of one single-token step."""
    return time_ratio(_timer(_plain(cfg), params, k + 1, slots), _timer(_plain(cfg), params, 1, slots))


def measure_cost_ratio(engine) -> float:
    drafter = engine.prog.drafter
    if drafter is None:
        return float("nan")
    if not drafter.uses_cache:
        return 0.0
    return time_ratio(
        _timer(drafter, engine.draft_params, 1, 512),
        _timer(_plain(engine.prog.target), engine.target_params, 1, 512),
    )


@dataclasses.dataclass(frozen=True)
class CostCurve:
    """Measured seconds per call at one batch size (rows) and cache size (slots):
    score[T]: a target call of T tokens per row (T = 1: a plain step; K + 1: scoring K
    draft tokens); draft: one draft call of one token per row (0 without a draft model)."""

    batch: int
    score: dict[int, float]
    draft: float


def _curve_path(engine, batch: int, slots: int, tokens: Sequence[int]) -> str:
    from specsamp.quant.kernels import isa, library_digest

    drafter = engine.prog.drafter
    # the native kernels' build and the code they run too (SPECSAMP_ISA may cap it): a
    # rebuilt or capped kernel changes every cost
    ident = repr((jax.devices()[0].device_kind, platform.machine(), jax.__version__,
                  library_digest(), isa(), engine.prog.target, engine.prog.kv_cache,
                  drafter.with_k(1) if drafter is not None else None,
                  batch, slots, sorted(tokens)))
    name = hashlib.sha256(ident.encode()).hexdigest()[:16]
    root = os.environ.get("SPECSAMP_CACHE", os.path.expanduser("~/.cache/specsamp"))
    return os.path.join(root, "costs", f"{name}.json")


def cost_curve(engine, batch: int, ks: Sequence[int], slots: int, repeats: int = 5) -> CostCurve:
    """The step costs at `batch` rows for K in ks (0: a plain step), measured once per
    machine, model, drafter and shape and cached on disk under $SPECSAMP_CACHE/costs."""
    tokens = sorted({1} | {k + 1 for k in ks})
    path = _curve_path(engine, batch, slots, tokens)
    if os.path.exists(path):
        with open(path) as fh:
            raw = json.load(fh)
        return CostCurve(batch, {int(t): s for t, s in raw["score"].items()}, raw["draft"])

    plain = _plain(engine.prog.target)
    timers = {t: _timer(plain, engine.target_params, t, slots, batch, engine.prog.kv_cache)
              for t in tokens}  # (a draft model's own cache stays float32)
    drafter = engine.prog.drafter
    if drafter is not None and drafter.uses_cache:
        timers["draft"] = _timer(drafter, engine.draft_params, 1, slots, batch)
    # Interleaved rounds, each call timed against the plain step of its own round: the
    # policy compares costs across K, and on a machine whose load changes, separate
    # measurements skewed those ratios (scoring 2 tokens at batch 1 once read 1.36 plain
    # steps; interleaved, 1.13-1.16 in two runs).
    rounds = [{name: timer() for name, timer in timers.items()} for _ in range(repeats)]
    step = statistics.median(r[1] for r in rounds)
    cost = {name: step * statistics.median(r[name] / r[1] for r in rounds) for name in timers}
    score = {t: cost[t] for t in tokens}
    draft = cost.get("draft", 0.0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump({"score": score, "draft": draft}, fh)
    os.replace(path + ".tmp", path)  # atomic: parallel workers never read half a file
    return CostCurve(batch, score, draft)
