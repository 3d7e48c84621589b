"""Explicit pyarrow schemas for specsamp's tables, with a version and a doc per column.

Every table written by the pipeline carries `schema_version` both as a column and in the
Parquet schema metadata (key b"specsamp.schema_version"), so a reader can refuse or adapt
an older table with a clear message instead of failing on a missing column.

Versions:
  1: first release.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
_META_KEY = b"specsamp.schema_version"


def _f(name: str, typ: pa.DataType, doc: str, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable, metadata={b"doc": doc.encode()})


# A prompt table needs only these; other columns are carried into `extra` (JSON).
PROMPTS_REQUIRED = pa.schema(
    [
        _f("id", pa.string(), "Unique prompt id within the run (e.g. HumanEval/0)."),
        _f("prompt", pa.string(), "Prompt text, before any chat template."),
    ]
)

_RUN_FIELDS = [
    _f("dataset", pa.string(), "Dataset name (humaneval, xsum, or the input file's stem)."),
    _f("mode", pa.string(), "'speculative' or 'autoregressive' (the baseline)."),
    _f("target", pa.string(), "Target model identifier (path or 'smollm2' for the default)."),
    _f("draft", pa.string(), "Drafter: a path, 'ngram', 'early-exit:L', or 'none'."),
    _f("k", pa.int32(), "Draft tokens per loop (0 for autoregressive)."),
    _f("temperature", pa.float32(), "Sampling temperature (0 = greedy)."),
    _f("top_k", pa.int32(), "Top-k filter (0 = off)."),
    _f("top_p", pa.float32(), "Nucleus filter (1.0 = off)."),
    _f("seed", pa.int64(), "Per-sample seed; the sample is reproducible from it and the prompt."),
    _f("run_id", pa.string(), "Identifier of the pipeline run."),
    _f("config_hash", pa.string(), "sha256 (first 16 hex) of the resolved run config."),
    _f("worker_host", pa.string(), "Host name of the worker that produced the row."),
    _f("device_kind", pa.string(), "Accelerator kind the models ran on (e.g. cpu, TPU v5 lite)."),
    _f("schema_version", pa.int32(), "Version of this schema."),
]

COMPLETIONS = pa.schema(
    [
        _f("id", pa.string(), "Prompt id, copied from the prompt table."),
        _f("prompt", pa.string(), "Prompt text as given (before the chat template)."),
        _f("completion", pa.string(), "Generated text (stop string and EOS removed)."),
        _f("completion_token_ids", pa.list_(pa.int32()), "Generated token ids, EOS included if hit."),
        _f("prompt_tokens", pa.int32(), "Prompt length in tokens, after the chat template."),
        _f("generated_tokens", pa.int32(), "Number of generated tokens."),
        _f("stop_reason", pa.string(), "'eos', 'stop' (stop string or id) or 'max_tokens'."),
        *_RUN_FIELDS,
        _f("target_calls", pa.int32(), "Target model calls in decoding (loops)."),
        _f("draft_calls", pa.int32(), "Draft model calls in decoding (K per loop; 0 for n-gram; a hybrid: 1 in lookup loops)."),
        _f("accepted_per_loop", pa.list_(pa.int32()), "Accepted draft tokens in each loop (0..K)."),
        _f("acceptance_rate", pa.float64(), "Accepted draft tokens / drafted tokens (NaN for autoregressive)."),
        _f("tokens_per_call", pa.float64(), "Generated tokens / target calls."),
        _f("prefill_s", pa.float64(), "Seconds spent on the prompt (both models)."),
        _f("decode_s", pa.float64(), "Seconds spent generating (this sample's share of its batch)."),
        _f("total_s", pa.float64(), "prefill_s + decode_s."),
        _f("ms_per_token", pa.float64(), "decode_s * 1000 / generated_tokens."),
        _f("cost_ratio", pa.float64(), "Measured draft step time / target step time on this worker (NaN if none).", True),
        _f("extra", pa.string(), "Other prompt-table columns, as a JSON object.", True),
    ],
    metadata={_META_KEY: str(SCHEMA_VERSION).encode()},
)

ERRORS = pa.schema(
    [
        _f("id", pa.string(), "Prompt id (or '<unreadable FILE>' when a prompt file's ids cannot be read).", True),
        _f("prompt", pa.string(), "Prompt text if readable.", True),
        _f("error", pa.string(), "One-line reason: empty prompt, prompt too long, generation failure, ..."),
        _f("error_kind", pa.string(), "Short machine-readable kind: empty_prompt, too_long, bad_row, bad_utf8, unreadable_file, generation_failed (README: Output tables)."),
        *_RUN_FIELDS,
        _f("extra", pa.string(), "Other prompt-table columns, as a JSON object.", True),
    ],
    metadata={_META_KEY: str(SCHEMA_VERSION).encode()},
)


class SchemaMismatch(ValueError):
    """A table does not match the schema it should (message says how)."""


def check_schema(actual: pa.Schema, expected: pa.Schema, what: str = "table") -> None:
    """Raise SchemaMismatch unless `actual` has every column of `expected` with its type.

    A table from another schema version is refused with the version in the message.
    """
    meta = actual.metadata or {}
    version = meta.get(_META_KEY)
    if version is not None and int(version) != SCHEMA_VERSION:
        raise SchemaMismatch(
            f"{what} was written with schema version {int(version)}; this specsamp reads "
            f"version {SCHEMA_VERSION}. Re-run the pipeline or use a matching specsamp release."
        )
    problems = []
    for field in expected:
        idx = actual.get_field_index(field.name)
        if idx < 0:
            problems.append(f"missing column '{field.name}'")
        elif not actual.field(idx).type.equals(field.type):
            problems.append(
                f"column '{field.name}' is {actual.field(idx).type}, expected {field.type}"
            )
    if problems:
        raise SchemaMismatch(f"{what} does not match the schema: " + "; ".join(problems))


def check_file(path: str, expected: pa.Schema, filesystem=None) -> None:
    """Check the Parquet file at `path` (local or gs://) against `expected`."""
    import pyarrow.parquet as pq

    check_schema(pq.read_schema(path, filesystem=filesystem), expected, what=path)


def describe(schema: pa.Schema) -> str:
    """Column-by-column documentation, as printed by `specsamp schema`."""
    lines = []
    for field in schema:
        doc = (field.metadata or {}).get(b"doc", b"").decode()
        lines.append(f"{field.name:24s} {str(field.type):14s} {doc}")
    return "\n".join(lines)
