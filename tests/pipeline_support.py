"""Helpers for the pipeline tests: tiny checkpoints, prompt files, configs, an engine
wrapper that fails on demand, and readers of the output tables."""

from __future__ import annotations

import glob
import os

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

FAILING_LOADER = "tests.pipeline_support:failing_loader"

# Good prompts, then rows that must each end in the error table (and why).
GOOD = ["def add(a, b):", "the quick brown fox", "hello world", "for i in range(3):", "speculative sampling"]
BAD = {"empty": ("", "empty_prompt"), "blank": ("  \n ", "empty_prompt"),
       "long": ("zq" * 150, "too_long"), "boom": ("please BOOM now", "generation_failed"),
       "null": (None, "bad_row")}
BINARY = {"bin/ok": ("bytes are fine".encode(), None), "bin/bad": (b"\xff\xfe not utf-8", "bad_row")}


def tiny_models(root: str) -> tuple[str, str]:
    from specsamp.testing import make_tiny_checkpoint

    return (make_tiny_checkpoint(os.path.join(root, "target"), seed=0, n_layers=2),
            make_tiny_checkpoint(os.path.join(root, "draft"), seed=1, n_layers=1))


def write_prompts(folder: str) -> dict[str, str | None]:
    """Two prompt files (string prompts; binary prompts); returns {id: expected error kind}."""
    os.makedirs(folder, exist_ok=True)
    ids = [f"good/{i}" for i in range(len(GOOD))] + list(BAD)
    texts = GOOD + [t for t, _ in BAD.values()]
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(texts, pa.string()),
                             "level": list(range(len(ids)))}), os.path.join(folder, "mixed-0.parquet"))
    pq.write_table(pa.table({"id": list(BINARY), "prompt": pa.array([b for b, _ in BINARY.values()], pa.binary())}),
                   os.path.join(folder, "mixed-1.parquet"))
    expected = {i: None for i in ids[: len(GOOD)]}
    expected.update({i: kind for i, (_, kind) in BAD.items()})
    expected.update({i: kind for i, (_, kind) in BINARY.items()})
    return expected


def write_config(path: str, target: str, draft: str, **changes) -> str:
    cfg = {"input": os.path.join(os.path.dirname(path), "prompts", "mixed-*.parquet"),
           "output": os.path.join(os.path.dirname(path), "out"), "target": target,
           "settings": [{"draft": "none"}, {"draft": draft, "k": 3}, {"draft": "ngram", "k": 2}],
           "max_new_tokens": 16, "batch_size": 2, "seed": 7, "chat": True, **changes}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


class _Failing:
    """The real generator, except that a prompt containing BOOM breaks generate()."""

    def __init__(self, gen):
        self._gen = gen

    def __getattr__(self, name):
        return getattr(self._gen, name)

    def generate(self, prompts, seeds):
        if any("BOOM" in p for p in prompts):
            raise RuntimeError("injected engine failure")
        return self._gen.generate(prompts, seeds)


def failing_loader(spec):
    from specsamp import load_generator

    return _Failing(load_generator(spec))


def read(output: str, table: str) -> pa.Table:
    paths = sorted(glob.glob(os.path.join(output, f"{table}-*.parquet")))
    return pa.concat_tables([pq.read_table(p) for p in paths]) if paths else None


def files(output: str, table: str) -> list[str]:
    return sorted(glob.glob(os.path.join(output, f"{table}-*.parquet")))
