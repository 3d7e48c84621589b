"""The compiled loops sample exactly from the target.

Statistical checks compare the joint distribution of the first three generated tokens with
exact target probabilities from full forward passes (no cache) on a vocabulary of 8; each
check is a chi-square test at a false-alarm rate of ALPHA = 1e-4, on fixed seeds (so the
suite is deterministic). Greedy checks demand token-for-token equality.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import Program, new_state
from specsamp.decoding.engine import Engine
from specsamp.decoding.shapes import prefill_groups
from specsamp.models.llama import Transformer, init_cache
from tests import tiny

ALPHA = 1e-4
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so that n-gram lookup proposes something
N_SAMPLES = 24_000
N_TOKENS = 3


@functools.cache
def _all_continuations(kv_dtype, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(sequences [V^3, T]: PROMPT + every 3 tokens, the target's logits [V^3, T, V] at
    `dtype` by one full forward pass over them, no cache, XLA's attention, over keys and
    values rounded to the cache's type). One pass per cache type and dtype: the sampling
    settings only transform the logits."""
    v = tiny.TARGET.vocab_size
    seqs = np.array([PROMPT + list(c) for c in itertools.product(range(v), repeat=N_TOKENS)])
    b, t = seqs.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = Transformer(tiny.TARGET).apply(
        {"params": tiny.at_dtype(tiny.target_params(), dtype)}, jnp.asarray(seqs), positions,
        init_cache(tiny.TARGET, b, t, kv_dtype))
    return seqs, logits


@functools.cache
def exact_joint(sp: SamplingParams, kv_dtype=jnp.float32, dtype="float32") -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) under the target at `dtype`, from the logits of full forward
    passes over all prefixes (`_all_continuations`). Cached: several tests compare with the
    same law; the array is read-only."""
    from specsamp.decoding.sampling import probs_from_logits

    seqs, logits = _all_continuations(kv_dtype, dtype)
    b = len(seqs)
    # One compiled program, not op by op (tens of small eager compilations per law).
    probs = np.asarray(jax.jit(probs_from_logits, static_argnums=1)(logits, sp), np.float64)
    n = len(PROMPT)
    joint = np.ones(len(seqs))
    for i in range(N_TOKENS):
        joint *= probs[np.arange(b), n - 1 + i, seqs[:, n + i]]
    joint = joint.reshape((tiny.TARGET.vocab_size,) * N_TOKENS)
    joint.flags.writeable = False
    return joint


# Each test's drafter as a draft string, built by the one factory users' drafters come from.
DRAFTS = {"none": "none", "model": "tiny-draft", "model-small-head": "tiny-draft-small-head",
          "early-exit": "early-exit:1", "ngram": "ngram",
          "feature": "tiny-feature", "feature-reduced": "tiny-feature-reduced",
          "hybrid": "ngram+tiny-feature-reduced", "hybrid-wide": "ngram+tiny-feature-reduced"}
WIDE = 3  # "hybrid-wide": wide lookup rounds of 3 tokens on 3-token matches (`k auto`'s)


def make_engine(sp, drafter_kind, k, max_new=N_TOKENS, kv_cache="float32", dtype="float32"):
    """An engine on the tiny target with its weights (and a draft model's) at `dtype`."""
    drafter, draft_params = tiny.drafter(DRAFTS[drafter_kind], k, sp,
                                         wide=WIDE if drafter_kind == "hybrid-wide" else 0,
                                         dtype=dtype)
    if drafter_kind.startswith("hybrid"):  # the factory's hybrid looks up 2-grams and longer only
        assert drafter.ngram.min_ngram == 2
    return Engine(Program(tiny.TARGET, sp, drafter, kv_cache),
                  tiny.at_dtype(tiny.target_params(), dtype), draft_params,
                  eos_ids=(), max_new_tokens=max_new)


def sample_counts(engine) -> tuple[np.ndarray, float]:
    v = tiny.TARGET.vocab_size
    counts = np.zeros((v,) * N_TOKENS)
    accepted = drafted = 0
    for start in range(0, N_SAMPLES, 8000):
        seeds = list(range(start, start + 8000))
        for r in engine.run([PROMPT] * len(seeds), seeds):
            counts[tuple(r.token_ids[:N_TOKENS])] += 1
            accepted += sum(r.accepted)
            drafted += sum(r.drafted)
    return counts, accepted / max(drafted, 1)


def chi_square_pvalue(counts, probs):
    counts, probs = counts.ravel(), probs.ravel()
    assert counts[probs == 0].sum() == 0, "sampled a sequence of zero target probability"
    expected = probs / probs.sum() * counts.sum()  # probs sum to 1 up to float32 rounding
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


CASES = [
    # (drafter, K, temperature, top_k, top_p)
    ("none", 0, 1.0, 0, 1.0),
    ("model", 2, 1.0, 0, 1.0),
    ("model", 3, 0.7, 4, 1.0),
    ("model", 2, 1.2, 0, 0.8),
    ("model-small-head", 2, 1.0, 0, 1.0),  # the draft lacks ids 6, 7: they come from the residual
    ("early-exit", 2, 1.0, 3, 0.9),
    ("ngram", 2, 1.0, 0, 1.0),
    ("feature", 2, 1.0, 0, 1.0),
    ("feature", 3, 0.9, 5, 0.9),
    ("feature-reduced", 3, 1.0, 0, 1.0),
    ("ngram", 3, 0.8, 0, 0.95),
    ("hybrid", 2, 1.0, 0, 1.0),
    ("hybrid", 3, 0.9, 4, 0.9),
    # PROMPT ends in a repeated 3-gram: every row's first round is a wide one (3 tokens at K=1)
    ("hybrid-wide", 1, 1.0, 0, 1.0),
]


@pytest.mark.parametrize("drafter,k,temperature,top_k,top_p", CASES)
def test_joint_distribution_of_three_tokens_matches_target(drafter, k, temperature, top_k, top_p):
    sp = SamplingParams(temperature, top_k, top_p)
    counts, acceptance = sample_counts(make_engine(sp, drafter, max(k, 1)))
    assert chi_square_pvalue(counts, exact_joint(sp)) > ALPHA
    if drafter != "none":
        assert 0.0 < acceptance < 1.0  # both branches of the rule were exercised


def test_float16_cache_distribution_matches_its_target():
    """With a float16 KV cache the target is the model over half-rounded keys and values:
    speculative samples follow that model's joint exactly. (The two models are close, so
    the check alone would pass with a float32 cache too: the state's cache type is
    checked as well.)"""
    sp = SamplingParams(1.0)
    engine = make_engine(sp, "model", 2, kv_cache="float16")
    state = new_state(engine.prog, jnp.asarray([PROMPT]), jnp.asarray([len(PROMPT)]), N_TOKENS,
                      jnp.zeros((1,), jnp.uint32), 16)
    assert state.target_cache.k.dtype == jnp.float16
    counts, acceptance = sample_counts(engine)
    assert chi_square_pvalue(counts, exact_joint(sp, jnp.float16)) > ALPHA
    assert 0.0 < acceptance < 1.0


@pytest.mark.parametrize("drafter,k,temperature,top_k,top_p", [
    ("model", 2, 1.0, 0, 1.0), ("early-exit", 2, 1.0, 3, 0.9)])
def test_bfloat16_distribution_matches_its_target(drafter, k, temperature, top_k, top_p):
    """With bfloat16 weights, activations and KV cache, speculative samples follow the
    bfloat16 model's joint (probabilities in float32 from its logits). (The bfloat16 and
    float32 models are close, so the check alone would pass on a float32 run: the types
    the run computes in are checked as well.)"""
    from specsamp.models.llama import compute_dtype

    sp = SamplingParams(temperature, top_k, top_p)
    engine = make_engine(sp, drafter, k, kv_cache="bfloat16", dtype="bfloat16")
    state = new_state(engine.prog, jnp.asarray([PROMPT]), jnp.asarray([len(PROMPT)]), N_TOKENS,
                      jnp.zeros((1,), jnp.uint32), 16)
    assert state.target_cache.k.dtype == state.draft.k.dtype == jnp.bfloat16
    assert compute_dtype(engine.target_params) == compute_dtype(engine.draft_params) == jnp.bfloat16
    counts, acceptance = sample_counts(engine)
    assert chi_square_pvalue(counts, exact_joint(sp, jnp.bfloat16, "bfloat16")) > ALPHA
    assert 0.0 < acceptance < 1.0


def test_the_statistical_check_has_power():
    """A sampler from a slightly different distribution (temperature 1.1 instead of 1.0)
    must fail the same check: the test above can fail."""
    counts, _ = sample_counts(make_engine(SamplingParams(1.1), "model", 2))
    assert chi_square_pvalue(counts, exact_joint(SamplingParams(1.0))) < ALPHA


GREEDY_CASES = [("model", 1), ("model", 4), ("model-small-head", 3), ("early-exit", 3), ("ngram", 2), ("ngram", 5),
                ("feature", 1), ("feature", 4), ("feature-reduced", 3), ("hybrid", 1),
                ("hybrid", 4), ("hybrid-wide", 1), ("hybrid-wide", 2)]


GREEDY_PROMPTS = [PROMPT, [5, 4], [7], [3, 3, 3, 3, 3, 3, 1]]


@functools.cache
def greedy_autoregressive(kv_cache: str, dtype: str) -> tuple[tuple[int, ...], ...]:
    """The plain engine's greedy tokens for GREEDY_PROMPTS (24 each), once per cache type
    and dtype for every drafter compared with them."""
    engine = make_engine(SamplingParams(0.0), "none", 1, max_new=24, kv_cache=kv_cache, dtype=dtype)
    return tuple(tuple(r.token_ids) for r in engine.run(GREEDY_PROMPTS, [0, 1, 2, 3]))


# with a float16 KV cache too (both engines on it), for two of the drafters; and in
# bfloat16 (weights, activations and cache) for four
@pytest.mark.parametrize("drafter,k,kv_cache,dtype", [(d, k, "float32", "float32") for d, k in GREEDY_CASES]
                         + [("model", 4, "float16", "float32"), ("hybrid-wide", 2, "float16", "float32")]
                         + [(d, k, "bfloat16", "bfloat16") for d, k in
                            [("model", 4), ("early-exit", 3), ("ngram", 2), ("hybrid-wide", 2)]])
def test_greedy_speculative_equals_greedy_autoregressive(drafter, k, kv_cache, dtype):
    sp = SamplingParams(0.0)
    spec = make_engine(sp, drafter, k, max_new=24, kv_cache=kv_cache, dtype=dtype).run(GREEDY_PROMPTS, [0, 1, 2, 3])
    for a, s in zip(greedy_autoregressive(kv_cache, dtype), spec):
        assert s.token_ids == a
        assert len(s.token_ids) == 24 and s.stop_reason == "max_tokens"
        # Each target call emits accepted + 1 tokens; only the last may be cut at max tokens.
        assert 0 <= sum(s.accepted) + s.calls - 24 <= max(s.drafted, default=k)
        assert len(s.accepted) == len(s.drafted) == s.loops <= s.calls
        assert all(0 <= a <= d for a, d in zip(s.accepted, s.drafted))
        assert set(s.drafted) <= ({k, WIDE} if drafter == "hybrid-wide" else {k})
    if drafter == "hybrid-wide":  # wide rounds ran, on PROMPT's repeats at least
        assert any(WIDE in s.drafted for s in spec)


@pytest.mark.parametrize("drafter", ["model", "ngram", "feature", "hybrid"])
def test_sample_depends_only_on_its_seed_not_its_batch(drafter):
    """Tokens and statistics of a row are the same alone and among other rows (n-gram: a
    batch-mate with a match must not change a row that has none, and vice versa), also when
    the batch's prefill runs in groups of different counts of passes (a row scattered into
    another's slot, or prefilled for too few passes, fails here)."""
    sp = SamplingParams(1.0, 0, 0.9)
    engine = make_engine(sp, drafter, 3, max_new=12)
    prompts = [[5, 4], PROMPT, [3, 1] * 35, [7, 6, 5, 4, 3], [2, 6] * 20, [1, 2, 1, 2, 1, 2]]
    seeds = [1, 42, 5, 3, 7, 9]
    # 4 rows of one prefill pass, 1 of two, 1 of three
    assert [c for _, c in prefill_groups([len(p) for p in prompts])] == [1, 2, 3]
    batched = engine.run(prompts, seeds)
    for prompt, seed, together in zip(prompts, seeds, batched):
        alone = engine.run([prompt], [seed])[0]
        assert alone.token_ids == together.token_ids
        assert (alone.accepted, alone.calls) == (together.accepted, together.calls)


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_rows_that_share_a_prompt_are_prefilled_once_and_sample_as_alone(drafter):
    """Rows with one prompt under many seeds are prefilled once and copied (`decode.insert`'s
    source): each row's tokens and statistics equal the row run alone. Catches a copy that
    keeps the prefilled row's seed instead of its own (every copy would sample alike), a
    slot given another distinct prompt, and distinct prompts out of first-use order."""
    import dataclasses

    sp = SamplingParams(1.0, 0, 0.9)
    engine = make_engine(sp, drafter, 3, max_new=12)
    a, b, c = PROMPT, [5, 4], [7, 6, 5, 4, 3]
    prompts = [b, a, a, c, a, b, a, a, a]
    seeds = [3, 1, 2, 4, 5, 6, 7, 8, 9]
    calls = []
    insert = engine.insert

    def spy(*args):
        calls.append(args)
        return insert(*args)

    shared = dataclasses.replace(engine)
    shared.insert = spy
    batched = shared.run(prompts, seeds)
    assert [len(args[2]) for args in calls] == [4]  # 3 distinct prompts in one call of 4 rows
    assert calls[0][-1] is not None
    for prompt, seed, together in zip(prompts, seeds, batched):
        alone = engine.run([prompt], [seed])[0]
        assert alone.token_ids == together.token_ids
        assert (alone.accepted, alone.calls) == (together.accepted, together.calls)
    assert len({tuple(r.token_ids) for r, p in zip(batched, prompts) if p == a}) > 1


@pytest.mark.parametrize("drafter", ["model", "feature"])
def test_prefill_in_passes_equals_one_forward(drafter):
    """Catches a prefill loop that feeds a pass at the wrong positions, skips or repeats
    one, or gives the drafter the wrong offset or features: three passes of
    PREFILL_CHUNK positions leave the target's and the draft's caches as one forward over
    the same positions does (the drafter's own prefill at offset 0); a fourth pass past
    the positions compared changes none of them."""
    import jax

    from specsamp.decoding.decode import PREFILL_CHUNK, prefill
    from specsamp.decoding.state import prefix_positions
    from specsamp.models.model import Model

    eng = make_engine(SamplingParams(1.0), drafter, 2)
    prog, tp, dp = eng.prog, eng.target_params, eng.draft_params
    n = 3 * PREFILL_CHUNK
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, tiny.TARGET.vocab_size, (2, n + 1)), jnp.int32)
    lens = jnp.asarray([n + 1, n + 1], jnp.int32)
    state = new_state(prog, prompts, lens, 4, jnp.asarray([1, 2], jnp.uint32), 256)

    tokens = state.tokens[:, :n]
    hidden, cache = Model(prog.target).forward(tp, tokens, prefix_positions(tokens),
                                               state.target_cache, head=False)
    zero = jnp.zeros((2,), jnp.int32)
    draft = prog.drafter.prefill(dp, tokens, prog.drafter.observe(state.draft, hidden, zero), zero)
    draft_cache = draft if drafter == "model" else draft.cache
    for passes in (3, 4):
        got = prefill(prog, tp, dp, state, jnp.int32(passes))
        got_draft = got.draft if drafter == "model" else got.draft.cache
        for want, have in [(cache, got.target_cache), (draft_cache, got_draft)]:
            for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(have)):
                np.testing.assert_allclose(np.asarray(b)[..., :n, :], np.asarray(a)[..., :n, :],
                                           rtol=1e-5, atol=1e-5)
        if drafter == "feature":  # the target's features the draft reads
            np.testing.assert_allclose(np.asarray(got.draft.features)[:, :n],
                                       np.asarray(draft.features)[:, :n], rtol=1e-5, atol=1e-5)


def test_rows_stop_independently_on_eos():
    """A row that hits EOS stops there (EOS kept); the others go on to max tokens."""
    sp = SamplingParams(0.0)
    prompts = [PROMPT, [5, 4]]
    free = make_engine(sp, "model", 3, max_new=16).run(prompts, [0, 0])
    first = free[0].token_ids
    cut = next(j for j in range(1, 16) if first[j] not in first[:j])  # a fresh token
    eos = first[cut]
    drafter, draft_params = tiny.drafter("tiny-draft", 3, sp)
    engine = Engine(Program(tiny.TARGET, sp, drafter), tiny.target_params(), draft_params,
                    eos_ids=(eos,), max_new_tokens=16)
    a, b = engine.run(prompts, [0, 0])
    assert a.token_ids == first[: cut + 1] and a.stop_reason == "eos"
    other = free[1].token_ids
    end = other.index(eos) + 1 if eos in other else 16
    assert b.token_ids == other[:end]
    assert b.stop_reason == ("eos" if eos in other else "max_tokens")


def _host_lookup_finds(tokens: list[int], t: int, lo: int = 2, hi: int = 3) -> bool:
    """Plain-Python n-gram lookup: does tokens[t-n+1..t] occur ending earlier, for some n?"""
    return any(t >= n - 1 and tokens[e - n + 1:e + 1] == tokens[t - n + 1:t + 1]
               for n in range(lo, hi + 1) for e in range(n - 1, t))


def test_hybrid_uses_the_model_exactly_in_rounds_where_lookup_finds_nothing():
    """Replays each round's lookup on the host: rows with a match cost one draft call (the
    cache refresh), rows without run the model's chain of K calls."""
    k = 3
    engine = make_engine(SamplingParams(0.0), "hybrid", k, max_new=24)
    prompts = [[7], [1, 2, 1, 2, 1, 2], [5, 4], PROMPT]
    lookups = models = 0
    for prompt, r in zip(prompts, engine.run(prompts, [0, 1, 2, 3])):
        tokens = list(prompt) + list(r.token_ids)
        t, expected = len(prompt) - 1, 0
        assert r.loops == r.calls == len(r.accepted)  # every round scores a draft
        for n in r.accepted:
            found = _host_lookup_finds(tokens, t)
            lookups, models = lookups + found, models + (not found)
            expected += 1 if found else k
            t += n + 1
        assert r.draft_calls == expected
    assert lookups and models  # both kinds of round ran


@pytest.mark.parametrize("drafter,k", [("ngram", 2), ("hybrid-wide", 1)])
def test_rounds_that_branch_update_the_kv_cache_in_place(drafter, k):
    """Rounds that choose between two forwards of different widths (n-gram: score or a
    plain step; wide rounds) must not copy the target's KV cache: `lax.cond` branches did,
    twice per round, a third of a decode step at batch 1 on the embedded model."""
    import re

    from specsamp.decoding.decode import generate, new_state

    engine = make_engine(SamplingParams(0.0), drafter, k)
    state = new_state(engine.prog, jnp.ones((2, 8), jnp.int32), jnp.array([8, 8]), 8,
                      jnp.zeros(2, jnp.uint32), 64)
    hlo = generate.lower(engine.prog, k, engine.target_params, engine.draft_params, state,
                         jnp.array([-1]), jnp.array([-1]), jnp.int32(4), jnp.int32(3)).compile().as_text()
    cache = state.target_cache.k.shape
    shape = f"f32[{','.join(map(str, cache))}]"
    copies = [line for line in hlo.splitlines() if re.search(r"= " + re.escape(shape) + r"\S* copy\(", line)]
    assert " while(" in hlo and not copies, copies[:2]
