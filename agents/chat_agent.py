"""Episodes with a chat-mode model (an API model with no tokenizer here): messages in, actions out.

The env keeps the conversation (`info["messages"]`, `info["tools"]`); each turn sends it in the
OpenAI chat format (tool calls with ids, arguments as JSON strings, `tool` replies tied to their
call) and renders the reply back into the env's action format: in the tools format the reply's
tool calls as hermes blocks (the env's default parser), in ReAct the reply's text. The env then
parses and checks the action exactly as it does a sampled one, so an API model meets the same
rules, bounds and scoring as a local one.

The turns hold no tokens: these trajectories are for evaluation only (`info["trainable"]` is
False, and the trainer refuses them).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Sequence

import gymnasium as gym

from seeupo_gym.agents.backends.base import RequestError, SamplingParams
from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.agents.vector import checked_env_answer
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.text import valid_unicode

logger = logging.getLogger(__name__)

_CHAT_TURN = 5  # purpose mixed into derive_seed


def openai_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The env's chat history in the OpenAI format: each assistant tool call gets an id and JSON
    string arguments, and each `tool` message the id of the call it answers (in order)."""
    out: list[dict[str, Any]] = []
    open_ids: list[str] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for k, call in enumerate(message["tool_calls"]):
                function = call.get("function", {})
                arguments = function.get("arguments", {})
                calls.append({
                    "id": f"call_{index}_{k}",
                    "type": "function",
                    "function": {"name": function.get("name", ""),
                                 "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
                })
            open_ids = [call["id"] for call in calls]
            out.append({"role": "assistant", "content": message.get("content") or "", "tool_calls": calls})
        elif role == "tool":
            if open_ids:
                out.append({"role": "tool", "tool_call_id": open_ids.pop(0), "content": message.get("content", "")})
            else:  # a tool reply to no call (the env reports an error this way): plain user text
                out.append({"role": "user", "content": message.get("content", "")})
        else:
            out.append({"role": role, "content": message.get("content", "")})
    return out


def render_reply(content: str, tool_calls: Sequence[tuple[str, Any]], tools_format: bool) -> str:
    """A chat reply as the env's action text (valid Unicode: a server may send lone surrogates)."""
    content = valid_unicode(content)
    if not tools_format:
        return content
    blocks = [
        "<tool_call>\n" + json.dumps({"name": valid_unicode(name), "arguments": _valid(arguments)}, ensure_ascii=False)
        + "\n</tool_call>"
        for name, arguments in tool_calls
    ]
    return "\n".join(([content.strip()] if content.strip() else []) + blocks)


def _valid(value: Any) -> Any:
    """JSON from the server with every string made valid Unicode (a `\\ud800` escape decodes to a
    lone surrogate, which would come back out of the env's JSON parser as one)."""
    if isinstance(value, str):
        return valid_unicode(value)
    if isinstance(value, list):
        return [_valid(v) for v in value]
    if isinstance(value, dict):
        return {valid_unicode(str(k)): _valid(v) for k, v in value.items()}
    return value


def collect_chat(
    backend: Any,
    env_id: str,
    task_ids: Sequence[str],
    group_size: int,
    *,
    seed: int,
    sampling: SamplingParams,
    env_kwargs: dict[str, Any] | None = None,
    concurrency: int = 8,
    on_turn: Any = None,
    on_episode: Any = None,
) -> RolloutBatch:
    """`group_size` episodes of every task with a chat-mode `OpenAIBackend`, `concurrency` at once
    (each on its own env). Same seed, same requests (per (episode, turn) seeds)."""
    jobs = [(b * group_size + g, task_id, b, g) for b, task_id in enumerate(task_ids) for g in range(group_size)]

    def run(job: tuple[int, str, int, int]) -> Trajectory:
        index, task_id, b, g = job
        env = gym.make(env_id, **(env_kwargs or {}))
        try:
            trajectory = _episode(backend, env, task_id, b, g, index, seed, sampling, on_turn)
        finally:
            env.close()
        if on_episode is not None:  # e.g. a progress bar: one step per finished episode
            on_episode(trajectory)
        return trajectory

    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="chat-episode") as pool:
        trajectories = list(pool.map(run, jobs))
    return RolloutBatch(trajectories)


def _episode(backend: Any, env: Any, task_id: str, b: int, g: int, index: int, seed: int,
             sampling: SamplingParams, on_turn: Any) -> Trajectory:
    group_id = f"{b}:{task_id}"
    record: dict[str, Any] = {"actions": [], "trainable": False}
    turns: list[Turn] = []

    def finish(end: str, reward: float, success: bool, truncated: bool, info: dict[str, Any] | None = None) -> Trajectory:
        record["end"] = end
        if info is not None:
            record["env_info"] = {k: v for k, v in info.items() if k != "messages"}
            record["messages"] = info.get("messages", [])
        return Trajectory(task_id=task_id, group_id=group_id, rollout_id=f"{group_id}:{g}", turns=turns,
                          reward=reward, success=success, truncated=truncated, info=record)

    # The whole episode, every turn and retry, ends at the backend's episode deadline.
    deadline = backend.episode_deadline() if hasattr(backend, "episode_deadline") else None
    try:
        _, info = checked_env_answer(env.reset(options={"task_id": task_id}), "reset")
    except Exception as error:  # noqa: BLE001  a broken env (or one answering what no env does) costs its episode only
        record["error"] = f"{type(error).__name__}: {error}"
        return finish("env_error", 0.0, False, True)
    while True:
        tools = list(info.get("tools") or [])
        request = replace(sampling, seed=derive_seed(seed, _CHAT_TURN, index, len(turns) + 1))
        try:
            reply = backend.chat(openai_messages(info.get("messages", [])), request, tools=tools or None,
                                 **({"deadline": deadline} if deadline is not None else {}))
        except RequestError as error:
            record["error"] = f"{type(error).__name__}: {error}"
            return finish("backend_error", 0.0, False, True, info)
        action = render_reply(reply.content, reply.tool_calls, bool(tools))
        if not tools:  # the ReAct format reads the text: calls the server made as tool calls are lost
            dropped = len(reply.tool_calls) + reply.content.count("<tool_call>")
            if dropped:
                record["dropped_tool_calls"] = record.get("dropped_tool_calls", 0) + dropped
        record["actions"].append(action)
        turns.append(Turn(context_ids=[], response_ids=[], sample_logprobs=[], finish_reason=reply.finish_reason))
        if on_turn is not None:
            on_turn(reply)
        try:
            _, reward, terminated, truncated, info = checked_env_answer(env.step(action), "step")
        except Exception as error:  # noqa: BLE001
            record["error"] = f"{type(error).__name__}: {error}"
            return finish("env_error", 0.0, False, True)
        if terminated or truncated:
            return finish("terminated" if terminated else "truncated", float(reward), bool(info.get("success", False)),
                          bool(truncated and not terminated), info)
