"""Plot `specsamp bench --throughput --json` output: decode tokens/s by batch size, one
line per (batching, drafter, K).

    specsamp bench --throughput ... --json > runs.jsonl
    python tools/plot_throughput.py runs.jsonl docs/figures/throughput.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    lines: dict = {}
    with open(src) as f:
        for row in map(json.loads, filter(str.strip, f)):
            label = f"{row.get('batching', 'static')}, " + (
                "autoregressive" if row["drafter"] == "none" else f"K={row['k']}")
            lines.setdefault(label, []).append((row["batch_size"], row["decode_tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(lines.items()):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", linestyle="--" if label.startswith("static") else "-",
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (slots)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title("specsamp bench --throughput (stored weights, 2 vCPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/plot_throughput.py RUNS.jsonl OUT.png")
    main(sys.argv[1], sys.argv[2])
