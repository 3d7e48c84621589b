"""PNG figures of a report (`specsamp report --plot DIR`), drawn with matplotlib's Agg backend.

- ms_per_token_vs_k.png: mean ms/token against K with the P10-P90 band of per-sample
  ms/token and the autoregressive baseline as a horizontal line (the shape of Figure 1 of
  Chen et al. 2023); beside it the measured speed-up with its 95% interval and the cost
  model's prediction.
- accepted_per_loop[-SERIES].png: for each K, the share of loops that kept 0..K draft
  tokens, with the truncated geometric distribution the measured alpha implies.
- acceptance_by_position[-SERIES].png: the chance that draft position i is kept, per K.

A series is one dataset and sampling setting (the grouping keys other than mode, k and
draft); figures 2 and 3 are drawn once per series, with a suffix when there are several.
Settings with `k: auto` (K chosen each round, no one K to put on an axis) are dotted
horizontal lines in the first figure, beside the baseline's, and are left out of the other
two. Token tree settings are left out of all three (a tree's depth is not a chain's K; the
text report gives their accepted depths).
"""

from __future__ import annotations

import math
import os
import re

from specsamp.analysis import report
from specsamp.decoding import stats
from specsamp.runconfig import K_AUTO

_DPI = 150


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(groups: list[report.Group]) -> dict:
    """{series key: (autoregressive group or None, speculative groups of one K sorted by K,
    `k: auto` groups)}."""
    out: dict = {}
    for g in groups:
        if g.tree != "off":
            continue
        entry = out.setdefault(report.baseline_key(g.key), [None, [], []])
        if g.key.get("mode") == "autoregressive" and g.samples:
            entry[0] = g
        elif g.speculative and g.samples and g.k == K_AUTO:
            entry[2].append(g)
        elif g.speculative and g.samples and g.k:
            entry[1].append(g)
    return {k: (b, sorted(s, key=lambda g: g.k), a) for k, (b, s, a) in out.items() if s or a}


def _label(key: tuple) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in key) or "all"


def _slug(key: tuple) -> str:
    return re.sub(r"[^A-Za-z0-9.=_-]+", "_", ",".join(f"{k}={v}" for k, v in key))


def write_all(con, by, out_dir: str) -> list[str]:
    """Draw every figure for the groups of `by` (plus mode and k); return the paths."""
    keys = tuple(dict.fromkeys([*by, "mode", "k"]))
    series = _series(report.summarize(con, keys))
    if not series:
        return []
    os.makedirs(out_dir, exist_ok=True)
    plt = _pyplot()
    paths = [_latency_figure(plt, series, os.path.join(out_dir, "ms_per_token_vs_k.png"))]
    for key, (_, spec, _) in series.items():
        if not spec:
            continue
        suffix = f"-{_slug(key)}" if len(series) > 1 else ""
        title = _label(key)
        paths.append(_histogram_figure(plt, spec, title, os.path.join(out_dir, f"accepted_per_loop{suffix}.png")))
        paths.append(_position_figure(plt, spec, title, os.path.join(out_dir, f"acceptance_by_position{suffix}.png")))
    return paths


def _save(plt, fig, path: str) -> str:
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _latency_figure(plt, series: dict, path: str) -> str:
    fig, (ax, ax_s) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = _short_labels(list(series))
    for i, (base, spec, autos) in enumerate(series.values()):
        color = colors[i % len(colors)]
        _latency_panel(ax, base, spec, color, names[i], base_color="0.3" if len(series) == 1 else color)
        _speedup_panel(ax_s, spec, color)
        for g in autos:
            _auto_lines(ax, ax_s, g, color)
    ax.set(xlabel="K (draft tokens per loop)", ylabel="decode ms per token",
           title="Latency per token: mean and P10-P90 of samples")
    ax.set_ylim(bottom=0)
    ax_s.axhline(1.0, color="0.5", lw=0.8)
    ax_s.set(xlabel="K (draft tokens per loop)", ylabel="speed-up vs autoregressive",
             title="Speed-up: measured (95% CI) and cost model")
    ks = sorted({g.k for _, spec, _ in series.values() for g in spec})
    for a in (ax, ax_s):
        a.set_xticks(ks)
        a.grid(alpha=0.3)
    _legends(ax, ax_s, auto=any(autos for _, _, autos in series.values()))
    fig.tight_layout()
    return _save(plt, fig, path)


def _short_labels(keys: list[tuple]) -> list[str]:
    """Series names from the keys that differ between series ('speculative' for one)."""
    if len(keys) == 1:
        return ["speculative"]
    varying = [i for i in range(len(keys[0])) if len({k[i] for k in keys}) > 1]
    return [_label(tuple(k[i] for i in varying)) for k in keys]


def _legends(ax, ax_s, auto: bool = False) -> None:
    """Line styles explained once; with several series, their colours named in the left panel."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    grey = "0.35"
    style = [Patch(color=grey, alpha=0.25, label="P10-P90 of per-sample ms/token"),
             Line2D([], [], color=grey, ls="--", label="autoregressive mean (band: its P10-P90)")]
    if auto:
        style.append(Line2D([], [], color=grey, ls=":", label="k auto (K chosen per round): mean"))
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + style, fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    ax_s.legend(handles=[Line2D([], [], color=grey, marker="o", label="measured, 95% CI"),
                         Line2D([], [], color=grey, marker="s", mfc="none", ls="--",
                                label="cost model (alpha, K, c)")],
                fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)


def _latency_panel(ax, base, spec, color, name, base_color) -> None:
    ks = [g.k for g in spec]
    ms = [g.ms_per_token for g in spec]
    ax.plot(ks, [m.mean for m in ms], "o-", color=color, label=f"{name}: mean")
    ax.fill_between(ks, [m.p10 for m in ms], [m.p90 for m in ms], color=color, alpha=0.2)
    if base is not None:
        b = base.ms_per_token
        ax.axhline(b.mean, color=base_color, ls="--", lw=1.5)
        ax.axhspan(b.p10, b.p90, color=base_color, alpha=0.08)
        ax.annotate(f"autoregressive {b.mean:.1f} ms", (1.0, b.mean), xycoords=("axes fraction", "data"),
                    xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom",
                    fontsize=8, color=base_color)


def _auto_lines(ax, ax_s, g, color) -> None:
    """A `k: auto` group: its mean ms/token and measured speed-up as dotted lines."""
    mean = g.ms_per_token.mean
    ax.axhline(mean, color=color, ls=":", lw=1.5)
    ax.annotate(f"k auto {mean:.1f} ms", (0.0, mean), xycoords=("axes fraction", "data"),
                xytext=(4, 3), textcoords="offset points", ha="left", va="bottom", fontsize=8,
                color=color)
    if g.speedup is not None:
        ax_s.axhline(g.speedup.measured, color=color, ls=":", lw=1.5)
        ax_s.annotate(f"k auto {g.speedup.measured:.2f}x", (0.0, g.speedup.measured),
                      xycoords=("axes fraction", "data"), xytext=(4, -3), textcoords="offset points",
                      ha="left", va="top", fontsize=8, color=color)


def _speedup_panel(ax, spec, color) -> None:
    measured = [(g.k, g.speedup) for g in spec if g.speedup is not None]
    if measured:
        ks, s = zip(*measured)
        lows = [x.measured - x.low if x.low is not None else 0 for x in s]
        highs = [x.high - x.measured if x.high is not None else 0 for x in s]
        ax.errorbar(ks, [x.measured for x in s], yerr=[lows, highs], fmt="o-", color=color, capsize=3)
    predicted = [(g.k, g.predicted_speedup) for g in spec if g.predicted_speedup is not None]
    if predicted:
        ks, p = zip(*predicted)
        ax.plot(ks, p, "s--", color=color, alpha=0.6, mfc="none")


def _grid(plt, n: int, width: float = 2.6, height: float = 2.2):
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _histogram_figure(plt, spec, title: str, path: str) -> str:
    fig, axes = _grid(plt, len(spec))
    for ax, g in zip(axes, spec):
        total = sum(g.accepted_histogram.values())
        xs = list(range(g.k + 1))
        shares = [g.accepted_histogram.get(x, 0) / total for x in xs]
        ax.bar(xs, shares, color="C0", alpha=0.8, label="measured")
        if g.alpha is not None:
            model = stats.accepted_distribution(g.alpha, g.k)
            ax.plot(xs, model, "o", color="C3", ms=4, label="model: alpha^j (1 - alpha), alpha^K at j = K")
        alpha = "" if g.alpha is None else f", alpha {g.alpha:.2f}"
        ax.set_title(f"K={g.k} ({total} loops{alpha})", fontsize=9)
        ax.set_xticks(xs)
        ax.set_ylim(0, 1)
        ax.tick_params(labelsize=8)
    fig.supxlabel("draft tokens accepted in a loop (j)", fontsize=9)
    fig.supylabel("share of loops", fontsize=9)
    fig.suptitle(f"Accepted tokens per loop ({title})", fontsize=10)
    fig.tight_layout()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2,
               fontsize=8, frameon=False)
    return _save(plt, fig, path)


def _position_figure(plt, spec, title: str, path: str) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    cmap = plt.get_cmap("viridis")
    kmax = max(g.k for g in spec)
    for g in spec:
        pos = list(range(1, len(g.acceptance_by_position) + 1))
        ax.plot(pos, g.acceptance_by_position, "o-", ms=4,
                color=cmap((g.k - 1) / max(kmax - 1, 1) * 0.9), label=f"K={g.k}")
    widest = spec[-1]
    if widest.alpha is not None:  # i.i.d. model: position i is kept with chance alpha^i
        ax.plot(range(1, kmax + 1), stats.kept_by_position(widest.alpha, kmax), "--", color="0.4", lw=1,
                label=f"alpha^i, alpha={widest.alpha:.2f} (K={kmax})")
    ax.set(xlabel="draft position i", ylabel="P(position i kept)", ylim=(0, 1.02),
           title=f"Acceptance by draft position ({title})")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return _save(plt, fig, path)
