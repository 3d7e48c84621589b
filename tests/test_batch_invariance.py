"""A row's logits are bit for bit the same alone, in a call of up to 64 rows, as a K+1
scoring block or one token at a time: on XLA's attention and the native kernel, over
float32 and float16 caches (`specsamp.reductions` states why and how)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.models.model import Model
from specsamp.quant import kernels
from tests import tiny

PROMPT_LEN, BLOCK, SLOTS = 9, 5, 32  # a 9-token prefill, then a K+1 = 5 block
ROWS = 64
WATCHED = (0, 5, 63)  # rows compared with their own computation alone


def _tokens() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, tiny.TARGET.vocab_size, (ROWS, PROMPT_LEN + BLOCK)).astype(np.int32)


@functools.cache
def _forward(attention: str):
    model = Model(tiny.TARGET, attention=attention)
    return jax.jit(lambda p, t, pos, c: model.forward(p, t, pos, c)), model


def block_logits(rows, attention, dtype, single, params=None):
    """Logits [len(rows), BLOCK, V] of the last BLOCK tokens of `rows` (indices into
    _tokens()) after a prefill of the first PROMPT_LEN in one call: the block in one call,
    or (single) one token per call."""
    fwd, model = _forward(attention)
    params = tiny.target_params() if params is None else params
    toks = jnp.asarray(_tokens()[list(rows)])
    b, n = toks.shape
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    _, cache = fwd(params, toks[:, :PROMPT_LEN], pos[:, :PROMPT_LEN], model.init_cache(b, SLOTS, dtype))
    if not single:
        return np.asarray(fwd(params, toks[:, PROMPT_LEN:], pos[:, PROMPT_LEN:], cache)[0])
    out = []
    for i in range(PROMPT_LEN, n):
        logits, cache = fwd(params, toks[:, i:i + 1], pos[:, i:i + 1], cache)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


def _batch(size: int) -> list[int]:
    """`size` distinct rows holding the watched ones (where they fit), in a scrambled
    order, so a watched row sits at other slots in other batches."""
    rest = [r for r in np.random.default_rng(size).permutation(ROWS) if r not in WATCHED]
    rows = (list(WATCHED) + rest)[:size]
    return [rows[i] for i in np.random.default_rng(size + 1).permutation(size)]


CASES = [("xla", jnp.float32), ("xla", jnp.float16), ("cpu", jnp.float32), ("cpu", jnp.float16)]


@pytest.mark.parametrize("attention,dtype", CASES, ids=[f"{a}-{jnp.dtype(d).name}" for a, d in CASES])
def test_row_logits_bit_equal_in_any_batch_block_or_steps(attention, dtype):
    """Catches a reduction whose order depends on the rows or tokens in a call: RMSNorm's
    sum of squares as `jnp.mean` (XLA:CPU rounds it otherwise from 8 rows), a float
    product as one batched `jnp.dot`/`dot_general` (other bits from 2 rows, and a block's
    against single steps), XLA attention's einsums and softmax over the whole batch."""
    if attention == "cpu" and kernels.load():
        pytest.skip(kernels.load())
    alone = {r: block_logits([r], attention, dtype, single=True)[0] for r in WATCHED}
    for size in (3, 8, 64):
        rows = _batch(size)
        for single in (False, True):
            got = block_logits(rows, attention, dtype, single)
            for r in WATCHED:
                if r in rows:
                    np.testing.assert_array_equal(
                        got[rows.index(r)], alone[r],
                        err_msg=f"row {r} in a batch of {size}, {'steps' if single else 'block'}")


def test_batched_products_trade_bit_equal_rows_for_one_batched_program():
    """`reductions.batched_products` (distillation only): programs traced inside hold no
    per-row loop for their products and attention, give the per-row program's logits up
    to rounding, and the per-row default comes back after the block, also after an
    error inside it."""
    from specsamp import reductions

    if not reductions.per_row():
        pytest.skip("products already batched (several devices)")
    model = Model(tiny.TARGET, attention="xla")
    toks = jnp.asarray(_tokens()[:8])

    def program():
        fwd = jax.jit(lambda p, t: model.full_forward(p, t))
        return fwd, fwd.lower(tiny.target_params(), toks).as_text()

    per_row_fwd, per_row_text = program()
    with reductions.batched_products():
        assert not reductions.per_row()
        batched_fwd, batched_text = program()
    assert reductions.per_row()
    # the layers' scan is a loop in both; the per-row products and attention add theirs
    assert per_row_text.count("stablehlo.while") > batched_text.count("stablehlo.while") >= 1
    np.testing.assert_allclose(np.asarray(batched_fwd(tiny.target_params(), toks)),
                               np.asarray(per_row_fwd(tiny.target_params(), toks)), rtol=1e-4, atol=1e-5)
    with pytest.raises(ZeroDivisionError):
        with reductions.batched_products():
            1 / 0
    assert reductions.per_row()
