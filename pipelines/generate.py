"""The generation pipeline: prompt shards in, completion and error tables out.

    PromptBatches -> ReadPrompts -> Generate (RunInference) -> Commit

The plan (`pipelines.plan`) fixes the batches: rows of one prompt file that go through the
model together. `ReadPrompts` reads a batch's rows and expands them into work (one sample
per setting; unusable rows become error rows right there), `Generate` runs the batch, and
`Commit` writes its completion and error shards at once (`pipelines.commit`): a run that is
killed keeps its committed rows and a re-run does the rest; a batch that a runner redoes
rewrites its own shards. Every step is a Create or a ParDo with one output and nothing
emitted at a bundle's end, so every runner (the FnApiRunner, Dataflow, Beam on Dask)
executes the graph the same way; what differs per runner is in `pipelines.runners`.

Usage (what `specsamp run` calls):
    run(["--config", "configs/humaneval.yaml", "--output", "out/he",
         "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"])
Flags other than --config/--input/--output/--limit/--retry-errors are Beam pipeline
options. With no --runner (or --runner DirectRunner) the job runs on Beam's FnApiRunner in
this machine: Beam 2.77's DirectRunner would first try to download the Prism runner.
--runner DaskRunner runs it on a Dask cluster (`pipelines.dask_cluster`).
"""

from __future__ import annotations

import sys

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import RunInference
from apache_beam.options.pipeline_options import TestOptions

from pipelines import rows, runners
from pipelines.commit import CommitBatch, remove_stale_temps
from pipelines.handler import DEFAULT_LOADER, NAMESPACE, GeneratorHandler, count_row
from pipelines.options import parse_args, strict_bool
from pipelines.plan import Plan, make_plan, resolve_input
from pipelines.read import read_prompt_file
from pipelines.stop import stops_cleanly
from pipelines.summary import Summary, summarize
from specsamp import runconfig

pipeline_options = runners.pipeline_options  # the options a run gets (tests build pipelines with them)


def run(argv: list[str] | None = None, test_pipeline=None, loader: str = DEFAULT_LOADER) -> Summary | None:
    """Check everything, run the job, and return a summary of the output (None on a dry run).

    `loader` ("module:function", spec -> generator) lets tests wrap the engine.
    """
    args, beam_args = parse_args(argv)
    cfg = runconfig.load(args.config, input=args.input, output=args.output, limit=args.limit)
    options = runners.pipeline_options(beam_args, cfg.runner)
    test = options.view_as(TestOptions)
    dry_run = test.dry_run = strict_bool(test.dry_run, "--dry_run")
    plan = make_plan(resolve_input(cfg, prepare=not dry_run), dry_run=dry_run, retry=args.retry_errors)
    print(_intro(plan, dry_run), file=sys.stderr)
    if plan.todo == 0 and not dry_run:
        return summarize(cfg.output, this_run=0)
    target = runners.target_of(options, test_pipeline)
    with target.started(plan, dry_run) as job:
        p = runners.off_prism(test_pipeline) if test_pipeline else runners.make_pipeline(options)
        job.finish_graph(build(p, plan, loader, job.parallelism()))
        if dry_run and target.local:
            return None  # the local runners ignore --dry_run: building the graph is the dry run
        with stops_cleanly(lambda signum: job.stopped(signum, cfg.output)):
            job.run_to_end(p)
        # The job has ended, every batch committed: a writer killed mid-write while it went
        # on (a Dask worker whose tasks the cluster redid) left its temporary file.
        remove_stale_temps(cfg.output)
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


def build(p: beam.Pipeline, plan: Plan, loader: str = DEFAULT_LOADER, parallelism: int = 1):
    """Add the job's steps to `p`; returns the PCollection of the committed batches'
    reports (`pipelines.commit.report`)."""
    cfg, info = plan.cfg, plan.info
    return (
        p
        | "PromptBatches" >> beam.Create(plan.batches(parallelism))
        | "ReadPrompts" >> beam.Map(_read_batch, cfg, info, plan.wanted)
        | "Generate" >> RunInference(GeneratorHandler(cfg, info, plan.todo, loader))
        | "Commit" >> beam.ParDo(CommitBatch(cfg.output))
    )


def _read_batch(batch, cfg, info, wanted) -> rows.Work:
    """A planned batch -> its Work; counts its prompts and the error rows made here."""
    items = list(read_prompt_file(batch.path, batch.rows))
    work = rows.expand_batch(items, cfg, info, wanted)
    Metrics.counter(NAMESPACE, "prompts").inc(len(items))
    for row in work.errors:
        count_row("error", row)
    return work


if __name__ == "__main__":  # python -m pipelines.generate --config ... == specsamp run ...
    from specsamp.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
