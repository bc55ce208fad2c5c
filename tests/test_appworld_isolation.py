"""Red team, second round: what one AppWorld episode can leave for the next, do to the warm
parent that forks it, reach through the kernel, or tell the host over its socket.

Real sandbox, real AppWorld. Cells reach the OS past both Python guards (`random._os`, the
`posix` module, ctypes), as an attacker would; the assertions are about the kernel's walls
and the host's handling of what comes back.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import gymnasium as gym
import psutil
import pytest

import seeupo_gym  # noqa: F401  (registers the ids)
from conftest import appworld_mini
from seeupo_gym.appworld import find_python, render_action
from seeupo_gym.appworld.server import AppWorldServer, ServerError, ServerPool

pytestmark = pytest.mark.appworld

MINI, MINI_TASKS = appworld_mini()
PRELUDE = """\
import random, typing
P = random._os.sys.modules['posix']
C = typing.sys.modules['ctypes']
libc = C.CDLL(None, use_errno=True)
"""
IDLE_CPU_S = 0.25  # CPU-seconds the whole server may use over the 5 s between two steps


def solution(task_id: str) -> str:
    return (MINI / "tasks" / task_id / "ground_truth" / "solution.py").read_text()


@pytest.fixture(scope="module")
def server():
    own = AppWorldServer(find_python(), MINI, sandbox="bwrap")
    own.start()
    own.wait_ready()
    yield own
    own.shutdown()


def run(server: AppWorldServer, code: str, task_id: str = "mininote_1", fresh: bool = False) -> str:
    if fresh:
        server.close_episode(collect=False)
    if not server.episode_active:
        server.open_episode(task_id, timeout_seconds=10, max_interactions=50)
    return server.execute(PRELUDE + textwrap.dedent(code), timeout=40)


def warm_parent(server: AppWorldServer) -> psutil.Process:
    """The cell sandbox's warm parent, seen from the host: the python process whose parent is
    bwrap's init inside the sandbox."""
    for process in psutil.Process(server.pid).children(recursive=True):
        if (process.name().startswith("python") and "cells.py" in " ".join(process.cmdline())
                and process.parent().name() == "bwrap"):
            return process
    raise AssertionError("no warm parent found")


def server_cpu_seconds(server: AppWorldServer) -> float:
    total = 0.0
    for process in [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]:
        try:
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            pass
    return total


# ---------------------------------------------------------------------------- IPC


def test_sysv_ipc_objects_do_not_survive_the_episode(server):
    plant = """
        IPC_CREAT = 0o1000
        shm = libc.shmget(0x5EE0, 1 << 20, IPC_CREAT | 0o666)
        address = libc.shmat(shm, None, 0) if shm >= 0 else -1
        libc.shmat.restype = C.c_void_p
        msq = libc.msgget(0x5EE1, IPC_CREAT | 0o666)
        sem = libc.semget(0x5EE2, 1, IPC_CREAT | 0o666)
        print(shm >= 0, msq >= 0, sem >= 0)
    """
    assert run(server, plant, fresh=True).split() == ["True", "True", "True"]
    probe = """
        print(libc.shmget(0x5EE0, 0, 0), libc.msgget(0x5EE1, 0), libc.semget(0x5EE2, 0, 0))
        info = (C.c_int * 64)()  # how many objects this IPC namespace holds (/proc/sysvipc is covered)
        print('shm', libc.shmctl(0, 14, info) >= 0 and info[0])  # SHM_INFO: shm_info.used_ids
        print('msg', libc.msgctl(0, 12, info) >= 0 and info[0])  # MSG_INFO: msginfo.msgpool
        print('sem', libc.semctl(0, 0, 19, info) >= 0 and info[7])  # SEM_INFO: seminfo.semusz
    """
    found = run(server, probe, task_id="minitodo_1", fresh=True).splitlines()
    assert found[0] == "-1 -1 -1", found  # ENOENT: the keys are gone
    assert found[1:] == ["shm 0", "msg 0", "sem 0"], found


def test_posix_shared_memory_and_message_queues_are_unavailable(server):
    output = run(server, """
        for path in ('/dev/shm/seeupo', '/dev/mqueue'):
            try:
                P.open(path, P.O_RDWR | P.O_CREAT)
                print('created', path)
            except OSError as error:
                print('refused', error.errno)
        print('mq_open', libc.mq_open(b'/seeupo', 0o102, 0o600, None) if hasattr(libc, 'mq_open') else -1)
    """, fresh=True)
    assert "created" not in output and output.count("refused") == 2, output
    assert "mq_open -1" in output


# ---------------------------------------------------------------------------- the warm parent


def parent_state(process: psutil.Process) -> dict:
    return {
        "nofile": process.rlimit(psutil.RLIMIT_NOFILE),
        "nproc": process.rlimit(psutil.RLIMIT_NPROC),
        "stack": process.rlimit(psutil.RLIMIT_STACK),
        "nice": process.nice(),
        "affinity": process.cpu_affinity(),
        "scheduler": os.sched_getscheduler(process.pid),
        "oom_score_adj": Path(f"/proc/{process.pid}/oom_score_adj").read_text().strip(),
        "stopped": process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE),
    }


def test_the_warm_parent_is_out_of_reach(server):
    server.close_episode(collect=False)
    server.open_episode("mininote_1", timeout_seconds=10, max_interactions=50)
    parent = warm_parent(server)
    before = parent_state(parent)
    # Every pid the episode can name or see in /proc, its parent's first: each hostile call.
    output = run(server, """
        libc.prlimit.argtypes = [C.c_int, C.c_int, C.c_void_p, C.c_void_p]
        low = (C.c_ulong * 2)(16, 16)
        def own_pid(path):  # this process's or thread's number here (/proc numbers them otherwise)
            status = P.read(P.open(path + '/status', P.O_RDONLY), 65536).decode()
            return int([l for l in status.splitlines() if l.startswith('NSpid')][0].split()[-1])
        mine = {own_pid('/proc/self/task/' + t) for t in P.listdir('/proc/self/task')} | {P.getpid()}
        seen = {P.getppid(), 1, 2, 3} | {int(p) for p in P.listdir('/proc') if p.isdigit()}
        done = []
        for pid in sorted(seen - mine - {0}):
            for what, call in (
                ('prlimit', lambda: libc.prlimit(pid, 7, low, None) == 0 and libc.prlimit(pid, 6, low, None) == 0
                 and libc.prlimit(pid, 3, low, None) == 0),
                ('renice', lambda: libc.setpriority(0, pid, 19) == 0),
                ('affinity', lambda: P.sched_setaffinity(pid, {0}) or True),
                ('idle', lambda: P.sched_setscheduler(pid, 5, P.sched_param(0)) or True),
                ('oom', lambda: P.write(P.open(f'/proc/{pid}/oom_score_adj', P.O_WRONLY), b'1000') > 0),
                ('ptrace', lambda: libc.ptrace(16, pid, None, None) == 0),
                ('stop', lambda: P.kill(pid, 19) or True),
            ):
                try:
                    if call():
                        done.append(f'{what}:{pid}')
                except OSError:
                    pass
        libc.setpriority(2, P.getuid(), 19)  # PRIO_USER: every process of this uid it can see
        print(' '.join(done) or 'nothing')
    """)
    after = parent_state(parent)
    assert after == before, f"the episode changed its warm parent ({output}): {before} -> {after}"
    # Only the episode itself was in reach; its next episode starts as it should.
    server.close_episode(collect=False)
    fresh = run(server, "print(P.nice(0), sorted(P.sched_getaffinity(0)) == sorted(range(P.cpu_count())))")
    assert fresh.split() == [str(os.nice(0)), "True"], fresh  # the niceness the suite itself runs at


def test_the_episode_is_stopped_between_steps(server):
    """Threads, interval timers and forks a cell leaves burn no CPU while the policy thinks."""
    run(server, """
        import threading
        def spin():
            while True:
                pass
        threading.Thread(target=spin, daemon=True).start()
        signal = typing.sys.modules['signal']
        def busy(*_):
            end = typing.sys.modules['time'].monotonic() + 0.05
            while typing.sys.modules['time'].monotonic() < end:
                pass
        signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
        signal.signal(signal.SIGALRM, busy)
        if P.fork() == 0:
            P.setsid()
            while True:
                pass
        print('planted')
    """, fresh=True)
    before = server_cpu_seconds(server)
    time.sleep(5.0)
    used = server_cpu_seconds(server) - before
    assert used < IDLE_CPU_S, f"the server used {used:.2f} CPU-s in the 5 s between two steps"
    # Thawed for the next request, it answers it.
    assert server.execute("print('still here')", timeout=40).strip().endswith("still here")


ZOMBIE_LEADER = """
    T = typing.sys.modules['threading']
    typing.sys.modules['limits'].kill_descendants = lambda: 0  # the episode's own clean-up
    if P.fork() == 0:
        def wake():  # SIGCONT the stopped episode (PID 1 here), then spin
            while True:
                try:
                    P.kill(1, 18)
                except OSError:
                    pass
        for _ in range(2):
            T.Thread(target=wake, daemon=True).start()
        libc.syscall(60, 0)  # exit(2): the main thread alone; the leader shows as a zombie
    def spin():
        while True:
            pass
    T.Thread(target=spin, daemon=True).start()
    print('planted')
"""
FORK_STORM = """
    typing.sys.modules['limits'].kill_descendants = lambda: 0
    def storm():
        while True:
            try:
                if P.fork() == 0:
                    P.setsid()
            except OSError:
                pass
            try:
                P.kill(1, 18)
            except OSError:
                pass
    T = typing.sys.modules['threading']
    T.Thread(target=storm, daemon=True).start()
    if P.fork() == 0:
        storm()
    typing.sys.modules['time'].sleep(0.3)
    print('storming')
"""


def episode_processes(server: AppWorldServer) -> list[psutil.Process]:
    """Processes of the episode's namespace that are not dead, seen from the host: below the
    warm parent, except the supervisor and the episode's process (which is stopped)."""
    parent = warm_parent(server)
    supervisors = parent.children()
    inside = [p for s in supervisors for p in s.children(recursive=True)]
    found = []
    for process in inside[1:]:  # inside[0]: the episode's process
        try:
            if any(psutil.Process(t.id).status() != psutil.STATUS_ZOMBIE for t in process.threads()):
                found.append(process)
        except psutil.Error:
            pass
    return found


def test_a_process_whose_main_thread_exited_does_not_outlive_the_pause_nor_wake_the_episode(server):
    output = run(server, ZOMBIE_LEADER, fresh=True)
    assert output.strip() == "planted", output
    before = server_cpu_seconds(server)
    time.sleep(5.0)
    used = server_cpu_seconds(server) - before
    assert used < IDLE_CPU_S, f"the server used {used:.2f} CPU-s in the 5 s between two steps"
    assert episode_processes(server) == []
    assert server.execute("print('still here')", timeout=40).strip().endswith("still here")


# Slow suite: eight fork storms, ~40 s; the sweep itself is checked by the other isolation tests.
@pytest.mark.slow
def test_a_fork_storm_never_outlasts_the_sweep(server):
    outcomes = []
    for trial in range(8):
        output = run(server, FORK_STORM, fresh=True)
        before = server_cpu_seconds(server)
        time.sleep(1.0)
        used = server_cpu_seconds(server) - before
        left = episode_processes(server)
        outcomes.append((trial, output.strip()[-20:], round(used, 2), len(left)))
    assert all(used < IDLE_CPU_S and left == 0 for _, _, used, left in outcomes), outcomes


THREAD_STORM = """
    T = typing.sys.modules['threading']
    typing.sys.modules['limits'].kill_descendants = lambda: 0  # the episode's own clean-up
    def storm():  # every thread (clone(CLONE_THREAD), through pthread_create) starts more, then spins
        while True:
            try:
                T.Thread(target=storm, daemon=True).start()
            except RuntimeError:
                break
        while True:
            pass
    if P.fork() == 0:
        P.setsid()
        storm()
    T.Thread(target=storm, daemon=True).start()
    libc.usleep(1000000)
    status = P.read(P.open('/proc/self/status', P.O_RDONLY), 65536).decode()
    print('threads', [l.split()[1] for l in status.splitlines() if l.startswith('Threads:')][0])
"""


def test_a_thread_storm_is_bounded_by_the_sandbox_and_does_not_outlive_the_step(server):
    """Threads starting threads, in the episode's process and in a child in a session of its
    own: they count against the sandbox's process limit, the child's die with the step, the
    episode's own are stopped between steps (no CPU), and all end with the episode."""
    output = run(server, THREAD_STORM, fresh=True)
    assert output.startswith("threads"), output
    assert int(output.split()[1]) <= server.limits.processes, output
    assert episode_processes(server) == []
    before = server_cpu_seconds(server)
    time.sleep(3.0)
    used = server_cpu_seconds(server) - before
    assert used < IDLE_CPU_S, f"the server used {used:.2f} CPU-s in the 3 s between two steps"
    assert server.execute("print('still here')", timeout=40).strip().endswith("still here")
    server.close_episode(collect=False)
    assert warm_parent(server).children() == []  # the episode's process and its threads are gone
    assert run(server, "print('next')", fresh=True).strip() == "next"


# ---------------------------------------------------------------------------- the kernel


def test_sockets_of_every_family_but_unix_are_refused(server):
    # Creation only: never bind or connect a vsock port (the virtual machine's host channel).
    output = run(server, """
        S = typing.sys.modules['socket']
        families = {'vsock': 40, 'netlink': 16, 'packet': 17, 'alg': 38, 'bluetooth': 31, 'inet': 2, 'inet6': 10,
                    'key': 15, 'rds': 21, 'tipc': 30, 'xdp': 44, 'can': 29, 'qipcrtr': 42}
        for name, family in families.items():
            for kind in (S.SOCK_STREAM, S.SOCK_DGRAM, S.SOCK_RAW, S.SOCK_SEQPACKET):
                fd = libc.socket(family, kind, 0)
                if fd >= 0:
                    P.close(fd)
                    print('created', name, kind)
        fd = libc.syscall(41, (1 << 32) | 40, 1, 0)  # socket(2), family with high bits set
        if fd >= 0:
            P.close(fd)
            print('created vsock-high-bits')
        a, b = S.socketpair()
        print('unix ok')
    """, fresh=True)
    assert output.strip() == "unix ok", output


def test_kernel_budgets_shared_with_the_host_cannot_be_used_up(server):
    output = run(server, """
        signal = typing.sys.modules['signal']
        fcntl = typing.sys.modules['fcntl']
        made = 0
        for _ in range(200):
            fd = libc.inotify_init1(0)
            if fd < 0:
                break
            made += 1
        print('inotify', made)
        r, w = P.pipe()
        try:
            fcntl.fcntl(w, 1031, 1 << 20)
            print('pipe-resized')
        except OSError:
            print('pipe-fixed')
        try:
            P.openpty()
            print('pty')
        except OSError:
            print('no-pty')
        signal.signal(signal.SIGRTMIN, lambda *_: None)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
        queued = 0
        for _ in range(5000):
            try:
                signal.pthread_kill(typing.sys.modules['threading'].main_thread().ident, signal.SIGRTMIN)
            except OSError:
                break
            queued += 1
        print('rt-signals', queued if queued < 5000 else 'unbounded')
        limits = P.read(P.open('/proc/self/limits', P.O_RDONLY), 65536).decode().splitlines()
        print('sigpending-limit', [l for l in limits if 'pending' in l][0].split()[3])
    """, fresh=True)
    lines = dict((line.split(" ", 1) + [""])[:2] for line in output.strip().splitlines())
    assert lines["inotify"] == "0", output
    assert "pipe-fixed" in output and "no-pty" in output, output
    assert int(lines["sigpending-limit"]) <= 1024, output
    assert lines["rt-signals"] != "unbounded", output


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user, every sandbox's nobody is that user")
def test_each_sandbox_is_a_host_user_of_its_own(server):
    other = AppWorldServer(find_python(), MINI, sandbox="bwrap")
    try:
        other.start()
        other.wait_ready()
        uids = {warm_parent(one).uids().real for one in (server, other)}
    finally:
        other.shutdown()
    assert len(uids) == 2 and not uids & {0, 65534, os.getuid()}, uids


# ---------------------------------------------------------------------------- concurrent sandboxes

# A sender encodes bits as locks on a file every sandbox binds from the host (the interpreter):
# POSIX record locks, OFD locks and flock; a receiver in another sandbox, at the same time,
# reads them with F_GETLK / F_OFD_GETLK, a non-blocking flock and /proc/locks.
FLOCK = "'hh4xqqi4x'"  # struct flock on 64-bit Linux
SEND_BY_LOCKS = """
    F, S = typing.sys.modules['fcntl'], typing.sys.modules['struct']
    exe = typing.sys.executable
    held = [P.open(exe, P.O_RDONLY) for _ in range(3)]
    for i in range(16):
        if {secret} >> i & 1:
            F.fcntl(held[0], F.F_SETLK, S.pack(FLOCK, F.F_RDLCK, 0, {base} + i, 1, 0))
            F.fcntl(held[1], 37, S.pack(FLOCK, F.F_RDLCK, 0, {base} + 100 + i, 1, 0))  # F_OFD_SETLK
    if {secret} & 1:
        F.flock(held[2], F.LOCK_SH)
    typing.sys.modules['builtins'].seeupo_held = held  # keep them open between steps
    print('sent')
""".replace("FLOCK", FLOCK)
RECEIVE_BY_LOCKS = """
    F, S = typing.sys.modules['fcntl'], typing.sys.modules['struct']
    exe = typing.sys.executable
    fd = P.open(exe, P.O_RDONLY)
    def probe(command, start):
        try:
            kind = S.unpack(FLOCK, F.fcntl(fd, command, S.pack(FLOCK, F.F_WRLCK, 0, start, 1, 0)))[0]
            return '1' if kind != F.F_UNLCK else '0'
        except OSError:
            return 'e'
    posix = ''.join(probe(F.F_GETLK, {base} + i) for i in range(16))
    ofd = ''.join(probe(36, {base} + 100 + i) for i in range(16))  # F_OFD_GETLK
    try:
        F.flock(fd, F.LOCK_EX | F.LOCK_NB)
        flock = '0'
    except BlockingIOError:
        flock = '1'
    except OSError:
        flock = 'e'
    inode = ':' + str(P.stat(exe).st_ino) + ' '
    listed = P.read(P.open('/proc/locks', P.O_RDONLY), 1 << 20).decode().splitlines()
    starts = sorted(int(line.split()[-2]) - {base} for line in listed if inode in line
                    and {base} <= int(line.split()[-2]) < {base} + 200)
    print(posix, ofd, flock, starts)
""".replace("FLOCK", FLOCK)


@pytest.fixture(scope="module")
def other_server():
    own = AppWorldServer(find_python(), MINI, sandbox="bwrap")
    own.start()
    own.wait_ready()
    yield own
    own.shutdown()


def test_concurrent_sandboxes_cannot_pass_bits_through_locks_on_shared_files(server, other_server):
    """Sandbox A holds locks on the interpreter (bound read-only from the host into every
    sandbox) while sandbox B's episode runs: B reads the same thing whatever A sent."""
    base = 10**6 + int.from_bytes(os.urandom(2), "big") * 1000  # apart from other runs' locks
    seen = []
    for secret in (0xA5A5, 0x5A5A):
        sent = run(server, SEND_BY_LOCKS.format(secret=secret, base=base), fresh=True)
        assert sent.strip() == "sent", sent
        seen.append(run(other_server, RECEIVE_BY_LOCKS.format(base=base), fresh=True).strip())
    assert seen[0] == seen[1], f"B read different locks for different secrets: {seen}"
    posix, ofd, flock, starts = seen[0].split(" ", 3)
    assert "1" not in posix + ofd + flock and starts == "[]", seen[0]


def test_locks_model_code_takes_exclude_nothing_and_sqlite_still_reads_the_tasks_dbs(server):
    # The episode's world was opened from the task's DB files (SQLite takes its locks there):
    # the ground truth still solves the task under the filter.
    server.close_episode(collect=False)
    server.open_episode("mininote_2", timeout_seconds=10, max_interactions=50)
    server.execute(solution("mininote_2"), timeout=40)
    assert server.grade("mininote_2", server.close_episode(collect=True))["success"]
    output = run(server, """
        F, S = typing.sys.modules['fcntl'], typing.sys.modules['struct']
        fd = P.open('/scratch/tmp/own', P.O_RDWR | P.O_CREAT)
        F.fcntl(fd, F.F_SETLK, S.pack(FLOCK, F.F_WRLCK, 0, 0, 1, 0))
        F.flock(fd, F.LOCK_EX)
        print('taken')
        for what, call in (('getlk', lambda: F.fcntl(fd, F.F_GETLK, S.pack(FLOCK, F.F_WRLCK, 0, 0, 1, 0))),
                           ('lease', lambda: F.fcntl(fd, 1024, F.F_RDLCK)),
                           ('notify', lambda: F.fcntl(P.open('/usr/bin', P.O_RDONLY), 1026, 1)),
                           ('nowait', lambda: P.preadv(fd, [bytearray(1)], 0, 8)),
                           ('evict', lambda: P.posix_fadvise(fd, 0, 0, 4))):
            try:
                call()
                print(what, 'allowed')
            except OSError:
                print(what, 'refused')
        for what, number in (('mincore', 27), ('cachestat', 451)):  # ENOSYS
            print(what, 'refused' if libc.syscall(number, 0, 0, 0, 0) == -1 and C.get_errno() == 38 else 'allowed')
    """.replace("FLOCK", FLOCK), fresh=True)
    lines = output.strip().splitlines()
    assert lines[0] == "taken" and all(line.endswith("refused") for line in lines[1:]), output



def test_exclusive_steps_never_run_two_sandboxes_cells_at_once(server, other_server):
    """With `SandboxLimits(exclusive_steps=True)` a cell runs only while no other sandbox's does,
    so one cannot time another's CPU use: two cells started together, each spinning 0.6 s on
    CLOCK_MONOTONIC, run one after the other. The control, without it: they overlap."""
    import dataclasses
    import threading

    spin = CLOCK + "start = now()\nwhile now() < start + 0.6:\n    pass\nprint(start, now())\n"

    def together() -> list[tuple[float, float]]:
        for each in (server, other_server):
            run(each, "print(1)", fresh=True)  # both episodes open and stopped between steps
        spans: list[str] = []
        threads = [threading.Thread(target=lambda s=each: spans.append(run(s, spin))) for each in (server, other_server)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sorted(tuple(float(x) for x in span.split()) for span in spans)

    (a_start, a_end), (b_start, b_end) = together()
    assert b_start < a_end, "the control: without exclusive_steps the two cells overlap"
    saved = server.limits, other_server.limits
    try:
        server.limits = dataclasses.replace(server.limits, exclusive_steps=True)
        other_server.limits = dataclasses.replace(other_server.limits, exclusive_steps=True)
        (a_start, a_end), (b_start, b_end) = together()
    finally:
        server.limits, other_server.limits = saved
    assert a_end - a_start >= 0.6 and b_start >= a_end, (a_start, a_end, b_start, b_end)



def test_a_step_waiting_past_exclusive_wait_s_fails_as_a_timeout_and_the_lock_frees_with_its_holder():
    from seeupo_gym.appworld.server import ServerTimeout, exclusive_step

    with exclusive_step(1.0):
        started = time.monotonic()
        with pytest.raises(ServerTimeout, match="exclusive_wait_s=0.2"):
            with exclusive_step(0.2):
                pass
        assert 0.2 <= time.monotonic() - started < 2.0
    with exclusive_step(0.2):  # released when its holder left
        pass


# Global kernel counters: a sandbox busy with memory, scratch files, CPU, processes and Unix
# sockets, while another sandbox reads every file under /proc and /sys it can (a bounded
# read each) before and during that activity.
# AppWorld fakes `time` in cells (a frozen clock, a disabled sleep): the kernel's clock instead.
CLOCK = """
class Timespec(C.Structure):
    _fields_ = [('s', C.c_long), ('ns', C.c_long)]
def now(ts=Timespec()):
    libc.clock_gettime(1, C.byref(ts))
    return ts.s + ts.ns * 1e-9
def sleep(seconds):
    libc.usleep(max(0, int(seconds * 1e6)))
def sleep_until(moment):
    sleep(moment - now())
"""
# A's schedule and B's snapshots follow one clock (CLOCK_MONOTONIC is the machine's): slots of
# SLOT_S seconds from a start the host gives, A idle in the even ones and busy in the odd ones.
SLOT_S = 1.2
PHASES = "IBIBIB"
BUSY = CLOCK + textwrap.dedent("""
    S = typing.sys.modules['socket']
    chunk = b'x' * (1 << 20)
    def work(until):  # memory, a scratch file written and truncated, sockets, a fork, CPU
        while now() < until:
            block = bytearray(16 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            del block
            fd = P.open('/scratch/tmp/busy', P.O_WRONLY | P.O_CREAT | P.O_TRUNC, 0o600)
            for _ in range(16):
                P.write(fd, chunk)
            P.ftruncate(fd, 0)
            P.close(fd)
            a, b = S.socketpair()
            for _ in range(16):
                a.sendall(chunk[:65536]); b.recv(65536)
            a.close(); b.close()
            listener = S.socket(S.AF_UNIX, S.SOCK_STREAM)
            listener.bind('/scratch/tmp/busy.sock'); listener.listen(); listener.close()
            P.unlink('/scratch/tmp/busy.sock')
            pid = P.fork()
            if pid == 0:
                P._exit(0)
            P.waitpid(pid, 0)
            spin = now() + 0.02
            while now() < spin:
                pass
    start, slot = {start!r}, {slot!r}
    for i, phase in enumerate({phases!r}):
        if phase == 'B':
            sleep_until(start + i * slot)
            work(start + (i + 1) * slot)
    print('busy')
""")
SNAPSHOT = CLOCK + """
def snapshot(roots=('/proc', '/sys'), limit=4096, most=30000, depth=6):
    # {path: hash of its first `limit` bytes} for every file readable under `roots`; links not followed
    found, stack = {}, [(root, 0) for root in roots]
    while stack and len(found) < most:
        folder, level = stack.pop()
        try:
            names = P.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = folder.rstrip('/') + '/' + name
            try:
                kind = P.lstat(path).st_mode & 0o170000
            except OSError:
                continue
            if kind == 0o040000 and level < depth:
                stack.append((path, level + 1))
            elif kind == 0o100000:
                try:
                    fd = P.open(path, P.O_RDONLY | P.O_NONBLOCK)
                except OSError:
                    continue
                try:
                    found[path] = hash(P.read(fd, limit))
                except OSError:
                    pass
                finally:
                    P.close(fd)
    return found
"""
WATCH = textwrap.dedent("""
    start, slot = {start!r}, {slot!r}
    took, pairs = 0.0, []
    for i in range({slots}):
        sleep_until(start + i * slot + 0.1)
        first = snapshot()
        sleep_until(start + (i + 1) * slot - 0.1 - took)
        begun = now()
        second = snapshot()
        took = max(took, now() - begun)
        pairs.append(sorted(p for p in first.keys() | second.keys() if first.get(p) != second.get(p)))
    print(typing.sys.modules['json'].dumps({{'files': len(first), 'pairs': pairs}}))
""")
OWN_PROCESS = r"^/proc/\d+/"  # B's own sandbox's processes (a pid namespace of its own)
# How B itself ran (the timing channel); arch_status is the ms since B's own last AVX-512 use.
SCHEDULER = r"/(sched|schedstat|stat|status|arch_status)$"


def test_no_file_under_proc_or_sys_changes_with_a_concurrent_sandboxs_activity(server, other_server):
    """Sandbox A idle and busy in turns (memory, scratch files, CPU, forks, Unix sockets);
    sandbox B reads every file it can under /proc and /sys at the start and end of each turn.
    Outside B's own processes no file changes at all. Of B's own process files, none changes
    in every busy turn and no idle one, except the scheduler's counters of B's own running
    (the timing channel, measured by scripts/sandbox_channel_capacity.py).
    The control: the host's unmasked /proc sees A's scratch file come and go."""
    import re
    import threading

    for one in (server, other_server):
        one.close_episode(collect=False)
        one.open_episode("mininote_1", timeout_seconds=40, max_interactions=50)
    start = time.monotonic() + 3.0
    busy: list[str] = []
    watched: list[str] = []
    shmem: list[int] = []
    threads = [
        threading.Thread(target=lambda: busy.append(server.execute(
            PRELUDE + BUSY.format(start=start, slot=SLOT_S, phases=PHASES), timeout=60))),
        threading.Thread(target=lambda: watched.append(other_server.execute(
            PRELUDE + SNAPSHOT + WATCH.format(start=start, slot=SLOT_S, slots=len(PHASES)), timeout=60))),
    ]
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            shmem.append(_meminfo_kb("Shmem"))  # the control: the host's /proc sees A's tmpfs pages
            time.sleep(0.01)
    finally:
        for thread in threads:
            thread.join()
    assert busy and busy[0].strip() == "busy", busy
    assert watched and watched[0].strip().startswith("{"), watched
    assert max(shmem) - min(shmem) >= 8 * 1024, "the control saw no sign of A's scratch file on the host"
    pairs = [set(paths) for paths in json.loads(watched[0].strip().splitlines()[-1])["pairs"]]
    own, scheduler = re.compile(OWN_PROCESS), re.compile(SCHEDULER)
    for phase, paths in zip(PHASES, pairs):
        outside = sorted(path for path in paths if not own.match(path))
        assert not outside, f"files outside B's own processes changed ({'A busy' if phase == 'B' else 'A idle'}): {outside[:40]}"
    in_every_busy = set.intersection(*(paths for phase, paths in zip(PHASES, pairs) if phase == "B"))
    in_an_idle = set.union(*(paths for phase, paths in zip(PHASES, pairs) if phase == "I"))
    follows_a = sorted(path for path in in_every_busy - in_an_idle if not scheduler.search(path))
    assert not follows_a, f"B's own process files changed with A's activity: {follows_a[:40]}"


def _meminfo_kb(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/meminfo")


def test_an_answer_cannot_cross_concurrent_sandboxes_through_shared_memory_counters(server, other_server):
    """The attack that won: A writes and truncates a file in its tmpfs /scratch, one bit per
    0.25 s slot; B polls /proc/meminfo's Shmem and sysinfo at the same time. B reads one
    constant value and a refused sysinfo, whatever A sends."""
    import threading

    send = CLOCK + textwrap.dedent("""
        start = now()
        for i in range(16):
            fd = P.open('/scratch/tmp/bit', P.O_WRONLY | P.O_CREAT | P.O_TRUNC, 0o600)
            if {secret} >> i & 1:
                for _ in range(48):
                    P.write(fd, b'x' * (1 << 20))
            P.close(fd)
            while now() < start + 0.25 * (i + 1):
                sleep(0.005)
        P.unlink('/scratch/tmp/bit')
        print('sent')
    """)
    receive = CLOCK + textwrap.dedent("""
        info = (C.c_ulong * 16)()
        seen, refused = set(), set()
        end = now() + 5.0
        while now() < end:
            fd = P.open('/proc/meminfo', P.O_RDONLY)
            seen.add(P.read(fd, 65536).decode())
            P.close(fd)
            refused.add(libc.sysinfo(info) == -1 and C.get_errno())
            sleep(0.01)
        print(len(seen), sorted(refused), [l for l in next(iter(seen)).splitlines() if l.startswith('Shmem')])
    """)
    run(server, "print('ready')", fresh=True)
    run(other_server, "print('ready')", fresh=True)
    sent: list[str] = []
    sender = threading.Thread(target=lambda: sent.append(run(server, send.format(secret=0xB6A5))))
    sender.start()
    try:
        seen = run(other_server, receive)
    finally:
        sender.join()
    assert sent and sent[0].strip() == "sent", sent
    assert seen.strip() == "1 [1] ['Shmem: 0 kB']", seen


def test_model_code_still_reads_its_own_process_facts_and_constant_machine_facts(server):
    """What psutil and AppWorld read under /proc works: boot time, this process's memory,
    the CPU count; machine-wide files are constants or empty, /proc/sys is an empty folder, and
    none of them can be written or unmounted."""
    output = run(server, """
        psutil = typing.sys.modules['importlib'].import_module('psutil')
        utils = typing.sys.modules['importlib'].import_module('appworld.common.utils')
        read = lambda path: P.read(P.open(path, P.O_RDONLY), 65536).decode()
        facts = {
            'boot': abs(psutil.boot_time() - BOOT) < 2,
            'rss': psutil.Process(P.getpid()).memory_info().rss > 0,
            'appworld_mb': utils.memory_usage_mb() > 0,
            'cpus': P.cpu_count() == CPUS,
            'total': psutil.virtual_memory().total,
            'sys': P.listdir('/proc/sys'), 'pressure': P.listdir('/proc/pressure'),
            'vmstat': read('/proc/vmstat'), 'locks': read('/proc/locks'),
            'self': 'VmRSS' in read('/proc/self/status'),
        }
        for path in ('/proc/meminfo', '/proc/sys/kernel/ns_last_pid'):
            try:
                P.close(P.open(path, P.O_WRONLY))
                facts['wrote ' + path] = True
            except OSError:
                pass
        facts['umount'] = libc.umount2(b'/proc/meminfo', 2) == 0
        print(typing.sys.modules['json'].dumps(facts))
    """.replace("BOOT", str(psutil.boot_time())).replace("CPUS", str(os.cpu_count())), fresh=True)
    assert output.strip().startswith("{"), output
    facts = json.loads(output.strip().splitlines()[-1])
    assert facts == {
        "boot": True, "rss": True, "appworld_mb": True, "cpus": True, "total": 3072 * 2**20,
        "sys": [], "pressure": [], "vmstat": "", "locks": "", "self": True, "umount": False,
    }, output


# ---------------------------------------------------------------------------- the grader

COLLATERAL = ["assert no model other than simple_note.Note changed."]


@pytest.fixture(scope="module")
def honest_state(server) -> dict[str, str]:
    """The change files of mininote_2 solved by its ground truth: scores 1.0."""
    server.close_episode(collect=False)
    server.open_episode("mininote_2", timeout_seconds=10, max_interactions=50)
    server.execute(solution("mininote_2"), timeout=40)
    state = server.close_episode(collect=True)
    assert server.grade("mininote_2", state)["success"]
    return state


def with_change(state: dict[str, str], app: str, statement: str) -> dict[str, str]:
    """`state` with one raw statement appended to an app's change file, as model code can."""
    return {**state, f"{app}.jsonl": state.get(f"{app}.jsonl", "") + json.dumps([statement, [], False]) + "\n"}


@pytest.mark.parametrize("statement", [
    "DELETE FROM main.alarms",  # schema-qualified
    'DELETE FROM "main"."alarms" WHERE id = 1',
    "UPDATE alarms SET label = 'moved' WHERE id = 1",  # a raw update keeps the row's record hash
    "UPDATE alarms SET label = 'moved', record_hash = 'P3GemumZyCA=' WHERE id = 1",  # or restores it
])
def test_side_effects_the_episode_writes_itself_are_seen_by_the_grader(server, honest_state, statement):
    report = server.grade("mininote_2", with_change(honest_state, "phone", statement))
    assert [f["requirement"] for f in report["failures"]] == COLLATERAL, report


@pytest.mark.parametrize("statement", [
    "CREATE TABLE loot (x)",
    "DROP TABLE alarms",
    "UPDATE alarms SET label = randomblob(300000000) || randomblob(300000000) WHERE id = 1",
    "ATTACH DATABASE '/scratch/x.db' AS x",
    "INSERT INTO alarms (time) SELECT time FROM alarms",
])
def test_the_grader_replays_nothing_but_data_changes_of_the_apps_own_tables(server, honest_state, statement):
    with pytest.raises(ServerError, match="not a data change|does not replay"):
        server.grade("mininote_2", with_change(honest_state, "phone", statement))


def test_a_self_join_costs_the_grader_a_bounded_moment_and_no_restart(server, honest_state):
    # 14 copies of a 4-row table: 4**14 rows to visit; the replay's step budget ends it.
    join = "UPDATE alarms SET label = 'x' FROM " + ", ".join(f"alarms a{i}" for i in range(13))
    grader = psutil.Process(server._grader.pid)
    start = time.monotonic()
    with pytest.raises(ServerError, match="over 10000000 SQLite steps"):
        server.grade("mininote_2", with_change(honest_state, "phone", join))
    assert time.monotonic() - start < 10, time.monotonic() - start  # a busy 2-core machine: ~1 s
    assert server._grader.pid == grader.pid and grader.is_running()
    assert server.grade("mininote_2", honest_state)["success"]


# ---------------------------------------------------------------------------- the wire

# The episode's socket and the request being answered, from the frame of `episode.serve`.
FIND_SOCKET = """
W = typing.sys.modules['wire']
def frames():
    for f in typing.sys._current_frames().values():  # the cell may run in a thread of its own
        while f is not None:
            yield f
            f = f.f_back
f = next(f for f in frames() if isinstance(f.f_locals.get('request'), dict) and 'sock' in f.f_locals)
sock, request = f.f_locals['sock'], f.f_locals['request']
"""


@pytest.fixture(scope="module")
def env():
    patch = pytest.MonkeyPatch()
    patch.setattr("seeupo_gym.appworld.env.refusal", lambda code: None)
    made = gym.make("seeupo/AppWorld-v0", split="mini", sandbox="bwrap", max_turns=10, timeout_seconds=6, response_grace_s=4,
                    max_output_chars=20_000)
    yield made
    made.close()
    patch.undo()


def forge(env: gym.Env, reply: str, task_id: str = "mininote_1") -> tuple[str, float, bool, dict]:
    env.reset(options={"task_id": task_id})
    code = PRELUDE + FIND_SOCKET + f"W.send(sock, {reply})\nprint('real output')"
    observation, reward, terminated, truncated, info = env.step(render_action(code))
    return observation, reward, terminated, info


def assert_well_formed(observation: str, info: dict) -> None:
    for text in (observation, info["action_error"], info["termination_reason"]):
        assert len(text) <= 25_000, len(text)
        text.encode("utf-8")  # no lone surrogates


@pytest.mark.parametrize("reply", [
    "{'ok': False, 'error': 'x' * 1_600_000 + chr(0xD800)}",  # an over-long error, a lone surrogate
    "{'ok': True, 'output': 'forged ' + chr(0xDC80) * 10}",  # a reply to no request
    "{'ok': True, 'output': True}",  # a reply to a task_completed request not yet sent
])
def test_a_forged_reply_ends_the_episode_as_an_error_never_shifting_later_replies(env, reply):
    observation, reward, terminated, info = forge(env, reply)
    assert terminated and reward == 0.0
    assert "forged or stale" in info["termination_reason"], info["termination_reason"]
    assert_well_formed(observation, info)
    # The next episode is in phase: each reply answers its own request.
    env.reset(options={"task_id": "mininote_1"})
    for word in ("first", "second"):
        observation, *_ = env.step(render_action(f"print('{word}')"))
        assert observation.strip() == word


def test_a_forged_reply_carrying_the_requests_own_id_is_only_that_steps_output(env):
    # Model code can read the request (frames); its forgery then stands for this step's
    # output, which it controls anyway. The real reply that follows answers nothing: the next
    # request ends the episode instead of reading it.
    env.reset(options={"task_id": "mininote_1"})
    code = PRELUDE + FIND_SOCKET + "W.send(sock, {'ok': True, 'output': 'FORGED', 'id': request.get('id')})"
    observation, *_ = env.step(render_action(code))
    assert observation == "FORGED"
    observation, reward, terminated, _, info = env.step(render_action("print('next')"))
    assert terminated and "forged or stale" in info["termination_reason"]
    assert "next" not in observation or "Error" in observation


def test_a_claimed_completion_is_not_a_completed_task(env):
    # The episode's process says its task is completed (a patch here; a forged reply is the
    # same claim): the grader finds no completed task in its state, and the episode goes on.
    env.reset(options={"task_id": "mininote_1"})
    patch = "random._os.sys.modules['appworld.environment'].AppWorld.task_completed = lambda self: True"
    observation, reward, terminated, truncated, info = env.step(render_action(PRELUDE + patch + "\n# complete_task"))
    assert (terminated, truncated, reward) == (False, False, 0.0), info["termination_reason"]
    # A real completion ends it, as the grader says.
    _, reward, terminated, _, info = env.step(render_action(solution("mininote_1")))
    assert terminated and info["termination_reason"] == "completed" and reward == 1.0


# ---------------------------------------------------------------------------- recovery


# Slow suite: waits out a step deadline, ~40 s.
@pytest.mark.slow
def test_a_stopped_warm_parent_is_replaced_within_the_step_deadline():
    with ServerPool(MINI, sandbox="bwrap") as pool:
        env = gym.make("seeupo/AppWorld-v0", split="mini", server_pool=pool, timeout_seconds=4, response_grace_s=3)
        try:
            env.reset(options={"task_id": "mininote_1"})
            parent = warm_parent(env.unwrapped.server)
            parent.suspend()
            start = time.monotonic()
            observation, reward, terminated, _, info = env.step(render_action("print(1)"))
            step_s = time.monotonic() - start
            assert terminated and info["termination_reason"], observation
            assert step_s < 4 + 3, step_s
            start = time.monotonic()
            env.reset(options={"task_id": "mininote_1"})
            observation, *_ = env.step(render_action("print(2)"))
            assert observation.strip() == "2"
            assert time.monotonic() - start < 60
        finally:
            env.close()
