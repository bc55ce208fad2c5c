"""A memory cgroup per sandbox: one bound on the resident memory of all its processes together
(and, asked for, on its host tasks: processes and threads, a pids cgroup).

Rlimits bound each process alone (RLIMIT_AS), so model code that forks can hold memory
limit x processes. A cgroup bounds the sum: past it, the kernel's OOM killer ends a process
of that sandbox only (episode processes volunteer, see `worker/cells.py`).

The cgroup is made under this process's own memory cgroup, which must be writable: cgroup v1
(`/sys/fs/cgroup/memory/...`), or cgroup v2 with the memory controller delegated to it (a
systemd `Delegate=yes` unit, a container runtime that delegates). Its name carries the owning
process's pid, so groups left by a SIGKILLed owner are found and removed by the next one.

A bound on host tasks (`max_tasks`, for gVisor, whose Sentry runs a sandbox's processes as host
threads and stub processes: about 500 host tasks at the sandbox's 64 processes) goes in the
same group under cgroup v2, and in a twin group of the v1 pids hierarchy under cgroup v1;
where this machine has no pids controller to use, `max_tasks` is None after construction.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "seeupo-sandbox-"
_counter = itertools.count()


class MemoryCgroupUnavailable(RuntimeError):
    """No writable memory cgroup here; the message says why."""


def _own_memory_cgroup() -> tuple[Path, int]:
    """(folder of this process's memory cgroup, cgroup version)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory" / path.lstrip("/"), 1
    for line in lines:
        if line.startswith("0::"):
            return CGROUP_ROOT / line[3:].lstrip("/"), 2
    raise MemoryCgroupUnavailable("this process is in no memory cgroup (/proc/self/cgroup)")


def parent_group() -> tuple[Path, int]:
    """Where sandbox groups are made, checked to be usable; raises MemoryCgroupUnavailable."""
    folder, version = _own_memory_cgroup()
    if not folder.is_dir():
        raise MemoryCgroupUnavailable(f"{folder} is not mounted here (a container without its cgroup file system?)")
    if version == 2 and "memory" not in (folder / "cgroup.subtree_control").read_text().split():
        raise MemoryCgroupUnavailable(
            f"the memory controller is not enabled for children of {folder} (cgroup v2 without delegation)"
        )
    if not os.access(folder, os.W_OK):
        raise MemoryCgroupUnavailable(f"{folder} is not writable by this user (no delegated cgroup)")
    return folder, version


def _own_pids_cgroup_v1() -> Path | None:
    """This process's cgroup in the v1 pids hierarchy, if there is a writable one."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            folder = CGROUP_ROOT / "pids" / path.lstrip("/")
            return folder if folder.is_dir() and os.access(folder, os.W_OK) else None
    return None


class MemoryCgroup:
    """A child memory cgroup with a hard limit; processes written to it, and all they start,
    share the limit (and `max_tasks`, where given and this machine has a pids controller).
    `remove` deletes it once they are gone."""

    def __init__(self, limit_bytes: int, max_tasks: int | None = None) -> None:
        parent, self.version = parent_group()
        sweep_orphans(parent)
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.path = parent / name
        self.pids_path: Path | None = None  # the v1 pids twin
        try:
            self.path.mkdir()
        except OSError as error:
            raise MemoryCgroupUnavailable(f"cannot make a cgroup under {parent}: {error}") from error
        self.limit_bytes = limit_bytes
        self.max_tasks: int | None = None
        if max_tasks is not None:
            self._bound_tasks(parent, name, max_tasks)
        try:
            if self.version == 1:
                self._write("memory.limit_in_bytes", limit_bytes)
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    self._write("memory.memsw.limit_in_bytes", limit_bytes)  # no escape into swap
            else:
                self._write("memory.max", limit_bytes)
                if (self.path / "memory.swap.max").exists():
                    self._write("memory.swap.max", 0)
        except OSError as error:
            self.remove()
            raise MemoryCgroupUnavailable(f"cannot set a memory limit in {self.path}: {error}") from error

    def _bound_tasks(self, parent: Path, name: str, max_tasks: int) -> None:
        try:
            if self.version == 2:
                if "pids" in (parent / "cgroup.subtree_control").read_text().split():
                    self._write("pids.max", max_tasks)
                    self.max_tasks = max_tasks
                return
            pids_parent = _own_pids_cgroup_v1()
            if pids_parent is None:
                return
            sweep_orphans(pids_parent)
            self.pids_path = pids_parent / name
            self.pids_path.mkdir()
            (self.pids_path / "pids.max").write_text(str(max_tasks))
            self.max_tasks = max_tasks
        except OSError:
            self.max_tasks = None  # no usable pids controller: the caller warns

    @property
    def procs_files(self) -> list[Path]:
        """The `cgroup.procs` files a process is written to, to be in every group of this one."""
        return [self.path / "cgroup.procs"] + ([self.pids_path / "cgroup.procs"] if self.pids_path else [])

    def add(self, pid: int) -> None:
        """Move a process in; what it starts from then on is in too."""
        for procs in self.procs_files:
            procs.write_text(str(pid))

    def tasks(self) -> int | None:
        """Host tasks (processes and threads) in the group now, where it has a pids bound."""
        folder = self.pids_path or self.path
        try:
            return int((folder / "pids.current").read_text())
        except (OSError, ValueError):
            return None

    def usage_bytes(self) -> int:
        return self._read_int("memory.usage_in_bytes" if self.version == 1 else "memory.current")

    def peak_bytes(self) -> int | None:
        """Highest usage so far (None where the kernel does not keep it)."""
        try:
            return self._read_int("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        except OSError:
            return None

    def oom_kills(self) -> int:
        """Processes the OOM killer has ended in this group so far."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def remove(self, timeout: float = 5.0) -> None:
        """Delete the group: kill what is left in it, then rmdir (busy until the kernel has
        finished with the dead processes)."""
        _remove(self.path, timeout)
        if self.pids_path is not None:
            _remove(self.pids_path, timeout)

    def _write(self, name: str, value: int) -> None:
        (self.path / name).write_text(str(value))

    def _read_int(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])


def _remove(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        for pid in _procs(path):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(0.02)


def _procs(path: Path) -> list[int]:
    try:
        return [int(pid) for pid in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def sweep_orphans(parent: Path) -> list[Path]:
    """Remove groups whose owning process is gone (SIGKILLed before it could remove them)."""
    removed = []
    for path in parent.glob(PREFIX + "*"):
        try:
            owner = int(path.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if psutil.pid_exists(owner):
            continue
        if _remove(path, timeout=1.0):
            removed.append(path)
    return removed
