"""`specsamp report TABLES...`: latency, acceptance and speed-up per group, and plots."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="latency percentiles, acceptance and speed-up per group of completion tables",
        description="Summarize completion tables (files, folders, globs or gs:// URLs); "
        "error tables (errors-*.parquet) in the same folders are counted per group.",
    )
    p.add_argument("tables", nargs="+", metavar="TABLES",
                   help="completion tables: Parquet files, folders (searched recursively), globs, gs:// URLs")
    p.add_argument("--by", default=None, metavar="KEYS",
                   help="comma-separated grouping keys (default dataset,mode,k,temperature)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="DIR", default=None,
                   help="also write PNG figures (ms/token vs K, accepted per loop, acceptance by position)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    from specsamp.analysis import outputs, report, report_text

    by = report.parse_by(args.by)
    con = outputs.connect(outputs.resolve(args.tables))
    groups = report.summarize(con, by)
    if args.json:
        print(json.dumps(report.to_json(groups), indent=2))
    else:
        print(report_text.render(groups))
    if args.plot:
        from specsamp.analysis import plots

        written = plots.write_all(con, by, args.plot)
        if not args.json:
            print("\nFigures: " + (", ".join(written) if written else "none (no speculative groups)"))
    return 0
