"""TurnBandit over `seeupo-serve seeupo/TurnBandit-v0`: `vf-eval seeupo-vf-turnbandit --env.taskset.serve-url URL
[--env.taskset.seeds '[0,1,2]']`. A TurnBandit task is a reset seed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf

from seeupo_verifiers import SeeupoConfig, SeeupoTask, SeeupoEnv, SeeupoHarness, SeeupoTaskset


class TurnBanditConfig(SeeupoConfig):
    seeds: list[int] = list(range(8))
    """The reset seeds to play, one task each."""


# verifiers reads a taskset's config class off its own `Taskset[Task, Config]` base.
class TurnBanditTaskset(SeeupoTaskset, vf.Taskset[SeeupoTask, TurnBanditConfig]):
    ENV_ID = "seeupo/TurnBandit-v0"
    def resets(self) -> Iterator[dict[str, Any]]:
        self.served()  # the right env, reachable
        for seed in self.config.seeds:
            yield {"seed": int(seed)}


__all__ = ["SeeupoEnv", "SeeupoHarness", "TurnBanditTaskset"]
