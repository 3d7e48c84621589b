"""Local and gs:// paths through one door (fsspec/gcsfs), with errors a user can act on.

Beam's own IO reads and writes the tables inside a job; this module is for the checks and
small reads done on the launching machine before and after a job (prompt preparation,
input validation, resume scans, the summary).
"""

from __future__ import annotations

import os
import socket
import urllib.parse
import uuid

from specsamp.errors import UserError

_REACHED: set = set()  # endpoints already found reachable in this process


def filesystem(path: str):
    """(fsspec filesystem, path without protocol) for a local path or URL."""
    import fsspec.core

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        # gcsfs 2026.x probes every bucket for hierarchical namespaces; an emulator does
        # not answer that probe and each bucket then costs a 60 s timeout.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    if path.startswith("gs://"):
        _check_reachable(path)
    try:
        return fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise UserError(f"cannot open {path}: {e}") from None


def _check_reachable(path: str) -> None:
    """One TCP connection to the storage endpoint, with a short timeout: without it an
    unreachable endpoint costs minutes of the client's retries before any message."""
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
    if endpoint in _REACHED:
        return
    url = urllib.parse.urlsplit(endpoint if "://" in endpoint else "http://" + endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=10).close()
    except OSError as e:
        raise UserError(f"cannot reach {url.hostname}:{port} for {path} ({type(e).__name__}: {e}); "
                        "check the network connection") from None
    _REACHED.add(endpoint)


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
    """Create a local folder, or check that the bucket exists and answers; then write and
    delete a small file there, so that an output that cannot be written fails now."""
    fs, stripped = filesystem(path)
    try:
        if "://" in path:
            bucket = stripped.split("/", 1)[0]
            if not fs.exists(bucket):
                raise UserError(f"bucket gs://{bucket} does not exist or is not reachable")
        else:
            fs.makedirs(stripped, exist_ok=True)
        probe = f"{stripped.rstrip('/')}/.specsamp-write-check-{uuid.uuid4().hex[:8]}"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot write to output {path}: {_reason(e)}") from None


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
