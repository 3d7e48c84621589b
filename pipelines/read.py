"""Reading prompt shards on the workers, one file at a time, so that bad input costs only
its own rows.

Text columns are read as bytes and decoded here, row by row: a prompt that is not valid
UTF-8 becomes a `bad_utf8` error row naming its file and row, not a crash of the whole
read. A file that cannot be read at all becomes `unreadable_file` error rows: one per id
when the id column can still be read, else one row whose id names the file
(`placeholder_id`). Either way the other files run.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from specsamp.fs import filesystem

_TEXT = (pa.string(), pa.large_string())


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One input row, with where it came from and, for an unusable one, why."""

    where: str  # "FILE row N" (0-based), or the file alone
    row: dict
    problem: tuple[str, str] | None = None  # (error kind, message)


def placeholder_id(path: str) -> str:
    """The id given to the rows of a file whose ids cannot be read."""
    return f"<unreadable {path}>"


def read_prompt_file(path: str, rows: tuple[int, ...] | None = None):
    """PromptRows of one Parquet prompt file (local or gs://): all of them, or the rows
    at 0-based positions `rows` (a batch of the plan), in that order."""
    try:
        table = _cached_read(path)
        wanted = range(table.num_rows) if rows is None else rows
        picked = table.take(list(wanted)).to_pylist()
    except Exception as e:
        yield from (r for i, r in enumerate(_unreadable(path, e)) if rows is None or i in rows)
        return
    for i, row in zip(wanted, picked):
        yield _decoded(row, f"{path} row {i}")


_LAST: dict = {}  # (path, version) -> table: a file's batches often follow each other on a worker


def _cached_read(path: str) -> pa.Table:
    """The file's table, read once for consecutive batches of it in this process (a
    long-lived worker serves many jobs: the key holds the file's size and change time)."""
    fs, stripped = filesystem(path)
    info = fs.info(stripped)
    key = (path, *(str(info.get(k)) for k in ("size", "mtime", "generation", "updated", "etag")))
    if key not in _LAST:
        _LAST.clear()  # one file at a time: prompt shards are small, memory stays flat
        _LAST[key] = _read(path)
    return _LAST[key]


def _read(path: str, columns=None) -> pa.Table:
    import pyarrow.parquet as pq

    fs, stripped = filesystem(path)
    if "://" in path and not path.startswith("file://"):
        # Whole-file reads: prompt shards are small, and fsspec's prefetcher leaves tasks behind.
        table = pq.read_table(pa.BufferReader(fs.cat_file(stripped)), columns=columns)
    else:
        table = pq.read_table(stripped, filesystem=fs, columns=columns)
    # Bytes, not str: pyarrow does not check UTF-8 on read, Python does on conversion.
    for i, field in enumerate(table.schema):
        if field.type in _TEXT:
            table = table.set_column(i, field.name, table.column(i).cast(pa.binary()))
    return table


def _decoded(row: dict, where: str) -> PromptRow:
    out, problem = {}, None
    for name, value in row.items():
        if isinstance(value, bytes):
            value, bad = _text(value)
            if bad and name in ("id", "prompt") and problem is None:
                problem = ("bad_utf8", f"{name} in {where} is not valid UTF-8 ({bad})")
        out[name] = value
    return PromptRow(where, out, problem)


def _text(value: bytes) -> tuple[str, str | None]:
    """(text, None), or (text with U+FFFD for the bad bytes, what was wrong)."""
    try:
        return value.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return value.decode("utf-8", errors="replace"), f"{e.reason} at byte {e.start}"


def read_ids(path: str) -> list[str]:
    """The id column of a prompt file, decoded as the workers decode it."""
    return [_text(i)[0] if isinstance(i, bytes) else i
            for i in _read(path, columns=["id"]).column("id").to_pylist()]


def _unreadable(path: str, error: Exception):
    reason = " ".join(f"cannot read prompt file {path}: {type(error).__name__}: {error}".split())[:500]
    try:
        ids = read_ids(path)
    except Exception:
        ids = [placeholder_id(path)]
    for i, pid in enumerate(ids):
        yield PromptRow(f"{path} row {i}", {"id": pid, "prompt": None}, ("unreadable_file", reason))
