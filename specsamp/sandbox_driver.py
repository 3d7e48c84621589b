"""Runs one untrusted program inside the limits `specsamp.sandbox` asks for (stdlib only).

Started as `python -I -B sandbox_driver.py` by `specsamp.sandbox.run_program`, never
imported. It reads one JSON object from stdin (nonce, work dir, limits, program source),
then, in this order, before the program runs:
  1. namespaces (Linux): a new network namespace (no interfaces: every connect fails) and a
     new mount namespace in which every mount is read-only except the work dir. Run as a
     user other than root, a user namespace is created first (where the kernel allows it);
  2. resource limits: CPU seconds, address space, file size, open files, no core files,
     no new processes (RLIMIT_NPROC 0; root in the host namespace is exempt, step 3 is not);
  3. an audit hook (PEP 578), which cannot be removed once added, refusing process creation,
     sockets, ctypes calls, and file writes, deletes, renames and permission changes outside the
     work dir: a second line where namespaces are unavailable.
The program's stdout and stderr go to /dev/null. The verdict is one line on the original
stdout, prefixed by the nonce the program never sees: "<nonce> passed" or
"<nonce> failed <reason>". The program runs with __name__ == "__sandbox__", so
`if __name__ == "__main__":` blocks in it are skipped.
"""

import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000
MS_REC, MS_PRIVATE, MS_BIND = 0x4000, 1 << 18, 0x1000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_RECURSIVE, AT_FDCWD = 0x1, 0x2, 0x8000, -100
SYS_MOUNT_SETATTR = 442  # the same number on every Linux architecture (new syscall table)

BLOCKED_EVENTS = {
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "resource.setrlimit",
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
    "sys.remote_exec", "webbrowser.open",
    # ctypes may be imported (numpy does), but not used to reach C functions or raw memory.
    "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
    "ctypes.cdata/buffer", "ctypes.string_at", "ctypes.wstring_at",
}
PATH_EVENTS = {
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown",
    "os.link", "os.symlink", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile",
    "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr",
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def isolate_namespaces(workdir: str) -> str:
    """Enter fresh network and mount namespaces; return what was achieved, in words."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNS | CLONE_NEWNET | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
    if libc.unshare(flags) != 0:
        return "no namespaces (" + os.strerror(ctypes.get_errno()) + ")"

    class MountAttr(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("set", "clr", "propagation", "userns_fd")]

    def setattr_(path: str, recursive: bool, attr: "MountAttr") -> int:
        return libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(),
                            AT_RECURSIVE if recursive else 0, ctypes.byref(attr), ctypes.sizeof(attr))

    ok = (libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
          and libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None) == 0
          and setattr_("/", True, MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)) == 0
          and setattr_(workdir, False, MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)) == 0)
    if not ok:
        return "network namespace; filesystem writable (" + os.strerror(ctypes.get_errno()) + ")"
    return "network and read-only mount namespaces"


def set_limits(limits: dict) -> None:
    cpu = int(limits["cpu_s"])
    mem = int(limits["memory_mb"]) << 20
    fsize = int(limits["file_mb"]) << 20
    for name, value in (("RLIMIT_CPU", cpu), ("RLIMIT_AS", mem), ("RLIMIT_FSIZE", fsize),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", 0)):
        if hasattr(resource, name):
            resource.setrlimit(getattr(resource, name), (value, value))


def install_guard(workdir: str) -> None:
    """The audit hook: refuse what could reach beyond the work dir."""
    root = os.path.realpath(workdir)
    realpath, join, getcwd, fspath = os.path.realpath, os.path.join, os.getcwd, os.fspath

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an fd already open
        p = realpath(join(getcwd(), fspath(path)))
        return p == root or p.startswith(root + os.sep) or p == os.devnull

    def hook(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(flags, int) and flags & WRITE_FLAGS) or (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} is not allowed")
        elif event in PATH_EVENTS:
            for a in args:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} on {a!r} is not allowed")

    sys.addaudithook(hook)


def main() -> None:
    job = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # stdin is spent: the program cannot read the nonce
    verdict_fd = os.dup(1)
    workdir, limits = job["workdir"], job["limits"]
    isolation = "no namespaces"
    if limits.get("namespaces", True):
        try:
            isolation = isolate_namespaces(workdir)
        except (AttributeError, OSError) as e:  # not Linux: the guard and limits remain
            isolation = f"no namespaces ({type(e).__name__})"
    os.chdir(workdir)
    set_limits(limits)
    if limits.get("guard", True):
        install_guard(workdir)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        code = compile(job["program"], "program.py", "exec")
        exec(code, {"__name__": "__sandbox__", "__builtins__": __builtins__})
        verdict = "passed"
    except BaseException as e:  # SystemExit and KeyboardInterrupt included: all are failures
        verdict = "failed " + " ".join(f"{type(e).__name__}: {e}".split())[:300]
    os.write(verdict_fd, f"{job['nonce']} {verdict}\n{job['nonce']} isolation {isolation}\n".encode())


if __name__ == "__main__":
    main()
