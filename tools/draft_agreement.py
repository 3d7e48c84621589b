"""Top-k agreement by depth of drafters with the embedded target, on held-out prompts.

    PYTHONPATH=. python tools/draft_agreement.py --prompts humaneval:16,prose:16 \\
        --new-tokens 128 --drafts smollm2-feature,early-exit:8,early-exit:16,early-exit:24 --json out.json

(the run of docs/drafters.md, "Top-k agreement by depth"; these are the defaults).

1. The target's greedy continuation of each prompt (chat form, `--new-tokens` at most;
   plain decoding, so the path is the target's own argmax path).
2. One teacher-forced target pass over prompt + continuation: its logits and hidden states.
3. For every drafter, the records of `specsamp.analysis.draft_agreement` at rows t = the
   prompt's last token .. the last one with `--depth` tokens after it (the same rows for
   every depth), and prompt lookup's candidates at the same rows.

Prints a table per drafter and writes everything as JSON with --json. Counts, not timings:
machine load does not change the figures.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp
import numpy as np

from specsamp.analysis import draft_agreement as da
from specsamp.decoding.config import SamplingParams


def _prompts(spec: str) -> list[tuple[str, str]]:
    """'humaneval:16,prose:16' -> [(set, text)]; both sets were never distilled on."""
    from specsamp.analysis.bench import humaneval_prompts, prose_prompts

    sets = {"humaneval": humaneval_prompts, "prose": prose_prompts}
    out = []
    for part in spec.split(","):
        name, _, limit = part.partition(":")
        out += [(name, text) for text in sets[name](int(limit) if limit else None)]
    return out


def _continuations(prompts, new_tokens: int, batch: int):
    """[(prompt length, prompt + greedy continuation as int32)] and the generator."""
    from specsamp.decoding.generator import GeneratorSpec, load_generator

    gen = load_generator(GeneratorSpec(draft="none", max_new_tokens=new_tokens, chat=True,
                                       batch_size=batch))
    texts = [text for _, text in prompts]
    done = gen.generate(texts, seeds=[0] * len(texts))
    ids = [gen.encode_prompt(t) for t in texts]
    seqs = [(len(p), np.array(p + list(c.token_ids), np.int32)) for p, c in zip(ids, done)]
    return seqs, gen


def _rows(prompt_len: int, length: int, count: int, depth: int):
    """Rows from the prompt's last token, `count` of them (a fixed shape: one compiled
    program), and which are valid (depth tokens after them in the sequence)."""
    rows = prompt_len - 1 + np.arange(count)
    return rows, rows + depth <= length - 1


def _lookup(seq, rows, valid, min_ngram: int) -> dict:
    counts, any_hit, top1 = da.lookup_candidates(seq, rows[valid], 3, min_ngram)
    return {"rows": int(valid.sum()),
            **{f"candidates>={k}": int((counts >= k).sum()) for k in da.WIDTHS},
            "target_among_candidates": int(any_hit.sum()), "latest_match_is_target": int(top1.sum())}


def run(args) -> dict:
    from specsamp.decoding.factory import build_drafter, file_loader

    prompts = _prompts(args.prompts)
    seqs, gen = _continuations(prompts, args.new_tokens, args.batch_size)
    target = gen.target
    count = args.new_tokens - args.depth + 1
    slots = max(p + count + args.depth for p, _ in seqs)
    slots += -slots % 64
    drafters = {name: build_drafter(name, 1, SamplingParams(), target.cfg, target.params, file_loader(target))
                for name in args.drafts}
    parts = {name: [] for name in drafters}
    truths, valids, lookup, mismatch = [], [], {1: [], 2: []}, 0
    for i, (plen, seq) in enumerate(seqs):
        tokens = jnp.asarray(np.pad(seq, (0, slots - len(seq))))[None]
        hidden, logits = da.target_pass(target.cfg, target.params, tokens)
        argmax = np.asarray(jnp.argmax(logits[0, plen - 1 : len(seq) - 1], axis=-1))
        mismatch += int((argmax != seq[plen:]).sum())
        rows, valid = _rows(plen, len(seq), count, args.depth)
        truths.append(np.asarray(tokens[0])[rows[:, None] + 1 + np.arange(args.depth)])
        valids.append(valid)
        for n in lookup:
            lookup[n].append(_lookup(seq, rows, valid, n))
        for name, (drafter, params) in drafters.items():
            parts[name].append(da.measure(drafter, params, tokens, hidden, logits, rows, args.depth))
        print(f"prompt {i + 1}/{len(seqs)}: {plen} + {len(seq) - plen} tokens", file=sys.stderr)
    truth, valid = np.concatenate(truths), np.concatenate(valids)
    return {
        "prompts": args.prompts, "new_tokens": args.new_tokens, "depth": args.depth,
        "generated_tokens": int(sum(len(s) - p for p, s in seqs)),
        "argmax_mismatches": mismatch,  # teacher-forced argmax != the generated token
        "drafters": {name: da.summarize(da.concat(p), truth, valid) for name, p in parts.items()},
        "lookup": {f"ngram min {n}": {k: sum(d[k] for d in v) for k in v[0]} for n, v in lookup.items()},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="humaneval:16,prose:16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=da.DEPTH)
    ap.add_argument("--drafts", type=lambda s: s.split(","), default=["smollm2-feature", "early-exit:8", "early-exit:16", "early-exit:24"])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    out = run(args)
    for name, depths in out["drafters"].items():
        print(da.format_table(name, depths) + "\n")
    print(f"prompt lookup (n-grams up to 3): {json.dumps(out['lookup'])}")
    print(f"{out['generated_tokens']} generated tokens; teacher-forced argmax mismatches: {out['argmax_mismatches']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
