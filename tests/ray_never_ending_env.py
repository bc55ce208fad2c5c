"""An env that never ends its episodes (it says neither terminated nor truncated past its own
`max_turns`), for the Ray worker's turn-limit test: imported by id
(`ray_never_ending_env:test/NeverEndingBandit-v0`) in the worker as in the driver."""

import gymnasium as gym

from seeupo_gym.turnbandit import TurnBanditEnv


class NeverEndingBandit(TurnBanditEnv):
    def step(self, action):
        if self._over:
            return "Go on.", 0.0, False, False, self._last_info
        observation, reward, terminated, truncated, info = super().step(action)
        self._over, self._last_info = terminated or truncated, info
        return observation, 0.0, False, False, info

    def reset(self, *, seed=None, options=None):
        self._over, self._last_info = False, {}
        return super().reset(seed=seed, options=options)


if "test/NeverEndingBandit-v0" not in gym.registry:
    gym.register("test/NeverEndingBandit-v0", entry_point=NeverEndingBandit)
