"""Run untrusted Python (model-written code) in a separate, limited process.

Each program gets its own process and a fresh temporary work dir, a wall-clock time limit
(the process group is killed when it runs over), and the isolation that
`specsamp/sandbox_driver.py` sets up inside the child: no network, a read-only view of
every file outside the work dir, CPU / memory / file-size limits, no new processes, and an
audit hook that refuses the same things again where namespaces are unavailable.

This is a guard against accidents and misbehaving generated code, not a hardened sandbox
against an adversary who targets it (such code could, e.g., read files or look for the
verdict's nonce in the driver's memory). Evaluate code from untrusted sources inside a
container or VM as well.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_driver.py")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use. `namespaces` and `guard` exist to test each layer alone."""

    timeout_s: float = 10.0
    memory_mb: int = 2048
    file_mb: int = 16
    namespaces: bool = True
    guard: bool = True


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str  # 'passed' | 'failed' | 'timed out'
    detail: str
    seconds: float
    isolation: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Run `source` as a script in a fresh sandboxed process; it passes if it raises nothing."""
    workdir = tempfile.mkdtemp(prefix="specsamp-eval-")
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "workdir": workdir, "program": source, "limits": {
        "cpu_s": int(limits.timeout_s) + 1, "memory_mb": limits.memory_mb,
        "file_mb": limits.file_mb, "namespaces": limits.namespaces, "guard": limits.guard}}
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", _DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=workdir, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(json.dumps(job).encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return Outcome("timed out", f"over {limits.timeout_s:g} s", time.monotonic() - start, "")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _outcome(nonce, out.decode(errors="replace"), err.decode(errors="replace"),
                    proc.returncode, time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only the program and its children
    except ProcessLookupError:
        pass
    proc.communicate()


def _outcome(nonce: str, out: str, err: str, returncode: int, seconds: float) -> Outcome:
    lines = {}
    for line in out.splitlines():
        head, _, rest = line.partition(" ")
        if head == nonce:
            kind, _, detail = rest.partition(" ")
            lines[kind] = detail
    isolation = lines.get("isolation", "")
    if "passed" in lines:
        return Outcome("passed", "", seconds, isolation)
    if "failed" in lines:
        return Outcome("failed", lines["failed"], seconds, isolation)
    if returncode and returncode < 0:
        reason = f"killed by {signal.Signals(-returncode).name}"  # e.g. SIGXCPU, SIGKILL (memory)
        status = "timed out" if -returncode == signal.SIGXCPU else "failed"
        return Outcome(status, reason, seconds, isolation)
    tail = " ".join(err.split())[-300:]
    return Outcome("failed", f"no verdict (exit {returncode}) {tail}".strip(), seconds, isolation)
