"""Smoke benchmark: is the first sample of a fresh process timed like the others?

A fresh worker compiles its programs on its first batch (and on every new shape). The
engine compiles ahead of time, outside the timed calls, and reports the seconds in
`compile_s`; this script shows that the first sample's ms/token is then in line with the
median sample's (target: within 1.5x).

    python tools/cold_start.py [--draft none|auto|ngram] [--prompts 6] [--max-new-tokens 64]
                               [--cold-cache]

Run it alone for figures (other processes on the machine move them). --cold-cache uses an
empty compilation cache, as a first run on a new machine does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default="none")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--cold-cache", action="store_true", help="start from an empty compilation cache")
    args = ap.parse_args(argv)
    if args.cold_cache:
        os.environ["SPECSAMP_JAX_CACHE"] = tempfile.mkdtemp(prefix="specsamp-jax-")

    from specsamp.analysis.bench import humaneval_prompts
    from specsamp.compilation import enable_compilation_cache
    from specsamp.decoding.generator import GeneratorSpec, load_generator

    enable_compilation_cache()
    t0 = time.perf_counter()
    gen = load_generator(GeneratorSpec(target=args.target, draft=args.draft, k=args.k, chat=True,
                                       max_new_tokens=args.max_new_tokens))
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows = []
    for i, prompt in enumerate(humaneval_prompts(args.prompts)):
        t0 = time.perf_counter()
        [c] = gen.generate([prompt], [i])
        wall = time.perf_counter() - t0
        rows.append(c)
        print(f"sample {i}: {c.generated_tokens:4d} tokens  {c.ms_per_token:7.2f} ms/token  "
              f"compile {c.compile_s:6.2f} s  wall {wall:6.2f} s", flush=True)
    median = statistics.median(c.ms_per_token for c in rows)
    ratio = rows[0].ms_per_token / median
    print(f"first / median ms/token: {ratio:.2f}x ({rows[0].ms_per_token:.2f} / {median:.2f}); "
          f"compile {sum(c.compile_s for c in rows):.1f} s in all, outside the timings")
    return 0 if ratio <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
