"""Everything checked and decided before a job starts, on the launching machine.

A missing or corrupt input file, a missing column, a wrong column type, repeated ids, an
unreachable bucket or an output folder holding another config's rows: each is one
`UserError` here, before any worker starts or model loads. The plan also fixes the run id,
the prompts within `limit`, and (for resuming) the samples already in the output.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import pyarrow as pa

from pipelines.rows import RunInfo
from schemas import COMPLETIONS, ERRORS, SchemaMismatch, check_schema
from specsamp import prompts, storage
from specsamp.errors import UserError
from specsamp.runconfig import RunConfig, Setting

_ID_TYPES = (pa.string(), pa.large_string())
_PROMPT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())
TABLES = ("completions", "errors")


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: RunConfig
    files: tuple[str, ...]
    info: RunInfo
    allowed: frozenset | None  # prompt ids within `limit`; None means all
    done: frozenset  # (id, setting key) pairs already in the output
    n_prompts: int  # prompts in scope
    todo: int  # samples still to generate (prompts x settings, less those done)

    @property
    def pattern(self) -> str:
        """What ReadFromParquet reads: the input as given (a file or a glob)."""
        return self.cfg.input

    def wanted(self, pid, setting: Setting) -> bool:
        """Whether the (prompt, setting) pair is in scope and not yet written."""
        in_scope = self.allowed is None or pid in self.allowed
        return in_scope and (pid, setting.key) not in self.done

    def prefix(self, table: str) -> str:
        """Output files are TABLE-RUNID-SHARD-of-N.parquet: a resumed run never overwrites."""
        return storage.join(self.cfg.output, f"{table}-{self.info.run_id}")


def make_plan(cfg: RunConfig, dry_run: bool = False) -> Plan:
    """Check inputs and output and decide what to do. A dry run (build the job graph, do
    not submit) touches no storage: it must work offline, without credentials."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    if dry_run:
        info = RunInfo.of(cfg, run_id, prompts.dataset_name(cfg.input))
        return Plan(cfg, (), info, None, frozenset(), 0, 0)
    files = storage.glob(cfg.input)
    if not files:
        raise UserError(f"no input files match {cfg.input}")
    ids = _check_inputs(files)
    in_scope = ids if cfg.limit is None else ids[: cfg.limit]
    done = _scan_output(cfg)
    todo = sum((pid, s.key) not in done for pid in in_scope for s in cfg.settings)
    info = RunInfo.of(cfg, run_id, prompts.dataset_name(files[0]))
    allowed = None if cfg.limit is None else frozenset(in_scope)
    return Plan(cfg, tuple(files), info, allowed, done, len(in_scope), todo)


def resolve_input(cfg: RunConfig, prepare: bool = True) -> RunConfig:
    """`input: builtin:NAME` -> prompt shards under OUTPUT/prompts/, written on first use
    (unless `prepare` is False, as in a dry run)."""
    name = cfg.builtin_input
    if name is None:
        return cfg
    folder = storage.join(cfg.output, "prompts")
    pattern = storage.join(folder, f"{name}-*.parquet")
    if prepare and not storage.glob(pattern):
        table = prompts.humaneval() if name == "humaneval" else prompts.xsum()
        prompts.write_shards(table, folder, shard_size=1000, prefix=name)
    return cfg.with_overrides(input=pattern)


def _check_inputs(files: list[str]) -> list[str]:
    """Check each file's schema, then read all ids (in file order) and check them."""
    import pyarrow.parquet as pq

    ids = []
    for path in files:
        fs, stripped = storage.filesystem(path)
        try:
            schema = pq.read_schema(stripped, filesystem=fs)
            _check_prompt_schema(schema, path)
            ids += pq.read_table(stripped, columns=["id"], filesystem=fs).column("id").to_pylist()
        except UserError:
            raise
        except Exception as e:  # truncated file, not Parquet, permission, network
            raise UserError(f"cannot read prompt file {path}: {type(e).__name__}: {e}") from None
    prompts.check_ids(ids, where=f"input {files[0] if len(files) == 1 else ' + '.join(files[:2])}")
    return ids


def _check_prompt_schema(schema: pa.Schema, path: str) -> None:
    for name, types in (("id", _ID_TYPES), ("prompt", _PROMPT_TYPES)):
        idx = schema.get_field_index(name)
        if idx < 0:
            raise UserError(f"{path} has no '{name}' column (it has {schema.names}); "
                            "a prompt table needs string columns id and prompt "
                            "(specsamp prepare file can make one)")
        if schema.field(idx).type not in types:
            raise UserError(f"{path}: column '{name}' is {schema.field(idx).type}, expected a string")


def _scan_output(cfg: RunConfig) -> frozenset:
    """(id, setting key) pairs already written, after checking they come from this config."""
    import pyarrow.parquet as pq

    storage.ensure_dir(cfg.output)
    done, want = set(), cfg.config_hash()
    for table, schema in zip(TABLES, (COMPLETIONS, ERRORS)):
        for path in storage.glob(storage.join(cfg.output, f"{table}-*.parquet")):
            fs, stripped = storage.filesystem(path)
            try:
                check_schema(pq.read_schema(stripped, filesystem=fs), schema, what=path)
                got = pq.read_table(stripped, columns=["id", "draft", "k", "config_hash"], filesystem=fs)
            except SchemaMismatch as e:
                raise UserError(str(e)) from None
            except Exception as e:
                raise UserError(f"cannot read existing output {path}: {type(e).__name__}: {e}") from None
            hashes = set(got.column("config_hash").to_pylist())
            if hashes - {want}:
                raise UserError(f"{cfg.output} holds rows of another config (hash {sorted(hashes - {want})[0]}, "
                                f"this one is {want}); choose another --output")
            d = got.to_pydict()
            done.update((i, Setting(dr, k).key) for i, dr, k in zip(d["id"], d["draft"], d["k"]))
    return frozenset(done)

