"""`specsamp audit`: is speculative sampling exact on your own target/drafter pair?"""

from __future__ import annotations

from specsamp.commands.common import add_model_args, print_json, sampling_from, status
from specsamp.errors import UserError

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."


def register(sub) -> None:
    p = sub.add_parser("audit", help="statistical exactness audit of speculative sampling")
    add_model_args(p)
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=1.0, help="default 1 (greedy is trivial)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--chat", action="store_true", help="use the chat template")
    p.add_argument("--samples", type=int, default=2000, help="samples per method (default 2000)")
    p.add_argument("--positions", type=int, default=3, help="tokens compared (default 3)")
    p.add_argument("--alpha", type=float, default=1e-3, help="false-alarm rate (default 1e-3)")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from specsamp.analysis.audit import format_results, run_audit
    from specsamp.decoding.generator import GeneratorSpec, load_generator

    if args.samples < 50:
        raise UserError(f"--samples must be >= 50 for a meaningful test, got {args.samples}")
    if not 1 <= args.positions <= 16:
        raise UserError(f"--positions must be 1..16, got {args.positions}")
    if not 0 < args.alpha < 1:
        raise UserError(f"--alpha must be in (0, 1), got {args.alpha}")
    if args.draft == "none":
        raise UserError("audit checks a drafter against the target: give --draft other than none")
    sp = sampling_from(args)
    common = dict(target=args.target, sampling=sp, max_new_tokens=args.positions, weights=args.weights,
                  kv_cache=args.kv_cache, dtype=args.dtype, chat=args.chat, batch_size=min(args.batch_size, args.samples))
    status(f"loading models; drawing {args.samples} speculative and {args.samples} "
           f"autoregressive samples of {args.positions} tokens ...")
    spec_gen = load_generator(GeneratorSpec(draft=args.draft, k=args.k, tree=args.tree, verify=args.verify,
                                            **common))
    ar_gen = load_generator(GeneratorSpec(draft="none", **common))
    results = run_audit(spec_gen, ar_gen, args.prompt, args.samples, args.positions)
    failed = any(r.p_value < args.alpha / len(results) for r in results)
    if args.json:
        for r in results:
            print_json({**r.__dict__, "failed": r.p_value < args.alpha / len(results)})
    else:
        print(format_results(results, args.alpha))
        print("audit FAILED: the samples do not follow the target" if failed else "audit passed")
    return 1 if failed else 0
