"""The batch-aware K policy picks the K of highest expected tokens per second."""

import numpy as np
import pytest

from specsamp.decoding.batching import modelled_rounds
from specsamp.decoding.costs import CostCurve
from specsamp.decoding.kpolicy import KPolicy
from specsamp.decoding.position_rates import depth_counts, expected_tokens_by_position
from specsamp.decoding.row_rates import RowRates
from specsamp.decoding.stats import expected_tokens

KS = (0, 1, 2, 4)


def _policy(score, draft=0.0):
    """A round at K costs score(K + 1) (scoring K + 1 tokens) + K * draft."""
    return KPolicy(CostCurve(8, {k: score(k + 1) + k * draft for k in KS}), KS)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(np.array([0.0, 0.5, 1.0]), 2) == pytest.approx([1.0, 1.75, 3.0])


def test_flat_scoring_costs_favour_long_drafts():
    """Memory-bound (scoring K+1 tokens costs one step): drafting pays at any alpha > 0."""
    policy = _policy(lambda t: 1.0, draft=0.01)
    assert KS[policy(np.array([30.0, 28.0]), np.array([40.0, 40.0]))] == 4


def test_compute_bound_scoring_turns_drafting_off():
    """Compute-bound (cost grows with tokens scored) and alpha 0.3: plain rounds win, also
    with rates by draft position (each row counts one token at K = 0, not the batch one)."""
    policy = _policy(lambda t: float(t), draft=0.05)
    assert KS[policy(np.array([3.0, 3.0]), np.array([10.0, 10.0]))] == 0
    depth = (np.array([6.0, 0, 0, 0]), np.array([20.0, 0, 0, 0]))
    assert KS[policy(np.array([3.0, 3.0]), np.array([10.0, 10.0]), depth)] == 0
    many = np.full(32, 6.0), np.full(32, 10.0)  # alpha 0.6 at rounds measured at batch 32
    batch32 = KPolicy(CostCurve(32, {0: 0.070, 1: 0.143, 2: 0.188, 4: 0.284}), KS)
    assert KS[batch32(*many, (np.array([192.0, 0, 0, 0]), np.array([320.0, 0, 0, 0])))] == 0


def test_choice_follows_acceptance_at_a_middle_cost():
    """Scoring costs 1 + 0.2 per extra token: rows that accept 90% draft 4, rows that
    accept 10% do not draft at all."""
    policy = _policy(lambda t: 1 + 0.2 * (t - 1), draft=0.02)
    assert KS[policy(np.array([90.0]), np.array([100.0]))] == 4
    assert KS[policy(np.array([10.0]), np.array([100.0]))] == 0
    assert list(policy.chosen) == [4, 0]


def test_depth_counts_by_draft_position():
    """Loops that kept 0, 2 and 4 of 4 tokens: position 1 tested 3 times and kept twice,
    position 4 tested and kept once (a loop tests up to its first rejection)."""
    accepted, tested = depth_counts([0, 2, 4], 4, 4)
    assert accepted.tolist() == [2, 2, 1, 1] and tested.tolist() == [3, 2, 2, 1]
    # Loops of their own K (k auto): 1 of 1 kept tests no further; 1 of 3 kept tests position 2.
    accepted, tested = depth_counts([1, 1, 0], [1, 3, 2], 4)
    assert accepted.tolist() == [2, 0, 0, 0] and tested.tolist() == [3, 1, 0, 0]
    rates = np.ones(4)
    assert expected_tokens_by_position(0.5, rates, 3) == pytest.approx(expected_tokens(0.5, 3))


def test_deep_positions_kept_rarely_shorten_the_draft():
    """Rows that accept 90%: 4 tokens under the plain model, but when the run shows the
    draft's second to fourth guesses kept 1 time in 10 (a chained draft), 1 token; with no
    round yet past position 1, the plain model's choice."""
    policy = _policy(lambda t: 1 + 0.2 * (t - 1), draft=0.02)
    acc, tested = np.array([90.0]), np.array([100.0])
    first_only = (np.array([90.0, 0, 0, 0]), np.array([100.0, 0, 0, 0]))
    assert KS[policy(acc, tested, first_only)] == 4
    chained = (np.array([900.0, 90, 9, 1]), np.array([1000.0, 900, 90, 9]))
    policy.chunks.update(range(len(KS)))  # every K ran a chunk: none is explored
    assert KS[policy(acc, tested, chained)] == 1


def test_fresh_rows_borrow_the_pooled_rate():
    """A row without tested tokens is estimated at its neighbours' pooled rate, not 0."""
    policy = _policy(lambda t: 1.0)
    alpha = policy.rows(np.array([0.0, 80.0]), np.array([0.0, 100.0]))
    assert alpha[0] == pytest.approx(81 / 102)


def _at_ks(engine, ks):
    """`engine` at the K values ks (a K policy's)."""
    import dataclasses

    from specsamp.decoding.config import KChoice

    return dataclasses.replace(engine, k=KChoice(ks, auto=True))


def test_cost_curve_is_measured_once_then_read_from_disk(tmp_path, monkeypatch):
    """The first call times a round at every K of the engine and writes the seconds under
    $SPECSAMP_CACHE/costs; a second call reads them and times nothing."""
    from specsamp.decoding import costs
    from specsamp.decoding.config import SamplingParams
    from tests.test_exactness import make_engine

    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path))
    cont = _at_ks(make_engine(SamplingParams(0.0), "model", 4), (0, 2))
    first = costs.cost_curve(cont, 2, slots=128, width=16, repeats=1)
    assert sorted(first.rounds) == [0, 2] and all(s > 0 for s in first.rounds.values())
    assert len(list((tmp_path / "costs").iterdir())) == 1

    def no_timing(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(costs, "time_rounds", no_timing)
    assert costs.cost_curve(cont, 2, slots=128, width=16) == first
    # a rebuilt kernel library is a different machine for its costs, and so is the same
    # build running other code (SPECSAMP_ISA=avx512 on an AMX machine): measured afresh
    from specsamp.quant import kernels

    for name, other in (("library_digest", "another build"), ("isa", "some other isa")):
        with monkeypatch.context() as m:
            m.setattr(kernels, name, lambda other=other: other)
            with pytest.raises(AssertionError, match="measured again"):
                costs.cost_curve(cont, 2, slots=128, width=16)
        assert costs.cost_curve(cont, 2, slots=128, width=16) == first
    # other shapes, other K values, a float16 cache: other rounds
    others = [(cont, 2, 256, 16), (cont, 2, 128, 32), (cont, 3, 128, 16), (_at_ks(cont, (0, 1)), 2, 128, 16),
              (_at_ks(make_engine(SamplingParams(0.0), "model", 4, kv_cache="float16"), (0, 2)), 2, 128, 16)]
    for other, batch, slots, width in others:
        with pytest.raises(AssertionError, match="measured again"):
            costs.cost_curve(other, batch, slots=slots, width=width)


def test_rounds_are_timed_as_the_engine_runs_them(monkeypatch):
    """costs.time_rounds runs each K's own chunk program, `rounds` rounds a call, from the same
    prefilled state: a K = 2 call drafts (2 draft tokens tested per row and round), a plain
    call does not, and neither stops early."""
    from specsamp.decoding import costs, decode
    from specsamp.decoding.config import SamplingParams
    from tests.test_exactness import make_engine

    cont = _at_ks(make_engine(SamplingParams(0.0), "model", 4), (0, 2))
    seen = []
    real = costs.compiled

    def spy(fn, static, traced):
        exe, seconds = real(fn, static, traced)
        if fn is not decode.generate:
            return exe, seconds

        def run(**kw):
            state, ran = exe(**kw)
            seen.append((static["k"] == 0,
                         int(ran), np.asarray(state.round_drafted).max()))
            return state, ran
        return run, seconds

    monkeypatch.setattr(costs, "compiled", spy)
    rounds = costs.time_rounds(cont, 2, slots=128, width=16, repeats=2, rounds=3)
    assert sorted(rounds) == [0, 2] and all(s > 0 for s in rounds.values())
    assert [(plain, ran) for plain, ran, _ in seen] == [(True, 3), (False, 3)] * 2
    assert [drafted for plain, _, drafted in seen if not plain] == [2, 2]


def test_a_small_predicted_gain_keeps_plain_rounds():
    """Drafting predicted 3% faster than plain rounds (within the cost curve's error) keeps
    K = 0; 10% faster drafts. Scoring 2 tokens costs 1.3 steps, alpha 0.34 or 0.43."""
    policy = _policy(lambda t: 1.0 if t == 1 else 1.3 + 10 * (t - 2), draft=0.0)
    few, more = np.array([34.0]), np.array([43.0])
    tested = np.array([100.0])
    assert policy.tokens_per_second(1, policy.rows(few, tested)) == pytest.approx(1.03, abs=0.01)
    assert KS[policy(few, tested)] == 0
    assert policy.tokens_per_second(1, policy.rows(more, tested)) == pytest.approx(1.10, abs=0.01)
    assert KS[policy(more, tested)] == 1
    eager = KPolicy(policy.curve, KS, margin=0.0)
    assert KS[eager(few, tested)] == 1


def test_a_close_plain_call_is_revisited_and_a_clear_one_is_not():
    """Plain rounds test no draft, so a plain choice made on unlucky estimates would stand
    for ever (a run at batch 1 once went plain after one hard prompt and stayed plain for
    the rest of its 32). After `revisit` plain rounds in a row, a chunk runs at the best
    drafted K where it is predicted within `close` of plain rounds, and a close plain
    chunk runs no longer than that (at batch 1 it would otherwise run to the end of its
    row); where drafting loses clearly it never does and plain chunks run on. Rounds of
    runs without the drafter (`fresh_choice` at K = 0) count too, and the run after them
    keeps the drafter for its revisit. Catches a policy that never revisits, one that
    revisits clear losses, one that counts choices instead of rounds, and a revisit that
    fresh runs skip."""
    ks = (0, 1)
    row, tested = np.array([20.0]), np.array([100.0])  # alpha ~0.21: K = 1 ~1.005x plain

    def chunks(policy, rounds):
        """Each choice, then its chunk's rounds as the runner would run them."""
        got = []
        for _ in range(rounds):
            k = ks[policy(row, tested)]
            ran = 16 if k else policy.plain_rounds(16)
            got.append((k, ran))
            policy.observe(k, policy.curve.rounds[k] * (ran or 1000), ran or 1000, slots=1)  # as priced
        return got

    close = KPolicy(CostCurve(1, {0: 1.0, 1: 1.2}), ks)
    assert chunks(close, 5) == [(0, 64), (1, 16), (0, 64), (1, 16), (0, 64)]
    close.plain_run = 0
    close.observe(0, 40.0, 40, slots=8)  # a chunk cut short by a refill: 24 rounds to go
    assert ks[close(row, tested)] == 0 and close.plain_rounds(16) == 24
    close.observe(0, 24.0, 24, slots=8)
    assert ks[close(row, tested)] == 1
    clear = KPolicy(CostCurve(1, {0: 1.0, 1: 3.0}), ks)
    assert chunks(clear, 4) == [(0, None)] * 4
    # fresh rows at the prior alpha 0.5: K = 1 predicted 1.03x plain, within the margin
    fresh = KPolicy(CostCurve(1, {0: 1.0, 1: 1.45}), ks)
    assert ks[fresh.fresh_choice()] == 0
    fresh.observe(0, 40.0, 40, slots=1)  # a run without the drafter, 40 rounds
    assert ks[fresh.fresh_choice()] == 0
    fresh.observe(0, 40.0, 40, slots=1)
    assert ks[fresh.fresh_choice()] == 1
    assert ks[fresh(np.zeros(1), np.zeros(1))] == 1  # the revisit runs in that run's first chunk
    fresh.observe(1, 1.45 * 16, 16, slots=1)
    assert fresh.plain_run == 0 and list(fresh.chosen) == [1]  # a drafted chunk restarts the count


def test_timed_chunks_correct_the_cost_curve():
    """The curve prices K = 1 at 1.6 plain rounds (measured on a busy machine, say) while
    the run's chunks take 1.1: a row at alpha 0.5 starts plain and drafts once 64 timed
    rounds of each say otherwise. Chunks at fewer slots than the curve's do not count; a
    machine twice as slow as the curve moves every shape, timed or not, alike."""
    ks = (0, 1)
    row, tested = np.array([50.0]), np.array([100.0])
    policy = KPolicy(CostCurve(4, {0: 1.0, 1: 1.6}), ks)
    assert ks[policy(row, tested)] == 0
    policy.observe(1, 1.1 * 64, 64, slots=2)  # a compacted tail: ignored
    assert policy.round_seconds(1) == pytest.approx(1.6)
    policy.observe(0, 1.0 * 64, 64, slots=4)
    policy.observe(1, 1.1 * 64, 64, slots=4)
    assert policy.round_seconds(1) == pytest.approx(1.1, rel=0.1)
    assert ks[policy(row, tested)] == 1
    slow = KPolicy(CostCurve(4, {0: 1.0, 1: 1.6}), ks)
    slow.observe(0, 2.0 * 64, 64, slots=4)
    assert slow.round_seconds(0) == pytest.approx(2.0, rel=0.05)
    assert slow.round_seconds(1) == pytest.approx(1.6 * 1.8, rel=0.05)  # untimed: scaled alike


def test_a_short_chunk_does_not_price_its_shape():
    """A chunk's fixed cost spread over one round (a row's last chunk at batch 1: 1-round
    chunks read 1.3-2.2x a round of the same shape) must not price K = 1 out: two such
    chunks at 2.2x left it at 1.02x plain (under the margin) where its rounds give 1.15x.
    Chunks of `timed_min_rounds` rounds count. Catches short chunks timed as any other."""
    ks = (0, 1)
    row, tested = np.array([50.0]), np.array([100.0])
    policy = KPolicy(CostCurve(1, {0: 1.0, 1: 1.3}), ks)
    assert ks[policy(row, tested)] == 1
    for _ in range(2):
        policy.observe(1, 2.2 * 1.3, 1, slots=1)
    assert policy.round_seconds(1) == pytest.approx(1.3)
    assert ks[policy(row, tested)] == 1
    policy.observe(1, 2.2 * 1.3 * policy.timed_min_rounds, policy.timed_min_rounds, slots=1)
    assert policy.round_seconds(1) > 1.5


def test_a_chain_predicted_a_little_below_the_choice_runs_again_now_and_then():
    """A chain whose one exploring chunk (or a dear curve) put it below the choice would
    never run again, so neither its measured round seconds nor its deeper positions' rates
    could move (a run at batch 1 kept K = 1 for 99% of its rounds where the fixed K = 2 was
    5% faster). Every `reexplore`-th drafted-chain choice runs the other chain predicted
    within `reexplore_within` that ran fewest chunks; a clear loss never runs, first runs
    and plain rounds do not count. Once the chain a re-run picks has run
    `reexplore_evidence` = 3 chunks, the wait doubles with each re-run while the choice
    stays (16, 32, then `reexplore_max` = 64 choices: a long run at batch 1 otherwise
    spent one chunk in nine on chains 10-15% slower for good) and starts again at 8 when
    the choice moves. Catches a policy that never re-runs a chain, one that re-runs clear
    losses, one that always re-runs the same chain, one whose re-runs never thin out, one
    that thins them out on a single chunk's evidence and one that keeps a long wait after
    its choice moved."""
    def fixed(speeds):
        policy = KPolicy(CostCurve(1, {0: 1.0, 1: 1.0, 2: 1.0, 4: 1.0}), KS)
        policy._choice = lambda *args: (KS.index(1), list(speeds))
        return policy

    rows = np.array([50.0]), np.array([100.0])
    close = fixed([1.0, 2.0, 1.7, 1.2])  # K = 2 15% below K = 1, K = 4 40% below
    got = [KS[close(*rows)] for _ in range(150)]
    assert got[:9] == [1] * 8 + [2]  # the first K = 1 chunk is a first run
    assert [i for i, k in enumerate(got) if k != 1] == [8, 16, 24, 40, 72, 136]
    assert set(got) == {1, 2}
    clear = fixed([1.0, 2.0, 1.4, 1.2])
    assert [KS[clear(*rows)] for _ in range(20)] == [1] * 20
    for _ in range(1100):  # a long run keeps counts by shape and only its last chunks
        clear(*rows)
    assert len(clear.chosen) == 1024 and dict(clear.chunks) == {KS.index(1): 1120}
    both = fixed([1.0, 2.0, 1.7, 1.6])  # K = 2 and K = 4 both close: they take turns
    got = [KS[both(*rows)] for _ in range(200)]
    assert [i for i, k in enumerate(got) if k != 1] == [8, 16, 24, 32, 40, 56, 88, 152]
    assert [k for k in got if k != 1] == [2, 4] * 4
    both._choice = lambda *args: (KS.index(2), [1.0, 1.7, 2.0, 1.6])  # the choice moves to K = 2
    got = [KS[both(*rows)] for _ in range(8)]
    assert got == [2] * 7 + [4]  # the 8th choice after the move; K = 4 ran fewer chunks than K = 1


def test_chunks_at_a_settled_chain_run_longer():
    """A chunk costs ~1.5 ms beyond its rounds, 2% of a 16-round chunk at batch 1: chunks at
    the chain whose re-runs have backed off run as many times longer as the wait did (2x
    after the first doubling, up to 8x); re-run and first chunks, and every chunk after the
    choice moves, run the base length. Catches long chunks before the wait backs off, at
    a re-run, or kept after the choice moved."""
    policy = KPolicy(CostCurve(1, {0: 1.0, 1: 1.0, 2: 1.0, 4: 1.0}), KS)
    policy._choice = lambda *args: (KS.index(1), [1.0, 2.0, 1.7, 1.2])
    rows = np.array([50.0]), np.array([100.0])
    lengths = []
    for _ in range(150):
        k = KS[policy(*rows)]
        lengths.append((k, policy.drafted_rounds(16)))
    assert lengths[0] == (1, 16) and lengths[8] == (2, 16)  # a first run, a re-run
    assert {n for k, n in lengths[:25]} == {16}  # the wait has not backed off yet
    assert lengths[30] == (1, 32) and lengths[60] == (1, 64) and lengths[100] == (1, 128)
    assert all(n == 16 for k, n in lengths if k == 2)  # re-runs stay short
    assert max(n for _, n in lengths) == 16 * policy.reexplore_max // policy.reexplore
    policy._choice = lambda *args: (KS.index(2), [1.0, 1.7, 2.0, 1.2])  # the choice moves
    assert KS[policy(*rows)] == 2 and policy.drafted_rounds(16) == 16


def test_a_fresh_row_at_batch_1_starts_from_the_engine_history():
    """A row with no tested tokens and no neighbours takes the rate of every row the engine
    ran (here 0.8 or 0.15), not a uniform prior's 0.5: the K it starts at follows."""
    policy = _policy(lambda t: 1 + 0.2 * (t - 1), draft=0.02)
    fresh = np.zeros(1)
    assert policy.rows(fresh, fresh, (80.0, 100.0))[0] == pytest.approx(81 / 102)
    good = (np.array([80.0, 60, 45, 30]), np.array([100.0, 80, 60, 45]))
    bad = (np.array([15.0, 1, 0, 0]), np.array([100.0, 15, 1, 0]))
    assert KS[policy.fresh_choice()] == 1  # no history: at 0.5
    assert KS[policy.fresh_choice(good)] == 4
    assert KS[policy.fresh_choice(bad)] == 0


def test_an_untimed_chain_close_to_the_choice_runs_once():
    """The curve alone prices K = 2 just above K = 1 (predicted within `close`): it runs one
    chunk so that its own rounds are timed, then the timed costs decide (here K = 2 is
    cheaper than the curve said). K = 4, predicted far slower, never runs."""
    policy = KPolicy(CostCurve(1, {0: 1.0, 1: 1.2, 2: 1.5, 4: 3.0}), KS)
    row, tested = np.array([60.0]), np.array([100.0])
    assert KS[policy(row, tested)] == 2  # explored
    policy.observe(2, 1.25 * 64, 64, slots=1)
    policy.observe(1, 1.2 * 64, 64, slots=1)
    assert [KS[policy(row, tested)] for _ in range(3)] == [2, 2, 2]
    other = KPolicy(CostCurve(1, {0: 1.0, 1: 1.2, 2: 1.5, 4: 3.0}), KS)
    other.observe(1, 1.2 * 64, 64, slots=1)
    other(row, tested)
    other.observe(2, 1.6 * 64, 64, slots=1)  # the explored chunk confirms the curve
    assert [KS[other(row, tested)] for _ in range(3)] == [1, 1, 1]
    assert 4 not in other.chosen


def test_chunks_that_emit_more_than_predicted_raise_their_k():
    """Two chains priced alike by the rates model (K = 2 a little below K = 1 here) whose
    K = 2 rounds keep more than the model predicts (as a hybrid's K >= 3 rounds do, their
    lookup rounds being left out of the rates): chunks the policy chose at K = 2 that
    emitted 1.2x the predicted tokens move the choice to K = 2; chunks that emitted what
    was predicted leave it; a chunk the policy did not choose (another caller's K) and a
    plain chunk teach nothing. Catches a policy that ignores what its rounds emitted, and
    one that calibrates by chunks it did not predict."""
    ks = (0, 1, 2)
    curve = CostCurve(1, {0: 1.0, 1: 1.3, 2: 1.62})
    row, tested = np.array([60.0]), np.array([100.0])

    def run(factor, chunks=8):
        policy = KPolicy(curve, ks, reexplore=1000)
        got = []
        for _ in range(chunks):
            k = ks[policy(row, tested)]
            got.append(k)
            alpha = policy.rows(row, tested)
            predicted = float(expected_tokens(alpha, k)[0])
            policy.observe(k, curve.rounds[k] * 16, 16, slots=1, counted=(predicted * 16 * (factor if k == 2 else 1), 16))
        return policy, got

    assert float(expected_tokens(np.array([0.6]), 2)[0]) / 1.62 < float(expected_tokens(np.array([0.6]), 1)[0]) / 1.3
    keep, got = run(1.0)
    assert got[-4:] == [1] * 4 and keep.calibration(2) == pytest.approx(1.0)
    more, got = run(1.2)
    assert 2 in got[:2] and got[-4:] == [2] * 4 and more.calibration(2) > 1.1
    other = KPolicy(curve, ks)
    other.observe(2, 1.62 * 16, 16, slots=1, counted=(100.0, 16))  # not chosen by it
    other(row, tested)
    other.observe(0, 16.0, 16, slots=1, counted=(16.0, 16))
    assert other.calibrated == {}


def test_a_chunk_counts_as_the_rounds_its_tokens_are_worth():
    """Two rows over a chunk of 4 rounds: row 0 ran 4 modelled rounds (2, 1, 2, 1 tokens),
    row 1 a wide round (3 tokens), a modelled one (1) and another wide one (4), then ended.
    A modelled round emits 7 / 5 tokens on average; the chunk's 14 tokens over 7 row-rounds
    are worth 10 modelled row-rounds: 4 x 10 / 7 batch rounds. With no modelled round the
    chunk counts as it ran."""
    emitted = np.array([[2, 1, 2, 1], [3, 1, 4, 0]])
    mine = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
    counted = np.array([[1, 1, 1, 1], [0, 1, 0, 0]], bool)
    assert modelled_rounds(4, emitted, mine, counted) == pytest.approx(4 * 10 / 7)
    assert modelled_rounds(4, emitted, mine, mine & False) == 4
    assert modelled_rounds(4, emitted, mine, mine) == pytest.approx(4)


def test_timed_chunks_are_priced_per_modelled_round():
    """K = 1 chunks timed at 1.3 plain rounds a round (the curve's figure), at alpha 0.3:
    1.3 tokens a round, plain rounds win. The same chunks held wide rounds that emitted as
    much as 1.25x their rounds of K = 1 would: K = 1 costs 1.04 per modelled round and
    drafting wins. The machine's drift is read from the rounds as they ran (unchanged)."""
    ks = (0, 1)
    row, tested = np.array([30.0]), np.array([100.0])
    curve = CostCurve(1, {0: 1.0, 1: 1.3})
    plain, wide = KPolicy(curve, ks), KPolicy(curve, ks)
    for policy, modelled in ((plain, 256), (wide, 320)):
        policy.observe(0, 1.0 * 256, 256, slots=1)
        policy.observe(1, 1.3 * 256, 256, slots=1, modelled=modelled)
    assert plain._drift() == wide._drift() == pytest.approx(1.0)
    assert ks[plain(row, tested)] == 0
    assert wide.round_seconds(1) == pytest.approx((16 * 1.3 + 1.3 * 256) / (16 + 320))
    assert ks[wide(row, tested)] == 1


def _wide_chunk(rounds: int, wide: int, wide_tokens: int, counted_tokens: int):
    """One row's chunk of `rounds` rounds, `wide` of them wide (emitting `wide_tokens` in
    all), the rest counted rounds emitting `counted_tokens`: (its modelled rounds as the
    runner counts them, its `WideRounds` report, its counted rounds' (tokens, row-rounds))."""
    emitted = np.zeros((1, rounds))
    emitted[0, :wide] = wide_tokens / wide if wide else 0
    emitted[0, wide:] = counted_tokens / (rounds - wide)
    mine = np.ones((1, rounds), bool)
    counted = mine.copy()
    counted[0, :wide] = False
    report = (float(rounds), float(wide), float(wide_tokens))
    return modelled_rounds(rounds, emitted, mine, counted), report, (float(counted_tokens), rounds - wide)


def test_wide_rounds_are_pooled_over_the_k_values_that_run_them():
    """A hybrid's wide rounds come with the text, not with K: K = 1's own chunks met none
    where K = 2's had a fifth (3 tokens each). K = 1's timed rounds are then counted as if
    they had the pooled share: each of its rounds as 1 + f (t - m) / m modelled rounds
    (checked against a chunk built with that share, counted by the runner's own rule),
    K = 2's move slightly toward the pool, and K = 1 (priced per modelled round) now wins
    where the same chunks without the reports leave K = 2 ahead."""
    ks = (0, 1, 2)
    curve = CostCurve(1, {0: 1.0, 1: 1.3, 2: 1.6})
    row, tested = np.array([55.0]), np.array([100.0])
    one, one_report, one_counted = _wide_chunk(100, 0, 0, 150)  # m = 1.5, no wide round
    two, two_report, two_counted = _wide_chunk(1000, 200, 600, 1600)  # m = 2, f = 0.2, t = 3
    pooled, blind = KPolicy(curve, ks), KPolicy(curve, ks)
    for policy, reports in ((pooled, (one_report, two_report)), (blind, (None, None))):
        policy.observe(1, 1.2 * 100, 100, slots=1, modelled=one, counted=one_counted, wide=reports[0])
        policy.observe(2, 1.6 * 1000, 1000, slots=1, modelled=two, counted=two_counted, wide=reports[1])
    f = 200 / 1100
    as_pooled, _, _ = _wide_chunk(1100, 200, 600, 1.5 * 900)  # K = 1 at the pooled share
    assert pooled.wide.modelled(1, 100, one) == pytest.approx(as_pooled * 100 / 1100)
    assert pooled.wide.modelled(1, 100, one) == pytest.approx(100 * (1 + f * 1.5 / 1.5))
    assert pooled.wide.modelled(2, 1000, two) == pytest.approx(1000 * (1 + f * 1.0 / 2.0))
    assert blind.wide.modelled(1, 100, one) == one == 100
    drift = pooled._drift()
    assert pooled.round_seconds(1) == pytest.approx((16 * 1.3 * drift + 120) / (16 + 100 * (1 + f)))
    assert ks[blind(row, tested)] == 2
    assert ks[pooled(row, tested)] == 1


def _rows(rates, tested, rng):
    """Finished rows' (accepted, tested): `tested` tokens each at its own true rate."""
    return [(float(rng.binomial(tested, r)), float(tested)) for r in rates]


def test_rows_pool_as_strongly_as_their_spread_says():
    """The prior weight a row's count is pooled with is the beta prior's strength that the
    finished rows' spread implies: rows drawn from Beta(m p, m (1 - p)) give about m (here
    m = 40, 20 and 150: a reference sampler, not the formula), rows all alike the upper
    bound; before `spread_rows` rows, `prior_weight`. Catches a spread taken without
    subtracting the binomial noise (weights far too small), an unweighted spread, and the
    weight inverted."""
    rng = np.random.default_rng(0)
    policy = KPolicy(CostCurve(1, {0: 1.0, 1: 1.3}), (0, 1))
    assert policy.rows.weight() == policy.rows.prior_weight
    for m in (40.0, 20.0, 150.0):
        policy.rows.finished[:] = 0
        for accepted, tested in _rows(rng.beta(0.5 * m, 0.5 * m, 2000), 80, rng):
            policy.rows.finish(accepted, tested)
        assert policy.rows.weight() == pytest.approx(m, rel=0.25)
    policy.rows.finished[:] = 0
    for accepted, tested in _rows([0.5] * 400, 80, rng):
        policy.rows.finish(accepted, tested)
    assert policy.rows.weight() >= 150
    policy.rows.finish(3.0, 0.0)  # a row that tested nothing says nothing
    assert policy.rows.finished[0] == 400


def test_a_row_among_alike_rows_is_not_put_on_plain_rounds_by_its_start():
    """HumanEval at T = 1 (measured): rows' rates 0.49 +- 0.035, drafting ~8% faster than
    plain rounds. A row that kept 4 of its first 16 tested tokens is an unlucky start, not
    a bad row: among alike rows it drafts on (plain rounds would run for the rest of it at
    batch 1); among rows whose rates differ widely it is judged on its own count."""
    rng = np.random.default_rng(1)
    ks = (0, 1)
    curve = CostCurve(1, {0: 1.0, 1: 1.36})  # 1.47 tokens a round at 0.47: 1.08x plain
    alike, differ = KPolicy(curve, ks), KPolicy(curve, ks)
    for accepted, tested in _rows(np.clip(rng.normal(0.49, 0.035, 32), 0, 1), 80, rng):
        alike.rows.finish(accepted, tested)
    for accepted, tested in _rows(rng.beta(1.5, 1.5, 32), 80, rng):
        differ.rows.finish(accepted, tested)
    start, tested = np.array([4.0]), np.array([16.0])
    pooled = {}
    for policy, choice in ((alike, 1), (differ, 0)):
        pooled[choice] = tuple(c * np.ones(1) for c in policy.rows.finished[1:3])
        assert ks[policy._choice(start, tested, pooled[choice])[0]] == choice
    weak = KPolicy(curve, ks, rows=RowRates(prior_weight=4.0, spread_rows=10**6))  # the old fixed weight
    assert ks[weak._choice(start, tested, pooled[1])[0]] == 0


def test_the_margin_fades_as_both_costs_are_timed():
    """A 3% predicted gain is within the curve's error while either cost rests on it (plain
    rounds stay); once the run's chunks have timed plain rounds and K = 1 over many rounds,
    the same gain drafts. Timing only one of them keeps the margin."""
    ks = (0, 1)
    row, tested = np.array([34.0]), np.array([100.0])
    curve = CostCurve(1, {0: 1.0, 1: 1.3})
    untimed, one, both = (KPolicy(curve, ks, rows=RowRates(prior_weight=4.0)) for _ in range(3))
    assert untimed.tokens_per_second(1, untimed.rows(row, tested)) == pytest.approx(1.03, abs=0.01)
    one.observe(1, 1.3 * 512, 512, slots=1)
    for shape, seconds in ((0, 1.0), (1, 1.3)):
        both.observe(shape, seconds * 512, 512, slots=1)
    assert [ks[p(row, tested)] for p in (untimed, one, both)] == [0, 0, 1]
    assert both._margin(1) == pytest.approx(0.05 * 16 / (16 + 512))


def test_plain_rounds_overpriced_by_the_curve_run_once_and_win():
    """A curve measured in a bad minute priced plain rounds at twice their cost and K = 1
    at 1.4x plain's curve figure (a batch-32 run on 8-bit activations: K = 1 really
    costs 2x a plain round and ran at 0.8x of plain for the whole run). Plain rounds were
    never chosen, so never timed, and the drift of K = 1's timed rounds moves plain's
    figure only as far as K = 1's. Every `reexplore`-th drafted-chain choice runs plain
    rounds while none was timed (where predicted within `reexplore_within`); once timed
    they win. Catches a policy that keeps the
    losing K for good, and one that re-runs plain rounds after they were timed."""
    true = {0: 0.048, 1: 0.096}
    policy = KPolicy(CostCurve(32, {0: 0.096, 1: 0.132, 2: 0.23, 4: 0.36}), KS)
    rows, tested = np.full(32, 50.0), np.full(32, 100.0)  # 1.5 tokens a K = 1 round
    got = []
    for _ in range(30):
        k = KS[policy(rows, tested)]
        got.append(k)
        policy.observe(k, true.get(k, 0.2) * 16, 16, slots=32)
    assert got[0] == 1 and 0 in got[:10]
    assert got[-10:].count(0) >= 8
    settled = KPolicy(CostCurve(32, {0: 0.048, 1: 0.132, 2: 0.23, 4: 0.36}), KS)
    settled.observe(0, 0.048 * 16, 16, slots=32)
    settled._choice = lambda *args: (KS.index(1), [1.0, 1.05, 0.5, 0.4])
    assert [KS[settled(rows, tested)] for _ in range(20)] == [1] * 20
    far = KPolicy(CostCurve(32, {0: 0.096, 1: 0.132, 2: 0.23, 4: 0.36}), KS)
    far._choice = lambda *args: (KS.index(1), [1.0, 1.2, 0.5, 0.4])  # 17% below: reexplored
    got = [KS[far(rows, tested)] for _ in range(20)]
    assert got.count(0) == 2 and got[:2] == [1, 1]
