"""seeupo-eval against a slow chat server moves its bar once per finished episode, not once per chunk
of tasks (6 minutes of `0/4` was what a user saw). The installed command in a subprocess, against a
real HTTP server that takes its time."""

from __future__ import annotations

import json
import time

from cli_helpers import ModelServer, chat_reply, run


def test_the_chat_mode_bar_moves_every_episode():
    def slow(body: dict) -> tuple[int, dict]:
        time.sleep(0.4)  # past tqdm's refresh interval: each step can show
        return chat_reply("A")

    with ModelServer(slow) as server:
        done = run("seeupo-eval", "--base-url", server.url + "/v1", "--model", "m", "--env", "seeupo/TurnBandit-v0",
                   "--env-kwargs", json.dumps({"variant": "easy", "num_tasks": 4, "turns": [1, 1], "max_turns": 1}),
                   "--concurrency", "1")  # one chunk of 4 tasks: before, the bar went 0/4 -> 4/4 at its end
    assert done.returncode == 0, done.stderr
    shown = done.stderr.replace("\r", "\n")
    assert all(f"| {i}/4 [" in shown for i in (1, 2, 3)), shown


def test_the_readme_tours_collect_prints_a_bar_that_moves_every_response(capsys):
    from seeupo_gym.agents import HFBackend, SamplingParams, VectorAgent, load_model

    model, tokenizer = load_model("tiny")
    with VectorAgent("seeupo/TurnBandit-v0", HFBackend(model, tokenizer), tokenizer, num_envs=4,
                     sampling=SamplingParams(max_new_tokens=4), env_kwargs={"variant": "easy", "max_turns": 2}) as agent:
        batch = agent.collect([None, None], group_size=2, seed=0, progress=True)
        again = agent.collect([None, None], group_size=2, seed=0)  # the bar leaves the agent as it was
    assert isinstance(agent.backend, HFBackend)
    assert [t.reward for t in batch] == [t.reward for t in again]
    shown = capsys.readouterr().err.replace("\r", "\n")
    assert "collect:" in shown and "1 response," in shown and "2 responses" in shown, shown


def test_the_chat_mode_bar_redraws_after_each_reply_of_one_long_episode():
    # One episode of four slow replies: before, the bar sat at 0/1 with no change until the episode ended.
    def slow(body: dict) -> tuple[int, dict]:
        time.sleep(0.4)
        return chat_reply("A")

    with ModelServer(slow) as server:
        done = run("seeupo-eval", "--base-url", server.url + "/v1", "--model", "m", "--env", "seeupo/TurnBandit-v0",
                   "--env-kwargs", json.dumps({"variant": "easy", "num_tasks": 1, "turns": [4, 4], "max_turns": 4}),
                   "--concurrency", "1")
    assert done.returncode == 0, done.stderr
    frames = [line for line in done.stderr.replace("\r", "\n").splitlines() if "| 0/1 [" in line]
    shown = "\n".join(frames)
    assert all(f"{label}]" in shown for label in ("1 reply", "2 replies", "3 replies")), done.stderr
