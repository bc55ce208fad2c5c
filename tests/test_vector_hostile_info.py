"""VectorAgent with a local env whose answers go bad after its first step, past gymnasium's
passive checker (which looks at the first reset and step only): each ends its episode as an env
error with the reason, never the collection."""

from __future__ import annotations

import gymnasium as gym
import pytest

import seeupo_gym  # noqa: F401
from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.vector import END_ENV_ERROR, VectorAgent
from seeupo_gym.spaces import UnicodeText

_GOOD = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "task_id": "t"}


class LateHostileEnv(gym.Env):
    """Honest at reset and at the first step; then answers `bad` (the whole step, or its info)."""

    def __init__(self, bad=None, whole=False):
        self.observation_space = self.action_space = UnicodeText(4096)
        self.bad, self.whole, self.steps = bad, whole, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return "U", dict(_GOOD)

    def step(self, action):
        self.steps += 1
        if self.steps == 1:
            return "U", 0.0, False, False, dict(_GOOD)
        return self.bad if self.whole else ("U", 0.0, False, False, self.bad)


gym.register("test/LateHostile-v0", entry_point=LateHostileEnv)


@pytest.mark.parametrize("bad, whole, match", [
    ("a string", False, "info is a str, not a dict"),
    ([1, 2], False, "info is a list, not a dict"),
    ({"messages": "hello"}, False, "info['messages'] is a str"),
    ({"messages": [{"role": 5, "content": "x"}]}, False, "message 0 has no string role"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, False, "message 0 has dict content"),
    ({"messages": [], "tools": "x"}, False, "info['tools'] is not a list of dicts"),
    (("U", "one", True, False, {}), True, "the reward 'one', not a finite number"),
])
def test_an_env_answer_the_agent_cannot_read_ends_its_episode_as_an_env_error(tiny, one_torch_thread, bad, whole, match):
    model, tokenizer = tiny
    with VectorAgent("test/LateHostile-v0", HFBackend(model, tokenizer), tokenizer, num_envs=2,
                     sampling=SamplingParams(max_new_tokens=2), env_kwargs={"bad": bad, "whole": whole}) as agent:
        batch = agent.collect(["t", "t"], group_size=1, seed=0).trajectories
    assert [t.info["end"] for t in batch] == [END_ENV_ERROR] * 2
    assert all("EnvAnswerError" in t.info["error"] and match in t.info["error"] for t in batch)
    assert all(len(t.turns) == 2 and t.reward == 0.0 for t in batch)


def test_a_readable_info_passes_the_check():
    from seeupo_gym.agents.vector import env_info_error

    assert env_info_error(_GOOD) is None
    assert env_info_error({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
                           "tools": [{"type": "function"}], "tool_parser": "hermes"}) is None
    assert env_info_error({}, at_reset=False) is None  # a step may leave messages out
    assert env_info_error({}) is not None


@pytest.mark.parametrize("bad", ["a string", {"messages": ["hello"]}])
def test_a_chat_episode_ends_as_an_env_error_on_an_env_answer_it_cannot_read(bad):
    from seeupo_gym.agents.chat_agent import collect_chat

    class ScriptedChatBackend:  # stands in for a chat-mode OpenAIBackend: one fixed reply
        mode = "chat"

        def chat(self, messages, sampling, tools=None):
            from seeupo_gym.agents.backends.openai import ChatReply

            return ChatReply(content="A")

    (episode,) = collect_chat(ScriptedChatBackend(), "test/LateHostile-v0", ["t"], 1, seed=0,
                              sampling=SamplingParams(max_new_tokens=2), env_kwargs={"bad": bad}).trajectories
    assert episode.info["end"] == END_ENV_ERROR and "EnvAnswerError" in episode.info["error"]
    assert len(episode.info["actions"]) == 2
