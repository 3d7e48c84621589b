"""`specsamp generate`: one completion and its statistics, without Beam."""

from __future__ import annotations

from specsamp.commands.common import (
    add_model_args, add_sampling_args, add_tensor_parallel_arg, print_json, spec_from, status,
)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate one completion and print its statistics")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[],
                   help="stop token id besides the model's EOS (repeatable)")
    add_model_args(p)
    add_tensor_parallel_arg(p)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (k: -1 for --k auto, as in the output tables; "
                        "drafted_per_loop: the K of each drafted round; the other target calls "
                        "were plain rounds, K = 0)")
    p.set_defaults(func=run)


def rounds_at_k(s: dict) -> dict[int, int]:
    """Target calls (rounds) at each K in a completion's statistics (`Completion.stats`):
    its drafted rounds by K, and K = 0 for the plain rounds, which scored no draft (a
    `--k auto` policy runs them where drafting does not pay)."""
    import collections

    rounds = collections.Counter(s["drafted_per_loop"])
    plain = s["target_calls"] - len(s["drafted_per_loop"])
    if plain:
        rounds[0] += plain
    return dict(sorted(rounds.items()))


def run(args) -> int:
    import collections
    import time

    from specsamp.analysis.throughput import rounds_by_shape, width_gains
    from specsamp.decoding.generator import load_generator
    from specsamp.runconfig import K_AUTO as TABLE_K_AUTO
    from specsamp.runconfig import k_label

    spec = spec_from(args, chat=args.chat, system=args.system, stop=tuple(args.stop),
                     stop_token_ids=tuple(args.stop_token_id), tensor_parallel=args.tensor_parallel)
    t0 = time.perf_counter()
    if not args.json:
        status(f"loading {spec.target or 'smollm2 (embedded default)'} with drafter {spec.draft} ...")
    gen = load_generator(spec)
    [c] = gen.generate([args.prompt], [args.seed])
    s = c.stats()
    if spec.draft_k.auto and c.k:  # (a Completion's k is then the largest K the policy may pick)
        s["k"] = spec.draft_k.table
    if args.json:
        print_json({"text": c.text, "token_ids": list(c.token_ids), **s})
        return 0
    print(c.text)
    status(
        f"\n--- {s['generated_tokens']} tokens, stop: {s['stop_reason']}, mode: {s['mode']}"
        + (f", drafter {gen.draft_id}, K={k_label(s['k'])}" if c.k else "")
        + (f", tree {s['tree']} ({s['drafted_per_loop'][0] if s['drafted_per_loop'] else 0} nodes "
           "scored a round; rounds by accepted depth: "
           + ", ".join(f"{d}: {n}" for d, n in sorted(collections.Counter(s["accepted_per_loop"]).items()))
           + ")" if s["tree"] not in ("off", "auto") else "")
        + (" (rounds at K: " + ", ".join(f"{k}: {n}" for k, n in rounds_at_k(s).items()) + ")"
           if s["k"] == TABLE_K_AUTO and s["tree"] != "auto" else "")
        + (", tree auto (rounds by shape, a K or a tree: "
           + ", ".join(f"{k}: {n}" for k, n in rounds_by_shape(gen.engine.k_rounds, ran_only=True).items())
           + "; trees' tokens over their spines': "
           + (", ".join(f"{k}: {g:.2f}" for k, g in width_gains(gen.engine.tree_tokens).items()) or "none ran")
           + ")" if s["tree"] == "auto" else "")
        + f"\n    target calls {s['target_calls']}, draft calls {s['draft_calls']}, "
        f"tokens/call {s['tokens_per_call']:.2f}"
        + (f", acceptance {s['acceptance_rate']:.2f}" if c.k else "")
        + f"\n    prefill {s['prefill_s']:.3f} s, decode {s['decode_s']:.3f} s "
        f"({s['ms_per_token']:.1f} ms/token; includes compilation on a first run; "
        f"total wall {time.perf_counter() - t0:.1f} s)"
    )
    return 0
