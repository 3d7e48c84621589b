"""Everything checked and decided before a job starts, on the launching machine.

A missing or corrupt input file, a missing column, a wrong column type, repeated ids, an
unreachable bucket or an output folder holding another config's rows: each is one
`UserError` here, before any worker starts or model loads. The plan also fixes the run id,
the prompts within `limit`, and (for resuming) the samples already in the output.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

import pyarrow as pa

from pipelines.commit import remove_stale_temps
from pipelines.read import placeholder_id, read_ids
from pipelines.rows import RunInfo
from schemas import COMPLETIONS, ERRORS, SchemaMismatch, check_schema
from specsamp import prompts
from specsamp.errors import UserError
from specsamp.fs import ensure_dir, filesystem, glob, join
from specsamp.runconfig import RunConfig, Setting

_ID_TYPES = (pa.string(), pa.large_string())
_PROMPT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())
TABLES = ("completions", "errors")
# A batch holds up to BATCH_REFILLS x batch_size prompts: the continuous engine refills its
# batch_size slots from them as rows finish. Smaller when a job is small, so that each
# worker gets about BATCHES_PER_WORKER of them (the last ones even out the workers' loads).
BATCH_REFILLS = 4
BATCHES_PER_WORKER = 4


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: RunConfig
    files: tuple[str, ...]
    info: RunInfo
    allowed: frozenset | None  # prompt ids within `limit`; None means all
    done: frozenset  # (id, setting key) pairs already in the output
    n_prompts: int  # prompts in scope
    todo: int  # samples still to generate (prompts x settings, less those done)
    retried: int = 0  # error rows to attempt again (--retry-errors)
    unreadable: tuple[str, ...] = ()  # input files whose ids cannot be read (error rows)
    rows: tuple[tuple[str, tuple[int, ...]], ...] = ()  # per file: positions of rows with work left

    def wanted(self, pid, setting: Setting) -> bool:
        """Whether the (prompt, setting) pair is in scope and not yet written."""
        in_scope = self.allowed is None or pid in self.allowed
        return in_scope and (pid, setting.key) not in self.done

    def batches(self, parallelism: int = 1) -> list[Batch]:
        """The job's units of work: rows of one file, each batch a few generate calls'
        worth. A batch is what a runner retries or a cluster reruns after losing a worker,
        so its rows are fixed here (its shards then get the same names when redone); there
        are enough of them to keep `parallelism` workers busy to the end of the job."""
        prompts = sum(len(r) for _, r in self.rows)
        size = max(1, min(BATCH_REFILLS * self.cfg.batch_size,
                          math.ceil(prompts / (BATCHES_PER_WORKER * max(1, parallelism)))))
        return [Batch(path, rows[i:i + size]) for path, rows in self.rows for i in range(0, len(rows), size)]


@dataclasses.dataclass(frozen=True)
class Batch:
    """Rows of one prompt file (0-based positions) that go through the model together."""

    path: str
    rows: tuple[int, ...]


def make_plan(cfg: RunConfig, dry_run: bool = False, retry: frozenset | None = None) -> Plan:
    """Check inputs and output and decide what to do. A dry run (build the job graph, do
    not submit) touches no storage: it must work offline, without credentials.

    `retry`: error kinds to attempt again (empty: every kind; None: none).
    """
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    if dry_run:
        info = RunInfo.of(cfg, run_id, prompts.dataset_name(cfg.input))
        return Plan(cfg, (cfg.input,), info, None, frozenset(), 0, 0, rows=((cfg.input, (0,)),))
    files = glob(cfg.input)
    if not files:
        raise UserError(f"no input files match {cfg.input}")
    per_file, unreadable = _check_inputs(files)
    ids = [pid for file_ids in per_file for pid in file_ids]
    in_scope = ids if cfg.limit is None else ids[: cfg.limit]
    done, retried = _scan_output(cfg, retry)
    check_context(cfg)  # after the output check: it may download the default model
    todo = sum((pid, s.key) not in done for pid in in_scope for s in cfg.settings)
    info = RunInfo.of(cfg, run_id, prompts.dataset_name(files[0]))
    allowed = None if cfg.limit is None else frozenset(in_scope)
    scope = set(in_scope)
    plan = Plan(cfg, tuple(files), info, allowed, done, len(in_scope), todo,
                sum(1 for key in retried if key[0] in scope), tuple(unreadable))
    rows, seen = [], 0
    for path, file_ids in zip(files, per_file):
        mine = [i for i, pid in enumerate(file_ids) if seen + i < len(in_scope)
                and any(plan.wanted(pid, s) for s in cfg.settings)]
        seen += len(file_ids)
        if mine:
            rows.append((path, tuple(mine)))
    return dataclasses.replace(plan, rows=tuple(rows))


def resolve_input(cfg: RunConfig, prepare: bool = True) -> RunConfig:
    """`input: builtin:NAME` -> prompt shards under OUTPUT/prompts/, written on first use
    (unless `prepare` is False, as in a dry run)."""
    name = cfg.builtin_input
    if name is None:
        return cfg
    folder = join(cfg.output, "prompts")
    pattern = join(folder, f"{name}-*.parquet")
    if prepare and not glob(pattern):
        table = prompts.humaneval() if name == "humaneval" else prompts.xsum()
        prompts.write_shards(table, folder, shard_size=1000, prefix=name)
    return cfg.with_overrides(input=pattern)


def _check_inputs(files: list[str]) -> tuple[list[list[str]], list[str]]:
    """Check each file's schema, then read all ids (per file, in file order) and check them.

    A file that cannot be read is not fatal while others can: its rows become error rows
    (`unreadable_file`) and it counts as one row with a placeholder id.
    """
    import pyarrow.parquet as pq

    per_file, unreadable, reasons = [], [], []
    for path in files:
        fs, stripped = filesystem(path)
        try:
            _check_prompt_schema(pq.read_schema(stripped, filesystem=fs), path)
            per_file.append(read_ids(path))
        except UserError:
            raise
        except Exception as e:  # truncated file, not Parquet, permission, network
            reasons.append(f"cannot read prompt file {path}: {type(e).__name__}: {e}")
            unreadable.append(path)
            per_file.append([placeholder_id(path)])
    if len(unreadable) == len(files):
        raise UserError(reasons[0])
    prompts.check_ids([pid for ids in per_file for pid in ids],
                      where=f"input {files[0] if len(files) == 1 else ' + '.join(files[:2])}")
    return per_file, unreadable


def _check_prompt_schema(schema: pa.Schema, path: str) -> None:
    for name, types in (("id", _ID_TYPES), ("prompt", _PROMPT_TYPES)):
        idx = schema.get_field_index(name)
        if idx < 0:
            raise UserError(f"{path} has no '{name}' column (it has {schema.names}); "
                            "a prompt table needs string columns id and prompt "
                            "(specsamp prepare file can make one)")
        if schema.field(idx).type not in types:
            raise UserError(f"{path}: column '{name}' is {schema.field(idx).type}, expected a string")


def _scan_output(cfg: RunConfig, retry: frozenset | None) -> tuple[frozenset, frozenset]:
    """((id, setting key) pairs already written, those of them to retry), after checking
    that the rows come from this config. An error row whose kind is in `retry` (all kinds
    when `retry` is empty) is not done, unless a completion already supersedes it."""
    import pyarrow.parquet as pq

    ensure_dir(cfg.output)
    remove_stale_temps(cfg.output)
    found, want = {}, cfg.config_hash()
    for table, schema in zip(TABLES, (COMPLETIONS, ERRORS)):
        columns = ["id", "draft", "k", "tree", "config_hash"] + (["error_kind"] if table == "errors" else [])
        for path in glob(join(cfg.output, f"{table}-*.parquet")):
            fs, stripped = filesystem(path)
            try:
                check_schema(pq.read_schema(stripped, filesystem=fs), schema, what=path)
                got = pq.read_table(stripped, columns=columns, filesystem=fs)
            except SchemaMismatch as e:
                raise UserError(str(e)) from None
            except Exception as e:
                raise UserError(f"cannot read existing output {path}: {type(e).__name__}: {e}") from None
            hashes = set(got.column("config_hash").to_pylist())
            if hashes - {want}:
                raise UserError(f"{cfg.output} holds rows of another config (hash {sorted(hashes - {want})[0]}, "
                                f"this one is {want}); choose another --output")
            d = got.to_pydict()
            kinds = d.get("error_kind") or [None] * len(d["id"])
            for i, dr, k, tree, kind in zip(d["id"], d["draft"], d["k"], d["tree"], kinds):
                key = (i, Setting(dr, k, tree).key)
                if kind is None or found.get(key, "") is not None:  # a completion wins
                    found[key] = kind
    retried = {key for key, kind in found.items()
               if kind is not None and retry is not None and (not retry or kind in retry)}
    return frozenset(set(found) - retried), frozenset(retried)


def check_context(cfg: RunConfig) -> None:
    """max_new_tokens (plus a draft round and a one-token prompt) must fit the target's
    context; checked before any work, or every row would fail as too long. A tree's round
    scores all its nodes."""
    from pipelines.context import context_length

    n = context_length(cfg.target_name)
    if n is None:
        return
    widest = max(cfg.settings, key=lambda s: max(s.span, 1))
    k = max(widest.span, 1)
    room = n - k - 3
    if cfg.max_new_tokens > room:
        what = f"K={k}" if widest.tree == "off" else f"tree {widest.tree} of {k} nodes"
        raise UserError(f"max_new_tokens {cfg.max_new_tokens} does not fit the target's context of "
                        f"{n} tokens (at most {room} with {what}, leaving room for a prompt)")
