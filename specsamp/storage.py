"""Local and gs:// paths through one door (fsspec/gcsfs), with errors a user can act on.

Beam's own IO reads and writes the tables inside a job; this module is for the checks and
small reads done on the launching machine before and after a job (prompt preparation,
input validation, resume scans, the summary).
"""

from __future__ import annotations

import os

from specsamp.errors import UserError


def filesystem(path: str):
    """(fsspec filesystem, path without protocol) for a local path or URL."""
    import fsspec.core

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        # gcsfs 2026.x probes every bucket for hierarchical namespaces; an emulator does
        # not answer that probe and each bucket then costs a 60 s timeout.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        return fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise UserError(f"cannot open {path}: {e}") from None


def glob(pattern: str) -> list[str]:
    """Files matching `pattern` (or the file itself), sorted, with their protocol."""
    fs, stripped = filesystem(pattern)
    try:
        fs.invalidate_cache()  # a job may have written here since the last listing
        if fs.isdir(stripped):
            raise UserError(f"{pattern} is a folder; give a file or a glob such as {pattern.rstrip('/')}/*.parquet")
        found = sorted(fs.glob(stripped)) if _has_magic(stripped) else (
            [stripped] if fs.exists(stripped) else [])
    except UserError:
        raise
    except Exception as e:  # network, permissions, missing bucket: all one message
        raise UserError(f"cannot list {pattern}: {_reason(e)}") from None
    return [_with_protocol(pattern, f) for f in found]


def ensure_dir(path: str) -> None:
    """Create a local folder, or check that the bucket exists and answers (write access
    shows only when the job writes)."""
    fs, stripped = filesystem(path)
    try:
        if "://" in path:
            bucket = stripped.split("/", 1)[0]
            if not fs.exists(bucket):
                raise UserError(f"bucket gs://{bucket} does not exist or is not reachable")
        else:
            fs.makedirs(stripped, exist_ok=True)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot use output {path}: {_reason(e)}") from None


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if "://" in base else os.path.join(base, *parts)


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def _with_protocol(original: str, found: str) -> str:
    if "://" not in original:
        return found
    return original.split("://", 1)[0] + "://" + found.split("://", 1)[-1]


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
