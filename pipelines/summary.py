"""The short summary `specsamp run` prints: where the tables are and what is in them.

Read back from the written tables (not from Beam counters), so it is the same whichever
runner ran the job, and it covers resumed runs as a whole; error rows superseded by a
retried sample's completion are not counted (`specsamp.analysis.outputs.live`).
"""

from __future__ import annotations

import collections
import dataclasses
import math

from specsamp.analysis.outputs import live
from specsamp.decoding import stats
from specsamp.fs import filesystem, glob, join
from specsamp.runconfig import k_label

_KEY = ["id", "draft", "k", "tree", "config_hash", "run_id"]
_COLUMNS = _KEY + ["mode", "generated_tokens", "target_calls", "accepted_per_loop",
                   "drafted_per_loop", "ms_per_token", "compile_s"]


@dataclasses.dataclass(frozen=True)
class SettingStats:
    mode: str
    draft: str
    k: int
    tree: str  # 'off' or the token tree's widths (k is then its depth)
    rows: int
    acceptance: float  # accepted / drafted tokens, pooled over rows (NaN for the baseline)
    tokens_per_call: float
    ms_per_token: float  # mean of the rows' ms/token (rows without tokens left out), as in specsamp report
    compile_s: float  # compiling programs, outside every timing


@dataclasses.dataclass(frozen=True)
class Summary:
    output: str
    completions: int
    errors: int
    this_run: int  # samples this run set out to make
    settings: tuple[SettingStats, ...]
    error_kinds: dict

    def text(self) -> str:
        width = max([5] + [len(s.draft) for s in self.settings])
        kwidth = max([4] + [len(_k_cell(s)) for s in self.settings])
        lines = [
            f"tables in {self.output} (this run: {self.this_run} samples):",
            f"  {join(self.output, 'completions-*.parquet')}  {self.completions} rows",
            f"  {join(self.output, 'errors-*.parquet')}  {self.errors} rows"
            + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(self.error_kinds.items()))})" if self.errors else ""),
            *([f"{self.errors} samples failed ({', '.join(f'{k}: {v}' for k, v in sorted(self.error_kinds.items()))}); "
               "the error table's 'error' column says why; --retry-errors [KIND,...] attempts them again"]
              if self.errors else []),
            f"{'mode':15s} {'draft':>{width}s} {'K':>{kwidth}s} {'rows':>5s} {'accept':>7s} {'tok/call':>8s} "
            f"{'ms/token':>9s} {'speed-up':>8s}",
        ]
        base = next((s.ms_per_token for s in self.settings if s.mode == "autoregressive"), math.nan)
        for s in self.settings:
            lines.append(f"{s.mode:15s} {s.draft:>{width}s} {_k_cell(s):>{kwidth}s} {s.rows:5d} {_fmt(s.acceptance, 7, 3)} "
                         f"{_fmt(s.tokens_per_call, 8, 2)} {_fmt(s.ms_per_token, 9, 1)} "
                         f"{_fmt(stats.speedup(base, s.ms_per_token), 8, 2, 'x')}")
        if not math.isnan(base):
            lines.append("speed-up: baseline mean ms/token over the setting's, means over samples "
                         "as in specsamp report (which adds intervals, percentiles, per-dataset groups)")
        compile_s = sum(s.compile_s for s in self.settings)
        lines.append(f"compiling programs took {compile_s:.1f} s, outside every timing above")
        return "\n".join(lines)


def summarize(output: str, this_run: int = 0) -> Summary:
    completions, errors = live(_read(output, "completions", _COLUMNS),
                               _read(output, "errors", _KEY + ["error_kind"]))
    groups = collections.defaultdict(list)
    for row in completions:
        groups[(row["mode"], row["draft"], row["k"], row["tree"])].append(row)
    settings = tuple(_stats(key, rs) for key, rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3] != "off", kv[0][3])))
    kinds = collections.Counter(r["error_kind"] for r in errors)
    return Summary(output, len(completions), len(errors), this_run, settings, dict(kinds))


def _stats(key, rs: list[dict]) -> SettingStats:
    mode, draft, k, tree = key
    tokens = sum(r["generated_tokens"] for r in rs)
    calls = sum(r["target_calls"] for r in rs)
    counts = [stats.loop_counts(r["accepted_per_loop"], r["drafted_per_loop"]) for r in rs]
    accepted, drafted = sum(c[0] for c in counts), sum(c[1] for c in counts)
    ms = [r["ms_per_token"] for r in rs if r["ms_per_token"] is not None and not math.isnan(r["ms_per_token"])]
    return SettingStats(mode, draft, k, tree, len(rs), stats.acceptance_rate(accepted, drafted),
                        stats.tokens_per_call(tokens, calls), stats.ratio(sum(ms), len(ms)),
                        sum(r["compile_s"] for r in rs))


def _read(output: str, table: str, columns: list[str]) -> list[dict]:
    import pyarrow.parquet as pq

    out = []
    for path in glob(join(output, f"{table}-*.parquet")):
        fs, stripped = filesystem(path)
        out += pq.read_table(stripped, columns=columns, filesystem=fs).to_pylist()
    return out


def _k_cell(s: SettingStats) -> str:
    """The K column: K (`auto` for k auto), or a tree's widths ('tree 2x1')."""
    return k_label(s.k) if s.tree == "off" else f"tree {s.tree}"


def _fmt(x: float, width: int, digits: int, unit: str = "") -> str:
    text = "-" if math.isnan(x) else f"{x:.{digits}f}{unit}"
    return f"{text:>{width}s}"
