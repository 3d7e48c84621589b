"""The pipeline's output tables, found and opened for queries (`specsamp report`, `eval`).

A user names tables as files, folders (searched recursively), globs, or gs:// URLs (any
fsspec URL). Completion tables are `completions-*.parquet` (or any other Parquet file named
directly); error tables are `errors-*.parquet`, taken from the folders of the completion
tables. Every file's schema is checked against `schemas` before any query runs, so a table
from another schema version is refused with one clear line.

Local files are read by DuckDB directly; remote ones through fsspec into Arrow, registered
with the same DuckDB connection. Either way the connection has two views, `completions` and
`errors`, with non-finite timings turned into NULL (so aggregates skip them) and float32
sampling settings rounded to 6 digits (0.7, not 0.699999988).

Exactly once: a sample is identified by `ROW_KEY`. The pipeline commits each key once; as
a safety net the views keep one row per key. An error row is superseded (left out of the
`errors` view) when a completion with its key exists, as after `specsamp run
--retry-errors`, and only the latest error row of a key counts.
"""

from __future__ import annotations

import dataclasses
import posixpath

from schemas import COMPLETIONS, ERRORS, SchemaMismatch, check_schema
from specsamp.errors import UserError
from specsamp.fs import filesystem, glob, join

COMPLETIONS_GLOB = "completions-*.parquet"
ROW_KEY = ("id", "draft", "k", "tree", "config_hash")
ERRORS_GLOB = "errors-*.parquet"


@dataclasses.dataclass(frozen=True)
class Tables:
    """Resolved table files, each with its protocol when remote (e.g. 'gs://b/x.parquet')."""

    completions: tuple[str, ...]
    errors: tuple[str, ...]


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _is_errors(path: str) -> bool:
    return posixpath.basename(path).startswith("errors-")


def _expand(arg: str) -> list[str]:
    """Parquet files that one command-line argument names (folders searched recursively)."""
    fs, stripped = filesystem(arg)
    try:
        is_dir = fs.isdir(stripped)
    except Exception as e:  # network, permissions, missing bucket: one line
        raise UserError(f"cannot list {arg}: {type(e).__name__}: {e}") from None
    if is_dir:
        return [f for pattern in (COMPLETIONS_GLOB, ERRORS_GLOB)
                for f in glob(join(arg, "**", pattern))]
    found = glob(arg)
    if not found:
        raise UserError(f"nothing matches {arg}" if any(c in arg for c in "*?[") else f"{arg} does not exist")
    return found


def _sibling_errors(completion_files: list[str]) -> list[str]:
    folders = sorted({posixpath.dirname(f) for f in completion_files})
    return [f for d in folders for f in glob(join(d, ERRORS_GLOB) if d else ERRORS_GLOB)]


def resolve(args: list[str]) -> Tables:
    """The completion and error tables named by `args`; a UserError when there are none."""
    files = [f for arg in args for f in _expand(arg)]
    completions = sorted({f for f in files if not _is_errors(f)})
    if not completions:
        raise UserError(f"no completion tables ({COMPLETIONS_GLOB}) found in: {' '.join(args)}")
    errors = sorted({f for f in files if _is_errors(f)} | set(_sibling_errors(completions)))
    for path in completions:
        _check(path, COMPLETIONS)
    for path in errors:
        _check(path, ERRORS)
    return Tables(tuple(completions), tuple(errors))


def _check(path: str, expected) -> None:
    import pyarrow.parquet as pq

    fs, stripped = filesystem(path)
    try:
        schema = pq.read_schema(stripped, filesystem=fs)
    except Exception as e:
        raise UserError(f"{path} is not a readable Parquet table: {type(e).__name__}: {e}") from None
    try:
        check_schema(schema, expected, what=path)
    except SchemaMismatch as e:
        raise UserError(str(e)) from None


# Non-finite timings become NULL; float32 settings are shown as the user wrote them.
_CLEAN = {
    "completions": """SELECT * REPLACE (
        CASE WHEN isfinite(total_s) THEN total_s END AS total_s,
        CASE WHEN isfinite(ms_per_token) THEN ms_per_token END AS ms_per_token,
        CASE WHEN isfinite(cost_ratio) THEN cost_ratio END AS cost_ratio,
        round(temperature::DOUBLE, 6) AS temperature,
        round(top_p::DOUBLE, 6) AS top_p)""",
    "errors": """SELECT * REPLACE (
        round(temperature::DOUBLE, 6) AS temperature,
        round(top_p::DOUBLE, 6) AS top_p)""",
}


_KEY = ", ".join(ROW_KEY)
_MATCH = " AND ".join(f"c.{k} = e.{k}" for k in ROW_KEY)
_LIVE = {  # one row per key; errors superseded by a completion left out
    "completions": f"SELECT * FROM _completions_all QUALIFY row_number() OVER (PARTITION BY {_KEY} "
                   "ORDER BY run_id DESC) = 1",
    "errors": f"SELECT * FROM _errors_all e WHERE NOT EXISTS (SELECT 1 FROM _completions_all c "
              f"WHERE {_MATCH}) QUALIFY row_number() OVER (PARTITION BY {_KEY} ORDER BY run_id DESC) = 1",
}


def connect(tables: Tables):
    """A DuckDB connection with the views `completions` and `errors` over `tables`."""
    import duckdb

    con = duckdb.connect()
    for name, files, schema in (
        ("completions", tables.completions, COMPLETIONS),
        ("errors", tables.errors, ERRORS),
    ):
        source = _source(con, name, list(files), schema)
        con.execute(f"CREATE VIEW _{name}_all AS {_CLEAN[name]} FROM {source}")
    for name in ("completions", "errors"):
        con.execute(f"CREATE VIEW {name} AS {_LIVE[name]}")
    return con


def live(completions: list[dict], errors: list[dict]) -> tuple[list[dict], list[dict]]:
    """The rule of the views on plain rows (which must hold the `ROW_KEY` columns)."""
    def key(r):
        return tuple(r[k] for k in ROW_KEY)

    def latest(rows):
        best = {}
        for r in rows:
            if key(r) not in best or (r.get("run_id") or "") > (best[key(r)].get("run_id") or ""):
                best[key(r)] = r
        return list(best.values())

    done = latest(completions)
    finished = {key(r) for r in done}
    return done, latest([r for r in errors if key(r) not in finished])


def _source(con, name: str, files: list[str], schema) -> str:
    """A FROM clause reading `files`: local ones by DuckDB, remote ones via Arrow."""
    local = [f.removeprefix("file://") for f in files if not _is_remote(f)]
    remote = [f for f in files if _is_remote(f)]
    parts = []
    if local:
        listing = ", ".join("'" + f.replace("'", "''") + "'" for f in local)
        parts.append(f"SELECT * FROM read_parquet([{listing}], union_by_name = true)")
    if remote or not local:
        con.register(f"_{name}_arrow", _read_remote(remote, schema))
        parts.append(f"SELECT * FROM _{name}_arrow")
    return "(" + " UNION ALL BY NAME ".join(parts) + ")"


def _read_remote(files: list[str], schema):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = []
    for path in files:
        fs, stripped = filesystem(path)
        try:
            # Whole-file reads: tables are small, and fsspec's prefetcher leaves tasks behind.
            parts.append(pq.read_table(pa.BufferReader(fs.cat_file(stripped))))
        except Exception as e:
            raise UserError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts, promote_options="permissive")

