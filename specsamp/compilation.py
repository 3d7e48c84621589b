"""Compiling the decoding programs: the persistent cache, and compiling ahead of time so
that no timed call ever includes compilation.

`enable_compilation_cache` is called explicitly by the entry points (the command line, the
Beam handler's model load, the test session), never as a side effect of building a
generator: a library user keeps control of JAX's global configuration.

`compiled(fn, static, traced)` returns the executable of a `jax.jit` function for the
shapes of its traced arguments, compiling it first if this process has not met those shapes (and the
seconds that took). Executables are keyed on the static arguments and the shapes, dtypes
and placement (a tensor-parallel mesh) of the traced ones only: values (weights, seeds, stop ids, round limits) never
cause a compile.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import numpy as np

_EXECUTABLES: dict = {}
_LOCK = threading.Lock()


def enable_compilation_cache() -> None:
    """Reuse compiled programs across processes (tests, workers, repeated CLI runs), in
    $SPECSAMP_JAX_CACHE or $SPECSAMP_CACHE/jax (default ~/.cache/specsamp/jax);
    SPECSAMP_JAX_CACHE=off leaves the persistent cache off."""
    if os.environ.get("SPECSAMP_JAX_CACHE") == "off":
        return
    path = os.environ.get("SPECSAMP_JAX_CACHE") or os.path.join(
        os.environ.get("SPECSAMP_CACHE", os.path.expanduser("~/.cache/specsamp")), "jax"
    )
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def signature(args) -> tuple:
    """The tree structure, shapes, dtypes and shardings (devices) of `args`: all a compiled
    program depends on."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((np.shape(x), np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x),
                        getattr(x, "weak_type", False), getattr(x, "sharding", None)) for x in leaves)


def compiled(fn, static: dict, traced: dict) -> tuple[object, float]:
    """(executable of `fn` for these static arguments and the shapes of the traced ones,
    seconds spent compiling it now: 0 when this process compiled it before). Call the
    executable with the traced arguments by name: `exe(**traced)`."""
    key = (fn, tuple(sorted(static.items())), signature(traced))
    with _LOCK:  # workers may share a process; compile each program once
        if key in _EXECUTABLES:
            return _EXECUTABLES[key], 0.0
        t0 = time.perf_counter()
        _EXECUTABLES[key] = fn.lower(**static, **traced).compile()
        return _EXECUTABLES[key], time.perf_counter() - t0
