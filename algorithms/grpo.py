"""GRPO, token-level.

`A_i` = GRAE of trajectory i, group-normalized, broadcast to every response token of every turn
of trajectory i; all turns are updated together with `-agg_tokens clip_obj(rho, A_i)` + KL, the
aggregate taken over the whole minibatch (a minibatch holds whole trajectories).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Algorithm, AlgorithmConfig, Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch


@dataclass
class GRPOConfig(AlgorithmConfig):
    # GRAE normalization: none | group | batch.
    normalization: str = "group"
    # token-mean | seq-mean-token-mean | seq-mean-token-sum
    loss_agg: str = "token-mean"
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


@register_algorithm("grpo")
class GRPO(Algorithm):
    config_class = GRPOConfig
    config: GRPOConfig

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
                # A_i broadcast to every response token of the sample.
                token_advantages = core.per_sample(advantages, part, new.logprobs).unsqueeze(1).expand_as(new.logprobs)
                return core.token_policy_loss(
                    new,
                    core.old_or_detached(old, part, new.logprobs),
                    token_advantages,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    clip_ratio_c=cfg.clip_ratio_c,
                    ref=core.gather(ref, part, new.logprobs) if ref is not None else None,
                    kl_coef=cfg.kl_coef,
                    kl_estimator=cfg.kl_estimator,
                    loss_agg=cfg.loss_agg,
                    totals=totals.part(part),
                )

            steps.append(learner.minimize(minibatch, loss))

        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), advantages, len(steps)))
        return core.mean_metrics(steps)
