"""Measured step costs: the cost model's c = (draft step time) / (target step time).

Both are timed the same way, as they run inside the decoding loop: a compiled loop of
`_INNER` forwards (batch 1, same cache size) that updates its cache in place and consumes
the logits, divided by `_INNER`; median of several calls after a warm-up. (Timing single
jitted calls instead adds the host dispatch and a copy of the whole cache to every call,
~10 ms here, which inflates step costs and flattens their ratios.) N-gram costs ~0.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from specsamp.models import ModelConfig, Transformer, init_cache


_INNER = 8


@jax.jit(static_argnames=("cfg",))
def _steps(cfg: ModelConfig, params, tokens, positions, cache):
    def body(i, carry):
        cache, acc = carry
        logits, cache = Transformer(cfg).apply({"params": params}, tokens, positions + i, cache)
        return cache, acc + jnp.max(logits)  # consume the logits, as sampling does

    return jax.lax.fori_loop(0, _INNER, body, (cache, jnp.float32(0)))


def _timer(cfg: ModelConfig, params, tokens_per_call: int, slots: int):
    cache = init_cache(cfg, 1, slots)
    tokens = jnp.zeros((1, tokens_per_call), jnp.int32)
    positions = 100 + jnp.arange(tokens_per_call, dtype=jnp.int32)[None]
    jax.block_until_ready(_steps(cfg, params, tokens, positions, cache))  # compile

    def once() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(_steps(cfg, params, tokens, positions, cache))
        return (time.perf_counter() - t0) / _INNER

    return once


def step_seconds(cfg: ModelConfig, params, tokens_per_call: int = 1, slots: int = 512,
                 repeats: int = 7) -> float:
    """Median seconds of one forward of `tokens_per_call` tokens (batch 1)."""
    once = _timer(cfg, params, tokens_per_call, slots)
    return statistics.median(once() for _ in range(repeats))


def time_ratio(a, b, repeats: int = 9) -> float:
    """Median of a()/b() over interleaved calls: robust to a machine whose load changes."""
    return statistics.median(a() / b() for _ in range(repeats))


def scoring_ratio(cfg: ModelConfig, params, k: int, slots: int = 512) -> float:
    """Time of scoring K+1 tokens in one call / time of one single-token step."""
    return time_ratio(_timer(cfg, params, k + 1, slots), _timer(cfg, params, 1, slots))


def measure_cost_ratio(engine) -> float:
    drafter = engine.prog.drafter
    if drafter is None:
        return float("nan")
    if not drafter.uses_cache:
        return 0.0
    return time_ratio(
        _timer(drafter.cfg, engine.draft_params, 1, 512),
        _timer(engine.prog.target, engine.target_params, 1, 512),
    )
