"""Theorem 1 of the paper: the rejection rule's output follows q exactly, for any p.

Exact enumeration over tiny vocabularies (p with zeros, q with zeros, point-mass p), then
the compiled rule itself sampled many times against the exact q (chi-square; each check has
a documented false-alarm rate of 1e-4 and runs with fixed keys, so it is deterministic).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specsamp.decoding.acceptance import accept
from specsamp.decoding.sampling import residual

ALPHA = 1e-4  # false-alarm rate of each statistical check


def _random_dist(rng, v, zeros=0):
    x = rng.gamma(0.7, size=v)
    if zeros:
        x[rng.choice(v, zeros, replace=False)] = 0.0
    return (x / x.sum()).astype(np.float32)


def _cases():
    rng = np.random.default_rng(7)
    cases = [(_random_dist(rng, 6), _random_dist(rng, 6)) for _ in range(5)]
    cases += [(_random_dist(rng, 6, zeros=2), _random_dist(rng, 6)) for _ in range(3)]  # p zeros
    cases += [(_random_dist(rng, 6), _random_dist(rng, 6, zeros=3)) for _ in range(3)]  # q zeros
    cases += [(np.eye(6, dtype=np.float32)[i], _random_dist(rng, 6, zeros=i % 3)) for i in range(4)]
    q = _random_dist(rng, 6)
    cases += [(q.copy(), q)]  # p == q: everything accepted
    return cases


def exact_output(p, q):
    """P(emitted token = x) when x~ ~ p, kept with min(1, q/p), else (q - p)+ normalised,
    using the engine's own `residual`."""
    keep = np.where(p > 0, np.minimum(1.0, q / np.where(p > 0, p, 1)), 0.0)
    reject_mass = float(np.sum(p * (1 - keep)))
    res = np.asarray(residual(jnp.asarray(q), jnp.asarray(p)))
    return p * keep + reject_mass * res


@pytest.mark.parametrize("case", range(len(_cases())))
def test_theorem1_exact_enumeration(case):
    p, q = _cases()[case]
    np.testing.assert_allclose(exact_output(p, q), q, atol=1e-6)


def _run_rule(p_rows, q_rows, n_samples, seed):
    """Draft K tokens from the fixed p rows, apply the compiled rule, return first emitted
    token and the number accepted."""
    k = p_rows.shape[0]
    p, q = jnp.asarray(p_rows), jnp.asarray(q_rows)

    def one(key):
        kd, ka = jax.random.split(key)
        draft = jax.random.categorical(kd, jnp.log(p), axis=-1).astype(jnp.int32)
        n, x = accept(ka, draft, p, q)
        first = jnp.where(n > 0, draft[0], x)
        return first, n

    keys = jax.random.split(jax.random.PRNGKey(seed), n_samples)
    first, n = jax.jit(jax.vmap(one))(keys)
    return np.asarray(first), np.asarray(n)


def _chi_square_pvalue(counts, probs):
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("case", [0, 5, 8, 11, 14])
def test_compiled_rule_first_token_follows_q(case):
    """Catches a wrong ratio, a wrong residual or a biased uniform draw in the real code."""
    p1, q1 = _cases()[case]
    rng = np.random.default_rng(case)
    p_rows = np.stack([p1, _random_dist(rng, 6), _random_dist(rng, 6)])
    q_rows = np.stack([q1, _random_dist(rng, 6), _random_dist(rng, 6), _random_dist(rng, 6)])
    first, n = _run_rule(p_rows, q_rows, 200_000, seed=case)
    counts = np.bincount(first, minlength=6)
    assert _chi_square_pvalue(counts, q1.astype(np.float64)) > ALPHA
    # The acceptance rate of the first position is alpha = sum min(p, q).
    alpha = np.minimum(p1, q1).sum()
    assert abs((n > 0).mean() - alpha) < 5 * np.sqrt(alpha * (1 - alpha) / n.size) + 1e-6


def test_greedy_limit_keeps_draft_iff_it_is_the_argmax():
    q = jnp.eye(5)[jnp.array([2, 4, 1])]  # target argmaxes 2, 4 then bonus 1
    p = jnp.eye(5)[jnp.array([2, 3])]
    n, x = accept(jax.random.PRNGKey(0), jnp.array([2, 3]), p, q)
    assert int(n) == 1 and int(x) == 4
    n, x = accept(jax.random.PRNGKey(1), jnp.array([2, 4]), jnp.eye(5)[jnp.array([2, 4])], q)
    assert int(n) == 2 and int(x) == 1


def test_greedy_rule_equals_the_rule_on_one_hot_q():
    """accept_greedy (argmax comparisons, what the loop runs at temperature 0) gives the
    (n, token) of the general rule on q = one-hot of the first argmax, for drafts that
    match 0..K leading argmaxes, with tied logits and with p a point mass or not."""
    from specsamp.decoding.acceptance import accept_batch, accept_greedy
    from specsamp.decoding.config import SamplingParams
    from specsamp.decoding.sampling import probs_from_logits
    from specsamp.models.argmax import first_argmax

    rng = np.random.default_rng(0)
    b, k, v = 64, 3, 6
    logits = jnp.asarray(rng.integers(0, 3, size=(b, k + 1, v)).astype(np.float32))  # ties
    argmax = first_argmax(logits)
    keep = rng.integers(0, k + 1, size=b)  # leading draft tokens equal to the argmax
    other = (np.asarray(argmax[:, :k]) + rng.integers(1, v, size=(b, k))) % v
    draft = jnp.asarray(np.where(np.arange(k)[None] < keep[:, None], np.asarray(argmax[:, :k]), other))
    q = probs_from_logits(logits, SamplingParams(0.0))
    for p in (jax.nn.one_hot(draft, v), jnp.asarray(rng.dirichlet(np.ones(v), size=(b, k)), jnp.float32)):
        p = jnp.where(jax.nn.one_hot(draft, v) > 0, jnp.maximum(p, 1e-3), p)  # p(draft) > 0
        n, x = accept_batch(jax.random.split(jax.random.PRNGKey(1), b), draft, p, q)
        ng = accept_greedy(draft, argmax)
        assert np.array_equal(np.asarray(ng), keep) and np.array_equal(np.asarray(n), keep)
        assert np.array_equal(np.asarray(x), np.asarray(jnp.take_along_axis(argmax, ng[:, None], 1)[:, 0]))


def test_bonus_token_follows_the_last_target_distribution():
    """When all K draft tokens are kept, the extra token is drawn from q_{K+1} itself.
    Draft rows equal to the target's make every draft token kept; the last draft row
    differs from q_{K+1}, so drawing the bonus from the residual (q_{K+1} - p_K)+ (the
    draft rows padded with their last row instead of zeros) would shift it."""
    rng = np.random.default_rng(3)
    p_rows = np.stack([_random_dist(rng, 6), _random_dist(rng, 6)])
    bonus_q = _random_dist(rng, 6)
    q_rows = np.concatenate([p_rows, bonus_q[None]])
    assert np.abs(bonus_q - p_rows[-1]).sum() > 0.5  # a residual would be far from q_{K+1}
    k = p_rows.shape[0]
    p, q = jnp.asarray(p_rows), jnp.asarray(q_rows)

    def one(key):
        kd, ka = jax.random.split(key)
        draft = jax.random.categorical(kd, jnp.log(p), axis=-1).astype(jnp.int32)
        return accept(ka, draft, p, q)

    n, x = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(11), 100_000))
    n, x = np.asarray(n), np.asarray(x)
    assert (n == k).all()  # p == q: nothing is rejected
    assert _chi_square_pvalue(np.bincount(x, minlength=6), bonus_q.astype(np.float64)) > ALPHA


@pytest.mark.parametrize("rule", ["token", "block"])
def test_point_mass_drafts_need_no_rows(rule):
    """A lookup's drafts (p None, or `point` rows whose p is not read) give the rule's
    (n, token) on p = one_hot(draft) for the same keys, bit for bit: the point mass is
    the same numbers without building [K, V] rows. Rows mix point-mass and drawn drafts,
    and the unread p rows of point rows are garbage (NaN) to show they are not read."""
    from specsamp.decoding.acceptance import accept_batch, accept_block_batch

    f = jax.jit(accept_batch if rule == "token" else accept_block_batch)
    rng = np.random.default_rng(5)
    b, k, v = 256, 3, 6
    q = jnp.asarray(rng.dirichlet(np.ones(v) * 0.5, size=(b, k + 1)), jnp.float32)
    drawn = jnp.asarray(rng.dirichlet(np.ones(v) * 0.5, size=(b, k)), jnp.float32)
    draft = jnp.asarray(rng.integers(0, v, size=(b, k)), jnp.int32)
    drawn = jnp.where(jax.nn.one_hot(draft, v) > 0, jnp.maximum(drawn, 0.05), drawn)
    one_hot = jax.nn.one_hot(draft, v, dtype=jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(2), b)
    want = f(keys, draft, one_hot, q)
    got = f(keys, draft, None, q)
    assert all(np.array_equal(w, g) for w, g in zip(want, got))
    point = jnp.asarray(rng.random(b) < 0.5)
    mixed = jnp.where(point[:, None, None], one_hot, drawn)
    want = f(keys, draft, mixed, q)
    got = f(keys, draft, jnp.where(point[:, None, None], jnp.nan, drawn), q, point)
    assert all(np.array_equal(w, g) for w, g in zip(want, got))
    assert 0 < np.asarray(want[0]).mean() < k  # kept some drafts, not all
