import copy

import gymnasium as gym
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


class EchoEnv(gym.Env):
    """Observes the last action; a text env in three lines."""

    observation_space = UnicodeText(64)
    action_space = UnicodeText(64)

    def reset(self, *, seed=None, options=None):
        return "start", {}

    def step(self, action):
        return action, 0.0, False, False, {}


TEXTS = [("héllo", "wörld 中文 😀"), ("", "x" * 64), ("\x00nul\x00", "lone \ud800 surrogate"), ("a", "b")]


def test_async_vector_env_carries_text_through_default_shared_memory():
    envs = gym.vector.AsyncVectorEnv([EchoEnv, EchoEnv])  # shared_memory=True is gymnasium's default
    try:
        assert envs.reset(seed=0)[0] == ("start", "start")
        for actions in TEXTS:
            observations, *_ = envs.step(actions)
            assert observations == actions and isinstance(observations, tuple)
    finally:
        envs.close()


def test_observations_handed_out_earlier_do_not_change_later():
    envs = gym.vector.AsyncVectorEnv([EchoEnv, EchoEnv])
    try:
        envs.reset()
        first, *_ = envs.step(TEXTS[0])
        envs.step(TEXTS[1])
        assert first == TEXTS[0]
    finally:
        envs.close()


def test_text_inside_a_dict_space_uses_the_same_shared_memory():
    class DictEnv(EchoEnv):
        observation_space = gym.spaces.Dict({"text": UnicodeText(8), "count": gym.spaces.Discrete(9)})

        def reset(self, *, seed=None, options=None):
            return {"text": "", "count": 0}, {}

        def step(self, action):
            return {"text": action, "count": len(action)}, 0.0, False, False, {}

    envs = gym.vector.AsyncVectorEnv([DictEnv, DictEnv])
    try:
        envs.reset()
        observations, *_ = envs.step(("ß", "日本語"))
        assert observations["text"] == ("ß", "日本語") and list(observations["count"]) == [1, 3]
    finally:
        envs.close()


def test_an_observation_over_the_bound_is_a_clear_error():
    from seeupo_gym.spaces import _create_text_shared_memory, _write_text_to_shared_memory

    space = UnicodeText(4)
    memory = _create_text_shared_memory(space, n=1)
    with pytest.raises(ValueError, match="not in UnicodeText"):
        _write_text_to_shared_memory(space, 0, "12345", memory)
