"""OpenAIBackend against a hostile model server (tests/hostile_model_server.py, real sockets on
127.0.0.1): replies dripped a byte at a time, slow episodes, and a server that echoes the request's
headers (the API key) into its replies and errors."""

from __future__ import annotations

import gzip
import json
import logging
import time
from pathlib import Path

import pytest

import seeupo_gym  # noqa: F401  registers the envs
from hostile_model_server import dripped_completion, start
from seeupo_gym.agents.backends import SamplingParams
from seeupo_gym.agents.backends.openai import OpenAIBackend, ServerReplyError


@pytest.fixture(scope="module")
def hostile():
    url, listener = start()
    yield url
    listener.close()


def test_a_reply_dripped_over_58_s_fails_at_the_attempts_deadline(hostile):
    assert len(dripped_completion()) == 146  # 146 bytes, one each 0.4 s: 58 s
    backend = OpenAIBackend(hostile + "/drip-0.4/v1", "m", api_key_env=None, timeout_s=2.0, retries=1)
    started = time.monotonic()
    try:
        with pytest.raises(ServerReplyError, match=r"no whole reply within 2(\.\d+)? s \(timeout_s=2\)"):
            backend.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    finally:
        backend.close()
    assert 1.9 < time.monotonic() - started < 4.0


def test_retries_of_a_dripped_reply_each_end_at_the_deadline(hostile):
    backend = OpenAIBackend(hostile + "/drip-0.4/v1", "m", api_key_env=None, timeout_s=1.0, retries=3, backoff_s=0.01)
    started = time.monotonic()
    try:
        with pytest.raises(ServerReplyError, match="gave up after 3 attempts"):
            backend.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    finally:
        backend.close()
    assert backend.requests_sent == 3 and time.monotonic() - started < 8.0  # 3 x 1 s and the backoff


def test_a_reply_dripped_inside_the_deadline_is_accepted(hostile):
    # The control: the same 146 bytes at 5 ms each (0.7 s) arrive whole within the deadline.
    backend = OpenAIBackend(hostile + "/drip-0.005/v1", "m", api_key_env=None, timeout_s=10.0, retries=1)
    try:
        (completion,) = backend.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    finally:
        backend.close()
    assert completion.token_ids == [1] and completion.logprobs == [-0.5]


def _chat_episode(url: str, **backend_kwargs):
    from seeupo_gym.agents.chat_agent import collect_chat

    backend = OpenAIBackend(url, "m", mode="chat", api_key_env=None, retries=1, **backend_kwargs)
    started = time.monotonic()
    try:
        batch = collect_chat(backend, "seeupo/TurnBandit-v0", ["mixed-0-1"], 1, seed=0,
                             sampling=SamplingParams(max_new_tokens=4), env_kwargs={"max_turns": 8})
    finally:
        backend.close()
    return batch.trajectories[0], time.monotonic() - started


def test_a_chat_episode_ends_at_its_episode_deadline_however_many_turns_are_left(hostile):
    # Each reply takes 0.4 s, well inside timeout_s; eight turns of them outlast the episode's 1.2 s.
    ended, elapsed = _chat_episode(hostile + "/slow-0.4/v1", timeout_s=5.0, episode_timeout_s=1.2)
    assert ended.info["end"] == "backend_error" and ended.reward == 0.0
    assert "episode_timeout_s" in ended.info["error"]
    assert elapsed < 4.0 and len(ended.info["actions"]) <= 3
    # The control: with time enough, the same episode plays its eight turns.
    played, elapsed = _chat_episode(hostile + "/slow-0.4/v1", timeout_s=5.0, episode_timeout_s=60.0)
    assert played.info["end"] == "truncated" and len(played.info["actions"]) == 8 and elapsed > 3.2


def test_the_api_key_a_server_echoes_reaches_no_error_info_log_or_rollouts_file(hostile, tmp_path, monkeypatch,
                                                                                   caplog, capsys):
    from seeupo_gym.training.cli import eval_main

    secret = "sk-live-0123456789abcdefXYZ"
    monkeypatch.setenv("SEEUPO_TEST_KEY", secret)
    rollouts, result = tmp_path / "rollouts.jsonl", tmp_path / "result.json"
    with caplog.at_level(logging.DEBUG):
        code = eval_main([
            "--base-url", hostile + "/echo/v1", "--model", "m", "--api-key-env", "SEEUPO_TEST_KEY",
            "--env", "seeupo/TurnBandit-v0", "--env-kwargs", json.dumps({"max_turns": 4}), "--tasks", "mixed-0-1",
            "-k", "1", "--rollouts", str(rollouts), "--out", str(result), "--no-progress",
        ])
    out = capsys.readouterr()
    assert code == 1 and "[redacted]" in out.err  # its one episode ended in the echoing 400, quoted there
    (record,) = [json.loads(line) for line in rollouts.read_text().splitlines()]
    # The server did echo it: turn 1's text and turn 2's error held the header, now redacted.
    assert record["actions"][0] == "I saw Bearer [redacted]"
    assert record["end"] == "backend_error"
    written = [rollouts.read_text(), result.read_text(), out.out, out.err, caplog.text]
    assert "[redacted]" in caplog.text  # the server check's warning names the "model" the server listed
    for text in written:
        assert secret not in text and secret[3:15] not in text
    assert "\\u0073\\u006b" not in out.err  # nor spelled in \u escapes


def test_the_key_a_server_echoes_in_an_error_never_reaches_the_exception_nor_the_episodes_info(hostile, monkeypatch):
    from seeupo_gym.agents.chat_agent import collect_chat

    secret = "sk-live-0123456789abcdefXYZ"
    monkeypatch.setenv("SEEUPO_TEST_KEY", secret)
    backend = OpenAIBackend(hostile + "/echo/v1", "m", mode="chat", api_key_env="SEEUPO_TEST_KEY", retries=1)
    history = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "U"}]
    try:
        reply = backend.chat(history[:1], SamplingParams(max_new_tokens=4))
        with pytest.raises(ServerReplyError) as raised:
            backend.chat(history, SamplingParams(max_new_tokens=4))
        (episode,) = collect_chat(backend, "seeupo/TurnBandit-v0", ["mixed-0-1"], 1, seed=0,
                                  sampling=SamplingParams(max_new_tokens=4)).trajectories
    finally:
        backend.close()
    assert episode.info["end"] == "backend_error" and "Bearer [redacted]" in episode.info["error"]
    assert secret not in json.dumps(episode.info)
    assert reply.content == "I saw Bearer [redacted]"
    message = str(raised.value)
    assert "HTTP 400" in message and secret not in message and secret[:12] not in message
    assert secret not in repr(raised.value) and secret not in repr(backend)


def test_a_short_placeholder_key_is_sent_and_left_in_replies(hostile, monkeypatch):
    # "EMPTY" (what local servers are given) is no secret: a reply that says it keeps it.
    monkeypatch.setenv("SEEUPO_TEST_KEY", "EMPTY")
    backend = OpenAIBackend(hostile + "/echo/v1", "m", mode="chat", api_key_env="SEEUPO_TEST_KEY", retries=1)
    try:
        reply = backend.chat([{"role": "user", "content": "U"}], SamplingParams(max_new_tokens=4))
    finally:
        backend.close()
    assert reply.content == "I saw Bearer EMPTY"


def test_the_logprob_floor_is_below_any_a_sampler_can_draw_and_keeps_sums_finite():
    import math

    import numpy as np

    from seeupo_gym.agents.backends.openai import LOGPROB_FLOOR

    assert LOGPROB_FLOOR < math.log(np.finfo(np.float64).smallest_subnormal)  # -744.4
    assert math.isfinite(float(np.float32(LOGPROB_FLOOR) * np.float32(2**20)))  # a million tokens at the floor


def test_a_training_run_on_a_server_that_echoes_the_key_writes_it_to_no_run_file_or_log(hostile, tmp_path, monkeypatch,
                                                                                        caplog, capsys, one_torch_thread):
    from trainer_helpers import tiny_config

    from seeupo_gym.training.trainer import Trainer

    secret = "sk-live-0123456789abcdefXYZ"
    monkeypatch.setenv("SEEUPO_TEST_KEY", secret)
    config = tiny_config(tmp_path, "train.steps=1", "env.kwargs={max_turns: 1}", "train.group_size=4",
                         "generation.backend=openai", f"generation.base_url={hostile}/echo/v1",
                         "generation.api_key_env=SEEUPO_TEST_KEY", f"generation.weights_dir={tmp_path}")
    with caplog.at_level(logging.DEBUG):
        with Trainer(config) as trainer:
            trainer.train()
    out = capsys.readouterr()
    run = tmp_path / "run"
    records = [json.loads(line) for line in gzip.open(run / "rollouts.jsonl.gz", "rt")]
    errors = [r for r in records if "error" in json.dumps(r)]
    assert errors and "[redacted]" in json.dumps(errors)  # the echoed 400s are recorded, the key in none
    for path in run.rglob("*"):
        if path.is_file():
            data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            assert secret.encode() not in data, path
    for text in (out.out, out.err, caplog.text):
        assert secret not in text


def test_a_reply_nested_as_deep_as_json_parses_is_a_clear_error_when_a_key_is_redacted(monkeypatch):
    import sys

    import httpx

    monkeypatch.setenv("SEEUPO_TEST_KEY", "sk-live-0123456789abcdefXYZ")
    backend = OpenAIBackend("http://model.invalid/v1", "m", mode="chat", api_key_env="SEEUPO_TEST_KEY", retries=1)
    def body(depth: int) -> bytes:
        return b'{"choices": [{"message": {"content": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}}]}"

    depth = sys.getrecursionlimit()
    while True:  # the deepest reply json.loads parses from here, less what the backend's calls take
        try:
            json.loads(body(depth))
            break
        except RecursionError:
            depth -= 10
    deep = body(depth - 60)
    # A mock transport stands in for the server (no deadline wrapper needed for a reply that is all there).
    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=httpx.ByteStream(deep)))
    backend._client = httpx.Client(transport=transport)
    try:
        with pytest.raises(ServerReplyError, match="nests too deep"):
            backend.chat([{"role": "user", "content": "U"}], SamplingParams(max_new_tokens=4))
    finally:
        backend.close()


def test_tool_call_arguments_nested_700_deep_end_the_request_not_the_collection():
    import httpx

    from seeupo_gym.agents.chat_agent import collect_chat

    arguments = "[" * 700 + "]" * 700  # parses; walking it (render_reply) would overflow the stack
    reply = {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}}]}
    backend = OpenAIBackend("http://model.invalid/v1", "m", mode="chat", api_key_env=None, retries=1)
    # A mock transport stands in for the server.
    backend._client = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, stream=httpx.ByteStream(json.dumps(reply).encode()))))
    try:
        (episode,) = collect_chat(backend, "seeupo/TurnBandit-v0", ["mixed-0-1"], 1, seed=0,
                                  sampling=SamplingParams(max_new_tokens=4),
                                  env_kwargs={"action_format": "tools"}).trajectories
    finally:
        backend.close()
    assert episode.info["end"] == "backend_error" and "nest deeper than 64 levels" in episode.info["error"]


def test_seeupo_eval_takes_the_episode_and_request_deadlines_from_its_flags(hostile, tmp_path, capsys):
    from seeupo_gym.training.cli import eval_main

    def evaluate(*flags: str) -> tuple[int, dict, str, float]:
        rollouts = tmp_path / f"rollouts{len(flags)}.jsonl"
        started = time.monotonic()
        code = eval_main([
            "--base-url", hostile + "/slow-0.4/v1", "--model", "m", "--api-key-env", "SEEUPO_UNSET_KEY",
            "--env", "seeupo/TurnBandit-v0", "--env-kwargs", json.dumps({"max_turns": 8}), "--tasks", "mixed-0-1",
            "-k", "1", "--rollouts", str(rollouts), "--no-progress", *flags,
        ])
        (record,) = [json.loads(line) for line in rollouts.read_text().splitlines()]
        return code, record, capsys.readouterr().err, time.monotonic() - started

    # Eight 0.4 s turns outlast an episode deadline of 1.2 s: the episode ends there, with its reason.
    code, record, said, elapsed = evaluate("--episode-timeout", "1.2")
    assert code == 1 and record["end"] == "backend_error" and "episode's deadline of 1.2 s" in said
    assert elapsed < 15.0
    # A request deadline below one reply's 0.4 s fails each request.
    code, record, said, _ = evaluate("--request-timeout", "0.1")
    assert code == 1 and record["end"] == "backend_error" and "(timeout_s=0.1)" in said
    # The control: the defaults let the eight turns play.
    code, record, _, _ = evaluate()
    assert code == 0 and record["end"] == "truncated" and len(record["actions"]) == 8
    for flag in ("--request-timeout", "--episode-timeout"):
        assert eval_main(["--base-url", hostile + "/v1", "--model", "m", flag, "0"]) == 2
        assert f"{flag} must be > 0" in capsys.readouterr().err


def test_training_generation_takes_its_request_deadline_from_the_config(hostile):
    from seeupo_gym.agents.backends import TrainingSetup
    from seeupo_gym.agents.models import load_tokenizer

    def backend(**options):  # a reply of 146 bytes, one each 5 ms: 0.7 s
        setup = TrainingSetup(model_name="m", dtype="float32", seed=0, lora_rank=0, max_context_tokens=512,
                              processes=1, sharded=False,
                              options={"base_url": hostile + "/drip-0.005/v1", "api_key_env": "SEEUPO_UNSET_KEY",
                                       **options})
        return OpenAIBackend.for_training(None, load_tokenizer("tiny"), setup)

    short = backend(request_timeout_s=0.2)
    try:
        with pytest.raises(ServerReplyError, match=r"\(timeout_s=0\.2\)"):
            short.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    finally:
        short.close()
    default = backend()  # the control: 300 s by default, and the reply arrives
    try:
        (completion,) = default.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    finally:
        default.close()
    assert default.timeout_s == 300.0 and completion.token_ids
