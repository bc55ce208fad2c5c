"""Turn-level GAE with a critic, transcribed from AReaL's `_compute_turn_level_gae`.

Source: areal-project/AReaL (formerly inclusionAI/AReaL), commit
8966ca17970010a23094071cd8a55e1c53385955, areal/trainer/ppo/gae.py, `_compute_turn_level_gae`
(read from the search index's copy at that commit). As that code computes it, each generated turn
with at least one loss token is one timestep:
- r_t: the reward increments on the turn's loss tokens summed;
- V_t: the critic's value at the turn's first loss token;
- a turn without loss tokens is no timestep: no value, no advantage, and the recursion passes over it
  (`valid_turn_mask`); a reward it carried is lost, as rewards there ride on loss tokens;
- after the last turn, the next value is the bootstrap value x `seq_no_eos_mask`: 0 for an episode that
  ended;
- delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lambda A_{t+1}; returns A_t + V_t;
- A_t and the return are copied to every loss token of turn t.
How our records map onto its inputs: r_t are `turn_credit.turn_rewards`; a turn's loss tokens are its
response tokens, so an empty response is the turn without loss tokens (advantage 0, return 0).
AReaL's caller (areal/trainer/ppo/actor.py) passes one reward, the episode's score on its last token,
so there r_t = 0 ... 0, R (token KL is added to the advantage after, not in the recursion): per-turn
rewards from `info["turn_rewards"]` go beyond what AReaL feeds it. gamma = lambda = 1 are its
`discount` and `gae_lambda` defaults.
Where ours departs: a truncated episode also bootstraps 0 (AReaL bootstraps it with the value at the
last position); float64.
The update is the shared turn-level clipped surrogate plus `vf_coef` x PPO's clipped value loss toward
the turn's return at each of its tokens. With gamma = lambda = 1, A_t = G_t - V_t: unbiased whatever the
critic and whoever decides the episode's length (docs/credit.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Learner, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, TurnCreditConfig, turn_rewards


@dataclass
class TurnGAEConfig(TurnCreditConfig):
    gamma: float = 1.0
    lam: float = 1.0
    vf_coef: float = 0.5
    value_clip: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must lie in [0, 1], got {self.gamma}/{self.lam}")


def turn_level_gae(
    batch: RolloutBatch, turn_values: dict[core.SampleKey, float], gamma: float, lam: float
) -> tuple[dict[core.SampleKey, float], dict[core.SampleKey, float]]:
    """(A_t, return_t) per turn sample from the values of the turns with tokens, each trajectory's
    recursion from its end; a turn without tokens is skipped (0, 0)."""
    advantages, returns = {}, {}
    for trajectory in batch:
        rewards = turn_rewards(trajectory)
        next_value, last = 0.0, 0.0
        for t in reversed(range(trajectory.num_turns)):
            key = (trajectory.rollout_id, t + 1)
            if trajectory.turns[t].num_response_tokens == 0:
                advantages[key], returns[key] = 0.0, 0.0
                continue
            value = turn_values[key]
            delta = rewards[t] + gamma * next_value - value
            last = delta + gamma * lam * last
            advantages[key], returns[key] = last, last + value
            next_value = value
    return advantages, returns


@register_algorithm("turn_gae")
class TurnGAE(TurnAdvantageAlgorithm):
    config_class = TurnGAEConfig
    config: TurnGAEConfig
    needs_value_model = True

    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        frozen = core.frozen_values(learner, batch.samples())
        # The turn's state value: the value at its first action token (an empty response has none).
        first = {k: float(v[0]) for k, v in frozen.items() if v.numel()}
        advantages, returns = turn_level_gae(batch, first, self.config.gamma, self.config.lam)
        self.old_values = {k: torch.tensor(first.get(k, 0.0)) for k in returns}
        self.value_targets = {k: torch.tensor(returns[k]) for k in returns}
        return advantages
