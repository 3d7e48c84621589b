"""Explicit pyarrow schemas for specsamp's tables, with a version and a doc per column.

Every table written by the pipeline carries `schema_version` both as a column and in the
Parquet schema metadata (key b"specsamp.schema_version"), so a reader can refuse or adapt
an older table with a clear message instead of failing on a missing column.

Versions:
  1: first release.
  2: completions gain `compile_s`; statistics describe exactly the emitted tokens (cut at
     a stop string; a round cut by EOS or the token limit counts only its emitted tokens).
  3: completions gain `drafted_per_loop` (each loop's own K).
  4: completions and errors gain `tree` (a setting's token tree, part of the row key with
     id, draft and k); a tree round's loop counts are its nodes scored and accepted depth.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 4
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
    _f("k", pa.int32(), "Draft tokens per loop, the setting's K (0 for autoregressive; -1 for `k: auto`, the batch-aware policy, which picks K each round: drafted_per_loop holds what it picked; -1 too for `tree: auto`)."),
    _f("tree", pa.string(), "The setting's token tree: 'off' (chains of k drafts; the baseline too) or its widths per depth, e.g. '2x1' (k is then its depth), or 'auto' (k -1: the batch-aware policy picks plain rounds, a chain's K or a small tree per chunk; drafted_per_loop holds each loop's K or node count). With id, draft and k the row's key: a tree and a chain of one drafter are different settings."),
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
        _f("generated_tokens", pa.int32(), "Number of generated tokens (completion_token_ids); every statistic below describes exactly these."),
        _f("stop_reason", pa.string(), "'eos', 'stop' (stop string or id) or 'max_tokens'."),
        *_RUN_FIELDS,
        _f("target_calls", pa.int32(), "Target model calls (rounds) that produced the generated tokens: speculative loops plus plain steps (an n-gram round without a match; every round of the baseline)."),
        _f("draft_calls", pa.int32(), "Draft model calls in those rounds (K per loop of a draft model; 0 for n-gram; a hybrid: 1 in lookup loops)."),
        _f("accepted_per_loop", pa.list_(pa.int32()), "Per speculative loop (a call that scored a draft): draft tokens kept by the rejection rule and emitted, 0..K; for a tree, the accepted depth (tokens of the accepted path, 0..its depth). A loop ended early by EOS, a stop or the token limit counts only the draft tokens it emitted."),
        _f("drafted_per_loop", pa.list_(pa.int32()), "Per speculative loop: draft tokens it scored, its K (the setting's k, or the K that k auto chose for that round); for a tree, its node count (every node is scored; 4 for 2x1). Same length as accepted_per_loop."),
        _f("acceptance_rate", pa.float64(), "sum(accepted_per_loop) / sum(drafted_per_loop) (NaN for autoregressive; for a tree, the share of scored nodes kept)."),
        _f("tokens_per_call", pa.float64(), "Generated tokens / target calls."),
        _f("prefill_s", pa.float64(), "Seconds of the batch's prompt pass (both models), compilation excluded."),
        _f("decode_s", pa.float64(), "Seconds of decoding until this sample's last emitted token, compilation excluded: the batch's decode time x target_calls / the rounds the batch ran (rounds of a batch take equal time); at batch size 1, the measured time less any rounds run past a stop string."),
        _f("total_s", pa.float64(), "prefill_s + decode_s."),
        _f("ms_per_token", pa.float64(), "decode_s * 1000 / generated_tokens."),
        _f("compile_s", pa.float64(), "Seconds compiling programs for shapes this worker met first with this sample's batch (cached compiles load faster); on the batch's first row, 0 on the others, so the column sums to the workers' compile time. Not part of prefill_s, decode_s or total_s."),
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
