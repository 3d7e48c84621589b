"""`specsamp eval TABLES...`: HumanEval pass@1 and XSum ROUGE per group, and parity."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="HumanEval pass@1 (sandboxed execution) and XSum ROUGE per group, with parity",
        description="Score completion tables: HumanEval rows by running each program in a "
        "bubblewrap sandbox (new user, PID, network, IPC, UTS and mount namespaces; uid 65534 "
        "without capabilities, no_new_privs, a seccomp filter refusing namespaces, mounts, "
        "ptrace, pidfds and non-AF_UNIX sockets; only /usr and Python visible, read-only; a "
        "private tmpfs /tmp; wall-clock, CPU, memory, file-size and process limits; everything "
        "a program starts dies with it). A completion passes when its outputs on the test's "
        "inputs, compared here with the canonical solution's, are right and the plain "
        "HumanEval check passes too; disagreements are listed. Not enforced: reading the "
        "visible files (/usr, the Python installation), CPU and memory use up to the limits, "
        "kernel bugs. Without bubblewrap, user namespaces or seccomp, eval refuses unless "
        "--unsafe-host-execution. Rows with a reference summary are scored by ROUGE-1/2/L. "
        "Each speculative group is compared with its autoregressive baseline.",
    )
    p.add_argument("tables", nargs="+", metavar="TABLES",
                   help="completion tables: Parquet files, folders (searched recursively), globs, gs:// URLs")
    p.add_argument("--by", default=None, metavar="KEYS",
                   help="comma-separated grouping keys (default dataset,mode,k,temperature)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="wall-clock seconds per HumanEval program for each of its two runs, "
                   "the outputs and the plain check (default 10)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="programs run at once (default: CPU count)")
    p.add_argument("--unsafe-host-execution", action="store_true",
                   help="where no sandbox can be set up, run HumanEval programs as plain child "
                   "processes of this one (resource limits only: they can read and write your "
                   "files, use the network and signal your processes); never for untrusted code")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    from specsamp.analysis import evaluation, outputs, report
    from specsamp.analysis.sandbox import Limits, SandboxUnavailable
    from specsamp.errors import UserError

    if not args.timeout > 0:
        raise UserError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    con = outputs.connect(outputs.resolve(args.tables))
    by = report.with_tree(con, report.parse_by(args.by))
    try:
        groups, isolation = evaluation.score_tables(con, by, Limits(timeout_s=args.timeout), args.workers,
                                                    unsafe=args.unsafe_host_execution)
    except SandboxUnavailable as e:
        raise UserError(f"cannot isolate HumanEval programs: {e} (or pass --unsafe-host-execution)") from None
    if args.json:
        print(json.dumps(evaluation.to_json(groups, isolation), indent=2))
    else:
        print(evaluation.render(groups, isolation))
    return 0
