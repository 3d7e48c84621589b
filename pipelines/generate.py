"""The generation pipeline: prompt shards in, completion and error tables out.

    ReadPrompts -> ExpandSettings -> Generate (RunInference) -> Route -> WriteCompletions
                         \\--------------- bad rows --------------------> WriteErrors

Usage (what `specsamp run` calls):
    run(["--config", "configs/humaneval.yaml", "--output", "out/he",
         "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"])
Flags other than --config/--input/--output/--limit are Beam pipeline options. With no
--runner (or --runner DirectRunner) the job runs on Beam's FnApiRunner in this machine:
Beam 2.77's DirectRunner would first try to download the Prism runner from the internet.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import apache_beam as beam
from apache_beam.io.parquetio import ReadFromParquet, WriteToParquet
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import RunInference
from apache_beam.options.pipeline_options import (DirectOptions, PipelineOptions,
                                                  StandardOptions, TestOptions)

from pipelines import rows
from pipelines.handler import DEFAULT_LOADER, NAMESPACE, GeneratorHandler, count_row
from pipelines.plan import Plan, make_plan, resolve_input
from pipelines.summary import Summary, summarize
from schemas import COMPLETIONS, ERRORS
from specsamp import runconfig
from specsamp.errors import UserError

_LOCAL_RUNNERS = (None, "DirectRunner", "SwitchingDirectRunner")
_USER_ERROR = re.compile(r"specsamp\.errors\.UserError: ([^\n]+)")


def run(argv: list[str] | None = None, test_pipeline=None, loader: str = DEFAULT_LOADER) -> Summary | None:
    """Check everything, run the job, and return a summary of the output (None on a dry run).

    `loader` ("module:function", spec -> generator) lets tests wrap the engine.
    """
    args, beam_args = parse_args(argv)
    cfg = runconfig.load(args.config, input=args.input, output=args.output, limit=args.limit)
    options = pipeline_options(beam_args)
    dry_run = bool(options.view_as(TestOptions).dry_run)
    plan = make_plan(resolve_input(cfg, prepare=not dry_run), dry_run=dry_run)
    print(_intro(plan, dry_run), file=sys.stderr)
    if plan.todo == 0 and not dry_run:
        return summarize(cfg.output, this_run=0)
    p = _off_prism(test_pipeline) if test_pipeline else _pipeline(options)
    write(*build(p, plan, loader), plan)
    _run_to_end(p)
    return None if dry_run else summarize(cfg.output, this_run=plan.todo)


def _intro(plan: Plan, dry_run: bool) -> str:
    if dry_run:
        return "specsamp run: dry run; building the job graph only (storage not checked)"
    if plan.todo == 0:
        return (f"specsamp run: nothing to do; all {plan.n_prompts} prompts x "
                f"{len(plan.cfg.settings)} settings are already in {plan.cfg.output}")
    return (f"specsamp run: {plan.todo} samples to generate ({plan.n_prompts} prompts x "
            f"{len(plan.cfg.settings)} settings, {len(plan.done)} already done) -> {plan.cfg.output}")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(the run's own flags, Beam pipeline options)."""
    parser = argparse.ArgumentParser(prog="specsamp run", add_help=False, allow_abbrev=False)
    runconfig.add_override_arguments(parser)
    return parser.parse_known_args(argv)


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """Beam options, with local runs sent to the FnApiRunner (see the module docstring)."""
    options = PipelineOptions(beam_args)
    std = options.view_as(StandardOptions)
    if std.runner in _LOCAL_RUNNERS:
        std.runner = "FnApiRunner"
    if options.view_as(DirectOptions).direct_running_mode == "multi_processing":
        _export_source_path()
    return options


def _run_to_end(p: beam.Pipeline) -> None:
    """Run and wait. A UserError raised on a worker (e.g. a checkpoint that does not load)
    reaches us wrapped in the runner's traceback: give the user its one line back."""
    try:
        p.run().wait_until_finish()
    except Exception as e:
        found = _USER_ERROR.search(str(e))
        if found:
            raise UserError(found.group(1)) from None
        raise


def _off_prism(p: beam.Pipeline) -> beam.Pipeline:
    """A TestPipeline left on the default DirectRunner would try to download Prism."""
    from apache_beam.runners.direct.direct_runner import SwitchingDirectRunner
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    if isinstance(p.runner, SwitchingDirectRunner):
        p.runner = FnApiRunner()
    return p


def _pipeline(options: PipelineOptions) -> beam.Pipeline:
    try:
        return beam.Pipeline(options=options)
    except ValueError as e:  # Beam's own option checks (bad runner, project id, bucket)
        raise UserError(f"invalid pipeline options: {' '.join(str(e).split())}") from None


def build(p: beam.Pipeline, plan: Plan, loader: str = DEFAULT_LOADER):
    """Add the job's steps to `p`; returns the (completions, errors) PCollections of rows."""
    cfg, info = plan.cfg, plan.info
    split = (
        p
        | "ReadPrompts" >> ReadFromParquet(plan.pattern, validate=False)
        | "ExpandSettings" >> beam.FlatMap(_expand, cfg, info, plan.wanted).with_outputs("error", main="example")
    )
    results = (
        split.example
        | "Generate" >> RunInference(GeneratorHandler(cfg, info, plan.todo, loader))
        | "Route" >> beam.FlatMap(_route).with_outputs("error", main="completion")
    )
    errors = (split.error, results.error) | "AllErrors" >> beam.Flatten()
    return results.completion, errors


def write(completions, errors, plan: Plan) -> None:
    for label, pcoll, table, schema in (("WriteCompletions", completions, "completions", COMPLETIONS),
                                        ("WriteErrors", errors, "errors", ERRORS)):
        pcoll | label >> WriteToParquet(plan.prefix(table), schema=schema, file_name_suffix=".parquet",
                                        codec="snappy", use_compliant_nested_type=True)


def _expand(row: dict, cfg, info, wanted):
    """Prompt row -> Examples (main output) and error rows for unusable rows ("error")."""
    items = rows.expand(row, cfg, info, wanted)
    if items:
        Metrics.counter(NAMESPACE, "prompts").inc()
    for tag, value in items:
        if tag == "example":
            yield value
        else:
            count_row("error", value)
            yield beam.pvalue.TaggedOutput("error", value)


def _route(result):
    tag, row = result.inference
    yield row if tag == "completion" else beam.pvalue.TaggedOutput("error", row)


def _export_source_path() -> None:
    """Worker subprocesses must import `pipelines` and `specsamp` even when the project is
    not installed (running from a checkout): put its root on their PYTHONPATH."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])


if __name__ == "__main__":  # python -m pipelines.generate --config ... == specsamp run ...
    from specsamp.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
