"""PPO with a critic.

The learner carries a value model (`learner.values`, one value per response token). Token-level
GAE runs over each trajectory's response tokens of all turns in order (observation tokens are
not timesteps), with the team reward R_i on the last response token of the last turn; gamma = 1,
lambda = 1 by default. Advantages are whitened over the batch; the policy loss is the token-level
clipped surrogate with `rho`, plus `vf_coef` x the clipped value loss, plus KL. One `minimize`
call per minibatch steps the policy and the value model together.

verl's options (algorithms/options.py): `loss_agg` as GRPO's (with `loss_scale_factor`);
`use_kl_in_reward` (GAE sees `-beta * kl_j` at every response token, R_i at the last);
`entropy_coeff`; `rollout_correction` (a rejected token also leaves GAE's recursion, the whitening
and the value loss, as verl's modified response mask); every `kl_estimator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core, options
from seeupo_gym.algorithms.base import Algorithm, Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch


@dataclass
class PPOConfig(options.LossOptionsConfig):
    gamma: float = 1.0
    lam: float = 1.0
    vf_coef: float = 0.5
    # Value clip range around the step-start values (verl's cliprange_value default).
    value_clip: float = 0.5
    whiten_advantages: bool = True
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
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must lie in [0, 1], got {self.gamma}/{self.lam}")
        self.require_choice("loss_agg", core.LOSS_AGGREGATIONS)
        self.require_choice("sequence", core.SEQUENCES)
        self.require_dual_clip()
        self.require_scale_factor()


def trajectory_gae(
    batch: RolloutBatch,
    values: dict[core.SampleKey, torch.Tensor],
    gamma: float,
    lam: float,
    token_rewards: dict[core.SampleKey, torch.Tensor] | None = None,
    keep: dict[core.SampleKey, torch.Tensor] | None = None,
) -> tuple[dict[core.SampleKey, torch.Tensor], dict[core.SampleKey, torch.Tensor]]:
    """GAE advantages and returns per response token, keyed by sample: each trajectory's turns are
    concatenated in order into one row, R_i sits on the row's last token, `token_rewards` (the KL
    penalty) add per token; tokens outside `keep` (rejected) are skipped like padding."""
    rows, keys = [], []
    # GAE runs in the dtype of the values (a float64 critic: float64 advantages and returns).
    dtype = next(iter(values.values())).dtype if values else torch.float32
    for trajectory in batch:
        sample_keys = [(trajectory.rollout_id, t) for t in range(1, trajectory.num_turns + 1)]
        rows.append(torch.cat([values[k] for k in sample_keys]) if sample_keys else torch.zeros(0, dtype=dtype))
        keys.append(sample_keys)
    length = max((r.numel() for r in rows), default=0)
    value_rows = core.pad_rows(rows, length)
    lengths = torch.tensor([r.numel() for r in rows])
    mask = torch.arange(length)[None, :] < lengths[:, None]
    rewards = torch.zeros_like(value_rows)
    if token_rewards is not None:
        rewards = core.pad_rows(
            [torch.cat([token_rewards[k] for k in ks]) if ks else torch.zeros(0) for ks in keys], length
        ).to(dtype)
    if keep is not None:
        mask = core.pad_rows([torch.cat([keep[k].float() for k in ks]) if ks else torch.zeros(0) for ks in keys], length) > 0.5
    for i, trajectory in enumerate(batch):
        if lengths[i] > 0:
            rewards[i, lengths[i] - 1] += trajectory.reward
    advantages, returns = core.gae(rewards, value_rows, mask, gamma, lam)
    adv_out, ret_out = {}, {}
    for i, sample_keys in enumerate(keys):
        start = 0
        for k in sample_keys:
            n = values[k].numel()
            adv_out[k], ret_out[k] = advantages[i, start : start + n], returns[i, start : start + n]
            start += n
    return adv_out, ret_out


@register_algorithm("ppo")
class PPO(Algorithm):
    config_class = PPOConfig
    config: PPOConfig
    needs_value_model = True

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        cfg = self.config
        self.schedule = []
        samples = batch.samples()
        old = core.frozen_logprobs(learner, samples)
        ref = core.frozen_logprobs(learner, samples, reference=True) if cfg.kl_coef > 0 else None
        old_values = core.frozen_values(learner, samples)
        step = options.prepare_step(self, batch, learner, samples, old=old, ref=ref, sequence=cfg.sequence)
        keep = step.correction.keep if step.correction is not None else None
        advantages, returns = trajectory_gae(batch, old_values, cfg.gamma, cfg.lam, step.token_rewards, keep)
        if cfg.whiten_advantages and advantages:
            # Whitened over every (kept) response token of the batch.
            keys = list(advantages)
            flat = torch.cat([advantages[k] for k in keys])[None]
            kept = torch.cat([keep[k] for k in keys])[None] if keep is not None else torch.ones_like(flat, dtype=torch.bool)
            flat = core.whiten(flat, kept)[0]
            advantages = dict(zip(keys, torch.split(flat, [advantages[k].numel() for k in keys])))

        steps = []
        for minibatch in core.minibatches(samples, cfg.minibatch_size, cfg.epochs, generator):
            totals = options.totals(step, minibatch)

            def loss(part, new, values):
                policy_loss, stats = options.token_loss(cfg, step, part, new, core.gather(old, part, new.logprobs),
                                                        core.gather(advantages, part, new.logprobs), ref, totals)
                new, _ = options.corrected(step, part, new)  # the value loss counts the kept tokens too
                value_loss = core.clipped_value_loss(
                    values,
                    core.gather(old_values, part, values),
                    core.gather(returns, part, values),
                    new.mask,
                    cfg.value_clip,
                    totals,
                )
                return policy_loss + cfg.vf_coef * value_loss, {**vars(stats), "value_loss": float(value_loss.detach())}

            steps.append(options.minimize(learner, minibatch, loss, cfg, values=True))

        weights = {s.rollout_id: float(advantages[core.sample_key(s)][0]) for s in samples if s.t == 1 and s.turn.num_response_tokens}
        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), weights, len(steps)))
        return {**core.mean_metrics(steps), **step.metrics}
