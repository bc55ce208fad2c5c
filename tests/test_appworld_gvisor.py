"""AppWorld under gVisor, the default where runsc runs (`sandbox="auto"`): each sandbox a kernel
of its own, and each episode a sandbox no earlier episode ran in. The attacks here run under the
default settings: a sender moves a kernel counter, a receiver in a concurrent episode or in the
next episode of the same env reads it, and its reading must not follow what was sent.

Skipped, saying why, where runsc cannot run here (`make runsc` installs it). The red-team suite
runs against gVisor too:
    SEEUPO_TEST_APPWORLD_SANDBOX=gvisor .venv/bin/python -m pytest -q -p no:xdist tests/test_appworld_redteam.py
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from seeupo_gym.appworld import find_python, sandbox
from seeupo_gym.appworld.env import AppWorldEnv
from seeupo_gym.appworld.sandbox import Launcher, SandboxLimits, SandboxUnavailable
from seeupo_gym.appworld.server import AppWorldServer, ServerDied, ServerTimeout
from conftest import appworld_mini
from redteam_cells import KERNEL_COUNTERS

pytestmark = pytest.mark.appworld

MINI, _ = appworld_mini()
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sandbox_channel_capacity.py"


def capacity_script():
    spec = importlib.util.spec_from_file_location("sandbox_channel_capacity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def servers(mode: str | None, count: int = 2, limits: SandboxLimits | None = None) -> list[AppWorldServer]:
    """`count` started servers; mode None: the default settings, skipped where they are not
    gVisor here (no runsc: the default is then bwrap, with its warning)."""
    try:
        Launcher(find_python(), mode or "gvisor")
    except SandboxUnavailable as error:
        pytest.skip(f"no {mode or 'gvisor (the default)'} sandbox here: {str(error)[:300]}")
    if mode is None:
        pair = [AppWorldServer(find_python(), MINI, limits=limits) for _ in range(count)]
        assert all(server.sandbox == "gvisor" and server.fresh_kernels for server in pair)
    else:
        pair = [AppWorldServer(find_python(), MINI, sandbox=mode, limits=limits) for _ in range(count)]
    for server in pair:
        server.start()
    for server in pair:
        server.wait_ready()
    return pair


@pytest.fixture(scope="module")
def default_pair():
    pair = servers(None)
    yield pair
    for server in pair:
        server.shutdown()


def run(server: AppWorldServer, code: str, fresh: bool = False, task_id: str = "mininote_1") -> str:
    if fresh:
        server.close_episode(collect=False)
    if not server.episode_active:
        server.open_episode(task_id, timeout_seconds=40, max_interactions=50)
    return server.execute(PRELUDE + textwrap.dedent(code), timeout=60)


PRELUDE = """
import random, typing
P = random._os.sys.modules['posix']
O = random._os
C = typing.sys.modules['ctypes']
S = typing.sys.modules['socket']
libc = C.CDLL(None, use_errno=True)
"""

# 2-bit symbols, each value twice: a receiver whose readings follow them would decode them all.
SYMBOLS = [3, 0, 2, 1, 0, 3, 1, 2]


def test_appworld_default_inode_storage_channel_between_concurrent_episodes_carries_nothing(default_pair):
    """The attack that won under bwrap: sandbox A's step makes symbol x 2048 pipes, sandbox B's
    next step reads how many inode batches other CPUs took since its last one. Under the default
    (gVisor) B reads the same count after every symbol: its inode numbers are its own kernel's."""
    sender, receiver = default_pair
    for server in default_pair:
        server.close_episode(collect=False)
        server.open_episode("mininote_1", timeout_seconds=600, max_interactions=50)
    decoded, taken, _ = capacity_script().measure_storage(sender, receiver, SYMBOLS, bits=2, unit=2048)
    assert len(set(taken)) == 1, f"B's readings followed A's symbols {SYMBOLS}: {taken}"
    assert sum(d == s for d, s in zip(decoded, SYMBOLS)) <= len(SYMBOLS) // 2  # one value of four: chance


def test_appworld_bwrap_inode_storage_channel_carries_the_symbols_control():
    """The control: the same sender and receiver in two bubblewrap sandboxes (one host kernel)
    pass every symbol."""
    pair = servers("bwrap")
    try:
        for server in pair:
            server.open_episode("mininote_1", timeout_seconds=600, max_interactions=50)
        decoded, taken, _ = capacity_script().measure_storage(pair[0], pair[1], SYMBOLS, bits=2, unit=4096)
    finally:
        for server in pair:
            server.shutdown()
    assert decoded == SYMBOLS, f"batches read: {taken}"


def test_appworld_gvisor_sandbox_keeps_the_bwrap_guarantees(default_pair):
    """Inside: nobody without capabilities, its own kernel, no network but a loopback, a
    read-only root that holds no host file but the binds (no ground truth), a writable scratch,
    the scrubbed environment, the rlimits the episode asked for."""
    output = run(default_pair[0], """
        facts = {'uid': P.getuid(), 'gid': P.getgid(), 'own_kernel': O.path.exists('/proc/sentry-meminfo')}
        status = P.read(P.open('/proc/self/status', P.O_RDONLY), 65536).decode()
        facts['caps'] = sorted({line.split()[1] for line in status.splitlines() if line.startswith(('CapEff', 'CapPrm'))})
        try:
            S.create_connection(('1.1.1.1', 80), timeout=2)
            facts['net'] = 'connected'
        except OSError as error:
            facts['net'] = type(error).__name__
        facts['ifaces'] = sorted(P.listdir('/sys/class/net')) if O.path.exists('/sys/class/net') else []
        written = []
        for path in ('/x', '/usr/x', '/aw/x', '/aw/data/x', '/opt/seeupo-worker/x', '/scratch/tmp/x'):
            try:
                P.close(P.open(path, P.O_WRONLY | P.O_CREAT, 0o600))
                written.append(path)
            except OSError:
                pass
        facts['written'] = written
        facts['tasks'] = sorted(P.listdir('/aw/data/tasks'))
        facts['truth'] = O.path.exists('/aw/data/tasks/mininote_1/ground_truth')
        facts['host_data'] = O.path.exists(MINI)
        facts['env'] = sorted(O.environ)
        R = typing.sys.modules['resource']
        facts['as_mb'] = R.getrlimit(R.RLIMIT_AS)[0] >> 20
        print(typing.sys.modules['json'].dumps(facts))
    """.replace("MINI", repr(str(MINI))), fresh=True)
    assert output.strip().startswith("{"), output
    facts = json.loads(output.strip().splitlines()[-1])
    assert facts["uid"] == facts["gid"] == 65534 and facts["own_kernel"], facts
    assert facts["caps"] == ["0000000000000000"], facts
    assert facts["net"] != "connected" and facts["ifaces"] in ([], ["lo"]), facts
    assert facts["written"] == ["/scratch/tmp/x"], facts
    assert facts["tasks"] == ["mininote_1"] and not facts["truth"] and not facts["host_data"], facts
    assert facts["env"] == ["APPWORLD_CACHE", "APPWORLD_ROOT", "HOME", "IPYTHONDIR", "LANG", "PATH",
                            "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE", "SEEUPO_SANDBOXED", "SEEUPO_SCRATCH",
                            "TMPDIR"], facts
    assert facts["as_mb"] == 3072, facts


def test_appworld_gvisor_grades_the_ground_truth_solution_as_a_success(default_pair):
    """A whole episode through both gVisor sandboxes: the task's own solution scores 1.0, doing
    nothing scores less."""
    server = default_pair[0]
    server.close_episode(collect=False)
    server.open_episode("mininote_2", timeout_seconds=40, max_interactions=50)
    server.execute((MINI / "tasks" / "mininote_2" / "ground_truth" / "solution.py").read_text(), timeout=60)
    assert server.grade("mininote_2", server.close_episode(collect=True))["success"]
    server.open_episode("mininote_2", timeout_seconds=40, max_interactions=50)
    assert not server.grade("mininote_2", server.close_episode(collect=True))["success"]


# The /proc and /sys differential of tests/test_appworld_isolation.py, for gVisor: there /proc
# and /sys are B's own kernel's, unmasked, so files change with B's own activity (uptime, its
# memory); none may change with A's, i.e. in every busy turn of A and in no idle one.
def test_appworld_gvisor_no_file_under_proc_or_sys_follows_a_concurrent_sandboxs_activity(default_pair):
    """Sandbox A idle and busy in turns (memory, scratch files, CPU, forks, Unix sockets);
    sandbox B reads every file it can under /proc and /sys at the start and end of each turn.
    No file changes in every busy turn and no idle one, but the scheduler's counters of B's own
    running (as in tests/test_appworld_isolation.py). The control: the host's /proc sees A's
    scratch file come and go."""
    import test_appworld_isolation as isolation

    server, other = default_pair
    for one in default_pair:
        one.close_episode(collect=False)
        one.open_episode("mininote_1", timeout_seconds=40, max_interactions=50)
    # Each gVisor kernel has a CLOCK_MONOTONIC of its own: the two follow the wall clock instead.
    def on_wall_clock(code: str) -> str:
        assert "libc.clock_gettime(1," in code
        return code.replace("libc.clock_gettime(1,", "libc.clock_gettime(0,")

    start = time.time() + 5.0
    busy: list[str] = []
    watched: list[str] = []
    shmem: list[int] = []
    threads = [
        threading.Thread(target=lambda: busy.append(server.execute(on_wall_clock(
            isolation.PRELUDE + isolation.BUSY.format(start=start, slot=isolation.SLOT_S, phases=isolation.PHASES)),
            timeout=90))),
        threading.Thread(target=lambda: watched.append(other.execute(on_wall_clock(
            isolation.PRELUDE + isolation.SNAPSHOT + isolation.WATCH.format(
                start=start, slot=isolation.SLOT_S, slots=len(isolation.PHASES))), timeout=90))),
    ]
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            shmem.append(isolation._meminfo_kb("Shmem"))
            time.sleep(0.01)
    finally:
        for thread in threads:
            thread.join()
    assert busy and busy[0].strip() == "busy", busy
    assert watched and watched[0].strip().startswith("{"), watched
    assert max(shmem) - min(shmem) >= 8 * 1024, "the control saw no sign of A's scratch file on the host"
    report = json.loads(watched[0].strip().splitlines()[-1])
    assert report["files"] > 50, report  # B did read /proc and /sys
    pairs = [set(paths) for paths in report["pairs"]]
    in_every_busy = set.intersection(*(paths for phase, paths in zip(isolation.PHASES, pairs) if phase == "B"))
    in_an_idle = set.union(*(paths for phase, paths in zip(isolation.PHASES, pairs) if phase == "I"))
    # Except the counters of B's own running (its processes' and its kernel's /proc/stat, status) and
    # its own kernel's Unix socket table (only B's sockets: the state of its control connection moves
    # with how soon the host answers, under load): the CPU-contention timing channel, measured by
    # scripts/sandbox_channel_capacity.py (seen once in 6 runs at load 16: `/proc/21/task/22/net/unix`).
    scheduler = re.compile(isolation.SCHEDULER + r"|/net/unix$")
    follows_a = sorted(path for path in in_every_busy - in_an_idle if not scheduler.search(path))
    assert not follows_a, f"B's files followed A's activity: {follows_a[:40]}"


@pytest.mark.slow
def test_appworld_default_gvisor_sandbox_host_tasks_are_bounded_and_a_storm_ends_only_its_episode(default_pair):
    """~60 s at load 10. A fork storm of spinning processes in the default sandbox meets the host-task bound of
    its pids cgroup (gVisor runs each sandbox process as several host tasks): at most the
    episode ends, and the server's next episode runs in a fresh sandbox."""
    server = default_pair[0]
    server.close_episode(collect=False)
    server.open_episode("mininote_1", timeout_seconds=20, max_interactions=50)
    group = server._cells.cgroup  # noqa: SLF001  the host side of the sandbox
    if group is None or group.max_tasks is None:
        pytest.skip("no pids cgroup here: the host-task bound is off (the env warned)")
    assert group.max_tasks == SandboxLimits().host_tasks
    storm = """
        r, w = P.pipe()
        n = 0
        for _ in range(200):
            try:
                pid = P.fork()
            except OSError:
                break
            if pid == 0:
                P.read(r, 1)  # blocks until the sweep kills it
                P._exit(0)
            n += 1
        print('forked', n)
    """
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], group.tasks() or 0)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        print(run(server, storm))  # forks until the process limit, or the sandbox meets the bound and dies
    except (ServerDied, ServerTimeout) as error:
        print(type(error).__name__, str(error)[:200])
    finally:
        stop.set()
        watcher.join()
    print("peak host tasks", peak[0], "of", group.max_tasks)
    assert 0 < peak[0] <= group.max_tasks
    assert run(server, "print('next', 1 + 1)", fresh=True).split()[-1] == "2"


# ------------------------------------------------------- consecutive episodes of one env

PIPES_PER_UNIT = 256
SECRETS = (1, 5)  # a shared kernel moves the second reading by 5 x 256 (+1) past the first


def pipe_counter_readings(server: AppWorldServer) -> list[int]:
    """Episodes of one server: sender (secret 1) | receiver, then sender (secret 5) | receiver.
    The receiver's readings, one after each secret."""
    send, read = KERNEL_COUNTERS
    readings = []
    server.close_episode(collect=False)
    for step, secret in enumerate(SECRETS):
        server.open_episode("mininote_1", timeout_seconds=40, max_interactions=50)
        if step:
            readings.append(int(server.execute(read.render(), timeout=60).split()[-1]))
        assert "sent" in server.execute(send.render(secret=secret, unit=PIPES_PER_UNIT), timeout=120)
        server.close_episode(collect=False)
    server.open_episode("mininote_1", timeout_seconds=40, max_interactions=50)
    readings.append(int(server.execute(read.render(), timeout=60).split()[-1]))
    server.close_episode(collect=False)
    return readings


def test_appworld_default_episode_cannot_read_the_pipe_counter_its_envs_previous_episode_moved(default_pair):
    """Under the default settings an episode sends a secret through its kernel's pipe counter
    (secret x 256 pipes) and the next episode of the same server reads the counter: it reads
    the same number whatever the secret, for each episode runs in a kernel no episode ran in."""
    first, second = pipe_counter_readings(default_pair[1])
    assert abs(second - first) < PIPES_PER_UNIT, (first, second)


@pytest.mark.slow
def test_appworld_gvisor_episodes_in_one_kernel_pass_the_pipe_counter_control():
    """The control, ~60 s: with `fresh_kernel_per_episode=False` an env's episodes follow each
    other in one gVisor kernel, and the receiver's reading moves by what was sent."""
    (server,) = servers("gvisor", count=1, limits=SandboxLimits(fresh_kernel_per_episode=False))
    try:
        first, second = pipe_counter_readings(server)
    finally:
        server.shutdown()
    assert second - first >= (SECRETS[1] - 1) * PIPES_PER_UNIT, (first, second)


def test_appworld_default_is_gvisor_with_a_kernel_per_episode_where_runsc_runs():
    """The env, its pool and a server, built with no sandbox named, all choose gVisor and a
    fresh kernel per episode; the host tasks of a sandbox are bounded by default."""
    try:
        Launcher(find_python(), "gvisor")
    except SandboxUnavailable as error:
        pytest.skip(str(error)[:300])
    env = AppWorldEnv(split="mini")  # no server starts before a reset
    try:
        assert env._pool.sandbox == "gvisor"  # noqa: SLF001
    finally:
        env.close()
    server = AppWorldServer(find_python(), MINI)
    try:
        assert server.sandbox == "gvisor" and server.fresh_kernels
        assert SandboxLimits().host_tasks <= 512  # 64 sandboxes within a pid_max of 32768
    finally:
        server.shutdown()


def test_appworld_gvisor_sandbox_dies_whole_with_its_server():
    """Killing a server leaves no runsc, gofer or Sentry process behind."""
    (server,) = servers("gvisor", count=1)
    root = str(server.root)
    try:
        running = [p for p in psutil.process_iter(["cmdline"]) if root in " ".join(p.info["cmdline"] or [])]
        assert len(running) >= 3, running  # runsc, its gofer and Sentry, for each of the two sandboxes
    finally:
        server.shutdown()
    time.sleep(1.0)
    left = [p for p in psutil.process_iter(["cmdline"]) if root in " ".join(p.info["cmdline"] or [])]
    assert not left, left


def test_appworld_auto_sandbox_falls_back_to_bwrap_with_a_warning_and_gvisor_refuses(monkeypatch, caplog):
    """Without runsc, "auto" is bwrap and says which channel stays open; "gvisor" refuses,
    saying how to install it."""
    def missing():
        raise SandboxUnavailable("No gVisor (runsc) binary: install it with `make runsc`")

    monkeypatch.setattr(sandbox, "find_runsc", missing)
    sandbox._warn_no_gvisor.cache_clear()
    with caplog.at_level(logging.WARNING, logger="seeupo_gym.appworld.sandbox"):
        try:
            launcher = Launcher(find_python(), "auto")
        except SandboxUnavailable as error:
            pytest.skip(f"no bwrap sandbox here either: {str(error)[:200]}")
    assert launcher.mode == "bwrap" and launcher.runsc is None
    warned = [record.getMessage() for record in caplog.records if "fall back to bubblewrap" in record.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0], warned  # one line
    assert "inode and pipe counters" in warned[0] and "make runsc" in warned[0], warned
    with pytest.raises(SandboxUnavailable, match="make runsc"):
        Launcher(find_python(), "gvisor")


def test_appworld_auto_sandbox_is_gvisor_where_runsc_runs():
    try:
        sandbox.find_runsc()
        Launcher(find_python(), "gvisor")
    except SandboxUnavailable as error:
        pytest.skip(str(error)[:300])
    assert Launcher(find_python(), "auto").mode == "gvisor"
    assert os.path.exists(str(sandbox.find_runsc()))
