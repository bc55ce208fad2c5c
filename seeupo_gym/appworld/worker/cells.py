"""The cell worker: a warm parent that forks one fresh process per episode.

Run by the AppWorld interpreter inside the cell sandbox:  python -P cells.py CONTROL_FD

The parent imports AppWorld and its apps but opens no world and runs no model code. On
"begin" (with a socket riding along) it forks a child that opens the task's world, without
its ground truth, and runs the episode's requests on that socket. On "end" it kills the
child and everything the child started, hands back the episode's final state (AppWorld's DB
change files) and empties the scratch folder, so nothing survives into the next episode.
It exits when the host's end of CONTROL_FD closes.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys

import limits
import wire

SCRATCH = os.environ.get("SEEUPO_SCRATCH", "/scratch")
EXPERIMENT = "seeupo"
STATE_FILE = re.compile(r"[A-Za-z0-9_]{1,64}\.jsonl")  # DB changes; hashes are not trusted
MAX_STATE_BYTES = 48 * 2**20


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    limits.make_undumpable()  # episode processes share our uid: they must not ptrace or read us
    limits.reset_scratch()
    limits.warm_up_appworld()
    wire.send(control, {"ready": True, "pid": os.getpid()})
    child = None
    while True:
        try:
            request, episode_fd = wire.receive(control, with_fd=True)
        except (wire.WireError, OSError):
            _stop(child)
            os._exit(0)
        op = request.get("op")
        if op == "begin":
            _stop(child)
            child = _fork_episode(control, episode_fd, request)
            wire.send(control, {"ok": True, "output": {"pid": child}})
        elif op == "sweep":
            wire.send(control, {"ok": True, "output": {"killed": _sweep(child)}})
        elif op == "end":
            ended = _stop(child)
            child = None
            state = _collect_state(request["task_id"]) if request.get("collect") else None
            limits.reset_scratch()
            wire.send(control, {"ok": True, "output": {"state": state, "ended": ended}})
        else:
            wire.send(control, {"ok": False, "error": f"unknown request {op!r}"})


def _fork_episode(control: socket.socket, episode_fd: int, request: dict) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid:
        os.close(episode_fd)
        return pid
    try:
        control.close()  # the episode must not be able to talk to the parent
        os.setsid()  # its own process group: `_stop` kills all of it
        limits.die_with_parent(parent)
        limits.volunteer_for_oom_kill()
        limits.apply(request["limits"])
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # cells may write to raw fds; the host only reads replies
            os.dup2(null, fd)
        import episode

        episode.serve(socket.socket(fileno=episode_fd))
    finally:
        os._exit(0)


def _sweep(child: int | None) -> int:
    """Kill what the episode's cells started and leave the episode's process running. The host
    asks after every cell: the episode cleans up after its cells itself, but a cell can patch
    that code; this runs where no model code has run."""
    if child is None:
        return 0
    if limits.in_own_pid_namespace():
        return limits.kill_all_but({os.getpid(), child})
    return limits.kill(limits.descendants(child))  # unsandboxed: no namespace to sweep; the tree only


def _stop(child: int | None) -> str:
    """Kill the episode's process and everything it started, and reap them. Returns how the
    episode's process had ended by itself ("" if it was still running)."""
    ended = ""
    if child is not None:
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pid, status = 0, 0
        if pid:
            ended = _describe(status)
        for target in (-child, child):
            try:
                os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
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
