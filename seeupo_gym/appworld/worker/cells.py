"""The cell worker: a warm parent that forks one fresh process per episode.

Run by the AppWorld interpreter inside the cell sandbox:  python -P cells.py CONTROL_FD [SECCOMP_FD|PATH]

The parent imports AppWorld and its apps but opens no world and runs no model code. On
"begin" (with a socket riding along) it starts the episode (`Episode`): a process in
namespaces of its own that opens the task's world, without its ground truth, and runs the
episode's requests on that socket. Between requests the host has the parent "sweep" (the
episode's supervisor stops the episode's process and kills everything else in its namespace)
and "thaw" it again. On "end" it
kills the episode and everything in its namespaces, hands back the episode's final state
(AppWorld's DB change files) and empties the scratch folder, so nothing survives into the
next episode. It exits when the host's end of CONTROL_FD closes.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import sys
import time
from typing import Callable

import limits
import wire

SCRATCH = os.environ.get("SEEUPO_SCRATCH", "/scratch")
EXPERIMENT = "seeupo"
STATE_FILE = re.compile(r"[A-Za-z0-9_]{1,64}\.jsonl")  # DB changes; hashes are not trusted
MAX_STATE_BYTES = 48 * 2**20
# The supervisor's sweep makes the episode's namespace still within this, or kills the episode
# (well within the host's wait for the warm parent, server.CONTROL_TIMEOUT_S).
SWEEP_S = 2.0
STOP_WAIT_S = 0.1  # a stopped process's threads all stop within microseconds on an idle machine
KILL_PROGRAM = "/bin/kill"


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    # In the sandbox: the seccomp filter, an fd (bubblewrap) or a read-only file (gVisor), or
    # "none" where this machine has no libseccomp; loaded per episode after its namespaces are
    # made. Unsandboxed: no second argument.
    sandboxed = len(sys.argv) > 2
    program = limits.read_filter(sys.argv[2]) if sandboxed and sys.argv[2] != "none" else None
    limits.make_undumpable()  # episode processes share our uid: they must not ptrace or read us
    limits.reset_scratch()
    limits.warm_up_appworld()
    wire.send(control, {"ready": True, "pid": os.getpid()})
    episode: Episode | None = None
    while True:
        try:
            request, episode_fd = wire.receive(control, with_fd=True)
        except (wire.WireError, OSError):
            _stop(episode)
            os._exit(0)
        op, reply = request.get("op"), {"ok": True}
        try:
            if op == "begin":
                _stop(episode)
                episode = None
                episode = Episode.start(control, episode_fd, request, sandboxed, program)
                reply["output"] = {"pid": episode.pid}
            elif op == "thaw":
                reply["output"] = {"running": episode is not None and episode.thaw()}
            elif op == "sweep":
                reply["output"] = {"killed": _sweep(episode)}
            elif op == "state":
                reply["output"] = {"state": _collect_state(request["task_id"])}
            elif op == "end":
                ended = _stop(episode)
                episode = None
                state = _collect_state(request["task_id"]) if request.get("collect") else None
                limits.reset_scratch()
                reply["output"] = {"state": state, "ended": ended}
            else:
                reply = {"ok": False, "error": f"unknown request {op!r}"}
        except Exception as error:  # noqa: BLE001  the host reads why; the parent lives on
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        reply["id"] = request.get("id")
        wire.send(control, reply)


class Episode:
    """An episode's two processes: its supervisor, a fork of this parent that runs no model
    code, and the episode's process, the supervisor's child.

    In the sandbox the supervisor makes a user namespace and a PID namespace, so the
    episode's process is PID 1 of a namespace of its own: this parent and the supervisor have
    no PID there (nothing can signal, prlimit, renice, pin, reschedule or trace them by
    number), and killing it kills everything in that namespace. The episode's process then
    makes an IPC namespace of its own (SysV shared memory, semaphores and message queues die
    with it) and a mount namespace whose /proc holds process entries only, every machine-wide
    counter covered (`limits.mask_proc`), drops the capabilities the user namespace gave it
    and loads the seccomp filter (which refuses new namespaces and mounts from then on) before
    any model code runs. The supervisor
    also sweeps that namespace between requests (`_sweep_namespace`), on this parent's word.
    """

    def __init__(self, supervisor: int, pid: int, status_fd: int, sweeps: socket.socket) -> None:
        self.supervisor, self.pid, self._status_fd, self._sweeps = supervisor, pid, status_fd, sweeps
        self.frozen = False

    @classmethod
    def start(
        cls, control: socket.socket, episode_fd: int, request: dict, sandboxed: bool, program: bytes | None
    ) -> Episode:
        parent = os.getpid()
        status_read, status_write = os.pipe()
        sweeps, supervisor_sweeps = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        supervisor = os.fork()
        if supervisor == 0:
            try:
                control.close()  # the episode must not be able to talk to the parent
                sweeps.close()
                os.close(status_read)
                _supervise(parent, episode_fd, request, sandboxed, program, status_write, supervisor_sweeps)
            finally:
                os._exit(0)
        os.close(episode_fd)
        os.close(status_write)
        supervisor_sweeps.close()
        line = _read_line(status_read)
        if not line.isdigit():
            os.close(status_read)
            sweeps.close()
            _reap(supervisor)
            raise RuntimeError(f"the episode did not start: {line or 'its supervisor died'}")
        os.set_blocking(status_read, False)
        return cls(supervisor, int(line), status_read, sweeps)

    def thaw(self) -> bool:
        self.frozen = False
        return _signal(self.pid, signal.SIGCONT)

    def sweep(self) -> int:
        """Have the supervisor kill every other process of the episode's namespace and leave
        the episode's process stopped; how many it found alive. An episode the supervisor
        cannot make still within SWEEP_S is killed (its next request finds it gone): -1."""
        try:
            self._sweeps.settimeout(SWEEP_S + 1.0)
            self._sweeps.sendall(b"s")
            answer = _read_answer(self._sweeps)
        except OSError:
            answer = ""
        if answer.lstrip("-").isdigit() and int(answer) >= 0:
            self.frozen = True
            return int(answer)
        for target in (self.pid, self.supervisor):
            _signal(target, signal.SIGKILL)
        return -1

    def ended(self) -> str:
        """How the episode's process ended by itself ("" if it is still running)."""
        try:
            text = os.read(self._status_fd, 64).decode()
        except (BlockingIOError, OSError):
            return ""
        return _describe(int(text)) if text.strip().lstrip("-").isdigit() else ""

    def kill(self) -> str:
        ended = self.ended()
        for target in (-self.pid, self.pid, self.supervisor):  # the namespace dies with its PID 1
            _signal(target, signal.SIGKILL)
        _reap(self.supervisor)
        os.close(self._status_fd)
        self._sweeps.close()
        return ended


def _supervise(
    parent: int, episode_fd: int, request: dict, sandboxed: bool, program: bytes | None, status_fd: int,
    sweeps: socket.socket,
) -> None:
    """The supervisor: make the namespaces, start the episode's process, report its pid,
    sweep its namespace when the parent asks and, once it has ended, report its wait status."""
    try:
        os.setsid()  # its own session and process group: `_stop` kills all of it
        limits.die_with_parent(parent)
        if sandboxed:
            limits.new_user_and_pid_namespace()
        alive_read, alive_write = os.pipe()  # EOF at the episode's end when the supervisor is gone
        pid = os.fork()
    except Exception as error:  # noqa: BLE001  reported to the parent, which tells the host
        os.write(status_fd, f"{type(error).__name__}: {error}\n".encode())
        return
    if pid == 0:
        os.close(status_fd)
        os.close(alive_write)
        sweeps.close()
        _run_episode(episode_fd, request, sandboxed, program, alive_read)
        return
    os.close(episode_fd)
    os.close(alive_read)
    os.write(status_fd, f"{pid}\n".encode())
    ended, exited = _exit_watch(pid)
    keep = {1, parent, os.getpid(), pid}  # the sandbox's init, the warm parent, us, the episode
    while not exited():
        ready = select.select([ended, sweeps], [], [])[0]
        if sweeps not in ready:
            continue
        if not sweeps.recv(16):
            break  # the parent is gone (and we with it: die_with_parent)
        found = _sweep_namespace(pid, keep) if sandboxed else _sweep_tree(pid)
        sweeps.sendall(f"{found}\n".encode())
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            status = 0
            break
    os.write(status_fd, str(status).encode())


def _exit_watch(pid: int) -> tuple[int, Callable[[], bool]]:
    """A file descriptor that becomes readable once the child `pid` has exited (or may have),
    and the check that says whether it has (without reaping it)."""
    try:
        fd = os.pidfd_open(pid)
        return fd, lambda: bool(select.select([fd], [], [], 0)[0])
    except OSError:  # gVisor's kernel has no pidfd_open: SIGCHLD wakes a pipe instead
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(write)

        def exited() -> bool:
            try:
                os.read(read, 4096)
            except BlockingIOError:
                pass
            return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

        return read, exited


def _run_episode(episode_fd: int, request: dict, sandboxed: bool, program: bytes | None, alive_fd: int) -> None:
    try:
        limits.die_with_parent(None)
        if select.select([alive_fd], [], [], 0)[0]:
            return  # the supervisor died before the prctl
        if sandboxed:
            limits.new_ipc_and_mount_namespace()
            if not limits.own_kernel():  # gVisor's /proc holds no other sandbox's counters
                limits.mask_proc(int(request["limits"]["memory_mb"]))
        os.setsid()
        limits.volunteer_for_oom_kill()
        limits.apply(request["limits"])
        if sandboxed:
            limits.drop_capabilities()
        if program is not None:
            limits.load_seccomp(program)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # cells may write to raw fds; the host only reads replies
            os.dup2(null, fd)
    except Exception as error:  # noqa: BLE001  no episode then: the host sees its socket close
        print(f"the episode's process could not start: {type(error).__name__}: {error}",
              file=sys.stderr, flush=True)  # the server's log, which its errors quote
        return
    import episode

    episode.serve(socket.socket(fileno=episode_fd))


def _read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _signal(pid: int, number: int) -> bool:
    try:
        os.kill(pid, number)
        return True
    except ProcessLookupError:
        return False


def _wait_until_stopped(pid: int, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat_file:
                state = stat_file.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            return
        if state in (b"T", b"t", b"Z", b"X"):
            return
        time.sleep(0.0005)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _sweep(episode: Episode | None) -> int:
    """Kill what the episode's cells started, leave the episode's process, and freeze it until
    the next request. The host asks after every request: the episode cleans up after its cells
    itself, but a cell can patch that code; this runs where no model code has run."""
    return episode.sweep() if episode is not None else 0


def _sweep_namespace(episode: int, keep: set[int]) -> int:
    """In the supervisor: stop the episode's process (PID 1 of the episode's namespace), then
    kill everything else in that namespace, whatever its state (a leader that exited while its
    threads run looks like a zombie; a fork storm outraces any list). Returns how many processes
    were alive besides the episode's, or -1 if the namespace could not be made still in SWEEP_S.

    kill(-1) from inside the namespace reaches every process there but its PID 1 and the
    caller, atomically against fork (a child forked meanwhile is either signalled too or its
    fork fails). So: once the episode's process is stopped and stays stopped across one such
    kill (its threads' context switches unchanged), only it remains, and nothing is left to
    wake it. A process list alone is a consistent snapshot only when no pid was allocated
    while it was read (the fast path when a request started nothing).

    gVisor's kernel counts no context switches and has no last pid: there the kill is always
    made, and "stayed stopped" is the episode's threads all stopped after it, with nothing
    else left alive in its namespace."""
    deadline = time.monotonic() + SWEEP_S
    found = 0
    while time.monotonic() < deadline:
        _signal(episode, signal.SIGSTOP)
        # Not stopped soon: another process keeps waking it; the kill below ends that one.
        still = _until(lambda: limits.all_stopped(limits.thread_states(episode)), time.monotonic() + STOP_WAIT_S)
        if still:
            before = limits.last_pid()
            alive = limits.live_processes(keep)
            if not alive and before is not None and limits.last_pid() == before and limits.thread_states(episode) == still:
                return found  # (gVisor's kernel has no last pid: always the kill below)
            found += len(alive)
        if not _kill_namespace(deadline):
            continue
        if _until(lambda: not limits.live_processes(keep), deadline) is None:
            break
        if still and limits.thread_states(episode) == still:  # never woke: nothing was made after the kill
            return found
    _signal(episode, signal.SIGKILL)
    return -1


def _kill_namespace(deadline: float) -> bool:
    """kill(-1, SIGKILL) from a child of the supervisor, which lands in the episode's PID
    namespace. Spawned (no copy of this large process) where the system has a kill program."""
    if os.path.exists(KILL_PROGRAM):
        sweeper = os.posix_spawn(KILL_PROGRAM, ["kill", "-9", "-1"], {})
    else:
        sweeper = os.fork()
        if sweeper == 0:
            try:
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
    # A process of the episode may stop the sweeper before it kills: then it is killed, and
    # the next round spawns another.
    if _until(lambda: os.waitpid(sweeper, os.WNOHANG)[0] == sweeper or None, deadline) is None:
        _signal(sweeper, signal.SIGKILL)
        _reap(sweeper)
        return False
    return True


def _sweep_tree(episode: int) -> int:
    """Unsandboxed (no namespace of the episode's own): kill the episode's process tree, then
    stop the episode's process."""
    killed = limits.kill(limits.descendants(episode))
    _signal(episode, signal.SIGSTOP)
    _wait_until_stopped(episode)
    return killed


def _until(condition, deadline: float):
    """Poll `condition` until it returns something truthy (returned) or the deadline (None)."""
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(0.0002)


def _read_answer(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < 32:
        chunk = sock.recv(32)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _stop(episode: Episode | None) -> str:
    """Kill the episode's processes and everything they started, and reap them. Returns how
    the episode's process had ended by itself ("" if it was still running)."""
    ended = episode.kill() if episode is not None else ""
    if limits.in_own_pid_namespace():
        # Every process of ours but this one (double forks, new sessions included); only
        # inside the sandbox's PID namespace, where that means the episode's leftovers.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while True:
        try:
            if os.waitpid(-1, 0)[0] == 0:
                break
        except ChildProcessError:
            break
    return ended


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        why = {signal.SIGXCPU: ": CPU time limit", signal.SIGKILL: "", signal.SIGSEGV: ": crashed"}.get(number, "")
        return f"killed by {signal.Signals(number).name}{why}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _collect_state(task_id: str) -> dict[str, str]:
    """The episode's saved DB changes, read as data: regular files only, bounded in size."""
    folder = os.path.join(SCRATCH, "experiments", "outputs", EXPERIMENT, "tasks", task_id, "dbs")
    state: dict[str, str] = {}
    total = 0
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return state
    for name in names:
        if not STATE_FILE.fullmatch(name):
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as file:
            if not os.path.stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            data = file.read(MAX_STATE_BYTES - total + 1)
        total += len(data)
        if total > MAX_STATE_BYTES:
            raise RuntimeError(f"the episode's saved state is over {MAX_STATE_BYTES} bytes")
        state[name] = data.decode("utf-8", "replace")
    return state


if __name__ == "__main__":
    main()
