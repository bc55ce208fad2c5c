"""`seeupo/Ray-v0`'s deadlines for an env that declares no step bound of its own: a step waits
`UNDECLARED_STEP_S + STEP_MARGIN_S` (60 s), not the reset's `timeout_s` (600 s), and an episode
the env does not end by its own `max_turns` is ended by the client. One local Ray instance."""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import pytest

ray = pytest.importorskip("ray")

import seeupo_gym  # noqa: E402,F401
import seeupo_gym.remote_ray as remote_ray  # noqa: E402
from seeupo_gym.remote import RemoteEnvError  # noqa: E402

KWARGS = {"variant": "easy", "num_tasks": 8, "max_turns": 2}
TESTS = {"runtime_env": {"env_vars": {"PYTHONPATH": os.path.dirname(__file__)}}}


@pytest.fixture(scope="module")
def local_ray():
    remote_ray.start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_an_env_without_its_own_step_bound_gets_the_undeclared_bound_not_the_reset_timeout(local_ray, monkeypatch):
    env = gym.make("seeupo/Ray-v0", env_id="seeupo/TurnBandit-v0", env_kwargs=KWARGS)
    try:  # before: 600 s, the reset's timeout_s
        assert env.unwrapped.timeout_s == 600 and env.unwrapped.step_timeout_s == 60.0
        assert env.unwrapped.max_turns == 2
    finally:
        env.close()
    monkeypatch.setattr(remote_ray, "UNDECLARED_STEP_S", 1.0)
    monkeypatch.setattr(remote_ray, "STEP_MARGIN_S", 1.0)
    env = gym.make("seeupo/Ray-v0", env_id="seeupo/TurnBandit-v0", env_kwargs=KWARGS)
    pid = ray.get(env.unwrapped.actor.describe.remote())["pid"]
    env.reset(seed=0)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(RemoteEnvError, match="did not answer step within 2 s; it was killed"):
            env.step("A")
        assert time.monotonic() - start < 15
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        env.close()


def test_an_episode_the_env_never_ends_is_ended_at_its_turn_limit(local_ray):
    env = gym.make("seeupo/Ray-v0", env_id="ray_never_ending_env:test/NeverEndingBandit-v0", env_kwargs=KWARGS,
                   actor_options=TESTS)
    try:
        env.reset(seed=0)
        assert env.step("nonsense")[2:4] == (False, False)
        with pytest.raises(RemoteEnvError, match=r"did not end the episode at its turn limit \(max_turns=2\)"):
            env.step("nonsense")
        env.reset(seed=1)  # the next episode starts afresh
        assert env.step("nonsense")[2:4] == (False, False)
    finally:
        env.close()
