"""`seeupo/Remote-v0` against a hostile server (tests/hostile_env_server.py, a real process on
127.0.0.1): every answer is bounded before and after decompression and checked before the
caller sees it; anything else is a `RemoteEnvError`, which `VectorAgent.collect` ends as an env
error, never a crash."""

from __future__ import annotations

import contextlib
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("websockets")

import seeupo_gym  # noqa: E402,F401
from seeupo_gym.remote import RemoteEnv, RemoteEnvError, checked_step  # noqa: E402
from seeupo_gym.spaces import UnicodeText  # noqa: E402

SCRIPT = Path(__file__).with_name("hostile_env_server.py")


@pytest.fixture(scope="module")
def hostile_server():
    process = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        match = re.search(r"at (http://\S+)", line)
        assert match, f"the hostile server did not start: {line!r}"
        yield match.group(1)
    finally:
        process.kill()
        process.wait(timeout=30)


@pytest.fixture
def hostile(hostile_server):
    """`hostile(mode)`: the URL at which the hostile server plays `mode`."""
    return lambda mode: contextlib.nullcontext(f"{hostile_server}/{mode}")


def test_a_hostile_server_deflate_bomb_is_cut_at_the_message_bound(hostile):
    # 415 kB on the wire, 400 M characters inflated: the client stops inflating at its bound.
    with hostile("deflate_bomb") as url:
        env = RemoteEnv(url, max_message_bytes=1 << 20)
        start = time.monotonic()
        with pytest.raises(RemoteEnvError, match="lost the session"):
            env.reset(seed=0)
        assert time.monotonic() - start < 20
        env.close()


def test_a_hostile_server_gzip_description_bomb_is_refused_at_the_bound(hostile):
    with hostile("gzip_bomb") as url:
        with pytest.raises(RemoteEnvError, match="gzip body over 8388608 bytes once decompressed"):
            RemoteEnv(url)


@pytest.mark.parametrize("mode,match", [
    ("nan_reward", "reward nan; a reward is a finite number"),
    ("list_info", "info of type list, not a dict"),
    ("int_text", "observation of type int, not text"),
    ("string_done", "done='yes'"),
    ("long_text", "observation of 4097 characters, outside UnicodeText"),
])
def test_a_hostile_server_answer_of_the_wrong_shape_is_a_remote_env_error(hostile, mode, match):
    with hostile(mode) as url:
        env = RemoteEnv(url, env_id="seeupo/TurnBandit-v0", env_kwargs={"max_turns": 10})
        try:
            text, info = env.reset(seed=0)
            assert isinstance(text, str) and info["turn"] == 0  # resets are honest
            with pytest.raises(RemoteEnvError, match=re.escape(match)):
                env.step("A")
            assert env._ws is None  # the session is dropped: the next reset opens a new one
            assert env.reset(seed=1)[1]["turn"] == 0
        finally:
            env.close()


def test_the_vector_agent_ends_hostile_server_episodes_as_env_errors(hostile, tiny, one_torch_thread):
    from seeupo_gym.agents.backends import HFBackend, SamplingParams
    from seeupo_gym.agents.vector import END_ENV_ERROR, VectorAgent

    model, tokenizer = tiny
    for mode in ("list_info", "nan_reward"):
        with hostile(mode) as url:
            with VectorAgent("seeupo/TurnBandit-v0", HFBackend(model, tokenizer), tokenizer, num_envs=2,
                             sampling=SamplingParams(max_new_tokens=4), url=url) as agent:
                batch = agent.collect(["mixed-0-1", "mixed-0-2"], group_size=1, seed=0).trajectories
        assert [t.info["end"] for t in batch] == [END_ENV_ERROR] * 2
        assert all("RemoteEnvError" in t.info["error"] and t.reward == 0.0 for t in batch)


def test_the_honest_stand_in_plays_an_episode_so_the_failures_above_are_the_modes(hostile):
    with hostile("honest") as url:
        env = RemoteEnv(url)
        try:
            env.reset(seed=0)
            _, reward, terminated, truncated, info = env.step("A")
            assert math.isfinite(reward) and isinstance(info, dict) and not truncated
        finally:
            env.close()


def test_checked_step_takes_an_env_step_and_names_each_wrong_field():
    space = UnicodeText(10)
    assert checked_step(("ok", 1, False, True, {"a": "\ud800"}), space, "w") == ("ok", 1.0, False, True, {"a": "\\ud800"})
    for bad, match in [(("ok", math.inf, False, False, {}), "finite"), (("ok", True, False, False, {}), "finite"),
                       (("ok", 0.0, 1, False, {}), "terminated=1"), (("ok", 0.0, False, None, {}), "truncated=None"),
                       (("x" * 11, 0.0, False, False, {}), "11 characters"), ((b"ok", 0.0, False, False, {}), "bytes"),
                       (("ok", 0.0, False, False, {}, 1), "5-tuple")]:
        with pytest.raises(RemoteEnvError, match=match):
            checked_step(bad, space, "w")


@pytest.mark.parametrize("mode, match", [
    ("str_messages", "the env's message 3 is a str, not a dict"),
    ("str_tool_calls", "has tool_calls that are not a list of dicts"),
    ("reset_str_messages", "the env's message 0 is a str, not a dict"),
    ("reset_no_messages", "info['messages'] is a NoneType, not a list of messages"),
])
def test_a_hostile_servers_unreadable_messages_end_the_episode_as_an_env_error_not_the_collection(
        hostile, tiny, one_torch_thread, mode, match):
    from seeupo_gym.agents.backends import HFBackend, SamplingParams
    from seeupo_gym.agents.vector import END_ENV_ERROR, VectorAgent

    model, tokenizer = tiny
    with hostile(mode) as url:
        with VectorAgent("seeupo/TurnBandit-v0", HFBackend(model, tokenizer), tokenizer, num_envs=2,
                         sampling=SamplingParams(max_new_tokens=4), url=url) as agent:
            batch = agent.collect(["mixed-0-1", "mixed-0-2"], group_size=1, seed=0).trajectories
    assert [t.info["end"] for t in batch] == [END_ENV_ERROR] * 2
    assert all(re.search(f"EnvAnswerError: .*{re.escape(match)}", t.info["error"]) and t.reward == 0.0 for t in batch)
