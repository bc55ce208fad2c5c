"""Process hardening for the sandboxed workers: rlimits, parent-death signal, dumpability.

All through the standard library (`resource`, `prctl` via ctypes): the sandbox itself
(namespaces, read-only mounts, the unprivileged user) is bubblewrap's job, set up by the host.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import stat

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_PR_CAPBSET_DROP = 24
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CLONE_NEWIPC, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNS = 0x08000000, 0x10000000, 0x20000000, 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)

# name in the host's limits message -> (rlimit, multiplier to the rlimit's unit)
RLIMITS = {
    "memory_mb": (resource.RLIMIT_AS, 2**20),
    "cpu_seconds": (resource.RLIMIT_CPU, 1),
    "processes": (resource.RLIMIT_NPROC, 1),
    "open_files": (resource.RLIMIT_NOFILE, 1),
    "file_size_mb": (resource.RLIMIT_FSIZE, 2**20),
    # Queued signals count against the user that made the sandbox's user namespace too (root):
    # bounded here so one sandbox cannot use up the host's signal queue.
    "pending_signals": (resource.RLIMIT_SIGPENDING, 1),
    "locked_mb": (resource.RLIMIT_MEMLOCK, 2**20),
}


def apply(limits: dict) -> None:
    """Set hard and soft rlimits; no core dumps and no POSIX message queues in any case."""
    for name, value in limits.items():
        if name in RLIMITS and value is not None:
            which, unit = RLIMITS[name]
            bound = int(value) * unit
            hard = resource.getrlimit(which)[1]
            if hard != resource.RLIM_INFINITY:
                bound = min(bound, hard)  # a sandbox already stricter stays so
            try:
                resource.setrlimit(which, (bound, bound))
            except ValueError:
                if not (own_kernel() and hard == bound):
                    raise  # gVisor's kernel refuses to set some (queued signals: 0 already)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
    except ValueError:
        if not own_kernel():
            raise
        # gVisor's kernel refuses this limit; its message queues live in the episode's own IPC
        # namespace of a kernel no other sandbox shares, and die with it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-long write fails (EFBIG) instead of killing


def die_with_parent(parent_pid: int | None) -> None:
    """SIGKILL this process when its parent exits, whatever it is running at the time. With
    `parent_pid`, exit at once if the parent is already gone (a parent in another PID
    namespace has no pid here: the caller checks)."""
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the prctl


def volunteer_for_oom_kill() -> None:
    """Be the OOM killer's first choice in the sandbox's memory cgroup (children inherit it):
    an episode over the sandbox's memory limit ends, the warm parent stays. Raising one's own
    score needs no privilege."""
    _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # else /proc/self belongs to root, not to us
    try:
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write("1000")
    except OSError:
        pass  # no /proc/self/oom_score_adj (not Linux, or /proc hidden): the limit still holds
    finally:
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def adopt_orphans() -> None:
    """Become the subreaper of everything this process starts: orphaned grandchildren (double
    forks, new sessions) are reparented here, so `kill_descendants` finds them all."""
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def processes() -> list[tuple[int, int, str]]:
    """(pid, parent pid, state) of every process this one can see in /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat_file:
                fields = stat_file.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        found.append((int(entry), int(fields[1]), fields[0].decode()))
    return found


def kill(pids: list[int]) -> int:
    """SIGKILL each; returns how many were still there to kill."""
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def kill_descendants() -> int:
    """SIGKILL and reap every process this one started (directly or, as subreaper, not);
    returns how many. Reads /proc, which numbers processes as the sandbox's PID namespace
    does, while an episode's process has a namespace of its own: children are found by
    /proc's numbers and signalled by their numbers here. Repeats until no child is left,
    since a killed child's children are reparented here."""
    me, killed = int(os.readlink("/proc/self")), 0
    depth = len(_namespace_pids("self")) - 1
    if depth < 0 and os.getpid() == 1:
        return _kill_namespace_from_its_init()
    while True:
        children = [pid for pid, parent, _ in processes() if parent == me]
        if not children:
            break
        local = [pids[depth] for pid in children if len(pids := _namespace_pids(str(pid))) > depth]
        if not local:
            break  # gone meanwhile, or outside our namespace: nothing of ours to kill
        killed += kill(local)
        for pid in local:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return killed


def _namespace_pids(pid: str) -> list[int]:
    """A process's pid in each PID namespace it is in, outermost first ([] once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(number) for number in line.split()[1:]]
    except OSError:
        pass
    return []


def _kill_namespace_from_its_init() -> int:
    """`kill_descendants` for PID 1 of a namespace whose /proc has other numbers and no NSpid
    lines (gVisor's): kill(-1) reaches every process of the namespace but this one, atomically
    against fork, and whatever was in it is a child here (reparented to its init). Reaps them
    all; returns how many."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    reaped = 0
    while True:
        try:
            os.waitpid(-1, 0)
            reaped += 1
        except ChildProcessError:
            return reaped
        except InterruptedError:
            continue


def thread_states(pid: int) -> dict[int, tuple[str, int]]:
    """{thread id: (state, context switches so far)} of a process's threads ({} once it is
    gone). Switches grow whenever a thread runs, so equal values mean it did not run between."""
    found = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status", "rb") as status:
                fields = dict(line.split(b":", 1) for line in status.read().splitlines() if b":" in line)
            state = fields[b"State"].split()[0].decode()
            # gVisor's kernel counts no switches: 0, and only the state tells (cells.py, `_sweep_namespace`)
            switches = int(fields.get(b"voluntary_ctxt_switches", 0)) + int(fields.get(b"nonvoluntary_ctxt_switches", 0))
        except (OSError, KeyError, ValueError):
            continue  # exited meanwhile
        found[int(tid)] = (state, switches)
    return found


def all_stopped(threads: dict[int, tuple[str, int]]) -> dict[int, tuple[str, int]] | None:
    """`threads` if every one is stopped or dead (and there is one), else None."""
    if threads and all(state in "TZX" for state, _ in threads.values()):
        return threads
    return None


def live_processes(keep: set[int]) -> list[int]:
    """Processes here, `keep` aside, with a thread that is not dead: a thread-group leader that
    has exited shows as a zombie while its other threads still run."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in keep:
            if any(state not in "ZX" for state, _ in thread_states(int(entry)).values()):
                alive.append(int(entry))
    return alive


def last_pid() -> int | None:
    """The last pid this PID namespace handed out (to a process or a thread); None where the
    kernel does not say (gVisor's)."""
    try:
        with open("/proc/sys/kernel/ns_last_pid") as file:
            return int(file.read())
    except FileNotFoundError:
        return None


def descendants(root: int) -> list[int]:
    """Live processes below `root` in the process tree."""
    children: dict[int, list[int]] = {}
    for pid, parent, state in processes():
        if state not in "ZX":
            children.setdefault(parent, []).append(pid)
    found, stack = [], list(children.get(root, ()))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, ()))
    return found


def new_user_and_pid_namespace() -> None:
    """Move into a new user namespace (as the same uid and gid, mapped to themselves) whose
    next child is PID 1 of a new PID namespace. Needs no privilege: the sandbox allows nested
    user namespaces until the episode's seccomp filter refuses them."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(_CLONE_NEWUSER | _CLONE_NEWPID), "unshare(CLONE_NEWUSER | CLONE_NEWPID)")
    _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # else /proc/self belongs to root, not to us
    try:
        try:
            with open("/proc/self/setgroups", "w") as file:
                file.write("deny")
        except OSError:
            pass  # gVisor's kernel has no writable setgroups file; Linux's refuses the gid_map below without it
        for name, text in (("uid_map", f"{uid} {uid} 1\n"), ("gid_map", f"{gid} {gid} 1\n")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    finally:
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def new_ipc_and_mount_namespace() -> None:
    """SysV IPC objects and POSIX message queues of this process's own (gone when it is), and
    mounts of its own (`mask_proc`): needs the capabilities of its user namespace."""
    if own_kernel():
        # gVisor refuses mounts in nested user namespaces: no `mask_proc`, whose /proc is the
        # sandbox kernel's own anyway (no other sandbox's activity is in it).
        _check(_libc.unshare(_CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
        return
    _check(_libc.unshare(_CLONE_NEWIPC | _CLONE_NEWNS), "unshare(CLONE_NEWIPC | CLONE_NEWNS)")
    _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount(/, MS_PRIVATE)")


def own_kernel() -> bool:
    """True in a gVisor sandbox: a kernel of its own (the Sentry), which has this file."""
    return os.path.exists("/proc/sentry-meminfo")


# /proc files that are not about a process, given constant contents (what psutil, glibc and
# AppWorld read there); every other one reads as empty. `{cpus}` lines: one per CPU.
PROC_CONSTANTS = {
    "stat": "cpu  0 0 0 0 0 0 0 0 0 0\n{cpus}intr 0\nctxt 0\nbtime {btime}\nprocesses 0\n"
            "procs_running 1\nprocs_blocked 0\nsoftirq 0 0 0 0 0 0 0 0 0 0 0\n",
    "meminfo": "MemTotal: {kb} kB\nMemFree: {kb} kB\nMemAvailable: {kb} kB\nBuffers: 0 kB\nCached: 0 kB\n"
               "SwapCached: 0 kB\nActive: 0 kB\nInactive: 0 kB\nShmem: 0 kB\nSReclaimable: 0 kB\n"
               "SwapTotal: 0 kB\nSwapFree: 0 kB\n",
    "loadavg": "0.00 0.00 0.00 1/1 1\n",
    "uptime": "0.00 0.00\n",
}
_PROC_KEEP = ("self", "thread-self")  # links into this process's own entries


def mask_proc(memory_mb: int) -> list[str]:
    """Cover every entry of /proc that is not a process's: global kernel counters (memory, CPU,
    load, pressure, vmstat, locks, /proc/sys...) are a channel between concurrent sandboxes.
    Folders get an empty folder; files a constant (`PROC_CONSTANTS`, the boot time read from the
    real /proc/stat) or an empty file, all on one read-only tmpfs, itself covered. In this
    process's own mount namespace (`new_ipc_and_mount_namespace`; the warm parent and the
    supervisor keep the whole /proc), before the seccomp filter, which refuses mounts. (A fresh
    proc mount with subset=pid is refused here: bwrap's covers over /proc/irq and /proc/bus make
    the kernel deem it too revealing; a memfd cannot be bound, its mount is the kernel's.)
    Returns the names covered."""
    with open("/proc/stat", "rb") as stat_file:
        real = stat_file.read().decode(errors="replace").splitlines()
    btime = next((line.split()[1] for line in real if line.startswith("btime ")), "0")
    cpus = sum(1 for line in real if line.startswith("cpu") and line[3:4].isdigit()) or 1
    fields = {"btime": btime, "kb": memory_mb * 1024,
              "cpus": "".join(f"cpu{n} 0 0 0 0 0 0 0 0 0 0\n" for n in range(cpus))}
    folders, files = [], []
    for name in sorted(os.listdir("/proc")):
        if name.isdigit() or name in _PROC_KEEP:
            continue
        mode = os.lstat(f"/proc/{name}").st_mode
        if stat.S_ISDIR(mode):
            folders.append(name)
        elif not stat.S_ISLNK(mode):  # links (net, mounts) lead into /proc/self
            files.append(name)
    if not folders:
        raise OSError(errno.ENOENT, "/proc has no folder to hold the masks")
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    staging = f"/proc/{folders[0]}"
    _check(_libc.mount(b"none", staging.encode(), b"tmpfs", flags, b"size=64k,nr_inodes=32,mode=755"), "mount(tmpfs)")
    os.mkdir(f"{staging}/empty", 0o555)
    for name in files:
        content = PROC_CONSTANTS.get(name, "").format(**fields)
        source = f"{staging}/{name}" if content else f"{staging}/empty-file"
        if not os.path.exists(source):
            with open(source, "w") as file:
                file.write(content)
            os.chmod(source, 0o444)
    _check(_libc.mount(None, staging.encode(), None, _MS_REMOUNT | _MS_RDONLY | flags, None), "remount(tmpfs, ro)")
    for name in files:
        source = f"{staging}/{name}" if PROC_CONSTANTS.get(name) else f"{staging}/empty-file"
        _check(_libc.mount(source.encode(), f"/proc/{name}".encode(), None, _MS_BIND, None), f"mount(bind on {name})")
    for name in [*folders[1:], folders[0]]:  # the staging folder last: covered by its own empty folder
        _check(_libc.mount(f"{staging}/empty".encode(), f"/proc/{name}".encode(), None, _MS_BIND, None),
               f"mount(bind on {name})")
    return folders + files


def drop_capabilities() -> None:
    """Give up the capabilities a new user namespace grants inside it (bounding set, ambient,
    effective, permitted, inheritable). Capabilities are numbered from 0 up; the first number
    the kernel does not know ends the loop (no /proc/sys/kernel/cap_last_cap: masked)."""
    for cap in range(64):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL and cap > 0:
                break
            _check(-1, "prctl(PR_CAPBSET_DROP)")
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two of (effective, permitted, inheritable): all empty
    _check(_libc.capset(header, data), "capset")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(program: bytes) -> None:
    """Load a seccomp filter (classic BPF, as libseccomp exports it) on this process and all it
    will start; no_new_privs is set by the sandbox, so no privilege is needed."""
    if not program or len(program) % 8:
        raise ValueError(f"a seccomp program is a whole number of 8-byte instructions, got {len(program)} bytes")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what} failed: {os.strerror(number)}")


def make_undumpable() -> None:
    """No ptrace attach and no /proc/<pid>/mem for processes of the same uid."""
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def in_own_pid_namespace() -> bool:
    """True inside the sandbox, not root: the child of bubblewrap's PID 1, or gVisor's PID 1
    itself (whose parent has no pid there: 0)."""
    return os.environ.get("SEEUPO_SANDBOXED") == "1" and os.getppid() in (0, 1) and os.getuid() != 0


def read_filter(source: str) -> bytes:
    """The seccomp program from a file descriptor number (bubblewrap's memfd, closed after) or
    a read-only file's path (gVisor's bundle)."""
    fd = int(source) if source.isdigit() else os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def empty_folder(path: str) -> None:
    """Delete everything under `path`, keep `path`. Works on trees of any depth (a cell may
    nest thousands of folders) and folders a cell made unreadable: each folder's subfolders
    are moved up to `path` before the folder is removed, so only two folders are open at once."""
    root = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    moved = 0
    try:
        while True:
            with os.scandir(root) as entries:
                top = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
            if not top:
                return
            for name, is_dir in top:
                if not is_dir:
                    os.unlink(name, dir_fd=root)
                    continue
                os.chmod(name, stat.S_IRWXU, dir_fd=root)
                folder = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root)
                try:
                    with os.scandir(folder) as entries:
                        inside = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
                    for child, child_is_dir in inside:
                        if child_is_dir:
                            os.chmod(child, stat.S_IRWXU, dir_fd=folder)
                            while True:  # a free name at the top (a cell may have taken some)
                                moved += 1
                                try:
                                    os.rename(child, f".moved-{moved}", src_dir_fd=folder, dst_dir_fd=root)
                                    break
                                except OSError as error:
                                    if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                                        raise
                        else:
                            os.unlink(child, dir_fd=folder)
                finally:
                    os.close(folder)
                os.rmdir(name, dir_fd=root)
    finally:
        os.close(root)


def reset_scratch() -> None:
    """Empty the scratch folder and remake the folders the environment variables point at."""
    scratch = os.environ.get("SEEUPO_SCRATCH", "/scratch")
    empty_folder(scratch)
    for name in ("home", "tmp", "ipython", "cache", "experiments"):
        os.makedirs(os.path.join(scratch, name), exist_ok=True)


def warm_up_appworld() -> None:
    """Import AppWorld and every app's modules, so a forked episode opens its world fast."""
    import importlib

    import appworld.environment  # noqa: F401
    import appworld.evaluator  # noqa: F401
    from appworld.apps import get_all_apps

    for app in get_all_apps():
        for part in ("", ".apis", ".models"):
            try:
                importlib.import_module(f"appworld.apps.{app}{part}")
            except ModuleNotFoundError:
                pass
    import gc

    gc.collect()
    gc.freeze()  # keeps forked children from copying the parent's pages on every collection
