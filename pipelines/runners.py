"""What differs between runners, in one place: the runner a run gets, how its job starts,
runs, reports and stops. The job graph (`pipelines.generate.build`) is the same for all.

- Local (Beam's FnApiRunner, also for --runner DirectRunner: Beam 2.77's DirectRunner
  would first try to download Prism): runs in this process and its worker processes.
- Dataflow (and any other remote Beam runner): the job is submitted; the launcher waits.
  Staging and the worker container are Beam's --setup_file / --sdk_container_image
  (see Dockerfile and configs/dataflow_tpu.yaml).
- Dask (`pipelines.dask_cluster`): Beam's DaskRunner on a dask.distributed cluster, an
  existing one or a LocalCluster started here.

`runner:` in a run config (local | dask | dataflow) picks one when --runner is not given.
"""

from __future__ import annotations

import contextlib
import os
import re

import apache_beam as beam
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from pipelines import dask_cluster
from pipelines.commit import remove_stale_temps
from pipelines.stop import kept_in, signal_words
from specsamp.errors import UserError

_LOCAL_RUNNERS = (None, "DirectRunner", "SwitchingDirectRunner")
_CONFIG_RUNNERS = {"local": None, "dask": dask_cluster.RUNNER, "dataflow": "DataflowRunner"}
_USER_ERROR = re.compile(r"specsamp\.errors\.UserError: ([^\n]+)")


def pipeline_options(beam_args: list[str], config_runner: str | None = None) -> PipelineOptions:
    """Beam options, with local runs sent to the FnApiRunner and the Dask runner known by
    its short names (DaskRunner, dask) as well as by its class path."""
    options = PipelineOptions(beam_args)
    std = options.view_as(StandardOptions)
    if std.runner is None and config_runner is not None:
        std.runner = _CONFIG_RUNNERS[config_runner]
    if std.runner in dask_cluster.NAMES:
        std.runner = dask_cluster.RUNNER
    if std.runner in _LOCAL_RUNNERS:
        std.runner = "FnApiRunner"
    if options.view_as(DirectOptions).direct_running_mode == "multi_processing" or std.runner == dask_cluster.RUNNER:
        export_source_path()
    return options


def target_of(options: PipelineOptions, test_pipeline=None):
    """The runner-specific side of a run: LocalTarget, RemoteTarget or dask_cluster.DaskTarget."""
    runner = options.view_as(StandardOptions).runner
    if test_pipeline is not None:
        return RemoteTarget(options) if "Dataflow" in type(test_pipeline.runner).__name__ else LocalTarget(options)
    if runner == dask_cluster.RUNNER:
        return dask_cluster.DaskTarget(options)
    return LocalTarget(options) if runner == "FnApiRunner" else RemoteTarget(options)


class LocalTarget:
    """The FnApiRunner: this machine, `--direct_num_workers` processes."""

    local = True  # ignores --dry_run: building the graph is the dry run

    def __init__(self, options: PipelineOptions):
        self.options = options

    @contextlib.contextmanager
    def started(self, plan, dry_run: bool):
        yield self

    def parallelism(self) -> int:
        return max(1, self.options.view_as(DirectOptions).direct_num_workers or 1)

    def finish_graph(self, reports) -> None:
        """Nothing to add: the reports end in the runner's memory (small: keys per batch)."""

    def stopped(self, signum: int, output: str) -> str:
        """The line for Ctrl-C / SIGTERM, once the worker processes are gone: what a killed
        writer left half-written is removed now, not at the next run."""
        remove_stale_temps(output)
        name, what = signal_words(signum)
        return f"specsamp run: {what} ({name}); {kept_in(output)}"

    def run_to_end(self, p: beam.Pipeline) -> None:
        """Run and wait. A UserError raised on a worker (e.g. a checkpoint that does not
        load, an output that cannot be written) reaches us wrapped in the runner's
        traceback: give the user its one line back."""
        try:
            p.run().wait_until_finish()
        except UserError:
            raise
        except Exception as e:
            found = _USER_ERROR.search(str(e))
            if found:
                raise UserError(found.group(1)) from None
            raise


class RemoteTarget(LocalTarget):
    """Dataflow and other submitted jobs: the job runs elsewhere, and honours --dry_run."""

    local = False

    def parallelism(self) -> int:
        from apache_beam.options.pipeline_options import WorkerOptions

        return max(1, self.options.view_as(WorkerOptions).max_num_workers or 1)

    def stopped(self, signum: int, output: str) -> str:
        name, what = signal_words(signum)
        return (f"specsamp run: {what} ({name}); the submitted job keeps running and committing to "
                f"{output}: cancel it (gcloud dataflow jobs cancel) before running the same command again")


def make_pipeline(options: PipelineOptions) -> beam.Pipeline:
    try:
        return beam.Pipeline(options=options)
    except ValueError as e:  # Beam's own option checks (bad runner, project id, bucket)
        raise UserError(f"invalid pipeline options: {' '.join(str(e).split())}") from None


def off_prism(p: beam.Pipeline) -> beam.Pipeline:
    """A TestPipeline left on the default DirectRunner would try to download Prism."""
    from apache_beam.runners.direct.direct_runner import SwitchingDirectRunner
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    if isinstance(p.runner, SwitchingDirectRunner):
        p.runner = FnApiRunner()
    return p


def export_source_path() -> None:
    """Worker processes must import `pipelines` and `specsamp` even when the project is
    not installed (running from a checkout): put its root on their PYTHONPATH."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])
