"""OpenAIBackend against a real HTTP server on 127.0.0.1 (tests/openai_server.py: the tiny model,
vLLM's token extensions, scripted chat replies, and injected faults)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import httpx
import pytest

import seeupo_gym  # noqa: F401  registers the envs
from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.backends.openai import OpenAIBackend, ServerReplyError
from seeupo_gym.agents.vector import END_BACKEND_ERROR, VectorAgent

SERVER = Path(__file__).with_name("openai_server.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path: Path, script: dict | None = None):
    port = _free_port()
    args = [sys.executable, str(SERVER), "--port", str(port)]
    if script is not None:
        path = tmp_path / f"script-{port}.json"
        path.write_text(json.dumps(script))
        args += ["--script", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(process.stderr.read().decode()[-2000:])
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the test server did not start")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, url = _start(tmp_path_factory.mktemp("openai"))
    yield url
    process.kill()
    process.wait()


def _fault(url: str, fault: str, count: int = 1) -> None:
    httpx.post(url + "/control", json={"fault": fault, "count": count}).raise_for_status()


def _backend(url: str, tokenizer, **kwargs) -> OpenAIBackend:
    kwargs.setdefault("backoff_s", 0.01)
    return OpenAIBackend(url + "/v1", "tiny", vocab_size=len(tokenizer), stop_token_ids=(tokenizer.eos_token_id,), **kwargs)


def test_tokens_mode_returns_what_the_in_process_backend_samples(server, tiny, one_torch_thread):
    model, tokenizer = tiny
    prompt = tokenizer("Hello there, pick an option", add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(max_new_tokens=8, seed=3)
    remote = _backend(server, tokenizer)
    try:
        (served,) = remote.generate([prompt], sampling)
    finally:
        remote.close()
    (local,) = HFBackend(model, tokenizer).generate([prompt], sampling)
    assert served.token_ids == local.token_ids
    assert served.logprobs == pytest.approx(local.logprobs, abs=1e-5)
    assert served.finish_reason == local.finish_reason


def test_tokens_mode_recorded_logprobs_are_the_learners_teacher_forced_logprobs(server, tiny, one_torch_thread):
    from seeupo_gym.agents.scoring import response_logprobs

    model, tokenizer = tiny
    prompt = tokenizer("Count to three:", add_special_tokens=False)["input_ids"]
    remote = _backend(server, tokenizer)
    try:
        (served,) = remote.generate([prompt], SamplingParams(max_new_tokens=12, seed=0))
    finally:
        remote.close()
    logprobs, mask = response_logprobs(model, [prompt], [served.token_ids], pad_token_id=tokenizer.pad_token_id)
    assert logprobs[0][mask[0]].tolist() == pytest.approx(served.logprobs, abs=1e-4)


@pytest.mark.parametrize("fault", ["429", "500", "timeout"])
def test_a_transient_failure_is_retried(server, tiny, fault):
    _, tokenizer = tiny
    remote = _backend(server, tokenizer, timeout_s=2.0, retries=3)
    try:
        _fault(server, fault, count=1)
        (completion,) = remote.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))
        assert len(completion.token_ids) >= 1
        assert remote.requests_sent == 2
    finally:
        remote.close()


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("bad_ids", "outside the vocabulary"),
        ("nan", "not a finite number"),
        ("tiny_logprob", r"not a finite number in \[-10000, 0\]: -1e\+308"),
        ("truncated", "not JSON"),
        ("huge", "byte bound"),
        ("gzip", "compressed"),
    ],
)
def test_a_bad_reply_ends_the_request_with_a_clear_error(server, tiny, fault, reason):
    _, tokenizer = tiny
    remote = _backend(server, tokenizer, retries=2, max_body_bytes=2**20)
    try:
        _fault(server, fault, count=1)
        started = time.monotonic()
        with pytest.raises(ServerReplyError, match=reason):
            remote.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))
        assert time.monotonic() - started < 20
        assert remote.requests_sent == 1  # not a transient failure: no retry
    finally:
        remote.close()


def test_a_server_that_keeps_failing_gives_up_after_its_retries(server, tiny):
    _, tokenizer = tiny
    remote = _backend(server, tokenizer, retries=2)
    try:
        _fault(server, "500", count=5)
        with pytest.raises(ServerReplyError, match="gave up after 2 attempts"):
            remote.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))
    finally:
        _fault(server, None, count=0)
        remote.close()


def test_a_bad_reply_ends_its_episode_and_the_collection_goes_on(server, tiny, one_torch_thread):
    _, tokenizer = tiny
    remote = _backend(server, tokenizer, retries=1)
    try:
        _fault(server, "bad_ids", count=1)
        with VectorAgent("seeupo/TurnBandit-v0", remote, tokenizer, num_envs=2,
                         sampling=SamplingParams(max_new_tokens=4), env_kwargs={"variant": "easy"}) as agent:
            batch = agent.collect([None, None], group_size=2, seed=0)
    finally:
        remote.close()
    ends = [t.info["end"] for t in batch]
    assert len(batch) == 4
    assert ends.count(END_BACKEND_ERROR) == 1
    failed = next(t for t in batch if t.info["end"] == END_BACKEND_ERROR)
    assert "outside the vocabulary" in failed.info["error"] and failed.reward == 0.0


def test_the_api_key_is_sent_but_never_shown(server, tiny, monkeypatch):
    _, tokenizer = tiny
    secret = "sk-test-5f1e2d3c4b5a"
    monkeypatch.setenv("SEEUPO_TEST_KEY", secret)
    remote = _backend(server, tokenizer, api_key_env="SEEUPO_TEST_KEY", retries=1)
    try:
        remote.set_policy_version(7)
        remote.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
        _fault(server, "500", count=1)
        with pytest.raises(ServerReplyError) as error:
            remote.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
    finally:
        remote.close()
    assert secret not in str(error.value) and secret not in repr(remote)
    last = httpx.get(server + "/log").json()[-2]
    assert last["authorized"] and last["policy_version"] == "7"


# ------------------------------------------------------------------------------------- chat mode


def _bfcl_script(task_id: str, correct: bool) -> tuple[str, list[dict]]:
    """Chat replies for one BFCL entry: its ground truth as tool calls (or one wrong call per turn),
    each user turn closed by a reply without calls."""
    from seeupo_gym.bfcl.data import get_entry
    from seeupo_gym.bfcl.env import render_tool_action
    from seeupo_gym.tools import parse_hermes

    entry = get_entry(task_id)
    replies: list[dict] = []
    for calls in entry.ground_truth:
        if calls:
            if correct:
                parsed = parse_hermes(render_tool_action(list(calls)).split("</think>")[-1])
                replies.append({"content": "", "tool_calls": [[c.name, dict(c.arguments)] for c in parsed.calls]})
            else:
                replies.append({"content": "", "tool_calls": [["ls", {}]]})
        replies.append({"content": "Done."})
    return entry.user_messages[0], replies


def test_eval_of_a_chat_model_scores_what_the_env_scores_for_the_same_responses(tmp_path, capsys):
    from seeupo_gym.training.cli import eval_main

    tasks = {"multi_turn_base_0": True, "multi_turn_base_1": False}
    script = dict(_bfcl_script(task_id, correct) for task_id, correct in tasks.items())
    process, url = _start(tmp_path, script)
    env_kwargs = {"action_format": "tools", "split": "all"}
    try:
        code = eval_main([
            "--base-url", url + "/v1", "--model", "scripted", "--env", "seeupo/BFCL-v4-v0",
            "--env-kwargs", json.dumps(env_kwargs), "--tasks", ",".join(tasks), "-k", "2",
            "--rollouts", str(tmp_path / "rollouts.jsonl"), "--out", str(tmp_path / "result.json"), "--no-progress",
        ])
    finally:
        process.kill()
        process.wait()
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4
    by_task = {t["task_id"]: t["mean_score"] for t in result["tasks"]}
    assert by_task == {"multi_turn_base_0": 1.0, "multi_turn_base_1": 0.0}
    for rollout in rollouts:  # the same actions, replayed in process, score the same
        env = gym.make("seeupo/BFCL-v4-v0", **env_kwargs)
        env.reset(options={"task_id": rollout["task_id"]})
        for action in rollout["actions"]:
            _, reward, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
        env.close()
        assert reward == rollout["reward"]


def test_chat_mode_renders_the_history_in_the_openai_format():
    from seeupo_gym.agents.chat_agent import openai_messages, render_reply

    history = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "cd", "arguments": {"folder": "a"}}},
            {"type": "function", "function": {"name": "ls", "arguments": {}}}]},
        {"role": "tool", "name": "cd", "content": "ok"},
        {"role": "tool", "name": "ls", "content": "x"},
    ]
    out = openai_messages(history)
    assert [m.get("tool_call_id") for m in out[3:]] == [out[2]["tool_calls"][0]["id"], out[2]["tool_calls"][1]["id"]]
    assert json.loads(out[2]["tool_calls"][0]["function"]["arguments"]) == {"folder": "a"}
    action = render_reply("\ud800hi", [("cd", {"folder": "\udfff"})], tools_format=True)
    action.encode("utf-8")  # valid Unicode whatever the server sent
    body = json.loads(action.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
    body["arguments"]["folder"].encode("utf-8")  # and still after the env's JSON parser


def test_eval_with_the_papers_protocol_runs_its_test_split_four_times_greedily(tmp_path, capsys):
    from seeupo_gym.training.cli import eval_main

    script = dict([_bfcl_script("multi_turn_base_100", True)])  # base_101 gets no calls: fails
    process, url = _start(tmp_path, script)
    try:
        code = eval_main([
            "--base-url", url + "/v1", "--model", "scripted", "--protocol", "paper", "--max-tasks", "2",
            "--env-kwargs", json.dumps({"action_format": "tools"}), "--out", str(tmp_path / "result.json"),
            "--no-progress",
        ])
        log = httpx.get(url + "/log").json()
    finally:
        process.kill()
        process.wait()
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["k"], result["n"], result["temperature"]) == (4, 4, 0.0)
    assert [t["task_id"] for t in result["tasks"]] == ["multi_turn_base_100", "multi_turn_base_101"]
    assert {entry["temperature"] for entry in log} == {0.0}
    assert "| scripted | 50.0 | 50.0 |" in capsys.readouterr().out


# ------------------------------------------------------------------------- training on a server


def test_a_lora_update_reaches_the_server_and_later_samples_come_from_it(server, tmp_path, one_torch_thread):
    import torch

    from seeupo_gym.agents.backends import TrainingSetup
    from seeupo_gym.agents.models import load_model
    from seeupo_gym.agents.scoring import response_logprobs

    model, tokenizer = load_model("tiny", seed=0, lora={"r": 4, "alpha": 8})
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # an adapter that matters (a fresh one is the identity)
    setup = TrainingSetup(model_name="tiny", dtype="float32", seed=0, lora_rank=4, max_context_tokens=512,
                          processes=1, sharded=False, options={"base_url": server + "/v1", "weights_dir": str(tmp_path)})
    backend = OpenAIBackend.for_training(model, tokenizer, setup)
    prompt = tokenizer("Pick A or B:", add_special_tokens=False)["input_ids"]
    try:
        backend.update_weights(model)
        (completion,) = backend.generate([prompt], SamplingParams(max_new_tokens=10, seed=4))
    finally:
        backend.close()
    with torch.no_grad():
        learner, mask = response_logprobs(model, [prompt], [completion.token_ids], pad_token_id=tokenizer.pad_token_id)
        with model.disable_adapter():
            base, _ = response_logprobs(model, [prompt], [completion.token_ids], pad_token_id=tokenizer.pad_token_id)
    assert learner[0][mask[0]].tolist() == pytest.approx(completion.logprobs, abs=1e-4)
    assert (learner - base).abs().max() > 0.01  # the samples came from the adapter, not the base
    log = httpx.get(server + "/log").json()
    load = [e for e in log if e["route"] == "load_lora_adapter"][-1]
    last = log[-1]
    assert load["lora_name"] == "policy-v1"
    assert (last["route"], last["model"], last["policy_version"]) == ("completions", "policy-v1", "1")


@pytest.mark.slow
def test_a_training_run_generates_on_the_server_and_pushes_each_versions_adapter(tmp_path, one_torch_thread):
    from trainer_helpers import tiny_config

    from seeupo_gym.training.trainer import Trainer

    process, url = _start(tmp_path)
    try:
        config = tiny_config(
            tmp_path, "model.lora={r: 4, alpha: 8}", "train.steps=3", "env.kwargs={max_turns: 1}", "optim.lr=1e-2",
            "generation.backend=openai", f"generation.base_url={url}/v1", f"generation.weights_dir={tmp_path}",
        )
        with Trainer(config) as trainer:
            records = trainer.train()
        log = httpx.get(url + "/log").json()
    finally:
        process.kill()
        process.wait()
    assert [r["step"] for r in records if "rollout/trajectories" in r] == [1.0, 2.0, 3.0]
    loads = [e["lora_name"] for e in log if e["route"] == "load_lora_adapter"]
    assert loads[:2] == ["policy-v1", "policy-v2"]
    assert [e["lora_name"] for e in log if e["route"] == "unload_lora_adapter"][:1] == (["policy-v1"] if len(loads) > 2 else [])
    versions = [(e["model"], e["policy_version"]) for e in log if e["route"] == "completions"]
    assert versions[0] == ("tiny", "0")
    assert ("policy-v1", "1") in versions and ("policy-v2", "2") in versions
    # Every request after an adapter load names that adapter: no sample comes from stale weights.
    seen = "0"
    for entry in log:
        if entry["route"] == "load_lora_adapter":
            seen = entry["lora_name"].removeprefix("policy-v")
        elif entry["route"] == "completions":
            assert entry["policy_version"] == seen
