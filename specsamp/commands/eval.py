"""`specsamp eval TABLES...`: HumanEval pass@1 and XSum ROUGE per group, and parity."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="HumanEval pass@1 (sandboxed execution) and XSum ROUGE per group, with parity",
        description="Score completion tables: HumanEval rows by running each program in a "
        "separate sandboxed process (no network, read-only files outside a temporary dir, "
        "time and memory limits); rows with a reference summary by ROUGE-1/2/L. Each "
        "speculative group is compared with its autoregressive baseline.",
    )
    p.add_argument("tables", nargs="+", metavar="TABLES",
                   help="completion tables: Parquet files, folders (searched recursively), globs, gs:// URLs")
    p.add_argument("--by", default=None, metavar="KEYS",
                   help="comma-separated grouping keys (default dataset,mode,k,temperature)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="wall-clock seconds per HumanEval program (default 10)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="programs run at once (default: CPU count)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    from specsamp import evaluation, outputs, report
    from specsamp.errors import UserError
    from specsamp.sandbox import Limits

    if not args.timeout > 0:
        raise UserError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    by = report.parse_by(args.by)
    con = outputs.connect(outputs.resolve(args.tables))
    groups, isolation = evaluation.score_tables(con, by, Limits(timeout_s=args.timeout), args.workers)
    if args.json:
        print(json.dumps(evaluation.to_json(groups, isolation), indent=2))
    else:
        print(evaluation.render(groups, isolation))
    return 0
