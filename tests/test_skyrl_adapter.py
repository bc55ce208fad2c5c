"""Our envs through SkyRL's `skyrl_gym.make` (seeupo_gym.integrations.skyrl), with the real skyrl-gym 0.4."""

from __future__ import annotations

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="needs `pip install seeupo-gym[skyrl]` (make test installs it)")

from omegaconf import OmegaConf  # noqa: E402

from seeupo_gym.bfcl import get_entry, render_action, render_tool_action, render_turn_end  # noqa: E402
from seeupo_gym.integrations.skyrl import register  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    register()  # idempotent


def play(env, actions):
    outputs = []
    for action in actions:
        outputs.append(env.step(action))
        if outputs[-1]["done"]:
            break
    return outputs


@pytest.mark.parametrize("action_format", ["react", "tools"])
def test_bfcl_ground_truth_through_skyrl_make_scores_one(action_format):
    entry = get_entry("multi_turn_base_0")
    config = OmegaConf.create({"max_turns": 20, "action_format": action_format})
    env = skyrl_gym.make("seeupo/BFCL-v4-v0", env_config=config, extras={"task_id": entry.id})
    assert isinstance(env, BaseTextEnv) and env.max_turns == 20
    prompt, metadata = env.init([{"role": "user", "content": "ignored: the env owns its prompt"}])
    assert [m["role"] for m in prompt] == ["system", "user"] and prompt[1]["content"] == entry.user_messages[0]
    render = render_tool_action if action_format == "tools" else render_action
    assert (metadata["tools"] != []) == (action_format == "tools")
    if action_format == "tools":
        assert '"name": "cd"' in prompt[0]["content"]  # SkyRL renders without tools=: they are in the text
    actions = []
    for calls in entry.ground_truth:
        if calls:
            actions.append(render(list(calls)))
        actions.append(render_turn_end("Done."))
    outputs = play(env, actions)
    assert outputs[-1]["done"] and outputs[-1]["reward"] == 1.0 and outputs[-1]["metadata"]["success"]
    assert all(not output["done"] and output["reward"] == 0.0 for output in outputs[:-1])
    first = outputs[0]["observations"]
    expected_role = "tool" if action_format == "tools" else "user"
    assert first and {m["role"] for m in first} == {expected_role}
    env.close()


def test_turnbandit_through_skyrl_make_scores_the_optimum_from_extra_info():
    env = skyrl_gym.make("seeupo/TurnBandit-v0", env_config={"variant": "follow", "num_tasks": 2},
                         extras={"extra_info": {"task_id": "follow-0-0"}, "reward_spec": {}})
    prompt, _ = env.init([])
    assert "Task follow-0-0" in prompt[-1]["content"]
    task = env.env.unwrapped.tasks[0]
    outputs = play(env, [f"<think>pick</think>\n{label}" for label in task.optimal_answers()])
    assert outputs[-1]["done"] and outputs[-1]["reward"] == pytest.approx(task.optimal_value)
    assert outputs[0]["observations"][0]["role"] == "user"


def test_a_row_without_a_task_id_is_a_clear_error():
    with pytest.raises(ValueError, match="extras must name the task"):
        skyrl_gym.make("seeupo/TurnBandit-v0", env_config=None, extras={"prompt": "x"})


def test_a_bad_action_is_an_observation_not_an_exception():
    env = skyrl_gym.make("seeupo/BFCL-v4-base-v0", env_config={"action_format": "tools"}, extras={"task_id": "multi_turn_base_0"})
    env.init([])
    output = env.step('<tool_call>{"name": "cd", "arguments": {"folder": ' + "[" * 10_000 + "}}</tool_call>")
    assert not output["done"] and "nested too deeply" in output["metadata"]["action_error"]
    assert output["observations"][0]["role"] == "user" and output["observations"][0]["content"].startswith("Error:")


@pytest.mark.appworld
def test_appworld_ground_truth_through_skyrl_make_scores_one():
    from conftest import appworld_mini
    from seeupo_gym.appworld.env import render_tool_action as appworld_tool_action

    folder, tasks = appworld_mini()
    env = skyrl_gym.make("seeupo/AppWorld-v0", env_config={"action_format": "tools"}, extras={"task_id": tasks[0]})
    try:
        env.init([])
        solution = (folder / "tasks" / tasks[0] / "ground_truth" / "solution.py").read_text()
        output = env.step(appworld_tool_action(solution))
        assert output["done"] and output["reward"] == 1.0
    finally:
        env.close()
