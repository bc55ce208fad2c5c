import copy

import pytest
from gymnasium.spaces import Tuple
from gymnasium.vector.utils import batch_space

from seeupo_gym.spaces import UnicodeText


def test_accepts_any_unicode_string_within_the_bound():
    space = UnicodeText(100)
    for text in ["", "plain", "<think>x</think>\n```python\nprint('hi')\n```", "中文 😀 Ω \x00 \ufffd"]:
        assert space.contains(text), text


def test_rejects_over_long_strings_and_non_strings():
    space = UnicodeText(5, min_length=1)
    assert not space.contains("123456")
    assert not space.contains("")
    assert not space.contains(b"bytes")
    assert not space.contains(None)
    assert not space.contains(12)


def test_repr_is_short():
    assert repr(UnicodeText(4096)) == "UnicodeText(0, 4096)"


def test_samples_are_members():
    space = UnicodeText(50, seed=0)
    assert all(space.contains(space.sample()) for _ in range(20))


def test_seeded_samples_repeat():
    assert UnicodeText(30, seed=3).sample() == UnicodeText(30, seed=3).sample()


def test_batch_space_gives_a_tuple_of_unicode_text_spaces():
    batched = batch_space(UnicodeText(64), 3)
    assert isinstance(batched, Tuple)
    assert len(batched.spaces) == 3
    assert all(isinstance(s, UnicodeText) and s.max_length == 64 for s in batched.spaces)
    assert batched.contains(("a", "日本", "😀"))


def test_equality_and_copy():
    assert UnicodeText(10) == copy.deepcopy(UnicodeText(10))
    assert UnicodeText(10) != UnicodeText(11)


def test_bad_bounds_are_an_error():
    with pytest.raises(ValueError):
        UnicodeText(1, min_length=2)


def test_async_vector_env_with_shared_memory_is_refused_with_the_fix_named():
    # Shared memory would silently hand back stale observations for text spaces.
    import gymnasium as gym

    class EchoEnv(gym.Env):
        observation_space = UnicodeText(16)
        action_space = UnicodeText(16)

        def reset(self, *, seed=None, options=None):
            return "start", {}

        def step(self, action):
            return action, 0.0, True, False, {}

    with pytest.raises(ValueError, match="shared_memory=False"):
        gym.vector.AsyncVectorEnv([EchoEnv, EchoEnv], shared_memory=True)
    envs = gym.vector.AsyncVectorEnv([EchoEnv, EchoEnv], shared_memory=False)
    try:
        envs.reset()
        observations, *_ = envs.step(("héllo", "wörld"))
        assert observations == ("héllo", "wörld")
    finally:
        envs.close()
