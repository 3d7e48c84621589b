"""The terminal form of `specsamp report` (and of `specsamp eval`'s tables): plain-text
tables of the groups `specsamp.analysis.report.summarize` computes (latency, speculation,
token trees, errors). Numbers are formatted here only; every figure is computed there."""

from __future__ import annotations

from specsamp.analysis.report import Group, SpeedUp, Summary
from specsamp.runconfig import k_label


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: first column(s) of text left-aligned, the rest right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    numeric = [all(_looks_numeric(r[i]) for r in rows) for i in range(len(headers))]

    def line(cells):
        return "  ".join(str(c).rjust(w) if num else str(c).ljust(w)
                         for c, w, num in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _looks_numeric(cell: str) -> bool:
    return cell == "n/a" or cell[:1].isdigit() or cell[:1] in "-+."


def fmt(x, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def key_cells(key: dict) -> list[str]:
    return ["n/a" if v is None else k_label(v) if k == "k" else f"{v:g}" if isinstance(v, float)
            else str(v) for k, v in key.items()]


def _mean_sd(s: Summary | None, spec: str) -> str:
    if s is None or s.mean is None:
        return "n/a"
    return f"{s.mean:{spec}} ± {fmt(s.sd, spec)}"


def _latency_rows(groups: list[Group]) -> list[list[str]]:
    rows = []
    for g in groups:
        t, m = g.total_s, g.ms_per_token
        pcts = [fmt(getattr(s, p) if s else None, spec)
                for s, spec in ((t, ".3f"), (m, ".2f")) for p in ("p50", "p90", "p99")]
        rows.append(key_cells(g.key) + [str(g.samples), str(g.tokens), str(sum(g.errors.values())),
                                     _mean_sd(t, ".3f"), *pcts[:3], _mean_sd(m, ".2f"), *pcts[3:]])
    return rows


def _speedup_cell(s: SpeedUp | None) -> str:
    if s is None:
        return "n/a"
    ci = f" [{s.low:.2f}, {s.high:.2f}]" if s.low is not None else " [n/a]"
    return f"{s.measured:.2f}x{ci}"


def _spec_rows(groups: list[Group]) -> list[list[str]]:
    return [key_cells(g.key) + [
        fmt(g.acceptance_rate), fmt(g.alpha), fmt(g.tokens_per_call, ".2f"), fmt(g.cost_ratio),
        _speedup_cell(g.speedup),
        "n/a" if g.predicted_speedup is None else f"{g.predicted_speedup:.2f}x",
        " ".join(f"{p:.2f}" for p in g.acceptance_by_position) or "n/a",
    ] for g in groups if g.speculative]


def _tree_rows(groups: list[Group]) -> list[list[str]]:
    return [key_cells(g.key) + [
        str(sum(g.accepted_histogram.values())), fmt(g.nodes_per_round, ".2f"),
        " ".join(str(g.accepted_histogram.get(d, 0))
                 for d in range(max([g.k or 0, *g.accepted_histogram]) + 1)),
    ] for g in groups if g.speculative and g.tree != "off"]


def render(groups: list[Group]) -> str:
    """The terminal report: latency for every group, then speculation, token trees, errors."""
    if not groups:
        return "no rows"
    keys = list(groups[0].key)
    parts = ["Latency (total_s: seconds per sample; ms/tok: decode ms per generated token)",
             format_table(keys + ["n", "tokens", "errors", "total_s mean ± sd", "P50", "P90", "P99",
                                  "ms/tok mean ± sd", "P50", "P90", "P99"], _latency_rows(groups))]
    spec = _spec_rows(groups)
    if spec:
        parts += ["", "Speculation (speed-up: baseline ms/tok / group ms/tok, 95% CI; "
                      "predicted: (1-alpha^(K+1))/((1-alpha)(Kc+1)))",
                  format_table(keys + ["accept", "alpha", "tok/call", "c", "speed-up [95% CI]", "predicted",
                                       "kept by draft position 1..K"], spec)]
        if "mode" not in keys:
            parts.append("(speed-up needs 'mode' among the --by keys)")
    trees = _tree_rows(groups)
    if trees:
        parts += ["", "Token trees (rounds; nodes scored per round, mean; rounds that accepted "
                      "0, 1, .., depth draft tokens)",
                  format_table(keys + ["rounds", "nodes/round", "accepted depth 0..D"], trees)]
    failed = [g for g in groups if g.errors]
    if failed:
        parts += ["", "Errors by kind"]
        parts += ["  " + " ".join(f"{k}={v}" for k, v in zip(keys, key_cells(g.key))) + ": " +
                  ", ".join(f"{k} {n}" for k, n in sorted(g.errors.items())) for g in failed]
    return "\n".join(parts)
