"""The generation pipeline: prompt shards in, completion and error tables out.

    PromptFiles -> ReadPrompts -> Spread -> ExpandSettings -> Generate (RunInference) -> Route
        -> CommitCompletions;   unusable rows and failed samples -> AllErrors -> CommitErrors

Rows are committed in shards as batches finish (`pipelines.commit`): a run that is killed
keeps its committed rows and a re-run does the rest. `Spread` (a reshuffle) hands the rows
of even a single input file to every worker.

Usage (what `specsamp run` calls):
    run(["--config", "configs/humaneval.yaml", "--output", "out/he",
         "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"])
Flags other than --config/--input/--output/--limit/--retry-errors are Beam pipeline
options. With no --runner (or --runner DirectRunner) the job runs on Beam's FnApiRunner in
this machine: Beam 2.77's DirectRunner would first try to download the Prism runner.
"""

from __future__ import annotations

import os
import re
import sys

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import RunInference
from apache_beam.options.pipeline_options import (DirectOptions, PipelineOptions,
                                                  StandardOptions, TestOptions)

from pipelines import rows
from pipelines.commit import CommitShards
from pipelines.handler import DEFAULT_LOADER, NAMESPACE, GeneratorHandler, count_row
from pipelines.options import parse_args, strict_bool
from pipelines.plan import Plan, make_plan, resolve_input
from pipelines.read import read_prompt_file
from pipelines.stop import stops_cleanly
from pipelines.summary import Summary, summarize
from schemas import COMPLETIONS, ERRORS
from specsamp import runconfig
from specsamp.errors import UserError

_LOCAL_RUNNERS = (None, "DirectRunner", "SwitchingDirectRunner")
_USER_ERROR = re.compile(r"specsamp\.errors\.UserError: ([^\n]+)")
_SIGNALS = {2: ("SIGINT", "interrupted"), 15: ("SIGTERM", "terminated")}


def run(argv: list[str] | None = None, test_pipeline=None, loader: str = DEFAULT_LOADER) -> Summary | None:
    """Check everything, run the job, and return a summary of the output (None on a dry run).

    `loader` ("module:function", spec -> generator) lets tests wrap the engine.
    """
    args, beam_args = parse_args(argv)
    cfg = runconfig.load(args.config, input=args.input, output=args.output, limit=args.limit)
    options = pipeline_options(beam_args)
    test = options.view_as(TestOptions)
    dry_run = test.dry_run = strict_bool(test.dry_run, "--dry_run")
    plan = make_plan(resolve_input(cfg, prepare=not dry_run), dry_run=dry_run, retry=args.retry_errors)
    print(_intro(plan, dry_run), file=sys.stderr)
    if plan.todo == 0 and not dry_run:
        return summarize(cfg.output, this_run=0)
    p = _off_prism(test_pipeline) if test_pipeline else _pipeline(options)
    write(*build(p, plan, loader), plan)
    if dry_run and _is_local(p):
        return None  # the local runners ignore --dry_run: building the graph is the dry run
    local = _is_local(p)
    with stops_cleanly(lambda signum: _stopped(signum, cfg.output, local)):
        _run_to_end(p)
    return None if dry_run else summarize(cfg.output, this_run=plan.todo)


def _intro(plan: Plan, dry_run: bool) -> str:
    if dry_run:
        return "specsamp run: dry run; building the job graph only (storage not checked, nothing run)"
    if plan.todo == 0:
        return (f"specsamp run: nothing to do; all {plan.n_prompts} prompts x "
                f"{len(plan.cfg.settings)} settings are already in {plan.cfg.output}")
    retried = f", {plan.retried} error rows retried" if plan.retried else ""
    lines = [f"specsamp run: {plan.todo} samples to generate ({plan.n_prompts} prompts x "
             f"{len(plan.cfg.settings)} settings, {len(plan.done)} already done{retried}) -> {plan.cfg.output}"]
    lines += [f"specsamp run: warning: cannot read {path}; its rows go to the error table "
              "(unreadable_file)" for path in plan.unreadable]
    return "\n".join(lines)


def _stopped(signum: int, output: str, local: bool = True) -> str:
    name, what = _SIGNALS.get(signum, (f"signal {signum}", "stopped"))
    if not local:  # the launcher stops; the job goes on where it runs
        return (f"specsamp run: {what} ({name}); the submitted job keeps running and committing to "
                f"{output}: cancel it (gcloud dataflow jobs cancel) before running the same command again")
    return (f"specsamp run: {what} ({name}); the rows committed so far are kept in {output}; "
            "run the same command again to resume")


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """Beam options, with local runs sent to the FnApiRunner (see the module docstring)."""
    options = PipelineOptions(beam_args)
    std = options.view_as(StandardOptions)
    if std.runner in _LOCAL_RUNNERS:
        std.runner = "FnApiRunner"
    if options.view_as(DirectOptions).direct_running_mode == "multi_processing":
        _export_source_path()
    return options


def _is_local(p: beam.Pipeline) -> bool:
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    return isinstance(p.runner, FnApiRunner)


def _run_to_end(p: beam.Pipeline) -> None:
    """Run and wait. A UserError raised on a worker (e.g. a checkpoint that does not load,
    an output that cannot be written) reaches us wrapped in the runner's traceback: give
    the user its one line back."""
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
        | "PromptFiles" >> beam.Create(list(plan.files))
        | "ReadPrompts" >> beam.FlatMap(read_prompt_file)
        | "Spread" >> beam.Reshuffle()
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
    """Commit rows in shards of one generate batch (all settings) as they are made."""
    n = plan.cfg.batch_size * len(plan.cfg.settings)
    for label, pcoll, table, schema in (("CommitCompletions", completions, "completions", COMPLETIONS),
                                        ("CommitErrors", errors, "errors", ERRORS)):
        pcoll | label >> beam.ParDo(CommitShards(plan.cfg.output, table, schema, n))


def _expand(item, cfg, info, wanted):
    """PromptRow -> Examples (main output) and error rows for unusable rows ("error")."""
    items = rows.expand(item, cfg, info, wanted)
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
