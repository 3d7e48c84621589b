"""Local paths and gs:// (any fsspec URL) through one door (fsspec/gcsfs), with errors a
user can act on, and the local cache.

Beam's own IO reads and writes the tables inside a job; this module is for the checks and
small reads done on the launching machine before and after a job (prompt preparation,
input validation, resume scans, the summary, the report) and for model files.

A remote GGUF file (memory-mapped when read) and a remote checkpoint's small files (config,
tokenizer, shard index) are copied once into the cache and read from there; safetensors
shards are not copied but read in place with ranged reads (`specsamp.loading.hf`). A copy
is keyed by the URL and the remote file's size and version stamp, so a changed file is
fetched again and an unchanged one is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import urllib.parse
import uuid
from pathlib import Path

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

def cache_dir(*parts: str) -> Path:
    """The cache folder (env SPECSAMP_CACHE, else ~/.cache/specsamp), created on demand."""
    root = os.environ.get("SPECSAMP_CACHE") or os.path.join(Path.home(), ".cache", "specsamp")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def kind_of(path: str) -> str:
    """'file', 'dir' or 'missing' for a local path or URL (network errors are UserErrors)."""
    fs, stripped = filesystem(path)
    try:
        if fs.isdir(stripped):
            return "dir"
        return "file" if fs.exists(stripped) else "missing"
    except Exception as e:
        raise UserError(f"cannot reach {path}: {_reason(e)}") from None


def list_dir(path: str) -> list[str]:
    """Base names of the files directly in a folder (local or remote)."""
    fs, stripped = filesystem(path)
    try:
        return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(stripped, detail=False))
    except Exception as e:
        raise UserError(f"cannot list {path}: {_reason(e)}") from None


def local_file(path: str) -> str:
    """A local path holding the file at `path`; a remote file is copied into the cache."""
    if not is_remote(path):
        path = path.removeprefix("file://")
        if not os.path.isfile(path):
            raise UserError(f"no such file: {path}")
        return path
    return str(mirror([path]) / _basename(path))


def mirror(urls: list[str]) -> Path:
    """A local cache folder holding a copy of each remote file in `urls` (by base name).
    The folder is keyed by the URLs and each file's size and version stamp, so a file
    changed remotely is fetched again and an unchanged one never is."""
    stamps = [(url, _stamp(url)) for url in urls]
    key = hashlib.sha256(json.dumps(stamps, sort_keys=True, default=str).encode()).hexdigest()
    folder = cache_dir("remote", key[:24])
    for url in urls:
        target = folder / _basename(url)
        if target.exists():
            continue
        fs, stripped = filesystem(url)
        try:
            with fs.open(stripped, "rb") as src, atomic_output(target) as tmp:
                with open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=16 << 20)
        except OSError as e:
            raise UserError(f"cannot copy {url}: {_reason(e)}") from None
    return folder


def _stamp(url: str) -> dict:
    fs, stripped = filesystem(url)
    try:
        info = fs.info(stripped)
    except FileNotFoundError:
        raise UserError(f"no such file: {url}") from None
    except Exception as e:
        raise UserError(f"cannot reach {url}: {_reason(e)}") from None
    return {k: info.get(k) for k in ("size", "etag", "md5Hash", "generation", "mtime", "updated")}


def _basename(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


class atomic_output:
    """`with atomic_output(final) as tmp:` write to `tmp`; it becomes `final` only when the
    block succeeds, so an interrupted download or conversion never leaves a partial file
    that a later run would trust."""

    def __init__(self, final: str | Path):
        self.final = Path(final)

    def __enter__(self) -> str:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(dir=self.final.parent, prefix=f".{self.final.name}.")
        os.close(fd)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            os.replace(self.tmp, self.final)
        elif os.path.exists(self.tmp):
            os.remove(self.tmp)
        return False


def read_text(path: str) -> str:
    """The text of a small file (a config, a manifest), local or remote."""
    fs, stripped = filesystem(path)
    try:
        with fs.open(stripped, "r") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"no such file: {path}") from None
    except Exception as e:
        raise UserError(f"cannot read {path}: {_reason(e)}") from None
