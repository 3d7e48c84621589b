"""Helpers for the pipeline tests: tiny checkpoints, prompt files, configs, an engine
wrapper that fails on demand, and readers of the output tables."""

from __future__ import annotations

import glob
import os

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

FAILING_LOADER = "tests.pipeline_support:failing_loader"

# Prompt rows in file order, with the error kind each must end in (None: a completion).
# Bad rows sit between good ones so that a batch of two holds a good and a bad prompt.
GOOD = ["def add(a, b):", "the quick brown fox", "hello world", "for i in range(3):", "speculative sampling"]
ROWS = [("good/0", GOOD[0], None), ("boom", "please BOOM now", "generation_failed"),
        ("good/1", GOOD[1], None), ("empty", "", "empty_prompt"),
        ("good/2", GOOD[2], None), ("blank", "  \n ", "empty_prompt"),
        ("good/3", GOOD[3], None), ("long", "zq" * 150, "too_long"),
        ("good/4", GOOD[4], None), ("null", None, "bad_row")]
BINARY = [("bin/ok", "bytes are fine".encode(), None), ("bin/bad", b"\xff\xfe not utf-8", "bad_utf8")]
# A string column holding bytes that are not UTF-8 (pyarrow does not check on write or read).
BAD_TEXT = [("str/ok", b"plain text", None), ("str/bad", b"caf\xe9 au lait", "bad_utf8")]


def tiny_models(root: str) -> tuple[str, str]:
    from specsamp.testing import make_tiny_checkpoint

    return (make_tiny_checkpoint(os.path.join(root, "target"), seed=0, n_layers=2),
            make_tiny_checkpoint(os.path.join(root, "draft"), seed=1, n_layers=1))


def write_prompts(folder: str) -> dict[str, str | None]:
    """Three prompt files (string prompts; binary prompts; a string column with bytes that
    are not UTF-8); returns {id: expected error kind}."""
    os.makedirs(folder, exist_ok=True)
    ids, texts, kinds = zip(*ROWS)
    pq.write_table(pa.table({"id": list(ids), "prompt": pa.array(texts, pa.string()),
                             "level": list(range(len(ids)))}), os.path.join(folder, "mixed-0.parquet"))
    bids, blobs, bkinds = zip(*BINARY)
    pq.write_table(pa.table({"id": list(bids), "prompt": pa.array(blobs, pa.binary())}),
                   os.path.join(folder, "mixed-1.parquet"))
    sids, texts, skinds = zip(*BAD_TEXT)
    pq.write_table(pa.table({"id": list(sids), "prompt": pa.array(texts, pa.binary()).view(pa.string())}),
                   os.path.join(folder, "mixed-2.parquet"))
    return dict(zip(ids + bids + sids, kinds + bkinds + skinds))


def write_config(path: str, target: str, draft: str, **changes) -> str:
    cfg = {"input": os.path.join(os.path.dirname(path), "prompts", "mixed-*.parquet"),
           "output": os.path.join(os.path.dirname(path), "out"), "target": target,
           "settings": [{"draft": "none"}, {"draft": draft, "k": 3}, {"draft": "ngram", "k": 2}],
           "max_new_tokens": 16, "batch_size": 2, "seed": 7, "chat": True, **changes}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def make_setup(root) -> tuple[str, dict, str, str]:
    """Tiny models, the three prompt files and the default config under `root` (a Path):
    (config path, {id: expected error kind}, target, draft)."""
    target, draft = tiny_models(str(root / "models"))
    expected = write_prompts(str(root / "prompts"))
    return write_config(str(root / "run.yaml"), target, draft), expected, target, draft


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


STALE_TEMP_IN = "SPECSAMP_TEST_STALE_TEMP_IN"
STALE_LOADER = "tests.pipeline_support:stale_temp_loader"


def stale_temp_loader(spec):
    """The failing loader, and, in the folder named by env STALE_TEMP_IN, the temporary
    file a writer killed mid-write leaves, once the run is under way (after its start's
    sweep)."""
    from pipelines.commit import TEMP_MARK

    folder = os.environ.get(STALE_TEMP_IN)
    if folder:
        with open(os.path.join(folder, f".errors-0.parquet{TEMP_MARK}killed00"), "wb") as f:
            f.write(b"half a shard")
    return failing_loader(spec)


def files(output: str, table: str) -> list[str]:
    return sorted(glob.glob(os.path.join(output, f"{table}-*.parquet")))


PID_LOG = "SPECSAMP_TEST_PID_LOG"
PID_LOADER = "tests.pipeline_support:pid_loader"


class _PidLogging:
    """The real generator, noting which process ran each generate call (in the folder
    named by env PID_LOG: worker processes inherit it)."""

    def __init__(self, gen):
        self._gen = gen

    def __getattr__(self, name):
        return getattr(self._gen, name)

    def generate(self, prompts, seeds):
        with open(os.path.join(os.environ[PID_LOG], str(os.getpid())), "a") as f:
            f.write(f"{len(prompts)}\n")
        return self._gen.generate(prompts, seeds)


def pid_loader(spec):
    from specsamp import load_generator

    return _PidLogging(load_generator(spec))


FAILING_PID_LOADER = "tests.pipeline_support:failing_pid_loader"


def failing_pid_loader(spec):
    """Both wrappers: BOOM fails, and each generate call notes its process; each load is
    noted too (in PID_LOG/<pid>.loads)."""
    from specsamp import load_generator

    with open(os.path.join(os.environ[PID_LOG], f"{os.getpid()}.loads"), "a") as f:
        f.write(f"{spec.draft}\n")
    return _PidLogging(_Failing(load_generator(spec)))
