"""The sandboxes' seccomp filter: kernel interfaces AppWorld has no use for, refused.

Namespaces bound what model code can reach; the kernel itself stays reachable through every
system call. This filter refuses the ones that widen that surface and that no AppWorld code
needs: new namespaces (a nested user namespace grants every capability inside it), mounts,
ptrace and cross-process memory, BPF, perf events, userfaultfd, io_uring, keyrings, kernel
modules; and kernel budgets one sandbox could use up for the host or another sandbox
(inotify instances are charged to the user that made the sandbox's user namespace, root;
`F_SETPIPE_SZ` draws on a per-user pipe budget). Sockets: only AF_UNIX (AppWorld talks to its
apps in-process; asyncio's self-pipe is a Unix socketpair); AF_VSOCK, in particular, is not
namespaced and would reach the virtual machine's host.

Files every sandbox binds from the host (the interpreter, the venv, the API docs) are the same
inodes in all of them, so whatever state the kernel keeps per inode and lets one process set
and another read is a channel between concurrent episodes. The model-code filter
(`filter_program(model_code=True)`, loaded on each episode's process) closes them all: record
locks (`fcntl` F_SETLK/F_SETLKW and their OFD forms) and `flock` report success and take no
lock, asking for one (F_GETLK, F_OFD_GETLK) is refused, and so are leases, directory
notifications (`F_NOTIFY` reports other processes' reads) and the page-cache probes that need
no clock (`mincore`, `cachestat`, `preadv2`/`pwritev2` with RWF_NOWAIT, fadvise DONTNEED to
evict); so is `sysinfo` (the machine's memory, load and process counts, which every other
sandbox moves). seccomp cannot see paths, so the episode's own scratch files get no locks either;
AppWorld needs none (its DBs are in memory, read once from the task's files by one process).
The grader runs no model code and keeps real locks (SQLite writes the DBs it builds). Built with libseccomp (as flatpak builds the filters it hands bubblewrap), exported
as BPF, and loaded by bwrap (`--seccomp FD`) just before it starts the worker; no_new_privs
is already set, so no privilege is needed. The cell sandbox loads it per episode instead
(`worker/limits.py`, `load_seccomp`), after the episode's own namespaces are made. System calls of other architectures (32-bit
`int 0x80` on x86-64) are killed: libseccomp's default for a foreign architecture.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

REFUSED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "syslog", "acct", "quotactl",
    "swapon", "swapoff", "reboot", "iopl", "ioperm",
    "inotify_init", "inotify_init1",
)
SOCKET_FAMILIES = (1,)  # AF_UNIX; socket(2) and socketpair(2) with any other family: EAFNOSUPPORT
F_SETPIPE_SZ = 1031
# fcntl commands on per-inode state another sandbox could see. Taking a lock (F_SETLK,
# F_SETLKW, their OFD forms; flock) "succeeds" and takes none: the kernel then holds no lock
# of any sandbox, and honest single-process users (SQLite reading the task's DBs) work on.
# Asking for one (F_GETLK, F_OFD_GETLK), leases and directory notifications are refused.
FAKED_LOCKS = (6, 7, 37, 38)
REFUSED_FCNTL = (5, 36, 1024, 1025, 1026)
RWF_NOWAIT = 0x8
POSIX_FADV_DONTNEED = 4
# clone(2) flags that make namespaces; clone3 hides its flags in memory, so it gets ENOSYS and
# the C library falls back to clone, whose flags the filter can see.
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)

_ACT_ALLOW = 0x7FFF0000
_CMP_NE = 1
_CMP_MASKED_EQ = 7
_INT_MASK = 0xFFFFFFFF  # int arguments: the kernel reads the low 32 bits


def _act_errno(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


class SeccompUnavailable(RuntimeError):
    """No libseccomp here; the message says what to install."""


@functools.cache
def filter_program(model_code: bool = True) -> bytes:
    """The filter as a BPF program (what bwrap's --seccomp reads); built once per process and kind.

    model_code: also refuse what would let concurrent episodes talk through shared inodes
    (locks, leases, notifications, page-cache probes); False for the grader only.
    """
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as error:
        raise SeccompUnavailable(
            f"libseccomp is not installed ({error}); install it (Debian/Ubuntu: libseccomp2, Fedora: libseccomp)"
        ) from error
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    context = lib.seccomp_init(_ACT_ALLOW)
    if not context:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        def refuse(syscall: str, action: int, *conditions: _ArgCmp) -> None:
            number = lib.seccomp_syscall_resolve_name(syscall.encode())
            if number < 0:
                return  # not a system call of this architecture
            array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
            if lib.seccomp_rule_add_array(context, action, number, len(conditions), array) != 0:
                raise SeccompUnavailable(f"libseccomp refused a rule for {syscall}")

        for syscall in REFUSED:
            refuse(syscall, _act_errno(errno.EPERM))
        for flag in NAMESPACE_FLAGS:
            refuse("clone", _act_errno(errno.EPERM), _ArgCmp(0, _CMP_MASKED_EQ, flag, flag))
        refuse("clone3", _act_errno(errno.ENOSYS))
        # Any family but AF_UNIX, compared on all 64 bits: high bits set are refused as well.
        assert SOCKET_FAMILIES == (1,), "one family: libseccomp takes one comparison per argument"
        for syscall in ("socket", "socketpair"):
            refuse(syscall, _act_errno(errno.EAFNOSUPPORT), _ArgCmp(0, _CMP_NE, SOCKET_FAMILIES[0], 0))
        refuse("fcntl", _act_errno(errno.EPERM), _ArgCmp(1, _CMP_MASKED_EQ, _INT_MASK, F_SETPIPE_SZ))
        if model_code:
            for command in FAKED_LOCKS:
                refuse("fcntl", _act_errno(0), _ArgCmp(1, _CMP_MASKED_EQ, _INT_MASK, command))
            for command in REFUSED_FCNTL:
                refuse("fcntl", _act_errno(errno.EPERM), _ArgCmp(1, _CMP_MASKED_EQ, _INT_MASK, command))
            refuse("flock", _act_errno(0))
            for syscall in ("mincore", "cachestat"):
                refuse(syscall, _act_errno(errno.ENOSYS))
            for syscall in ("preadv2", "pwritev2"):
                refuse(syscall, _act_errno(errno.EOPNOTSUPP), _ArgCmp(5, _CMP_MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT))
            refuse("fadvise64", _act_errno(errno.EPERM), _ArgCmp(3, _CMP_MASKED_EQ, _INT_MASK, POSIX_FADV_DONTNEED))
            # The machine's memory, swap, load and process count: global counters another
            # sandbox moves (its /proc twins are masked, `worker/limits.py` `mask_proc`).
            refuse("sysinfo", _act_errno(errno.EPERM))
        read_end, write_end = os.pipe()
        try:
            # Small enough for the pipe's buffer (a few KiB against 64 KiB).
            if lib.seccomp_export_bpf(context, write_end) != 0:
                raise SeccompUnavailable("seccomp_export_bpf failed")
            os.close(write_end)
            write_end = -1
            chunks = []
            while chunk := os.read(read_end, 65536):
                chunks.append(chunk)
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        return b"".join(chunks)
    finally:
        lib.seccomp_release(context)


def filter_fd(model_code: bool = True) -> int:
    """A fresh file descriptor holding the filter, for one bwrap to read (it reads it to the end)."""
    fd = os.memfd_create("seeupo-seccomp", os.MFD_CLOEXEC)
    os.write(fd, filter_program(model_code))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
