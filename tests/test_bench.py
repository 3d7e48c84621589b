"""specsamp bench: the cost model's arithmetic, and one tiny end-to-end run."""

import dataclasses
import math

import pytest

from specsamp.analysis.bench import Timing, measured_prediction, run_bench
from specsamp.decoding.config import SamplingParams
from specsamp.decoding.results import Completion


def _completion(tokens, calls, accepted, draft_calls, k):
    return Completion(text="", token_ids=tuple(range(tokens)), prompt_tokens=3, stop_reason="max_tokens",
                      mode="speculative", target_calls=calls, draft_calls=draft_calls,
                      accepted_per_loop=tuple(accepted), prefill_s=0.0, decode_s=1.0, k=k)


def test_measured_prediction_counts_plain_steps_and_real_draft_calls():
    t = Timing()
    # 4 scored rounds (3 + 1 + 0 + 2 accepted, one token each on top) and 2 plain steps.
    t.add([_completion(tokens=12, calls=6, accepted=[3, 1, 0, 2], draft_calls=7, k=3)])
    # tested: the 6 accepted plus one rejection in each of the 3 loops that kept fewer than K
    assert (t.loops, t.calls, t.draft_calls, t.accepted, t.tested) == (4, 6, 7, 6, 9)
    cost = 4 * 1.25 + 2 * 1 + 7 * 0.05  # in target steps
    assert measured_prediction(t, 0.05, 1.25) == pytest.approx(12 / cost)
    # With every round scored and K draft calls each, it is tokens/loop over the paper's cost.
    u = Timing()
    u.add([_completion(tokens=10, calls=4, accepted=[3, 1, 0, 2], draft_calls=12, k=3)])
    assert measured_prediction(u, 0.1, 1.0) == pytest.approx(2.5 / (3 * 0.1 + 1))
    assert math.isnan(measured_prediction(Timing(), 0.1, 1.0))


def test_loops_without_their_own_k_count_at_the_setting_k():
    """A Completion made without drafted_per_loop writes k for each loop (the table column
    stays one entry per loop); with it, each loop counts at its own K."""
    c = _completion(tokens=9, calls=4, accepted=[3, 1, 0, 2], draft_calls=12, k=3)
    assert c.stats()["drafted_per_loop"] == [3, 3, 3, 3] and c.acceptance_rate == 6 / 12
    mixed = dataclasses.replace(c, drafted_per_loop=(3, 1, 1, 2))
    assert mixed.stats()["drafted_per_loop"] == [3, 1, 1, 2] and mixed.acceptance_rate == 6 / 7


def test_run_bench_on_a_tiny_model(tmp_path):
    from specsamp.decoding.generator import GeneratorSpec, load_generator
    from specsamp.testing import make_tiny_checkpoint

    target = make_tiny_checkpoint(str(tmp_path / "t"), n_layers=2)

    def make(draft, k, sp):
        return load_generator(GeneratorSpec(target=target, draft=draft, k=k, sampling=sp,
                                            max_new_tokens=12))

    rows = run_bench(make, ["the quick brown fox", "one two one two one"], "ngram", [2],
                     [SamplingParams(0.0)], repeats=1)
    (row,) = rows
    assert row["drafter"] == "ngram" and row["k"] == 2 and row["tokens"] > 0
    assert 1.0 <= row["tokens_per_call"] <= 3.0 and row["cost_ratio"] == 0.0
    assert row["score_cost_ratio"] > 0 and row["speedup"] > 0
    assert math.isfinite(row["predicted_speedup_scoring"])


def test_traffic_fields_and_step_bytes():
    """Catches wrong GB/s arithmetic or a step that counts an untied embedding table (a
    step reads one row of it) or misses the tied head (a step reads all of it)."""
    import jax
    import jax.numpy as jnp

    from specsamp.analysis.bench import add_traffic, traffic_line
    from specsamp.models import Model, ModelConfig
    from specsamp.models.llama import init_params

    rows = [{"ar_ms_per_token": 10.0}]
    add_traffic(rows, "stored", 100_000_000, 20.0)
    assert rows[0]["weights"] == "stored" and rows[0]["bytes_per_step"] == 100_000_000
    assert math.isclose(rows[0]["gb_per_s"], 10.0) and rows[0]["stream_gb_per_s"] == 20.0
    assert "10.0 GB/s" in traffic_line(rows)
    for tied in (True, False):
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=16, d_ff=48, tie_embeddings=tied)
        params = init_params(cfg)
        total = sum(a.size * 4 for a in jax.tree.leaves(params))
        embed = 64 * 32 * 4
        assert Model(cfg).step_bytes(params) == (total if tied else total - embed)
        assert params["embed"]["embedding"].dtype == jnp.float32


def test_step_flops_count_every_weight_once_in_any_format():
    """2 FLOPs per weight of every matrix a step reads, whether stored as float32 or in
    blocks (an int8 matrix stands for as many weights as its float source); the untied
    embedding is read a row at a time, so it is no product."""
    import jax

    from specsamp.models import Model, ModelConfig
    from specsamp.models.llama import init_params
    from specsamp.quant.blocks import int8_kernel

    for tied in (True, False):
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                          head_dim=16, d_ff=48, tie_embeddings=tied)
        params = init_params(cfg)
        weights = sum(a.size for a in jax.tree.leaves(params))
        expected = 2 * (weights if tied else weights - 64 * 32)
        assert Model(cfg).step_flops(params) == expected
        mlp = params["layers"]["mlp"]
        stored = {**params, "layers": {**params["layers"], "mlp": {
            **mlp, "up": {"kernel": int8_kernel(mlp["up"]["kernel"], "xla")}}}}
        assert Model(cfg).step_flops(stored) == expected


def test_roofline_is_the_slower_of_bytes_and_flops():
    from specsamp.analysis.throughput import Machine, roofline_tokens_per_s

    machine = Machine(gb_per_s=10.0, gflop_per_s=100.0)
    # 1 GB per step reads in 0.1 s; 1 GFLOP per row takes 0.01 s: memory-bound up to 10 rows
    assert math.isclose(roofline_tokens_per_s(1, 10**9, 10**9, machine), 10.0)
    assert math.isclose(roofline_tokens_per_s(10, 10**9, 10**9, machine), 100.0)
    assert math.isclose(roofline_tokens_per_s(40, 10**9, 10**9, machine), 100.0)
