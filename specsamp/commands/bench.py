"""`specsamp bench`: baseline vs speculative on the same prompts, in one process."""

from __future__ import annotations

import argparse
import itertools

from specsamp.commands.common import (
    add_dtype_arg, add_kv_cache_arg, add_verify_arg, add_tensor_parallel_arg, add_weights_arg, k_value, print_json, status,
)
from specsamp.errors import UserError


def _list(kind):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure speed-up over the autoregressive baseline")
    p.add_argument("--target", default=None, help="target model (default: embedded SmolLM2)")
    p.add_argument("--draft", default="auto",
                   help="drafter (auto, path, ngram[:N], ngram+<feature draft>, early-exit:L)")
    p.add_argument("--k", type=_list(k_value), default=None,
                   help="K values, e.g. 1,2,4,8 (default 2,4); with --throughput also 'auto' "
                        "(default 4,auto)")
    p.add_argument("--tree", type=_list(str), default=[],
                   help="token trees to bench beside the K chains, widths per depth, e.g. "
                        "3x1x1,2x2, or nodes as rank paths, e.g. 1-2-11, or N nodes chosen per "
                        "row (a dynamic tree, e.g. 3) (any drafter; ngram: trees of branches, "
                        "like 3x1x1 or 1-2-11; ngram+<draft>: those or N; not with "
                        "--throughput); with "
                        "--throughput only 'auto': a setting whose K policy weighs small trees "
                        "beside the chains (K column tree-auto)")
    p.add_argument("--temperature", type=_list(float), default=[0.0], help="e.g. 0,1")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=_list(float), default=[1.0], help="e.g. 1,0.8")
    p.add_argument("--prompts", default="humaneval",
                   help="'humaneval' (chat form), 'prose' (chat form; the prose prompts held out "
                        "of distillation) or a Parquet/JSONL file with a prompt column")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; overrides --prompts)")
    p.add_argument("--chat", action="store_true", help="chat template for --prompt / file prompts")
    p.add_argument("--limit", type=int, default=None,
                   help="number of prompts (default 8; with --throughput 4 x the largest batch "
                        "size, so that continuous batching has prompts to refill with)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=None,
                   help="median over this many (default 3); with --throughput, runs of the whole "
                        "schedule, pooled, with each run's speed-up reported (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per setting and line")
    add_weights_arg(p, many=True)
    add_dtype_arg(p)
    add_kv_cache_arg(p, many=True)
    add_verify_arg(p)
    p.add_argument("--throughput", action="store_true",
                   help="tokens/s of a batch job per batch size, K and batching (EOS on)")
    p.add_argument("--batch-size", type=_list(int), default=[1, 8, 32],
                   help="with --throughput: batch sizes (slots), e.g. 1,8,32")
    p.add_argument("--batching", type=_list(str), default=["static", "continuous"],
                   help="with --throughput: static and/or continuous (default both)")
    add_tensor_parallel_arg(p)
    p.set_defaults(func=run)


def _prompts(args) -> tuple[list[str], bool]:
    from specsamp.analysis.bench import humaneval_prompts, prose_prompts

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    if args.prompt:
        return args.prompt[: args.limit], args.chat
    if args.prompts == "humaneval":
        return humaneval_prompts(args.limit), True
    if args.prompts == "prose":
        return prose_prompts(args.limit), True
    from specsamp.prompts import from_file

    table = from_file(args.prompts)
    return table.column("prompt").to_pylist()[: args.limit], args.chat


def run(args) -> int:
    from specsamp.analysis.bench import (
        add_traffic, format_table, run_bench, streaming_bandwidth, traffic_line,
    )
    from specsamp.decoding.config import SamplingParams
    from specsamp.decoding.generator import GeneratorSpec, load_generator

    if args.draft == "none":
        raise UserError("bench compares a drafter with the baseline: give --draft other than none")
    if args.repeats is not None and args.repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {args.repeats}")
    if args.throughput:
        if args.tree not in ([], ["auto"]):
            raise UserError("--tree is for the latency bench (batch 1); with --throughput it takes "
                            "only 'auto'")
        return run_throughput_command(args)
    if "auto" in args.tree:
        raise UserError("--tree auto needs --throughput (the latency bench runs fixed shapes at batch 1)")
    args.repeats = 3 if args.repeats is None else args.repeats
    args.k = args.k or [2, 4]
    args.limit = 8 if args.limit is None else args.limit
    if "auto" in args.k:
        raise UserError("--k auto needs --throughput (the latency bench runs fixed K at batch 1)")
    from specsamp.decoding.config import parse_tree

    args.tree = [t for t in args.tree if parse_tree(t) is not None]  # 'off': the chains
    prompts, chat = _prompts(args)
    samplings = [SamplingParams(t, args.top_k, p) for t in args.temperature for p in args.top_p
                 if not (t == 0 and p != args.top_p[0])]  # greedy ignores top-p: run it once
    loaded = {}

    def maker(weights, kv_cache):
        def make(draft, k, sp, tree="off"):
            spec = GeneratorSpec(target=args.target, draft=draft, k=k, sampling=sp, chat=chat, tree=tree,
                                 max_new_tokens=args.max_new_tokens, weights=weights,
                                 tensor_parallel=args.tensor_parallel, kv_cache=kv_cache,
                                 dtype=args.dtype, verify=args.verify)
            if not loaded:
                status(f"loading {args.target or 'smollm2 (embedded default)'} ...")
            gen = load_generator(spec)
            loaded[spec] = gen
            return gen
        return make

    status(f"{len(prompts)} prompts, K={args.k}, trees {args.tree or 'none'}, drafter {args.draft}, {args.repeats} repeats, "
           f"weights {','.join(args.weights)}, KV cache {','.join(args.kv_cache)}, "
           f"tensor parallel {args.tensor_parallel}, verify {args.verify}")
    stream = streaming_bandwidth()
    groups = []
    for weights, kv_cache in itertools.product(args.weights, args.kv_cache):
        make = maker(weights, kv_cache)
        rows = run_bench(make, prompts, args.draft, args.k, samplings, args.repeats, args.seed,
                         log=status, trees=args.tree)
        gen = make("none", 1, samplings[0])  # already loaded: the baseline of this group
        add_traffic(rows, weights, _step_bytes(gen), stream)
        groups.append([{**r, "kv_cache": gen.engine.prog.kv_cache} for r in rows])  # 'auto' resolved
    for rows in groups:
        _print(rows, args.json, lambda rs: traffic_line(rs) + "\n" + format_table(rs))
    return 0


def _step_bytes(gen) -> int:
    from specsamp.models import Model

    return Model(gen.engine.prog.target).step_bytes(gen.engine.target_params)


def _print(rows: list[dict], as_json: bool, table) -> int:
    if as_json:
        for r in rows:
            print_json(r)
    else:
        print(table(rows))
    return 0


def run_throughput_command(args) -> int:
    from specsamp.analysis.bench import compute_peak, streaming_bandwidth
    from specsamp.analysis.throughput import Machine, run_throughput
    from specsamp.decoding.config import SamplingParams, check_k
    from specsamp.decoding.generator import GeneratorSpec, load_generator

    from specsamp.analysis.throughput import TREE_AUTO

    ks = (args.k or [4, "auto"]) + ([TREE_AUTO] if args.tree else [])
    args.limit = 4 * max(args.batch_size) if args.limit is None else args.limit
    for k in ks:
        if k not in ("auto", TREE_AUTO):
            check_k(k)
    if any(b < 1 for b in args.batch_size):
        raise UserError(f"--batch-size takes integers >= 1, got {args.batch_size}")
    if set(args.batching) - {"static", "continuous"} or not args.batching:
        raise UserError(f"--batching takes static and/or continuous, got {args.batching}")
    if len(args.temperature) > 1 or len(args.top_p) > 1:
        raise UserError("bench --throughput runs one sampling setting: give one --temperature and "
                        f"one --top-p (got {args.temperature} and {args.top_p})")
    prompts, chat = _prompts(args)
    sp = SamplingParams(args.temperature[0], args.top_k, args.top_p[0])
    status(f"loading {args.target or 'smollm2 (embedded default)'} ...")

    repeats = args.repeats or 1
    status(f"{len(prompts)} prompts, batch sizes {args.batch_size}, K={ks}, drafter {args.draft}, "
           f"{repeats} run(s)")
    machine = Machine(streaming_bandwidth(), compute_peak())
    status(f"this machine streams {machine.gb_per_s:.1f} GB/s and multiplies float32 matrices "
           f"at {machine.gflop_per_s:.0f} GFLOP/s")
    rows = []
    for weights, kv_cache in itertools.product(args.weights, args.kv_cache):
        def load(draft, k, weights=weights, kv_cache=kv_cache):
            tree = "auto" if k == TREE_AUTO else "off"
            return load_generator(GeneratorSpec(target=args.target, draft=draft, k="auto" if tree == "auto" else k,
                                                tree=tree, sampling=sp,
                                                chat=chat, max_new_tokens=args.max_new_tokens,
                                                weights=weights, kv_cache=kv_cache,
                                                tensor_parallel=args.tensor_parallel,
                                                dtype=args.dtype, verify=args.verify))

        group = run_throughput(load, prompts, args.draft, ks, args.batch_size, args.batching,
                               log=status, machine=machine, repeats=repeats)
        from specsamp.decoding.config import resolve_kv_cache

        resolved = resolve_kv_cache(kv_cache, load("none", 1).target.dtype)  # loaded already
        rows += [{**r, "weights": weights, "kv_cache": resolved} for r in group]
    return _print(rows, args.json, _throughput_tables)


def _throughput_tables(rows: list[dict]) -> str:
    """One table per (weights, KV cache), in the order they ran, each under its name."""
    from specsamp.analysis.throughput import format_throughput

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["weights"], r["kv_cache"]), []).append(r)
    return "\n\n".join(f"weights {w}, KV cache {c}:\n" + format_throughput(rs)
                       for (w, c), rs in groups.items())
