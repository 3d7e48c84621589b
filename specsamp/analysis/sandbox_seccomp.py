"""The seccomp filter for sandboxed programs, compiled to BPF with libseccomp.

libseccomp (libseccomp.so.2, part of every Debian/Ubuntu base system) is called through
ctypes: it resolves syscall names for this architecture and writes the BPF program that
bubblewrap loads (`bwrap --seccomp FD`) just before it starts the driver. The filter allows
by default and refuses, with an error code, what a HumanEval program never needs and what
could reach beyond the sandbox: other namespaces, other processes' memory, mounts, kernel
interfaces that bypass seccomp (io_uring) or widen the kernel surface (bpf, perf, keyrings),
and every socket family but AF_UNIX. Syscalls of another ABI (i386, x32) are killed by
libseccomp's default bad-architecture action.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

_ACT_ALLOW = 0x7FFF0000
_CMP_NE, _CMP_MASKED_EQ = 1, 7
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000, 0x00000080)  # NS, CGROUP, UTS, IPC, USER, PID, NET, TIME

DENIED = (
    # other namespaces and the mount table
    "setns", "unshare", "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    # other processes (the PID namespace hides the host's; these would not need a pid)
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_send_signal",
    "pidfd_getfd", "kcmp",
    # kernel interfaces a test program has no use for
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "syslog", "name_to_handle_at", "open_by_handle_at", "iopl", "ioperm", "quotactl",
    "lookup_dcookie", "vhangup", "sethostname", "setdomainname", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "personality", "mknod", "mknodat",
    "fanotify_init", "landlock_create_ruleset",
)


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or refused to build the filter."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


def _library():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise SeccompUnavailable(f"libseccomp not found ({e}); install libseccomp2") from e
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _rules():
    """(syscall name, errno, [(arg index, compare op, a, b)]) for every refusal."""
    rules = [(name, errno.EPERM, []) for name in DENIED]
    rules.append(("socket", errno.EAFNOSUPPORT, [(0, _CMP_NE, AF_UNIX, 0)]))
    rules += [("clone", errno.EPERM, [(0, _CMP_MASKED_EQ, f, f)]) for f in CLONE_NEW_FLAGS]
    # clone3 passes its flags in memory, out of the filter's reach: ENOSYS makes glibc
    # fall back to clone, whose flags are checked above.
    rules.append(("clone3", errno.ENOSYS, []))
    rules += [("ioctl", errno.EPERM, [(1, _CMP_MASKED_EQ, 0xFFFFFFFF, req)]) for req in (TIOCSTI, TIOCLINUX)]
    return rules


@functools.lru_cache(maxsize=1)
def filter_bpf() -> bytes:
    """The compiled filter (BPF program bytes), built once per process."""
    lib = _library()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        for name, code, args in _rules():
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a syscall on this architecture
            cmps = (_ArgCmp * max(1, len(args)))(*[_ArgCmp(*a) for a in args])
            rc = lib.seccomp_rule_add_array(ctx, _errno_action(code), nr, len(args), cmps)
            if rc < 0:
                raise SeccompUnavailable(f"seccomp rule for {name}: {os.strerror(-rc)}")
        read_fd, write_fd = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctx, write_fd)
            os.close(write_fd)
            write_fd = -1
            data = _read_all(read_fd)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        if rc < 0 or not data:
            raise SeccompUnavailable(f"seccomp_export_bpf: {os.strerror(-rc) if rc < 0 else 'empty'}")
        return data
    finally:
        lib.seccomp_release(ctx)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def filter_fd() -> int:
    """A fresh readable fd holding the filter, positioned at its start (bwrap reads it once)."""
    fd = os.memfd_create("specsamp-seccomp", 0)  # not CLOEXEC: it goes to bwrap via pass_fds
    data = filter_bpf()
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
