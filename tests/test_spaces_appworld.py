"""`seeupo/AppWorld-v0` under async `gym.make_vec` with gymnasium's defaults (shared memory on):
text observations, non-ASCII and long ones, come back exactly as the env wrote them."""

import gymnasium as gym
import pytest

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.appworld import render_action

pytestmark = pytest.mark.appworld

NON_ASCII = "héllo 中文 😀"
LONG = "ü" * 5_000


@pytest.mark.slow  # two sandboxed AppWorld servers start: 45 s on a busy machine
def test_async_appworld_with_default_shared_memory_carries_non_ascii_and_long_text():
    envs = gym.make_vec("seeupo/AppWorld-v0", 2, vectorization_mode="async", split="mini")
    try:
        observations, infos = envs.reset(seed=[0, 1])
        for index, observation in enumerate(observations):
            assert infos["messages"][index][-1]["content"] in observation  # the task, whole
        code = (f"print({NON_ASCII!r})", f"print({LONG[0]!r} * {len(LONG)})")
        observations, *_ = envs.step(tuple(render_action(line) for line in code))
        assert NON_ASCII in observations[0]
        assert LONG in observations[1]
    finally:
        envs.close()
