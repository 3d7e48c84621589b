"""Products with 8-bit activations ("stored-a8" weights, a8.h): the native kernels against
a float64 reference of the documented arithmetic, rows independent of the call, and the
rounding's effect on a product against the float path's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.quant import dequantize, from_gguf_blocks, kernels, matmul, to_qweight
from tests.test_quant import _kernel_or_skip, random_blocks

KINDS = ("Q4_1", "Q8_0")


def bytes_reference(x: np.ndarray):
    """x [R, C] float32 rounded as a8.h says: per block of 32, dx = max|x| / 127 and
    X = round-half-even(x * (127 / max|x|)); returns X (float64) and dx [R, C/32]."""
    r, c = x.shape
    blocks = x.reshape(r, c // 32, 32)
    a = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(a > 0, np.float32(127) / a, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((blocks * inv).astype(np.float32)), -127, 127)
    dx = (a / np.float32(127)).astype(np.float32)[..., 0]
    return q.astype(np.float64).reshape(r, c), dx.astype(np.float64)


def a8_reference(x: np.ndarray, fields: dict) -> np.ndarray:
    """y = sum over blocks of dx * (d * sum q X + m * sum X), in float64 from the stored
    fields: what the kernels compute but for float32 rounding of the per-block terms."""
    q, dx = bytes_reference(x)
    w = np.asarray(dequantize(to_qweight(fields, False, "xla")), np.float64)  # d * q (+ m)
    r, c = x.shape
    xs = (q.reshape(r, c // 32, 32) * dx[..., None]).reshape(r, c)  # dx * X
    return xs @ w.T


def a8_weight(fields: dict):
    return to_qweight(fields, False, "cpu", activations="int8")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows_x", [1, 5, 19])
def test_a8_kernel_matches_reference(kind, rows_x):
    """Catches a wrong byte layout of the codes (nibble halves, the 4-byte words), a wrong
    scale/minimum index, the q8 bias of 128 taken off wrongly, and rows written to the wrong
    place: the kernel's product equals the reference of a8.h's arithmetic to float32
    rounding. 19 rows: two passes of 8 and a tail of 3."""
    _kernel_or_skip()
    n, c = 208, 160
    fields = from_gguf_blocks(random_blocks(kind, n, c, seed=40), kind, n, c)
    x = np.random.default_rng(41).normal(size=(rows_x, c)).astype(np.float32)
    w = a8_weight(fields)
    assert w.activations == "int8" and w.layout == "tiles"
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x), w), np.float64)
    want = a8_reference(x, fields)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and it is a product of x: within the rounding of x to bytes of the float path's
    exact = x.astype(np.float64) @ np.asarray(dequantize(to_qweight(fields, False, "xla")), np.float64).T
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()
    assert np.abs(got - exact).max() > 1e-6 * np.abs(exact).max()  # it did round x


@pytest.mark.parametrize("kind", KINDS)
def test_a8_kernel_rows_independent_of_batch(kind):
    """Catches a row's product that depends on the other rows of the call (the byte
    preparation split across threads, passes of 8 rows): 70 rows together give, bit for bit,
    what each row gives alone, so scoring K + 1 tokens equals K + 1 single steps."""
    _kernel_or_skip()
    n, c = 128, 96
    fields = from_gguf_blocks(random_blocks(kind, n, c, seed=42), kind, n, c)
    w = a8_weight(fields)
    x = jnp.asarray(np.random.default_rng(43).normal(size=(70, c)).astype(np.float32))
    f = jax.jit(matmul)
    together = np.asarray(f(x, w))
    alone = np.concatenate([np.asarray(f(x[i:i + 1], w)) for i in range(70)])
    np.testing.assert_array_equal(together, alone)


def test_a8_kernel_matches_on_zero_and_non_finite_blocks():
    """Catches a division by a zero block's maximum (NaN where the product is 0) and an
    infinite input that does not reach the outputs: a zero block adds nothing, a row with
    an infinite input gives NaN outputs and leaves the other rows alone."""
    _kernel_or_skip()
    n, c = 32, 64
    fields = from_gguf_blocks(random_blocks("Q4_1", n, c, seed=44), "Q4_1", n, c)
    w = a8_weight(fields)
    x = np.random.default_rng(45).normal(size=(3, c)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 40] = np.inf
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x), w))
    assert np.all(np.isfinite(got[[0, 2]])) and np.all(np.isnan(got[1]))
    want = a8_reference(x[[0, 2]], fields)
    np.testing.assert_allclose(got[[0, 2]], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a8_needs_the_native_kernels():
    """A user asking for 8-bit activations off the native CPU kernels gets an error that
    says so, not float products under an int8 name."""
    fields = from_gguf_blocks(random_blocks("Q8_0", 32, 64, seed=46), "Q8_0", 32, 64)
    with pytest.raises(ValueError, match="native CPU kernels"):
        to_qweight(fields, False, "xla", activations="int8")


def test_stored_a8_is_refused_where_it_cannot_run(monkeypatch):
    """Clear errors, not a traceback or silent float products: with the XLA path forced
    (no native kernels), and on a tensor-parallel mesh."""
    from specsamp.errors import UserError
    from specsamp.loading import load_model

    with pytest.raises(UserError, match="tensor-parallel"):
        load_model("smollm2", weights="stored-a8", mesh=object())
    from specsamp.loading import _to_jax_tree

    monkeypatch.setenv("SPECSAMP_QUANT_BACKEND", "xla")
    fields = from_gguf_blocks(random_blocks("Q8_0", 32, 64, seed=47), "Q8_0", 32, 64)
    with pytest.raises(UserError, match="native CPU kernels"):
        _to_jax_tree({"w": {**fields, "transposed": False}}, None, "m", activations="int8")


@pytest.mark.slow
def test_stored_a8_greedy_speculation_equals_its_autoregressive_output():
    """The embedded model with 8-bit activations: its quantized matrices take them, and
    greedy speculation (the hybrid drafter in a chain and in a dynamic tree) gives its own
    autoregressive output token for token, since a call's rows do not change each other's
    products. Its output is close to the float path's (it is a slightly different model)."""
    _kernel_or_skip()
    from specsamp.decoding.config import SamplingParams
    from specsamp.decoding.decode import Program
    from specsamp.decoding.engine import Engine
    from specsamp.decoding.factory import build_drafter, file_loader
    from specsamp.decoding.tree import DynamicTree
    from specsamp.loading import load_model
    from specsamp.quant.blocks import is_quantized

    model = load_model("smollm2", weights="stored-a8")
    qs = [w for w in jax.tree.leaves(model.params, is_leaf=is_quantized) if is_quantized(w)]
    assert qs and all(w.activations == "int8" for w in qs)
    prompts = ["<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n"
               "<|im_start|>assistant\n", "The history of the printing press begins in"]
    ids, sp = [model.tokenizer.encode(p) for p in prompts], SamplingParams(0.0)

    def run(drafter=None, draft_params=None, tree=None):
        engine = Engine(Program(model.cfg, sp, drafter, tree=tree), model.params, draft_params,
                        eos_ids=tuple(model.tokenizer.eos_ids), max_new_tokens=40)
        return engine.run(ids, [0, 1])

    plain = run()
    assert all(len(r.token_ids) > 10 for r in plain)
    for k, tree in ((3, None), (DynamicTree.of(3).max_depth, DynamicTree.of(3))):
        d, dp = build_drafter("ngram+smollm2-feature", k, sp, model.cfg, model.params,
                              file_loader(model))
        spec = run(d, dp, tree)
        assert [s.token_ids for s in spec] == [a.token_ids for a in plain]
        assert sum(sum(s.accepted) for s in spec) > 0


def _a8_products(path: str) -> None:
    """Products of both formats on fixed inputs, saved to `path` (run in a subprocess)."""
    out = {}
    for kind in KINDS:
        fields = from_gguf_blocks(random_blocks(kind, 208, 160, seed=48), kind, 208, 160)
        x = 3 * np.random.default_rng(49).normal(size=(11, 160)).astype(np.float32)
        out[kind] = np.asarray(jax.jit(matmul)(jnp.asarray(x), a8_weight(fields)))
    np.savez(path, **out)


@pytest.mark.slow
def test_a8_portable_loop_gives_the_vector_codes_bits(tmp_path):
    """a8.h promises the same bits on every machine (so a run's outputs do not depend on
    whether the worker has VNNI): the portable loop, run in a process capped at it, gives
    the AVX-512 VNNI code's products bit for bit. Catches a vector path that sums in
    another order or fuses differently."""
    import os
    import subprocess
    import sys

    _kernel_or_skip()
    if not kernels.vnni():
        pytest.skip("this machine runs the portable loop for 8-bit activations")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"from tests.test_a8 import _a8_products; _a8_products({str(tmp_path / 'p.npz')!r})"
    env = {**os.environ, "SPECSAMP_ISA": "portable", "PYTHONPATH": root}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    _a8_products(str(tmp_path / "v.npz"))
    portable, vector = np.load(tmp_path / "p.npz"), np.load(tmp_path / "v.npz")
    for kind in KINDS:
        np.testing.assert_array_equal(portable[kind], vector[kind])
