"""BFCL and TurnBandit under `gym.make_vec` with gymnasium's defaults, episodes staggered.

Envs end at different steps (other tasks, injected invalid responses, truncation), so a vector
step mixes envs mid-episode, just ended and just reset: gymnasium then batches `info` key by
key, which breaks when a key's type changes between envs. Async mode uses gymnasium's default
shared memory for the text observations; it must hand back exactly what sync mode does.
"""

from __future__ import annotations

from typing import Any, Callable

import gymnasium as gym
import numpy as np
import pytest

import seeupo_gym  # noqa: F401
from seeupo_gym.bfcl import get_entry, render_action, render_turn_end
from seeupo_gym.templates import ReActTemplate
from seeupo_gym.turnbandit import make_tasks

NUM_ENVS = 3
NON_ASCII = "héllo 中文 😀"
UNKNOWN_FUNCTION = "naïve_中文"  # a valid Python name, echoed back in BFCL's error observation

Policy = Callable[[int, dict[str, Any]], str]


def env_info(infos: dict[str, Any], index: int) -> dict[str, Any]:
    """One env's info out of the batched dict (gymnasium batches nested dicts key by key)."""
    return {
        key: env_info(value, index) if isinstance(value, dict) else value[index]
        for key, value in infos.items()
        if not key.startswith("_") and infos[f"_{key}"][index]
    }


def drive(envs: gym.vector.VectorEnv, policy: Policy, steps: int) -> list[tuple]:
    """Step the vector env with one policy per env index; the trace of what came back."""
    observations, infos = envs.reset(seed=7)
    trace = [(observations, None, None, None, [env_info(infos, i)["task_id"] for i in range(NUM_ENVS)])]
    for _ in range(steps):
        actions = tuple(policy(i, env_info(infos, i)) for i in range(NUM_ENVS))
        observations, rewards, terminated, truncated, infos = envs.step(actions)
        assert all(isinstance(observation, str) for observation in observations)
        trace.append((observations, rewards.tolist(), terminated.tolist(), truncated.tolist(),
                      [env_info(infos, i)["turn"] for i in range(NUM_ENVS)]))
    return trace


def turnbandit_policy(kwargs: dict[str, Any]) -> Policy:
    """Optimal labels, but env i answers invalidly (with non-ASCII text) on every (i+2)-th step."""
    tasks = {task.task_id: task for task in make_tasks(**kwargs)}

    def act(index: int, info: dict[str, Any]) -> str:
        if (info["turn"] + 1) % (index + 2) == 0:
            return ReActTemplate.render(NON_ASCII)
        task = tasks[info["task_id"]]
        return ReActTemplate.render(task.optimal_answers()[len(info["choices"]) % task.num_turns])

    return act


def bfcl_policy() -> Policy:
    """Ground-truth replay; env i first sends i calls to an unknown non-ASCII name per user turn."""
    scripts: dict[int, list[str]] = {}

    def act(index: int, info: dict[str, Any]) -> str:
        if info["turn"] == 0:
            scripts[index] = []
            for calls in get_entry(info["task_id"]).ground_truth:
                scripts[index] += [f"<think>x</think>\n[{UNKNOWN_FUNCTION}(text='{NON_ASCII}')]"] * index
                scripts[index] += ([render_action(list(calls))] if calls else []) + [render_turn_end("Done.")]
        return scripts[index].pop(0) if scripts[index] else render_turn_end("Done.")

    return act


def types_per_key(trace_infos: list[dict[str, Any]]) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for infos in trace_infos:
        for key, value in infos.items():
            seen.setdefault(key, set()).add(type(value).__name__ if not isinstance(value, np.ndarray) else value.dtype.kind)
    return seen


CASES = {
    "turnbandit": (
        "seeupo/TurnBandit-v0",
        {"variant": "mixed", "num_tasks": 8, "max_turns": 6},
        lambda: turnbandit_policy({"variant": "mixed", "num_tasks": 8}),
        40,
        NON_ASCII,
    ),
    "bfcl": ("seeupo/BFCL-v4-v0", {"categories": ["base"], "max_turns": 10}, bfcl_policy, 40, UNKNOWN_FUNCTION),
}


@pytest.mark.parametrize("case", list(CASES))
def test_async_with_default_shared_memory_matches_sync_over_staggered_episodes(case):
    env_id, kwargs, policy, steps, echoed = CASES[case]
    traces = {}
    for mode in ("sync", "async"):
        envs = gym.make_vec(env_id, NUM_ENVS, vectorization_mode=mode, **kwargs)
        try:
            traces[mode] = drive(envs, policy(), steps)
        finally:
            envs.close()
    assert traces["async"] == traces["sync"]
    ends = [tuple(step[2][i] or step[3][i] for step in traces["sync"][1:]) for i in range(NUM_ENVS)]
    assert len(set(ends)) == NUM_ENVS  # every env ended its episodes at other steps
    assert sum(map(sum, ends)) >= 2 * NUM_ENVS
    assert any(echoed in observation for step in traces["async"] for observation in step[0])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_batched_info_keeps_one_type_per_key_while_envs_end_at_different_steps(case, mode):
    env_id, kwargs, policy_factory, steps, _ = CASES[case]
    policy = policy_factory()
    envs = gym.make_vec(env_id, NUM_ENVS, vectorization_mode=mode, **kwargs)
    seen: list[dict[str, Any]] = []
    try:
        _, infos = envs.reset(seed=3)
        seen.append(infos)
        for _ in range(steps):
            _, _, terminated, truncated, infos = envs.step(tuple(policy(i, env_info(infos, i)) for i in range(NUM_ENVS)))
            seen.append(infos)
    finally:
        envs.close()
    mixed = {key: kinds for key, kinds in types_per_key(seen).items() if len(kinds) > 1}
    assert mixed == {}
    assert all(infos["_messages"].all() for infos in seen)  # every env reported, every step


def test_long_observations_round_trip_through_shared_memory():
    """BFCL's system prompts are thousands of characters; a long-context entry's results more."""
    envs = gym.make_vec("seeupo/BFCL-v4-v0", 2, vectorization_mode="async", categories=["long_context"])
    sync = gym.make_vec("seeupo/BFCL-v4-v0", 2, vectorization_mode="sync", categories=["long_context"])
    try:
        observations, _ = envs.reset(seed=1)
        assert observations == sync.reset(seed=1)[0]
        assert min(map(len, observations)) > 5_000
        actions = (render_action(["ls(a=True)"]), render_action(["pwd()"]))
        assert envs.step(actions)[0] == sync.step(actions)[0]
    finally:
        envs.close()
        sync.close()
