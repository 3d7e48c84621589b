"""Apache Beam pipelines of specsamp (the Beam code stays thin; the work is in `specsamp`).

- `pipelines.generate`: planned batches of prompt rows -> RunInference(GeneratorHandler) ->
  Parquet shards; one graph for every runner.
- `pipelines.runners`: what differs per runner (local FnApiRunner, Dataflow, Dask).
- `pipelines.dask_cluster`: Beam on a dask.distributed cluster (LocalCluster or existing).
- `pipelines.handler`: the ModelHandler (models loaded once per worker, errors per element).
- `pipelines.read`: prompt files read on the workers (bad_utf8, unreadable_file rows).
- `pipelines.commit`: each batch's rows committed in atomic, idempotent shards.
- `pipelines.plan`: checks and decisions made before a job starts (inputs, resume, run id,
  the batches).
- `pipelines.context`: the target's context length, for the max_new_tokens check.
- `pipelines.options`: the run's own flags (--retry-errors, strict booleans).
- `pipelines.stop`: SIGINT / SIGTERM as clean stops of a local or Dask run.
- `pipelines.rows`: plain functions from prompt rows to work items and output rows.
- `pipelines.summary`: the summary printed at the end of `specsamp run`.
- `pipelines.command`: `specsamp run`, plugged into the CLI as an entry point (pyproject.toml).
"""
