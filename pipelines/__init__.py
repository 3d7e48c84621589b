"""Apache Beam pipelines of specsamp (the Beam code stays thin; the work is in `specsamp`).

- `pipelines.generate`: prompt shards -> RunInference(GeneratorHandler) -> Parquet shards.
- `pipelines.handler`: the ModelHandler (models loaded once per worker, errors per element).
- `pipelines.read`: prompt files read on the workers (bad_utf8, unreadable_file rows).
- `pipelines.commit`: rows committed in atomic, idempotent shards as batches finish.
- `pipelines.plan`: checks and decisions made before a job starts (inputs, resume, run id).
- `pipelines.context`: the target's context length, for the max_new_tokens check.
- `pipelines.options`: the run's own flags (--retry-errors, strict booleans).
- `pipelines.stop`: SIGINT / SIGTERM as clean stops of a local run.
- `pipelines.rows`: plain functions from prompt rows to work items and output rows.
- `pipelines.summary`: the summary printed at the end of `specsamp run`.
"""
