"""Measured step costs: the cost model's c = (draft step time) / (target step time).

Both are timed the same way, as they run inside the decoding loop: a compiled loop of
`_INNER` forwards (batch 1, same cache size) that updates its cache in place and consumes
the logits, divided by `_INNER`; median of several calls after a warm-up. (Timing single
jitted calls instead adds the host dispatch and a copy of the whole cache to every call,
which inflates step costs and flattens their ratios.) N-gram costs ~0.

`cost_curve` measures, for the batch-aware K policy (`specsamp.decoding.kpolicy`), the
seconds of whole decoding rounds at a batch size: a plain round and a round at each K, as
the engine runs them (`time_rounds`), not a sum of forwards, which leaves out what else a
drafted round does (the drafter's refresh and head, the acceptance, the bookkeeping) and
underrates drafting's cost (docs/measurements.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.compilation import compiled
from specsamp.decoding.config import SamplingParams, shape_key
from specsamp.decoding.decode import empty_state, generate, insert, prefill_chunks
from specsamp.decoding.drafters import ModelDrafter
from specsamp.models import ModelConfig, init_cache
from specsamp.quant import kernels


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


@dataclasses.dataclass(frozen=True)
class CostCurve:
    """Measured seconds of one decoding round of `batch` rows (slots) at each K: rounds[0]
    a plain round, rounds[K] a round that drafts K tokens and scores K+1; rounds['2x1'] a
    round of that token tree (`config.shape_key`)."""

    batch: int
    rounds: dict[int | str, float]


def shape_program(prog, shape):
    """(program, k) of the round program for `shape`: a chain's K (the program as it is),
    or a Tree (the program drafting that tree, k its depth)."""
    if isinstance(shape, int):
        return prog, shape
    return dataclasses.replace(prog, tree=shape), shape.max_depth


def _curve_path(engine, batch: int, slots: int, width: int) -> str:
    drafter = engine.prog.drafter
    # the native kernels' build and the code they run too (SPECSAMP_ISA may cap it): a
    # rebuilt or capped kernel changes every cost; so do the weights' formats (float,
    # stored blocks, their layout and activations: the tree's structure) and dtypes
    weights = (str(jax.tree.structure(engine.target_params)),
               tuple(str(a.dtype) for a in jax.tree.leaves(engine.target_params)))
    ident = repr(("rounds", jax.devices()[0].device_kind, platform.machine(), jax.__version__,
                  kernels.library_digest(), kernels.isa(), kernels.vnni(), weights,
                  engine.prog.target, engine.prog.kv_cache,
                  engine.prog.sampling, drafter.with_k(1) if drafter is not None else None,
                  engine.max_new_tokens, batch, engine.k.ks, slots, width)
                 + ((tuple(shape_key(t) for t in engine.k.trees),) if engine.k.trees else ()))
    name = hashlib.sha256(ident.encode()).hexdigest()[:16]
    root = os.environ.get("SPECSAMP_CACHE", os.path.expanduser("~/.cache/specsamp"))
    return os.path.join(root, "costs", f"{name}.json")


def time_rounds(engine, batch: int, slots: int, width: int, repeats: int = 5,
                rounds: int = 4) -> dict[int, float]:
    """Seconds of one round of `engine` at each K of engine.k.ks (0: plain) and each tree
    of engine.k.trees (keyed by `shape_key`) over `batch` slots, as its runner runs it:
    the round program at that K or tree (`decode.generate`, `shape_program`),
    `rounds` rounds a call, over all rows prefilled with `width` random tokens (in which a
    lookup drafter finds no match: the drafter's model round, the dearer one) and never
    stopping. The K values take turns in each of `repeats` repeats, each from a copy of
    the same state; a K's seconds are the median over repeats of its ratio to the first
    K's in the same repeat, times the first K's median (a drift of the machine's speed
    falls on every K alike)."""
    eng, b = engine, batch
    prompts = np.random.default_rng(0).integers(0, eng.prog.target.vocab_size, (b, width))
    traced = dict(target_params=eng.target_params, draft_params=eng.draft_params,
                  state=eng.place(empty_state(eng.prog, b, slots, eng.max_new_tokens)),
                  prompts=jnp.asarray(prompts, jnp.int32), lens=jnp.full((b,), width, jnp.int32),
                  seeds=jnp.zeros((b,), jnp.uint32), slots=jnp.arange(b, dtype=jnp.int32),
                  chunks=jnp.int32(prefill_chunks(width)))
    exe, _ = compiled(insert, dict(prog=eng.prog, max_new=eng.max_new_tokens), traced)
    start = jax.block_until_ready(exe(**traced))
    never = jnp.asarray(np.array([-1], np.int32))
    traced = dict(target_params=eng.target_params, draft_params=eng.draft_params, state=start,
                  eos_ids=never, stop_ids=never, max_rounds=jnp.int32(rounds),
                  refill_at=jnp.int32(b + 1))
    calls = [compiled(generate, dict(zip(("prog", "k"), shape_program(eng.prog, shape))), traced)[0]
             for shape in eng.k.shapes]
    seconds = [[] for _ in calls]
    for _ in range(repeats):
        for i, exe in enumerate(calls):
            state = jax.block_until_ready(jax.tree.map(jnp.copy, start))  # the call donates it
            t0 = time.perf_counter()
            ran = int(exe(**{**traced, "state": state})[1])  # waits for the call
            seconds[i].append((time.perf_counter() - t0) / max(ran, 1))
    first = statistics.median(seconds[0])
    return {shape_key(shape): first * statistics.median(s / s0 for s, s0 in zip(times, seconds[0]))
            for shape, times in zip(eng.k.shapes, seconds)}


def cost_curve(engine, batch: int, slots: int, width: int, repeats: int = 5) -> CostCurve:
    """The round costs of `engine` (its K values) over `batch` slots of `slots` cache
    positions and prompts `width` tokens wide, measured once per machine, model, drafter,
    settings and shape, and cached on disk under $SPECSAMP_CACHE/costs."""
    path = _curve_path(engine, batch, slots, width)
    if os.path.exists(path):
        with open(path) as fh:
            raw = json.load(fh)
        return CostCurve(batch, {int(k) if k.isdigit() else k: s for k, s in raw["rounds"].items()})
    rounds = time_rounds(engine, batch, slots, width, repeats)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump({"rounds": rounds}, fh)
    os.replace(path + ".tmp", path)  # atomic: parallel workers never read half a file
    return CostCurve(batch, rounds)
