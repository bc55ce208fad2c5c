"""GSPO, sequence-level.

Each turn's response y_{i,t} is one sequence with ratio `s(y_{i,t})` (`sequence: turn`, the SeeUPO
paper's); or each trajectory's responses of all turns together are one sequence (`trajectory`, as
verl). The group-normalized `A_i` weighs every sequence of trajectory i; all turns are updated
together with `-mean_sequences clip_obj(s, A_i)` + KL, the KL a token mean per sequence averaged over
sequences. `log s` is clamped above at 10 as verl. (GSPO's paper uses much smaller clip ranges; eps is
a parameter.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Algorithm, AlgorithmConfig, Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch


@dataclass
class GSPOConfig(AlgorithmConfig):
    # GRAE normalization: none | group | batch.
    normalization: str = "group"
    # What one ratio covers: turn (default: each turn's response, the SeeUPO paper, the unit SeeUPO
    # updates) | trajectory (verl's: one row per trajectory, every turn's response tokens). The surrogate
    # and the KL are both averaged per sequence (seq-mean-token-mean); verl's GSPO aggregates both
    # with the actor's `loss_agg_mode` (token-mean by default; its GSPO recipe sets seq-mean-token-mean).
    sequence: str = "turn"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("normalization", core.NORMALIZATIONS)
        self.require_choice("sequence", core.SEQUENCES)


@register_algorithm("gspo")
class GSPO(Algorithm):
    config_class = GSPOConfig
    config: GSPOConfig

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        cfg = self.config
        self.schedule = []
        advantages = core.trajectory_advantages(batch, cfg.normalization)
        samples = batch.samples()
        old = core.old_logprobs(learner, samples, cfg.minibatch_size, cfg.epochs)
        ref = core.frozen_logprobs(learner, samples, reference=True) if cfg.kl_coef > 0 else None

        steps = []
        for minibatch in core.minibatches(samples, cfg.minibatch_size, cfg.epochs, generator):
            totals = core.Totals.of(minibatch, cfg.sequence)

            def loss(part, new, values):
                return core.sequence_policy_loss(
                    new,
                    core.old_or_detached(old, part, new.logprobs),
                    core.per_sample(advantages, part, new.logprobs),
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    ref=core.gather(ref, part, new.logprobs) if ref is not None else None,
                    kl_coef=cfg.kl_coef,
                    kl_estimator=cfg.kl_estimator,
                    totals=totals.part(part),
                )

            steps.append(learner.minimize(minibatch, loss))

        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), advantages, len(steps)))
        return core.mean_metrics(steps)
