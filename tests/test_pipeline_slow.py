"""The pipeline on the real embedded model (SmolLM2-135M) with 2 worker processes."""

import os

import pyarrow.parquet as pq
import pytest

from specsamp.cli import main

pytestmark = pytest.mark.slow


def test_humaneval_on_embedded_model_two_processes(tmp_path, capsys):
    """A few HumanEval prompts, speculative and baseline, on the DirectRunner's process
    pool: every sample lands once, greedy speculative text equals the baseline's, and
    the tables open in pyarrow and DuckDB."""
    import duckdb

    config = tmp_path / "he.yaml"
    config.write_text("input: builtin:humaneval\nlimit: 3\nmax_new_tokens: 24\n"
                      "settings:\n  - {draft: none}\n  - {draft: ngram, k: 4}\n")
    out = tmp_path / "out"
    assert main(["run", "--config", str(config), "--output", str(out),
                 "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]) == 0
    text = capsys.readouterr().out
    assert "completions-*.parquet  6 rows" in text and "errors-*.parquet  0 rows" in text

    table = duckdb.sql(f"select id, mode, completion, generated_tokens from '{out}/completions-*.parquet' "
                       "order by id, mode").fetchall()
    assert len(table) == 6
    for baseline, speculative in zip(table[0::2], table[1::2]):
        assert (baseline[0], baseline[1], speculative[1]) == (speculative[0], "autoregressive", "speculative")
        assert baseline[2] == speculative[2] and baseline[3] > 0  # greedy: same text either way
    files = sorted(p for p in os.listdir(out) if p.startswith("completions-"))
    assert sum(pq.read_metadata(str(out / f)).num_rows for f in files) == 6
