"""The first index of each row's largest value, shared by the models (a draft's greedy
tokens) and the decoding loop (greedy sampling, the target's greedy check)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NATIVE_ARGMAX_FROM = 1024  # vocabulary sizes where the kernel's argmax pays


def first_argmax(x: jax.Array, native: bool | None = None) -> jax.Array:
    """argmax over the last axis, first index on ties (as jnp.argmax; a row holding a NaN
    gives V - 1 on the kernel, and on XLA whatever its max reduction makes of a NaN: the
    index of the largest other value, or V - 1). On one CPU device with the native kernels,
    and a real vocabulary, one kernel call (`specsamp.quant.kernels.argmax`: one pass over
    the row where XLA makes three); elsewhere two vectorised reductions, which XLA:CPU runs
    faster than its fused argmax (figures: docs/measurements.md, native kernels). native:
    whether the native kernels run this program (decided once by its caller,
    `decoding.decode.Program.native`); None: decided now."""
    from specsamp.quant import kernels

    if native is None:
        native = kernels.on_one_cpu_device()
    if x.shape[-1] >= NATIVE_ARGMAX_FROM and native:
        return kernels.argmax(x)
    return xla_first_argmax(x)


def xla_first_argmax(x: jax.Array) -> jax.Array:
    """`first_argmax` in XLA operations (the reference, and the path off the kernels)."""
    v = x.shape[-1]
    at_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(at_max, jnp.arange(v, dtype=jnp.int32), v), axis=-1), v - 1)
