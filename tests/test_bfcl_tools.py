"""seeupo/BFCL-v4-v0 with action_format="tools": native tool calls on the real data, backends and checker."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.bfcl import CATEGORIES, get_entry, load_category, render_tool_action
from seeupo_gym.bfcl.env import FINAL_OBSERVATION
from seeupo_gym.bfcl.prompt import json_schema
from seeupo_gym.tools import render_tool_calls
from fuzz_helpers import mangled


def make(**kwargs):
    kwargs.setdefault("categories", list(CATEGORIES))
    kwargs.setdefault("split", "all")
    kwargs.setdefault("action_format", "tools")
    return gym.make("seeupo/BFCL-v4-v0", **kwargs)


def tool_script(ground_truth) -> list[str]:
    """The ground-truth replay as tool calls: each turn's calls in one response, then plain text."""
    actions = []
    for calls in ground_truth:
        if calls:
            actions.append(render_tool_action(list(calls), thought="these calls do what the user asked"))
        actions.append("<think>nothing left to call</think>\nDone.")
    return actions


def play(env, task_id, actions):
    env.reset(options={"task_id": task_id})
    steps = []
    for action in actions:
        steps.append(env.step(action))
        if steps[-1][2] or steps[-1][3]:
            break
    return steps


def sample_ids(per_category: int) -> list[str]:
    ids = []
    for category in CATEGORIES:
        entries = load_category(category)
        step = len(entries) // per_category
        ids += [entries[index * step].id for index in range(per_category)]
    return ids + ["multi_turn_base_173"]  # its ground truth passes a string to an integer parameter


@pytest.mark.parametrize("task_id", sample_ids(5))
def test_ground_truth_as_tool_calls_scores_one(task_id):
    steps = play(make(max_turns=100), task_id, tool_script(get_entry(task_id).ground_truth))
    observation, reward, terminated, truncated, info = steps[-1]
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert observation == FINAL_OBSERVATION
    assert info["turn"] == get_entry(task_id).min_responses
    assert all(step[4]["action_error"] == "" for step in steps)


@pytest.mark.slow
def test_ground_truth_as_tool_calls_scores_one_on_all_800_entries():
    env = make(max_turns=100)
    failed = []
    for category in CATEGORIES:
        for entry in load_category(category):
            *_, (_, reward, terminated, _, info) = play(env, entry.id, tool_script(entry.ground_truth))
            if not (terminated and reward == 1.0):
                failed.append((entry.id, info.get("error_type")))
    assert failed == []


def test_a_wrong_call_scores_zero_with_the_same_checker():
    entry = get_entry("multi_turn_base_0")
    wrong = [list(calls) for calls in entry.ground_truth]
    wrong[0] = wrong[0][:-1]  # leave out the turn's last call
    *_, (_, reward, terminated, _, info) = play(make(max_turns=100), entry.id, tool_script(wrong))
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    assert info["turn_results"][0] == "failed"


def test_tools_are_json_schemas_in_info_and_not_in_the_system_message():
    env = make()
    observation, info = env.reset(options={"task_id": "multi_turn_base_0"})
    entry = get_entry("multi_turn_base_0")
    names = [tool["function"]["name"] for tool in info["tools"]]
    assert "cd" in names and "ls" in names
    assert all(tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object" for tool in info["tools"])
    dumped = json.dumps(info["tools"])
    assert '"dict"' not in dumped and '"float"' not in dumped  # BFCL's dialect is mapped to JSON Schema
    system = info["messages"][0]
    assert system["role"] == "system" and "cd(" not in system["content"] and "tool-calling format" in system["content"]
    assert '"name": "cd"' in observation  # text-only agents see the tools in the observation
    assert info["messages"][1] == {"role": "user", "content": entry.user_messages[0]}


def test_bfcl_dict_type_becomes_json_object_recursively():
    schema = {"type": "dict", "properties": {"a": {"type": "array", "items": {"type": "dict"}}, "b": {"type": "float"},
                                             "c": {"type": "any"}}}
    assert json_schema(schema) == {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object"}},
                                                                     "b": {"type": "number"}, "c": {}}}


def test_results_come_back_as_tool_messages_and_plain_text_ends_the_turn():
    env = make()
    _, info = env.reset(options={"task_id": "multi_turn_base_0"})
    before = info["messages"]
    action = render_tool_calls([("ls", {}), ("cd", {"folder": "nowhere"})], content="<think>look</think>")
    observation, reward, terminated, truncated, info = env.step(action)
    assert info["action_kind"] == "calls" and info["action_error"] == ""
    assistant, first, second = info["messages"][len(before):]
    assert assistant["role"] == "assistant" and assistant["content"] == "<think>look</think>"
    assert [call["function"] for call in assistant["tool_calls"]] == [
        {"name": "ls", "arguments": {}}, {"name": "cd", "arguments": {"folder": "nowhere"}}]
    assert first["role"] == second["role"] == "tool" and (first["name"], second["name"]) == ("ls", "cd")
    assert "error" in second["content"].lower()
    assert observation.startswith("Results:")
    _, _, _, _, info = env.step("I listed the files.")
    assert info["action_kind"] == "turn_end" and info["user_turn"] == 1
    assert info["messages"][-2] == {"role": "assistant", "content": "I listed the files."}
    assert info["messages"][-1]["role"] == "user"


@pytest.mark.parametrize(
    "action, message",
    [
        ('<tool_call>{"name": "format_disk", "arguments": {}}</tool_call>', "not an available tool"),
        ('<tool_call>{"name": "ls", "arguments": {"a": tru}}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "ls", "arguments": {"a": ' + "[" * 10_000 + "]" * 10_000 + "}}</tool_call>", "nested too deeply"),
        ('<tool_call>{"name": "ls", "arguments": {"a": "' + "x" * 10_000_000 + '"}}</tool_call>', "too long"),
        ('<tool_call>{"name": "ls", "arguments": {"a": 123456789012345678901234}}</tool_call>', "too large an integer"),
        ('<tool_call>{"name": "power", "arguments": {"base": 2, "exponent": 100000}}</tool_call>', "exponent must be at most"),
    ],
)
def test_bad_tool_calls_are_error_observations_that_keep_the_turn(action, message):
    env = make()
    env.reset(options={"task_id": "multi_turn_base_15"})  # has MathAPI's power
    observation, reward, terminated, truncated, info = env.step(action)
    assert info["action_kind"] == "error" and message in info["action_error"]
    assert (reward, terminated, truncated, info["user_turn"]) == (0.0, False, False, 0)
    assert observation.startswith("Error:") and info["messages"][-1] == {"role": "user", "content": observation}


def test_miss_func_reveals_new_tools_as_schemas_in_the_user_message():
    entry = next(entry for entry in load_category("miss_func") if entry.revealed_functions)
    env = make()
    _, info = env.reset(options={"task_id": entry.id})
    turn, names = next(iter(entry.revealed_functions.items()))
    assert not set(names) & {tool["function"]["name"] for tool in info["tools"]}
    actions = tool_script(entry.ground_truth)
    for action in actions:
        _, _, _, _, info = env.step(action)
        if info["user_turn"] == turn:
            break
    reveal = info["messages"][-1]["content"]
    assert all(f'"name": "{name}"' in reveal for name in names) and "<tools>" in reveal
    assert not set(names) & {tool["function"]["name"] for tool in info["tools"]}  # the system's tools stay fixed


def test_the_tools_format_passes_check_env_and_keeps_info_types():
    env = make(categories="base").unwrapped
    check_env(env, skip_render_check=True)
    _, reset_info = env.reset(options={"task_id": "multi_turn_base_0"})
    *_, (_, _, _, _, end_info) = play(env, "multi_turn_base_0", tool_script(get_entry("multi_turn_base_0").ground_truth))
    assert {k: type(v) for k, v in reset_info.items()} == {k: type(v) for k, v in end_info.items()}


def test_unknown_action_format_or_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="action_format must be one of"):
        make(action_format="json")
    with pytest.raises(ValueError, match="unknown tool parser"):
        make(tool_parser="nope")


def test_react_format_publishes_no_tools():
    _, info = make(action_format="react").reset(options={"task_id": "multi_turn_base_0"})
    assert info["tools"] == []


def test_mangled_tool_calls_never_raise():
    import random

    rng = random.Random(0)
    valid = render_tool_calls([("cd", {"folder": "document"}), ("ls", {"a": True})])
    env = make(max_turns=1000)
    env.reset(options={"task_id": "multi_turn_base_0"})
    alphabet = '{}[]":,\\<>/ \n0123456789eE.-+tool_callnameargumentsNaN\x00\ud800'
    for _ in range(300):
        observation, reward, terminated, truncated, info = env.step(mangled(valid, rng, alphabet))
        assert isinstance(observation, str) and info["action_kind"] in ("calls", "turn_end", "error")
        if terminated or truncated:
            env.reset(options={"task_id": "multi_turn_base_0"})
