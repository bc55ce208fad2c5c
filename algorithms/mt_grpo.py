"""MT-GRPO, transcribed from the paper's repository: `MTGRPOEnvTrainer._assign_advantages`.

Source: SiliangZeng/Multi-Turn-RL-Agent, commit 127dda5f8c20be62d7d483ccbd65841b65956162,
verifiers/trainers/mt_grpo_env_trainer.py, `_assign_advantages` (from 7860de6 to 4eeca09 the same
as the default `advantage_est="aae"` branch beside a "cae" one, removed in a14334a), with
`_compute_normalized_advantages` of verifiers/trainers/grpo_env_trainer.py. As that code computes it,
per group of G rollouts:
- three scalar rewards per rollout, each standardized over its group as (r - mean) / (std + 1e-4),
  torch's unbiased std: the turn reward (A^T), the outcome reward (A^O), and their sum (A^C);
- a rollout whose first reply is followed by a `<result>` message is cut in two segments: the tokens
  before the result get A^O + `turn_advantage_coef` x A^T, every later token A^O;
- a rollout without a result (it never called the tool) gets A^C on every token.
`turn_advantage_coef` defaults to 1.0 there, as `turn_advantage_coef` here.

How our records map onto its inputs:
- the environment's reply after turn t plays the `<result>` message, so a rollout of two turns or more
  is cut after turn 1 and a one-turn rollout takes A^C;
- the turn reward is r_1 and the outcome reward is R - r_1 (the rewards after turn 1), so that the
  source's combined reward, turn + outcome, is R; r_t are `turn_credit.turn_rewards` (0 ... 0, R
  without `info["turn_rewards"]`, where a multi-turn rollout's turn reward is 0 and its outcome R).
Where ours departs: the segments are our turns, not mask runs of a padded token row (the same split
whenever every turn has a token); a group of one has std 0 (torch's unbiased std of one value is NaN
there, and TRL never forms such a group); groups may differ in size (the source views the batch as
equal groups of `num_generations`); float64 (the source is float32).
The atropos environment's per-turn-index variant is `mt_grpo_atropos` (algorithms/mt_grpo_atropos.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Learner, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, TurnCreditConfig, turn_rewards

STD_EPS = 1e-4  # `_compute_normalized_advantages`' constant


@dataclass
class MTGRPOConfig(TurnCreditConfig):
    turn_advantage_coef: float = 1.0


def normalized_advantages(rewards: list[float]) -> np.ndarray:
    """(r - mean) / (unbiased std + 1e-4) over one group; a group of one has std 0."""
    x = np.asarray(rewards, dtype=np.float64)
    std = x.std(ddof=1) if len(x) > 1 else 0.0
    return (x - x.mean()) / (std + STD_EPS)


def mt_grpo_advantages(batch: RolloutBatch, turn_advantage_coef: float) -> dict[core.SampleKey, float]:
    out: dict[core.SampleKey, float] = {}
    for group in batch.groups().values():
        first = [turn_rewards(t)[0] if t.num_turns else 0.0 for t in group]
        turn_adv = normalized_advantages(first)
        outcome_adv = normalized_advantages([t.reward - r1 for t, r1 in zip(group, first)])
        combined_adv = normalized_advantages([t.reward for t in group])
        for i, trajectory in enumerate(group):
            for t in range(1, trajectory.num_turns + 1):
                if trajectory.num_turns == 1:
                    value = combined_adv[i]
                elif t == 1:
                    value = outcome_adv[i] + turn_advantage_coef * turn_adv[i]
                else:
                    value = outcome_adv[i]
                out[(trajectory.rollout_id, t)] = float(value)
    return out


@register_algorithm("mt_grpo")
class MTGRPO(TurnAdvantageAlgorithm):
    config_class = MTGRPOConfig
    config: MTGRPOConfig

    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        return mt_grpo_advantages(batch, self.config.turn_advantage_coef)
