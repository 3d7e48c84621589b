"""Differential testing of HumanEval completions: the verdict the trusted side decides.

The untrusted program never sees the expected answers and never reports a verdict:
1. `record_references`: each problem's canonical solution runs under its own `check` in a
   sandbox, with a stand-in that records every call's arguments and the canonical result
   (tests that draw random inputs are seeded, so the inputs repeat from run to run).
2. The completion runs in another sandbox on those arguments and returns its outputs as
   Python literals (the test code, with its expected values, is sent only after that).
3. `compare` (here, in the trusted process) reads the outputs with `ast.literal_eval`, which
   builds plain data only, and compares them with the canonical results, type-aware:
   bool is not int, list is not tuple, str is not bytes; numbers compare by value, floats
   within 1e-6 (absolute or relative), as the HumanEval tests' own tolerances allow. An
   object with an always-true `__eq__` never gets here: it is not a literal.
Problems with more than one right answer get their own checker, as in EvalPlus: find_zero
(HumanEval/32) passes when the polynomial is within 1e-4 of zero at the returned point.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import math

from specsamp.analysis.sandbox import Limits, Sandbox

FLOAT_TOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Reference:
    """One problem's recorded calls: (args literal, kwargs literal, canonical result)."""

    calls: tuple = ()
    error: str = ""

    @property
    def inputs(self) -> list[list[str]]:
        return [[a, k] for a, k, _ in self.calls]


def record_references(sandbox: Sandbox, problems: dict[str, dict], limits: Limits,
                      workers: int) -> dict[str, Reference]:
    """Reference calls for every problem (task id -> problem), in `workers` sandboxes."""
    ids = sorted(problems)
    chunks = [ids[i::workers] for i in range(min(workers, len(ids)))]

    def one(chunk: list[str]) -> dict[str, Reference]:
        job = {"kind": "record", "problems": [
            {"key": t, "program": problems[t]["prompt"] + problems[t]["canonical_solution"],
             "test": problems[t]["test"], "entry": problems[t]["entry_point"]} for t in chunk]}
        ex = sandbox.exchange(job, dataclasses.replace(limits, timeout_s=limits.timeout_s * len(chunk)))
        if not ex.replies:  # the sandbox itself failed: no verdict would mean anything
            raise RuntimeError(f"recording the reference outputs failed: {ex.stderr.strip()[-300:] or 'no reply'}")
        results = ex.replies[0].get("results", {})
        return {t: _reference(results.get(t)) for t in chunk}

    refs: dict[str, Reference] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(chunks))) as pool:
        for part in pool.map(one, chunks):
            refs.update(part)
    return refs


def _reference(result) -> Reference:
    if not isinstance(result, dict) or "calls" not in result:
        error = result.get("error", "") if isinstance(result, dict) else ""
        return Reference(error=f"no reference: {error or 'recording failed'}")
    try:
        calls = tuple((a, k, ast.literal_eval(out)) for a, k, out in result["calls"])
    except (ValueError, SyntaxError, TypeError) as e:
        return Reference(error=f"no reference: {type(e).__name__}")
    return Reference(calls=calls) if calls else Reference(error="no reference: the test makes no calls")


def compare(task_id: str, reference: Reference, reply: dict | None) -> tuple[bool, str]:
    """(passed, why not) for the candidate's phase-1 reply against the reference."""
    if reference.error:
        return False, reference.error
    if not isinstance(reply, dict) or not isinstance(reply.get("outputs"), list):
        return False, "no outputs" if not isinstance(reply, dict) or "error" not in reply else "program raised"
    outputs = reply["outputs"]
    if len(outputs) != len(reference.calls):
        return False, f"{len(outputs)} outputs for {len(reference.calls)} inputs"
    checker = CHECKERS.get(task_id, lambda args, got, expected: same(got, expected))
    for i, (out, (args, _, expected)) in enumerate(zip(outputs, reference.calls)):
        if not (isinstance(out, list) and len(out) == 2 and out[0] == "ok" and isinstance(out[1], str)):
            return False, f"input {i}: raised or returned no literal"
        try:
            got = ast.literal_eval(out[1])
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return False, f"input {i}: output is not plain data"
        if not checker(args, got, expected):
            return False, f"input {i}: wrong output"
    return True, ""


def same(a, b) -> bool:
    """Type-aware equality of plain data (see the module docstring)."""
    numbers = (int, float)
    if type(a) is bool or type(b) is bool:
        return type(a) is type(b) and a == b
    if type(a) in numbers and type(b) in numbers:
        if float in (type(a), type(b)):
            return _close(float(a), float(b))
        return a == b
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def _close(x: float, y: float) -> bool:
    try:
        return math.isclose(x, y, rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)
    except OverflowError:
        return False


def _poly_root(args: str, got, expected) -> bool:
    """find_zero: any point where the polynomial is within 1e-4 of zero (its test's bound)."""
    coeffs = ast.literal_eval(args)[0]
    if type(got) not in (int, float):
        return False
    try:
        return math.fabs(sum(c * math.pow(got, i) for i, c in enumerate(coeffs))) < 1e-4
    except (OverflowError, ValueError):
        return False


CHECKERS = {"HumanEval/32": _poly_root}
