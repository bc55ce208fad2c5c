"""GSPO, sequence-level.

Each turn's response y_{i,t} is one sequence with ratio `s(y_{i,t})` (`sequence: turn`, the SeeUPO
paper's); or each trajectory's responses of all turns together are one sequence (`trajectory`, as
verl). The group-normalized `A_i` weighs every sequence of trajectory i; all turns are updated
together with `-mean_sequences clip_obj(s, A_i)` + KL, the KL a token mean per sequence averaged over
sequences. `log s` is clamped above at 10 as verl. (GSPO's paper uses much smaller clip ranges; eps is
a parameter.)

verl's options (algorithms/options.py): `loss_agg` (how sequences weigh: per sequence by default,
or by their token counts under verl 0.9.1's token-mean etc.; KL and entropy aggregated alike) and
`policy_loss_agg` (the policy term's own mode: `seq-mean-token-mean` is verl 0.9.0's GSPO, whose
policy term ignores `loss_agg_mode`),
`use_kl_in_reward`, `entropy_coeff`, `rollout_correction` (sequence-level weights; token-level ones
are refused: the surrogate has one term per sequence), every `kl_estimator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core, options
from seeupo_gym.algorithms.base import Algorithm, Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch


@dataclass
class GSPOConfig(options.LossOptionsConfig):
    # GRAE normalization: none | group | batch.
    normalization: str = "group"
    # What one ratio covers: turn (default: each turn's response, the SeeUPO paper, the unit SeeUPO
    # updates) | trajectory (verl's: one row per trajectory, every turn's response tokens).
    sequence: str = "turn"
    # How sequences weigh in the loss (policy, KL and entropy terms, as verl 0.9.1's GSPO):
    # seq-mean-token-mean (GSPO's paper; verl's actor default is token-mean) | token-mean | token-sum
    # | seq-mean-token-sum | seq-mean-token-sum-norm.
    loss_agg: str = "seq-mean-token-mean"
    # The policy term's own aggregation, null = loss_agg (verl 0.9.1). seq-mean-token-mean is verl
    # 0.9.0's GSPO (policy per sequence whatever loss_agg_mode; KL and entropy by loss_agg_mode):
    # `loss_agg: token-mean, policy_loss_agg: seq-mean-token-mean` is verl 0.9.0's default setup.
    policy_loss_agg: str | None = None
    # seq-mean-token-sum-norm divides by this (verl's loss_scale_factor); required with that mode.
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("normalization", core.NORMALIZATIONS)
        self.require_choice("sequence", core.SEQUENCES)
        self.require_choice("loss_agg", core.LOSS_AGGREGATIONS)
        if self.policy_loss_agg is not None:
            self.require_choice("policy_loss_agg", core.LOSS_AGGREGATIONS)
            if self.policy_loss_agg == "seq-mean-token-sum-norm" and not (self.loss_scale_factor or 0) > 0:
                raise ValueError("policy_loss_agg: seq-mean-token-sum-norm needs loss_scale_factor > 0")
        self.require_scale_factor()
        self.refuse_token_weights_on_sequences("GSPO")


@register_algorithm("gspo")
class GSPO(Algorithm):
    config_class = GSPOConfig
    config: GSPOConfig

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        cfg = self.config
        self.schedule = []
        samples = batch.samples()
        old = core.old_logprobs(learner, samples, cfg.minibatch_size, cfg.epochs)
        ref = core.frozen_logprobs(learner, samples, reference=True) if cfg.kl_coef > 0 else None
        step = options.prepare_step(self, batch, learner, samples, old=old, ref=ref, sequence=cfg.sequence)
        advantages = core.trajectory_advantages(batch, cfg.normalization, step.rewards)

        steps = []
        for minibatch in core.minibatches(samples, cfg.minibatch_size, cfg.epochs, generator):
            totals = options.totals(step, minibatch)

            def loss(part, new, values):
                return options.sequence_loss(
                    cfg, step, part, new, core.old_or_detached(old, part, new.logprobs),
                    core.per_sample(advantages, part, new.logprobs), ref, totals.part(part),
                    loss_agg=cfg.loss_agg, loss_scale_factor=cfg.loss_scale_factor, policy_loss_agg=cfg.policy_loss_agg,
                )

            steps.append(options.minimize(learner, minibatch, loss, cfg))

        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), advantages, len(steps)))
        return {**core.mean_metrics(steps), **step.metrics}
