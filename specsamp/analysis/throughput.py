"""Throughput benchmark (`specsamp bench --throughput`): tokens per second of a batch job,
per batch size, drafter and K (a fixed K or `auto`, the batch-aware policy), with static
batches (a batch runs until its longest row ends) and continuous batching (free slots are
refilled), EOS on, on the same prompts, in one process. Settings take turns, so that they
run under the same machine noise: with static batches every setting runs each batch before
the next batch starts, with continuous batching every setting runs one chunk of its stream
in turn (`_take_turns`).
With `repeats` > 1 the whole schedule runs that many times on the same engines (odd runs take
the settings in reverse order, so that a drift of the machine falls on all alike); every
figure pools the runs (tokens and seconds summed), and `speedups` lists each run's own
speed-up, so that a reader sees how far the machine's noise moves it.

Compilation is never timed: both engines compile every program ahead of its first timed
call (`specsamp.compilation`) and report the seconds apart. Figures:
  prefill_tokens_per_s: prompt tokens over the wall time of prefill calls;
  decode_tokens_per_s: generated tokens over the wall time of decode calls;
  tokens_per_s: generated tokens over both;
  ar_tokens_per_s, ar_decode_tokens_per_s: the same for the baseline (drafter "none", K 0)
    at the same batch size and batching;
  speedup: decode_tokens_per_s over the baseline's;
  speedups: (repeats > 1) each run's decode tokens/s over the baseline's in the same run;
  repeats: runs of the schedule pooled in the row;
  vs_static: (continuous rows) decode_tokens_per_s over the static row of the same setting;
  rounds: decode rounds run (each computes every slot of the batch, busy or not);
  tokens_per_slot_round: generated tokens over rounds x batch_size (for the baseline, the
    share of slots that produced a token: static batches idle the slots of finished rows);
  continuous_bound: (static baseline rows) static rounds over the fewest rounds any
    batching needs, ceil(generated / batch_size): the most continuous batching can gain
    on these prompts at this batch size;
  ar_bound_tokens_per_s: (baseline rows, when the machine's figures are given) the
    roofline of a plain step at this batch size: batch_size rows per max(weight bytes over
    the streaming bandwidth, batch_size x weight FLOPs per row over the matrix-multiply
    rate); `roofline_tokens_per_s`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Iterator, Sequence

from specsamp.decoding import stats
from specsamp.decoding.engine import Continuous, Static
from specsamp.decoding.kpolicy import auto_policy

AUTO = "auto"
TREE_AUTO = "tree-auto"  # `--tree auto`: K auto with the policy's tree shapes beside the chains


@dataclasses.dataclass
class Measure:
    prompts: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    rounds: int = 0
    k_rounds: dict = dataclasses.field(default_factory=dict)
    tree_tokens: dict = dataclasses.field(default_factory=dict)  # `Engine.tree_tokens` of the runs


class _Setting:
    """One setting's engine, batching policy and running totals, fed groups of the prompts
    in turn: `static` batches (a batch runs until its longest row ends), `continuous`
    through `batch` slots. Seeds are the prompts' indices. With K auto, chunks of 16
    rounds at most: the policy re-decides K as acceptance estimates move."""

    def __init__(self, engine, prompts: Sequence[Sequence[int]], batch: int, batching: str, k):
        self.engine, self.prompts, self.m = engine, prompts, Measure()
        chunk = 16 if k in (AUTO, TREE_AUTO) else 1 << 30
        self.batching = (Continuous(batch, chunk_rounds=chunk) if batching == "continuous"
                         else Static(chunk_rounds=chunk))
        if engine.policy is None and len(engine.k.shapes) > 1:
            engine.policy = auto_policy(engine, batch, prompts)

    def feed(self, group: Sequence[int]) -> Iterator[None]:
        """Runs the prompts of `group`, yielding after each chunk of rounds, so that
        settings can take turns (`_take_turns`). Totals are the engine's inserts and chunks
        during the run (an engine may serve several settings, in turn, not at once)."""
        m, prompts, eng = self.m, [self.prompts[i] for i in group], self.engine
        m.prompts += len(prompts)
        m.prompt_tokens += sum(len(p) for p in prompts)
        before = eng.prefill_s, eng.decode_s, collections.Counter(eng.k_rounds)
        trees_before = {key: tuple(v) for key, v in eng.tree_tokens.items()}
        samples = yield from eng.steps(prompts, list(group), batching=self.batching)
        m.generated += sum(len(r.token_ids) for r in samples)
        m.prefill_s += eng.prefill_s - before[0]
        m.decode_s += eng.decode_s - before[1]
        k_rounds = collections.Counter(m.k_rounds) + (eng.k_rounds - before[2])
        m.k_rounds = dict(k_rounds)
        m.rounds = sum(k_rounds.values())
        for key, (kept, spine) in eng.tree_tokens.items():
            was, old = m.tree_tokens.get(key, (0.0, 0.0)), trees_before[key]
            m.tree_tokens[key] = (was[0] + kept - old[0], was[1] + spine - old[1])


_DONE = object()


def _take_turns(feeds: Sequence[Iterator[None]]) -> None:
    """Advances each of `feeds` by one step in turn until all are done: settings take
    turns call by call, so that a slow spell of the machine falls on all of them alike."""
    feeds = list(feeds)
    while feeds:
        feeds = [f for f in feeds if next(f, _DONE) is not _DONE]


def _groups(n: int, batch: int, batching: str) -> list[range]:
    """Static: the batches, in order; continuous: one stream of every prompt."""
    if batching == "continuous":
        return [range(n)]
    return [range(i, min(i + batch, n)) for i in range(0, n, batch)]


@dataclasses.dataclass(frozen=True)
class Machine:
    """What bounds a plain step here: measured streaming bandwidth and matrix-multiply rate
    (`specsamp.analysis.bench.streaming_bandwidth`, `compute_peak`)."""

    gb_per_s: float
    gflop_per_s: float


def roofline_tokens_per_s(batch: int, step_bytes: int, step_flops: int, machine: Machine) -> float:
    """Tokens/s of plain steps of `batch` rows if each step took only the longer of reading
    the weights once (bytes) and their products for every row (FLOPs per row x batch)."""
    seconds = max(step_bytes / (machine.gb_per_s * 1e9),
                  batch * step_flops / (machine.gflop_per_s * 1e9))
    return batch / seconds


def run_throughput(
    load: Callable,  # (draft, k) -> Generator
    prompts: Sequence[str],
    drafter: str,
    ks: Sequence,  # ints and/or "auto", "tree-auto"
    batch_sizes: Sequence[int],
    batchings: Sequence[str] = ("static", "continuous"),
    log: Callable[[str], None] = lambda s: None,
    machine: Machine | None = None,
    repeats: int = 1,
) -> list[dict]:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ar = load("none", 1)
    ids = [ar.encode_prompt(p) for p in prompts]
    bound = None
    if machine is not None:
        from specsamp.models import Model

        model = Model(ar.engine.prog.target)
        step = model.step_bytes(ar.engine.target_params), model.step_flops(ar.engine.target_params)
        bound = lambda b: roofline_tokens_per_s(b, *step, machine)  # noqa: E731
    rows = []
    for batch in batch_sizes:
        static: dict = {}
        for batching in batchings:
            gens = [("none", 0, ar)]
            for k in ks:
                gen = load(drafter, k)  # "auto": the generator the policy runs (wide rounds too)
                gens.append((gen.draft_id, k, gen))
            settings = [_Setting(gen.engine, ids, batch, batching, k) for _, k, gen in gens]
            # Settings take turns, so that a slow spell of the machine falls on all of
            # them alike: static batches batch by batch (every setting runs batch i before
            # any runs batch i + 1), continuous streams chunk by chunk (each setting's
            # engine keeps its own slots between its turns).
            runs = []  # each setting's (generated tokens, decode seconds) after each run
            for run in range(repeats):
                # Odd runs take the settings in reverse order: which one goes first in a
                # turn then alternates too.
                order = settings if run % 2 == 0 else settings[::-1]
                for group in _groups(len(ids), batch, batching):
                    _take_turns([setting.feed(group) for setting in order])
                runs.append([(s.m.generated, s.m.decode_s) for s in settings])
            rates = _run_rates(runs)
            base = settings[0].m
            for i, ((name, k, _), setting) in enumerate(zip(gens, settings)):
                m = setting.m
                log(f"  batch {batch} {batching} K={k}: {m.generated / m.decode_s:.1f} decode tokens/s")
                row = _row(batch, batching, name, k, m, base)
                row["repeats"] = repeats
                if repeats > 1:
                    row["speedups"] = [stats.ratio(run[i], run[0]) for run in rates]
                if name == "none":
                    if batching == "static":
                        row["continuous_bound"] = stats.ratio(m.rounds, math.ceil(m.generated / batch))
                    if bound is not None:
                        row["ar_bound_tokens_per_s"] = bound(batch)
                if batching == "static":
                    static[(name, k)] = row["decode_tokens_per_s"]
                elif (name, k) in static:
                    row["vs_static"] = row["decode_tokens_per_s"] / static[(name, k)]
                rows.append(row)
    return rows


def _run_rates(runs: list[list[tuple[int, float]]]) -> list[list[float]]:
    """Per run and setting, decode tokens/s of that run alone, from running totals."""
    out, prev = [], [(0, 0.0)] * len(runs[0])
    for run in runs:
        out.append([stats.ratio(g - g0, s - s0) for (g, s), (g0, s0) in zip(run, prev)])
        prev = run
    return out


def rounds_by_shape(k_rounds, ran_only: bool = False) -> dict[str, int]:
    """An engine's rounds per shape (`Engine.k_rounds`: int K for chains, '2x1' for trees,
    both under tree auto) keyed by the shape's text, chains by K first, then trees;
    ran_only: without the shapes that never ran."""
    order = sorted(k_rounds, key=lambda key: (isinstance(key, str), str(key).rjust(8)))
    return {str(key): k_rounds[key] for key in order if k_rounds[key] or not ran_only}


def width_gains(tree_tokens) -> dict[str, float]:
    """Each tree that ran (`Engine.tree_tokens`): the tokens its rounds emitted over those
    their spines (first-child chains) kept in the same rounds, what its width gained
    (the K policy's `width_gain` before shrinkage)."""
    return {key: float(kept / spine) for key, (kept, spine) in tree_tokens.items() if spine > 0}


def _row(batch, batching, drafter, k, m: Measure, base: Measure) -> dict:
    decode = stats.ratio(m.generated, m.decode_s)
    base_decode = stats.ratio(base.generated, base.decode_s)
    return {
        "batch_size": batch, "batching": batching, "drafter": drafter, "k": k,
        "prefill_tokens_per_s": stats.ratio(m.prompt_tokens, m.prefill_s),
        "decode_tokens_per_s": decode,
        "tokens_per_s": stats.ratio(m.generated, m.prefill_s + m.decode_s),
        "ar_tokens_per_s": stats.ratio(base.generated, base.prefill_s + base.decode_s),
        "ar_decode_tokens_per_s": base_decode,
        "speedup": stats.ratio(decode, base_decode),
        "prompts": m.prompts, "prompt_tokens": m.prompt_tokens, "generated_tokens": m.generated,
        "prefill_s": m.prefill_s, "decode_s": m.decode_s, "rounds": m.rounds,
        "tokens_per_slot_round": stats.ratio(m.generated, m.rounds * batch),
        "k_rounds": rounds_by_shape(m.k_rounds),
        **({"tree_gain": width_gains(m.tree_tokens)} if m.tree_tokens else {}),
    }


def format_throughput(rows: list[dict]) -> str:
    head = (f"{'B':>3} {'batching':>10} {'drafter':>21} {'K':>4} {'prefill t/s':>11} "
            f"{'decode t/s':>10} {'total t/s':>9} {'AR decode':>9} {'speed-up':>8} {'vs static':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        vs = f"{r['vs_static']:>8.2f}x" if "vs_static" in r else f"{'':>9}"
        lines.append(
            f"{r['batch_size']:>3} {r['batching']:>10} {r['drafter'][-21:]:>21} {str(r['k']):>4} "
            f"{r['prefill_tokens_per_s']:>11.1f} {r['decode_tokens_per_s']:>10.1f} "
            f"{r['tokens_per_s']:>9.1f} {r['ar_decode_tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x {vs}"
            + (f"  runs {min(r['speedups']):.2f}-{max(r['speedups']):.2f}x" if r.get("speedups") else ""))
    lines.append("decode t/s: generated tokens over decode wall time; total: over prefill + decode; "
                 "speed-up: decode t/s over the baseline's (same B and batching)")
    lines += _limits(rows)
    return "\n".join(lines)


def _limits(rows: list[dict]) -> list[str]:
    """One line per batch size on what bounds the baseline there."""
    out = []
    for r in rows:
        if r["drafter"] != "none" or r["batching"] != "static":
            continue
        line = (f"B={r['batch_size']}: static batches kept {r['tokens_per_slot_round']:.0%} of slot-rounds "
                f"busy (continuous batching can gain at most {r['continuous_bound']:.2f}x here)")
        if "ar_bound_tokens_per_s" in r:
            line += (f"; plain-step roofline {r['ar_bound_tokens_per_s']:.0f} t/s, "
                     f"measured {r['decode_tokens_per_s'] / r['ar_bound_tokens_per_s']:.0%} of it")
        out.append(line)
    return out
