"""Runs inside the sandbox: executes programs and reports plain data (stdlib only).

Started by `specsamp.analysis.sandbox` as `python -s -S -B -P -c <this source>`, never imported. It talks
to the trusted parent over its stdin and stdout pipes in frames (4-byte big-endian length,
then UTF-8 JSON), which it moves to private fds before any program runs; the program's own
stdin, stdout and stderr are /dev/null. Jobs (the "kind" of the first frame):
- "probe": report what the sandbox looks like from inside (uid, capabilities, seccomp mode,
  no_new_privs, visible processes, network interfaces) before anything untrusted runs.
- "record": trusted code only (canonical solutions and the datasets' tests). Each test's
  `check` gets a recording stand-in for the solution; every call's arguments and the
  canonical result go back as Python literals.
- "candidate": untrusted code. Phase 1 runs the program and calls its entry point on the
  given inputs; the outputs go back as literals (plain types only, size-limited). Only then
  does the parent send phase 2, the full HumanEval program with its test, whose outcome
  goes back too. The parent decides from phase 1's outputs; it believes nothing in the
  replies but plain data it checks itself, because the program runs in this process and can
  change anything here, the driver included.
Programs run with __name__ == "__sandbox__", so their `if __name__ == "__main__":` blocks
are skipped.
"""

import ast
import copy
import json
import os
import random
import resource
import struct
import sys

MAX_LITERAL = 1 << 16  # characters of one serialised value
PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
PLAIN_CONTAINERS = (list, tuple, set, frozenset, dict)


def recv(fd: int) -> dict:
    header = _read_exactly(fd, 4)
    return json.loads(_read_exactly(fd, struct.unpack(">I", header)[0]).decode())


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("parent closed the channel")
        data += chunk
    return data


def send(fd: int, obj: dict) -> None:
    payload = json.dumps(obj).encode()
    data = struct.pack(">I", len(payload)) + payload
    while data:
        data = data[os.write(fd, data):]


def literal(value, depth: int = 0) -> str:
    """repr of plain data (exact builtin types only), which ast.literal_eval reads back."""
    check_plain(value, depth)
    text = repr(value)
    if len(text) > MAX_LITERAL:
        raise ValueError(f"value longer than {MAX_LITERAL} characters")
    return text


def check_plain(value, depth: int = 0) -> None:
    if depth > 50:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if kind is float and value != value or kind is float and value in (float("inf"), float("-inf")):
        raise ValueError("nan or infinity is not a literal")
    if kind in PLAIN_SCALARS:
        return
    if kind not in PLAIN_CONTAINERS:
        raise TypeError(f"{kind.__name__} is not plain data")
    items = [x for kv in value.items() for x in kv] if kind is dict else value
    for item in items:
        check_plain(item, depth + 1)


def set_limits(limits: dict) -> None:
    for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_mb"] << 20),
                        ("RLIMIT_FSIZE", limits["file_mb"] << 20), ("RLIMIT_NOFILE", 64),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", limits["processes"])):
        if hasattr(resource, name):
            resource.setrlimit(getattr(resource, name), (int(value), int(value)))


def run(source: str) -> dict:
    namespace = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    exec(compile(source, "program.py", "exec"), namespace)
    return namespace


def describe(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def probe() -> dict:
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    with open("/proc/net/dev") as f:  # this network namespace's interfaces
        nets = [line.split(":")[0].strip() for line in f if ":" in line]
    return {"uid": os.getuid(), "gid": os.getgid(), "pids": len(pids), "net": nets,
            **{k: status.get(k, "").strip() for k in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp")}}


def record(job: dict) -> dict:
    results = {}
    for item in job["problems"]:
        random.seed(0)  # tests that draw random inputs draw the same ones every run
        calls = []
        try:
            namespace = run(item["program"])
            solution = namespace[item["entry"]]

            def recorder(*args, **kwargs):
                call = [literal(copy.deepcopy(args)), literal(copy.deepcopy(kwargs))]
                calls.append(call)
                out = solution(*args, **kwargs)
                call.append(literal(out))
                return out

            exec(compile(item["test"], "test.py", "exec"), namespace)
            namespace["check"](recorder)
            results[item["key"]] = {"calls": calls}
        except BaseException as e:
            results[item["key"]] = {"error": describe(e)}
    return {"results": results}


def candidate_outputs(job: dict) -> dict:
    try:
        solution = run(job["program"])[job["entry"]]
    except BaseException as e:
        return {"error": describe(e)}
    outputs = []
    for args, kwargs in job["inputs"]:
        try:
            out = solution(*ast.literal_eval(args), **ast.literal_eval(kwargs))
            outputs.append(["ok", literal(out)])
        except BaseException as e:  # an exception is an output too: the reference may raise
            outputs.append(["raise", type(e).__name__])
    return {"outputs": outputs}


def plain_check(job: dict) -> dict:
    try:
        run(job["program"])
        return {"check": "passed"}
    except BaseException as e:
        return {"check": "failed", "detail": describe(e)}


def main() -> None:
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    job = recv(rfd)
    if job["kind"] == "probe":
        send(wfd, probe())
        return
    os.chdir(job.get("workdir") or os.getcwd())
    set_limits(job["limits"])
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 3000))
    if job["kind"] == "record":
        send(wfd, record(job))
        return
    send(wfd, candidate_outputs(job))
    send(wfd, plain_check(recv(rfd)))


if __name__ == "__main__":
    main()
