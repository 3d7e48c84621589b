"""Measured step costs: the cost model's c = (draft step time) / (target step time).

Both are timed the same way: one jitted single-token forward with a cache of the same
size, batch 1, median of several calls after a warm-up. N-gram lookup costs ~0.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from specsamp.models import ModelConfig, Transformer, init_cache


@jax.jit(static_argnames=("cfg",))
def _step(cfg: ModelConfig, params, tokens, positions, cache):
    return Transformer(cfg).apply({"params": params}, tokens, positions, cache)


def step_seconds(cfg: ModelConfig, params, tokens_per_call: int = 1, slots: int = 512,
                 repeats: int = 7) -> float:
    """Median seconds of one forward of `tokens_per_call` tokens (batch 1)."""
    cache = init_cache(cfg, 1, slots)
    tokens = jnp.zeros((1, tokens_per_call), jnp.int32)
    positions = 100 + jnp.arange(tokens_per_call, dtype=jnp.int32)[None]
    jax.block_until_ready(_step(cfg, params, tokens, positions, cache))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(_step(cfg, params, tokens, positions, cache))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cost_ratio(engine) -> float:
    drafter = engine.prog.drafter
    if drafter is None:
        return float("nan")
    if not drafter.uses_cache:
        return 0.0
    target = step_seconds(engine.prog.target, engine.target_params)
    draft = step_seconds(drafter.cfg, engine.draft_params)
    return draft / target
