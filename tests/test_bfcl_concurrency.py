"""BFCL envs stepped from many threads at once (as seeupo-serve sessions, thread-vectorized agents
and trainer adapters step them): no step raises and no episode's score depends on another's."""

from __future__ import annotations

import threading
import time

import gymnasium as gym

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.bfcl import CATEGORIES, get_entry, render_action, render_turn_end
from seeupo_gym.bfcl.env import render_tool_action

THREADS = 16
SECONDS = 4.0
# The same task in many threads; MathAPI's logarithm (mpmath's process-wide precision) and the
# long-context weather call (a dict of bfcl-eval's module) in the ground truth; every category.
TASKS = ["multi_turn_base_0", "multi_turn_base_32", "multi_turn_base_57", "multi_turn_miss_func_49",
         "multi_turn_miss_param_59", "multi_turn_long_context_57", "multi_turn_long_context_0", "multi_turn_base_90"]
# Sent in every wrong episode: a precision other episodes' logarithms must not be computed at.
NOISE = ["logarithm(value=3, base=7, precision=999)", "square_root(number=3, precision=999)"]


def play(env, task_id: str, correct: bool, render) -> float:
    """The ground truth (reward 1.0), or a wrong episode: the first turn's calls left out and
    high-precision math called instead where the task has MathAPI (reward 0.0)."""
    entry = get_entry(task_id)
    env.reset(options={"task_id": task_id})
    reward = None
    for turn, calls in enumerate(entry.ground_truth):
        if not correct and turn == 0:
            if "MathAPI" in entry.involved_classes:
                env.step(render(NOISE))
        elif calls:
            env.step(render(list(calls)))
        _, reward, terminated, _, _ = env.step(render_turn_end("Done."))
    assert terminated
    return reward


def test_sixteen_threads_stepping_bfcl_envs_raise_nothing_and_score_every_episode_as_alone():
    assert {task.rsplit("_", 1)[0].removeprefix("multi_turn_") for task in TASKS} == set(CATEGORIES)
    assert all(get_entry(task).ground_truth[0] for task in TASKS)  # a skipped first turn fails
    errors: list[BaseException] = []
    results: list[tuple[str, bool, float]] = []
    start = threading.Barrier(THREADS)
    deadline = time.monotonic() + SECONDS

    def worker(index: int) -> None:
        tools = index % 2 == 1
        env = gym.make("seeupo/BFCL-v4-v0", categories=list(CATEGORIES), split="all", max_turns=1_000,
                       action_format="tools" if tools else "react")
        render = render_tool_action if tools else render_action
        start.wait()
        episode = 0
        try:
            while time.monotonic() < deadline or episode < 2:
                task_id = TASKS[(index + episode // 2) % len(TASKS)]
                correct = episode % 2 == 0
                results.append((task_id, correct, play(env, task_id, correct, render)))
                episode += 1
        except BaseException as error:  # noqa: BLE001  (reported below, with the others)
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert len(results) >= 2 * THREADS
    assert [(task, correct) for task, correct, reward in results if reward != float(correct)] == []
    assert {task for task, _, _ in results} == set(TASKS)
