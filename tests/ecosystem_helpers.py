"""What the NeMo Gym and verifiers runner tests share: the scripted model's replies (BFCL ground
truth from bfcl-eval's possible_answer entries, an unsolved episode, hostile text, TurnBandit
answers), the local replay they are compared with, and the scripted OpenAI-compatible server."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import gymnasium as gym
import httpx

import seeupo_gym  # noqa: F401
from seeupo_gym.bfcl import get_entry, render_action, render_turn_end
from serve_helpers import repo_root

GROUND_TRUTH_TASK = "multi_turn_base_0"
UNSOLVED_TASK = "multi_turn_base_1"   # the model only ever says "Done." (the fake server's default)
HOSTILE_TASK = "multi_turn_base_2"
TURNBANDIT_SEEDS = (0, 1)
# The BFCL server requires a token (as off loopback): the runners send $SEEUPO_SERVE_TOKEN.
TOKEN = {"SEEUPO_SERVE_TOKEN": "ecosystems-test-token"}
# Code a runner must never run: each would leave its marker file if anything evaluated it.
HOSTILE_REPLIES = (
    "<think></think>\n[__import__('os').system('touch {marker}')]",
    "<think>x</think>\n[eval(\"open('{marker}', 'w')\")]",
    '{{"type": "reset", "data": {{"task_id": "multi_turn_base_0"}}}}',
    "<think></think>\n[cd(folder=__import__('pathlib').Path('{marker}').touch())]",
)


def ground_truth_replies(task_id: str) -> list[str]:
    """The task's ground-truth calls, one response per user turn, each followed by the turn's end."""
    replies = []
    for calls in get_entry(task_id).ground_truth:
        if calls:
            replies.append(render_action(list(calls)))
        replies.append(render_turn_end())
    return replies


def first_user_message(env_id: str, **reset: Any) -> str:
    env = gym.make(env_id)
    try:
        seed = reset.pop("seed", None)
        _, info = env.reset(seed=seed, options=reset or None)
        return next(m["content"] for m in info["messages"] if m["role"] == "user")
    finally:
        env.close()


def local_return(env_id: str, replies: list[str], **reset: Any) -> float:
    """The episode's return in a local env, the replies played in order ("Done." once they run out,
    as the fake server answers)."""
    env = gym.make(env_id)
    try:
        seed = reset.pop("seed", None)
        env.reset(seed=seed, options=reset or None)
        total, turn = 0.0, 0
        while True:
            _, reward, terminated, truncated, _ = env.step(replies[turn] if turn < len(replies) else "Done.")
            total, turn = total + float(reward), turn + 1
            if terminated or truncated:
                return total
    finally:
        env.close()


def turnbandit_replies(seed: int) -> list[str]:
    return ["<think></think>\n" + "ABC"[(seed + k) % 3] for k in range(8)]


def marker_of(text: str) -> str:
    return text[:120]


def script(marker_dir: Path) -> dict[str, list[dict[str, str]]]:
    """The fake server's replies, keyed by each episode's first user message."""
    hostile = [reply.format(marker=marker_dir / f"pwned-{k}") for k, reply in enumerate(HOSTILE_REPLIES)]
    bfcl = "seeupo/BFCL-v4-v0"
    out = {
        marker_of(first_user_message(bfcl, task_id=GROUND_TRUTH_TASK)): ground_truth_replies(GROUND_TRUTH_TASK),
        marker_of(first_user_message(bfcl, task_id=HOSTILE_TASK)): hostile * 4,
    }
    for seed in TURNBANDIT_SEEDS:
        out[marker_of(first_user_message("seeupo/TurnBandit-v0", seed=seed))] = turnbandit_replies(seed)
    return {marker: [{"content": reply} for reply in replies] for marker, replies in out.items()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def scripted_openai_server(script_json: dict, tmp: Path) -> Iterator[str]:
    """tests/openai_server.py answering from `script_json` on 127.0.0.1; yields its /v1 URL."""
    path = tmp / "script.json"
    path.write_text(json.dumps(script_json))
    port = free_port()
    log = open(tmp / "openai_server.log", "w")
    process = subprocess.Popen([sys.executable, str(repo_root() / "tests" / "openai_server.py"), "--port", str(port),
                                "--script", str(path)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp / "openai_server.log").read_text()[-2000:]
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.kill()
        process.wait(timeout=30)
        log.close()


def appworld_ground_truth_script(task_id: str) -> dict:
    """Under the served model name `appworld-ground-truth`, every conversation gets the task's
    ground-truth solution as its one response (the empty marker matches any first message)."""
    from seeupo_gym.appworld import find_data_dir, render_action

    solution = (find_data_dir("mini") / "tasks" / task_id / "ground_truth" / "solution.py").read_text()
    return {"appworld-ground-truth": {"": [{"content": render_action(solution)}]}}
