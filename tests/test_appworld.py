"""`seeupo/AppWorld-v0` end to end: the real AppWorld engine on the mini task set (built by
`make appworld-mini`), each episode in a fresh process of a sandboxed AppWorld server.

Servers take seconds to start, so most tests share one module-wide `ServerPool`; the tests
about server death and clean-up make their own. Every test leaves no server behind.
"""

import os
import signal
import time

import gymnasium as gym
import psutil
import pytest
from gymnasium.utils.env_checker import check_env

import seeupo_gym  # noqa: F401  (registers the ids)
from conftest import appworld_mini
from seeupo_gym.appworld import AppWorldEnv, ServerPool, render_action

pytestmark = pytest.mark.appworld

MINI, MINI_TASKS = appworld_mini()


def solution(task_id: str) -> str:
    return (MINI / "tasks" / task_id / "ground_truth" / "solution.py").read_text()


def server_processes() -> list[psutil.Process]:
    """AppWorld worker processes started by this test process (any depth)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any(part.endswith(("/cells.py", "/grader.py")) for part in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def pool():
    with ServerPool(MINI, sandbox="bwrap") as shared:
        yield shared
    assert server_processes() == []


@pytest.fixture
def make_env(pool):
    envs = []

    def make(**kwargs):
        env = gym.make("seeupo/AppWorld-v0", split="mini", server_pool=pool, **kwargs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


def test_mini_split_has_at_least_8_tasks_over_3_apps():
    assert len(MINI_TASKS) >= 8
    apps = {task_id.split("_")[0] for task_id in MINI_TASKS}
    assert len(apps) >= 3


def one_task_per_app(tasks: list[str]) -> list[str]:
    first: dict[str, str] = {}
    for task_id in tasks:
        first.setdefault(task_id.split("_")[0], task_id)
    return list(first.values())


# A task per app by default; every mini task (seconds each) in the slow suite.
@pytest.mark.parametrize("tasks", [one_task_per_app(MINI_TASKS), pytest.param(MINI_TASKS, marks=pytest.mark.slow)],
                         ids=["a task per app", "all"])
def test_ground_truth_solutions_score_one_through_gym_make(make_env, tasks):
    assert len({task_id.split("_")[0] for task_id in tasks}) >= 3
    env = make_env(max_turns=10)
    for task_id in tasks:
        env.reset(options={"task_id": task_id})
        _, reward, terminated, truncated, info = env.step(render_action(solution(task_id)))
        assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True), (task_id, info)
        assert info["termination_reason"] == "completed"
        assert info["tests"]["passed"] == info["tests"]["total"] > 0


@pytest.mark.parametrize("tasks", [one_task_per_app(MINI_TASKS), pytest.param(MINI_TASKS, marks=pytest.mark.slow)],
                         ids=["a task per app", "all"])
def test_completing_at_once_without_doing_the_task_scores_below_one(make_env, tasks):
    env = make_env()
    for task_id in tasks:
        env.reset(options={"task_id": task_id})
        _, reward, terminated, _, info = env.step(render_action("apis.supervisor.complete_task()"))
        assert terminated and not info["success"], task_id
        assert reward < 1.0, task_id
        assert reward == info["tests"]["passed"] / info["tests"]["total"]


def test_check_env_passes(pool):
    env = AppWorldEnv(split="mini", server_pool=pool)
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()


def test_reset_and_step_follow_the_env_contract(make_env):
    env = make_env(keep_think=False)
    obs, info = env.reset(seed=3, options={"task_id": "minivenmo_2"})
    assert set(info) >= {"task_id", "turn", "messages", "success"}
    assert (info["task_id"], info["turn"], info["success"]) == ("minivenmo_2", 0, False)
    system, first = info["messages"]
    assert (system["role"], first["role"]) == ("system", "user")
    assert obs == system["content"] + "\n\n" + first["content"]
    assert "<think>" in system["content"] and "apis.api_docs.show_api_descriptions" in system["content"]
    assert "Send $25 on Venmo to my friend Liam Chen" in first["content"]
    assert "maya.ortiz@gmail.com" in first["content"]
    assert env.observation_space.contains(obs)

    response = render_action("print(apis.api_docs.show_api_descriptions(app_name='venmo'))", thought="look")
    obs, reward, terminated, truncated, info = env.step(response)
    assert "create_transaction" in obs
    assert (reward, terminated, truncated, info["turn"]) == (0.0, False, False, 1)
    assert [m["role"] for m in info["messages"]] == ["system", "user", "assistant", "user"]
    assert info["messages"][2]["content"] == env.unwrapped.template.history_content(response)
    assert "<think>" not in info["messages"][2]["content"]  # keep_think=False drops it
    assert info["messages"][3]["content"] == obs


def test_completing_through_a_name_bound_in_an_earlier_turn_ends_the_episode(make_env):
    env = make_env()
    env.reset(options={"task_id": "minivenmo_1"})
    _, _, terminated, _, _ = env.step(render_action("finish = apis.supervisor.complete_task"))
    assert not terminated
    _, _, terminated, _, _ = env.step(render_action("balance = 182.5"))
    assert not terminated
    _, reward, terminated, _, info = env.step(render_action("finish(answer=balance)"))
    assert (reward, terminated, info["success"], info["turn"]) == (1.0, True, True, 3)


def test_reset_draws_tasks_from_the_split_reproducibly(make_env):
    env = make_env()
    drawn = [env.reset(seed=seed)[1]["task_id"] for seed in (0, 1, 2, 0)]
    assert drawn[0] == drawn[3]
    assert set(drawn) <= set(MINI_TASKS)
    with pytest.raises(ValueError, match="unknown AppWorld task"):
        env.reset(options={"task_id": "nosuch_1"})


def test_the_episode_is_truncated_at_max_turns_and_scored_by_the_evaluator(make_env):
    env = make_env(max_turns=2)
    env.reset(options={"task_id": "mininote_2"})
    _, _, terminated, truncated, _ = env.step(render_action("x = 1"))
    assert not terminated and not truncated
    _, reward, terminated, truncated, info = env.step(render_action("y = 2"))
    assert (terminated, truncated, info["turn"], info["termination_reason"]) == (False, True, 2, "max_turns")
    # Nothing was done and complete_task never called: of the 4 tests only "nothing else changed" passes.
    assert reward == info["tests"]["passed"] / info["tests"]["total"] == 0.25
    with pytest.raises(RuntimeError, match="reset"):
        env.step(render_action("x = 1"))


def test_the_callers_clock_runs_while_the_world_is_frozen(make_env):
    env = make_env()
    start = time.monotonic()
    env.reset(options={"task_id": "mininote_1"})
    in_episode = time.monotonic()
    time.sleep(0.05)
    obs, *_ = env.step(render_action("print(DateTime.now())\nprint(DateTime.now())"))
    after = time.monotonic()
    assert in_episode > start and after - in_episode >= 0.05
    # Inside the world time stands at the task's date (AppWorld's freezegun), out here it does not.
    first, second = obs.strip().splitlines()
    assert first == second and first.startswith("2024-05-14 10:30:00")


def test_bad_actions_give_error_observations_within_the_time_limit(make_env):
    env = make_env(timeout_seconds=2, max_turns=20)
    env.reset(options={"task_id": "mininote_2"})
    cases = [
        ("no code at all, just prose", "no ```python code block"),
        ("<think>thinking forever", "never closed"),
        (render_action("x = ("), "Syntax error"),
        (render_action("import os\nprint(os.listdir('/'))"), "importing 'os' is not allowed"),
        (render_action("open('/etc/passwd').read()"), "'open' is not allowed"),
        (render_action("raise ValueError('boom')"), "ValueError: boom"),
        ("x" * 1_000_000, "over the limit"),
        (render_action("print(1)\x00"), "NUL"),
        (render_action("while True:\n    pass"), "timed out after 2 seconds"),
        (12345, "must be a string"),
    ]
    for turn, (action, expected) in enumerate(cases, start=1):
        start = time.monotonic()
        obs, reward, terminated, truncated, info = env.step(action)
        elapsed = time.monotonic() - start
        assert expected in obs, (expected, obs[:300])
        assert (reward, terminated, truncated, info["turn"]) == (0.0, False, False, turn)
        assert elapsed < 2 + env.unwrapped.response_grace_s, (expected, elapsed)  # never a hang
    assert info["messages"][-2]["role"] == "assistant"
    # The world is intact: the task can still be solved after all that.
    _, reward, terminated, _, _ = env.step(render_action(solution("mininote_2")))
    assert (reward, terminated) == (1.0, True)


def test_a_stuck_cell_ends_the_episode_at_the_deadline_and_the_next_reset_is_fresh(pool):
    # A long C loop: AppWorld's SIGALRM timeout cannot interrupt it, the env's deadline does.
    env = AppWorldEnv(split="mini", server_pool=pool, timeout_seconds=3, response_grace_s=2)
    try:
        env.reset(options={"task_id": "minitodo_2"})
        start = time.monotonic()
        obs, reward, terminated, truncated, info = env.step(render_action("sum(range(10**12))"))
        # Bounded by the deadline (3 s limit + 2 s grace) plus the kill, with slack for a busy machine.
        assert time.monotonic() - start < 3 + 2 + 10
        assert (reward, terminated, truncated) == (0.0, True, False)
        assert "ServerTimeout" in info["termination_reason"] and "episode is over" in obs
        env.reset(options={"task_id": "minitodo_2"})
        _, reward, _, _, _ = env.step(render_action(solution("minitodo_2")))
        assert reward == 1.0
    finally:
        env.close()


def test_a_server_killed_mid_episode_ends_it_and_close_leaves_no_process(pool):
    env = gym.make("seeupo/AppWorld-v0", split="mini", sandbox="bwrap")  # its own server, killed at close()
    pids = []
    try:
        env.reset(options={"task_id": "miniphone_1"})
        server = env.unwrapped.server
        pids.append(server.pid)
        env.step(render_action("alarms = apis.phone.show_alarms"))
        os.kill(server.pid, signal.SIGKILL)
        obs, reward, terminated, truncated, info = env.step(render_action("print(alarms)"))
        assert (reward, terminated, truncated, info["turn"]) == (0.0, True, False, 2)
        assert "ServerDied" in info["termination_reason"]
        assert "stopped the environment" in obs

        _, info = env.reset(options={"task_id": "miniphone_1"})
        pids.append(env.unwrapped.server.pid)
        assert pids[1] != pids[0] and info["server_pid"] == pids[1]
        _, reward, terminated, _, _ = env.step(render_action(solution("miniphone_1")))
        assert (reward, terminated) == (1.0, True)
        sandboxed = [p.pid for p in psutil.Process(pids[1]).children(recursive=True)]
    finally:
        env.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids + sandboxed)


@pytest.mark.slow
def test_four_async_envs_run_episodes_concurrently_on_separate_servers():
    envs = gym.make_vec(
        "seeupo/AppWorld-v0",
        num_envs=4,
        vectorization_mode="async",
        vector_kwargs={"shared_memory": False},
        split="mini",
    )
    try:
        # Each worker draws its own task; every env is then stepped with its task's ground truth.
        _, infos = envs.reset(seed=[10, 11, 12, 13])
        task_ids = list(infos["task_id"])
        server_pids = {int(pid) for pid in infos["server_pid"]}
        assert len(server_pids) == 4
        assert all(psutil.pid_exists(pid) for pid in server_pids)  # all four up at once
        _, rewards, terminated, _, infos = envs.step([render_action(solution(t)) for t in task_ids])
        assert list(rewards) == [1.0] * 4 and all(terminated)
        assert {int(pid) for pid in infos["server_pid"]} == server_pids
    finally:
        envs.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in server_pids)


@pytest.mark.slow
def test_a_pool_recycles_its_server_after_recycle_after_episodes():
    with ServerPool(MINI, recycle_after=2, sandbox="bwrap") as own_pool:
        env = AppWorldEnv(split="mini", server_pool=own_pool)
        try:
            pids = [env.reset(options={"task_id": "mininote_1"})[1]["server_pid"] for _ in range(3)]
            assert pids[0] == pids[1] != pids[2]
            assert env.server.restarts == 1
            _, reward, _, _, _ = env.step(render_action(solution("mininote_1")))
            assert reward == 1.0
        finally:
            env.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)
