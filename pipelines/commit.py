"""Incremental, atomic output: finished rows are committed in small Parquet shards as each
batch completes, so a run killed at any moment keeps every committed row.

A shard's name is a hash of the (id, setting) keys it holds and of the run config: a bundle
that a runner retries, or a batch redone after a crash, writes the same name again and so
replaces its earlier copy instead of adding a second one. A shard appears whole or not at
all: local files are written under a hidden temporary name (`.TABLE-*.tmp-*`) and renamed
into place; a gs:// object is uploaded in one request, which GCS makes visible only once
complete. A write that fails (full disk, no permission) stops the job with one line; what
was committed before stays, and a re-run does the rest.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import uuid

import apache_beam as beam

from schemas import COMPLETIONS, ERRORS
from specsamp.errors import UserError
from specsamp.fs import filesystem, join

TEMP_MARK = ".tmp-"


def row_key(row: dict) -> tuple[str, str, int, str]:
    """The exactly-once key of an output row: (prompt id, drafter, K, tree)."""
    return (row["id"], row["draft"], int(row["k"]), row["tree"])


def shard_name(table: str, config_hash: str, keys) -> str:
    """`TABLE-<hash of config and keys>.parquet`: the same rows always get the same name."""
    digest = hashlib.sha256(config_hash.encode())
    for pid, draft, k, tree in sorted(keys, key=lambda t: (str(t[0]), *t[1:])):
        digest.update(f"\x1e{pid}\x1f{draft}\x1f{k}\x1f{tree}".encode())
    return f"{table}-{digest.hexdigest()[:24]}.parquet"


def write_shard(folder: str, table: str, rows: list[dict], schema) -> str:
    """Commit `rows` as one shard of `table` in `folder`; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = join(folder, shard_name(table, rows[0]["config_hash"], map(row_key, rows)))
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf, compression="snappy",
                   use_compliant_nested_type=True)
    try:
        _put(path, buf.getvalue())
    except UserError:
        raise
    except Exception as e:  # full disk, read-only folder, lost bucket: one line, rows kept
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise UserError(f"cannot write {path} ({reason}); the rows committed before are kept: "
                        "fix the output and run the same command again to resume") from None
    return path


def _put(path: str, data: bytes) -> None:
    if "://" in path and not path.startswith("file://"):
        fs, stripped = filesystem(path)
        fs.pipe_file(stripped, data)  # one upload: the object is visible whole or not at all
        return
    path = path.removeprefix("file://")
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}{TEMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the rename must not land before the bytes
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_stale_temps(folder: str) -> int:
    """Delete temporary files left by a writer that was killed mid-write (local only)."""
    if "://" in folder and not folder.startswith("file://"):
        return 0
    folder = folder.removeprefix("file://")
    if not os.path.isdir(folder):
        return 0
    stale = [n for n in os.listdir(folder) if n.startswith(".") and TEMP_MARK in n]
    for name in stale:
        try:
            os.remove(os.path.join(folder, name))
        except OSError:
            pass
    return len(stale)


class CommitBatch(beam.DoFn):
    """One batch's rows in (a RunInference result: (completion rows, error rows)), its
    shards committed at once, in `process`: nothing waits for the bundle's end, which some
    runners do not run to completion (Beam on Dask drops what `finish_bundle` emits) and
    which a killed worker never reaches. Out: a small report of what was committed."""

    def __init__(self, folder: str):
        self._folder = folder

    def process(self, result):
        completions, errors = result.inference
        for table, schema, rows in (("completions", COMPLETIONS, completions), ("errors", ERRORS, errors)):
            if rows:
                write_shard(self._folder, table, rows, schema)
                beam.metrics.Metrics.counter("specsamp", f"committed_{table}").inc(len(rows))
        yield report(completions, errors)


def report(completions: list[dict], errors: list[dict]) -> dict:
    """What a committed batch tells the launcher: its keys, tokens and where it ran."""
    return {"completions": [row_key(r) for r in completions],
            "errors": [(*row_key(r), r["error_kind"]) for r in errors],
            "tokens": sum(r["generated_tokens"] for r in completions),
            "worker": f"{socket.gethostname()}:{os.getpid()}"}
