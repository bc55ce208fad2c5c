"""VectorAgent: B tasks x G rollouts, one backend call per step, token-in/token-out.

The real path runs seeupo/BFCL-v4-v0 (bfcl-eval's data and checker) with the tiny model.
Mechanics that need exact control (episode lengths, env crashes, budgets) use `ScriptedChatEnv`,
a small env defined here that replaces the benchmark envs; template-exactness tests use
`ReplayBackend`, which replaces the model by canned responses.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import pytest
import torch

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.agents.backends import Backend, Completion, HFBackend, SamplingParams
from seeupo_gym.agents.scoring import response_logprobs
from seeupo_gym.agents.vector import END_CONTEXT_BUDGET, END_ENV_ERROR, ChatDelta, VectorAgent, encode, render_chat
from seeupo_gym.spaces import UnicodeText
from seeupo_gym.templates import ReActTemplate

BFCL = "seeupo/BFCL-v4-base-v0"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- test doubles


class ScriptedChatEnv(gym.Env):
    """Replaces the benchmark envs: task "tK" ends after K responses, "boom" raises in step.

    Reward = fraction of non-empty responses; truncated at max_turns.
    """

    def __init__(self, max_turns: int = 3, keep_think: bool = True) -> None:
        self.max_turns = max_turns
        self.template = ReActTemplate(keep_think=keep_think)
        self.observation_space = UnicodeText(10_000)
        self.action_space = UnicodeText(100_000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        task = (options or {}).get("task_id") or f"t{int(self.np_random.integers(1, 4))}"
        self.task, self.turn, self.non_empty = task, 0, 0
        self.messages = [
            {"role": "system", "content": "You are a test agent."},
            {"role": "user", "content": f"Task {task}: say anything."},
        ]
        return self.messages[-1]["content"], self._info(False)

    def step(self, action: str):
        if self.task == "boom":
            raise RuntimeError("the env's server died")
        self.turn += 1
        self.non_empty += bool(action.strip())
        self.messages.append({"role": "assistant", "content": self.template.history_content(action)})
        length = int(self.task[1:])
        terminated = self.turn >= length
        truncated = not terminated and self.turn >= self.max_turns
        reward = self.non_empty / length if terminated else 0.0
        observation = f"Noted {len(action)} characters. Go on."
        if not terminated:
            self.messages.append({"role": "user", "content": observation})
        return observation, reward, terminated, truncated, self._info(terminated and reward == 1.0)

    def _info(self, success: bool) -> dict[str, Any]:
        return {"task_id": self.task, "turn": self.turn, "messages": [dict(m) for m in self.messages], "success": success}


class ReplayBackend(Backend):
    """Replaces the model: answers every prompt with `text` tokenized canonically + <|im_end|>."""

    def __init__(self, tokenizer, text: str) -> None:
        self.ids = encode(tokenizer, text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.default_stop_token_ids = (self.ids[-1],)
        self.calls = 0
        self.batch_sizes: list[int] = []

    def generate(self, prompts, sampling):
        self.calls += 1
        self.batch_sizes.append(len(prompts))
        return [Completion(list(self.ids), [0.0] * len(self.ids), "stop") for _ in prompts]

    def update_weights(self, state_dict_or_model) -> None:
        pass


def scripted_agent(backend, tokenizer, **kwargs) -> VectorAgent:
    env_kwargs = kwargs.pop("env_kwargs", {})
    kwargs.setdefault("num_envs", 2)
    kwargs.setdefault("sampling", SamplingParams(max_new_tokens=6))
    return VectorAgent(
        "test/ScriptedChat", backend, tokenizer, env_factory=lambda: ScriptedChatEnv(**env_kwargs), **kwargs
    )


def _assistant_contents(trajectory) -> list[str]:
    return [m["content"] for m in trajectory.info["messages"] if m["role"] == "assistant"]


# ----------------------------------------------------------------------------- BFCL, real path


@pytest.fixture(scope="module")
def bfcl_run(tiny):
    model, tokenizer = tiny
    sampling = SamplingParams(max_new_tokens=10)
    with VectorAgent(
        BFCL, HFBackend(model, tokenizer), tokenizer, num_envs=3, sampling=sampling, env_kwargs={"max_turns": 2}
    ) as agent:
        batch = agent.collect(["multi_turn_base_0", None], group_size=2, seed=11)
        stats = agent.last_stats
    return batch, stats


def test_bfcl_rollouts_are_token_in_token_out(tiny, bfcl_run):
    model, tokenizer = tiny
    batch, stats = bfcl_run
    turns = [(turn, trajectory, t) for trajectory in batch for t, turn in enumerate(trajectory.turns)]
    assert len(turns) == stats.turns > len(batch)
    # Sampled logprobs equal a teacher-forced recomputation on the stored ids (fp32, CPU).
    recomputed, mask = response_logprobs(
        model,
        [turn.context_ids for turn, _, _ in turns],
        [turn.response_ids for turn, _, _ in turns],
        pad_token_id=tokenizer.pad_token_id,
    )
    for row, (turn, _, _) in enumerate(turns):
        sampled = torch.tensor(turn.sample_logprobs)
        assert int(mask[row].sum()) == len(turn.response_ids) > 0
        assert (recomputed[row, : len(turn.response_ids)] - sampled).abs().max() < 1e-3
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for trajectory in batch:
        # Decoding the stored ids reproduces the text the env received (its own history says so).
        received = _assistant_contents(trajectory)
        assert len(received) == trajectory.num_turns
        for turn, text in zip(trajectory.turns, received):
            ids = turn.response_ids
            if turn.finish_reason == "stop" and ids[-1] == im_end:
                ids = ids[:-1]
            assert tokenizer.decode(ids) == text
        assert trajectory.info["actions"] == received
        # Each context extends the previous context + response (nothing re-tokenized).
        for before, after in zip(trajectory.turns, trajectory.turns[1:]):
            prefix = before.context_ids + before.response_ids
            assert after.context_ids[: len(prefix)] == prefix
        first_two = trajectory.info["messages"][:2]
        assert trajectory.turns[0].context_ids == encode(tokenizer, render_chat(tokenizer, first_two, add_generation_prompt=True))


def test_bfcl_batch_has_groups_ids_and_env_outcomes(bfcl_run):
    batch, stats = bfcl_run
    assert len(batch) == 4 and stats.episodes == 4
    groups = batch.groups()
    assert list(groups) == ["0:multi_turn_base_0", f"1:{batch.trajectories[2].task_id}"]
    assert all(len(members) == 2 and len({t.task_id for t in members}) == 1 for members in groups.values())
    drawn = f"1:{batch.trajectories[2].task_id}"
    assert [t.group_id for t in batch] == ["0:multi_turn_base_0"] * 2 + [drawn] * 2
    assert batch.rollout_ids == ["0:multi_turn_base_0:0", "0:multi_turn_base_0:1", f"{drawn}:0", f"{drawn}:1"]
    for trajectory in batch:
        assert 1 <= trajectory.num_turns <= 2
        env_info = trajectory.info["env_info"]
        assert env_info["task_id"] == trajectory.task_id
        assert trajectory.success == env_info["success"]
        assert trajectory.truncated == (trajectory.info["end"] == "truncated")
    # The tiny random model never finishes a BFCL task: every episode uses both turns, is truncated
    # at the turn limit and scores 0 (what a truncated episode scores here).
    assert [(t.info["end"], t.num_turns, t.reward) for t in batch] == [("truncated", 2, 0.0)] * 4


def test_same_seed_same_rollouts_on_bfcl(tiny, bfcl_run):
    model, tokenizer = tiny
    batch, _ = bfcl_run
    with VectorAgent(
        BFCL, HFBackend(model, tokenizer), tokenizer, num_envs=3,
        sampling=SamplingParams(max_new_tokens=10), env_kwargs={"max_turns": 2},
    ) as agent:
        again = agent.collect(["multi_turn_base_0", None], group_size=2, seed=11)
    for a, b in zip(batch, again):
        assert (a.rollout_id, a.task_id, a.reward, a.truncated) == (b.rollout_id, b.task_id, b.reward, b.truncated)
        assert [(t.context_ids, t.response_ids) for t in a.turns] == [(t.context_ids, t.response_ids) for t in b.turns]
    # The two rollouts of a group are different samples.
    first, second = batch.groups()["0:multi_turn_base_0"]
    assert first.turns[0].response_ids != second.turns[0].response_ids


def test_contexts_equal_full_chat_template_rendering_with_a_replaying_backend_instead_of_a_model(tiny):
    _, tokenizer = tiny
    backend = ReplayBackend(tokenizer, "<think>Nothing to call.</think>\nDone for now.")
    with VectorAgent(
        BFCL, backend, tokenizer, num_envs=1, sampling=SamplingParams(max_new_tokens=64), env_kwargs={"max_turns": 3}
    ) as agent:
        (trajectory,) = agent.collect(["multi_turn_base_1"], group_size=1, seed=0)
    messages = trajectory.info["messages"]
    assert trajectory.num_turns == 3
    for t, turn in enumerate(trajectory.turns):
        history = messages[: 2 + 2 * t]
        expected = encode(tokenizer, render_chat(tokenizer, history, add_generation_prompt=True))
        assert turn.context_ids == expected


def test_dropped_think_blocks_rebuild_the_context_from_messages_with_a_replaying_backend_instead_of_a_model(tiny):
    _, tokenizer = tiny
    backend = ReplayBackend(tokenizer, "<think>SECRET-REASONING</think>\nDone for now.")
    with VectorAgent(
        BFCL, backend, tokenizer, num_envs=1, sampling=SamplingParams(max_new_tokens=64),
        env_kwargs={"max_turns": 2, "keep_think": False},
    ) as agent:
        (trajectory,) = agent.collect(["multi_turn_base_1"], group_size=1, seed=0)
    first, second = trajectory.turns
    messages = trajectory.info["messages"]
    assert messages[2] == {"role": "assistant", "content": "Done for now."}
    # Turn 2 was conditioned on the stripped history, and its record holds exactly those ids.
    assert second.context_ids == encode(tokenizer, render_chat(tokenizer, messages[:4], add_generation_prompt=True))
    assert "SECRET-REASONING" not in tokenizer.decode(second.context_ids)
    assert "SECRET-REASONING" in tokenizer.decode(first.response_ids)


# ----------------------------------------------------------------------------- mechanics (scripted env)


def test_episodes_of_different_lengths_in_a_small_pool(tiny):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer)
    with scripted_agent(backend, tokenizer, num_envs=2, schedule="lockstep") as agent:
        batch = agent.collect(["t1", "t2", "t3", "t4"], group_size=1, seed=0)
    assert [t.task_id for t in batch] == ["t1", "t2", "t3", "t4"]
    assert [t.num_turns for t in batch] == [1, 2, 3, 3]
    assert [t.truncated for t in batch] == [False, False, False, True]
    assert all(t.reward == 1.0 and t.success for t in batch.trajectories[:3])
    assert batch.trajectories[3].reward == 0.0 and not batch.trajectories[3].success
    # Two slots, so at most two prompts per call and more calls than the longest episode.
    assert agent.last_stats.backend_calls > 3


def test_one_backend_call_per_step_holds_every_waiting_episode(tiny):
    _, tokenizer = tiny
    backend = ReplayBackend(tokenizer, "hello")
    with scripted_agent(backend, tokenizer, num_envs=6, schedule="lockstep") as agent:
        batch = agent.collect(["t1", "t2", "t3"], group_size=2, seed=0)
    assert [t.num_turns for t in batch] == [1, 1, 2, 2, 3, 3]
    # Six episodes start together; after each step the finished ones leave the batch.
    assert backend.batch_sizes == [6, 4, 2]
    assert agent.last_stats.backend_calls == 3


def test_seeds_decide_the_rollouts_and_async_envs_change_nothing(tiny):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer)

    def run(seed, vectorization="sync"):
        with scripted_agent(backend, tokenizer, num_envs=3, vectorization=vectorization) as agent:
            batch = agent.collect([None, "t2"], group_size=2, seed=seed)
        return [(t.task_id, [turn.response_ids for turn in t.turns]) for t in batch]

    first = run(5)
    assert first == run(5) == run(5, "async")
    assert first != run(6)
    # A None task is drawn once per group: both rollouts play the same task.
    assert first[0][0] == first[1][0]


def test_over_long_episodes_end_truncated_at_the_context_budget(tiny):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer)
    with scripted_agent(backend, tokenizer) as agent:
        start = len(agent.initial_context(ScriptedChatEnv().reset(options={"task_id": "t3"})[1]["messages"]))
    sampling = SamplingParams(max_new_tokens=6)
    with scripted_agent(backend, tokenizer, sampling=sampling, max_context_tokens=start + 6 + 4) as agent:
        (trajectory,) = agent.collect(["t3"], group_size=1, seed=0)
    assert trajectory.num_turns == 1
    assert trajectory.truncated and trajectory.reward == 0.0 and not trajectory.success
    assert trajectory.info["end"] == END_CONTEXT_BUDGET
    # The first turn's context was used whole, never cut.
    assert len(trajectory.turns[0].context_ids) == start
    with scripted_agent(backend, tokenizer, sampling=sampling, max_context_tokens=start + 5) as agent:
        (empty,) = agent.collect(["t3"], group_size=1, seed=0)
    assert empty.num_turns == 0 and empty.info["end"] == END_CONTEXT_BUDGET


def test_a_crashing_env_ends_its_episode_and_the_rest_go_on(tiny):
    _, tokenizer = tiny
    backend = ReplayBackend(tokenizer, "hello")
    with scripted_agent(backend, tokenizer, num_envs=2) as agent:
        batch = agent.collect(["boom", "t2"], group_size=2, seed=0)
    boom = batch.groups()["0:boom"]
    assert all(t.info["end"] == END_ENV_ERROR and t.truncated and t.reward == 0.0 for t in boom)
    assert "server died" in boom[0].info["error"]
    assert all(t.success and t.num_turns == 2 for t in batch.groups()["1:t2"])


def test_observation_delta_is_the_template_suffix(tiny):
    _, tokenizer = tiny
    delta = ChatDelta(tokenizer)
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "second"},
    ]
    whole = render_chat(tokenizer, messages, add_generation_prompt=True)
    head = render_chat(tokenizer, messages[:2], add_generation_prompt=True) + "reply"
    assert head + delta.text("second") == whole
    assert head + "<|im_end|>" + delta.text("second", closed_by="<|im_end|>") == whole


def test_bad_agent_settings_are_refused(tiny):
    _, tokenizer = tiny
    backend = ReplayBackend(tokenizer, "x")
    with pytest.raises(ValueError, match="max_context_tokens"):
        scripted_agent(backend, tokenizer, sampling=SamplingParams(max_new_tokens=100), max_context_tokens=50)
    with pytest.raises(ValueError, match="vectorization"):
        scripted_agent(backend, tokenizer, vectorization="processes")
    with scripted_agent(backend, tokenizer) as agent, pytest.raises(ValueError, match="group_size"):
        agent.collect(["t1"], group_size=0, seed=0)
