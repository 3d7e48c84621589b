"""Beam on Dask: the job on a dask.distributed cluster (`--runner DaskRunner`).

With `--dask_client_address tcp://HOST:8786` the job goes to an existing cluster (a
`dask scheduler` and `dask worker` processes on any number of machines); without it a
LocalCluster of `--dask_workers N` worker processes starts here and stops with the run.

How Beam's DaskRunner executes the graph, and what the pipeline relies on (Beam 2.77):
- it translates Create, ParDo, GroupByKey and Flatten; `generate.build` uses only Create
  and ParDos with one output that emit in `process`, never in `finish_bundle` (dropped);
- each Create element (a planned batch) is its own partition, so the scheduler hands
  batches to whichever worker is free: rows spread over workers even from one file;
- a DoFn is set up per partition: the models stay loaded in the worker process
  (`pipelines.handler`), so a worker loads them once;
- a worker that dies has its tasks rerun elsewhere (a batch redone rewrites its own
  shards: `pipelines.commit`); one task killing 3 workers fails the job (KilledWorker);
- the result of the last step is gathered on the launcher: the last step here emits
  nothing, and reports progress as Dask events (`Publish`) instead;
- `metrics()` is not implemented: the summary is read back from the tables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.commit import remove_stale_temps
from pipelines.stop import kept_in, signal_words
from specsamp.errors import RunFailed, UserError

RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
NAMES = ("DaskRunner", "dask", "Dask", RUNNER)
_GIB = 1 << 30
_OURS = ("pipelines", "specsamp", "schemas")  # packages a cluster must have to run the job


class DaskClusterOptions(PipelineOptions):
    """The launcher's own Dask flag (Beam's DaskOptions has the client's)."""

    @classmethod
    def _add_argparse_args(cls, parser):
        parser.add_argument("--dask_workers", type=int, default=None,
                            help="worker processes of the LocalCluster started when no "
                                 "--dask_client_address is given (default: see default_workers)")


def default_workers(cfg, cores: int | None = None, available: int | None = None) -> int:
    """One worker process per core, as long as each can keep its models resident: a worker
    takes about 1 GiB plus four times the models' files (weights unpacked to float32)."""
    cores = cores or os.cpu_count() or 1
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    per_worker = _GIB + 4 * _model_bytes(cfg)
    return max(1, min(cores, available // per_worker))


def _model_bytes(cfg) -> int:
    """Bytes of the local model files a worker loads (remote ones are not counted)."""
    paths = [cfg.target] + [s.draft for s in cfg.settings]
    total = 0
    for path in filter(None, paths):
        path = os.path.expanduser(path)
        if os.path.isfile(path):
            total += os.path.getsize(path)
        elif os.path.isdir(path):
            total += sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)
    return total


class DaskTarget:
    """The Dask side of a run (see `pipelines.runners` for the others)."""

    local = True  # Beam's DaskRunner ignores --dry_run: building the graph is the dry run

    def __init__(self, options: PipelineOptions):
        self.options = options
        self.client = self.result = self.progress = None
        self._workers = 1
        self._address = None
        self._plan = None
        self._own_cluster = False

    @contextlib.contextmanager
    def started(self, plan, dry_run: bool):
        """Connect to the cluster (or start a LocalCluster) for the run, then close it."""
        self._plan = plan
        if dry_run:
            yield self
            return
        _require_dask()
        from apache_beam.runners.dask.dask_runner import DaskOptions

        dask_options = self.options.view_as(DaskOptions)
        with contextlib.ExitStack() as stack:
            if dask_options.address is None:
                n = self.options.view_as(DaskClusterOptions).dask_workers or default_workers(plan.cfg)
                dask_options.address = stack.enter_context(_local_cluster(n)).scheduler_address
                where = f"a LocalCluster of {n} worker processes started here"
                self._own_cluster = True
            else:
                where = "an existing cluster"
            self._address = dask_options.address
            self.client = stack.enter_context(_connect(self._address, dask_options.timeout))
            self._workers = sum(self.client.nthreads().values())
            if dask_options.npartitions is None and dask_options.partition_size is None:
                dask_options.npartitions = max(1, len(plan.batches(self._workers)))  # a batch per task
            _say(f"Dask scheduler {self._address} ({where}), {self._workers} worker threads"
                 + (f"; dashboard: {self.client.dashboard_link}" if _has_dashboard(self.client) else ""))
            try:
                yield self
            finally:  # Beam's own client: closing it releases whatever of the job is left
                if self.result is not None:
                    _within(10, self.result.client.close)

    def parallelism(self) -> int:
        return self._workers

    def finish_graph(self, reports) -> None:
        """The reports go to the launcher as Dask events; nothing is gathered at the end."""
        reports | "Publish" >> beam.ParDo(Publish(_topic(self._plan)))

    def stopped(self, signum: int, output: str) -> str:
        """The line for Ctrl-C / SIGTERM, after the job's tasks on the cluster are cancelled
        (a LocalCluster's workers are already gone with the launcher's child processes, so
        what they left half-written is removed now; another cluster's workers may still be
        writing, and the next run removes theirs)."""
        if self._own_cluster:
            remove_stale_temps(output)
        name, what = signal_words(signum)
        cancelled = self.result is not None and _within(5, lambda: self.result.client.cancel(self.result.futures))
        return (f"specsamp run: {what} ({name}); "
                + ("this job's tasks on the Dask cluster were cancelled; " if cancelled else "")
                + kept_in(output))

    def run_to_end(self, p: beam.Pipeline) -> None:
        """Submit, report progress until the job ends, and turn the cluster's failures into
        one line: a lost scheduler or a task that killed its workers is a RunFailed, a
        cluster without specsamp installed a UserError."""
        self.progress = LauncherProgress(self._plan.todo)
        self.client.subscribe_topic(_topic(self._plan), self.progress.event)
        try:
            self.result = p.run()
            self.result.wait_until_finish()
            # A client that lost its scheduler ends its futures as cancelled, without an error.
            unfinished = [f.status for f in self.result.futures if f.status != "finished"]
            if unfinished:
                raise _Unfinished(f"the job's futures ended {unfinished[0]}")
        except UserError:
            raise
        except Exception as e:
            raise self._failure(e) or e
        finally:
            _within(5, lambda: self.client.unsubscribe_topic(_topic(self._plan)))
        self.progress.print(final=True)

    def _failure(self, e: Exception) -> Exception | None:
        from distributed import KilledWorker

        keep = kept_in(self._plan.cfg.output)
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        if isinstance(e, KilledWorker):
            return RunFailed(f"a task of this job was running on each of the Dask workers that died "
                             f"before it finished ({reason}); {keep}")
        if "deserializ" in str(e) or (isinstance(e, ModuleNotFoundError) and e.name in _OURS):
            return UserError(f"the Dask cluster cannot load this job's code ({reason}): install specsamp, "
                             "the same version as here, where the scheduler and the workers run")
        # A request to the scheduler, not Client.scheduler_info: that one swallows a closed
        # connection and returns its cached reply, so a scheduler just lost looked alive.
        if self.client.status != "running" or not _within(
                10, lambda: self.client.sync(self.client.scheduler.identity, n_workers=0)):
            return RunFailed(f"lost the Dask scheduler at {self._address} ({reason}); {keep}")
        return None  # a bug: it keeps its traceback


class _Unfinished(Exception):
    """The job's futures ended without a result and without an error."""


class Publish(beam.DoFn):
    """On a Dask worker: one event per committed batch, to the launcher's progress."""

    def __init__(self, topic: str):
        self._topic = topic

    def process(self, report):
        try:
            from distributed import get_worker

            worker = get_worker()
        except (ImportError, ValueError):  # not in a Dask worker
            return
        worker.log_event(self._topic, {"worker": worker.address, "samples": len(report["completions"]) +
                                       len(report["errors"]), "errors": len(report["errors"]),
                                       "tokens": report["tokens"]})
        yield from ()


class LauncherProgress:
    """Samples done of the total, tokens/s, per worker: one line every `every_s` seconds."""

    def __init__(self, total: int, every_s: float = 10.0):
        self.total, self.every_s = total, every_s
        self.start = self.last = time.time()
        self.workers: dict[str, list[int]] = {}  # address -> [samples, errors, tokens]
        self._lock = threading.Lock()

    def event(self, event) -> None:
        _, msg = event
        with self._lock:
            counts = self.workers.setdefault(msg["worker"], [0, 0, 0])
            for i, key in enumerate(("samples", "errors", "tokens")):
                counts[i] += msg[key]
        if time.time() - self.last >= self.every_s:
            self.print()

    def print(self, final: bool = False) -> None:
        self.last = now = time.time()
        with self._lock:
            rows = sorted(self.workers.items())
        took = max(now - self.start, 1e-9)
        done, errors, tokens = (sum(c[i] for _, c in rows) for i in range(3))
        per = ", ".join(f"{w} {c[0]} samples, {c[2] / took:.1f} tokens/s" for w, c in rows)
        # A batch redone after a worker was lost counts again: `done` may pass the total.
        _say(f"{'done: ' if final else ''}{done} of {self.total} samples ({errors} errors), "
             f"{tokens / took:.1f} tokens/s in {took:.0f} s" + (f"; per worker: {per}" if per else ""))


def _topic(plan) -> str:
    return f"specsamp-progress-{plan.info.run_id}"


@contextlib.contextmanager
def _local_cluster(n: int):
    """A LocalCluster of `n` single-threaded worker processes (a generate call uses the
    cores itself). They start with SIGINT / SIGTERM blocked: a Ctrl-C reaches the whole
    process group, and the launcher, not each worker, stops the job (`pipelines.stop`).
    Their Dask logs are silenced below CRITICAL, as the launcher's are (`_quiet`): at a stop
    a worker that outlives the scheduler for a moment logs its failed heartbeat at ERROR,
    with a traceback, on the terminal the workers share with the launcher."""
    from distributed import LocalCluster

    _quiet()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, memory_limit=0,
                               dashboard_address=":0", silence_logs=logging.CRITICAL)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        yield cluster
    finally:
        _within(30, cluster.close)


@contextlib.contextmanager
def _connect(address: str, timeout):
    from distributed import Client

    _quiet()
    try:
        client = Client(address, timeout=timeout if isinstance(timeout, int) else 30)
    except (OSError, TimeoutError) as e:
        raise UserError(f"cannot reach the Dask scheduler at {address} ({type(e).__name__}: {e}); "
                        "start one (dask scheduler; dask worker tcp://HOST:8786) or leave out "
                        "--dask_client_address to start a LocalCluster here") from None
    try:
        if not client.nthreads():
            _say("waiting for a Dask worker to join the cluster")
            client.wait_for_workers(1)
        yield client
    finally:
        _within(10, client.close)


def _quiet() -> None:
    """Dask's own lines in the launcher (workers joining, closing, restarting; a client's
    reconnection attempts with their tracebacks) are not the user's business: the launcher
    turns what ends a job into one line of its own (`DaskTarget._failure`)."""
    for name in ["distributed", *logging.root.manager.loggerDict]:
        if name.split(".")[0] == "distributed":  # its config sets some children's levels
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _require_dask() -> None:
    try:
        import dask.distributed  # noqa: F401
    except ImportError:
        raise UserError('--runner DaskRunner needs dask.distributed: pip install "specsamp[dask]" '
                        '(or pip install "dask[distributed]")') from None


def _has_dashboard(client) -> bool:
    """A dashboard is served only where bokeh is installed (the `dask` extra has it)."""
    import importlib.util

    try:
        return bool(client.dashboard_link) and importlib.util.find_spec("bokeh") is not None
    except Exception:
        return False


def _within(seconds: float, fn) -> bool:
    """Call `fn` in a thread, waiting at most `seconds`: a cluster that is gone must not hang
    the launcher. True when it returned without an error."""
    ok = []

    def call():
        try:
            fn()
            ok.append(True)
        except Exception:
            pass

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(ok)


def _say(text: str) -> None:
    print(f"specsamp run: {text}", file=sys.stderr, flush=True)

