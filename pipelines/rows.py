"""Plain functions between prompt rows, work items and output rows (no Beam, no JAX).

An input row becomes one `Example` per generation setting, or one error row per setting
when the row itself is unusable; the handler turns each Example into one completion row
or one error row. So with S settings, N input rows end in exactly N*S output rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket

from pipelines.read import PromptRow
from schemas import SCHEMA_VERSION
from specsamp.runconfig import RunConfig, Setting

CORE_COLUMNS = ("id", "prompt", "dataset")


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What every output row of a run repeats (the `_RUN_FIELDS` of schemas/tables.py)."""

    run_id: str
    config_hash: str
    target: str
    temperature: float
    top_k: int
    top_p: float
    default_dataset: str

    @classmethod
    def of(cls, cfg: RunConfig, run_id: str, default_dataset: str) -> "RunInfo":
        s = cfg.sampling
        return cls(run_id, cfg.config_hash(), cfg.target_name, s.temperature, s.top_k,
                   s.top_p, cfg.dataset or default_dataset)


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt under one setting: the unit of work and of resuming."""

    id: str
    prompt: str
    draft: str
    k: int
    seed: int
    dataset: str
    extra: str | None
    tree: str = "off"

    @property
    def setting(self) -> Setting:
        return Setting(self.draft, self.k, self.tree)

    @property
    def key(self) -> str:
        return self.setting.key


@dataclasses.dataclass(frozen=True)
class Work:
    """A planned batch, read and expanded: the Examples to generate and the error rows of
    its unusable input rows (one per setting). One element of the pipeline, so that each
    runner carries it the same way (no tagged outputs, no grouping)."""

    examples: tuple[Example, ...]
    errors: tuple[dict, ...]

    def __len__(self) -> int:  # Beam's RunInference counts the elements of a "batch"
        return len(self.examples) + len(self.errors)


def expand_batch(items, cfg: RunConfig, info: RunInfo, todo) -> Work:
    """PromptRows of one batch -> the batch's Work (see `expand`)."""
    examples, errors = [], []
    for item in items:
        for tag, value in expand(item, cfg, info, todo):
            (examples if tag == "example" else errors).append(value)
    return Work(tuple(examples), tuple(errors))


def sample_seed(config_seed: int, prompt_id: str) -> int:
    """The engine's per-sample seed (config seed + prompt id), the same one `specsamp
    generate` uses, so a sample is the same whichever worker or batch runs it."""
    from specsamp import seed_for

    return seed_for(config_seed, prompt_id)


def expand(item: PromptRow, cfg: RunConfig, info: RunInfo, todo) -> list[tuple[str, object]]:
    """An input row -> [("example", Example) | ("error", error row)], one per setting to do.

    `todo(id, setting)` says whether that pair still needs doing (limit and resume).
    """
    row = item.row
    pid = row.get("id")
    settings = [s for s in cfg.settings if todo(pid, s)]
    if not settings:
        return []
    extra = _extra(row)
    dataset = row.get("dataset") or info.default_dataset
    prompt, problem = _prompt_text(row.get("prompt"))
    problem = item.problem or problem
    out = []
    for s in settings:
        if problem:
            kind, msg = problem
            out.append(("error", error_row(info, pid, prompt, kind, msg, s, dataset,
                                           sample_seed(cfg.seed, pid), extra)))
        else:
            out.append(("example", Example(pid, prompt, s.draft, s.k, sample_seed(cfg.seed, pid),
                                           dataset, extra, s.tree)))
    return out


def completion_row(info: RunInfo, ex: Example, c, device_kind: str, cost_ratio: float) -> dict:
    """The completions-table row for Example `ex` and its `Completion` `c`."""
    stats = c.stats()
    row = {
        "id": ex.id, "prompt": ex.prompt, "completion": c.text,
        "completion_token_ids": [int(t) for t in c.token_ids],
        **{k: stats[k] for k in ("prompt_tokens", "generated_tokens", "stop_reason", "target_calls",
                                 "draft_calls", "accepted_per_loop", "drafted_per_loop",
                                 "acceptance_rate",
                                 "tokens_per_call", "prefill_s", "decode_s", "total_s",
                                 "ms_per_token", "compile_s")},
        **_run_fields(info, ex.setting, ex.dataset, ex.seed, device_kind),
        "cost_ratio": None if cost_ratio is None or math.isnan(cost_ratio) else float(cost_ratio),
        "extra": ex.extra,
    }
    row["mode"] = stats["mode"]  # what the engine actually ran
    return row


def error_row(info: RunInfo, pid, prompt, kind: str, message: str, setting: Setting,
              dataset: str, seed: int, extra: str | None, device_kind: str = "") -> dict:
    return {
        "id": pid, "prompt": prompt, "error": " ".join(str(message).split())[:2000],
        "error_kind": kind,
        **_run_fields(info, setting, dataset, seed, device_kind),
        "extra": extra,
    }


def example_error(info: RunInfo, ex: Example, kind: str, message: str, device_kind: str = "") -> dict:
    return error_row(info, ex.id, ex.prompt, kind, message, ex.setting,
                     ex.dataset, ex.seed, ex.extra, device_kind)


def _run_fields(info: RunInfo, setting: Setting, dataset: str, seed: int, device_kind: str) -> dict:
    return {
        "dataset": dataset, "mode": setting.mode, "target": info.target,
        "draft": setting.draft, "k": setting.k, "tree": setting.tree,
        "temperature": info.temperature, "top_k": info.top_k,
        "top_p": info.top_p, "seed": seed, "run_id": info.run_id,
        "config_hash": info.config_hash, "worker_host": socket.gethostname(),
        "device_kind": device_kind, "schema_version": SCHEMA_VERSION,
    }


def _prompt_text(value) -> tuple[str | None, tuple[str, str] | None]:
    """(text, None) or (text-if-any, (error_kind, message)) for a prompt cell."""
    if value is None:
        return None, ("bad_row", "prompt is null")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            return None, ("bad_utf8", f"prompt is not valid UTF-8 ({e})")
    if not isinstance(value, str):
        return None, ("bad_row", f"prompt is a {type(value).__name__}, not text")
    if not value.strip():
        return value, ("empty_prompt", "prompt is empty")
    return value, None


def _extra(row: dict) -> str | None:
    """The carried-along columns as JSON (non-JSON values such as dates as strings)."""
    rest = {k: v for k, v in row.items() if k not in CORE_COLUMNS}
    if not rest:
        return None
    return json.dumps(rest, default=_jsonable, ensure_ascii=False)


def _jsonable(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)
