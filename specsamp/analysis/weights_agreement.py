"""Greedy output of two weight formats of one model, compared token by token.

Stored blocks are the float32 model's own values, but products are summed in another order,
so two logits within float32 rounding of each other may swap. Greedy output must therefore
be equal up to the first near-tie: where the two sequences first differ, the float32
model's logits of the two competing tokens must be within `tolerance`; any wider gap is a
real difference (a wrong weight, a kernel bug) and fails the check.

    python -m specsamp.analysis.weights_agreement --prompts humaneval --limit 8 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class Agreement:
    prompt: int
    tokens: int  # tokens compared (the shorter output)
    diverged_at: int | None  # first differing position, None if equal
    gap: float | None  # reference logit of its token minus that of the other's token

    def ok(self, tolerance: float) -> bool:
        return self.diverged_at is None or abs(self.gap) <= tolerance


def first_divergence(a, b) -> int | None:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def compare(prompts, max_new_tokens: int = 128, weights=("float32", "stored"),
            target: str | None = None) -> list[Agreement]:
    """Greedy outputs of `weights[1]` against the reference `weights[0]` (chat prompts)."""
    import jax.numpy as jnp

    from specsamp.decoding.generator import GeneratorSpec, load_generator
    from specsamp.models import Model

    ref, other = (load_generator(GeneratorSpec(target=target, draft="none", chat=True,
                                               max_new_tokens=max_new_tokens, weights=w))
                  for w in weights)
    model = Model(ref.target.cfg)
    out = []
    for n, text in enumerate(prompts):
        [a], [b] = ref.generate([text], [0]), other.generate([text], [0])
        i = first_divergence(a.token_ids, b.token_ids)
        gap = None
        if i is not None and i < min(len(a.token_ids), len(b.token_ids)):
            prefix = ref.encode_prompt(text) + list(a.token_ids[:i])
            logits = model.full_forward(ref.engine.target_params, jnp.asarray([prefix]))[0, -1]
            gap = float(logits[a.token_ids[i]] - logits[b.token_ids[i]])
        elif i is not None:
            gap = float("inf")  # one output stopped where the other went on: not a tie
        out.append(Agreement(n, min(len(a.token_ids), len(b.token_ids)), i, gap))
    return out


def main(argv=None) -> int:
    from specsamp.analysis.bench import humaneval_prompts, prose_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", choices=("humaneval", "prose"), default="humaneval")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--weights", default="stored", help="format compared with float32")
    p.add_argument("--tolerance", type=float, default=0.01, help="near-tie: logit gap at most this")
    args = p.parse_args(argv)
    prompts = (humaneval_prompts if args.prompts == "humaneval" else prose_prompts)(args.limit)
    results = compare(prompts, args.max_new_tokens, ("float32", args.weights))
    for r in results:
        state = "equal" if r.diverged_at is None else (
            f"diverged at {r.diverged_at}, logit gap {r.gap:.2e} "
            f"({'near-tie' if r.ok(args.tolerance) else 'NOT a near-tie'})")
        print(f"prompt {r.prompt}: {r.tokens} tokens, {state}")
    failed = [r for r in results if not r.ok(args.tolerance)]
    print(f"{len(results) - len(failed)}/{len(results)} equal up to the first near-tie")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
