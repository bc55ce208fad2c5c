"""GRPO, token-level.

`A_i` = GRAE of trajectory i, group-normalized, broadcast to every response token of every turn
of trajectory i; all turns are updated together with `-agg_tokens clip_obj(rho, A_i)` + KL, the
aggregate taken over the whole minibatch (a minibatch holds whole trajectories).

verl's options (algorithms/options.py): `loss_agg` token-mean | token-sum | seq-mean-token-mean |
seq-mean-token-sum | seq-mean-token-sum-norm (with `loss_scale_factor`); `use_kl_in_reward` (then
`R_i - beta sum_j kl_ij` enters GRAE), `entropy_coeff`, `rollout_correction`, every `kl_estimator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core, options
from seeupo_gym.algorithms.base import Algorithm, Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch


@dataclass
class GRPOConfig(options.LossOptionsConfig):
    # GRAE normalization: none | group | batch.
    normalization: str = "group"
    # token-mean | token-sum | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    loss_agg: str = "token-mean"
    # seq-mean-token-sum-norm divides by this (verl's loss_scale_factor); required with that mode.
    loss_scale_factor: float | None = None
    # The sequence of the seq-mean-* modes: trajectory (all its turns' tokens, as verl) | turn.
    sequence: str = "trajectory"
    # Dual clip: where A < 0, the objective is at least clip_ratio_c * A (verl's default 3); null: off.
    clip_ratio_c: float | None = 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("normalization", core.NORMALIZATIONS)
        self.require_choice("loss_agg", core.LOSS_AGGREGATIONS)
        self.require_choice("sequence", core.SEQUENCES)
        self.require_dual_clip()
        self.require_scale_factor()


@register_algorithm("grpo")
class GRPO(Algorithm):
    config_class = GRPOConfig
    config: GRPOConfig

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
                # A_i broadcast to every response token of the sample.
                token_advantages = core.per_sample(advantages, part, new.logprobs).unsqueeze(1).expand_as(new.logprobs)
                return options.token_loss(cfg, step, part, new, core.old_or_detached(old, part, new.logprobs),
                                          token_advantages, ref, totals)

            steps.append(options.minimize(learner, minibatch, loss, cfg))

        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), advantages, len(steps)))
        return {**core.mean_metrics(steps), **step.metrics}
