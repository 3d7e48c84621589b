"""Apache Beam pipelines of specsamp (the Beam code stays thin; the work is in `specsamp`).

- `pipelines.generate`: prompt shards -> RunInference(GeneratorHandler) -> Parquet tables.
- `pipelines.handler`: the ModelHandler (models loaded once per worker, errors per element).
- `pipelines.plan`: checks and decisions made before a job starts (inputs, resume, run id).
- `pipelines.rows`: plain functions from prompt rows to work items and output rows.
- `pipelines.summary`: the summary printed at the end of `specsamp run`.
"""
