"""seeupo/TurnBandit-v0 with action_format="tools": one `answer(label)` tool, and its tool-call parsing
attacked like the other envs' action formats."""

from __future__ import annotations

import json
import random

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.tools import render_tool_calls
from seeupo_gym.turnbandit import TOOLS
from fuzz_helpers import mangled

KWARGS = {"variant": "follow", "num_tasks": 4, "action_format": "tools"}


def make(**kwargs):
    return gym.make("seeupo/TurnBandit-v0", **{**KWARGS, **kwargs}).unwrapped


def call(label) -> str:
    return render_tool_calls([("answer", {"label": label})])


def test_optimal_answers_as_tool_calls_score_the_optimum_and_come_back_as_tool_messages():
    env = make()
    observation, info = env.reset(options={"task_id": "follow-0-0"})
    assert info["tools"] == TOOLS and info["tool_parser"] == "hermes"
    assert '"name": "answer"' in observation and "Call `answer` with one letter." in observation
    assert "`answer` tool" in info["messages"][0]["content"]
    for label in env.task.optimal_answers():
        observation, reward, terminated, truncated, info = env.step(f"<think>The step names it.</think>\n{call(label)}")
    assert terminated and not truncated and reward == pytest.approx(env.task.optimal_value) and info["success"]
    assert [m["role"] for m in info["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert info["messages"][2]["tool_calls"] == [{"type": "function", "function": {"name": "answer", "arguments": {"label": env.task.optimal_answers()[0]}}}]
    assert info["messages"][-1] == {"role": "tool", "name": "answer", "content": observation}


def test_the_label_is_read_like_a_react_answer():
    env = make()
    env.reset(options={"task_id": "follow-0-0"})
    options = env.task.options[0]
    _, _, _, _, info = env.step(call(f"b) {options[1]}"))
    assert info["action_error"] == "" and info["choices"] == "B"


def test_react_format_publishes_no_tools_and_keeps_its_messages():
    env = make(action_format="react")
    observation, info = env.reset(options={"task_id": "follow-0-0"})
    assert info["tools"] == [] and info["tool_parser"] == "" and "# Tools" not in observation
    assert "Answer with one letter." in observation
    _, _, _, _, info = env.step("A")
    assert info["messages"][-2:] == [{"role": "assistant", "content": "A"},
                                     {"role": "user", "content": info["messages"][-1]["content"]}]


HUGE = "x" * 10_000_000


@pytest.mark.parametrize(
    "action, message, as_tool",
    [
        ("B", "calls no tool" , False),
        ('<tool_call>{"name": "answer", "arguments": {"label": "B"}</tool_call>', "not valid JSON", False),
        ('<tool_call>{"name": "answer", "arguments": {"label": "B"}}', "not closed", False),
        ('<tool_call>{"name": "format_disk", "arguments": {}}</tool_call>', "not an available tool", False),
        (call("A") + call("B"), "makes 2 tool calls", False),
        (render_tool_calls([("answer", {"label": "A", "why": "x"})]), "unknown argument", False),
        (render_tool_calls([("answer", {})]), "missing required argument", False),
        (render_tool_calls([("answer", {"label": 1})]), "must be of type string", False),
        (render_tool_calls([("answer", {"label": ["A"]})]), "must be of type string", False),
        ('<tool_call>{"name": "answer", "arguments": {"label": 1e999}}</tool_call>', "must be a finite number", False),
        ('<tool_call>{"name": "answer", "arguments": {"label": NaN}}</tool_call>', "not a finite number", False),
        ('<tool_call>{"name": "answer", "arguments": {"label": ' + "[" * 10_000 + "]" * 10_000 + "}}</tool_call>", "characters long", False),
        ('<tool_call>{"name": "answer", "arguments": {"label": ' + "[" * 3_000 + "]" * 3_000 + "}}</tool_call>", "nested too deeply", False),
        ('<tool_call>{"name": "answer", "arguments": {"label": 123456789012345678901234567890}}</tool_call>', "too large an integer", False),
        (call(HUGE), "characters long", False),
        (call("Z"), "names none of the options", True),
        (call("\ud800"), "binary data", False),  # a lone surrogate, as a JSON escape
        ('<tool_call>{"name": "answer", "arguments": {"label": "\ud800"}}</tool_call>', "binary data", False),  # raw
        (call("A\x00"), "binary data", False),
        (call("A\x1b[2J"), "binary data", False),
        ("<think>unclosed " + call("A"), "<think> block is not closed", False),
        ('<tool_call>"answer"</tool_call>', "must be a JSON object", False),
        ('<tool_call>{"name": "answer", "arguments": "{\\"label\\": "}</tool_call>', "not valid JSON", False),
    ],
)
def test_bad_tool_calls_are_invalid_actions_that_use_the_turn_and_never_raise(action, message, as_tool):
    env = make()
    env.reset(options={"task_id": "follow-0-1"})
    observation, reward, terminated, truncated, info = env.step(action)
    assert message in info["action_error"] and info["invalid_action"] and info["invalid_actions"] == 1
    assert (reward, terminated, truncated, info["choices"]) == (0.0, False, False, "")
    assert observation.startswith("Invalid action:") and "Call `answer` with one letter among A, B, C." in observation
    assert len(observation) < 2_000  # a huge action is not echoed back
    json.dumps(info["messages"], ensure_ascii=False).encode("utf-8")  # valid Unicode on the way out...
    if "\ud800" not in action:
        assert info["messages"][-2]["role"] == "assistant"
    # ...and the answer is a tool result only when the response was one valid call of the tool.
    assert info["messages"][-1]["role"] == ("tool" if as_tool else "user")
    # The same decision is asked again, and the penalty lands on the final reward.
    for label in env.task.optimal_answers():
        _, reward, terminated, _, _ = env.step(call(label))
    assert terminated and reward == pytest.approx(env.task.optimal_value - env.invalid_penalty)


def test_mangled_tool_calls_never_raise():
    rng = random.Random(0)
    valid = call("B")
    env = make(max_turns=1000)
    env.reset(options={"task_id": "follow-0-0"})
    alphabet = '{}[]":,\\<>/ \n0123456789eE.-+tool_callnameargumentslabelABNaN\x00\ud800'
    kinds = set()
    for _ in range(400):
        observation, reward, terminated, truncated, info = env.step(mangled(valid, rng, alphabet))
        assert isinstance(observation, str) and isinstance(info["action_error"], str)
        kinds.add(info["invalid_action"])
        if terminated or truncated:
            env.reset(options={"task_id": "follow-0-0"})
    assert kinds == {True, False}  # some mangled calls still parse, most do not


def test_the_tools_format_passes_check_env_and_keeps_info_types():
    env = make()
    check_env(env, skip_render_check=True)
    _, reset_info = env.reset(options={"task_id": "follow-0-2"})
    _, _, _, _, error_info = env.step("no call")
    for label in env.task.optimal_answers():
        *_, end_info = env.step(call(label))
    types = {k: type(v) for k, v in reset_info.items()}
    assert types == {k: type(v) for k, v in error_info.items()} == {k: type(v) for k, v in end_info.items()}


def test_unknown_action_format_or_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="action_format must be one of"):
        make(action_format="json")
    with pytest.raises(ValueError, match="unknown tool parser"):
        make(tool_parser="nope")


def test_the_json_parser_reads_a_bare_call_object():
    env = make(tool_parser="json")
    env.reset(options={"task_id": "follow-0-0"})
    label = env.task.optimal_answers()[0]
    _, _, _, _, info = env.step(json.dumps({"name": "answer", "arguments": {"label": label}}))
    assert info["action_error"] == "" and info["choices"] == label


def test_brief_prompt_names_the_tool():
    env = make(brief=True)
    _, info = env.reset(options={"task_id": "follow-0-0"})
    assert info["messages"][0]["content"] == "You are playing TurnBandit. At each step, call the `answer` tool with the letter of one option."


def test_agent_appends_tool_results_token_in_token_out_with_a_scripted_backend_instead_of_a_model(tiny):
    from seeupo_gym.agents.backends import SamplingParams
    from seeupo_gym.agents.chat import render_chat
    from seeupo_gym.agents.vector import VectorAgent, encode
    from test_agent_tools import ScriptBackend

    _, tokenizer = tiny
    with VectorAgent("seeupo/TurnBandit-v0", ScriptBackend(tokenizer, [call("A")]), tokenizer, num_envs=1,
                     sampling=SamplingParams(max_new_tokens=64), env_kwargs=KWARGS) as agent:
        (trajectory,) = agent.collect(["follow-0-0"], group_size=1, seed=0)
    messages, tools = trajectory.info["messages"], trajectory.info["env_info"]["tools"]
    assert trajectory.num_turns == 2 and [m["role"] for m in messages[2:]] == ["assistant", "tool", "assistant", "tool"]
    first, second = trajectory.turns
    assert "<tools>" in tokenizer.decode(first.context_ids)
    # Appended, not rebuilt, and equal to the template's rendering of the env's history.
    assert second.context_ids[: len(first.context_ids) + len(first.response_ids)] == first.context_ids + first.response_ids
    assert second.context_ids == encode(tokenizer, render_chat(tokenizer, messages[:4], add_generation_prompt=True, tools=tools))


def test_stopping_in_the_tools_format_a_call_of_the_stop_ends_the_episode_with_its_reward():
    env = make(variant="stopping", num_tasks=6)
    for task in env.tasks:
        env.reset(options={"task_id": task.task_id})
        stop = "ABCDEFGH"[task.stops[0]]
        observation, reward, terminated, truncated, info = env.step(call(stop))
        assert terminated and not truncated and "(stop)" in observation and reward == task.reward((task.stops[0],))
        assert [m["role"] for m in info["messages"]] == ["system", "user", "assistant", "tool"]
        env.reset(options={"task_id": task.task_id})
        for label in task.optimal_answers():
            observation, reward, terminated, truncated, info = env.step(call(label))
        assert terminated and info["success"] and reward == pytest.approx(task.optimal_value)
        assert info["turn"] == len(task.optimal()[1])  # the optimum's own length, stops included
