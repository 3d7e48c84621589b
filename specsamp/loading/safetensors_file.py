"""Safetensors files read tensor by tensor: a local file from a memory map, a remote one
(gs://, any fsspec URL) by ranged reads.

The format: an 8-byte little-endian header length N, N bytes of JSON ({name: {"dtype",
"shape", "data_offsets": [begin, end]}, optional "__metadata__"}), then the tensors' raw
little-endian bytes, offsets counted from the end of the header.

`SafetensorsFile(path)` checks the whole header against the file's size when opened (a
truncated or corrupt file is one clear error before anything is converted), and
`tensor(name)` is a read-only numpy view of the mapped bytes: nothing is read until it is
used. `release(name)` drops the tensor's pages from this process's resident memory once
it has been converted (they are file pages: a later read maps them again), so reading a
checkpoint never holds more than the tensor in hand on top of what it is converted into.
BF16 is `ml_dtypes.bfloat16` (shipped with JAX), which the safetensors package's numpy
reader does not read.

`SafetensorsFile(url, remote_fs)` reads a remote file without copying it: the header with
two ranged reads, each tensor with ranged reads of whole rows, at most CHUNK_BYTES each
(`pieces(name)`), the next one fetched while the caller converts the current one. Only the
tensors asked for are read; memory holds at most two pieces besides what they are
converted into.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from specsamp.errors import UserError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header
CHUNK_BYTES = 32 << 20  # the most one ranged read of a remote file asks for


class SafetensorsFile:
    def __init__(self, path: str, remote_fs=None):
        """`path` is a local path, or with `remote_fs` (an fsspec filesystem) a path on it."""
        self.path, self._fs, self._map = path, remote_fs, None
        if remote_fs is None:
            self.size = os.path.getsize(path)
            with open(path, "rb") as f:
                self._read_header(lambda start, end: f.read(end - start))
                # An empty map cannot be memory-mapped; a file of only a header has no tensors.
                self._map = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                             if self.size > 0 and self.entries else None)
        else:
            self.size = int(self._remote(remote_fs.size, path))
            self._read_header(self._range)

    def _read_header(self, read) -> None:
        """`read(start, end)`: the file's bytes [start, end), read in order."""
        head = read(0, 8) if self.size >= 8 else b""
        if len(head) < 8:
            raise self._error("truncated (no header)")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > self.size:
            raise self._error(f"truncated or not safetensors (header of {n} bytes, "
                              f"file of {self.size})")
        try:
            header = json.loads(read(8, 8 + n))
        except ValueError as e:
            raise self._error(f"header is not valid JSON ({e})") from None
        self._base = 8 + n
        self.entries = {k: self._entry(k, v) for k, v in header.items() if k != "__metadata__"}

    def _range(self, start: int, end: int) -> bytes:
        data = self._remote(self._fs.cat_file, self.path, start=start, end=end)
        if len(data) != end - start:
            raise self._error(f"truncated: asked for bytes {start}-{end}, got {len(data)}")
        return data

    def _remote(self, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except FileNotFoundError:
            raise UserError(f"no such file: {self.path}") from None
        except Exception as e:  # network, permissions: one line
            raise self._error(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None

    def _error(self, what: str) -> UserError:
        return UserError(f"cannot read {self.path}: {what}")

    def _entry(self, name: str, e) -> tuple:
        """(numpy dtype, shape, absolute begin, end), checked against the file's size."""
        try:
            dtype, shape = DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"])
            begin, end = (int(x) for x in e["data_offsets"])
        except KeyError as k:
            raise self._error(f"tensor {name}: unsupported dtype or missing field {k}") from None
        except (TypeError, ValueError):
            raise self._error(f"tensor {name}: malformed header entry") from None
        if end - begin != math.prod(shape) * np.dtype(dtype).itemsize or begin < 0:
            raise self._error(f"tensor {name}: its byte range does not match its shape {shape}")
        if self._base + end > self.size:
            raise self._error(f"truncated: tensor {name} ends at byte {self._base + end}, "
                              f"the file has {self.size}")
        return dtype, shape, self._base + begin, self._base + end

    def keys(self):
        return self.entries.keys()

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.entries[name][0])

    def tensor(self, name: str) -> np.ndarray:
        """The tensor: a read-only view of the mapped bytes (a local file), or read whole."""
        dtype, shape, begin, end = self.entries[name]
        if begin == end:
            return np.zeros(shape, dtype)
        if self._map is None:
            return np.frombuffer(self._range(begin, end), dtype).reshape(shape)
        return np.frombuffer(self._map, dtype, math.prod(shape), begin).reshape(shape)

    def pieces(self, name: str):
        """(first row, rows) pieces of the tensor along its first axis, which together make
        it: a local file's tensor in one piece (its mapped view), a remote one's in ranged
        reads of at most CHUNK_BYTES (one row at least); a scalar as (0, itself)."""
        dtype, shape, begin, end = self.entries[name]
        if self._fs is None or begin == end or not shape:
            yield 0, self.tensor(name)
            return
        row = (end - begin) // shape[0]
        per = max(1, CHUNK_BYTES // max(row, 1))
        starts = range(0, shape[0], per)

        def fetch(r):
            rows = min(per, shape[0] - r)
            data = self._range(begin + r * row, begin + (r + rows) * row)
            return np.frombuffer(data, dtype).reshape(rows, *shape[1:])

        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(fetch, starts[0])
            for i, r in enumerate(starts):
                piece = pending.result()
                if i + 1 < len(starts):
                    pending = pool.submit(fetch, starts[i + 1])
                yield r, piece
                del piece

    def release(self, name: str) -> None:
        """Drop the tensor's mapped pages from resident memory (views stay valid)."""
        _, _, begin, end = self.entries[name]
        if self._map is None or end == begin or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = begin - begin % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive: the map closes when it goes
                pass
            self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
