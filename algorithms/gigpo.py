"""GiGPO (group-in-group), transcribed from verl-agent's `compute_gigpo_outcome_advantage`.

Source: langfengQ/verl-agent, commit 29e3e8b3e3412aff53b1e4a461dac77a8eec19bd (the last to touch the
file), gigpo/core_gigpo.py, `compute_gigpo_outcome_advantage` with `episode_norm_reward`,
`build_step_group`, `to_hashable`, `step_norm_reward` and `compute_step_discounted_returns`; read from
that commit in a fork that carries the upstream history (vanzll/verl-agent), the upstream repository
itself not being stored here.

As that code computes it, per turn sample (a "row"; exact-match anchors, `enable_similarity` off):
- episode term: every row of group g scores its trajectory's reward R_i; the baseline is the mean over
  the group's *rows* (`compute_mean_std_cross_steps=True`), so a trajectory weighs by its turn count
  and its own rows are in the mean. `mean_norm` (the function's default): R_i - mean; `mean_std_norm`:
  divided by (std + eps), torch's unbiased std. A group of one row: mean 0, std 1 (the term is R_i).
- step term: each row's step reward is its discounted return G_t = r_t + gamma G_{t+1}
  (`compute_step_discounted_returns`, gamma = 0.95 as every examples/gigpo_trainer script sets
  `algorithm.gamma=0.95`; ppo_trainer.yaml's own default is 1.0); rows of one group whose anchor
  observations are equal after `to_hashable` form a step group (a value is hashed as it is: 1, 1.0 and
  True are one key as in a Python dict, "1" another; lists and tuples become tuples, dicts sorted
  tuples, numpy arrays their flattened tuple); G_t - its mean (`mean_std_norm`: / (std + eps)). A step
  group of one row gets 0 (its mean is itself).
- A = episode + `step_advantage_w` x step.
How our records map onto its inputs: r_t are `turn_credit.turn_rewards`; the anchor of turn t is
`info["observations"][t-1]` when the trajectory carries them (the env's observation at that turn, as
verl-agent's `anchor_obs`). Where ours departs: a trajectory without observations anchors each turn on
its whole context (then only turns with identical histories share a step group); an observation
`to_hashable` refuses (any other type) stops the update with a clear error, as there; float64 (the
source is float32).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np
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


def to_hashable(x: Any) -> Hashable:
    """An observation as a dict key, as verl-agent's `to_hashable`: the value itself, not its text."""
    if isinstance(x, (int, float, str, bool)):
        return x
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.ndarray):
        return tuple(x.flatten())
    if isinstance(x, (list, tuple)):
        return tuple(to_hashable(e) for e in x)
    if isinstance(x, dict):
        return tuple(sorted((k, to_hashable(v)) for k, v in x.items()))
    raise TypeError(f"GiGPO anchor observations must be numbers, strings, lists, dicts or arrays; got {type(x).__name__}")


def anchor(sample: TurnSample) -> Hashable:
    observations: Any = sample.trajectory.info.get("observations")
    if observations is not None:
        return ("obs", to_hashable(observations[sample.t - 1]))
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
