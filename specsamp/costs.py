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
    from specsamp.config import SamplingParams
    from specsamp.drafters import ModelDrafter

    return ModelDrafter(cfg, 1, SamplingParams())


def _timer(model, params, tokens_per_call: int, slots: int):
    """model: a drafter (its own `forward`, e.g. a reduced head) or `_plain(cfg)`."""
    cache = init_cache(model.cfg, 1, slots)
    tokens = jnp.zeros((1, tokens_per_call), jnp.int32)
    positions = 100 + jnp.arange(tokens_per_call, dtype=jnp.int32)[None]
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
