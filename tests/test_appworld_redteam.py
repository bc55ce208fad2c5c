"""Red team for `seeupo/AppWorld-v0` (docs/architecture.md): the env must contain the
code a policy writes. The attack cells live in `tests/redteam_cells.py`.

Every cell runs through the public env (`gym.make`, `reset`, `step`) against a host the test
owns: a canary folder, a secret file and a secret environment variable, TCP/UDP/Unix listeners,
a SIGUSR1 handler in this (the "trainer's") process, a second env mid-episode, and the
honest scores of each task measured on a clean server. For each cell the test asserts:
- no effect outside the sandbox: canary files untouched, no listener contacted, no signal,
  no secret or ground truth in the observation, the other env's server untouched;
- `step` never raises and returns within the env's deadline;
- the reward of a fresh episode is what an honest policy gets on a clean server.
Findings are collected per class and asserted at the end, so one run lists every route that
still gets through, each named `<class>.<cell>: <effect>`.

The project's denylist guard is a friendly message, not a wall (a denylist over Python cannot be completed); the cells are
written to pass it, and the suite also switches it off where it can, so that every cell
reaches the sandbox. Set SEEUPO_REDTEAM_LOG=<file> to get each cell's observation as JSON lines.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import psutil
import pytest

import seeupo_gym  # noqa: F401  (registers the ids)
from conftest import appworld_mini
from seeupo_gym.appworld import render_action
from seeupo_gym.appworld.sandbox import SandboxLimits
import redteam_cells as catalogue
from redteam_cells import Cell

pytestmark = pytest.mark.appworld

MINI, TASKS = appworld_mini()
REPO = Path(__file__).resolve().parents[1]

TIMEOUT_S = 4  # AppWorld's own limit per cell (a ground truth needs ~2 s on a loaded machine)
GRACE_S = 3  # the env's extra wait before it kills a stuck episode
DEADLINE_S = TIMEOUT_S + GRACE_S + 10  # + the kill, grading and a busy 2-core machine
RESET_DEADLINE_S = 90  # a reset may have to restart a killed worker
# What all of this test's processes may hold at once: the attacker's cell sandbox at its memory
# cgroup's limit, plus the rest at rest (its grader, the victim's server: ~1 GiB together).
MEMORY_BOUND = (SandboxLimits().total_memory_mb + 1024) * 2**20
TRAINER_MEMORY_BOUND = 2**30  # what one step may add to the trainer's memory
IDLE_CPU = 0.1  # CPU-s per s an env may use while it waits (low: this machine may be loaded)
TOKEN = secrets.token_hex(6)  # marks everything the cells plant
ENV_SECRET = f"env-secret-{secrets.token_hex(8)}"
FILE_SECRET = f"file-secret-{secrets.token_hex(8)}"
CANARY_TEXT = "canary: untouched\n"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
COMPLETE = "apis.supervisor.complete_task()"
HONEST_TASKS = ("mininote_1", "minitodo_1", "minivenmo_1")  # tasks that ask a question


def solution(task_id: str) -> str:
    return (MINI / "tasks" / task_id / "ground_truth" / "solution.py").read_text()


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def ground_truth_fingerprints() -> list[str]:
    """Strings only the ground-truth files hold: seen in an observation, the cell read them."""
    prints = {"ground_truth_answer", "predicted_answer", "no_op_fail", "no_op_pass", "5550100003"}
    for task_id in TASKS:
        prints.add(solution(task_id).splitlines()[0])
        test_data = json.loads((MINI / "tasks" / task_id / "ground_truth" / "test_data.json").read_text())
        prints.update(str(entry["requirement"])[:60] for entry in test_data)
    return sorted(prints)


def our_processes() -> list[psutil.Process]:
    """Every process this test started, at any depth (servers and whatever they started)."""
    return psutil.Process().children(recursive=True)


def marked_processes() -> list[psutil.Process]:
    """Processes anywhere on the machine that carry this run's token (planted by a cell)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(TOKEN in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


class Listener:
    """A socket that records who reaches it (from a thread)."""

    def __init__(self, family: int, kind: int, address: object) -> None:
        self.sock = socket.socket(family, kind)
        if family != socket.AF_UNIX:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(address)
        self.stream = kind == socket.SOCK_STREAM
        if self.stream:
            self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.hits: list[str] = []
        self.closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def _serve(self) -> None:
        while not self.closed:
            try:
                if self.stream:
                    conn, peer = self.sock.accept()
                    conn.settimeout(0.5)
                    try:
                        data = conn.recv(200)
                    except OSError:
                        data = b""
                    conn.close()
                else:
                    data, peer = self.sock.recvfrom(200)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.hits.append(f"{peer!r} sent {data[:60]!r}")

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class Host:
    """What a cell must not reach, and the checks that say whether it did."""

    def __init__(self, root: Path) -> None:
        self.canary = root / "canary"
        self.canary.mkdir()
        self.secret_file = root / "trainer-secret.txt"
        self.secret_file.write_text(FILE_SECRET)
        self.planted = [  # places a cell could plant a file outside the sandbox
            site_packages(REPO / ".venv-appworld") / f"seeupo_redteam_{TOKEN}.pth",
            site_packages(REPO / ".venv") / f"seeupo_redteam_{TOKEN}.pth",
            *(MINI / "tasks" / task_id / "ground_truth" / f"redteam_{TOKEN}" for task_id in TASKS),
        ]
        self._reset_canary()
        self.original = self._snapshot()
        (root / "sock").mkdir()
        self.unix_path = str(root / "sock" / "host.sock")
        self.abstract = f"seeupo-redteam-{TOKEN}"
        self.listeners = {
            "tcp 127.0.0.1": Listener(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0)),
            "tcp 0.0.0.0": Listener(socket.AF_INET, socket.SOCK_STREAM, ("0.0.0.0", 0)),
            "tcp ::1": Listener(socket.AF_INET6, socket.SOCK_STREAM, ("::1", 0)),
            "udp 127.0.0.1": Listener(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0)),
            "unix path": Listener(socket.AF_UNIX, socket.SOCK_STREAM, self.unix_path),
            "unix abstract": Listener(socket.AF_UNIX, socket.SOCK_STREAM, "\0" + self.abstract),
        }
        addresses = [a.address for name, addrs in psutil.net_if_addrs().items() if name != "lo" for a in addrs]
        self.host_ip = next((a for a in addresses if a.count(".") == 3 and not a.startswith("127.")), "127.0.0.1")
        self.signals: list[int] = []
        self.fingerprints = [ENV_SECRET, FILE_SECRET, "PARENT-MEMORY-OPEN", *ground_truth_fingerprints()]
        try:
            self.fingerprints.append(Path("/etc/shadow").read_text().splitlines()[0])
        except (OSError, IndexError):
            pass

    def _reset_canary(self) -> None:
        for entry in self.canary.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        (self.canary / "canary.txt").write_text(CANARY_TEXT)
        (self.canary / "canary.txt").chmod(0o644)
        (self.canary / "canary.txt").touch()

    def _snapshot(self) -> dict[str, object]:
        state: dict[str, object] = {}
        for entry in sorted(self.canary.iterdir()):
            info = entry.lstat()
            content = entry.read_bytes() if entry.is_file() and not entry.is_symlink() else b""
            state[entry.name] = (stat.filemode(info.st_mode), info.st_nlink, content)
        state.update({str(path): True for path in self.planted if path.exists()})
        return state

    def values(self, **extra: object) -> dict[str, object]:
        return {
            "canary": self.canary,
            "secret_file": self.secret_file,
            "port": self.listeners["tcp 127.0.0.1"].port,
            "port_any": self.listeners["tcp 0.0.0.0"].port,
            "port6": self.listeners["tcp ::1"].port,
            "udp_port": self.listeners["udp 127.0.0.1"].port,
            "host_ip": self.host_ip,
            "unix_path": self.unix_path,
            "abstract": self.abstract,
            "trainer_pid": os.getpid(),
            "data": MINI,
            "aw_site": site_packages(REPO / ".venv-appworld"),
            "trainer_site": site_packages(REPO / ".venv"),
            "token": TOKEN,
            "victim_pids": [],
            "victim_ports": [],
            "victim_unix": [],
            "victim_task": "",
            **extra,
        }

    def effects(self, observation: str) -> list[str]:
        """What the last cell did outside the sandbox (then the host is put back as it was)."""
        found = []
        time.sleep(0.05)  # a datagram or a connection still in flight
        now = self._snapshot()
        if now != self.original:
            changed = sorted(k for k in set(now) | set(self.original) if now.get(k) != self.original.get(k))
            found.append(f"changed host files {changed}")
            self._reset_canary()
            for path in self.planted:
                path.unlink(missing_ok=True)
        for name, listener in self.listeners.items():
            if listener.hits:
                found.append(f"reached the host's {name} listener: {listener.hits}")
                listener.hits.clear()
        if self.signals:
            found.append(f"signalled the trainer process: {self.signals}")
            self.signals.clear()
        observation = _ANSI.sub("", observation)  # IPython colours can split a secret
        leaked = [fingerprint for fingerprint in self.fingerprints if fingerprint in observation]
        if leaked:
            found.append(f"observation shows secrets or ground truth {leaked}")
        other_ids = [task_id for task_id in TASKS if task_id in observation]
        if len(other_ids) > 2:
            found.append(f"observation lists the tasks {other_ids}")
        return found

    def close(self) -> None:
        for listener in self.listeners.values():
            listener.close()
        for path in self.planted:
            path.unlink(missing_ok=True)


class Findings(list):
    """`<kind>: <class>.<cell>: <effect>`; kind is host, grader, cross-env, persistence,
    resources, raise or late."""

    def add(self, kind: str, cell: str, what: str) -> None:
        self.append(f"{kind}: {cell}: {what}")


def assert_none(findings: list[str]) -> None:
    assert not findings, f"{len(findings)} attacks got through:\n" + "\n".join(findings)


_LOG = os.environ.get("SEEUPO_REDTEAM_LOG")


def log(cell: str, observation: str, elapsed: float) -> None:
    if _LOG:
        with open(_LOG, "a") as out:
            out.write(json.dumps({"cell": cell, "s": round(elapsed, 2), "observation": observation[:600]}) + "\n")


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def guard_off() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    patch.setattr("seeupo_gym.appworld.env.refusal", lambda code: None, raising=False)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    owned = Host(tmp_path_factory.mktemp("redteam"))
    previous_secret = os.environ.get("SEEUPO_REDTEAM_SECRET")
    os.environ["SEEUPO_REDTEAM_SECRET"] = ENV_SECRET  # set before any server starts
    previous_handler = signal.signal(signal.SIGUSR1, lambda number, frame: owned.signals.append(number))
    yield owned
    signal.signal(signal.SIGUSR1, previous_handler)
    if previous_secret is None:
        os.environ.pop("SEEUPO_REDTEAM_SECRET", None)
    else:
        os.environ["SEEUPO_REDTEAM_SECRET"] = previous_secret
    owned.close()
    for process in marked_processes():  # sleepers a cell left behind, if any got out
        process.kill()


# The sandbox backend the suite attacks: bwrap by default; SEEUPO_TEST_APPWORLD_SANDBOX=gvisor runs it
# against gVisor (tests/test_appworld_gvisor.py says how).
SANDBOX = os.environ.get("SEEUPO_TEST_APPWORLD_SANDBOX", "bwrap")


def make_env(**kwargs: object) -> gym.Env:
    options = {"split": "mini", "max_turns": 200, "timeout_seconds": TIMEOUT_S, "response_grace_s": GRACE_S,
               "sandbox": SANDBOX}
    return gym.make("seeupo/AppWorld-v0", **{**options, **kwargs})


VICTIM_TASK = "minivenmo_1"


@pytest.fixture(scope="module")
def attacker(host: Host) -> Iterator[gym.Env]:
    env = make_env()
    yield env
    env.close()


@pytest.fixture(scope="module")
def honest(attacker: gym.Env) -> dict[str, float]:
    """Each answer task's reward for calling `complete_task()` at once, measured before any
    attack (a server no cell has touched). Completing without the answer fails a test that a
    patched grader would pass."""
    scores = {task_id: complete_alone(attacker, task_id) for task_id in HONEST_TASKS}
    assert all(isinstance(score, float) and score < 1.0 for score in scores.values()), scores
    return scores


# ---------------------------------------------------------------------------- the runner


def attack(env: gym.Env, host: Host, cells: list[Cell], task_id: str, findings: Findings, **values: object) -> bool:
    """Run `cells` in episodes of `task_id` (a new episode whenever one ends) and record what
    each did. Returns whether the last episode is still open."""
    other = TASKS[(TASKS.index(task_id) + 1) % len(TASKS)]
    done = True
    for cell in cells:
        if done:
            start = time.monotonic()
            try:
                env.reset(options={"task_id": task_id})
                done = False
            except Exception as error:  # noqa: BLE001 (a raise is a finding, not a crash of the suite)
                findings.add("raise", cell.name, f"the reset before it raised {error!r}")
                continue
            if time.monotonic() - start > RESET_DEADLINE_S:
                findings.add("late", cell.name, f"the reset before it took {time.monotonic() - start:.0f} s")
        code = cell.render(**host.values(task=task_id, other_task=other, **values))
        start = time.monotonic()
        try:
            observation, _, terminated, truncated, _ = env.step(render_action(code))
        except Exception as error:  # noqa: BLE001
            findings.add("raise", cell.name, f"step raised {error!r}")
            done = True
            continue
        elapsed = time.monotonic() - start
        log(cell.name, observation, elapsed)
        if elapsed > DEADLINE_S:
            findings.add("late", cell.name, f"step took {elapsed:.1f} s (deadline {DEADLINE_S} s)")
        for effect in host.effects(observation):
            findings.add("host", cell.name, effect)
        done = terminated or truncated
    return not done


def scored(env: gym.Env, code: str, task_id: str | None) -> float | str:
    """The reward of `code` (in a new episode of `task_id` if given); how it failed if the
    episode was not scored."""
    try:
        if task_id is not None:
            env.reset(options={"task_id": task_id})
        observation, reward, _, _, info = env.step(render_action(code))
    except Exception as error:  # noqa: BLE001
        return f"raised {error!r}"
    reason = info.get("termination_reason")
    return reward if reason in ("completed", "max_turns") else f"{reward} ({reason or observation[:200]!r})"


def complete_alone(env: gym.Env, task_id: str | None = None) -> float | str:
    return scored(env, COMPLETE, task_id)


def ground_truth(env: gym.Env, task_id: str) -> float | str:
    return scored(env, solution(task_id), task_id)


def fresh_episodes(env: gym.Env, honest: dict[str, float], after: str, task_id: str, truth: bool = False) -> list[str]:
    """After an attack, a fresh episode scores as on a clean server: `complete_task()` alone
    its honest score and, if `truth`, the ground truth 1.0."""
    changes = []
    alone = complete_alone(env, task_id)
    if alone != honest[task_id]:
        changes.append(f"grader: {after}: then complete_task() alone on {task_id} scored {alone}, honestly {honest[task_id]}")
    scored = ground_truth(env, task_id) if truth else 1.0
    if scored != 1.0:
        changes.append(f"grader: {after}: then the ground truth of {task_id} scored {scored}")
    return changes


def assert_contained(env: gym.Env, host: Host, honest: dict[str, float], cells: list[Cell], task_id: str) -> None:
    findings = Findings()
    attack(env, host, cells, task_id, findings)
    after = cells[0].name.split(".")[0]
    findings += fresh_episodes(env, honest, after, HONEST_TASKS[len(after) % len(HONEST_TASKS)])
    assert_none(findings)


# ---------------------------------------------------------------------------- the attacks


def test_import_routes_through_allowed_modules_reach_nothing_on_the_host(attacker, host, honest):
    assert_contained(attacker, host, honest, catalogue.IMPORT_ROUTES, "mininote_2")


def test_introspection_routes_reach_nothing_on_the_host(attacker, host, honest):
    assert_contained(attacker, host, honest, catalogue.INTROSPECTION, "minitodo_2")


def test_ipython_hooks_reach_nothing_on_the_host(attacker, host, honest):
    assert_contained(attacker, host, honest, catalogue.IPYTHON, "minivenmo_2")


def test_cells_cannot_create_change_or_delete_host_files(attacker, host, honest):
    assert_contained(attacker, host, honest, catalogue.FILES, "miniphone_1")


def test_cells_cannot_read_the_trainers_files_or_environment(attacker, host, honest):
    assert_contained(attacker, host, honest, catalogue.SECRETS, "mininote_3")


def test_cells_have_no_network_and_no_host_sockets(attacker, host, honest):
    assert_contained(attacker, host, honest, catalogue.SOCKETS, "minitodo_2")


def test_processes_a_cell_starts_stay_in_the_sandbox(attacker, host, honest):
    assert_contained(attacker, host, honest, catalogue.PROCESSES, "minivenmo_2")


def test_cells_cannot_read_ground_truth_or_other_tasks_data(attacker, host, honest):
    assert_contained(attacker, host, honest, catalogue.GROUND_TRUTH, "miniphone_2")


def test_frames_a_cell_writes_to_the_hosts_socket_end_its_episode_without_raising(attacker, host, honest):
    findings = Findings()
    for cell in catalogue.HOST_CHANNEL:
        with MemoryWatch() as memory:
            attack(attacker, host, [cell], "mininote_2", findings)
        if memory.trainer_growth > TRAINER_MEMORY_BOUND:
            findings.add("host", cell.name, f"the trainer's process grew by {memory.trainer_growth / 2**30:.1f} GiB")
    findings += fresh_episodes(attacker, honest, "channel", "minitodo_1", truth=True)
    assert_none(findings)


def test_grader_patches_change_no_score_in_their_episode_or_the_next(attacker, host, honest):
    task_id, next_task = "mininote_1", "minitodo_1"
    findings = Findings()
    for cell in catalogue.GRADER:
        if attack(attacker, host, [cell], task_id, findings):
            now = complete_alone(attacker)
            if now != honest[task_id]:
                findings.add("grader", cell.name, f"complete_task() alone in its episode scored {now}, honestly {honest[task_id]}")
    findings += fresh_episodes(attacker, honest, "grader (the next episode)", next_task, truth=True)
    assert_none(findings)


def test_nothing_a_cell_leaves_survives_into_the_next_episode(attacker, host, honest):
    findings = Findings()
    attack(attacker, host, catalogue.PERSISTENCE_PLANTS, "mininote_2", findings)
    next_task = "minivenmo_1"
    attacker.reset(options={"task_id": next_task})
    for probe in catalogue.PERSISTENCE_PROBES:
        try:
            observation = attacker.step(render_action(probe.render(**host.values())))[0]
        except Exception as error:  # noqa: BLE001
            findings.add("raise", probe.name, repr(error))
            continue
        log(probe.name, observation, 0.0)
        if f"{TOKEN}-" in observation:
            findings.add("persistence", probe.name, f"the next episode sees {observation[:200]!r}")
    _, reward, *_ = attacker.step(render_action(solution(next_task)))
    if reward != 1.0:
        findings.add("grader", "persistence", f"the ground truth of the next episode scored {reward}")
    findings += fresh_episodes(attacker, honest, "persistence", "minitodo_1")
    assert_none(findings)


# ---------------------------------------------------------------------------- another env


def victim_processes(info: dict) -> list[psutil.Process]:
    pid = info.get("server_pid")
    if not pid or not psutil.pid_exists(pid):
        return []
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def endpoints(processes: list[psutil.Process]) -> tuple[list[int], list[str]]:
    ports, paths = set(), set()
    for process in processes:
        try:
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    ports.add(conn.laddr.port)
            for conn in process.net_connections(kind="unix"):
                if conn.laddr:
                    paths.add(conn.laddr)
        except psutil.Error:
            pass
    return sorted(ports), sorted(paths)


def is_stopped(process: psutil.Process) -> bool:
    try:
        return process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def cross_effects(processes: list[psutil.Process], nice: dict[int, int], stopped: set[int]) -> list[str]:
    """What a cell did to the other env's processes. `stopped`: those stopped before it ran (an
    episode's process is stopped by its own warm parent between requests)."""
    found = []
    for process in processes:
        try:
            status = process.status()
            if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) and process.pid not in stopped:
                found.append(f"stopped the other env's process {process.pid}")
                process.resume()
            elif status == psutil.STATUS_ZOMBIE:
                found.append(f"killed the other env's process {process.pid}")
            elif process.nice() != nice[process.pid]:
                found.append(f"reniced the other env's process {process.pid}")
            elif (Path(process.cwd()) / f"redteam-{TOKEN}").exists():
                found.append(f"wrote into the other env's folder {process.cwd()}")
                (Path(process.cwd()) / f"redteam-{TOKEN}").unlink()
        except psutil.NoSuchProcess:
            found.append(f"killed the other env's process {process.pid}")
        except psutil.AccessDenied:
            pass
    return found


def test_a_cell_cannot_reach_or_harm_another_envs_server(attacker, host, honest):
    # Started here, in the main thread: bwrap's --die-with-parent follows the thread that
    # started it, so a sandbox started from a thread that then ends dies with it.
    findings = Findings()
    victim = make_env()
    try:
        _, info = victim.reset(options={"task_id": VICTIM_TASK})
        findings += attack_other_env(attacker, host, honest, victim, info)
    finally:
        victim.close()
    assert_none(findings)


def attack_other_env(attacker: gym.Env, host: Host, honest: dict[str, float], victim: gym.Env, info: dict) -> Findings:
    findings = Findings()
    for cell in catalogue.CROSS_ENV:
        processes = victim_processes(info)
        nice = {p.pid: p.nice() for p in processes}
        stopped = {p.pid for p in processes if is_stopped(p)}
        ports, paths = endpoints(processes)
        values = {"victim_pids": [p.pid for p in our_processes()], "victim_ports": ports,
                  "victim_unix": paths, "victim_task": VICTIM_TASK}
        attack(attacker, host, [cell], "mininote_3", findings, **values)
        effects = cross_effects(processes, nice, stopped)
        for effect in effects:
            findings.add("cross-env", cell.name, effect)
        if effects:  # start the other env afresh so the next cell is judged on its own
            _, info = victim.reset(options={"task_id": VICTIM_TASK})
    # The other env's episode goes on as if nothing happened.
    _, reward, terminated, _, info = victim.step(render_action(solution(VICTIM_TASK)))
    if (reward, terminated, info["termination_reason"]) != (1.0, True, "completed"):
        findings.add("cross-env", "cross-env", f"the other env's ground truth then scored {reward}: {info['termination_reason']}")
    findings += fresh_episodes(victim, honest, "cross-env (the other env)", "minitodo_1")
    return findings


# ---------------------------------------------------------------------------- resources


class MemoryWatch:
    """Peak resident memory of the processes this test started (`peak`, sampled while a step
    runs and just after) and how far this, the trainer's, process rose above its own earlier
    peak (`trainer_growth`: from getrusage, as a reply parsed under the GIL stops samplers)."""

    def __init__(self) -> None:
        self.peak = 0
        self.trainer_growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            total = 0
            for process in our_processes():
                try:
                    total += process.memory_full_info().pss  # shared pages once, as the kernel holds them
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)

    def __enter__(self) -> MemoryWatch:
        self._trainer_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.trainer_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._trainer_before


def cpu_burnt(seconds: float = 1.0) -> float:
    """CPU seconds per second that this test's processes use over the next `seconds`."""
    processes = our_processes()

    def total() -> float:
        used = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
                used += times.user + times.system
            except psutil.Error:
                pass
        return used

    before = total()
    time.sleep(seconds)
    return (total() - before) / seconds


def leftovers(cell: str) -> list[str]:
    found = []
    marked = marked_processes()
    if marked:
        found.append(f"resources: {cell}: {len(marked)} planted processes outlive the episode")
    threads = sum(p.num_threads() for p in our_processes() if p.is_running())
    if threads > 200:
        found.append(f"resources: {cell}: {threads} threads outlive the episode")
    return found


def run_resource_cells(env: gym.Env, host: Host, cells: list[Cell], findings: Findings) -> None:
    """Each cell in its own episode: bounded memory while it runs, no CPU burnt once the step
    has returned (the policy is thinking), nothing left once the next episode has begun."""
    for cell in cells:
        with MemoryWatch() as memory:
            still_open = attack(env, host, [cell], "minitodo_2", findings)
            burnt = cpu_burnt() if still_open else 0.0
        log(cell.name, f"(peak memory {memory.peak / 2**30:.2f} GiB, CPU between steps {burnt:.2f})", 0.0)
        if memory.peak > MEMORY_BOUND:
            findings.add("resources", cell.name, f"the env's processes held {memory.peak / 2**30:.1f} GiB")
        if burnt > IDLE_CPU:
            findings.add("resources", cell.name, f"its episode burns {burnt:.1f} CPU-s per s between steps")
        env.reset(options={"task_id": "mininote_1"})
        findings += leftovers(cell.name)
    burnt = cpu_burnt()
    if burnt > IDLE_CPU:
        findings.add("resources", cells[-1].name.split(".")[0], f"the env burns {burnt:.1f} CPU-s per s once its episodes are over")


# Slow suite: each cell runs to its limit, ~70 s.
@pytest.mark.slow
def test_resource_exhaustion_is_bounded_and_ends_with_the_step(attacker, host, honest):
    findings = Findings()
    run_resource_cells(attacker, host, catalogue.RESOURCES, findings)
    findings += fresh_episodes(attacker, honest, "resources", "minivenmo_1", truth=True)
    assert_none(findings)


@pytest.mark.slow
def test_fork_bombs_disk_fills_and_large_allocations_are_bounded(attacker, host, honest):
    findings = Findings()
    run_resource_cells(attacker, host, catalogue.RESOURCES_SLOW, findings)
    name = f"redteam-fill-{TOKEN}"
    filled = [*Path("/tmp").glob(name), *Path("/tmp").glob(f"*/{name}"), *Path("/tmp").glob(f"*/*/{name}"),
              *Path("/dev/shm").glob(name)]
    for path in filled:
        findings.add("resources", "disk-fill", f"{path} ({path.stat().st_size >> 20} MiB) is on the host after the episode")
        path.unlink()
    findings += fresh_episodes(attacker, honest, "resources (slow)", "minitodo_1", truth=True)
    assert_none(findings)


def test_the_catalogue_has_at_least_60_cells_over_every_class():
    counts = {name: len(cells) for name, cells in catalogue.ALL_CLASSES.items()}
    assert sum(counts.values()) >= 60
    assert min(counts.values()) >= 3, counts
    names = [cell.name for cells in catalogue.ALL_CLASSES.values() for cell in cells]
    assert len(names) == len(set(names))
