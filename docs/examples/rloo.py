"""RLOO (REINFORCE leave-one-out) as a seeupo-gym plug-in: a complete user algorithm.

    seeupo-train --config tiny-cpu --plugin docs/examples/rloo.py algorithm.name=rloo

Each trajectory's baseline is the mean reward of the other rollouts of its task:
`A_i = R_i - mean_{j in group(i), j != i} R_j`. Every turn of trajectory i is pushed along
`A_i * sum_tokens log pi(y_{i,t})`, averaged over the minibatch's turn samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Algorithm, AlgorithmConfig, register_algorithm


@dataclass
class RLOOConfig(AlgorithmConfig):
    # Inherits epochs and minibatch_size (clip and KL options are unused here).
    pass


def leave_one_out_advantages(batch) -> dict[str, float]:
    """A_i = R_i - mean of the other rewards of i's group (0 for a group of one)."""
    advantages = {}
    for members in batch.groups().values():
        total = sum(t.reward for t in members)
        for t in members:
            others = len(members) - 1
            advantages[t.rollout_id] = t.reward - (total - t.reward) / others if others else 0.0
    return advantages


@register_algorithm("rloo")
class RLOO(Algorithm):
    config_class = RLOOConfig

    def update(self, batch, learner, generator: torch.Generator) -> dict[str, float]:
        advantages = leave_one_out_advantages(batch)
        steps = []
        for minibatch in core.minibatches(batch.samples(), self.config.minibatch_size, self.config.epochs, generator):
            totals = core.Totals.of(minibatch)

            def loss(part, new, values):
                # This part's share of the minibatch mean: divide by the minibatch's sample count.
                weights = core.per_sample(advantages, part, new.logprobs)
                log_likelihood = (new.logprobs * new.mask).sum(-1)
                share = -(weights * log_likelihood).sum() / totals.samples
                return share, core.LossStats(policy_loss=float(share.detach()))

            steps.append(learner.minimize(minibatch, loss))
        return core.mean_metrics(steps)
