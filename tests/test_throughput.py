"""specsamp bench --throughput on a tiny model: one row per (batch size, batching, drafter,
K), the baseline included, with figures that add up."""

import math

import pytest

from specsamp.analysis.throughput import Machine, format_throughput, roofline_tokens_per_s, run_throughput
from specsamp.decoding.config import AUTO_K, SamplingParams

MACHINE = Machine(gb_per_s=10.0, gflop_per_s=50.0)
PROMPTS = ["the quick brown fox", "one two one two one", "def add(a, b):", "for i in range",
           "the end of the story", "speculative sampling drafts"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    from specsamp.decoding.generator import GeneratorSpec, load_generator
    from specsamp.testing import make_tiny_checkpoint

    target = make_tiny_checkpoint(str(tmp_path_factory.mktemp("t") / "t"), n_layers=2)

    loaded = []

    def load(draft, k):
        loaded.append((draft, k))
        return load_generator(GeneratorSpec(target=target, draft=draft, k=k, sampling=SamplingParams(0.0),
                                            max_new_tokens=10))

    rows = run_throughput(load, PROMPTS, "ngram", [2, "auto"], [1, 4], machine=MACHINE)
    lengths = [len(c.token_ids) for c in load("none", 1).generate(PROMPTS, list(range(len(PROMPTS))))]
    # k auto is measured on the generator that `k auto` builds (a hybrid's wide rounds
    # exist only there), not on a fixed-K one
    assert ("ngram", "auto") in loaded and ("ngram", 4) not in loaded
    for r in rows:
        r["_lengths"] = lengths
    return rows


def test_one_row_per_setting_with_the_baseline(rows):
    keys = [(r["batch_size"], r["batching"], r["drafter"], r["k"]) for r in rows]
    assert keys == [(b, m, d, k) for b in (1, 4) for m in ("static", "continuous")
                    for d, k in (("none", 0), ("ngram", 2), ("ngram", "auto"))]


def test_figures_add_up(rows):
    """Rates are tokens over the measured seconds; the baseline's speed-up is 1; every
    setting generates for every prompt; auto's rounds are split over its K values."""
    for r in rows:
        assert r["prompts"] == len(PROMPTS) and 0 < r["generated_tokens"] <= 10 * len(PROMPTS)
        assert r["decode_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["decode_s"])
        assert r["tokens_per_s"] == pytest.approx(
            r["generated_tokens"] / (r["decode_s"] + r["prefill_s"]))
        assert r["prefill_tokens_per_s"] == pytest.approx(r["prompt_tokens"] / r["prefill_s"])
        assert r["speedup"] == pytest.approx(r["decode_tokens_per_s"] / r["ar_decode_tokens_per_s"])
        if r["drafter"] == "none":
            assert r["speedup"] == pytest.approx(1.0) and r["k"] == 0
        if r["k"] == "auto":
            assert set(r["k_rounds"]) <= {str(k) for k in AUTO_K.ks} and sum(r["k_rounds"].values()) > 0
        assert ("vs_static" in r) == (r["batching"] == "continuous")
        assert math.isfinite(r.get("vs_static", 1.0))
    # Greedy: every setting generates the same tokens, so the same count.
    assert len({r["generated_tokens"] for r in rows}) == 1
    assert "speed-up" in format_throughput(rows)


def test_generator_k_auto_and_continuous_give_greedy_baseline_text(tmp_path):
    """Generator with k 'auto' (continuous batching, K chosen per chunk) and with a fixed K
    in continuous batching returns the baseline's greedy completions, in prompt order."""
    from specsamp.decoding.generator import GeneratorSpec, load_generator
    from specsamp.testing import make_tiny_checkpoint

    target = make_tiny_checkpoint(str(tmp_path / "t"), n_layers=2)

    def gen(draft, k, batching="static"):
        return load_generator(GeneratorSpec(target=target, draft=draft, k=k, max_new_tokens=10,
                                            batch_size=2, batching=batching))

    seeds = list(range(len(PROMPTS)))
    base = [c.token_ids for c in gen("none", 1).generate(PROMPTS, seeds)]
    auto = gen("ngram", "auto")
    assert [c.token_ids for c in auto.generate(PROMPTS, seeds)] == base
    assert sum(auto.engine.k_rounds.values()) > 0
    cont = gen("ngram", 2, "continuous").generate(PROMPTS, seeds)
    assert [c.token_ids for c in cont] == base and all(c.k == 2 for c in cont)


def test_rounds_occupancy_and_bounds(rows):
    """A static batch runs until its longest row ends, one token per row per plain round:
    its rounds are the sum of each batch's longest completion (counted here from the
    completions themselves); continuous batching can at best keep every slot busy, so its
    bound is those rounds over ceil(tokens / B). The baseline rows carry the roofline of
    the model's own bytes and FLOPs on the given machine figures."""
    for r in rows:
        lengths, b = r["_lengths"], r["batch_size"]
        assert r["tokens_per_slot_round"] == pytest.approx(r["generated_tokens"] / (r["rounds"] * b))
        if r["drafter"] != "none":
            assert "ar_bound_tokens_per_s" not in r and "continuous_bound" not in r
            continue
        assert r["rounds"] >= -(-sum(lengths) // b)
        if r["batching"] == "static":
            static_rounds = sum(max(lengths[i:i + b]) for i in range(0, len(lengths), b))
            assert r["rounds"] == static_rounds
            assert r["continuous_bound"] == pytest.approx(static_rounds / -(-sum(lengths) // b))
        else:
            assert "continuous_bound" not in r
        assert r["ar_bound_tokens_per_s"] > 0
    one = next(r for r in rows if r["drafter"] == "none" and r["batch_size"] == 1)
    assert one["continuous_bound"] == 1.0 and one["tokens_per_slot_round"] == 1.0
    text = format_throughput(rows)
    assert "B=4: static batches kept" in text and "roofline" in text


def test_roofline_row_uses_the_models_bytes_and_flops(tmp_path):
    from specsamp.decoding.generator import GeneratorSpec, load_generator
    from specsamp.models import Model
    from specsamp.testing import make_tiny_checkpoint

    target = make_tiny_checkpoint(str(tmp_path / "t"), n_layers=2)
    gen = load_generator(GeneratorSpec(target=target, draft="none", k=1, max_new_tokens=4))
    rows = run_throughput(lambda d, k: gen, PROMPTS[:2], "none", [], [2], ["static"], machine=MACHINE)
    model = Model(gen.engine.prog.target)
    params = gen.engine.target_params
    assert rows[0]["ar_bound_tokens_per_s"] == pytest.approx(roofline_tokens_per_s(
        2, model.step_bytes(params), model.step_flops(params), MACHINE))


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """(load, calls): a tiny model's generators, and every (setting, group) the bench runs,
    in order."""
    from specsamp.analysis import throughput
    from specsamp.decoding.generator import GeneratorSpec, load_generator
    from specsamp.testing import make_tiny_checkpoint

    target = make_tiny_checkpoint(str(tmp_path / "t"), n_layers=2)
    calls = []
    feed = throughput._Setting.feed
    monkeypatch.setattr(throughput._Setting, "feed",
                        lambda self, group: (calls.append((self, tuple(group))), feed(self, group))[1])

    def load(draft, k):
        return load_generator(GeneratorSpec(target=target, draft=draft, k=k, max_new_tokens=4))

    return load, calls


def test_static_settings_run_each_batch_in_turn(recorded):
    """Static batches are interleaved: every setting runs batch i before any runs batch
    i + 1 (machine noise then falls on all settings alike); continuous runs the stream."""
    load, calls = recorded
    rows = run_throughput(load, PROMPTS, "ngram", [2], [2], ["static", "continuous"])
    static = [group for _, group in calls[:6]]
    assert static == [(0, 1), (0, 1), (2, 3), (2, 3), (4, 5), (4, 5)]
    assert len({s for s, _ in calls[:6]}) == 2
    assert [group for _, group in calls[6:]] == [tuple(range(len(PROMPTS)))] * 2
    assert [r["prompts"] for r in rows] == [len(PROMPTS)] * 4


def test_continuous_settings_take_turns_chunk_by_chunk(recorded, monkeypatch):
    """Continuous streams are interleaved too: each setting runs one chunk of its stream in
    turn (the engines keep their own slots), until one has no chunk left."""
    from specsamp.decoding import batching

    load, _ = recorded
    chunks = []  # the engine of each chunk, in order (a run collects once per chunk)
    collect = batching._Run.collect
    monkeypatch.setattr(batching._Run, "collect", lambda run: (chunks.append(run.engine), collect(run))[1])
    rows = run_throughput(load, PROMPTS, "ngram", [2], [2], ["continuous"])
    a, b = chunks[0], chunks[1]
    assert a is not b
    n = min(chunks.count(a), chunks.count(b))
    assert n >= 3  # several refills per stream (6 prompts, 2 slots)
    assert chunks[:2 * n] == [a, b] * n
    # each stream ran whole, its own: greedy, both settings counted every prompt's tokens
    alone = load("none", 1).generate(PROMPTS, list(range(len(PROMPTS))))
    assert [r["generated_tokens"] for r in rows] == [sum(len(c.token_ids) for c in alone)] * 2


def test_static_auto_computes_whole_static_batches(recorded):
    """With K auto a static setting runs static batches, as the static baseline does: it
    must not move a batch's last rows into fewer slots (a static batch computes all its
    slots until its longest row ends), or it gains what batching, not speculation, gives.
    The batches here have 4 and 2 prompts (a compacting run moves the last rows of 4 slots
    into 2 and 1); continuous settings still compact."""
    load, calls = recorded
    run_throughput(load, PROMPTS, "ngram", ["auto"], [4], ["static", "continuous"])
    static = {s for s, group in calls if len(group) <= 4 and s.engine.k.auto}
    assert len(static) == 1 and set(static.pop().engine.slot_rounds) == {4, 2}
    streams = [s for s, group in calls if len(group) == len(PROMPTS)]
    assert streams and all(s.batching.compact for s in streams)
    assert any(set(s.engine.slot_rounds) - {4} for s in streams)


def test_repeats_alternate_the_order_of_settings(recorded):
    """Odd runs take the settings in reverse order (static: within each batch; continuous:
    which stream runs the first chunk of each turn), so that a drift of the machine's speed
    falls on all settings alike."""
    load, calls = recorded
    run_throughput(load, PROMPTS[:4], "ngram", [2], [2], ["static", "continuous"], repeats=2)
    static, stream = calls[:8], calls[8:]
    first = static[0][0]
    # run 1: batch (0, 1) then (2, 3), baseline first; run 2: the other setting first
    assert [g for _, g in static] == [(0, 1), (0, 1), (2, 3), (2, 3)] * 2
    assert [s is first for s, _ in static] == [True, False, True, False, False, True, False, True]
    assert [g for _, g in stream] == [(0, 1, 2, 3)] * 4
    assert stream[0][0] is stream[3][0] and stream[1][0] is stream[2][0] and stream[0][0] is not stream[1][0]


def test_repeats_pool_the_runs_and_list_each_runs_speedup(recorded):
    """repeats=2: every prompt runs twice per setting (counts double), rates pool both runs,
    and `speedups` holds each run's own ratio, paired within the run."""
    load, _ = recorded
    once = run_throughput(load, PROMPTS[:4], "ngram", [2], [2], ["static", "continuous"])
    twice = run_throughput(load, PROMPTS[:4], "ngram", [2], [2], ["static", "continuous"], repeats=2)
    assert [r["repeats"] for r in twice] == [2] * 4 and "speedups" not in once[0]
    for a, b in zip(once, twice):
        assert b["prompts"] == 2 * a["prompts"] and b["generated_tokens"] == 2 * a["generated_tokens"]
        assert b["decode_tokens_per_s"] == pytest.approx(b["generated_tokens"] / b["decode_s"])
        assert len(b["speedups"]) == 2 and all(math.isfinite(x) and x > 0 for x in b["speedups"])
        if b["drafter"] == "none":
            assert b["speedups"] == [1.0, 1.0]
        else:  # the pooled ratio lies between the runs' own
            assert min(b["speedups"]) - 1e-9 <= b["speedup"] <= max(b["speedups"]) + 1e-9
    assert "runs " in format_throughput(twice)
