"""`specsamp run --config FILE [--input ...] [--output ...] [Beam options...]`: the pipeline.

The pipeline's subcommand of the `specsamp` CLI. The library sits below `pipelines` and
never imports it: `pyproject.toml` registers `register` in the entry point group
`specsamp.commands`, which `specsamp.cli` reads from the installed package's metadata.
"""

from __future__ import annotations

import argparse
import sys

from specsamp.runconfig import add_override_arguments

EPILOG = """\
Any other flag is an Apache Beam pipeline option. Local runs use Beam's FnApiRunner, e.g.
  specsamp run --config configs/humaneval.yaml --direct_num_workers 2 --direct_running_mode multi_processing
Dataflow with TPU workers (see configs/dataflow_tpu.yaml and Dockerfile):
  specsamp run --config configs/dataflow_tpu.yaml --runner DataflowRunner --project P --region R
    --temp_location gs://B/tmp --worker_machine_type ct5lp-hightpu-1t
    --dataflow_service_options "worker_accelerator=type:tpu-v5-lite-podslice;topology:1x1"
    --sdk_container_image IMAGE
A Dask cluster (pip install "specsamp[dask]"): a LocalCluster of N worker processes here
  specsamp run --config configs/humaneval.yaml --runner DaskRunner --dask_workers 2
or an existing cluster (dask scheduler; dask worker tcp://HOST:8786 on each machine)
  specsamp run --config C --runner DaskRunner --dask_client_address tcp://HOST:8786
Rows are committed as batches finish. A re-run with the same config and output resumes:
samples already written are skipped (--retry-errors [KIND,...] attempts error rows again).
Ctrl-C / SIGTERM stop with exit 130 / 143 and keep every committed row. --dry_run true
builds the job graph and runs nothing."""


class _PassThroughParser(argparse.ArgumentParser):
    """Keeps flags it does not know (Beam's pipeline options, too many to declare here
    without importing Beam) in `args.beam_args` instead of rejecting them."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        ns.beam_args = list(getattr(ns, "beam_args", None) or []) + extras
        return ns, []


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="generate over prompt shards with the Beam pipeline",
        description="Run the generation pipeline: prompt shards in, completions-*.parquet and "
        "errors-*.parquet out, then print where the tables are and a short summary.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.__class__ = _PassThroughParser  # created by add_parser; only parsing changes
    add_override_arguments(parser)
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from pipelines.generate import run
    from specsamp.compilation import enable_compilation_cache

    enable_compilation_cache()  # as for the CLI's own compiling commands (specsamp.cli)
    argv = ["--config", args.config]
    for flag in ("input", "output", "limit", "retry_errors"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    summary = run(argv + args.beam_args)
    if summary is None:
        print("dry run: the job graph was built; nothing was run", file=sys.stderr)
    else:
        print(summary.text())
    return 0
