"""Quantized weights kept as blocks (specsamp.quant): the decoded values against gguf-py's
own dequantizer, and products on the native kernels against the XLA reference."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.quant import QWeight, dequantize, dequantize_rows, from_gguf_blocks, matmul
from specsamp.quant import kernels, to_qweight
from specsamp.quant.blocks import plain, quantize_int8_rows, take_rows, tile_fields, tileable

KINDS = ("Q4_0", "Q4_1", "Q8_0")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [rows, bytes per row] with random codes and plausible scales."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    d = rng.uniform(-0.02, 0.02, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    if kind == "Q8_0":
        q = rng.integers(-128, 128, (rows, nb, 32)).astype(np.int8).view(np.uint8)
        parts = [d, q]
    elif kind == "Q4_1":
        m = rng.uniform(-0.2, 0.2, (rows, nb, 1)).astype(np.float16).view(np.uint8)
        parts = [d, m, rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)]
    else:
        parts = [d, rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def qweight(fields: dict, backend: str, transposed: bool = False) -> QWeight:
    """As the loader builds it: on the "cpu" backend of an AMX machine, in the tile layout
    where the matrix takes it (whole groups of 16 outputs), so the tests below run the
    tile kernels there and the AVX-512 ones under SPECSAMP_ISA=avx512."""
    return to_qweight(fields, transposed, backend)


@pytest.mark.parametrize("kind", KINDS)
def test_decoded_values_equal_gguf_dequantizer(kind):
    """Catches a wrong block layout (nibble order, scale/min offsets, Q4_0's -8 shift): our
    float32 values must be bit-identical to llama.cpp's reference dequantizer's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    raw = random_blocks(kind, 8, 96)
    want = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(8, 96).astype(np.float32)
    w = qweight(from_gguf_blocks(raw, kind, 8, 96), "xla")
    np.testing.assert_array_equal(np.asarray(dequantize(w)), want)
    ids = jnp.asarray([5, 0, 5, 7])
    np.testing.assert_array_equal(np.asarray(dequantize_rows(w, ids)), want[[5, 0, 5, 7]])
    t = qweight(from_gguf_blocks(raw, kind, 8, 96), "xla", transposed=True)
    np.testing.assert_array_equal(np.asarray(dequantize(t)), want.T)


def _kernel_or_skip():
    """Skip where the kernels were not built, except in CI (CI=true), where the clean
    clone's install must have built them: there a missing kernel fails."""
    error = kernels.load()
    if error and os.environ.get("CI"):
        pytest.fail(f"CI: {error}")
    if error:
        pytest.skip(error)


@pytest.mark.parametrize("kind", KINDS + ("int8",))
@pytest.mark.parametrize("rows_x", [1, 5, 70])
@pytest.mark.parametrize("n", [200, 208])
def test_kernel_matches_reference(kind, rows_x, n):
    """Catches kernel bugs (wrong block indexing, tails of row chunks, R > one pass of
    rows, threads writing the wrong rows, a wrong tile layout or limb arithmetic): the
    native product equals x @ W.T computed in float64 from gguf-py's values, to float32
    rounding. n not a multiple of the 64-row chunk; 208 (13 groups of 16) takes the tile
    path on AMX, 200 the AVX-512 one."""
    _kernel_or_skip()
    c = 160
    if kind == "int8":
        dense = np.random.default_rng(1).normal(size=(n, c)).astype(np.float32)
        fields = quantize_int8_rows(dense)
    else:
        fields = from_gguf_blocks(random_blocks(kind, n, c, seed=2), kind, n, c)
    x = np.random.default_rng(3).normal(size=(rows_x, c)).astype(np.float32)
    ref = np.asarray(dequantize(qweight(fields, "xla")), np.float64)
    want = x.astype(np.float64) @ ref.T
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x), qweight(fields, "cpu")))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    xla = np.asarray(jax.jit(matmul)(jnp.asarray(x), qweight(fields, "xla")))
    np.testing.assert_allclose(xla, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# (kind, outputs, inputs): 130 outputs take the row-pass kernels only; 112 x 96 (q4) also
# the many-row path from 24 rows (chunks of 64 and 48 outputs, 3 blocks per row).
# On AMX, 112 and 128 outputs take the tile path (96 inputs: an odd number of blocks).
ROWS_CASES = [("Q4_1", 130, 64), ("Q8_0", 130, 64), ("Q4_1", 112, 96), ("Q8_0", 128, 96)]


@pytest.mark.parametrize("kind,n,c", ROWS_CASES)
def test_kernel_rows_independent_of_batch(kind, n, c):
    """Catches a kernel whose result for a row depends on the other rows in the call: the
    K+1 scoring block must give what single steps give (greedy equality rests on it), and
    the many-row path (prefill, large batches) what the one-row path gives, bit for bit. On
    AMX, q4 calls of 8 rows or more write x as pairs instead of limbs (amx.h): the same
    numbers."""
    _kernel_or_skip()
    fields = from_gguf_blocks(random_blocks(kind, n, c, seed=4), kind, n, c)
    w = qweight(fields, "cpu")
    # 70 rows: passes of up to 12 rows, and more than one block of input rows
    x = jnp.asarray(np.random.default_rng(5).normal(size=(70, c)).astype(np.float32))
    f = jax.jit(matmul)
    together = np.asarray(f(x, w))
    alone = np.concatenate([np.asarray(f(x[i:i + 1], w)) for i in range(70)])
    np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(np.asarray(f(x[:6], w)), alone[:6])
    want = np.asarray(x, np.float64) @ np.asarray(dequantize(qweight(fields, "xla")), np.float64).T
    np.testing.assert_allclose(together, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_int8_rows_round_to_nearest():
    """Catches a wrong per-channel scale: every decoded weight is within half a step of
    its float source, and each row's largest weight is exact."""
    dense = np.random.default_rng(6).normal(size=(7, 64)).astype(np.float32)
    w = qweight(quantize_int8_rows(dense), "xla")
    back = np.asarray(dequantize(w))
    step = np.abs(dense).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(back - dense) <= step / 2 + 1e-7)
    i = np.abs(dense).argmax(axis=1)
    np.testing.assert_allclose(back[np.arange(7), i], dense[np.arange(7), i], rtol=1e-6)


def test_layer_view_reads_the_right_layer():
    """Catches wrong layer offsets in the kernels (codes, scales or minimums of another
    layer): a view (whole stack + index) multiplies like the sliced layer on XLA."""
    _kernel_or_skip()
    from specsamp.quant import layer_view

    for kind in ("Q4_1", "Q8_0"):
        layers = [from_gguf_blocks(random_blocks(kind, 48, 64, seed=10 + i), kind, 48, 64)
                  for i in range(3)]
        stacked = {k: None if layers[0][k] is None else np.stack([f[k] for f in layers])
                   for k in layers[0]}
        w = qweight(stacked, "cpu")
        x = jnp.asarray(np.random.default_rng(7).normal(size=(3, 64)).astype(np.float32))
        for i in range(3):
            view = jax.jit(lambda w, i: matmul(x, layer_view(w, i)))(w, jnp.int32(i))
            want = matmul(x, qweight(layers[i], "xla"))
            np.testing.assert_allclose(np.asarray(view), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_one_call_for_several_matrices(kind):
    """Catches a multi-matrix kernel call (q, k, v in one call) that mixes up its
    matrices, their layers or their outputs' chunks: each output equals its own
    single-matrix call exactly, for stacked layer views, and the call is one kernel call."""
    _kernel_or_skip()
    from specsamp.quant import layer_view, matmul_many

    shapes = [(208, 96), (80, 96), (64, 96)]  # rows not multiples of the 64-row chunk
    stacks = []
    for m, (n, c) in enumerate(shapes):
        layers = [from_gguf_blocks(random_blocks(kind, n, c, seed=20 + 3 * m + i), kind, n, c)
                  for i in range(3)]
        stacks.append(qweight({k: None if layers[0][k] is None else np.stack([f[k] for f in layers])
                               for k in layers[0]}, "cpu"))
    x = jnp.asarray(np.random.default_rng(8).normal(size=(5, 96)).astype(np.float32))

    def together(ws, i):
        return matmul_many(x, [layer_view(w, i) for w in ws])

    def alone(ws, i):
        return [matmul(x, layer_view(w, i)) for w in ws]

    text = jax.jit(together).lower(stacks, jnp.int32(1)).as_text()
    assert text.count("specsamp_qmatmul") == 1
    for i in range(3):
        got = jax.jit(together)(stacks, jnp.int32(i))
        want = jax.jit(alone)(stacks, jnp.int32(i))
        for g, w, (n, _) in zip(got, want, shapes):
            assert g.shape == (5, n)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# Outside the fast lane: a subprocess reruns the kernel test files per instruction set
# (an interpreter and the kernel tests each time), and no exactness property depends on
# which set runs.
@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_kernels_on_other_instruction_sets(isa):
    """This machine runs the AMX or AVX-512 code; others run AVX-512 without tiles, the AVX2
    or the portable loops (their own row limits per pass, their own decoding; attention's
    own score and weighted-sum loops). Catches a bug in those paths: the kernel tests above
    and the attention kernel's, rerun in a process whose kernels are capped at `isa`."""
    import subprocess
    import sys

    _kernel_or_skip()
    order = ["portable", "avx2", "avx512", "amx"]
    if order.index(kernels.isa()) <= order.index(isa):
        pytest.skip(f"this machine runs {kernels.isa()}: the tests above ran that path")
    env = {**os.environ, "SPECSAMP_ISA": isa}
    probe = subprocess.run([sys.executable, "-c", "from specsamp.quant import kernels; print(kernels.isa())"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip() == isa, probe.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", __file__,
         os.path.join(os.path.dirname(__file__), "test_attention_kernel.py"),
         os.path.join(os.path.dirname(__file__), "test_a8.py"),
         "-k", "kernel_matches or rows_independent or several_matrices or layer_view or argmax "
               "or rows_alike or ignores_later_slots"],
        env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_tile_layout_reads_as_the_gguf_one(kind):
    """Catches a wrong permutation into or out of the tile layout (any machine: the XLA
    path reads it too): the same values whole, by rows (an embedding lookup) and as a
    reduced head, and back to the GGUF bytes."""
    n, c = 48, 96
    fields = from_gguf_blocks(random_blocks(kind, n, c, seed=30), kind, n, c)
    assert tileable(fields)
    bits = 8 if kind == "Q8_0" else 4
    gguf = qweight(fields, "xla")
    tiled = QWeight(*(None if fields[k] is None else jnp.asarray(v) for k, v in
                      tile_fields(fields, bits).items()), bits=bits, block=32, transposed=False,
                   layout="tiles")
    assert not np.array_equal(np.asarray(tiled.codes), fields["codes"])
    want = np.asarray(dequantize(gguf))
    np.testing.assert_array_equal(np.asarray(dequantize(tiled)), want)
    ids = jnp.asarray([17, 0, 47, 17, 31])
    np.testing.assert_array_equal(np.asarray(dequantize_rows(tiled, ids)), want[np.asarray(ids)])
    back = plain(tiled)
    np.testing.assert_array_equal(np.asarray(back.codes), fields["codes"])
    np.testing.assert_array_equal(np.asarray(back.scale), fields["scale"])
    head_ids = jnp.asarray(np.random.default_rng(0).permutation(n)[:32])
    head = take_rows(tiled, head_ids, transposed=True)
    assert head.layout == "tiles"
    np.testing.assert_array_equal(np.asarray(dequantize(head)), want[np.asarray(head_ids)].T)
    assert take_rows(tiled, head_ids[:5], transposed=False).layout == "gguf"


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows_x", [7, 20])
def test_tile_products_within_the_limbs_bound(kind, rows_x):
    """Catches limbs that hold less of x than documented (amx.h: each row as integers below
    2^22 times a power of two, an error of at most 2^-22 of the row's largest |x|): every
    product on the tile path is within that rounding's bound, sum_k 2^-22 max|x_r| |w_nk|,
    plus float32's own rounding of the sums, of the float64 product; rows of very
    different scales, one with a single large input (the others are rounded against it).
    20 rows: q4 takes pairs (amx.h), q8 two passes of limbs."""
    _kernel_or_skip()
    if not kernels.amx():
        pytest.skip(f"no AMX here ({kernels.isa()})")
    n, c = 64, 256
    fields = from_gguf_blocks(random_blocks(kind, n, c, seed=50), kind, n, c)
    w = qweight(fields, "cpu")
    assert w.layout == "tiles"
    x = np.random.default_rng(11).normal(size=(rows_x, c)).astype(np.float32)
    x *= np.float32(10.0) ** (np.arange(rows_x, dtype=np.float32) % 7 - 3)[:, None]
    x[2, 5] = 1000.0
    ref = np.asarray(dequantize(qweight(fields, "xla")), np.float64)
    want = x.astype(np.float64) @ ref.T
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x), w), np.float64)
    absw = np.abs(ref).sum(axis=1)[None, :]
    limbs = 2.0 ** -22 * np.abs(x).max(axis=1, keepdims=True) * absw
    rounding = 2.0 ** -24 * c * (np.abs(x).astype(np.float64) @ np.abs(ref).T)
    assert (np.abs(got - want) <= limbs + rounding).all()


def test_tile_path_where_amx():
    """On an AMX machine the loader puts Q4 / Q8_0 matrices of whole groups of 16 outputs
    in the tile layout (else the tests above would not run the tile kernels there), and
    others stay in the GGUF one."""
    _kernel_or_skip()
    if not kernels.amx():
        pytest.skip(f"no AMX here ({kernels.isa()})")
    fields = from_gguf_blocks(random_blocks("Q4_1", 64, 64), "Q4_1", 64, 64)
    assert qweight(fields, "cpu").layout == "tiles"
    assert qweight(fields, "xla").layout == "gguf"
    odd = from_gguf_blocks(random_blocks("Q8_0", 40, 64), "Q8_0", 40, 64)
    assert qweight(odd, "cpu").layout == "gguf"


@pytest.mark.parametrize("v", [5, 16, 37, 49152])
def test_native_argmax_is_first_argmax(v):
    """Catches a kernel argmax that differs from the XLA one greedy decoding used before:
    first index on ties (within a vector's lanes, across lanes and in the tail), -inf rows,
    leading axes, a NaN row giving V - 1; and `first_argmax` takes the kernel for a real
    vocabulary here."""
    _kernel_or_skip()
    from specsamp.models import argmax

    rng = np.random.default_rng(v)
    x = rng.normal(size=(6, v)).astype(np.float32)
    x[0] = np.round(x[0])  # many ties
    x[1] = -np.inf
    x[2, v // 2] = np.nan
    x[3, [v - 1, 0]] = 50.0  # the first of two maxima, at both ends
    x[4, [v // 3, v - 1]] = 60.0
    x = jnp.asarray(x.reshape(2, 3, v))
    got = np.asarray(jax.jit(kernels.argmax)(x)).ravel()
    want = np.asarray(argmax.xla_first_argmax(x)).ravel()
    # (XLA's answer for the NaN row depends on its reduction: NaN-propagating or not)
    np.testing.assert_array_equal(got[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]])
    np.testing.assert_array_equal(got[[1, 2, 3, 4]], [0, v - 1, 0, v // 3])
    if v >= argmax.NATIVE_ARGMAX_FROM and jax.device_count() == 1:
        assert "specsamp_argmax" in jax.jit(argmax.first_argmax).lower(x).as_text()
