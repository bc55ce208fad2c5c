"""Broadcast: every turn of a trajectory gets the trajectory's GRPO or RLOO advantage.

Sources: SkyRL's step-wise training and rLLM's `collect_reward_and_advantage_from_trajectory_groups`
(rllm-org/rllm) compute one advantage per trajectory from its group and copy it to every step;
neither file is in the search index this was written from, so the estimators are the ones those
projects call: GRPO as verl's `compute_grpo_outcome_advantage` (`core.group_advantages`: group of
one, mean 0 and std 1) and RLOO as verl's `compute_rloo_outcome_advantage`
(R_i x n/(n-1) - mean x n/(n-1) = R_i - mean of the others; a group of one keeps R_i).
With `estimator: grpo` on a batch this equals `grpo`; it is here as the named baseline of the study.
"""

from __future__ import annotations

from dataclasses import dataclass

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Learner, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, TurnCreditConfig

ESTIMATORS = ("grpo", "rloo")


@dataclass
class BroadcastConfig(TurnCreditConfig):
    estimator: str = "rloo"
    normalization: str = "group"  # GRPO's

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("estimator", ESTIMATORS)
        self.require_choice("normalization", core.NORMALIZATIONS)


def rloo_advantages(batch: RolloutBatch) -> dict[str, float]:
    out = {}
    for group in batch.groups().values():
        n = len(group)
        mean = sum(t.reward for t in group) / n
        for t in group:
            out[t.rollout_id] = t.reward if n == 1 else t.reward * n / (n - 1) - mean * n / (n - 1)
    return out


@register_algorithm("broadcast")
class Broadcast(TurnAdvantageAlgorithm):
    config_class = BroadcastConfig
    config: BroadcastConfig

    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        cfg = self.config
        per_trajectory = (
            rloo_advantages(batch) if cfg.estimator == "rloo" else core.trajectory_advantages(batch, cfg.normalization)
        )
        return {core.sample_key(s): per_trajectory[s.rollout_id] for s in batch.samples()}
