"""Table schemas of specsamp: prompts in, completions and errors out (see tables.py)."""

from schemas.tables import (
    COMPLETIONS,
    ERRORS,
    PROMPTS_REQUIRED,
    SCHEMA_VERSION,
    SchemaMismatch,
    check_file,
    check_schema,
    describe,
)

__all__ = [
    "COMPLETIONS",
    "ERRORS",
    "PROMPTS_REQUIRED",
    "SCHEMA_VERSION",
    "SchemaMismatch",
    "check_file",
    "check_schema",
    "describe",
]
