"""Fault injection: runs killed, interrupted, fed corrupt input or a full disk, then resumed.

Every test counts rows the same way: input rows x settings = completion rows + error rows,
with no (id, setting) twice in the files as written (no read-side deduplication).
"""

import os
import random
import signal
import subprocess
import sys
import time

import apache_beam as beam
import pyarrow.parquet as pq
import pytest

from pipelines import commit
from schemas import COMPLETIONS, SCHEMA_VERSION
from specsamp.cli import main
from tests.pipeline_support import files, tiny_models, write_config, write_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = [{"draft": "none"}, {"draft": "ngram", "k": 2}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(str(tmp_path_factory.mktemp("fault-models")))


def make_run(root, models, **changes):
    """A config over the three mixed prompt files; returns (config path, {id: kind})."""
    expected = write_prompts(str(root / "prompts"))
    config = write_config(str(root / "run.yaml"), models[0], models[1],
                          **{"settings": SETTINGS, "batch_size": 1, **changes})
    return config, expected


def keys(out) -> tuple[list, list]:
    """(completion keys, error keys) as written, duplicates kept."""
    got = []
    for table in ("completions", "errors"):
        rows = [r for f in files(str(out), table) for r in pq.read_table(f, columns=["id", "draft", "k"]).to_pylist()]
        got.append([(r["id"], r["draft"], r["k"]) for r in rows])
    return got[0], got[1]


def assert_exactly_once(out, ids, settings=SETTINGS):
    done, failed = keys(out)
    want = {(i, s["draft"], s.get("k", 0)) for i in ids for s in settings}
    assert len(done) == len(set(done)) and len(failed) == len(set(failed)), "a row was written twice"
    assert not set(done) & set(failed), "a sample is both a completion and an error"
    assert set(done) | set(failed) == want and len(done) + len(failed) == len(want)
    assert not [n for n in os.listdir(out) if commit.TEMP_MARK in n], "a temporary file was left"
    return done, failed


def cli(config, *extra) -> subprocess.Popen:
    """`specsamp run` in its own session, so that the whole process tree can be killed."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "specsamp.cli", "run", "--config", config, *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_rows(proc, out, more_than: int, timeout: float = 300) -> bool:
    """Wait until more than `more_than` rows are committed; False if the run ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(out) and sum(map(len, keys(out))) > more_than:
            return True
        time.sleep(0.05)
    return False


def test_sigkill_at_random_moments_then_resume(models, tmp_path):
    """The whole process tree is SIGKILLed at random moments after it has committed new
    rows (three rounds, a machine dying mid-batch), then a last run completes. Catches lost
    rows, rows written twice by a redone batch, half-written shards and leftover temps."""
    config, expected = make_run(tmp_path, models)
    out = str(tmp_path / "out")
    rng = random.Random(9)
    counts = []
    for _ in range(3):
        before = sum(map(len, keys(out))) if os.path.isdir(out) else 0
        proc = cli(config, "--direct_num_workers", "2", "--direct_running_mode", "multi_processing")
        if wait_for_rows(proc, out, before):
            time.sleep(rng.uniform(0, 0.6))
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        counts.append(sum(map(len, keys(out))))
        for path in files(out, "completions") + files(out, "errors"):
            pq.read_table(path)  # every committed shard is whole
    assert counts[0] < len(expected) * len(SETTINGS), "the first kill came after the end: nothing tested"
    assert main(["run", "--config", config]) == 0  # the same command, here (no interpreter to start)
    assert_exactly_once(out, expected)


@pytest.mark.parametrize("signum, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_signal_stops_with_one_line_and_keeps_rows(models, tmp_path, signum, code, word):
    """SIGTERM / SIGINT (Ctrl-C reaches the whole process group) end the run with one line
    that says how to resume and exit 143 / 130; committed rows stay; the re-run finishes
    without duplicates. Catches Beam's wrapped tracebacks and work lost on a stop."""
    config, expected = make_run(tmp_path, models)
    out = str(tmp_path / "out")
    proc = cli(config, "--direct_num_workers", "2", "--direct_running_mode", "multi_processing")
    assert wait_for_rows(proc, out, 0)
    os.killpg(proc.pid, signum) if signum == signal.SIGINT else proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert word in last and "run the same command again to resume" in last
    kept = sum(map(len, keys(out)))
    assert kept > 0
    assert not [n for n in os.listdir(out) if commit.TEMP_MARK in n]
    assert main(["run", "--config", config]) == 0  # the same command, here
    assert_exactly_once(out, expected)


_WRITER_LAUNCHER = """
import multiprocessing, os, sys, time
from apache_beam.options.pipeline_options import PipelineOptions
from pipelines import commit, runners, stop

def write_forever(folder):
    data = os.urandom(1 << 20)
    while True:
        commit._put(os.path.join(folder, "completions-x.parquet"), data)

if __name__ == "__main__":
    folder = sys.argv[1]
    multiprocessing.set_start_method("spawn")
    target = runners.LocalTarget(PipelineOptions([]))
    with stop.stops_cleanly(lambda signum: target.stopped(signum, folder)):
        writers = [multiprocessing.Process(target=write_forever, args=(folder,)) for _ in range(2)]
        for w in writers:
            w.start()
        while not os.path.exists(os.path.join(folder, "completions-x.parquet")):
            time.sleep(0.05)
        print("writing", flush=True)
        time.sleep(600)
"""


def test_stop_removes_what_killed_writers_left_half_written(tmp_path):
    """A local run's stop kills its writers mid-write and sweeps the temporary files they
    left, once they have exited (SIGKILL lands asynchronously and a write in flight finishes
    first): none is left. Catches a stop that leaves them (seen in a Dask Ctrl-C test)."""
    folder = tmp_path / "out"
    folder.mkdir()
    script = tmp_path / "launcher.py"
    script.write_text(_WRITER_LAUNCHER)
    env = dict(os.environ, PYTHONPATH=ROOT)
    for attempt in range(3):  # a kill that misses every write is unlikely three times
        proc = subprocess.Popen([sys.executable, str(script), str(folder)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        time.sleep(0.5 + 0.3 * attempt)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "interrupted (SIGINT)" in err and "Traceback" not in err
        assert not [n for n in os.listdir(folder) if commit.TEMP_MARK in n]


class _FailOnce(commit.CommitBatch):
    """Fails once, after its first batch is committed: a worker dying mid-bundle."""

    def __init__(self, flag, *args):
        super().__init__(*args)
        self._flag = flag

    def process(self, result):
        yield from super().process(result)
        if not os.path.exists(self._flag):
            open(self._flag, "w").close()
            raise RuntimeError("injected failure mid-bundle")


def test_retried_bundle_rewrites_the_same_shards(tmp_path):
    """Beam's bundle-based DirectRunner retries a failed bundle; the retry re-commits the
    batches the failed attempt had committed. Shard names come from the rows' keys, so the
    retry replaces those shards: each row once. Catches shard names made per attempt."""
    from apache_beam.ml.inference.base import PredictionResult
    from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner

    rows = [_row(f"p{i}") for i in range(7)]
    batches = [PredictionResult(None, (rows[i:i + 2], [])) for i in range(0, len(rows), 2)]
    out = tmp_path / "out"
    out.mkdir()
    with beam.Pipeline(runner=BundleBasedDirectRunner()) as p:
        _ = (p | beam.Create(batches, reshuffle=False)
             | beam.ParDo(_FailOnce(str(tmp_path / "failed"), str(out))))
    assert os.path.exists(tmp_path / "failed")
    done, _ = keys(out)
    assert sorted(done) == sorted((r["id"], "none", 0) for r in rows)


def _row(pid: str) -> dict:
    row = {f.name: None for f in COMPLETIONS}
    row.update(id=pid, prompt="p", completion="c", completion_token_ids=[1], prompt_tokens=1,
               generated_tokens=1, stop_reason="eos", dataset="d", mode="autoregressive", target="t",
               draft="none", k=0, tree="off", temperature=0.0, top_k=0, top_p=1.0, seed=1, run_id="r",
               config_hash="0123456789abcdef", worker_host="h", device_kind="cpu",
               schema_version=SCHEMA_VERSION,
               target_calls=1, draft_calls=0, accepted_per_loop=[], drafted_per_loop=[], acceptance_rate=float("nan"),
               tokens_per_call=1.0, prefill_s=0.1, decode_s=0.1, total_s=0.2, ms_per_token=100.0,
               compile_s=0.0)
    return row


def test_corrupt_shard_among_good_ones(models, tmp_path, capsys):
    """One input file is garbage: its rows become unreadable_file errors naming the file,
    the other files' rows are generated, and the run ends normally."""
    config, expected = make_run(tmp_path, models)
    bad = tmp_path / "prompts" / "mixed-3.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file PAR1")
    assert main(["run", "--config", config]) == 0
    captured = capsys.readouterr()
    assert f"cannot read {bad}" in captured.err and "unreadable_file" in captured.out
    out = str(tmp_path / "out")
    placeholder = f"<unreadable {bad}>"
    _, failed = assert_exactly_once(out, [*expected, placeholder])
    errors = [r for f in files(out, "errors") for r in pq.read_table(f).to_pylist()]
    unreadable = [r for r in errors if r["error_kind"] == "unreadable_file"]
    assert {r["id"] for r in unreadable} == {placeholder} and str(bad) in unreadable[0]["error"]


def test_unreadable_rows_after_the_plan_become_error_rows(tmp_path, monkeypatch):
    """A file whose data cannot be read on the worker (the plan read its ids): one
    unreadable_file row per id, naming the file."""
    import pyarrow as pa

    from pipelines import read

    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["x", "y"]}), path)
    real = read._read
    monkeypatch.setattr(read, "_read", lambda p, columns=None: real(p, columns) if columns else 1 / 0)
    got = list(read.read_prompt_file(path))
    assert [(r.row["id"], r.problem[0]) for r in got] == [("a", "unreadable_file"), ("b", "unreadable_file")]
    assert path in got[0].problem[1] and "ZeroDivisionError" in got[0].problem[1]


@pytest.fixture
def small_disk(tmp_path):
    """A 96 KiB tmpfs (root only); skipped where mounting is not allowed."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_stops_with_one_line_then_resumes(models, tmp_path, small_disk, capsys):
    """The output fills up mid-run: one line (no traceback), exit 2, every committed shard
    whole and no temporary file; with space again, the re-run completes exactly once."""
    config, expected = make_run(tmp_path, models, output=str(small_disk / "out"))
    assert main(["run", "--config", config]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "run the same command again to resume" in err
    assert "Traceback" not in err
    out = str(small_disk / "out")
    done, failed = keys(out)
    assert 0 < len(done) + len(failed) < len(expected) * len(SETTINGS)
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    assert main(["run", "--config", config]) == 0
    assert_exactly_once(out, expected)


def test_retry_errors_supersedes_the_old_error_rows(models, tmp_path, capsys):
    """A first run whose engine fails on one prompt (generation_failed), then
    --retry-errors generation_failed with a working engine: the prompt is generated, its
    old error row no longer counts (summary, report views, resume scan), the other error
    kinds are not retried; a later --retry-errors (all kinds) leaves one error per key."""
    from pipelines.generate import run
    from specsamp.analysis import outputs
    from tests.pipeline_support import FAILING_LOADER

    config, expected = make_run(tmp_path, models)
    out = str(tmp_path / "out")
    first = run(["--config", config], loader=FAILING_LOADER)
    assert first.error_kinds["generation_failed"] == len(SETTINGS)
    second = run(["--config", config, "--retry-errors", "generation_failed"])
    assert f"{len(SETTINGS)} error rows retried" in capsys.readouterr().err
    bad = {i for i, kind in expected.items() if kind is not None and kind != "generation_failed"}
    assert second.errors == len(bad) * len(SETTINGS)
    assert second.completions == first.completions + len(SETTINGS)
    done, failed = keys(out)
    assert {("boom", s["draft"], s.get("k", 0)) for s in SETTINGS} <= set(done) & set(failed)
    assert "nothing to do" in (run(["--config", config]) and capsys.readouterr().err)
    run(["--config", config, "--retry-errors"])
    con = outputs.connect(outputs.resolve([out]))
    assert con.execute("select count(*), count(distinct (id, draft, k)) from errors").fetchall() == [
        (len(bad) * len(SETTINGS),) * 2]
    assert con.execute("select count(*) from completions").fetchall() == [(second.completions,)]
