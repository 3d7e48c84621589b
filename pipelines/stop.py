"""Clean stops of a local run: SIGINT / SIGTERM end it with one line and exit 130 / 143.

Beam catches and wraps exceptions raised inside a job (a KeyboardInterrupt turns into a
runner traceback), and the DirectRunner's worker processes would print their own. So the
signals are not delivered as exceptions at all: while a job runs they are blocked in the
threads and worker processes the job starts (which inherit the mask), and a watcher thread
takes them with `sigwait`; a thread that existed before (and so does not block them) runs
the same stop through a Python handler. The stop kills the job's processes, prints the line
and exits at once:
committed shards are whole files (see `pipelines.commit`), so nothing committed is lost and
nothing half-written is visible; rows not yet committed are redone by the next run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

_STOP = (signal.SIGINT, signal.SIGTERM)
_NAMES = {signal.SIGINT: ("SIGINT", "interrupted"), signal.SIGTERM: ("SIGTERM", "terminated")}
_LAUNCHER = "SPECSAMP_LAUNCHER_PID"  # set while a local job runs; worker processes inherit it
_DONE = signal.SIGUSR2  # wakes the watcher when the job ends normally


@contextlib.contextmanager
def stops_cleanly(message):
    """Run the body with SIGINT / SIGTERM handled as clean stops; `message(signum)` gives
    the line to print. Only in the main thread (elsewhere signals are not ours)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = set(_STOP) | {_DONE}
    os.environ[_LAUNCHER] = str(os.getpid())
    handlers = {s: signal.signal(s, lambda signum, frame: _stop(signum, message)) for s in _STOP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    watcher = threading.Thread(target=_watch, args=(wanted, message), name="specsamp-stop", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.pthread_kill(watcher.ident, _DONE)
        watcher.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        os.environ.pop(_LAUNCHER, None)


def signal_words(signum: int) -> tuple[str, str]:
    """(the signal's name, what it did to the run) for a stop's line."""
    return _NAMES.get(signum, (f"signal {signum}", "stopped"))


def kept_in(output: str) -> str:
    """What a stopped or failed run leaves, and how to go on (every runner commits whole
    shards, so the same command resumes)."""
    return f"the rows committed so far are kept in {output}; run the same command again to resume"


def ignore_interrupts_in_worker() -> None:
    """In a local job's worker process, ignore Ctrl-C: the terminal sends it to the whole
    process group, and the launcher stops the job (workers would print tracebacks). The
    worker is started by a shell that unblocks signals, and this runs off its main thread,
    where Python's `signal.signal` is refused: so the C library's `signal` is called."""
    launcher = os.environ.get(_LAUNCHER)
    if not launcher or launcher == str(os.getpid()):
        return
    try:
        import ctypes

        ctypes.CDLL(None).signal(signal.SIGINT, ctypes.c_void_p(1))  # SIG_IGN
    except (OSError, AttributeError):  # no C library to call: tracebacks, nothing worse
        pass


def _watch(wanted: set, message) -> None:
    signum = signal.sigwait(wanted)
    if signum != _DONE:
        _stop(signum, message)


_ONCE = threading.Lock()


def _stop(signum: int, message) -> None:
    if not _ONCE.acquire(blocking=False):
        return  # the other path is already stopping
    try:
        # Runner threads report the killed workers as they go: their noise goes nowhere.
        sys.stderr.flush()
        err = os.dup(2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        _wait_gone(kill_descendants())
        os.write(err, (message(signum) + "\n").encode())
    finally:
        os._exit(128 + signum)


def kill_descendants() -> list[int]:
    """SIGKILL every process started below this one (the runner's worker processes);
    returns their ids."""
    pids = _descendants(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return pids


def _wait_gone(pids: list[int], seconds: float = 5.0) -> None:
    """Wait until the killed processes have exited (a zombie counts as gone): SIGKILL is
    delivered asynchronously, and a write in flight finishes first, so only then can the
    stop's message sweep what they left (`pipelines.commit.remove_stale_temps`)."""
    import time

    deadline = time.monotonic() + seconds
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except (OSError, IndexError):
                break
            time.sleep(0.02)


def spawned_processes(root: int) -> list[int]:
    """Processes below `root` started by multiprocessing's spawn (a LocalCluster's Dask
    workers, the FnApiRunner's multi-processing workers): what a worker-kill test kills."""
    out = []
    for pid in _descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(pid)
        except OSError:  # gone meanwhile
            pass
    return out


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # not Linux: nothing to find this way
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
