"""Block verification (`acceptance.accept_block`): its output follows the target exactly.

1. The rule written out in plain NumPy (`_h_values`, `_round_law`), its exact output law
   enumerated over tiny vocabularies for K = 1..3: draft and target distributions that
   depend on the whole prefix, with zeros, point-mass drafts and draft == target. The
   first K + 1 tokens of a generation (the round's output, then the target continuing)
   must have the target's joint law; two wrong rules (the under-representation not
   carried from position to position; the residual without its factor) fail.
2. The compiled rule against that reference: the same tau and residual factor for given
   uniforms, and its sampled outputs (the kept tokens and the token after them) against
   the reference's exact law of a round (chi-square).
3. Block verification keeps at least as many tokens as the per-token rule in expectation.
The rule through the compiled loop (every drafter) is tests/test_exactness.py's chi-square:
sampled chains verify by blocks by default.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specsamp.decoding.acceptance import accept_block, block_rule

ALPHA = 1e-4  # false-alarm rate of each statistical check


def _h_values(draft, p, q, fault=None):
    """(P [K + 1], P[0] = 1; h [K]) of block verification for one drafted block."""
    k = len(draft)
    under = [1.0]
    for i in range(k):
        ratio = q[i][draft[i]] / p[i][draft[i]]
        under.append(min(ratio if fault == "no_carry" else under[-1] * ratio, 1.0))
    h = []
    for i in range(1, k):
        mass = np.maximum(under[i] * q[i] - p[i], 0).sum()
        den = mass + 1 - under[i]
        h.append(1.0 if den <= 0 else mass / den)
    return under, h + [under[k]]


def _residual(factor, q_row, p_row):
    d = np.maximum(factor * q_row - p_row, 0)
    return d / d.sum() if d.sum() > 0 else q_row


def _round_law(pf, qf, k, v, fault=None):
    """{round output (kept tokens + the token after them): probability}; pf(prefix) /
    qf(prefix): the draft's / target's distribution after a prefix (a tuple)."""
    law = {}
    for xs in itertools.product(range(v), repeat=k):
        drawn = np.prod([pf(xs[:i])[xs[i]] for i in range(k)])
        if drawn == 0:
            continue
        p = np.stack([pf(xs[:i]) for i in range(k)])
        q = np.stack([qf(xs[:i]) for i in range(k + 1)])
        under, h = _h_values(xs, p, q, fault)
        for tau in range(k + 1):
            # tau = the last position whose uniform fell under its h
            chance = (h[tau - 1] if tau else 1.0) * np.prod([1 - x for x in h[tau:]])
            if chance == 0:
                continue
            after = q[k] if tau == k else _residual(1.0 if fault == "unscaled" else under[tau], q[tau], p[tau])
            for t in np.flatnonzero(after):
                out = tuple(xs[:tau]) + (int(t),)
                law[out] = law.get(out, 0.0) + drawn * chance * after[t]
    return law


def _first_tokens(law, qf, k, v):
    """The law of the first K + 1 tokens: the round's output, then the target onwards."""
    first = {}
    for s in itertools.product(range(v), repeat=k + 1):
        total = 0.0
        for out, prob in law.items():
            if s[:len(out)] == out:
                total += prob * np.prod([qf(s[:j])[s[j]] for j in range(len(out), k + 1)])
        first[s] = total
    return first


def _target(qf, k, v):
    return {s: np.prod([qf(s[:j])[s[j]] for j in range(k + 1)]) for s in itertools.product(range(v), repeat=k + 1)}


def _family(seed, v, kind):
    """(pf, qf): distributions drawn afresh for every prefix."""
    rng = np.random.default_rng(seed)
    rows = {}

    def dist(prefix, who):
        if (prefix, who) not in rows:
            x = rng.gamma(0.7, size=v)
            if kind == "zeros" and rng.random() < 0.6:
                x[rng.integers(v)] = 0.0
            if kind == "point" and who == "p":
                x = np.eye(v)[rng.integers(v)]
            rows[prefix, who] = x / x.sum()
        return rows[prefix, who]

    return (lambda pre: dist(pre, "q" if kind == "equal" else "p")), (lambda pre: dist(pre, "q"))


FAMILIES = [(k, kind, seed) for k in (1, 2, 3) for kind in ("random", "zeros", "point", "equal") for seed in (0, 1)]


@pytest.mark.parametrize("k,kind,seed", FAMILIES)
def test_block_rule_is_exact_by_enumeration(k, kind, seed):
    pf, qf = _family(seed, 3, kind)
    got, want = _first_tokens(_round_law(pf, qf, k, 3), qf, k, 3), _target(qf, k, 3)
    assert max(abs(got[s] - want[s]) for s in want) < 1e-12


@pytest.mark.parametrize("fault", ["no_carry", "unscaled"])
def test_the_enumeration_fails_wrong_rules(fault):
    """Controls: each wrong rule is off the target's law by far more than the tolerance
    in some family the test above runs."""
    errors = []
    for k, kind, seed in FAMILIES:
        pf, qf = _family(seed, 3, kind)
        got, want = _first_tokens(_round_law(pf, qf, k, 3, fault), qf, k, 3), _target(qf, k, 3)
        errors.append(max(abs(got[s] - want[s]) for s in want))
    assert max(errors) > 1e-3


def _rows(seed, k, v, kind="random"):
    pf, qf = _family(seed, v, kind)
    return (np.stack([pf(()) if i == 0 else pf((i,)) for i in range(k)]).astype(np.float32),
            np.stack([qf(()) if i == 0 else qf((i,)) for i in range(k + 1)]).astype(np.float32))


def test_compiled_decision_equals_the_reference():
    """tau and the residual's factor for given uniforms, over random blocks and uniforms
    (including uniforms at 0 and just below 1, point-mass drafts and draft == target)."""
    rng = np.random.default_rng(0)
    rule = jax.jit(block_rule)
    for case in range(60):
        k = 1 + case % 3
        p, q = _rows(case, k, 5, ("random", "zeros", "point", "equal")[case % 4])
        draft = np.array([rng.choice(5, p=row / row.sum()) for row in p.astype(np.float64)])
        under, h = _h_values(draft, p.astype(np.float64), q.astype(np.float64))
        for eta in [rng.random(k) for _ in range(8)] + [np.zeros(k), np.full(k, 1 - 2 ** -24)]:
            eta = eta.astype(np.float32)
            if np.any(np.abs(eta - np.asarray(h)) < 1e-5):
                continue  # within float32 rounding of a threshold
            tau = max([i + 1 for i in range(k) if eta[i] < h[i]], default=0)
            got_tau, got_scale = rule(jnp.asarray(draft), jnp.asarray(p), jnp.asarray(q), jnp.asarray(eta))
            assert int(got_tau) == tau
            want_scale = under[tau] if 0 < tau < k else 1.0
            np.testing.assert_allclose(float(got_scale), want_scale, rtol=1e-5)


@pytest.mark.parametrize("k,seed", [(2, 0), (3, 1), (3, 2)])
def test_compiled_rule_samples_the_reference_law_of_a_round(k, seed):
    """accept_block drawn 200,000 times on fixed rows (the draft drawn from p) against the
    reference's exact law of the round's output: catches a wrong tau, factor or residual
    in the code that runs."""
    v = 4
    p, q = _rows(seed, k, v, "zeros" if seed == 2 else "random")
    law = _round_law(lambda pre: p[len(pre)].astype(np.float64), lambda pre: q[len(pre)].astype(np.float64), k, v)

    def one(key):
        kd, ka = jax.random.split(key)
        draft = jax.random.categorical(kd, jnp.log(jnp.asarray(p)), axis=-1).astype(jnp.int32)
        n, x = accept_block(ka, draft, jnp.asarray(p), jnp.asarray(q))
        return draft, n, x

    draft, n, x = (np.asarray(a) for a in jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(seed), 200_000)))
    outs = list(law)
    index = {o: i for i, o in enumerate(outs)}
    counts = np.zeros(len(outs))
    for d, m, t in zip(draft, n, x):
        key = tuple(int(a) for a in d[:m]) + (int(t),)
        assert key in index, f"output {key} has probability 0"
        counts[index[key]] += 1
    expected = np.array([law[o] for o in outs]) * counts.sum()
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    assert stats.chisquare(obs[exp > 0], exp[exp > 0] * obs.sum() / exp[exp > 0].sum()).pvalue > ALPHA


def _expected_kept(law):
    return sum(prob * (len(out) - 1) for out, prob in law.items())


def _token_law(pf, qf, k, v):
    """The per-token rule's law of a round, for the comparison below."""
    law = {}
    for xs in itertools.product(range(v), repeat=k):
        drawn = np.prod([pf(xs[:i])[xs[i]] for i in range(k)])
        if drawn == 0:
            continue
        keep = 1.0
        for n in range(k + 1):
            stop = 1.0 if n == k else 1 - min(1.0, qf(xs[:n])[xs[n]] / pf(xs[:n])[xs[n]])
            out = tuple(xs[:n])
            law[out + ("stop",)] = law.get(out + ("stop",), 0.0) + drawn * keep * stop
            if n < k:
                keep *= 1 - stop
    return law


@pytest.mark.parametrize("k,kind,seed", [f for f in FAMILIES if f[0] > 1])
def test_block_rule_keeps_at_least_the_per_token_rules_tokens(k, kind, seed):
    pf, qf = _family(seed, 3, kind)
    assert _expected_kept(_round_law(pf, qf, k, 3)) >= _expected_kept(_token_law(pf, qf, k, 3)) - 1e-12


def test_the_sampled_check_fails_a_residual_without_its_factor(monkeypatch):
    """Control: the compiled rule with the residual's factor dropped (1 for every tau)
    fails the check above."""
    import specsamp.decoding.acceptance as acceptance

    rule = acceptance.block_rule
    monkeypatch.setattr(acceptance, "block_rule", lambda *a: (rule(*a)[0], jnp.float32(1.0)))
    with pytest.raises(AssertionError):
        test_compiled_rule_samples_the_reference_law_of_a_round(3, 1)


def test_rows_the_draft_could_not_score_keep_nothing():
    """A NaN draft row (a broken draft) gives h = 0 where its comparisons fail, as the
    per-token rule keeps nothing there; it kept every token (h = 1) when a NaN
    denominator read as 0."""
    p, q = _rows(0, 3, 5)
    p[1:] = np.nan
    for eta in (np.zeros(3), np.full(3, 0.5)):
        tau, _ = block_rule(jnp.asarray([0, 1, 2]), jnp.asarray(p), jnp.asarray(q), jnp.asarray(eta, jnp.float32))
        assert int(tau) <= 1
