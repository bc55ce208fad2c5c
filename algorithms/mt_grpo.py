"""Per-turn-index GRPO (MT-GRPO), transcribed from Multi-Turn-RL-Agent's `_assign_advantages`.

Source: SiliangZeng/Multi-Turn-RL-Agent, mt_grpo_env_trainer.py, `_assign_advantages` (that
repository's path is not in the search index this was written from; the function was read from a
copy of the trainer found by its text). As that code computes it, over the G rollouts of one group:
- turn rewards are padded with 0.0 to the group's longest episode; at each turn index t,
  A^T_t = (r_t - mean_t) / std_t with numpy's population std, std 0 replaced by 1 (so the padded
  zeros of episodes that already ended sit in the statistics of later indices);
- A^O = (R - mean R) / std R over the group, the same way (population std, 0 -> 1);
- turn t < T_i: A^T_t + lambda A^O; the last turn of each episode: A^O alone.
`turn_level_advantage_lambda` is the source's config name (`lam` here). The survey's point (verl RFC
#7244): normalizing per turn index is biased when the policy chooses the length (docs/credit.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Learner, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, TurnCreditConfig, turn_rewards


@dataclass
class MTGRPOConfig(TurnCreditConfig):
    lam: float = 1.0


def _standardized(values: list[float]) -> list[float]:
    x = np.asarray(values, dtype=np.float64)
    std = x.std()
    if std == 0:
        std = 1.0
    return list((x - x.mean()) / std)


def mt_grpo_advantages(batch: RolloutBatch, lam: float) -> dict[core.SampleKey, float]:
    out: dict[core.SampleKey, float] = {}
    for group in batch.groups().values():
        rewards = [turn_rewards(t) for t in group]
        longest = max(len(r) for r in rewards)
        padded = [r + [0.0] * (longest - len(r)) for r in rewards]
        per_index = [_standardized([p[t] for p in padded]) for t in range(longest)]
        outcome = _standardized([t.reward for t in group])
        for i, trajectory in enumerate(group):
            for t in range(trajectory.num_turns):
                last = t == trajectory.num_turns - 1
                out[(trajectory.rollout_id, t + 1)] = float(outcome[i] if last else per_index[t][i] + lam * outcome[i])
    return out


@register_algorithm("mt_grpo")
class MTGRPO(TurnAdvantageAlgorithm):
    config_class = MTGRPOConfig
    config: MTGRPOConfig

    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        return mt_grpo_advantages(batch, self.config.lam)
