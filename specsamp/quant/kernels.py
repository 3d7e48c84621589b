"""The native CPU kernels (qkernels.cc, attention.cc, reduce.cc) as XLA FFI targets, and the
choice of backend.

The shared library is built from source by the package's install (`pip install -e .`, or
`python setup.py build_ext --inplace`) with the machine's C++ compiler and the FFI headers
that ship with jaxlib. Where it is missing (or on TPU/GPU) quantized products run on the
pure-XLA reference path (`specsamp.quant.blocks.matmul`), with one message saying so.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

_LOCK = threading.Lock()
_STATE: dict = {}
_TARGETS = {"specsamp_qmatmul": "SpecsampQMatmul", "specsamp_attend": "SpecsampAttend",
            "specsamp_attend_tree": "SpecsampAttendTree", "specsamp_argmax": "SpecsampArgmax",
            "specsamp_tree_sum": "SpecsampTreeSum", "specsamp_sample": "SpecsampSample",
            "specsamp_residual_sample": "SpecsampResidualSample",
            "specsamp_residual_mass": "SpecsampResidualMass", "specsamp_top_value": "SpecsampTopValue",
            "specsamp_nucleus_cut": "SpecsampNucleusCut"}
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512"}


def library_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_qkernels*.so")))
    return found[0] if found else None


def library_digest() -> str:
    """A short hash of the built kernel library ('' when none): measurements of its speed
    cached on disk (cost curves) are keyed on it, so a rebuilt kernel is measured afresh."""
    with _LOCK:
        if "digest" not in _STATE:
            path = library_path()
            if path is None:
                _STATE["digest"] = ""
            else:
                with open(path, "rb") as fh:
                    _STATE["digest"] = hashlib.sha256(fh.read()).hexdigest()[:16]
        return _STATE["digest"]


def load() -> str | None:
    """Register the FFI targets once. Returns None when ready, else why not (one line)."""
    with _LOCK:
        if "error" not in _STATE:
            _STATE["error"] = _load()
        return _STATE["error"]


def _load() -> str | None:
    path = library_path()
    if path is None:
        return ("native quantized kernels not built (run `pip install -e .` or "
                "`python setup.py build_ext --inplace`)")
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        for name, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        _STATE["isa"] = ISA_NAMES.get(int(lib.specsamp_isa()), "?")
        _STATE["amx"] = bool(lib.specsamp_amx())
        _STATE["vnni"] = bool(lib.specsamp_vnni())
    except (OSError, AttributeError, RuntimeError, ValueError) as e:
        return f"native quantized kernels unusable ({type(e).__name__}: {e})"
    return None


def isa() -> str | None:
    """'amx', 'avx512', 'avx2' or 'portable': the code the kernels run (None: not
    loaded). 'amx': AVX-512 plus the tile unit, for weights in the tile layout."""
    return None if load() else ("amx" if _STATE.get("amx") else _STATE.get("isa"))


def amx() -> bool:
    """Whether the kernels run products on AMX tiles (weights then take the tile layout,
    `specsamp.quant.blocks.to_qweight`). SPECSAMP_ISA=avx512 (or lower) turns it off."""
    return isa() == "amx"


def vnni() -> bool:
    """Whether products with 8-bit activations ("stored-a8") run on AVX-512 VNNI (else the
    portable loop: the same numbers, slower)."""
    return not load() and _STATE["vnni"]


def default_backend() -> str:
    """'cpu' (native kernels) on a CPU backend where they load, else 'xla'.
    SPECSAMP_QUANT_BACKEND=xla forces the reference path."""
    if os.environ.get("SPECSAMP_QUANT_BACKEND", "").lower() == "xla":
        return "xla"
    if jax.default_backend() != "cpu":
        return "xla"
    error = load()
    if error:
        if not _STATE.get("warned"):
            _STATE["warned"] = True
            print(f"specsamp: {error}; using the slower XLA path for quantized weights",
                  file=sys.stderr)
        return "xla"
    return "cpu"


def on_one_cpu_device() -> bool:
    """Whether calls traced now can take the kernels that do not shard: one device, the
    native kernels' backend (the argmax; attention over the KV cache)."""
    return jax.device_count() == 1 and default_backend() == "cpu"


def supports(w) -> bool:
    """Whether the kernels take this QWeight's layout (Q4_0 with float32 minimums do not)."""
    if w.bits == 4:
        return w.scale.dtype == jnp.float16 and w.min is not None and w.min.dtype == jnp.float16
    return w.scale.dtype in (jnp.float16, jnp.float32)


def qmatmul(x: jax.Array, w) -> jax.Array:
    """x [..., C] @ W.T with W [N, C] in blocks, on the kernels."""
    return qmatmul_many(x, [w])[0]


def qmatmul_many(x: jax.Array, ws) -> list[jax.Array]:
    """[x @ W.T for W in ws] in one kernel call (one split of the work, one dispatch): the
    weights must share their format (4 or 8 bits), their input width and, for layer views,
    the layer index. A layer view (w.layer set) passes the whole stack [L, N, ...] and the
    index: the kernel reads the layer in place, so XLA copies nothing."""
    lead, c = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, c).astype(jnp.float32)
    bits, layer, layout, act = ws[0].bits, ws[0].layer, ws[0].layout, ws[0].activations
    operands, outs = [], []
    for w in ws:
        if (w.bits != bits or (w.layer is None) != (layer is None) or w.layout != layout
                or w.activations != act):
            raise ValueError("one kernel call takes weights of one format, layout and "
                             "activations, all layer views or none")
        if w.layer is None:
            stack = lambda a: None if a is None else a.reshape((1,) + a.shape)
            codes, scale, minimum = stack(w.codes), stack(w.scale), stack(w.min)
        else:
            codes, scale, minimum = w.codes, w.scale, w.min
        if codes.ndim != 3:
            raise ValueError(f"kernel operands must be one matrix or one stack, got {codes.shape}")
        operands += [codes, scale] + ([minimum] if bits == 4 else [])
        outs.append(jax.ShapeDtypeStruct((x2.shape[0], w.rows), jnp.float32))
    index = jnp.int32(0) if layer is None else layer
    ys = jax.ffi.ffi_call("specsamp_qmatmul", outs)(index, x2, *operands, bits=np.int32(bits),
                                                    tiles=np.int32(layout == "tiles"),
                                                    act8=np.int32(act == "int8"))
    return [y.reshape(*lead, w.rows) for y, w in zip(ys, ws)]


def argmax(x: jax.Array) -> jax.Array:
    """x [..., V] -> [...] int32: the first index of each row's largest value (V - 1 for a
    row holding a NaN), on the kernel: `specsamp.models.argmax.first_argmax`'s XLA answer on
    every row without a NaN."""
    lead, v = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, v).astype(jnp.float32)
    out = jax.ffi.ffi_call("specsamp_argmax", jax.ShapeDtypeStruct((rows.shape[0],), jnp.int32),
                           vmap_method="broadcast_all")(rows)
    return out.reshape(lead)


def _by_row(target: str, x: jax.Array, dtype, *more: jax.Array, **attrs) -> jax.Array:
    """One value per row of x [..., N] (float32) from the kernel `target` (reduce.cc), with
    `more` operands of one value per row and the kernel's attributes `attrs`; vmapped
    callers batch into the same call."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape[:-1], dtype),
                            vmap_method="broadcast_all")
    return call(x.astype(jnp.float32), *more, **attrs)


def tree_sum(x: jax.Array) -> jax.Array:
    """x [..., N] -> [...]: `specsamp.reductions.tree_sum` over the last axis, bit for bit."""
    return _by_row("specsamp_tree_sum", x, jnp.float32)


def sample(probs: jax.Array, u: jax.Array) -> jax.Array:
    """probs [..., V], u [...] uniform in [0, 1) -> [...] int32: the draw of
    `specsamp.decoding.sampling._sample_row` with that u, bit for bit."""
    return _by_row("specsamp_sample", probs, jnp.int32, u.astype(jnp.float32))


def residual_sample(q: jax.Array, p: jax.Array, u: jax.Array, scale: jax.Array) -> jax.Array:
    """q, p [..., V], u, scale [...] -> [...] int32: `specsamp.decoding.sampling.draw` of
    `sampling.residual(scale q, p)` with that u, bit for bit, in one kernel."""
    return _by_row("specsamp_residual_sample", q, jnp.int32, p.astype(jnp.float32),
                   u.astype(jnp.float32), scale.astype(jnp.float32))


def residual_mass(q: jax.Array, p: jax.Array, scale: jax.Array) -> jax.Array:
    """q [..., Rq, V], p [..., Rp, V], scale [..., M] (Rq, Rp > M) -> [..., M] float32:
    `sampling.residual_mass`, bit for bit, reading rows 1..M where they lie."""
    call = jax.ffi.ffi_call("specsamp_residual_mass", jax.ShapeDtypeStruct(scale.shape, jnp.float32),
                            vmap_method="broadcast_all")
    return call(q.astype(jnp.float32), p.astype(jnp.float32), scale.astype(jnp.float32))


def top_value(x: jax.Array, k: int) -> jax.Array:
    """x [..., N] -> [...] float32: each row's k-th largest entry, `lax.top_k(x, k)[0][...,
    k - 1]` bit for bit (its total order: NaN of either sign at the ends)."""
    return _by_row("specsamp_top_value", x, jnp.float32, k=np.int32(k))


def nucleus_cut(probs: jax.Array, tiers: tuple[int, int], top_p: float) -> jax.Array:
    """probs [..., V] -> [...] float32: `sampling._nucleus_tiers`'s cut with those two
    tiers, bit for bit (NaN where XLA's is NaN), each row on its own."""
    return _by_row("specsamp_nucleus_cut", probs, jnp.float32, first=np.int32(tiers[0]),
                   second=np.int32(tiers[1]), top_p=np.float32(top_p))


def attend(layer, q, k, v, positions, k_cache, v_cache, scale: float, window=0,
           softcap: float | None = None, paths=None):
    """One layer's cache write and attention on the kernel (attention.cc).

    q [B, T, H, E], k/v [B, T, J, E] (this call's, rotated), positions [B, T], caches
    [L, B, J, S, E] float32 or float16 (both alike). Returns (out [B, T, H, E], k_cache,
    v_cache) with this call's keys/values written at layer `layer` (rounded to the cache's
    type); the caches are updated in place (aliased). window (an int32 scalar, may be
    traced): a query at position p attends to slots p - window < slot <= p (0: all slots
    up to p). softcap: scores (scaled) become softcap * tanh(score / softcap) (None: kept).
    paths: int32 [B, T, P], a token tree's block (`specsamp.models.llama.run_layers`):
    token t is written at slot positions[b, 0] + t, and reads the slots before the block
    and then, in the place of slots start..p, the block slots start + paths[b, t, :p-start+1]
    (the window and soft cap by position, as for a chain). None: the plain kernel."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    cache = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    target = "specsamp_attend" if paths is None else "specsamp_attend_tree"
    call = jax.ffi.ffi_call(target, (out, cache, cache), input_output_aliases={5: 1, 6: 2})
    operands = [jnp.asarray(layer, jnp.int32), q.astype(jnp.float32), k.astype(jnp.float32),
                v.astype(jnp.float32), positions.astype(jnp.int32), k_cache, v_cache,
                jnp.asarray(window, jnp.int32)]
    if paths is not None:
        operands.append(jnp.asarray(paths, jnp.int32))
    return call(*operands, scale=np.float32(scale), softcap=np.float32(softcap or 0.0))
