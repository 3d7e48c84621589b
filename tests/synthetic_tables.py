"""Completion and error tables written with the real schemas, for report and eval tests."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas import COMPLETIONS, ERRORS, SCHEMA_VERSION

RUN = dict(dataset="humaneval", target="smollm2", top_k=0, top_p=1.0, run_id="r1",
           config_hash="abc", worker_host="h", device_kind="cpu", schema_version=SCHEMA_VERSION)


def completion_row(i: int, *, mode="speculative", k=4, temperature=0.0, decode_s=1.0,
                   prefill_s=0.1, accepted=(4, 2), tokens=None, cost_ratio=0.1,
                   completion="", extra=None, id=None, dataset="humaneval", drafted=None,
                   tree="off") -> dict:
    """One row; loops and token counts follow the engine's rules (tokens = sum(accepted) + loops).
    `drafted`: each loop's K where it varies (`k: auto`, k = -1), or a tree's node count;
    else k every loop."""
    accepted = list(accepted) if mode == "speculative" else []
    drafted = list(drafted) if drafted is not None else [k] * len(accepted)
    if tokens is None:
        tokens = sum(accepted) + len(accepted) if accepted else 10
    loops = len(accepted) if accepted else tokens
    return {
        **RUN, "dataset": dataset,
        "id": id or f"p{i}", "prompt": "x", "completion": completion,
        "completion_token_ids": list(range(tokens)), "prompt_tokens": 5,
        "generated_tokens": tokens, "stop_reason": "max_tokens",
        "mode": mode, "draft": "d" if mode == "speculative" else "none",
        "k": k if mode == "speculative" else 0, "tree": tree if mode == "speculative" else "off",
        "temperature": temperature, "seed": i, "target_calls": loops, "draft_calls": sum(drafted) if mode == "speculative" else 0,
        "accepted_per_loop": accepted, "drafted_per_loop": drafted,
        "acceptance_rate": sum(accepted) / sum(drafted) if accepted else float("nan"),
        "tokens_per_call": tokens / loops if loops else float("nan"), "prefill_s": prefill_s, "decode_s": decode_s,
        "total_s": prefill_s + decode_s,
        "ms_per_token": 1000.0 * decode_s / tokens if tokens else float("nan"), "compile_s": 0.0,
        "cost_ratio": cost_ratio if mode == "speculative" else float("nan"),
        "extra": json.dumps(extra or {}),
    }


def error_row(i: int, *, mode="speculative", k=4, temperature=0.0, kind="too_long") -> dict:
    return {**RUN, "id": f"e{i}", "prompt": "x", "error": f"{kind} happened", "error_kind": kind,
            "mode": mode, "draft": "d" if mode == "speculative" else "none",
            "k": k if mode == "speculative" else 0, "tree": "off", "temperature": temperature, "seed": i,
            "extra": None}


def write(path, rows: list[dict], schema=COMPLETIONS) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    return str(path)


def write_errors(path, rows: list[dict]) -> str:
    return write(path, rows, ERRORS)


def random_rows(rng: np.random.Generator, n: int, **kw) -> list[dict]:
    """n rows with random decode times and acceptance, for distribution checks."""
    k = kw.get("k", 4)
    rows = []
    for i in range(n):
        accepted = rng.integers(0, k + 1, size=rng.integers(1, 6)).tolist()
        rows.append(completion_row(i, decode_s=float(rng.uniform(0.2, 3.0)),
                                   prefill_s=float(rng.uniform(0.01, 0.2)), accepted=accepted, **kw))
    return rows
