"""MT-GRPO per turn index, transcribed from an atropos environment's `_compute_mt_grpo_advantages`.

Source: NousResearch/atropos, commit 60188d07d398b510db4bd0968fca84019ec8bb36,
environments/tool_use_turnlevel_advantage_server.py, `_compute_mt_grpo_advantages`. As that code
computes it, over the rollouts it is given:
- turn rewards are padded with 0.0 to the longest rollout; at each turn index t,
  A^T_t = (r_t - mean_t) / std_t with numpy's population std, std 0 replaced by 1 (so the padded
  zeros of rollouts that already ended sit in the statistics of later indices);
- A^O = (R^O - mean) / std over the rollouts, the same way;
- turn t < T_i: A^T_t + lambda A^O; the last turn of each rollout: A^O alone.
From commit 6e2bdd2a39f16f74f5e938ccd6e31416353439a5 on, the last turn too gets A^T_T + lambda A^O:
`last_turn_outcome_only: false` computes that version.
`turn_level_advantage_lambda` is its option of that name; its default here is 1.0, the paper's and
6e2bdd2's (`Field(default=1.0)`); at 60188d07 the environment's default is 0.5
(`TURN_LEVEL_ADVANTAGE_LAMBDA = 0.5  # Paper uses 1.0`), so the defaults here are neither commit's whole.

How our records map onto its inputs, and where ours departs: the turn rewards are
`turn_credit.turn_rewards` (0 ... 0, R without `info["turn_rewards"]`) and the outcome reward is the
trajectory's reward R; the statistics run over each group (at 60188d07 the environment calls the
function with one rollout at a time, where every std is 0 and every term 0; at 6e2bdd2 with the
group); float64 throughout, as numpy's default there. The paper repository's own estimator is
`mt_grpo` (algorithms/mt_grpo.py). Normalizing per turn index is biased when the policy chooses the
episode's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Learner, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, TurnCreditConfig, turn_rewards


@dataclass
class MTGRPOAtroposConfig(TurnCreditConfig):
    turn_level_advantage_lambda: float = 1.0
    last_turn_outcome_only: bool = True


def _standardized(values: list[float]) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    std = x.std()
    return (x - x.mean()) / (std if std != 0 else 1.0)


def mt_grpo_atropos_advantages(
    batch: RolloutBatch, lam: float, last_turn_outcome_only: bool = True
) -> dict[core.SampleKey, float]:
    out: dict[core.SampleKey, float] = {}
    for group in batch.groups().values():
        rewards = [turn_rewards(t) for t in group]
        longest = max(len(r) for r in rewards)
        per_index = [_standardized([r[t] if t < len(r) else 0.0 for r in rewards]) for t in range(longest)]
        outcome = _standardized([t.reward for t in group])
        for i, trajectory in enumerate(group):
            for t in range(trajectory.num_turns):
                last = t == trajectory.num_turns - 1
                value = outcome[i] if last and last_turn_outcome_only else per_index[t][i] + lam * outcome[i]
                out[(trajectory.rollout_id, t + 1)] = float(value)
    return out


@register_algorithm("mt_grpo_atropos")
class MTGRPOAtropos(TurnAdvantageAlgorithm):
    config_class = MTGRPOAtroposConfig
    config: MTGRPOAtroposConfig

    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        cfg = self.config
        return mt_grpo_atropos_advantages(batch, cfg.turn_level_advantage_lambda, cfg.last_turn_outcome_only)
