"""GSPO, sequence-level with per-turn sequences (DESIGN section 5).

Each turn's response y_{i,t} is one sequence with ratio `s(y_{i,t})`; the group-normalized `A_i`
is shared by all turns of trajectory i; all turns are updated together with
`-mean_samples clip_obj(s, A_i)` + KL. (GSPO's paper uses much smaller clip ranges; eps is a parameter.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Algorithm, AlgorithmConfig, Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch


@dataclass
class GSPOConfig(AlgorithmConfig):
    # GRAE normalization: none | group | batch (DESIGN: group).
    normalization: str = "group"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("normalization", core.NORMALIZATIONS)


@register_algorithm("gspo")
class GSPO(Algorithm):
    config_class = GSPOConfig
    config: GSPOConfig

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        cfg = self.config
        self.schedule = []
        advantages = core.trajectory_advantages(batch, cfg.normalization)
        samples = batch.samples()
        old = core.frozen_logprobs(learner, samples, cfg.minibatch_size)
        ref = core.frozen_logprobs(learner, samples, cfg.minibatch_size, reference=True) if cfg.kl_coef > 0 else None

        stats, opt_metrics = [], []
        for minibatch in core.minibatches(samples, cfg.minibatch_size, cfg.epochs, generator):
            new = learner.logprobs(minibatch)
            loss, stat = core.sequence_policy_loss(
                new,
                core.gather(old, minibatch, new.logprobs),
                core.per_sample(advantages, minibatch, new.logprobs),
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                ref=core.gather(ref, minibatch, new.logprobs) if ref is not None else None,
                kl_coef=cfg.kl_coef,
            )
            opt_metrics.append(learner.optimize(loss))
            stats.append(stat)

        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), advantages, len(stats)))
        return core.mean_stats(stats, opt_metrics)
