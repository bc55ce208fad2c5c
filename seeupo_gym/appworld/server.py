"""AppWorld servers: per env, a sandboxed cell worker and a sandboxed grader, and their pool.

An open AppWorld freezes time for its whole process, allows one world per process and needs
the main thread for its code timeout, so worlds never run in the caller's process. And model
code is an adversary (RL finds any route from it to the host or the grader), so it runs
only in an episode process that is
- forked per episode from a warm parent that has imported AppWorld but run no model code,
  into user, PID and IPC namespaces of the episode's own (the warm parent has no pid there),
- inside a gVisor sandbox (the default where runsc runs: a kernel of its own, and under the
  default `SandboxLimits.fresh_kernel_per_episode` a cell sandbox no earlier episode ran in,
  started while the previous episode runs) or a bubblewrap one (`sandbox.py`): nobody, no
  network, read-only files except a private scratch, only the current task's public files,
  rlimits, one memory cgroup for all its processes (and, under gVisor, a bound on its host
  tasks), no inherited environment,
- stopped (SIGSTOP, all its threads) between requests, and everything else in its PID
  namespace killed (by its supervisor, from inside that namespace, whatever the processes'
  state: zombie-looking leaders, fork storms): nothing of it runs while the policy thinks,
- killed with everything in its namespaces when the episode ends (its final state is read
  out first), so no variable, patch, thread, process, IPC object or file reaches the next.
The grader runs in a second sandbox where no model code ever runs; it has the ground truth
and sees only the episode's final DB changes. The host talks to both over Unix sockets that
only it and the worker hold; each request has a deadline and an id its reply must carry, and
everything read from a sandbox is bounded and made valid Unicode here.

A worker that fails a request (no answer in time, a broken reply, death) is killed and
started afresh at the next reset; an episode process that fails ends its episode.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import psutil

from seeupo_gym.appworld.cgroup import MemoryCgroup, MemoryCgroupUnavailable
from seeupo_gym.appworld.paths import find_python
from seeupo_gym.appworld.sandbox import APPWORLD_ROOT, Launcher, Mounts, SandboxLimits
from seeupo_gym.appworld.worker import wire
from seeupo_gym.text import bounded as _bounded

logger = logging.getLogger(__name__)

DIR_PREFIX = "seeupo-appworld-"
EXPERIMENT = "seeupo"
_STATE_FILE = re.compile(r"[A-Za-z0-9_]{1,64}\.jsonl")
_LOG_TAIL_CHARS = 2000
# What the warm parent does per request (fork, signal, kill, read a few files) takes
# milliseconds: a parent that does not answer within this was stopped or wedged, and is
# replaced well within a step's deadline.
CONTROL_TIMEOUT_S = 5.0
MAX_ERROR_CHARS = 2000  # an error from a worker, as the host keeps it


def bounded(value: Any, limit: int = MAX_ERROR_CHARS) -> str:
    """Text from a sandbox as the host keeps it: valid Unicode, at most `limit` characters."""
    return _bounded(value, limit)


class ServerError(RuntimeError):
    """A request failed inside a working server (e.g. the task's world could not be opened)."""


class ServerDied(RuntimeError):
    """A worker or the episode's process is gone (killed, crashed or never came up)."""


class ServerTimeout(RuntimeError):
    """No answer within the deadline; the process that owed it has been killed."""


# Servers still running, killed at interpreter exit. Global because atexit is: contained here.
_LIVE: weakref.WeakSet[AppWorldServer] = weakref.WeakSet()


def _step_lock_path() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"seeupo-appworld-steps-{os.getuid()}.lock"


@contextlib.contextmanager
def exclusive_step(wait_s: float):
    """The machine's one lock for the steps of `exclusive_steps` sandboxes (every process and
    thread of this user): a file lock, released when its descriptor closes, so a host process
    that dies holds nothing. Model code never sees the file (it is outside every sandbox)."""
    path = _step_lock_path()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_uid != os.getuid():  # planted by another user, who could hold it forever
            raise ServerError(f"{path} belongs to another user; remove it or set XDG_RUNTIME_DIR")
        deadline = time.monotonic() + wait_s
        delay = 0.0002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ServerTimeout(f"waited {wait_s:g} s for the other sandboxes' steps to let this one run "
                                        f"(exclusive_steps; exclusive_wait_s={wait_s:g})") from None
                time.sleep(delay)
                delay = min(2 * delay, 0.002)
        yield
    finally:
        os.close(fd)


@atexit.register
def _kill_live_servers() -> None:
    for server in list(_LIVE):
        server.shutdown()


class _Worker:
    """One worker process (the cell parent or the grader) and the socket the host holds to it."""

    def __init__(
        self, script: str, launcher: Launcher, mounts: Mounts, root: Path, memory_limit_mb: int | None = None,
        filter_per_process: bool = False, max_tasks: int | None = None, slot: str = "",
    ) -> None:
        self.script = script
        self.slot = slot
        self._max_tasks = max_tasks if launcher.mode == "gvisor" else None  # bwrap: RLIMIT_NPROC per sandbox
        self._filter_per_process = filter_per_process
        self._launcher = launcher
        self._mounts = mounts
        self._root = root
        self._memory_limit_mb = memory_limit_mb if launcher.sandboxed else None
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self.cgroup: MemoryCgroup | None = None  # the sandbox's memory cgroup while it runs
        self.ready = False

    @property
    def log_path(self) -> Path:
        return self._root / f"{self.script}{self.slot}.log"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        self.kill()
        self.cgroup = _memory_cgroup(self._memory_limit_mb, self._max_tasks)
        host_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with open(self.log_path, "ab") as log:
                self._process = self._launcher.spawn(
                    self.script, worker_end.fileno(), self._mounts, self._root, log, cgroup=self.cgroup,
                    filter_per_process=self._filter_per_process, slot=self.slot,
                )
        except BaseException:
            host_end.close()
            self.kill()
            raise
        finally:
            worker_end.close()
        self._socket = host_end
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        reply = self._exchange(None, timeout, what="start-up")
        if not (isinstance(reply, dict) and reply.get("ready")):
            self.kill()
            raise ServerDied(f"the AppWorld {self.script} worker sent {reply!r} instead of ready")
        self.ready = True

    def request(self, message: dict[str, Any], timeout: float, fd: int | None = None) -> Any:
        message = {**message, "id": secrets.token_hex(8)}
        reply = self._exchange(message, timeout, what=message.get("op", "request"), fd=fd)
        if not isinstance(reply, dict) or "ok" not in reply or reply.get("id") != message["id"]:
            self.kill()
            raise ServerDied(f"the AppWorld {self.script} worker sent a malformed reply; killed it")
        if not reply["ok"]:
            raise ServerError(bounded(reply.get("error")))
        return reply.get("output")

    def _exchange(self, message: dict[str, Any] | None, timeout: float, what: str, fd: int | None = None) -> Any:
        if self._socket is None or not self.alive:
            raise ServerDied(self._death_message())
        try:
            self._socket.settimeout(timeout)
            if message is not None:
                wire.send(self._socket, message, fd=fd)
            reply, _ = wire.receive(self._socket, timeout=timeout)
            return reply
        except TimeoutError as error:
            self.kill()
            raise ServerTimeout(
                f"the AppWorld {self.script} worker gave no answer to {what} within {timeout:.1f} s; killed it"
            ) from error
        except (wire.WireError, OSError) as error:
            if self._exits_within(2.0):
                raise ServerDied(self._death_message()) from error
            self.kill()
            raise ServerDied(f"the AppWorld {self.script} worker broke the connection ({error}); killed it") from error

    def kill(self) -> None:
        """SIGKILL the worker and wait until every process of its sandbox is gone."""
        process = self._process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, 9)  # bwrap or runsc: its PID namespace (or Sentry), and all in it, dies with it
            except ProcessLookupError:
                pass
            process.wait()
        if self._socket is not None:
            _close_when_peer_gone(self._socket)
            self._socket = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        self.ready = False

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def _exits_within(self, seconds: float) -> bool:
        if self._process is None:
            return True
        try:
            self._process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _death_message(self) -> str:
        code = self._process.poll() if self._process is not None else None
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return f"the AppWorld {self.script} worker (pid {self.pid}) is not running ({how}); its log:\n{self.log_tail()}"

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"


class AppWorldServer:
    """One env's AppWorld processes: a sandboxed cell worker (a fresh process per episode)
    and a sandboxed grader.

    Args:
        python: the AppWorld interpreter.
        data_dir: the AppWorld `data` folder (the grader sees all of it; an episode sees only
            its task's public files and the API docs).
        startup_timeout: seconds to wait for the workers to come up.
        sandbox: "auto" (default: gvisor where runsc runs here, else bwrap with a warning),
            "gvisor" (a kernel per sandbox and, with `limits.fresh_kernel_per_episode`, per
            episode), "bwrap" (namespaces of the host's kernel, whose counters every sandbox
            shares) or "none": run model code unsandboxed, as the caller's user, with the
            caller's file system (unsafe for training; for debugging only). See `sandbox.py`.
        limits: rlimits of each episode's process, the memory of the whole cell sandbox and the
            size of its scratch space (`SandboxLimits`).
    """

    def __init__(
        self,
        python: Path,
        data_dir: Path,
        startup_timeout: float = 180.0,
        sandbox: str = "auto",
        limits: SandboxLimits | None = None,
    ) -> None:
        self.python = Path(python)
        self.data_dir = Path(data_dir).resolve()
        self.startup_timeout = startup_timeout
        self.limits = limits or SandboxLimits()
        self.episodes = 0  # episodes opened since the last (re)start
        self.restarts = 0
        self.experiment_name = EXPERIMENT
        launcher = Launcher(self.python, sandbox, scratch_mb=self.limits.scratch_mb)
        self.sandbox = launcher.mode  # "auto" resolved
        sweep_stale_dirs()
        self._owner_pid = os.getpid()
        self.root = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
        self.root.chmod(0o755)  # the sandboxes' nobody reads view/ and final/
        (self.root / "owner").write_text(f"{os.getpid()} {psutil.Process().create_time()}\n")
        self._view = self.root / "view"  # $APPWORLD_ROOT/data of the episode
        self._final = self.root / "final"  # $APPWORLD_ROOT/experiments of the grader
        (self._view / "tasks").mkdir(parents=True)
        self._final.mkdir()
        cell_binds = [(self._view, f"{APPWORLD_ROOT}/data")]
        for shared in ("api_docs", "base_dbs"):  # public and the same for every task
            if (self.data_dir / shared).is_dir():
                (self._view / shared).mkdir()
                cell_binds.append((self.data_dir / shared, f"{APPWORLD_ROOT}/data/{shared}"))
        def cells(slot: str) -> _Worker:
            return _Worker("cells.py", launcher, Mounts(cell_binds), self.root, self.limits.total_memory_mb,
                           filter_per_process=True, max_tasks=self.limits.host_tasks, slot=slot)

        self._new_cells = cells
        self._cells = cells("")
        # Under gVisor each episode gets a cell sandbox no episode ran in: the next one is started
        # while the current episode runs (its start-up, ~10 s, stays off the reset's path).
        self.fresh_kernels = self.sandbox == "gvisor" and self.limits.fresh_kernel_per_episode
        self._spare: _Worker | None = None
        self._cells_used = False  # an episode has run in self._cells
        self._grader = _Worker(
            "grader.py", launcher, Mounts([(self.data_dir, f"{APPWORLD_ROOT}/data")], experiments_from=self._final),
            self.root, self.limits.total_memory_mb,  # a memory bound of its own: it replays model-written SQL
            max_tasks=self.limits.host_tasks,
        )
        self._episode: socket.socket | None = None
        self._episode_task: str | None = None
        self._episode_frozen = False
        self._oom_kills_seen = 0
        _LIVE.add(self)

    # ------------------------------------------------------------------ processes

    @property
    def pid(self) -> int | None:
        """The host pid of the cell sandbox (under `fresh_kernels`, a new one per episode)."""
        return self._cells.pid

    @property
    def alive(self) -> bool:
        return self._cells.alive and self._grader.alive

    def start(self) -> None:
        """Spawn both workers without waiting for them (see `wait_ready`)."""
        for worker in (self._cells, self._grader):
            if not worker.alive:
                worker.start()
        self.episodes = 0

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        for worker in (self._cells, self._grader):
            worker.wait_ready(max(0.1, deadline - time.monotonic()))

    def ensure_running(self) -> None:
        """Start whatever is not running (after a crash, a kill or a failed request) and wait for it."""
        if not self.alive:
            if self._cells.pid is not None:
                self.restarts += 1
            self.kill()
            self.start()
        self.wait_ready()

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()
        self.wait_ready()

    def _retire_cells(self) -> None:
        """Under `fresh_kernels`: kill the cell sandbox an episode ran in and put the one started
        ahead in its place (or start one now, where none was)."""
        if not (self.fresh_kernels and self._cells_used):
            return
        self._cells.kill()
        spare, self._spare = self._spare, None
        if spare is None or not spare.alive:
            if spare is not None:
                spare.kill()
            spare = self._new_cells("-b" if self._cells.slot != "-b" else "-a")
            spare.start()
        self._cells, self._cells_used = spare, False

    def _start_spare(self) -> None:
        if self.fresh_kernels and self._spare is None:
            self._spare = self._new_cells("-b" if self._cells.slot != "-b" else "-a")
            self._spare.start()

    def kill(self) -> None:
        self._cells.kill()
        self._grader.kill()
        if self._spare is not None:
            self._spare.kill()
            self._spare = None
        self._cells_used = False
        if self._episode is not None:
            _close_when_peer_gone(self._episode)
        self._drop_episode()

    def shutdown(self) -> None:
        """Kill the workers and delete the server's folder. Only the process that made it does this."""
        if os.getpid() != self._owner_pid:
            return
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)
        _LIVE.discard(self)

    def log_tail(self) -> str:
        return f"[cells]\n{self._cells.log_tail()}\n[grader]\n{self._grader.log_tail()}"

    # ------------------------------------------------------------------ episodes

    @property
    def episode_active(self) -> bool:
        return self._episode is not None

    def open_episode(self, task_id: str, timeout_seconds: int, max_interactions: int, timeout: float = 120.0) -> dict:
        """Fork a fresh episode process, open `task_id`'s world in it; returns the task's
        instruction, supervisor and datetime."""
        self.close_episode(collect=False)
        self._retire_cells()
        self._cells.wait_ready(self.startup_timeout)
        self._show_task(task_id)
        host_end, episode_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cpu_seconds = max_interactions * (timeout_seconds + 10)
        self._cells_used = True
        try:
            self._cells.request(
                {"op": "begin", "limits": self.limits.rlimits(cpu_seconds)}, timeout=CONTROL_TIMEOUT_S,
                fd=episode_end.fileno(),
            )
        except BaseException:
            host_end.close()
            raise
        finally:
            episode_end.close()
        self._episode, self._episode_task, self._episode_frozen = host_end, task_id, False
        self._oom_kills_seen = self._cells.oom_kills()
        self.episodes += 1
        request = {"op": "initialize", "task_id": task_id, "timeout_seconds": timeout_seconds,
                   "max_interactions": max_interactions}
        summary = self._episode_request(request, timeout)
        self._start_spare()  # after the world is open: its start-up does not slow this reset
        if not (isinstance(summary, dict) and isinstance(summary.get("supervisor"), dict)):
            self._end_failed_episode()
            raise ServerDied("the episode's process sent a malformed task summary; killed it")
        # No model code has run in this episode yet; bounded all the same.
        return {
            "instruction": bounded(summary.get("instruction"), 20_000),
            "datetime": bounded(summary.get("datetime"), 100),
            "supervisor": {key: bounded(summary["supervisor"].get(key), 200)
                           for key in ("first_name", "last_name", "email", "phone_number")},
        }

    def execute(self, code: str, timeout: float, max_chars: int = 1_000_000) -> str:
        """Run a cell; its output, at most `max_chars` characters of valid Unicode."""
        try:
            output = self._episode_request({"op": "execute", "code": code, "max_chars": max_chars}, timeout)
        except ServerError as error:
            raise ServerError(f"{error}{self._oom_note()}") from error
        if not isinstance(output, str):
            self._end_failed_episode()
            raise ServerDied(f"the episode's process answered a cell with a {type(output).__name__}; killed it")
        return bounded(output, max_chars) + self._oom_note()

    def _oom_note(self) -> str:
        kills = self._cells.oom_kills()
        new, self._oom_kills_seen = kills - self._oom_kills_seen, kills
        if new <= 0:
            return ""
        return (f"\n[out of memory: the sandbox ended {new} process(es): all processes of an episode together "
                f"may hold at most {self.limits.total_memory_mb} MiB]")

    def task_completed(self, timeout: float = 60.0) -> bool:
        """Whether the episode's process says its task is completed: a claim, for ending the
        episode; only the grader's report (`grade`) says what the final state holds."""
        return self._episode_request({"op": "task_completed"}, timeout) is True

    def close_episode(self, collect: bool) -> dict[str, str] | None:
        """End the episode: its process and everything it started are killed. With `collect`,
        returns its final state (DB change files by name)."""
        if self._episode is None:
            return None
        task_id = self._episode_task
        self._drop_episode()
        # The warm parent only kills, reads files and empties the scratch: a parent that takes
        # longer was stopped by the episode, and the step must end within its deadline.
        output = self._cells.request({"op": "end", "task_id": task_id, "collect": collect}, timeout=CONTROL_TIMEOUT_S)
        self._retire_cells()  # the kernel the episode ran in serves no later episode
        return output["state"] if collect else None

    def episode_state(self) -> dict[str, str]:
        """The open episode's saved state (DB change files by name), its process left as it is:
        stopped between requests, so the files do not change while they are read."""
        if self._episode is None:
            raise ServerError("no episode is open")
        output = self._cells.request({"op": "state", "task_id": self._episode_task}, timeout=CONTROL_TIMEOUT_S)
        return output["state"]

    def grade(self, task_id: str, state: dict[str, str], timeout: float = 120.0) -> dict[str, Any]:
        """AppWorld's evaluation of `state` (from `close_episode`) against the task's ground truth,
        plus "completed": whether the final state holds a completed task."""
        tasks = self._final / "outputs" / EXPERIMENT / "tasks"
        shutil.rmtree(tasks, ignore_errors=True)
        dbs = tasks / task_id / "dbs"
        dbs.mkdir(parents=True)
        for name, text in state.items():
            if _STATE_FILE.fullmatch(name):  # data only; the grader makes its own model hashes
                (dbs / name).write_text(text)
        cpu_seconds = max(5, int(timeout) // 2)
        return self._grader.request(
            {"op": "evaluate", "task_id": task_id, "limits": self.limits.rlimits(cpu_seconds)}, timeout
        )

    def _episode_request(self, message: dict[str, Any], timeout: float) -> Any:
        """One request to the episode's process, which runs only while it is answered: the
        warm parent thaws it first and, once the reply is in, kills what the request started
        and stops it again (a cell can patch its own process, so the parent, where no model
        code runs, does this). The reply must carry the request's id: model code can write
        to this socket, and a reply to no request (forged, or the real one after a forged
        one) ends the episode rather than shifting every later reply by one. An episode whose
        processes cannot be made still is killed by the sweep: its next request ends it."""
        if self._episode is None:
            raise ServerError("no episode is open")
        if not self.limits.exclusive_steps:
            return self._run_episode_request(message, timeout)
        with exclusive_step(self.limits.exclusive_wait_s):  # from thaw to freeze: no other sandbox runs
            return self._run_episode_request(message, timeout)

    def _run_episode_request(self, message: dict[str, Any], timeout: float) -> Any:
        if self._episode_frozen:
            self._cells.request({"op": "thaw"}, timeout=CONTROL_TIMEOUT_S)
            self._episode_frozen = False
        message = {**message, "id": secrets.token_hex(8)}
        try:
            self._episode.settimeout(timeout)
            wire.send(self._episode, message)
            # Model code can write to this socket: a reply may be no larger than an output can be,
            # so parsing one costs the host little.
            max_bytes = 2**20 + 8 * int(message.get("max_chars", 0))
            reply, _ = wire.receive(self._episode, timeout=timeout, max_bytes=max_bytes)
        except TimeoutError as error:
            self._end_failed_episode()
            raise ServerTimeout(
                f"the episode's process gave no answer to {message['op']} within {timeout:.1f} s; killed it"
            ) from error
        except (wire.WireError, OSError) as error:
            out_of_memory = self._cells.oom_kills() > self._oom_kills_seen
            ended = self._end_failed_episode()
            if out_of_memory:
                ended = (f"the out-of-memory killer ended it: all processes of an episode together may hold "
                         f"at most {self.limits.total_memory_mb} MiB")
            raise ServerDied(f"the episode's process died ({ended or error})") from error
        if not (isinstance(reply, dict) and "ok" in reply):
            self._end_failed_episode()
            raise ServerDied("the episode's process sent a malformed reply; killed it")
        if reply.get("id") != message["id"]:
            self._end_failed_episode()
            raise ServerDied("the episode's process sent a reply to no request of this step (forged or stale); "
                             "killed it")
        self._cells.request({"op": "sweep"}, timeout=CONTROL_TIMEOUT_S)
        self._episode_frozen = True
        if not reply["ok"]:
            raise ServerError(bounded(reply.get("error")))
        return reply.get("output")

    def _end_failed_episode(self) -> str:
        """Kill a failed episode's process; how it had ended, if it had."""
        task_id = self._episode_task
        self._drop_episode()
        try:
            return self._cells.request({"op": "end", "task_id": task_id, "collect": False},
                                       timeout=CONTROL_TIMEOUT_S)["ended"]
        except (ServerDied, ServerTimeout, ServerError) as error:
            return f"and the cell worker failed too: {error}"
        finally:
            self._retire_cells()

    def _drop_episode(self) -> None:
        if self._episode is not None:
            self._episode.close()
        self._episode, self._episode_task, self._episode_frozen = None, None, False

    def _show_task(self, task_id: str) -> None:
        """Put the task's public files, and nothing else of it, where the episode will look."""
        tasks = self._view / "tasks"
        shutil.rmtree(tasks)
        source, target = self.data_dir / "tasks" / task_id, tasks / task_id
        target.mkdir(parents=True)
        shutil.copy2(source / "specs.json", target / "specs.json")
        shutil.copytree(source / "dbs", target / "dbs", copy_function=_link_or_copy)


def _memory_cgroup(limit_mb: int | None, max_tasks: int | None = None) -> MemoryCgroup | None:
    """A memory cgroup with this limit (and host-task bound), or None (with a warning) where
    this machine gives us none: memory is then bounded per process only."""
    if limit_mb is None:
        return None
    try:
        group = MemoryCgroup(limit_mb * 2**20, max_tasks=max_tasks)
    except MemoryCgroupUnavailable as error:
        _warn_no_cgroup(str(error))
        return None
    if max_tasks is not None and group.max_tasks is None:
        _warn_no_pids_cgroup()
    return group


@functools.cache
def _warn_no_pids_cgroup() -> None:
    logger.warning("AppWorld gVisor sandboxes get no bound on their host tasks (no usable pids cgroup here): "
                   "each runs up to about 500 host threads and processes at its 64-process limit")


@functools.cache  # once per reason and process, not at every server start
def _warn_no_cgroup(reason: str) -> None:
    logger.warning(
        "AppWorld sandboxes get no memory cgroup (%s): each process is bounded (SandboxLimits.memory_mb), "
        "but an episode that forks can hold that much per process", reason,
    )


def _close_when_peer_gone(sock: socket.socket, timeout: float = 5.0) -> None:
    """Close our end once every process holding the other end has exited (or after `timeout`):
    a socket reads EOF only then, so this waits for a killed sandbox to be really gone."""
    deadline = time.monotonic() + timeout
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            sock.settimeout(remaining)
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass
    sock.close()


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # read-only inside the sandbox either way
    except OSError:
        shutil.copy2(source, target)


def sweep_stale_dirs() -> list[Path]:
    """Delete server folders whose owning process is gone (it was SIGKILLed: no clean-up ran)."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(DIR_PREFIX + "*"):
        try:
            pid_text, created_text = (path / "owner").read_text().split()
            owner = psutil.Process(int(pid_text))
            if abs(owner.create_time() - float(created_text)) < 1e-3:
                continue  # still alive
        except psutil.NoSuchProcess:
            pass
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class ServerPool:
    """AppWorld servers for one interpreter and data folder, handed out one per env.

    `acquire` returns an idle server (restarted if a worker died, or recycled after
    `recycle_after` episodes) or starts a new one; `release` gives it back; `shutdown` kills
    them all. Sharing one pool among envs (or tests) reuses warm servers; an env without a
    pool makes its own and shuts it down at `close()`.

    Args:
        data_dir: the AppWorld `data` folder the servers serve.
        python: the AppWorld interpreter; None searches as `paths.find_python` does.
        startup_timeout: seconds to wait for a server to come up.
        recycle_after: episodes after which a server is restarted on its next acquire.
        sandbox, limits: as for `AppWorldServer`.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        python: str | os.PathLike[str] | None = None,
        startup_timeout: float = 180.0,
        recycle_after: int = 300,
        sandbox: str = "auto",
        limits: SandboxLimits | None = None,
    ) -> None:
        self.python = find_python(python)
        self.data_dir = Path(data_dir).resolve()
        self.startup_timeout = startup_timeout
        self.recycle_after = recycle_after
        self.limits = limits
        # Fail here, with the reason, if this machine cannot sandbox; "auto" is decided once, here.
        self.sandbox = Launcher(self.python, sandbox).mode
        self._idle: list[AppWorldServer] = []
        self._busy: list[AppWorldServer] = []
        self._lock = threading.Lock()

    @property
    def servers(self) -> list[AppWorldServer]:
        with self._lock:
            return self._idle + self._busy

    def acquire(self) -> AppWorldServer:
        with self._lock:
            server = self._idle.pop() if self._idle else None
        if server is None:
            server = AppWorldServer(self.python, self.data_dir, self.startup_timeout, self.sandbox, self.limits)
        try:
            self.prepare(server)
        except BaseException:
            server.shutdown()
            raise
        with self._lock:
            self._busy.append(server)
        return server

    def prepare(self, server: AppWorldServer) -> None:
        """Make a server fit for the next episode: running, answering, not overdue for recycling."""
        if server.alive and server.episodes >= self.recycle_after:
            logger.info("recycling AppWorld server pid %s after %d episodes", server.pid, server.episodes)
            server.restart()
        else:
            server.ensure_running()

    def release(self, server: AppWorldServer) -> None:
        try:
            server.close_episode(collect=False)
        except (ServerDied, ServerTimeout, ServerError):
            server.kill()  # restarted at its next acquire, never reused as it is
        with self._lock:
            if server in self._busy:
                self._busy.remove(server)
                self._idle.append(server)

    def shutdown(self) -> None:
        with self._lock:
            servers, self._idle, self._busy = self._idle + self._busy, [], []
        for server in servers:
            server.shutdown()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
