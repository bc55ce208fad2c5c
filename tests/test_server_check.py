"""A dead or mistyped model server fails before any episode, in one line; episodes a live server
fails are counted and named, and a run where all of them failed exits non-zero. Every test runs
the installed command in a subprocess against a real port."""

from __future__ import annotations

import json
import time

from cli_helpers import ModelServer, chat_reply, command, dead_port, quiet_env

import subprocess

TURNBANDIT = ["--env", "seeupo/TurnBandit-v0", "--env-kwargs", json.dumps({"variant": "easy", "num_tasks": 2, "turns": [1, 1], "max_turns": 1})]


def test_a_dead_port_fails_every_command_in_one_line_naming_the_url_before_any_episode(tmp_path):
    url = f"http://127.0.0.1:{dead_port()}/v1"
    commands = {
        "seeupo-eval": ["--base-url", url, "--model", "m", *TURNBANDIT, "--no-progress"],
        "seeupo-compare": ["--model", f"a=m@{url}", "--env", "seeupo/TurnBandit-v0", "--out", str(tmp_path / "cmp")],
        "seeupo-compare ": ["--config", "tiny-turnbandit", "--algorithms", "grpo", "generation.backend=openai",
                            f"generation.base_url={url}", "--out", str(tmp_path / "cmp-train")],
        "seeupo-train": ["--config", "tiny-turnbandit", "--out", str(tmp_path / "train"), "generation.backend=openai",
                         f"generation.base_url={url}"],
    }
    started = time.perf_counter()
    running = {name: subprocess.Popen([command(name.strip()), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=quiet_env()) for name, args in commands.items()}
    for name, process in running.items():
        out, err = process.communicate(timeout=180)
        last = err.strip().splitlines()[-1]
        assert process.returncode == 2, (name, err)
        assert last.startswith(f"{name.strip()}: ") and url in last and "Connection refused" in last, (name, err)
        assert "Traceback" not in err and "avg@" not in out, (name, out, err)
    assert time.perf_counter() - started < 120  # not ~5 s of retries per episode
    assert not (tmp_path / "train" / "metrics.jsonl").exists()
    assert not (tmp_path / "cmp" / "a").exists() and not (tmp_path / "cmp-train" / "grpo").exists()


def test_a_url_without_its_v1_path_is_named_with_the_fix():
    with ModelServer(lambda body: chat_reply("A")) as server:
        done = subprocess.run([command("seeupo-eval"), "--base-url", server.url, "--model", "m", *TURNBANDIT,
                               "--no-progress"], capture_output=True, text=True, timeout=120, env=quiet_env())
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert server.url in last and "HTTP 404" in last and "/v1" in last, done.stderr
    assert server.requests == 0  # no episode started


def test_episodes_the_server_fails_are_counted_and_named_and_a_run_where_all_failed_exits_non_zero(tmp_path):
    def every_other(body: dict) -> tuple[int, dict]:
        every_other.calls += 1
        return (400, {"error": "bad request"}) if every_other.calls % 2 else chat_reply("A")

    every_other.calls = 0
    runs = {}
    for name, chat in (("all", lambda body: (400, {"error": "bad request"})), ("half", every_other)):
        with ModelServer(chat) as server:
            runs[name] = subprocess.run(
                [command("seeupo-eval"), "--base-url", server.url + "/v1", "--model", "m", *TURNBANDIT, "--concurrency",
                 "1", "-k", "1", "--out", str(tmp_path / f"{name}.json"), "--no-progress"],
                capture_output=True, text=True, timeout=120, env=quiet_env())
    every = runs["all"]
    assert every.returncode == 1, every.stderr
    assert "every episode (2) ended with backend_error" in every.stderr and "HTTP 400" in every.stderr
    assert "2 of 2 episodes ended with backend_error" in every.stderr
    result = json.loads((tmp_path / "all.json").read_text())
    assert result["backend_errors"] == 2 and len(result["backend_error_episodes"]) == 2
    assert all(name in every.stderr for name in (e.split(":")[0] for e in result["backend_error_episodes"]))

    half = runs["half"]
    assert half.returncode == 0, half.stderr  # a score that measures the model, with the failures named
    assert "1 of 2 episodes ended with backend_error" in half.stderr
    named = json.loads((tmp_path / "half.json").read_text())["backend_error_episodes"]
    assert len(named) == 1 and named[0].split(": ")[0] in half.stderr


def test_hostile_replies_to_the_check_through_a_mock_transport_end_in_one_line_or_pass_never_raw():
    """The check's door: whatever a server answers to GET /models (a bomb, deep nesting, non-JSON,
    wrong shapes, names with terminal escapes) is a one-line error or a pass, read within bounds."""
    import logging

    import httpx

    from seeupo_gym.agents.backends.openai import OpenAIBackend
    from seeupo_gym.agents.backends.server_check import ServerCheckError, check_server

    replies = {
        "bomb": (200, b'{"data": [' + b'{"id": "x"},' * 500_000 + b'{"id": "m"}]}'),
        "deep": (200, b"[" * 100_000 + b"]" * 100_000),
        "not json": (200, b"\x00\xff<html>"),
        "list": (200, b'[1, 2]'),
        "escape": (200, json.dumps({"data": [{"id": "\x1b[2J\x1b]0;pwned\x07"}]}).encode()),
        "teapot": (418, b"{}"),
        "auth": (401, b"{}"),
    }
    for name, (status, body) in replies.items():
        transport = httpx.MockTransport(lambda request, status=status, body=body: httpx.Response(status, stream=httpx.ByteStream(body)))
        backend = OpenAIBackend("http://user:secret@127.0.0.1:9/v1", "m", mode="chat")
        backend._client = httpx.Client(transport=transport)  # the server's bytes, replayed without a socket
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        logging.getLogger("seeupo_gym.agents.backends.server_check").addHandler(handler)
        try:
            check_server(backend)
            outcome = ""
        except ServerCheckError as error:
            outcome = str(error)
        finally:
            logging.getLogger("seeupo_gym.agents.backends.server_check").removeHandler(handler)
            backend.close()
        text = outcome + "".join(records)
        assert "\n" not in outcome and "secret" not in text and "\x1b" not in text, (name, text)
        assert bool(outcome) == (status != 200), (name, outcome)
