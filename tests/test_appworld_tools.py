"""`seeupo/AppWorld-v0` with action_format="tools": the `execute_python` tool on the real engine
(mini task set, sandboxed servers), ground truth through tool calls."""

from __future__ import annotations

import gymnasium as gym
import pytest

import seeupo_gym  # noqa: F401  (registers the ids)
from conftest import appworld_mini
from seeupo_gym.appworld import ServerPool
from seeupo_gym.appworld.env import TOOL_NAME, TOOLS, render_tool_action
from seeupo_gym.tools import render_tool_calls

pytestmark = pytest.mark.appworld

MINI, MINI_TASKS = appworld_mini()


def solution(task_id: str) -> str:
    return (MINI / "tasks" / task_id / "ground_truth" / "solution.py").read_text()


@pytest.fixture(scope="module")
def env():
    with ServerPool(MINI, sandbox="bwrap") as pool:
        made = gym.make("seeupo/AppWorld-v0", split="mini", server_pool=pool, action_format="tools")
        yield made
        made.close()


# Two tasks by default; every mini task (a minute) in the slow suite.
@pytest.mark.parametrize("count", [2, pytest.param(None, marks=pytest.mark.slow)], ids=["two", "all"])
def test_ground_truth_through_the_tool_scores_one_on_every_mini_task(env, count):
    assert len(MINI_TASKS) >= 9
    for task_id in MINI_TASKS[:count]:
        _, info = env.reset(options={"task_id": task_id})
        assert info["tools"] == TOOLS
        _, reward, terminated, truncated, info = env.step(render_tool_action(solution(task_id), thought="solve it"))
        assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True), (task_id, info)


def test_output_comes_back_as_a_tool_message_and_bad_calls_are_error_observations(env):
    _, info = env.reset(options={"task_id": MINI_TASKS[0]})
    assert "execute_python" in info["messages"][0]["content"] and "```python" not in info["messages"][0]["content"]
    observation, reward, terminated, truncated, info = env.step(render_tool_action("print(6 * 7)"))
    assert observation.strip() == "42" and info["action_error"] == ""
    assistant, result = info["messages"][-2:]
    assert assistant["tool_calls"] == [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": "print(6 * 7)"}}}]
    assert result == {"role": "tool", "name": TOOL_NAME, "content": observation}
    bad = {
        "I am done.": "calls no tool",
        render_tool_calls([(TOOL_NAME, {"code": "print(1)"})] * 2): "exactly once",
        render_tool_calls([(TOOL_NAME, {"code": 5})]): "must be of type string",
        render_tool_calls([("shell", {"cmd": "ls"})]): "not an available tool",
        '<tool_call>{"name": "execute_python", "arguments": {"code": "' + "[" * 10_000: "not closed",
        render_tool_action("import os\nprint(os.listdir('/'))"): "refused",
    }
    for action, message in bad.items():
        observation, reward, terminated, truncated, info = env.step(action)
        assert message in info["action_error"], (action[:80], info["action_error"])
        assert observation.startswith("Error:") and not (terminated or truncated)
        assert info["messages"][-1] == {"role": "user", "content": observation}


def test_lone_surrogates_in_tool_names_and_arguments_come_back_as_valid_unicode(env):
    """JSON escapes in a tool call ("\\ud800") decode to lone surrogates; the observation,
    the error and the history repeat the model's names and values, always as valid Unicode."""
    import json

    env.reset(options={"task_id": MINI_TASKS[0]})
    actions = [
        render_tool_calls([("\ud800", {"code": "print(1)"})]),  # `\ud800` is not an available tool
        render_tool_calls([(TOOL_NAME, {"code": "print(1)", "\udfff": 1})]),  # an unknown argument
        render_tool_calls([(TOOL_NAME, {"code": 5, "x\udc80": "\ud800"})]),
        render_tool_calls([(TOOL_NAME, {"code": "print('\\ud800' + chr(0xDFFF))"})]),  # printed by the cell
    ]
    observations = []
    for action in actions:
        observation, _, terminated, truncated, info = env.step(action)
        observation.encode("utf-8")
        json.dumps(info, ensure_ascii=False).encode("utf-8")
        assert not (terminated or truncated), observation
        observations.append(observation)
    assert "`\\ud800` is not an available tool" in observations[0], observations[0]
    assert "\\udfff" in observations[1] and "\\udc80" in observations[2], observations
