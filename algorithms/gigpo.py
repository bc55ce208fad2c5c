"""GiGPO (group-in-group), transcribed from verl-agent's `compute_gigpo_outcome_advantage`.

Source: langfengQ/verl-agent, gigpo/core_gigpo.py, `compute_gigpo_outcome_advantage` with
`episode_norm_reward`, `build_step_group`, `step_norm_reward`. That repository is not in the search
index this was written from; the function was read from a verbatim copy of the file in a fork found
by its text (same signature, defaults and bodies), not from the paper.

As that code computes it, per turn sample (a "row"; exact-match anchors, `enable_similarity` off):
- episode term: every row of group g scores its trajectory's reward R_i; the baseline is the mean over
  the group's *rows* (`compute_mean_std_cross_steps=True`), so a trajectory weighs by its turn count
  and its own rows are in the mean. `mean_norm` (the function's default): R_i - mean; `mean_std_norm`:
  divided by (std + eps), torch's unbiased std. A group of one row: mean 0, std 1 (the term is R_i).
- step term: each row's step reward is its discounted return G_t = r_t + gamma G_{t+1} (verl-agent's
  `compute_step_discounted_returns`, gamma = 0.95 in its config); rows of one group with the same
  anchor observation form a step group; G_t - its mean (`mean_std_norm`: / (std + eps)). A step group
  of one row gets 0 (its mean is itself).
- A = episode + `step_advantage_w` x step.
Anchor observation of turn t: `info["observations"][t-1]` when the trajectory carries them (the env's
observation at that turn, as verl-agent's `anchor_obs`), else the turn's whole context (then only
turns with identical histories share a step group).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Learner, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, TurnSample
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, TurnCreditConfig, discounted_returns, turn_rewards

MODES = ("mean_norm", "mean_std_norm")


@dataclass
class GiGPOConfig(TurnCreditConfig):
    gamma: float = 0.95
    step_advantage_w: float = 1.0
    mode: str = "mean_norm"
    epsilon: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("mode", MODES)
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma}")


def anchor(sample: TurnSample) -> Hashable:
    observations: Any = sample.trajectory.info.get("observations")
    if observations is not None:
        return ("obs", str(observations[sample.t - 1]))
    return ("context", tuple(sample.turn.context_ids))


def _normalized(scores: list[float], group_of: list[Hashable], *, remove_std: bool, eps: float, single_mean: str) -> list[float]:
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for score, g in zip(scores, group_of):
        groups[g].append(score)
    stats = {}
    for g, members in groups.items():
        x = torch.tensor(members, dtype=torch.float64)
        if len(members) == 1:
            # episode_norm_reward: mean 0, std 1; step_norm_reward: mean = the score itself, std 1.
            stats[g] = (0.0 if single_mean == "zero" else members[0], 1.0)
        else:
            stats[g] = (float(x.mean()), float(x.std()))
    out = []
    for score, g in zip(scores, group_of):
        mean, std = stats[g]
        out.append(score - mean if remove_std else (score - mean) / (std + eps))
    return out


def gigpo_advantages(
    batch: RolloutBatch, *, gamma: float, step_advantage_w: float, mode: str = "mean_norm", epsilon: float = 1e-6
) -> dict[core.SampleKey, float]:
    remove_std = mode == "mean_norm"
    samples = batch.samples()
    returns = {t.rollout_id: discounted_returns(turn_rewards(t), gamma) for t in batch}
    episode = _normalized(
        [s.trajectory.reward for s in samples], [s.group_id for s in samples], remove_std=remove_std, eps=epsilon, single_mean="zero"
    )
    step = _normalized(
        [returns[s.rollout_id][s.t - 1] for s in samples],
        [(s.group_id, anchor(s)) for s in samples],
        remove_std=remove_std,
        eps=epsilon,
        single_mean="self",
    )
    return {core.sample_key(s): e + step_advantage_w * st for s, e, st in zip(samples, episode, step)}


@register_algorithm("gigpo")
class GiGPO(TurnAdvantageAlgorithm):
    config_class = GiGPOConfig
    config: GiGPOConfig

    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        cfg = self.config
        return gigpo_advantages(batch, gamma=cfg.gamma, step_advantage_w=cfg.step_advantage_w, mode=cfg.mode, epsilon=cfg.epsilon)
