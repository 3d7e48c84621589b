"""The pipeline on a real cluster engine: Beam's DaskRunner on a dask.distributed
LocalCluster of 2 worker processes (tiny random models, the real engine), checked row for
row against the FnApiRunner run of the same config and resumed; then workers SIGKILLed
mid-run, Ctrl-C, and a lost scheduler (an external `dask scheduler`) with the same command
resuming.

Every check counts rows as written (no read-side deduplication): input rows x settings =
completion rows + error rows, each (id, setting) once.
"""

import os
import random
import signal
import socket
import subprocess
import sys
import time
import types

import pyarrow.parquet as pq
import pytest

from pipelines import commit, dask_cluster
from pipelines.generate import run
from pipelines.plan import make_plan
from pipelines.runners import pipeline_options
from pipelines.stop import spawned_processes
from specsamp import runconfig
from tests.pipeline_support import FAILING_LOADER, FAILING_PID_LOADER, PID_LOG, files, make_setup, read
from tests.test_pipeline_faults import assert_exactly_once, cli, keys, wait_for_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASK = ["--runner", "DaskRunner", "--dask_workers", "2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The config, and the FnApiRunner run of it: the reference every Dask run must equal."""
    root = tmp_path_factory.mktemp("dask")
    config, expected, _, _ = make_setup(root)
    run(["--config", config, "--output", str(root / "reference")], loader=FAILING_LOADER)
    settings = [{"draft": s.draft, "k": s.k} for s in runconfig.load(config).settings]
    return {"root": root, "config": config, "expected": expected, "settings": settings,
            "reference": str(root / "reference")}


@pytest.fixture(scope="module")
def dask_runs(env):
    """On Dask: the first 4 prompts (all in one input file), then the same command without
    the limit, which resumes. Each run notes which processes generated (PID_LOG)."""
    out, logs = str(env["root"] / "dask"), [env["root"] / "pids-limit", env["root"] / "pids-rest"]
    summaries = []
    for log, limit in zip(logs, (["--limit", "4"], [])):
        log.mkdir()
        os.environ[PID_LOG] = str(log)  # the LocalCluster's worker processes inherit it
        try:
            summaries.append(run(["--config", env["config"], "--output", out, *limit, *DASK],
                                 loader=FAILING_PID_LOADER))
        finally:
            os.environ.pop(PID_LOG)
    return {"out": out, "logs": logs, "summaries": summaries}


def table(out, name, cols, ngram_counts=True):
    """Sorted rows of a table; n-gram drafts are made batch-wide, so their per-row counts
    depend on the batch-mates (text and tokens must not): left out when asked."""
    return sorted(tuple(r[c] for c in cols) for r in read(out, name).to_pylist()
                  if ngram_counts or not (r["draft"] == "ngram" and "accepted_per_loop" in cols))


TEXT = ["id", "draft", "k", "completion", "completion_token_ids"]
ERRORS = ["id", "draft", "k", "error_kind"]


def test_dask_run_equals_the_fnapi_run(env, dask_runs):
    """Rows in = completions + errors, each (id, setting) once, and the same rows as the
    FnApiRunner's, text and token ids included. Catches rows dropped at a bundle's end
    (Beam on Dask drops what finish_bundle emits), tagged outputs mixed up (Dask hands
    every consumer all of a ParDo's outputs) and rows written twice."""
    assert_exactly_once(dask_runs["out"], env["expected"], env["settings"])
    for name, cols in (("completions", TEXT), ("errors", ERRORS)):
        assert table(dask_runs["out"], name, cols) == table(env["reference"], name, cols)
    cols = TEXT + ["accepted_per_loop", "drafted_per_loop", "generated_tokens", "stop_reason"]
    assert table(dask_runs["out"], "completions", cols, False) == table(env["reference"], "completions", cols, False)


def test_one_input_file_spreads_over_both_workers(dask_runs):
    """The limited run's 4 prompts all come from one file: both worker processes generate.
    Catches a job whose one file is one task (all of it on one worker)."""
    assert len([n for n in os.listdir(dask_runs["logs"][0]) if n.isdigit()]) == 2


def test_each_worker_loads_the_models_once(env, dask_runs):
    """Beam on Dask sets a DoFn up for every partition (batch): the models must stay loaded
    in the worker process. Catches a model loaded again for each batch."""
    for log in dask_runs["logs"]:
        loads = [n for n in os.listdir(log) if n.endswith(".loads")]
        assert 1 <= len(loads) <= 2
        for name in loads:
            assert len((log / name).read_text().split()) == len(env["settings"]), name


def test_the_same_command_resumes(env, dask_runs, capsys):
    """The unlimited run added only what the limited run had not written (those rows keep
    their run id), and a third run finds nothing to do without starting a cluster (the
    command's own entry point in this process: a cluster started would say so on stderr)."""
    from specsamp.cli import main

    first, second = dask_runs["summaries"]
    n = len(env["settings"])
    assert first.this_run == 4 * n and second.this_run == (len(env["expected"]) - 4) * n
    got = read(dask_runs["out"], "completions").to_pylist() + read(dask_runs["out"], "errors").to_pylist()
    assert len({r["run_id"] for r in got}) == 2
    before = sorted(os.listdir(dask_runs["out"]))
    capsys.readouterr()
    code = main(["run", "--config", env["config"], "--output", dask_runs["out"], *DASK])
    err = capsys.readouterr().err
    assert code == 0 and "nothing to do" in err and "Dask scheduler" not in err
    assert sorted(os.listdir(dask_runs["out"])) == before


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped by whoever inherited it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _same_as_reference(env, out):
    """The default engine (the CLI cannot take a test loader): the BOOM prompt is a
    completion here and an error in the reference; every other row must be equal."""
    def rows(folder, name, cols):
        return [r for r in table(folder, name, cols, False) if r[0] != "boom"]

    for name, cols in (("completions", TEXT), ("errors", ERRORS)):
        assert rows(out, name, cols) == rows(env["reference"], name, cols)


@pytest.mark.slow
def test_workers_killed_mid_run_lose_and_repeat_nothing(env, tmp_path):
    """Worker processes SIGKILLed while the job runs: first one of the two once rows are
    committed, then every live worker once more rows are (so a worker that had committed
    batches dies: Dask reruns them, as it reruns what a dead worker was doing). The run ends
    normally with each (id, setting) once and the reference's rows. Catches shard names
    that differ on a redo, rows lost with a dead worker, a launcher that fails the job."""
    out = str(tmp_path / "out")
    proc = cli(env["config"], "--output", out, *DASK)
    assert wait_for_rows(proc, out, 0)
    first = spawned_processes(proc.pid)
    assert len(first) == 2
    os.kill(random.Random(3).choice(first), signal.SIGKILL)
    assert wait_for_rows(proc, out, sum(map(len, keys(out)))), "the run ended before the second kill"
    for pid in spawned_processes(proc.pid):
        os.kill(pid, signal.SIGKILL)
    killed_at = sum(map(len, keys(out)))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert killed_at < len(env["expected"]) * len(env["settings"]), "the kill came after the end"
    assert "Traceback" not in err and "dashboard: http" in err
    assert "done: " in err and "per worker:" in err
    assert_exactly_once(out, env["expected"], env["settings"])
    _same_as_reference(env, out)


@pytest.mark.slow
def test_ctrl_c_stops_the_cluster_with_one_line(env, tmp_path):
    """Ctrl-C (SIGINT to the process group): one line, exit 130, no worker process left,
    every committed shard whole and no temporary file (resuming is tested above)."""
    out = str(tmp_path / "out")
    proc = cli(env["config"], "--output", out, *DASK)
    assert wait_for_rows(proc, out, 0)
    workers = spawned_processes(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "interrupted" in last and "run the same command again" in last
    deadline = time.time() + 10  # SIGKILL is delivered asynchronously
    while [p for p in workers if _alive(p)] and time.time() < deadline:
        time.sleep(0.2)
    assert workers and not [p for p in workers if _alive(p)], "a worker outlived the launcher"
    for path in files(out, "completions") + files(out, "errors"):
        pq.read_table(path)
    assert not [n for n in os.listdir(out) if commit.TEMP_MARK in n]


def _heartbeat_failure() -> None:
    """What a worker logs when its scheduler went first (a stop): an ERROR with a traceback."""
    import logging

    try:
        raise OSError("the scheduler is gone")
    except OSError:
        logging.getLogger("distributed.worker").exception("Failed to communicate with scheduler during heartbeat.")


def test_local_cluster_workers_log_no_traceback(capfd):
    """The LocalCluster's workers share the launcher's terminal: a worker's Dask error log
    (a failed heartbeat after the scheduler stopped, seen at Ctrl-C) must not reach it."""
    from distributed import Client

    with dask_cluster._local_cluster(1) as cluster, Client(cluster.scheduler_address) as client:
        client.run(_heartbeat_failure)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "heartbeat" not in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_cluster(port: int) -> list[subprocess.Popen]:
    """A `dask scheduler` and a `dask worker` of one worker process, as on machines of a
    cluster (what is lost here is the scheduler: one worker shows it as well as two, and
    the CI machine's two cores start one faster)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    opts = dict(cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    scheduler = subprocess.Popen([dask, "scheduler", "--port", str(port), "--dashboard-address", ":0"], **opts)
    worker = subprocess.Popen([dask, "worker", f"tcp://127.0.0.1:{port}", "--nworkers", "1", "--nthreads", "1"],
                              **opts)
    return [scheduler, worker]


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


class _ClientBeforeItNotices:
    """A Dask client whose scheduler has just died, at the moment before the client notices:
    its status still says "running"; a request to the scheduler fails with a closed
    connection; `scheduler_info` answers from its cache (distributed's
    `Client._update_scheduler_info` swallows the OSError), as a real one did (a dask
    scheduler killed under a connected client: `scheduler_info` returned, a request failed)."""

    status = "running"
    scheduler = types.SimpleNamespace(identity=None)

    def sync(self, fn, *args, **kwargs):
        raise OSError("Stream is closed")

    def scheduler_info(self, n_workers=-1):
        return {"type": "Scheduler", "workers": {}}


def test_a_lost_scheduler_is_told_while_the_client_still_says_running(tmp_path):
    """The race behind a traceback seen once in CI at the end of the test below: the job's
    futures ended cancelled while the client still said "running", and the check that the
    scheduler answers (then Client.scheduler_info, which returns its cached reply when the
    connection is closed) passed, so the failure was taken for a bug. The launcher must say
    it lost the scheduler. Catches the cached check put back (the race itself happened in
    about 2 of 3 tries on a real cluster, so the client is held at that moment here)."""
    from specsamp.errors import RunFailed

    target = object.__new__(dask_cluster.DaskTarget)
    target.client, target._address = _ClientBeforeItNotices(), "tcp://127.0.0.1:8786"
    target._plan = types.SimpleNamespace(cfg=types.SimpleNamespace(output=str(tmp_path)))
    failure = target._failure(dask_cluster._Unfinished("the job's futures ended cancelled"))
    assert isinstance(failure, RunFailed) and "lost the Dask scheduler" in str(failure)


@pytest.mark.slow
def test_scheduler_lost_exits_1_and_the_same_command_resumes(env, tmp_path):
    """An existing cluster (--dask_client_address) whose scheduler dies mid-run: the
    launcher says so in one line and exits 1 (it must not report success: Dask ends the
    futures of a lost scheduler as cancelled, without an error); with the cluster back,
    the same command completes, each (id, setting) once."""
    from specsamp.cli import main

    out, port = str(tmp_path / "out"), _free_port()
    command = [env["config"], "--output", out, "--runner", "DaskRunner",
               "--dask_client_address", f"tcp://127.0.0.1:{port}"]
    os.environ["DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT"] = "5s"  # the client's reconnection window
    cluster = _start_cluster(port)
    try:
        proc = cli(*command)
        assert wait_for_rows(proc, out, 0)
        os.killpg(cluster[0].pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err
        assert "Traceback" not in err
        assert "lost the Dask scheduler" in err.strip().splitlines()[-1]
        _stop(cluster)
        cluster = _start_cluster(port)
        assert main(["run", "--config", *command]) == 0  # the same command, here
    finally:
        os.environ.pop("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT")
        _stop(cluster)
    assert_exactly_once(out, env["expected"], env["settings"])


def test_unreachable_scheduler_is_one_line(env, capsys):
    from specsamp.cli import main

    code = main(["run", "--config", env["config"], "--output", str(env["root"] / "nowhere"), "--runner", "dask",
                 "--dask_client_address", f"tcp://127.0.0.1:{_free_port()}", "--dask_connection_timeout", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot reach the Dask scheduler" in err and "Traceback" not in err


def test_runner_names_and_the_config_runner(tmp_path):
    """--runner DaskRunner / dask (short names Beam does not know), `runner: dask` in a
    config when no --runner is given, and --runner winning over the config."""
    from apache_beam.options.pipeline_options import StandardOptions

    def runner(args, config=None):
        return pipeline_options(args, config).view_as(StandardOptions).runner

    assert runner(["--runner", "DaskRunner"]) == runner(["--runner", "dask"]) == dask_cluster.RUNNER
    assert runner([], "dask") == dask_cluster.RUNNER and runner([], "local") == "FnApiRunner"
    assert runner(["--runner", "DirectRunner"], "dask") == "FnApiRunner"


def test_default_workers_keep_one_model_per_worker_resident(tmp_path):
    model = tmp_path / "m.gguf"
    with open(model, "wb") as f:
        f.truncate(1 << 29)  # half a GiB, sparse
    cfg = runconfig.from_dict({"input": "x", "output": "y", "target": str(model), "settings": [{"draft": "none"}]})
    gib = 1 << 30
    assert dask_cluster.default_workers(cfg, cores=8, available=10 * gib) == 3  # 3 GiB each
    assert dask_cluster.default_workers(cfg, cores=2, available=64 * gib) == 2
    assert dask_cluster.default_workers(cfg, cores=8, available=gib) == 1


def test_batches_cover_every_row_once_and_feed_every_worker(env):
    """The plan's batches: each row with work left in exactly one batch, batches of one
    file, at most 4 x batch_size prompts, and at least 4 per worker when the rows allow."""
    cfg = runconfig.load(env["config"])
    plan = make_plan(cfg.with_overrides(output=str(env["root"] / "batches")))
    for workers in (1, 2, 3):
        batches = plan.batches(workers)
        assert sorted((b.path, r) for b in batches for r in b.rows) == sorted(
            (path, r) for path, rows in plan.rows for r in rows)
        assert all(0 < len(b.rows) <= 4 * cfg.batch_size for b in batches)
    assert len(plan.batches(2)) > len(plan.batches(1)) >= 4 and plan.n_prompts == len(env["expected"])
