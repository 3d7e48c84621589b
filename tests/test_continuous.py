"""Continuous batching: rows inserted into free slots at chunk boundaries sample exactly as
under static batching (same tokens for the same prompt and seed), whatever their slot,
neighbours or insertion time."""

import dataclasses

import numpy as np
import pytest

from specsamp.decoding.config import KChoice, SamplingParams
from specsamp.decoding.engine import Continuous, Engine
from tests import tiny
from tests.test_exactness import PROMPT, exact_joint, chi_square_pvalue, make_engine, ALPHA, N_TOKENS

# Prompts of three buckets' worth of lengths (the tiny model's context is 256).
PROMPTS = [PROMPT, [5, 4], [7], [3, 3, 3, 3, 3, 3, 1], list(range(1, 8)) * 6, [2, 6] * 20,
           [1, 2, 1, 2, 1, 2], [6] * 70, [4, 5, 6]]
SEEDS = list(range(100, 100 + len(PROMPTS)))


def _eos_engine(sp, drafter, k, max_new):
    """An engine whose EOS id ends rows at different times (mixed output lengths)."""
    eng = make_engine(sp, drafter, k, max_new=max_new)
    eng.eos_ids = (5,)
    return eng


def switching(engine: Engine, ks, policy) -> Engine:
    """`engine` with its own statistics, at the K values ks, chosen per chunk by `policy`."""
    return dataclasses.replace(engine, k=KChoice(tuple(ks), auto=True), policy=policy)


@pytest.mark.parametrize("drafter,k,temperature", [
    ("none", 1, 1.0), ("model", 3, 0.0), ("hybrid", 2, 0.0), ("feature", 3, 1.0), ("ngram", 2, 0.8),
])
def test_continuous_rows_equal_static_rows(drafter, k, temperature):
    """Each row, inserted into 3 slots at different times next to different rows, has the
    tokens and statistics it has in the static engine. Catches a slot that
    keeps its previous occupant's cache, features or counters, keys that depend on the
    slot, and rows that read their neighbours."""
    sp = SamplingParams(temperature, 0, 0.9 if temperature else 1.0)
    static = _eos_engine(sp, drafter, k, max_new=20)
    got = static.run(PROMPTS, SEEDS, batching=Continuous(3, chunk_rounds=5))
    lengths = set()
    # One static batch (a row's tokens do not depend on its static batch either:
    # test_exactness.test_sample_depends_only_on_its_seed_not_its_batch).
    for row, alone in zip(got, static.run(PROMPTS, SEEDS)):
        assert row.token_ids == alone.token_ids
        assert (row.stop_reason, row.accepted, row.calls, row.draft_calls) == (
            alone.stop_reason, alone.accepted, alone.calls, alone.draft_calls)
        assert row.prefill_s > 0 and row.decode_s > 0
        lengths.add(len(row.token_ids))
    assert len(lengths) > 2  # rows really ended at different times


@pytest.mark.parametrize("drafter,k,temperature", [("feature", 2, 1.0), ("model", 3, 0.0)])
def test_last_rows_move_into_fewer_slots(drafter, k, temperature):
    """Once no prompt is queued and at most half the slots run, the running rows move into
    a state of fewer slots (down to one): each row still has its static tokens and
    statistics. Catches a move that loses a row's cache, drafter state, keys or counters,
    or that maps results back to the wrong prompt."""
    sp = SamplingParams(temperature, 0, 0.9 if temperature else 1.0)
    static = _eos_engine(sp, drafter, k, max_new=24)
    cont = dataclasses.replace(static)  # statistics of the continuous run alone
    prompts, seeds = PROMPTS + PROMPTS[:3], SEEDS + [7, 8, 9]
    got = cont.run(prompts, seeds, batching=Continuous(4))
    assert set(cont.slot_rounds) == {4, 2, 1}, cont.slot_rounds
    # the host's per-slot round counters moved with their rows: every round's accepted
    # draft tokens counted once for the K policy
    assert cont.depth[0].sum() == sum(sum(r.accepted) for r in got) > 0
    for row, alone in zip(got, static.run(prompts, seeds)):
        assert row.token_ids == alone.token_ids
        assert (row.stop_reason, row.accepted, row.calls, row.draft_calls) == (
            alone.stop_reason, alone.accepted, alone.calls, alone.draft_calls)
        assert row.decode_s > 0


def test_continuous_sampling_matches_exact_target_distribution():
    """Chi-square of the joint law of the first three tokens over many rows that pass
    through 64 slots (a sampler that reused a slot's stale state would fail it)."""
    sp = SamplingParams(1.0)
    static = make_engine(sp, "model", 2, max_new=N_TOKENS)
    n = 6000
    counts = np.zeros((tiny.TARGET.vocab_size,) * N_TOKENS)
    for r in static.run([PROMPT] * n, list(range(n)), batching=Continuous(64)):
        counts[tuple(r.token_ids[:N_TOKENS])] += 1
    assert chi_square_pvalue(counts, exact_joint(sp)) > ALPHA


class _Cycle:
    """A K policy that walks through the engine's ks in turn (every switch, plain rounds
    included, happens), recording what it saw."""

    def __init__(self, n):
        self.n, self.i, self.seen = n, -1, []

    def __call__(self, accepted, tested, depth):
        assert np.all(accepted <= tested)
        kept, tried = depth  # by draft position: position d + 1 is tried only after d is kept
        assert np.all(kept <= tried) and np.all(tried[1:] <= kept[:-1])
        self.seen.append(len(tested))
        self.i = (self.i + 1) % self.n
        return self.i


@pytest.mark.parametrize("drafter", ["model", "hybrid", "hybrid-wide"])
def test_switching_k_between_chunks_keeps_greedy_output(drafter):
    """Chunks alternate K = 0 (plain rounds, after which the drafter's cache is rebuilt),
    1 and 3: greedy output equals the static autoregressive engine's token for token.
    Catches a K switch that corrupts the state or a stale draft cache that changes output
    (hybrid-wide: with wide rounds of 3 lookup tokens inside K = 1 chunks)."""
    sp = SamplingParams(0.0)
    ar = _eos_engine(sp, "none", 1, max_new=20).run(PROMPTS, SEEDS)
    policy = _Cycle(3)
    cont = switching(_eos_engine(sp, drafter, 3, max_new=20), (0, 1, 3), policy)
    got = cont.run(PROMPTS, SEEDS, batching=Continuous(3, chunk_rounds=3))
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert set(cont.k_rounds) == {0, 1, 3} and max(policy.seen) == 3
    assert any(r.loops for r in got) and all(r.loops <= r.calls for r in got)


def test_wide_rounds_stay_out_of_the_k_policy_counts():
    """K = 1 chunks with wide rounds (3 lookup tokens): the policy's per-position counts
    describe the chunk's own K only, so positions 2-4 stay untested (counting the wide
    rounds' long matches there made the policy overrate K = 4)."""
    sp = SamplingParams(0.0)
    cont = switching(_eos_engine(sp, "hybrid-wide", 4, max_new=20), (1, 4), _Plain())
    got = cont.run(PROMPTS, SEEDS, batching=Continuous(3, chunk_rounds=4))
    assert any(3 in r.drafted for r in got)  # wide rounds ran
    accepted, tested = cont.depth
    assert tested[0] > 0 and not tested[1:].any() and not accepted[1:].any()


class _Observed:
    """A K policy that always picks index 0 and records what each timed chunk reports
    (`KPolicy.observe`): (rounds, modelled rounds, its wide rounds' report, its counted
    rounds' (tokens, row-rounds))."""

    def __init__(self):
        self.chunks = []

    def __call__(self, accepted, tested, depth):
        return 0

    def observe(self, shape, seconds, rounds, slots, modelled=None, counted=None, wide=None):
        self.chunks.append((rounds, modelled, wide, counted))


@pytest.mark.parametrize("drafter,more", [("hybrid-wide", True), ("model", False)])
def test_chunks_count_their_wide_rounds_by_what_they_emitted(drafter, more):
    """K = 1 chunks with wide rounds (3 lookup tokens, kept far more often than K = 1's
    one guess) report more modelled rounds than they ran, so that the policy prices K = 1
    by the tokens its chunks really emitted; with a draft model (no wide round) the two
    agree. Catches the runner reporting only the rounds it ran (the chunks' time then
    carries the wide rounds' cost without their tokens, and K = 1 looks dearer than it is)."""
    sp = SamplingParams(0.0)
    policy = _Observed()
    cont = switching(_eos_engine(sp, drafter, 4, max_new=20), (1, 4), policy)
    got = cont.run(PROMPTS, SEEDS, batching=Continuous(3, chunk_rounds=4))
    assert any(3 in r.drafted for r in got) == more  # wide rounds ran (or not)
    ran = sum(rounds for rounds, _, _, _ in policy.chunks)
    modelled = sum(m for _, m, _, _ in policy.chunks)
    assert ran == sum(cont.k_rounds.values()) > 0
    assert modelled > 1.05 * ran if more else modelled == pytest.approx(ran)
    # The wide rounds' report (`WideRounds`) is the same chunk counted apart: its rounds
    # and tokens give the modelled rounds back, and its wide rounds are the rows' 3s.
    reports = [(r, m, w, c) for r, m, w, c in policy.chunks if r]
    assert all((w is not None) == more for _, _, w, _ in reports)
    if more:
        for rounds, m, (rows, wide, wide_tokens), (tokens, counted) in reports:
            counted_as = rounds * (wide_tokens + tokens) / (tokens / counted) / rows if counted else rounds
            assert m == pytest.approx(counted_as)
        assert sum(w[1] for _, _, w, _ in reports) == sum(r.drafted.count(3) for r in got)


def test_switching_k_samples_exactly():
    """The same switching under sampling (temperature 1, the feature draft whose cache and
    features must survive plain chunks): chi-square against the exact target law."""
    sp = SamplingParams(1.0)
    cont = switching(make_engine(sp, "feature", 3, max_new=N_TOKENS), (0, 1, 3), _Cycle(3))
    n = 6000
    counts = np.zeros((tiny.TARGET.vocab_size,) * N_TOKENS)
    for r in cont.run([PROMPT] * n, list(range(n)), batching=Continuous(64, chunk_rounds=1)):
        counts[tuple(r.token_ids[:N_TOKENS])] += 1
    assert chi_square_pvalue(counts, exact_joint(sp)) > ALPHA


class _Plain:
    """A K policy that always picks K = 0 (index 0), counting its calls (one per chunk)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, accepted, tested, depth):
        self.calls += 1
        return 0


def test_plain_chunks_run_until_slots_free():
    """Plain chunks test no draft, so the policy's next choice could not differ: they run
    until rows finish (as an autoregressive engine does), not chunk_rounds at a time.
    Catches a K = 0 chunk that returns to the host every chunk_rounds rounds."""
    sp = SamplingParams(0.0)
    ar = _eos_engine(sp, "none", 1, max_new=20).run(PROMPTS, SEEDS)
    policy = _Plain()
    cont = switching(_eos_engine(sp, "model", 3, max_new=20), (0, 3), policy)
    got = cont.run(PROMPTS, SEEDS, batching=Continuous(3, chunk_rounds=2))
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    # at most one chunk per finished row (each frees a slot), and far fewer than rounds / 2
    assert policy.calls <= len(PROMPTS) < cont.k_rounds[0] / 2


class _PlainFor(_Plain):
    """K = 0 always, with plain chunks of at most `limit` rounds (`KPolicy.plain_rounds`);
    records each chunk's rounds."""

    def __init__(self, limit):
        super().__init__()
        self.limit, self.rounds = limit, []

    def plain_rounds(self, chunk):
        return max(self.limit, chunk)

    def observe(self, shape, seconds, rounds, slots, modelled=None, counted=None, wide=None):
        self.rounds.append(rounds)


def test_plain_chunks_run_as_long_as_the_policy_says():
    """A policy that will revisit a close plain call after so many rounds bounds its plain
    chunks to them (at batch 1 a chunk would otherwise run to the end of its row): every
    chunk runs at most that many rounds, and the tokens are plain decoding's. Catches a
    runner that ignores the bound."""
    sp = SamplingParams(0.0)
    ar = _eos_engine(sp, "none", 1, max_new=20).run(PROMPTS[:1], SEEDS[:1])
    policy = _PlainFor(2)
    cont = switching(_eos_engine(sp, "model", 3, max_new=20), (0, 3), policy)
    got = cont.run(PROMPTS[:1], SEEDS[:1], batching=Continuous(1, chunk_rounds=1))
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert max(policy.rounds) == 2 and sum(policy.rounds) == cont.k_rounds[0] >= 5
    assert policy.calls == len(policy.rounds)


def test_a_run_the_policy_keeps_plain_goes_without_the_drafter(monkeypatch):
    """A K policy whose measured rounds make drafting dear puts fresh rows at K = 0, and a
    plain run never changes that: the run then inserts and decodes without the drafter (no
    drafter in any program it compiles or runs) and its rows have the tokens and statistics
    of plain rounds with the drafter (sampled: the same seeds, the same tokens). Where
    drafting is cheap the drafter stays. Catches a detached run whose samples differ, and a
    run that feeds a drafter it never uses."""
    from specsamp.decoding import engine as engine_module
    from specsamp.decoding.costs import CostCurve
    from specsamp.decoding.kpolicy import KPolicy

    progs = []
    real = engine_module.compiled

    def spy(fn, static, traced):
        if "prog" in static:  # inserts, chunks, resyncs
            progs.append(static["prog"])
        return real(fn, static, traced)

    monkeypatch.setattr(engine_module, "compiled", spy)
    sp = SamplingParams(1.0, 0, 0.9)
    eng = _eos_engine(sp, "feature", 3, max_new=20)
    ks = (0, 1, 3)
    batching = Continuous(3, chunk_rounds=4)
    dear = switching(eng, ks, KPolicy(CostCurve(3, {0: 1.0, 1: 10.0, 3: 30.0}), ks))
    got = dear.run(PROMPTS, SEEDS, batching=batching)
    assert progs and all(p.drafter is None for p in progs) and set(dear.k_rounds) == {0}
    attached = switching(eng, ks, _Plain())
    progs.clear()
    for row, plain in zip(got, attached.run(PROMPTS, SEEDS, batching=batching)):
        assert row.token_ids == plain.token_ids
        assert (row.stop_reason, row.accepted, row.calls, row.draft_calls, row.drafted) == (
            plain.stop_reason, plain.accepted, plain.calls, plain.draft_calls, plain.drafted)
    assert all(p.drafter is not None for p in progs)
    cheap = switching(eng, ks, KPolicy(CostCurve(3, {0: 1.0, 1: 1.0, 3: 1.0}), ks))
    progs.clear()
    cheap.run(PROMPTS, SEEDS, batching=batching)
    assert all(p.drafter is not None for p in progs) and set(cheap.k_rounds) - {0}
    # every finished row told the policy its counts (`RowRates.finish`): together, what
    # the engine pooled by draft position over the same rounds
    finished = cheap.policy.rows.finished
    assert 0 < finished[0] <= len(PROMPTS)
    assert finished[1:3] == pytest.approx([cheap.depth[0].sum(), cheap.depth[1].sum()])


def test_prefill_groups_cover_rows_once_at_their_own_passes():
    """Catches a plan that drops or repeats a row, runs a row for fewer or more prefill
    passes than its own, or makes shapes other than powers of two; and one that splits
    when splitting saves little."""
    from specsamp.decoding.decode import PREFILL_CHUNK, prefill_chunks
    from specsamp.decoding.shapes import prefill_groups

    lens = [81, 91, 91, 100, 101, 113, 113, 115, 122, 126, 129, 133, 135, 136, 137, 142, 143,
            144, 146, 148, 156, 157, 158, 159, 160, 160, 167, 167, 169, 201, 209, 212]
    groups = prefill_groups(lens)
    rows = sorted(i for members, _ in groups for i in members)
    assert rows == list(range(len(lens)))
    for members, count in groups:
        assert len(members) & (len(members) - 1) == 0
        assert all(prefill_chunks(lens[i]) == count for i in members)
    computed = sum(len(m) * c * PREFILL_CHUNK for m, c in groups)
    assert computed < 0.7 * len(lens) * 256  # 32 rows padded to 256 before passes
    assert sum(n - 1 for n in lens) <= computed < sum(n - 1 + PREFILL_CHUNK for n in lens)
    assert [prefill_chunks(n) for n in (1, 2, 33, 34, 65)] == [1, 1, 1, 2, 2]
    assert prefill_groups([100, 120, 128, 97]) == [([0, 1, 2, 3], 4)]
    assert prefill_groups([120, 140]) == [([0, 1], 5)]  # 9 of 10 passes: not worth a split
    assert prefill_groups([30, 200]) == [([0], 1), ([1], 7)]


def _distinct_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, tiny.TARGET.vocab_size, int(rng.integers(1, 40))).tolist() for _ in range(n)]


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_static_and_continuous_policies_equal_greedy_autoregressive(drafter):
    """One engine, three host policies: static batching, continuous batching over 3 slots
    (refills, rows moved into fewer slots) and the plain autoregressive engine, all on
    distinct prompts: greedy tokens are the same row for row. Catches a policy that maps a
    result to another prompt, a refill that keeps a slot's previous occupant, and any
    round that differs between the policies."""
    sp = SamplingParams(0.0)
    prompts = _distinct_prompts(7, 3)
    seeds = list(range(7))
    spec = _eos_engine(sp, drafter, 3, max_new=16)
    ar = _eos_engine(sp, "none", 1, max_new=16).run(prompts, seeds)
    static = spec.run(prompts, seeds)
    cont = spec.run(prompts, seeds, batching=Continuous(3, chunk_rounds=2))
    want = [r.token_ids for r in ar]
    assert len(set(want)) > 3  # distinct prompts, distinct outputs
    assert [r.token_ids for r in static] == want == [r.token_ids for r in cont]
    assert all(r.loops for r in static)
    for a, b in zip(static, cont):
        assert (a.accepted, a.drafted, a.calls) == (b.accepted, b.drafted, b.calls)


class _Recording(_Cycle):
    """`_Cycle`, keeping the (accepted, tested) arrays it was given at each choice."""

    def __init__(self, n):
        super().__init__(n)
        self.inputs = []

    def __call__(self, accepted, tested, depth):
        self.inputs.append((accepted.copy(), tested.copy()))
        return super().__call__(accepted, tested, depth)


def test_acceptance_counts_after_k_switches():
    """A drafter that is the target itself (greedy: every draft token is kept) in chunks
    that switch K between 0, 1 and 3: each row's loops keep all they drafted at the K the
    round ran (accepted == drafted, each round's tokens == accepted + 1), the K policy sees
    every running row with accepted == tested, and the engine's counts by draft position
    are exactly the rows' loops. Catches acceptance counted at another K than the round's
    (e.g. the K of the chunk before a switch), which drops or misplaces a chunk's loops."""
    from specsamp.decoding.decode import Program
    from specsamp.decoding.drafters import ModelDrafter

    sp = SamplingParams(0.0)
    params = tiny.target_params()
    same = Engine(Program(tiny.TARGET, sp, ModelDrafter(tiny.TARGET, 3, sp)), params, params,
                  max_new_tokens=24)
    policy = _Recording(3)
    eng = switching(same, (0, 1, 3), policy)
    prompts, seeds = _distinct_prompts(6, 5), list(range(6))
    got = eng.run(prompts, seeds, batching=Continuous(3, chunk_rounds=2))
    ar = _eos_engine(sp, "none", 1, max_new=24)
    ar.eos_ids = ()
    assert [r.token_ids for r in got] == [r.token_ids for r in ar.run(prompts, seeds)]
    assert set(eng.k_rounds) == {0, 1, 3}
    assert {d for r in got for d in r.drafted} == {1, 3}  # drafted rounds at both K
    for r in got:
        rounds = r.rounds
        for i, (n, kept) in enumerate(zip(rounds.tokens, rounds.accepted)):
            if i + 1 < rounds.calls:  # the last round may be cut at max_new_tokens
                assert n == (kept + 1 if kept >= 0 else 1)
                assert kept < 0 or kept == rounds.drafted[i]
        assert sum(rounds.tokens) == len(r.token_ids)
    assert any(len(t) > 0 for _, t in policy.inputs)
    for accepted, tested in policy.inputs:
        np.testing.assert_array_equal(accepted, tested)
    kept, tried = eng.depth
    loops = [(n, k) for r in got for n, k in zip(r.accepted, r.drafted)]
    for d in range(3):  # a loop of K that kept n tested positions 1..min(n + 1, K)
        assert kept[d] == sum(n > d for n, _ in loops)
        assert tried[d] == sum(min(n + 1, k) > d for n, k in loops)
