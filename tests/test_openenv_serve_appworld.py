"""`seeupo-serve seeupo/AppWorld-v0`: a ground-truth episode through openenv-core's client, the
remote env against the local one, and no sandbox left after SIGTERM or SIGKILL of the server.

Sandbox processes are found in the server's own process tree (other AppWorld servers on the
machine are not ours to count or kill)."""

from __future__ import annotations

import signal
import time

import gymnasium as gym
import psutil
import pytest

pytest.importorskip("openenv.core")
from openenv.core import GenericEnvClient  # noqa: E402

import seeupo_gym  # noqa: E402,F401
from conftest import appworld_mini  # noqa: E402
from seeupo_gym.appworld import render_action  # noqa: E402
from serve_helpers import serving  # noqa: E402

pytestmark = pytest.mark.appworld

MINI, MINI_TASKS = appworld_mini()
KWARGS = {"split": "mini", "max_turns": 4}


def solution(task_id: str) -> str:
    return (MINI / "tasks" / task_id / "ground_truth" / "solution.py").read_text()


def sandbox_processes(root_pid: int) -> list[psutil.Process]:
    """AppWorld worker processes (cell parent, episodes, grader) under `root_pid`."""
    found = []
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if any(part.endswith(("/cells.py", "/grader.py")) for part in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def alive(processes: list[psutil.Process]) -> list[int]:
    living = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                living.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    return living


def without_pid(info: dict) -> dict:
    # The one key that names a process: the local and the served env run their own servers.
    return {key: value for key, value in info.items() if key != "server_pid"}


@pytest.fixture(scope="module")
def server():
    with serving("seeupo/AppWorld-v0", "split=mini", "max_turns=4", startup_s=300) as served:
        yield served


def test_a_ground_truth_appworld_episode_scores_one_through_the_openenv_client(server):
    task_id = MINI_TASKS[0]
    with GenericEnvClient(base_url=server.url, message_timeout_s=300).sync() as env:
        first = env.reset(seed=0, task_id=task_id)
        assert first.done is False and first.observation["info"]["task_id"] == task_id
        assert first.observation["info"]["server_pid"] > 0
        last = env.step({"response": render_action(solution(task_id))})
    assert (last.reward, last.done, last.observation["truncated"]) == (1.0, True, False)
    info = last.observation["info"]
    assert info["success"] is True and info["tests"]["passed"] == info["tests"]["total"] > 0


# Slow suite: three AppWorld episodes each side, ~35 s; a ground-truth episode over the client stays.
@pytest.mark.slow
def test_the_remote_appworld_env_equals_the_local_env_on_three_seeds(server):
    remote = gym.make("seeupo/Remote-v0", url=server.url, env_id="seeupo/AppWorld-v0", env_kwargs=KWARGS)
    local = gym.make("seeupo/AppWorld-v0", **KWARGS)
    try:
        assert remote.observation_space == local.observation_space and remote.action_space == local.action_space
        assert remote.unwrapped.task_ids == local.unwrapped.task_ids
        for seed in (0, 1, 2):
            (remote_obs, remote_info), (local_obs, local_info) = remote.reset(seed=seed), local.reset(seed=seed)
            assert remote_obs == local_obs and without_pid(remote_info) == without_pid(local_info)
            task_id = local_info["task_id"]
            actions = [
                "no code here",
                render_action("print(apis.api_docs.show_app_descriptions())"),
                render_action(solution(task_id)),
            ]
            for action in actions:
                *remote_step, remote_info = remote.step(action)
                *local_step, local_info = local.step(action)
                assert remote_step == local_step and without_pid(remote_info) == without_pid(local_info)
                assert {k: type(v) for k, v in remote_info.items()} == {k: type(v) for k, v in local_info.items()}
            assert local_step[1:3] == [1.0, True]
    finally:
        remote.close()
        local.close()


# Slow suite: a served AppWorld stopped twice, ~40 s each; a local server killed mid-episode
# leaving no process stays in test_appworld.py.
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_sandbox_is_left_after_the_server_is_stopped(sig):
    served = None
    with serving("seeupo/AppWorld-v0", "split=mini", "max_turns=4", startup_s=300) as served:
        clients = [GenericEnvClient(base_url=served.url, message_timeout_s=300).sync() for _ in range(2)]
        for env, task_id in zip(clients, MINI_TASKS):
            env.reset(seed=0, task_id=task_id)
            env.step({"response": render_action("x = 1")})
        sandboxes = sandbox_processes(served.pid)
        assert len(sandboxes) >= 4  # two sessions, each a cell parent, an episode and a grader
        code = served.stop(sig, timeout=120)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)  # SIGTERM: a clean exit
        for env in clients:
            try:
                env.close()
            except Exception:  # the server is gone: the client's goodbye may fail
                pass
    deadline = time.monotonic() + 30
    while alive(sandboxes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(sandboxes) == []


@pytest.mark.slow
def test_an_idle_appworld_session_is_reaped_with_its_sandboxes():
    import httpx

    with serving("seeupo/AppWorld-v0", "split=mini", "--idle-timeout", "5", startup_s=300) as served:
        with GenericEnvClient(base_url=served.url, message_timeout_s=300).sync() as env:
            env.reset(seed=0, task_id=MINI_TASKS[0])
            env.step({"response": render_action("x = 1")})
            sandboxes = sandbox_processes(served.pid)
            assert len(sandboxes) >= 2
            deadline = time.monotonic() + 60
            while (alive(sandboxes) or httpx.get(f"{served.url}/seeupo/env").json()["live_envs"]) \
                    and time.monotonic() < deadline:
                time.sleep(1)
            assert alive(sandboxes) == [] and httpx.get(f"{served.url}/seeupo/env").json()["live_envs"] == 0
            with pytest.raises(RuntimeError, match="session is closed"):
                env.step({"response": render_action("print(x)")})
            assert served.process.poll() is None  # the server goes on
