"""AppWorld under gVisor (`sandbox="gvisor"`): each sandbox a kernel of its own.

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
from seeupo_gym.appworld.sandbox import Launcher, SandboxUnavailable
from seeupo_gym.appworld.server import AppWorldServer
from conftest import appworld_mini

pytestmark = pytest.mark.appworld

MINI, _ = appworld_mini()
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sandbox_channel_capacity.py"


def capacity_script():
    spec = importlib.util.spec_from_file_location("sandbox_channel_capacity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def servers(mode: str, count: int = 2) -> list[AppWorldServer]:
    try:
        Launcher(find_python(), mode)
    except SandboxUnavailable as error:
        pytest.skip(f"no {mode} sandbox here: {str(error)[:300]}")
    pair = [AppWorldServer(find_python(), MINI, sandbox=mode) for _ in range(count)]
    for server in pair:
        server.start()
    for server in pair:
        server.wait_ready()
    return pair


@pytest.fixture(scope="module")
def gvisor_pair():
    pair = servers("gvisor")
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


def test_appworld_gvisor_inode_storage_channel_carries_nothing(gvisor_pair):
    """The attack that won under bwrap: sandbox A's step makes symbol x 2048 pipes, sandbox B's
    next step reads how many inode batches other CPUs took since its last one. Under gVisor B
    reads the same count after every symbol: its inode numbers are its own kernel's."""
    sender, receiver = gvisor_pair
    for server in gvisor_pair:
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


def test_appworld_gvisor_sandbox_keeps_the_bwrap_guarantees(gvisor_pair):
    """Inside: nobody without capabilities, its own kernel, no network but a loopback, a
    read-only root that holds no host file but the binds (no ground truth), a writable scratch,
    the scrubbed environment, the rlimits the episode asked for."""
    output = run(gvisor_pair[0], """
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


def test_appworld_gvisor_grades_the_ground_truth_solution_as_a_success(gvisor_pair):
    """A whole episode through both gVisor sandboxes: the task's own solution scores 1.0, doing
    nothing scores less."""
    server = gvisor_pair[0]
    server.close_episode(collect=False)
    server.open_episode("mininote_2", timeout_seconds=40, max_interactions=50)
    server.execute((MINI / "tasks" / "mininote_2" / "ground_truth" / "solution.py").read_text(), timeout=60)
    assert server.grade("mininote_2", server.close_episode(collect=True))["success"]
    server.open_episode("mininote_2", timeout_seconds=40, max_interactions=50)
    assert not server.grade("mininote_2", server.close_episode(collect=True))["success"]


# The /proc and /sys differential of tests/test_appworld_isolation.py, for gVisor: there /proc
# and /sys are B's own kernel's, unmasked, so files change with B's own activity (uptime, its
# memory); none may change with A's, i.e. in every busy turn of A and in no idle one.
def test_appworld_gvisor_no_file_under_proc_or_sys_follows_a_concurrent_sandboxs_activity(gvisor_pair):
    """Sandbox A idle and busy in turns (memory, scratch files, CPU, forks, Unix sockets);
    sandbox B reads every file it can under /proc and /sys at the start and end of each turn.
    No file changes in every busy turn and no idle one, but the scheduler's counters of B's own
    running (as in tests/test_appworld_isolation.py). The control: the host's /proc sees A's
    scratch file come and go."""
    import test_appworld_isolation as isolation

    server, other = gvisor_pair
    for one in gvisor_pair:
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
    assert "inode counter" in caplog.text and "make runsc" in caplog.text, caplog.text
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
