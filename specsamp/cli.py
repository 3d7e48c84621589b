"""The `specsamp` command line: one subcommand per module in `specsamp.commands`, plus
those installed packages add through the entry point group `specsamp.commands`.

Each command defines `register(subparsers)` (adds its parser, whose defaults set `func`)
and keeps its imports of heavy libraries (JAX, Beam) inside the handler, so that
`specsamp --help` is instant. A `UserError` becomes one line on stderr and exit status 2,
a `RunFailed` one line and exit status 1.

`specsamp run` is such an entry point (`pipelines.command:register`, declared in
pyproject.toml): the Beam pipeline package sits above the library and plugs its command
in, so no module of `specsamp` imports `pipelines`. A checkout whose installed metadata
predates an entry point lacks that command until `pip install -e .` runs again.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from specsamp.errors import RunFailed, UserError

ENTRY_POINTS = "specsamp.commands"
# The order of `specsamp --help`, a run's workflow. A name is a module of
# `specsamp.commands` or an entry point's name (`run`); one that neither provides is left
# out, and entry points not named here come last.
COMMANDS = (
    "generate",
    "bench",
    "audit",
    "download",
    "prepare",
    "run",
    "report",
    "eval",
    "distill",
)
# Commands that compile JAX programs: they reuse compiled programs across runs.
_COMPILING = ("generate", "bench", "audit", "distill", "distill-data")


class _Parser(argparse.ArgumentParser):
    """Usage mistakes as one line (argparse's default prints the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specsamp",
        description="Exact speculative sampling for batch generation (JAX + Apache Beam).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    plugins = _entry_points()
    for name in (*COMMANDS, *sorted(set(plugins) - set(COMMANDS))):
        register = _builtin(name) or (plugins[name].load() if name in plugins else None)
        if register is not None:
            register(sub)
    return parser


def _builtin(name: str):
    """`register` of the module `specsamp.commands.<name>`, or None where there is none."""
    try:
        module = importlib.import_module(f"specsamp.commands.{name}")
    except ModuleNotFoundError as e:  # a plugin's command, or a command still being built
        if e.name != f"specsamp.commands.{name}":
            raise
        return None
    return module.register


def _entry_points() -> dict:
    """Commands that installed packages add: name -> entry point of its `register`."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command in _COMPILING:
            from specsamp.compilation import enable_compilation_cache

            enable_compilation_cache()
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"specsamp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"specsamp {args.command}: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"specsamp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
