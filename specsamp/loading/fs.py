"""Where model files live: local paths and gs:// (any fsspec URL), and the local cache.

Readers of checkpoints (GGUF memory-maps its file, safetensors opens by name) want local
files, so a remote checkpoint is copied once into the cache and read from there. The copy
is keyed by the URL and the remote file's size and version stamp, so a changed file is
fetched again and an unchanged one is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from specsamp.errors import UserError
from specsamp.storage import filesystem


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
        raise UserError(f"cannot reach {path}: {_short(e)}") from None


def list_dir(path: str) -> list[str]:
    """Base names of the files directly in a folder (local or remote)."""
    fs, stripped = filesystem(path)
    try:
        return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(stripped, detail=False))
    except Exception as e:
        raise UserError(f"cannot list {path}: {_short(e)}") from None


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
            raise UserError(f"cannot copy {url}: {_short(e)}") from None
    return folder


def _stamp(url: str) -> dict:
    fs, stripped = filesystem(url)
    try:
        info = fs.info(stripped)
    except FileNotFoundError:
        raise UserError(f"no such file: {url}") from None
    except Exception as e:
        raise UserError(f"cannot reach {url}: {_short(e)}") from None
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


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
