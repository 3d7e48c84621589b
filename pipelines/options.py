"""The run's own command-line flags (the rest are Beam's), parsed strictly."""

from __future__ import annotations

import argparse

from specsamp import runconfig
from specsamp.errors import UserError

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(the run's own flags, Beam pipeline options). `retry_errors` becomes None (no
    retry), an empty frozenset (every kind) or the kinds named."""
    parser = argparse.ArgumentParser(prog="specsamp run", add_help=False, allow_abbrev=False)
    runconfig.add_override_arguments(parser)
    args, beam_args = parser.parse_known_args(argv)
    args.retry_errors = retry_kinds(args.retry_errors)
    return args, beam_args


def retry_kinds(value: str | None) -> frozenset | None:
    if value is None:
        return None
    kinds = frozenset(k.strip() for k in value.split(",") if k.strip() and k.strip() != "all")
    bad = [k for k in kinds if not k.replace("_", "").isalnum()]
    if bad:
        raise UserError(f"--retry-errors takes error kinds separated by commas (e.g. generation_failed,"
                        f"too_long), got {value!r}")
    return kinds


def strict_bool(value, flag: str) -> bool:
    """Beam declares some booleans as plain strings (`--dry_run false` would be true)."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise UserError(f"{flag} takes true or false, got {value!r}")
