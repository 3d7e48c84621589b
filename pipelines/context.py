"""The target's context length, read from its header or config before any work starts
(no weights are loaded): `max_new_tokens` is checked against it up front."""

from __future__ import annotations

import json

from specsamp import fs


def context_length(target: str) -> int | None:
    """Tokens of context of `target` ("smollm2", a .gguf file or an HF folder, local or
    remote), or None when it cannot be told here (the worker then reports the load error)."""
    try:
        if target == "smollm2":
            from specsamp.loading.download import ensure_smollm2

            return _gguf_context(ensure_smollm2(log=_status))
        kind = fs.kind_of(target)
        if kind == "file" and target.lower().endswith(".gguf") and not fs.is_remote(target):
            return _gguf_context(target.removeprefix("file://"))  # remote: not fetched twice
        if kind == "dir":
            return _hf_context(target)
    except Exception:  # the worker's load gives the precise reason
        return None
    return None


def _gguf_context(path: str) -> int | None:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.context_length")
    return 8192 if field is None else int(field.contents())  # the loader's default


def _hf_context(folder: str) -> int:
    config = json.loads(fs.read_text(fs.join(folder, "config.json")))
    return int(config.get("max_position_embeddings", 8192))  # the loader's default


def _status(msg: str) -> None:
    import sys

    print(f"specsamp: {msg}", file=sys.stderr, flush=True)
