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

The executables kept are bounded (least recently used first out, $SPECSAMP_MAX_EXECUTABLES,
default 48): each XLA:CPU executable holds memory mappings of its machine code, and a
process may hold at most vm.max_map_count of them (65530 by default). A long-lived process
that compiles many shapes (a pipeline worker, a test session) otherwise runs out, and XLA
then fails inside the next compile (seen as a segmentation fault).
"""

from __future__ import annotations

import collections
import os
import threading
import time

import jax
import numpy as np

_EXECUTABLES: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()


def _limit() -> int:
    return max(1, int(os.environ.get("SPECSAMP_MAX_EXECUTABLES", "48")))


def enable_compilation_cache(min_compile_seconds: float = 0.5) -> None:
    """Reuse compiled programs across processes (tests, workers, repeated CLI runs), in
    $SPECSAMP_JAX_CACHE or $SPECSAMP_CACHE/jax (default ~/.cache/specsamp/jax);
    SPECSAMP_JAX_CACHE=off leaves the persistent cache off. Programs that compile in less
    than `min_compile_seconds` are not stored."""
    if os.environ.get("SPECSAMP_JAX_CACHE") == "off":
        return
    path = os.environ.get("SPECSAMP_JAX_CACHE") or os.path.join(
        os.environ.get("SPECSAMP_CACHE", os.path.expanduser("~/.cache/specsamp")), "jax"
    )
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
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
            _EXECUTABLES.move_to_end(key)
            return _EXECUTABLES[key], 0.0
        t0 = time.perf_counter()
        exe = fn.lower(**static, **traced).compile()
        _EXECUTABLES[key] = exe
        while len(_EXECUTABLES) > _limit():
            _EXECUTABLES.popitem(last=False)
        return exe, time.perf_counter() - t0


def forget_executables() -> None:
    """Drop every executable this module keeps, and JAX's own caches of compiled
    functions, so that their machine code can be unmapped (see the module docstring)."""
    with _LOCK:
        _EXECUTABLES.clear()
    jax.clear_caches()


def memory_mappings() -> int | None:
    """How many memory mappings this process holds (Linux), else None."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None
