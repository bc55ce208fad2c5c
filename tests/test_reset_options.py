"""Reset options are read in one place (`seeupo_gym.options`): an unknown key, such as a typo of
`task_id`, is refused with the same message by every env, instead of silently starting a random
task. (Served and Ray envs: test_openenv_serve_limits.py, test_ray_workers.py.)"""

from __future__ import annotations

import gymnasium as gym
import pytest

import seeupo_gym  # noqa: F401

REFUSAL = r"reset: unknown option\(s\) \['task'\] \(did you mean 'task_id'\?\); the options are \['task_id'\]"
ENVS = {
    "seeupo/BFCL-v4-v0": ({}, "multi_turn_base_0"),
    "seeupo/TurnBandit-v0": ({}, "mixed-0-1"),
    "seeupo/AppWorld-v0": ({"sandbox": "none"}, "mininote_1"),  # refused before any server starts
}


@pytest.mark.parametrize("env_id", sorted(ENVS))
def test_an_unknown_reset_option_is_refused_with_one_message_in_every_env(env_id):
    kwargs, task_id = ENVS[env_id]
    env = gym.make(env_id, **kwargs)
    try:
        with pytest.raises(ValueError, match=REFUSAL):
            env.reset(seed=0, options={"task": task_id})
        with pytest.raises(ValueError, match=r"unknown option\(s\) \['seed', 'tsk'\]"):
            env.reset(options={"task_id": task_id, "tsk": 1, "seed": 3})
    finally:
        env.close()


def test_known_options_still_pick_the_task():
    env = gym.make("seeupo/TurnBandit-v0")
    assert env.reset(seed=0, options={"task_id": "mixed-0-1"})[1]["task_id"] == "mixed-0-1"
    assert env.reset(seed=0, options={})[1]["task_id"] != ""
