"""Our envs through verl's own agent-loop machinery (seeupo_gym.integrations.verl), with verl 0.9.1.

verl's real `AgentLoopWorker` (built from verl's generated default config, the tiny model's tokenizer)
runs our registered "seeupo_env" loop on rows from `build_dataset`: its registry, hydra instantiation,
padding and `DataProto` assembly are verl's. Only the LLM server manager is a stand-in (verl's is a
Ray actor in front of vLLM/SGLang): one serves the tiny model through our HF backend, one replays
BFCL's ground truth as the model's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import re

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="needs verl 0.9.1 (make venv installs it with --no-deps)")

from omegaconf import OmegaConf  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from seeupo_gym.agents.backends import HFBackend, SamplingParams  # noqa: E402
from seeupo_gym.agents.chat import appended_text, render_chat  # noqa: E402
from seeupo_gym.agents.vector import ChatDelta, encode  # noqa: E402
from seeupo_gym.bfcl import get_entry, render_tool_action  # noqa: E402
from seeupo_gym.integrations.verl import AGENT_NAME, SeeupoAgentLoop, build_dataset, write_parquet  # noqa: E402

BFCL = "seeupo/BFCL-v4-base-v0"
TASKS = ["multi_turn_base_0", "multi_turn_base_1"]
TOOLS = {"action_format": "tools", "max_turns": 20}
RESPONSE_LENGTH = 4096
PROMPT_LENGTH = 8192  # BFCL's tools-format prompts are ~4.7k tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ServerStandIn:
    """verl's server manager's `generate` contract; subclasses say where the tokens come from."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int], dict]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        return self.answer(request_id, list(prompt_ids), sampling_params)


class TinyModelServer(ServerStandIn):
    """Serves the tiny model (random init) through our HF backend, up to 8 tokens a response."""

    def __init__(self, model, tokenizer) -> None:
        super().__init__()
        self.backend = HFBackend(model, tokenizer)

    def answer(self, request_id, prompt_ids, sampling_params):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=min(8, sampling_params["max_tokens"]), seed=len(self.calls))
        completion = self.backend.generate([prompt_ids], sampling)[0]
        return TokenOutput(token_ids=completion.token_ids, log_probs=completion.logprobs)


class ScriptedServer(ServerStandIn):
    """Replaces the model: the k-th answer of a request is script[k] tokenized + <|im_end|>, logprob -0.5
    per token. Which script: the one whose task's first user message is in the request's prompt."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]) -> None:
        super().__init__()
        self.tokenizer, self.scripts = tokenizer, scripts
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turn: dict[str, int] = {}
        self.task_of: dict[str, str] = {}

    def answer(self, request_id, prompt_ids, sampling_params):
        if request_id not in self.task_of:
            text = self.tokenizer.decode(prompt_ids)
            self.task_of[request_id] = next(t for t in self.scripts if get_entry(t).user_messages[0] in text)
        script = self.scripts[self.task_of[request_id]]
        k = self.turn.get(request_id, 0)
        self.turn[request_id] = k + 1
        ids = encode(self.tokenizer, script[min(k, len(script) - 1)]) + [self.im_end]
        ids = ids[: sampling_params["max_tokens"]]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids))


def ground_truth_script(task_id: str) -> list[str]:
    actions = []
    for calls in get_entry(task_id).ground_truth:
        if calls:
            actions.append(render_tool_action(list(calls)))
        actions.append("Done.")  # plain text ends the user turn
    return actions


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    """verl's AgentLoopWorker from verl's generated PPO config, model path = the tiny model."""
    import verl

    model, tokenizer = tiny
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = OmegaConf.load(pathlib.Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    config.actor_rollout_ref.model.path = str(folder)
    config.actor_rollout_ref.rollout.name = "vllm"
    config.actor_rollout_ref.rollout.prompt_length = PROMPT_LENGTH
    config.actor_rollout_ref.rollout.response_length = RESPONSE_LENGTH
    return AgentLoopWorker(config, llm_client=None)


def run_rows(worker, server, rows) -> DataProto:
    worker.llm_client = server
    non_tensors = {
        "raw_prompt": np.array([row["prompt"] for row in rows] + [None], dtype=object)[:-1],
        "agent_name": np.array([row["agent_name"] for row in rows], dtype=object),
        "data_source": np.array([row["data_source"] for row in rows], dtype=object),
        "extra_info": np.array([row["extra_info"] for row in rows], dtype=object),
        "index": np.array([row["extra_info"]["index"] for row in rows]),
    }
    batch = DataProto.from_dict(tensors={"dummy_tensor": torch.zeros(len(rows), 1, dtype=torch.uint8)},
                                non_tensors=non_tensors)
    return asyncio.run(worker.generate_sequences(batch))


def segments(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """[(mask value, ids), ...]: the runs of equal mask."""
    runs: list[tuple[int, list[int]]] = []
    for token, bit in zip(ids, mask):
        if runs and runs[-1][0] == bit:
            runs[-1][1].append(token)
        else:
            runs.append((bit, [token]))
    return runs


def unpadded(output: DataProto, row: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """(prompt ids, response ids, response mask, logprobs) of a row without verl's padding."""
    prompt_mask = output.batch["attention_mask"][row, : output.batch["prompts"].shape[1]].bool()
    response_attention = output.batch["attention_mask"][row, output.batch["prompts"].shape[1] :].bool()
    prompt = output.batch["prompts"][row][prompt_mask].tolist()
    response = output.batch["responses"][row][response_attention].tolist()
    mask = output.batch["response_mask"][row][response_attention].tolist()
    logprobs = output.batch["rollout_log_probs"][row][response_attention].tolist()
    return prompt, response, mask, logprobs


def replay_env_tokens(tokenizer, task_id: str, model_segments: list[list[int]], env_kwargs=TOOLS) -> tuple[list[int], list[list[int]]]:
    """What a fresh env, stepped with the decoded model segments, gives: the prompt's ids and the
    ids of each observation the template appends after a segment."""
    import gymnasium as gym

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    env = gym.make(BFCL, **env_kwargs)
    _, info = env.reset(options={"task_id": task_id})
    messages, tools = info["messages"], info["tools"]
    prompt = encode(tokenizer, render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools))
    closing = ChatDelta(tokenizer).closing
    observations = []
    for ids in model_segments:
        stopped = ids[-1] == im_end
        _, _, terminated, truncated, info = env.step(tokenizer.decode(ids[:-1] if stopped else ids))
        if terminated or truncated:
            break
        following = info["messages"][len(messages) + 1 :]
        messages = info["messages"]
        observations.append(encode(tokenizer, appended_text(tokenizer, closing, following,
                                                            closed_by="<|im_end|>" if stopped else "")))
    env.close()
    return prompt, observations


def test_the_loop_is_registered_under_its_name_for_verls_registry():
    assert _agent_loop_registry[AGENT_NAME] == {"_target_": "seeupo_gym.integrations.verl.SeeupoAgentLoop"}
    assert SeeupoAgentLoop.__module__ == "seeupo_gym.integrations.verl"


def test_dataset_rows_are_verls_columns_and_round_trip_through_parquet(tmp_path):
    import pandas as pd

    rows = build_dataset(BFCL, TASKS, **TOOLS)
    assert [row["extra_info"]["task_id"] for row in rows] == TASKS
    assert [row["extra_info"]["index"] for row in rows] == [0, 1]
    first = rows[0]
    assert first["agent_name"] == "seeupo_env" and first["data_source"] == BFCL
    assert [m["role"] for m in first["prompt"]] == ["system", "user"]
    assert first["prompt"][1]["content"] == get_entry(TASKS[0]).user_messages[0]
    assert json.loads(first["extra_info"]["env_kwargs"]) == TOOLS
    write_parquet(rows, str(tmp_path / "train.parquet"))
    back = pd.read_parquet(tmp_path / "train.parquet")
    assert list(back["agent_name"]) == ["seeupo_env"] * 2
    assert back["extra_info"][1]["task_id"] == TASKS[1] and back["prompt"][0][1]["role"] == "user"



def test_dataset_of_a_split_is_the_envs_split_and_says_so():
    from seeupo_gym.bfcl.data import task_ids

    rows = build_dataset(BFCL, split="test", action_format="tools")
    assert [row["extra_info"]["task_id"] for row in rows] == list(task_ids(("base",), "test"))
    assert {row["extra_info"]["split"] for row in rows} == {"test"}
    assert json.loads(rows[0]["extra_info"]["env_kwargs"]) == {"split": "test", "action_format": "tools"}


def test_ground_truth_through_verls_worker_scores_one_with_env_tokens_masked(worker, tiny):
    _, tokenizer = tiny
    scripts = {task: ground_truth_script(task) for task in TASKS}
    server = ScriptedServer(tokenizer, scripts)
    output = run_rows(worker, server, build_dataset(BFCL, TASKS, **TOOLS))
    scores = output.batch["rm_scores"].sum(dim=1).tolist()
    assert scores == [1.0, 1.0]
    assert list(output.non_tensor_batch["env_end"]) == ["terminated", "terminated"]
    for row, task in enumerate(TASKS):
        prompt, response, mask, logprobs = unpadded(output, row)
        runs = segments(response, mask)
        model_runs = [ids for bit, ids in runs if bit == 1]
        env_runs = [ids for bit, ids in runs if bit == 0]
        # The model's tokens are exactly what the stand-in sampled, in order, logprobs kept; env tokens 0.0.
        im_end = server.im_end
        assert model_runs == [encode(tokenizer, action) + [im_end] for action in scripts[task]]
        assert [lp for lp, bit in zip(logprobs, mask) if bit] == [-0.5] * sum(mask)
        assert all(lp == 0.0 for lp, bit in zip(logprobs, mask) if not bit)
        # The prompt and every observation are what a fresh env gives for these actions, rendered
        # by the chat template (tools included), and the turns alternate model/env, ending on the model.
        expected_prompt, observations = replay_env_tokens(tokenizer, task, model_runs)
        assert prompt == expected_prompt and '"name": "cd"' in tokenizer.decode(prompt)
        assert env_runs == observations and runs[0][0] == 1 and runs[-1][0] == 1
        assert "<tool_response>" in tokenizer.decode(env_runs[0])
    # Each request extends the previous one: prompt + everything so far (token-in/token-out).
    for request_id in {call[0] for call in server.calls}:
        prompts = [ids for rid, ids, _ in server.calls if rid == request_id]
        assert all(later[: len(earlier)] == earlier for earlier, later in zip(prompts, prompts[1:]))


def test_tiny_model_rollouts_record_exactly_the_sampled_tokens_and_the_envs_observations(worker, tiny):
    model, tokenizer = tiny
    server = TinyModelServer(model, tokenizer)
    three_turns = {**TOOLS, "max_turns": 3}
    rows = build_dataset(BFCL, TASKS, **three_turns)
    output = run_rows(worker, server, rows)
    assert output.batch["rm_scores"].sum().item() == 0.0  # a random model solves nothing
    assert list(output.non_tensor_batch["env_end"]) == ["truncated", "truncated"]
    for row, task in enumerate(TASKS):
        prompt, response, mask, logprobs = unpadded(output, row)
        calls = [c for c in server.calls if tokenizer.decode(c[1]).count(get_entry(task).user_messages[0])]
        assert len(calls) == 3 and calls[0][1] == prompt
        runs = segments(response, mask)
        model_runs = [ids for bit, ids in runs if bit == 1]
        # What the server returned is what the sample records, and each next request is prompt + response so far.
        for k, (_, request, params) in enumerate(calls):
            assert request == prompt + response[: len(request) - len(prompt)]
            assert params["max_tokens"] == RESPONSE_LENGTH - (len(request) - len(prompt))
        assert len(model_runs) == 3
        _, observations = replay_env_tokens(tokenizer, task, model_runs, three_turns)
        assert [ids for bit, ids in runs if bit == 0] == observations


# ------------------------------------------------------------------------------------ red team


class HostileServer(ServerStandIn):
    """Replaces the model with hostile text: code in tool names and arguments, a lone surrogate, an
    unparseable block, then a response that fills max_tokens."""

    def __init__(self, tokenizer, marker: pathlib.Path) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.script = [
            '<tool_call>{"name": "__import__(\'os\').system(\'touch ' + str(marker) + '\')", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "cd", "arguments": {"folder": "__import__(\'os\').system(\'touch ' + str(marker) + '\')"}}</tool_call>',
            '<tool_call>{"name": "cd", "arguments": {"folder": "\\ud800"}}</tool_call>',
            "<tool_call>{" + "[" * 5000,
        ]
        self.turn: dict[str, int] = {}

    def answer(self, request_id, prompt_ids, sampling_params):
        k = self.turn.get(request_id, 0)
        self.turn[request_id] = k + 1
        if k < len(self.script):
            ids = encode(self.tokenizer, self.script[k])[: sampling_params["max_tokens"]]
        else:  # as long as allowed, never stopping
            ids = [self.tokenizer.convert_tokens_to_ids("a")] * sampling_params["max_tokens"]
        return TokenOutput(token_ids=ids, log_probs=[-1.0] * len(ids))


def test_hostile_model_text_runs_nothing_scores_zero_and_stays_inside_response_length(worker, tiny, tmp_path):
    _, tokenizer = tiny
    marker = tmp_path / "pwned"
    output = run_rows(worker, HostileServer(tokenizer, marker), build_dataset(BFCL, TASKS[:1], **TOOLS))
    assert not marker.exists()
    assert output.batch["rm_scores"].sum().item() == 0.0
    assert output.non_tensor_batch["env_end"][0] == "response_length"  # the last response filled the budget
    _, response, mask, _ = unpadded(output, 0)
    assert len(response) == RESPONSE_LENGTH and mask[-1] == 1
    observations = [ids for bit, ids in segments(response, mask) if bit == 0]
    texts = [tokenizer.decode(ids) for ids in observations]
    assert len(texts) == 4 and all("error" in text.lower() for text in texts)
    assert "is not an available tool" in texts[0] and "not closed with </tool_call>" in texts[3]
    assert "\\ud800" in texts[2]  # the lone surrogate comes back escaped, never raw


class DishonestServer(ServerStandIn):
    def __init__(self, answer) -> None:
        super().__init__()
        self._answer = answer

    def answer(self, request_id, prompt_ids, sampling_params):
        return self._answer(sampling_params)


@pytest.mark.parametrize("reply, message", [
    (lambda p: TokenOutput(token_ids=[10**9]), "outside the tokenizer's vocabulary"),
    (lambda p: TokenOutput(token_ids=[-1]), "outside the tokenizer's vocabulary"),
    (lambda p: TokenOutput(token_ids=[1] * (p["max_tokens"] + 1)), "tokens for max_tokens"),
    (lambda p: TokenOutput(token_ids=[1, 2], log_probs=[0.0]), "1 logprobs for 2 tokens"),
])
def test_a_server_reply_that_cannot_be_what_was_asked_is_a_clear_error(worker, reply, message):
    with pytest.raises(ValueError, match=message):
        run_rows(worker, DishonestServer(reply), build_dataset(BFCL, TASKS[:1], **TOOLS))


@contextlib.contextmanager
def loop_config(**options):
    """A registered agent name whose loop gets `options`, as verl's agent-loop YAML gives them (the
    trainer's config: the only place a url, workers or config-only env kwargs may come from)."""
    name = f"seeupo_env_test_{len(_agent_loop_registry)}"
    _agent_loop_registry[name] = {"_target_": "seeupo_gym.integrations.verl.SeeupoAgentLoop", **options}
    try:
        yield name
    finally:
        del _agent_loop_registry[name]


def test_a_dead_env_server_ends_the_sample_as_an_env_error_not_the_batch(worker, tiny):
    import socket

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rows = build_dataset(BFCL, TASKS[:1], **TOOLS) * 2
    _, tokenizer = tiny
    with loop_config(url=f"http://127.0.0.1:{port}") as served:
        rows[1] = {**rows[1], "agent_name": served}
        output = run_rows(worker, ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])}), rows)
    assert list(output.non_tensor_batch["env_end"]) == ["terminated", "env_error"]
    assert output.batch["rm_scores"].sum(dim=1).tolist() == [1.0, 0.0]
    assert "RemoteEnvError" in output.non_tensor_batch["env_error"][1]


@pytest.mark.parametrize("extra_info, message", [
    ({"env_id": BFCL}, "extra_info.task_id"),
    ({"task_id": "multi_turn_base_0", "env_id": "os.system"}, "as its env, not 'os.system'"),
    ({"task_id": "multi_turn_base_0", "env_id": BFCL, "env_kwargs": "[1, 2]"}, "JSON object"),
])
def test_a_malformed_row_ends_its_own_sample_with_a_clear_error_not_the_batch(worker, tiny, extra_info, message):
    _, tokenizer = tiny
    good = build_dataset(BFCL, TASKS[:1], **TOOLS)[0]
    bad = {**good, "extra_info": {"index": 1, **extra_info}}
    output = run_rows(worker, ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])}), [good, bad])
    assert list(output.non_tensor_batch["env_end"]) == ["terminated", "bad_row"]
    assert message in output.non_tensor_batch["env_error"][1]
    assert output.batch["rm_scores"].sum(dim=1).tolist() == [1.0, 0.0]


def test_a_prompt_over_prompt_length_is_a_zero_score_sample_of_verls_width(worker):
    rollout = worker.config.actor_rollout_ref.rollout
    rollout.prompt_length, worker.rollout_config.prompt_length = 1000, 1000
    try:
        output = run_rows(worker, DishonestServer(lambda p: pytest.fail("no request for an overlong prompt")),
                          build_dataset(BFCL, TASKS[:1], **TOOLS))
    finally:
        rollout.prompt_length, worker.rollout_config.prompt_length = PROMPT_LENGTH, PROMPT_LENGTH
    assert output.non_tensor_batch["env_end"][0] == "prompt_length"
    assert output.batch["prompts"].shape[1] == 1000 and output.batch["attention_mask"][0, :1000].all()
    assert output.batch["rm_scores"].sum().item() == 0.0 and output.batch["response_mask"].sum().item() == 0


def test_an_env_that_never_answers_ends_its_sample_at_the_loops_env_deadline(worker):
    """The env is a seeupo/Remote-v0 whose server accepts connections and never answers; the loop's
    `env_timeout_s` comes from its registry entry, as verl's agent-loop YAML gives it."""
    import socket
    import threading
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    threading.Timer(5.0, silent.close).start()  # then the blocked connect fails and its thread ends
    row = build_dataset(BFCL, TASKS[:1], **TOOLS)[0]
    start = time.monotonic()
    with loop_config(env_timeout_s=1.0, url=f"http://127.0.0.1:{port}") as deadline:
        output = run_rows(worker, DishonestServer(lambda p: pytest.fail("no request without an env")),
                          [{**row, "agent_name": deadline}])
    assert time.monotonic() - start < 30
    assert output.non_tensor_batch["env_end"][0] == "env_error"
    # the loop's clock or the client's (its connect_timeout_s is the loop's env_timeout_s), whichever says it first
    assert re.search(r"took longer than 1.0 s|within connect_timeout_s=1 s", output.non_tensor_batch["env_error"][0])
    assert output.batch["rm_scores"].sum().item() == 0.0


def test_a_response_mask_of_more_runs_than_the_turn_cap_is_refused_not_a_pool_update_each():
    from seeupo_gym.integrations.verl.seeupo import MAX_TURNS, mask_runs

    alternating = torch.tensor([1, 0] * 5000)  # 5,000 one-token "turns"
    with pytest.raises(ValueError, match=f"row 3: 5000 runs of response_mask 1 \\(turns\\), more than {MAX_TURNS}"):
        mask_runs(alternating, 3)
    assert len(mask_runs(torch.tensor([1, 0] * MAX_TURNS))) == MAX_TURNS


def test_env_text_is_tokenized_off_the_event_loop(worker, tiny, monkeypatch):
    """A 25 MB served observation took 38 s of the worker's event loop; now every env text is
    tokenized in a thread (and bounded first: `max_observation_chars`)."""
    import threading

    import seeupo_gym.integrations.verl as loop_module

    _, tokenizer = tiny
    threads = []

    def recording_encode(tok, text):
        threads.append(threading.current_thread() is threading.main_thread())
        return encode(tok, text)

    monkeypatch.setattr(loop_module, "encode", recording_encode)
    output = run_rows(worker, ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])}),
                      build_dataset(BFCL, TASKS[:1], **TOOLS))
    assert output.non_tensor_batch["env_end"][0] == "terminated"
    assert threads and not any(threads)  # the prompt and every observation, none on the loop's thread
