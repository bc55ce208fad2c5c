"""An env that declares its own step deadline (`step_deadline_s`), for the Ray worker tests:
imported by id (`ray_deadline_env:test/DeadlineBandit-v0`) in the worker as in the driver."""

import gymnasium as gym

from seeupo_gym.turnbandit import TurnBanditEnv


class DeadlineBandit(TurnBanditEnv):
    step_deadline_s = 2.0  # as an env that bounds its own steps (AppWorld: its code timeout) declares it


if "test/DeadlineBandit-v0" not in gym.registry:
    gym.register("test/DeadlineBandit-v0", entry_point=DeadlineBandit)
