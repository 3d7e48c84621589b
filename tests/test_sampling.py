"""The logits -> probabilities transform against a plain Python reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.sampling import probs_from_logits, residual
from specsamp.errors import UserError


def reference_probs(logits, temperature, top_k, top_p):
    """Textbook version, one row, plain Python: temperature, top-k, top-p, renormalise."""
    v = len(logits)
    if temperature == 0:
        best = max(range(v), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)]
    z = [x / temperature for x in logits]
    keep = set(range(v))
    if 0 < top_k < v:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = {i for i in keep if z[i] >= kth}
    m = max(z[i] for i in keep)
    e = {i: math.exp(z[i] - m) for i in keep}
    s = sum(e.values())
    probs = {i: e[i] / s for i in keep}
    if top_p < 1.0:
        ranked = sorted(probs.values(), reverse=True)
        mass, cut = 0.0, ranked[0]
        for p in ranked:
            if mass >= top_p:
                break
            cut, mass = p, mass + p
        probs = {i: p for i, p in probs.items() if p >= cut}
        s = sum(probs.values())
        probs = {i: p / s for i, p in probs.items()}
    return [probs.get(i, 0.0) for i in range(v)]


SETTINGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
            (0.8, 7, 0.9), (1.0, 1, 1.0), (2.0, 0, 0.3)]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_matches_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 2
    got = np.asarray(probs_from_logits(jnp.asarray(logits), SamplingParams(temperature, top_k, top_p)))
    for row, out in zip(logits, got):
        want = reference_probs(row.tolist(), temperature, top_k, top_p)
        np.testing.assert_allclose(out, want, atol=1e-6)
        assert out.dtype == np.float32 and abs(out.sum() - 1) < 1e-5


def test_residual_is_positive_part_normalised_and_falls_back_to_q():
    q = jnp.array([0.5, 0.3, 0.2, 0.0])
    p = jnp.array([0.2, 0.5, 0.1, 0.2])
    np.testing.assert_allclose(residual(q, p), [0.75, 0.0, 0.25, 0.0], atol=1e-7)
    np.testing.assert_allclose(residual(q, q), q)  # (q - q)+ is empty: fall back to q


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-1), dict(temperature=float("nan"))])
def test_bad_settings_are_user_errors(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("scale", [0.5, 6.0])  # flat: nucleus wider than 256 tokens; peaky: narrower
def test_nucleus_fast_and_full_paths_match_reference(scale):
    """Over 256 tokens the nucleus cut is looked for in the top 256 first; a wide nucleus
    falls back to a full sort. Both must give the reference's distribution."""
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(3, 1000)) * scale).astype(np.float32)
    got = np.asarray(probs_from_logits(jnp.asarray(logits), SamplingParams(1.0, 0, 0.9)))
    kept = (got > 0).sum(axis=-1)
    assert (kept > 256).all() if scale < 1 else (kept < 256).all()
    for row, out in zip(logits, got):
        np.testing.assert_allclose(out, reference_probs(row.tolist(), 1.0, 0, 0.9), atol=1e-6)


@pytest.mark.parametrize("scale,lo,hi", [(2.5, 256, 4096), (0.2, 4096, 6000)])
def test_nucleus_second_tier_and_full_sort_match_reference(scale, lo, hi):
    """A nucleus of 256-4,096 tokens is cut among the top 4,096 (second tier), a wider one
    after a full sort: both give the reference's distribution."""
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(2, 6000)) * scale).astype(np.float32)
    got = np.asarray(probs_from_logits(jnp.asarray(logits), SamplingParams(1.0, 0, 0.9)))
    kept = (got > 0).sum(axis=-1)
    assert ((kept > lo) & (kept <= hi)).all(), kept
    for row, out in zip(logits, got):
        np.testing.assert_allclose(out, reference_probs(row.tolist(), 1.0, 0, 0.9), atol=1e-6)


def test_top_k_and_nucleus_cut_compile_without_a_full_sort(monkeypatch):
    """XLA:CPU turns a sliced lax.top_k into a sort of the whole row (~7 ms at 49k
    tokens); `sampling.top_k` keeps its fast call. Top-k sampling has no sort at all; with
    top-p, the only sort is the wide-nucleus fallback's. On the XLA path (several devices,
    no native kernels; the native one sorts nothing in XLA). Catches the barrier removed."""
    from specsamp.decoding import sampling

    monkeypatch.setattr(sampling, "NATIVE_ROWS_FROM", 1 << 62)
    logits = jnp.zeros((1, 4096), jnp.float32)

    def sorts(sp):
        text = jax.jit(lambda x: probs_from_logits(x, sp)).lower(logits).compile().as_text()
        return text.count(" sort(")

    assert sorts(SamplingParams(1.0, 50, 1.0)) == 0
    assert sorts(SamplingParams(1.0, 0, 0.9)) == 1


def test_nucleus_batch_of_one_wide_and_one_peaked_row():
    """The fast path may serve a batch only when EVERY row's nucleus fits in the top 256:
    catches a coverage check over any row instead of all (the wide row would then keep at
    most 256 tokens where about 785 belong)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 1000)).astype(np.float32) * np.array([[0.5], [6.0]], np.float32)
    got = np.asarray(probs_from_logits(jnp.asarray(logits), SamplingParams(1.0, 0, 0.9)))
    kept = (got > 0).sum(axis=-1)
    assert kept[0] > 256 > kept[1], kept
    for row, out in zip(logits, got):
        np.testing.assert_allclose(out, reference_probs(row.tolist(), 1.0, 0, 0.9), atol=1e-6)


def _boundary_row():
    """A row whose top-256 mass, summed as the cut sums it (a running sum), is smaller
    than the same numbers added by jnp.sum: the two disagree on whether top_p = that
    running mass + 1 ulp is covered by the top 256."""
    import jax

    from specsamp.reductions import cumsum

    for seed in range(100):
        probs = np.random.default_rng(seed).gamma(0.5, size=1000).astype(np.float32)
        probs /= probs.sum()
        top = jax.lax.top_k(jnp.asarray(probs), 256)[0]
        running = np.float32(cumsum(top)[-1])
        if np.float32(jnp.sum(top)) > running:
            return jnp.asarray(probs[None]), running
    raise AssertionError("no row where sum and running sum differ")


def test_nucleus_fast_path_equals_full_sort_at_the_boundary():
    """At top_p equal to the top 256's running mass the nucleus is exactly those 256
    tokens (fast path); one ulp above, the 257th is needed (full sort). Catches a coverage
    check that adds the top differently from the cut (jnp.sum vs the running sum): it
    would call the top covered and drop the 257th token the full sort keeps."""
    from specsamp.decoding.sampling import _nucleus

    probs, running = _boundary_row()
    at = np.asarray(jax.jit(_nucleus, static_argnums=1)(probs, float(running)))
    above = np.asarray(jax.jit(_nucleus, static_argnums=1)(probs, float(np.nextafter(running, np.float32(2)))))
    ranked = np.sort(np.asarray(probs)[0])[::-1]
    assert (at > 0).sum() == 256
    assert (above > 0).sum() == 257
    assert np.asarray(probs)[0][above[0] > 0].min() == ranked[256]


def test_nucleus_stops_where_the_prefix_mass_equals_top_p():
    """Probabilities that are sums of powers of two, so prefix masses are exact: at top_p
    equal to a prefix's mass that prefix is the nucleus (it reaches top_p); the next token
    is not kept. Catches the cut's comparison `mass_before < top_p` written `<=`."""
    from specsamp.decoding.sampling import _nucleus

    probs = jnp.asarray([[0.0625, 0.5, 0.125, 0.25, 0.0625], [0.25, 0.125, 0.5, 0.0625, 0.0625]])
    for top_p, kept in [(0.75, 2), (0.875, 3), (0.5, 1)]:
        got = np.asarray(jax.jit(_nucleus, static_argnums=1)(probs, top_p))
        assert ((got > 0).sum(axis=-1) == kept).all(), (top_p, got)


@pytest.mark.parametrize("v", [7, 256, 1000, 5000])
def test_sample_draws_from_probs(v):
    """Catches a biased or broken inverse-CDF draw (off by one at a block edge, the wrong
    block, zeros drawn after rounding): 200,000 draws from a distribution with zeros spread
    over several 256-token blocks match it (chi-square), never hit a zero, and a point mass
    is always its token, whatever the position. (v = 5000 draws on the native kernel where
    it runs: `sampling.NATIVE_ROWS_FROM`.)"""
    from scipy import stats

    from specsamp.decoding.sampling import sample

    rng = np.random.default_rng(v)
    p = rng.random(v).astype(np.float32)
    p[::3] = 0.0
    p[-1] = 0.0
    p /= p.sum()
    keys = jax.random.split(jax.random.PRNGKey(0), 200_000)
    x = np.asarray(jax.jit(jax.vmap(sample, in_axes=(0, None)))(keys, jnp.asarray(p)))
    counts = np.bincount(x, minlength=v)
    assert counts[p == 0].sum() == 0
    support = p > 0
    expected = p[support].astype(np.float64) / p[support].astype(np.float64).sum() * len(x)
    assert stats.chisquare(counts[support], expected).pvalue > 1e-4
    ids = jnp.asarray([0, v // 2, v - 1])
    point = jax.nn.one_hot(ids, v)
    np.testing.assert_array_equal(np.asarray(jax.vmap(sample)(keys[:3], point)), np.asarray(ids))
    # one key for a batch of rows: independent rows, each inside its own support
    rows = sample(jax.random.PRNGKey(1), jnp.broadcast_to(jnp.asarray(p), (4, v)))
    assert rows.shape == (4,) and bool(jnp.all(jnp.asarray(p)[rows] > 0))


def _kernels_or_skip():
    """Skip where the native kernels were not built (except in CI, where they must be:
    `test_quant._kernel_or_skip`) or do not run (several devices)."""
    from specsamp.quant import kernels
    from tests.test_quant import _kernel_or_skip

    _kernel_or_skip()
    if not kernels.on_one_cpu_device():
        pytest.skip("the native kernels run on one CPU device")


def _on_both_paths(monkeypatch, fn, *args):
    """fn(*args) traced on the XLA operations (native rows switched off), then on the
    kernels: two fresh traces, as numpy arrays."""
    from specsamp.decoding import sampling

    with monkeypatch.context() as m:
        m.setattr(sampling, "NATIVE_ROWS_FROM", 1 << 62)
        xla = np.asarray(jax.jit(lambda *a: fn(*a))(*args))
    native = np.asarray(jax.jit(lambda *a: fn(*a))(*args))
    return xla, native


@pytest.mark.parametrize("n", [4096, 5000, 49152, 65537])
def test_native_row_kernels_give_the_xla_bits(monkeypatch, n):
    """The sampling path's long rows go through the native kernels (reduce.cc), which must
    give the XLA operations' bits: a tree sum (zero padding to a power of two, -0, inf,
    NaN, rows of every scale, leading axes), the softmax and probabilities built on it
    (temperature, top-k, top-p), and the draw for given uniforms (0, just below 1, random;
    zeros in the row, a partial last block, a point mass at either end). Catches another
    summation order (vectorised lanes, a sequential sum), the padding dropped, a draw off
    by one at a block edge or past the last positive entry. (Under vmap too: the
    kernels' rows are the batch's.)"""
    _kernels_or_skip()
    from specsamp.decoding.sampling import draw, residual_draw, row_sum, softmax

    rng = np.random.default_rng(n)
    x = (rng.standard_normal((2, 3, n)) * np.array([1e-3, 1.0, 1e4])[:, None]).astype(np.float32)
    x[1, 0, :7] = -0.0
    x[1, 1, 5] = np.inf
    x[1, 2, 9] = np.nan
    x = jnp.asarray(x)
    bits = lambda a: np.asarray(a).view(np.uint32)
    xla, native = _on_both_paths(monkeypatch, row_sum, x)
    np.testing.assert_array_equal(bits(xla), bits(native))
    assert "specsamp_tree_sum" in jax.jit(row_sum).lower(x).as_text()  # the kernel ran
    xla, native = _on_both_paths(monkeypatch, row_sum, -jnp.zeros((2, n)))
    np.testing.assert_array_equal(bits(xla), bits(native))  # a row of -0: +0, as x + 0 makes it
    logits = x[0]
    for sp in (SamplingParams(1.0), SamplingParams(0.7, 50, 1.0), SamplingParams(0.7, 0, 0.9)):
        xla, native = _on_both_paths(monkeypatch, lambda a: probs_from_logits(a, sp), logits)
        np.testing.assert_array_equal(bits(xla), bits(native))
    xla, native = _on_both_paths(monkeypatch, softmax, x[1, :2])
    np.testing.assert_array_equal(bits(xla), bits(native))

    p = rng.random((6, n)).astype(np.float32)
    p[:, ::3] = 0.0
    p[:, -1] = 0.0
    p[0, 300:] = 0.0  # mass in the first blocks only
    p[1] = 0.0
    p[1, n - 2] = 1.0  # a point mass in the last (partial) block
    p[2] = 0.0
    p[2, 0] = 1e-30  # a point mass at the start, tiny
    p[3] = 0.0
    p[3, 10:13] = [0.25, 0.25, 0.5]  # exact running masses: at u = 0.5, t equals one of them
    p = jnp.asarray(p / p.sum(axis=1, keepdims=True))
    below_one = np.nextafter(np.float32(1), np.float32(0))
    for u in (0.0, below_one, 0.5, *rng.random(5).astype(np.float32)):
        us = jnp.full((6,), u, jnp.float32)
        xla, native = _on_both_paths(monkeypatch, jax.vmap(draw), p, us)
        np.testing.assert_array_equal(xla, native)
        assert "specsamp_sample" in jax.jit(jax.vmap(draw)).lower(p, us).as_text()
        if u == 0.5:  # the first running mass above t = 0.5, not the one equal to it
            assert native[3] == 12, native
        assert (np.asarray(p)[np.arange(6), native] > 0).all()

    # The residual's draw in one kernel (`residual_draw`): q against draft rows p with mass
    # where q has none, a point mass, p == q (a residual of 0: q is drawn), zeros (the bonus)
    q = p[jnp.asarray([4, 5, 0, 3, 4, 1])]
    d = jnp.stack([p[5], jax.nn.one_hot(n // 2, n), p[0], jnp.zeros(n), p[1], p[2]])
    for u in (0.0, below_one, *rng.random(4).astype(np.float32)):
        us = jnp.full((6,), u, jnp.float32)
        xla, native = _on_both_paths(monkeypatch, jax.vmap(residual_draw), q, d, us)
        np.testing.assert_array_equal(xla, native)
        assert "specsamp_residual_sample" in jax.jit(jax.vmap(residual_draw)).lower(q, d, us).as_text()
        assert native[2] == int(jax.jit(draw)(q[2], us[2]))  # p == q: drawn from q
        assert np.asarray(q)[np.arange(6), native].min() > 0

    # Block verification's factor on q (`residual_draw`'s scale, `residual_mass`): the
    # same bits with the product rounded apart from the difference; a factor that leaves
    # no positive part (row 3: p == 0 there, so never) and one of 1.
    from specsamp.decoding.sampling import residual_mass

    scales = jnp.asarray([0.5, 1.0, 0.3, 0.999, 1e-3, 0.75], jnp.float32)
    for u in (0.0, below_one, *rng.random(3).astype(np.float32)):
        us = jnp.full((6,), u, jnp.float32)
        xla, native = _on_both_paths(monkeypatch, jax.vmap(residual_draw), q, d, us, scales)
        np.testing.assert_array_equal(xla, native)
        assert np.asarray(q)[np.arange(6), native].min() > 0
    # residual_mass reads rows 1..M of [..., R, V] stacks (here two stacks of 3 rows, M = 2,
    # and p with a row more than M + 1)
    qs, ds = q.reshape(2, 3, n), jnp.concatenate([d, d[:2]]).reshape(2, 4, n)
    ms = scales[:4].reshape(2, 2)
    xla, native = _on_both_paths(monkeypatch, residual_mass, qs, ds, ms)
    np.testing.assert_array_equal(bits(xla), bits(native))
    assert "specsamp_residual_mass" in jax.jit(residual_mass).lower(qs, ds, ms).as_text()
    want = np.maximum(np.asarray(ms, np.float64)[..., None] * np.asarray(qs, np.float64)[:, 1:3]
                      - np.asarray(ds, np.float64)[:, 1:3], 0).sum(-1)
    np.testing.assert_allclose(native, want, rtol=1e-4, atol=1e-30)


def test_native_top_values_give_the_xla_cuts(monkeypatch):
    """The top-k threshold and the nucleus's cut on the native kernels (a heap of the
    largest entries, `specsamp_top_value`, `specsamp_nucleus_cut`) give the bits of XLA's
    top_k, running sums and cut: rows of a model's shape (a few tokens with most of the
    mass), ties at the cut, -inf, NaN of either sign and -0 (top_k's total order), k = 1
    and k = N; top_p set to running masses exactly where a sequential sum comes out below
    them, so that a kernel summing in another order cuts those rows elsewhere; rows whose
    nucleus needs the 4,096 tier or the whole row beside rows that the first tier covers
    (XLA moves every row to the wider tier, the kernel each row alone: the same cuts), and
    NaN rows. Catches a wrong order of values (the k-th smallest, NaN placed as XLA does
    not), a heap that skips entries, another summation order, a tier's running sum not
    continued from the first's total."""
    _kernels_or_skip()
    from specsamp.decoding.sampling import _kth_largest, _nucleus, softmax
    from specsamp.reductions import cumsum

    n = 49152
    rng = np.random.default_rng(7)
    logits = np.stack([-s * np.log(rng.permutation(n) + 1.0) for s in (1.8, 1.6, 2.0, 3.0, 1.7, 2.5)])
    logits[1, rng.choice(n, 40, replace=False)] = logits[1].max()  # 40 tied at the top
    logits[2, :5000] = -np.inf
    logits = logits.astype(np.float32)
    odd = logits[4].copy()
    odd[[3, 99]] = np.nan
    odd[[5, 77]] = np.copysign(np.float32(np.nan), -1)  # -NaN: below -inf in top_k's order
    odd[[6, 8]] = [-0.0, 0.0]
    bits = lambda a: np.asarray(a).view(np.uint32)
    rows = jnp.asarray(np.concatenate([logits, odd[None]]))
    for k in (1, 2, 5, 40, 41, 256, 1000, n):
        xla, native = _on_both_paths(monkeypatch, lambda a: _kth_largest(a, k), rows)
        np.testing.assert_array_equal(bits(xla), bits(native))
        np.testing.assert_array_equal(native[:6, 0], np.sort(logits, axis=1)[:, n - k])
    assert "specsamp_top_value" in jax.jit(lambda a: _kth_largest(a, 5)).lower(rows).as_text()

    probs = jax.jit(softmax)(jnp.asarray(logits))
    ranked = np.asarray(jax.jit(lambda p: jax.lax.top_k(p, 256)[0])(probs))
    top = np.asarray(jax.jit(cumsum)(ranked))
    # running masses where a sequential sum comes out below: there it keeps one more token
    seq = np.cumsum(ranked, axis=1, dtype=np.float32)
    exact = [float(top[r, j]) for r in range(6) for j in range(3, 256) if seq[r, j] < top[r, j] < 0.95][:4]
    assert len(exact) == 4
    for top_p in (0.9, 0.5, 0.95, *exact):
        xla, native = _on_both_paths(monkeypatch, lambda p: _nucleus(p, top_p), probs)
        np.testing.assert_array_equal(bits(xla), bits(native))
    assert "specsamp_nucleus_cut" in jax.jit(lambda p: _nucleus(p, 0.9)).lower(probs).as_text()
    wider = [-1.2 * np.log(rng.permutation(n) + 1.0), rng.standard_normal(n)]  # tiers 2 and 3
    nan = np.full(n, np.nan, np.float32)  # softmax of a row with a NaN
    mixed = np.asarray(probs[0]).copy()
    mixed[[3, 99]] = np.nan
    mixed[77] = np.copysign(np.float32(np.nan), -1)
    rows = jnp.concatenate([probs, jax.jit(softmax)(jnp.asarray(np.stack(wider), jnp.float32)),
                            jnp.asarray(np.stack([nan, mixed]))])
    for top_p in (0.9, 0.6, exact[0]):
        xla, native = _on_both_paths(monkeypatch, lambda p: _nucleus(p, top_p), rows)
        np.testing.assert_array_equal(bits(xla), bits(native))
        kept = (native[6:8] > 0).sum(axis=1)
        assert top_p != 0.9 or (kept[0] > 256 and kept[1] > 4096)  # the wider tiers cut these


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8)])
def test_reduced_head_draws_from_the_full_rows_law(temperature, top_k, top_p):
    """A feature draft's reduced head draws among its own tokens (`drafters._drawer` on
    `tree_draft.Reduced` rows)
    from the law the full row gives (its logits scattered into the vocabulary, the rest
    at probability 0), and returns that law as the full row the acceptance rule reads.
    The head is padded as decoding loads it (the last id repeated). Catches padding
    counted as further mass on the last id, a token id taken from the wrong index, or a
    row that is not the one drawn from."""
    from scipy import stats

    from specsamp.decoding.drafters import _drawer
    from specsamp.decoding.tree_draft import Reduced
    from specsamp.models.feature_draft import scatter_reduced

    vocab, ids = 40, jnp.asarray([1, 4, 5, 9, 17, 30, 33, 33, 33], jnp.int32)  # 2 pads
    sub = jax.random.normal(jax.random.PRNGKey(0), (3, ids.shape[0])) * 2
    sub = sub.at[:, 7:].set(sub[:, 6:7])  # a padded row is the last id's row: the same logit
    sp = SamplingParams(temperature, top_k, top_p)
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    draw = jax.jit(lambda s, i: _drawer(sp, keys, None)(Reduced(s, ids, vocab), i))
    tok, p = draw(sub, 0)
    want = np.asarray(probs_from_logits(scatter_reduced(sub, ids, vocab), sp))
    np.testing.assert_allclose(np.asarray(p), want, rtol=2e-6, atol=1e-7)
    assert np.all(np.asarray(p)[np.arange(3), np.asarray(tok)] > 0)  # drawn where p has mass
    # many draws of row 0: frequencies follow p (keys differ by the draw index i)
    many = jax.jit(jax.vmap(lambda i: _drawer(sp, keys, None)(Reduced(sub, ids, vocab), i)[0][0]))
    counts = np.bincount(np.asarray(many(jnp.arange(4000))), minlength=vocab).astype(float)
    expected = want[0] * counts.sum()
    assert counts[want[0] == 0].sum() == 0
    big = expected >= 5
    assert stats.chisquare(counts[big], expected[big] * counts[big].sum() / expected[big].sum()).pvalue > 1e-4
