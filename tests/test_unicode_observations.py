"""Text no tokenizer takes (a lone UTF-16 surrogate) costs one episode at most, never a collection
or a training step: the envs escape it (the real BFCL backend here; AppWorld's host side in
`test_appworld_isolation.py`), and the agent ends the episode of an env that does not."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import pytest
from trainer_helpers import SHAPED_BFCL_ID, make_shaped_bfcl, tiny_config

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.agents.backends import Completion, SamplingParams
from seeupo_gym.agents.vector import END_ENV_ERROR, VectorAgent, encode
from seeupo_gym.bfcl import render_action
from seeupo_gym.spaces import UnicodeText
from seeupo_gym.text import bounded, valid_unicode
from seeupo_gym.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SURROGATE = "\ud800"
SURROGATE_ENV_ID = "test/BFCL-v4-one-lone-surrogate-v0"


def test_valid_unicode_escapes_lone_surrogates_and_keeps_the_rest():
    assert valid_unicode("ok é 🙂") == "ok é 🙂"
    assert valid_unicode(f"a{SURROGATE}b\udc80") == "a\\ud800b\\udc80"
    cut = bounded("x" * 100 + SURROGATE, 50)
    assert len(cut) <= 50 and cut.endswith("more characters]")
    assert bounded({"not": "text"}, 100) == "{'not': 'text'}"


def test_the_real_bfcl_env_escapes_a_lone_surrogate_its_backend_echoes():
    env = gym.make("seeupo/BFCL-v4-base-v0", max_turns=3)
    try:
        env.reset(options={"task_id": "multi_turn_base_0"})
        # The escape in the call's source makes a string value holding a lone surrogate.
        action = render_action(["mkdir(dir_name='\\ud800')", "ls()", "cd(folder='x\\ud800')"])
        observation, *_ , info = env.step(action)
    finally:
        env.close()
    observation.encode("utf-8")
    for message in info["messages"]:
        message["content"].encode("utf-8")
    assert "\\ud800" in observation


class SurrogateStubEnv(gym.Env):
    """Replaces the benchmark envs to test the agent around them: task "bad" answers the first
    response with a lone surrogate (an env that breaks the valid-Unicode contract), "bad-reset"
    opens with one, "t2" ends after two responses."""

    def __init__(self) -> None:
        self.observation_space = UnicodeText(10_000)
        self.action_space = UnicodeText(100_000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.task, self.turn = (options or {}).get("task_id", "t2"), 0
        opening = f"Task {self.task} {SURROGATE}" if self.task == "bad-reset" else f"Task {self.task}: say anything."
        self.messages = [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": opening}]
        return opening, self._info()

    def step(self, action: str):
        self.turn += 1
        self.messages.append({"role": "assistant", "content": action})
        terminated = self.turn >= 2
        observation = f"bad bytes {SURROGATE}" if self.task == "bad" else "Go on."
        if not terminated:
            self.messages.append({"role": "user", "content": observation})
        return observation, float(terminated), terminated, False, self._info()

    def _info(self) -> dict[str, Any]:
        return {"task_id": self.task, "messages": [dict(m) for m in self.messages], "success": False}


class ReplayBackend:
    """Replaces the model: answers every prompt with "hello" + <|im_end|>."""

    def __init__(self, tokenizer) -> None:
        self.ids = encode(tokenizer, "hello") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.default_stop_token_ids = (self.ids[-1],)

    def generate(self, prompts, sampling):
        return [Completion(list(self.ids), [0.0] * len(self.ids), "stop") for _ in prompts]

    def update_weights(self, state_dict_or_model) -> None:
        pass


@pytest.mark.parametrize("context_mode", ["auto", "rebuild"])
def test_a_stub_env_with_an_untokenizable_observation_loses_only_that_episode_in_collect(tiny, context_mode):
    _, tokenizer = tiny
    with pytest.raises((TypeError, ValueError)):  # what the stub's text does to the tokenizer itself
        encode(tokenizer, SURROGATE)
    agent = VectorAgent("test/SurrogateStub", ReplayBackend(tokenizer), tokenizer, num_envs=2,
                        sampling=SamplingParams(max_new_tokens=4), env_factory=SurrogateStubEnv,
                        context_mode=context_mode)
    with agent:
        batch = agent.collect(["bad", "bad-reset", "t2"], group_size=2, seed=0)
    groups = batch.groups()
    for name in ("0:bad", "1:bad-reset"):
        assert all(t.info["end"] == END_ENV_ERROR and t.reward == 0.0 for t in groups[name]), name
    assert "TypeError" in groups["0:bad"][0].info["error"] or "Error" in groups["0:bad"][0].info["error"]
    assert all(t.info["end"] == "terminated" and t.reward == 1.0 for t in groups["2:t2"])


class OneLoneSurrogate(gym.Wrapper):
    """The real (length-shaped) BFCL env, with a lone surrogate added to the first observation
    of the first episode of the process: an env breaking the valid-Unicode contract once."""

    sent = False

    def step(self, action):
        observation, reward, terminated, truncated, info = self.env.step(action)
        if not OneLoneSurrogate.sent and not (terminated or truncated):
            OneLoneSurrogate.sent = True
            observation += SURROGATE
            info = {**info, "messages": [*info["messages"][:-1],
                                         {**info["messages"][-1], "content": info["messages"][-1]["content"] + SURROGATE}]}
        return observation, reward, terminated, truncated, info


def make_one_lone_surrogate(**kwargs) -> gym.Env:
    return OneLoneSurrogate(make_shaped_bfcl(**kwargs))


if SURROGATE_ENV_ID not in gym.registry:
    gym.register(SURROGATE_ENV_ID, entry_point=make_one_lone_surrogate)


def test_a_training_step_completes_when_a_stub_wrapped_env_sends_one_untokenizable_observation(tmp_path):
    OneLoneSurrogate.sent = False
    config = tiny_config(tmp_path, "algorithm.name=grpo", "train.steps=1", f"env.id={SURROGATE_ENV_ID}",
                         f"plugins=[{__file__}]", "env.kwargs={max_turns: 2}")
    with Trainer(config) as trainer:
        records = trainer.train()
        assert trainer.state.step == 1
    assert OneLoneSurrogate.sent
    step = next(r for r in records if "rollout/trajectories" in r)
    assert step["rollout/env_errors"] == 1.0
    assert step["rollout/trajectories"] == 1.0  # the other rollout of the group
    assert SHAPED_BFCL_ID  # the real env underneath
