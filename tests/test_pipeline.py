"""The Beam pipeline on a tiny random model (real engine, real Beam, FnApiRunner).

One module-scoped run over good and bad prompts with three settings (baseline, a draft
model, n-gram) is checked from several sides; the compiled programs are shared by all
tests of the module through the handler's per-process generator cache.
"""

import json
import math
import os

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from pipelines import rows
from pipelines.generate import build, run
from pipelines.handler import GeneratorHandler, generator_spec
from pipelines.plan import make_plan
from schemas import COMPLETIONS, ERRORS, SCHEMA_VERSION, check_file
from specsamp import runconfig
from tests.pipeline_support import FAILING_LOADER, STALE_LOADER, STALE_TEMP_IN, files, make_setup, read


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    config, expected, target, draft = make_setup(root)
    summary = run(["--config", config], loader=FAILING_LOADER)
    cfg = runconfig.load(config)
    return {"root": root, "cfg": cfg, "config": config, "expected": expected, "summary": summary,
            "out": cfg.output, "target": target, "draft": draft}


def test_every_row_ends_in_exactly_one_table(env):
    """Catches lost, duplicated or doubly-routed rows: N prompts x S settings in, N*S out."""
    cfg, expected = env["cfg"], env["expected"]
    done = read(env["out"], "completions").to_pylist()
    failed = read(env["out"], "errors").to_pylist()
    keys = [(r["id"], r["draft"], r["k"]) for r in done + failed]
    assert len(keys) == len(set(keys)) == len(expected) * len(cfg.settings)
    assert set(keys) == {(i, s.draft, s.k) for i in expected for s in cfg.settings}
    assert {r["id"] for r in done} == {i for i, kind in expected.items() if kind is None}
    assert env["summary"].completions == len(done) and env["summary"].errors == len(failed)


def test_errors_carry_the_reason(env):
    """Each bad row lands in the error table with its own kind; a failing prompt in a
    batch of two does not take its batch-mate down (per-element handling)."""
    failed = read(env["out"], "errors").to_pylist()
    assert {(r["id"], r["error_kind"]) for r in failed} == {
        (i, kind) for i, kind in env["expected"].items() if kind is not None}
    done_ids = {r["id"] for r in read(env["out"], "completions").to_pylist()}
    assert "good/0" in done_ids  # was batched with "boom"
    boom = [r for r in failed if r["id"] == "boom"]
    assert all("injected engine failure" in r["error"] for r in boom)
    bad = {r["id"]: r["error"] for r in failed if r["error_kind"] == "bad_utf8"}
    assert "mixed-2.parquet row 1" in bad["str/bad"] and "mixed-1.parquet row 1" in bad["bin/bad"]
    long = next(r for r in failed if r["id"] == "long")
    assert "tokens" in long["error"] and long["prompt"] == "zq" * 150


def test_handler_isolates_a_failing_prompt_in_its_batch(env):
    """One generate call for the batch fails; the handler retries prompt by prompt, so only
    the failing prompt becomes an error row and the rest keep their order."""
    cfg = env["cfg"]
    handler = GeneratorHandler(cfg, rows.RunInfo.of(cfg, "unit", "unit"), loader=FAILING_LOADER)
    model = handler.load_model()
    s = cfg.settings[1]
    batch = [rows.Example(f"x{i}", p, s.draft, s.k, i, "unit", None)
             for i, p in enumerate(["hello", "a BOOM here", "zq" * 150, "world"])]
    out = handler.infer(batch, model)
    assert [row["id"] for _, row in out] == ["x0", "x1", "x2", "x3"]
    assert [tag if tag == "completion" else row["error_kind"]
            for tag, row in out] == ["completion", "generation_failed", "too_long", "completion"]
    [result] = handler.run_inference(rows.Work(tuple(batch), ()), model)
    completions, errors = result.inference
    assert [r["id"] for r in completions] == ["x0", "x3"] and [r["id"] for r in errors] == ["x1", "x2"]


def test_tables_follow_the_schemas(env):
    for path in files(env["out"], "completions"):
        check_file(path, COMPLETIONS)
    for path in files(env["out"], "errors"):
        check_file(path, ERRORS)
    table = read(env["out"], "completions")
    assert table.schema.field("completion_token_ids").type.value_type.bit_width == 32
    assert table.schema.metadata[b"specsamp.schema_version"] == str(SCHEMA_VERSION).encode()


def test_statistics_are_consistent(env):
    """A round yields its accepted draft tokens plus one from the target (a round without a
    draft, e.g. no n-gram match, yields one), so generated = sum(accepted) + target calls,
    less what an EOS or max_new_tokens cut from the last round (at most K tokens)."""
    cfg = env["cfg"]
    for r in read(env["out"], "completions").to_pylist():
        acc, n, calls, k = r["accepted_per_loop"], r["generated_tokens"], r["target_calls"], r["k"]
        assert n == len(r["completion_token_ids"]) and 1 <= n <= cfg.max_new_tokens
        assert math.isclose(r["total_s"], r["prefill_s"] + r["decode_s"])
        assert math.isclose(r["ms_per_token"], 1000 * r["decode_s"] / n)
        assert math.isclose(r["tokens_per_call"], n / calls)
        assert r["seed"] == rows.sample_seed(cfg.seed, r["id"])
        assert r["config_hash"] == cfg.config_hash() and r["target"] == env["target"]
        if r["mode"] == "autoregressive":
            assert (k, r["draft"], acc, r["draft_calls"]) == (0, "none", [], 0)
            assert calls == n and math.isnan(r["acceptance_rate"])
            continue
        assert all(0 <= a <= k for a in acc) and sum(acc) + calls - k <= n <= sum(acc) + calls
        if r["draft"] == "ngram":  # rounds without a match are plain steps
            assert len(acc) <= calls and r["draft_calls"] == 0
        else:
            assert len(acc) == calls and r["draft_calls"] == k * calls
        rate = sum(acc) / (k * len(acc)) if acc else math.nan
        assert math.isclose(r["acceptance_rate"], rate) or math.isnan(rate) and math.isnan(r["acceptance_rate"])


def test_rows_carry_the_run_and_the_extra_columns(env):
    done = read(env["out"], "completions").to_pylist()
    assert len({r["run_id"] for r in done}) == 1
    row = next(r for r in done if r["id"] == "good/2")
    assert json.loads(row["extra"]) == {"level": 4} and row["dataset"] == "mixed"
    assert next(r for r in done if r["id"] == "bin/ok")["prompt"] == "bytes are fine"


def test_greedy_completions_equal_the_generator(env):
    """The pipeline (batches of 2, three settings in one job) must produce exactly what
    the library produces for each prompt on its own with the same seed."""
    from specsamp import load_generator

    cfg = env["cfg"]
    done = read(env["out"], "completions").to_pylist()
    for s in cfg.settings:
        gen = load_generator(generator_spec(cfg, s))
        mine = sorted((r for r in done if r["k"] == s.k and r["draft"] == s.draft), key=lambda r: r["id"])
        for r in mine:
            [c] = gen.generate([r["prompt"]], [r["seed"]])
            assert (r["completion"], r["completion_token_ids"]) == (c.text, list(c.token_ids)), (s, r["id"])


def test_output_is_readable_by_duckdb(env):
    import duckdb

    out = env["out"]
    [(n, modes)] = duckdb.sql(f"select count(*), count(distinct mode) from '{out}/completions-*.parquet'").fetchall()
    assert (n, modes) == (env["summary"].completions, 2)
    kinds = duckdb.sql(f"select error_kind, count(*) from '{out}/errors-*.parquet' group by 1").fetchall()
    assert sum(c for _, c in kinds) == env["summary"].errors


def test_rerun_resumes_without_duplicates(env, capsys):
    """Same config and output: nothing to redo, no new file."""
    before = files(env["out"], "completions") + files(env["out"], "errors")
    summary = run(["--config", env["config"]], loader=FAILING_LOADER)
    assert "nothing to do" in capsys.readouterr().err
    assert files(env["out"], "completions") + files(env["out"], "errors") == before
    assert summary.completions == env["summary"].completions


def test_a_temporary_file_left_during_the_run_is_removed_at_its_end(env, tmp_path, monkeypatch):
    """A writer killed mid-write while the job goes on (the runner redoes its work) leaves
    its temporary file: the run removes it once the job has ended, as it does at its start
    and at a stop. Catches a sweep only then (a Dask run whose workers were killed
    mid-run ended with one)."""
    from pipelines.commit import TEMP_MARK

    monkeypatch.setenv(STALE_TEMP_IN, str(tmp_path))
    run(["--config", env["config"], "--output", str(tmp_path), "--limit", "2",
         "--input", str(env["root"] / "prompts" / "mixed-0.parquet")], loader=STALE_LOADER)
    assert read(str(tmp_path), "completions") is not None
    assert not [n for n in os.listdir(tmp_path) if TEMP_MARK in n]


def test_raised_limit_adds_only_the_new_prompts(env, tmp_path):
    """A run with limit 3, then limit 5, into one folder: 5 prompts x 3 settings, each once."""
    args = ["--config", env["config"], "--output", str(tmp_path), "--input", str(env["root"] / "prompts" / "mixed-0.parquet")]

    def keys():
        both = read(str(tmp_path), "completions").to_pylist() + read(str(tmp_path), "errors").to_pylist()
        return [(r["id"], r["draft"], r["k"], r["run_id"]) for r in both]

    run(args + ["--limit", "3"], loader=FAILING_LOADER)
    first = keys()
    run(args + ["--limit", "5"], loader=FAILING_LOADER)
    second = keys()
    assert len(first) == len({k[:3] for k in first}) == 9
    assert len(second) == len({k[:3] for k in second}) == 15
    assert set(first) < set(second) and len({k[3] for k in second}) == 2


def test_graph_counts_and_counters(env):
    """The job graph on a TestPipeline with assert_that, and the Beam counters."""
    cfg = env["cfg"].with_overrides(output=str(env["root"] / "graph-out"))
    plan = make_plan(cfg)
    good = [i for i, kind in env["expected"].items() if kind is None]
    bad = [(i, kind) for i, kind in env["expected"].items() if kind is not None]
    p = BeamTestPipeline(runner="FnApiRunner")
    reports = build(p, plan, loader=FAILING_LOADER, parallelism=2)
    assert_that(reports | beam.FlatMap(lambda r: [(i, k) for i, _, k, _ in r["completions"]]),
                equal_to([(i, s.k) for i in good for s in cfg.settings]), label="CheckCompletions")
    assert_that(reports | beam.FlatMap(lambda r: [(i, kind) for i, _, _, _, kind in r["errors"]]),
                equal_to([b for b in bad for _ in cfg.settings]), label="CheckErrors")
    result = p.run()
    counters = {}
    for c in result.metrics().query(MetricsFilter().with_namespace("specsamp"))["counters"]:
        counters[c.key.metric.name] = counters.get(c.key.metric.name, 0) + c.committed
    s = len(cfg.settings)
    assert counters["prompts"] == len(env["expected"])
    assert counters["samples"] == len(env["expected"]) * s
    assert counters["errors"] == len(bad) * s and counters["completions"] == len(good) * s
    assert counters["generated_tokens"] > 0 and 0 <= counters["accepted_tokens"] <= counters["drafted_tokens"]


def test_cli_prints_tables_and_summary(env, tmp_path, capsys):
    from specsamp.cli import main

    out = tmp_path / "cli"
    assert main(["run", "--config", env["config"], "--output", str(out), "--limit", "2",
                 "--input", str(env["root"] / "prompts" / "mixed-0.parquet")]) == 0
    text = capsys.readouterr().out
    assert f"{out}/completions-*.parquet  6 rows" in text and "errors-*.parquet  0 rows" in text
    assert "autoregressive" in text and "speculative" in text and "ms/token" in text


def test_two_processes_sharing_one_model_give_the_same_tables(env, tmp_path):
    """DirectRunner with 2 worker processes and the model shared across them (Beam's
    proxy, as on TPU hosts): the same rows as the in-process run, text for text."""
    import yaml

    with open(env["config"]) as f:
        cfg = yaml.safe_load(f)
    cfg.update(output=str(tmp_path / "out"), workers={"share_model_across_processes": True, "model_copies": 1})
    config = tmp_path / "shared.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run(["--config", str(config), "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"],
        loader=FAILING_LOADER)

    def table(out, name, cols):
        return sorted(tuple(r[c] for c in cols) for r in read(out, name).to_pylist()
                      # n-gram rounds are drafted batch-wide, so its per-row counts depend on
                      # the batch-mates; text and token ids must not.
                      if not (r["draft"] == "ngram" and "accepted_per_loop" in cols))

    cols = ["id", "draft", "k", "completion", "completion_token_ids"]
    assert table(str(tmp_path / "out"), "completions", cols) == table(env["out"], "completions", cols)
    cols += ["accepted_per_loop"]
    assert table(str(tmp_path / "out"), "completions", cols) == table(env["out"], "completions", cols)
    cols = ["id", "draft", "k", "error_kind"]
    assert table(str(tmp_path / "out"), "errors", cols) == table(env["out"], "errors", cols)


def test_dry_run_runs_nothing_and_false_means_false(env, tmp_path, capsys):
    """--dry_run true on a local runner builds the graph and writes no row; --dry_run
    false (a string to Beam) is a real run."""
    from specsamp.cli import main

    args = ["run", "--config", env["config"], "--output", str(tmp_path / "o"), "--limit", "1",
            "--input", str(env["root"] / "prompts" / "mixed-0.parquet")]
    assert main(args + ["--dry_run", "true"]) == 0
    assert "dry run" in capsys.readouterr().err
    assert not files(str(tmp_path / "o"), "completions")
    assert main(args + ["--dry_run", "false"]) == 0
    assert len(read(str(tmp_path / "o"), "completions")) == len(env["cfg"].settings)


def test_one_input_file_is_spread_over_two_workers(env, tmp_path, monkeypatch):
    """The README's --direct_num_workers 2 --direct_running_mode multi_processing on a
    single prompt file: both worker processes generate (catches a job whose one file
    pins all the work to one worker)."""
    from tests.pipeline_support import PID_LOADER, PID_LOG

    log = tmp_path / "pids"
    log.mkdir()
    monkeypatch.setenv(PID_LOG, str(log))
    run(["--config", env["config"], "--output", str(tmp_path / "o"),
         "--input", str(env["root"] / "prompts" / "mixed-0.parquet"),
         "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"], loader=PID_LOADER)
    assert len(os.listdir(log)) == 2


def test_tree_setting_beside_the_chain_of_its_drafter(env, tmp_path, capsys):
    """A token tree (2x1: 4 nodes, depth 2) and the chain at K = 2 of the same draft model
    in one run: every (id, setting) once, told apart by the tree column; each tree round
    scored 4 nodes and each chain round 2 tokens; greedy rows of both equal the baseline's
    tokens; running the same command again adds nothing."""
    from tests.pipeline_support import ROWS, write_config

    config = write_config(str(tmp_path / "tree.yaml"), env["target"], env["draft"],
                          input=str(env["root"] / "prompts" / "mixed-0.parquet"), output=str(tmp_path / "out"),
                          settings=[{"draft": "none"}, {"draft": env["draft"], "k": 2},
                                    {"draft": env["draft"], "tree": "2x1"}])
    summary = run(["--config", config])
    out = str(tmp_path / "out")
    done, failed = read(out, "completions").to_pylist(), read(out, "errors").to_pylist()
    expected = [i for i, _, _ in ROWS]
    want = {(i, d, k, t) for i in expected for d, k, t in
            (("none", 0, "off"), (env["draft"], 2, "off"), (env["draft"], 2, "2x1"))}
    keys = [(r["id"], r["draft"], r["k"], r["tree"]) for r in done + failed]
    assert len(keys) == len(set(keys)) and set(keys) == want
    assert {r["tree"] for r in failed if r["draft"] != "none"} == {"off", "2x1"}
    by = {(r["id"], r["tree"], r["mode"]): r for r in done}
    trees = [r for r in done if r["tree"] == "2x1"]
    chains = [r for r in done if r["tree"] == "off" and r["mode"] == "speculative"]
    assert trees and len(trees) == len(chains)
    for r in trees:
        assert r["drafted_per_loop"] and set(r["drafted_per_loop"]) == {4}
        assert all(0 <= a <= 2 for a in r["accepted_per_loop"])
        base = by[(r["id"], "off", "autoregressive")]
        assert r["completion_token_ids"] == base["completion_token_ids"], r["id"]
    for r in chains:
        assert set(r["drafted_per_loop"]) == {2}
        assert r["completion_token_ids"] == by[(r["id"], "off", "autoregressive")]["completion_token_ids"]
    assert " tree 2x1 " in summary.text()

    before = files(out, "completions") + files(out, "errors")
    capsys.readouterr()
    again = run(["--config", config])
    assert "nothing to do" in capsys.readouterr().err
    assert files(out, "completions") + files(out, "errors") == before
    assert (again.completions, again.errors) == (summary.completions, summary.errors)
