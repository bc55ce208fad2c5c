"""Options verl users set, shared by PPO, GRPO, GSPO and SeeUPO, under verl's names.

- `use_kl_in_reward` (with `kl_penalty`, the estimator, verl's default `kl` = k1, and `kl_ctrl`:
  `type` fixed | adaptive, `kl_coef`, `horizon`, `target_kl`): each response token's reward loses
  `beta * kl_j` (step-start policy against the reference) before the advantages (algorithms/kl.py).
  GRAE (GRPO, GSPO, SeeUPO) sums token rewards: `R_i - beta * sum_j kl_ij`; PPO's GAE sees the
  penalty at every token. The adaptive beta is updated after each step and kept in checkpoints.
  Independent of `kl_coef` (the KL term in the loss), as in verl; set kl_coef: 0 for verl's default.
- `entropy_coeff`: the loss gains `- entropy_coeff * agg(H)`, H the policy's entropy at each response
  token, aggregated like the surrogate (`loss_agg`; per sequence for GSPO/SeeUPO). The learner must
  compute H (`minimize(..., entropy=True)`).
- `rollout_correction`: verl's importance weights and rejection against the sampler
  (algorithms/rollout_correction.py), computed once per step from the step-start logprobs.
- `loss_agg` (GRPO, PPO, GSPO) also takes `token-sum` and `seq-mean-token-sum-norm` (with
  `loss_scale_factor`), and `kl_estimator` every name verl accepts (core.KL_ESTIMATORS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Algorithm, AlgorithmConfig, Learner, MicroLoss, TokenLogprobs
from seeupo_gym.algorithms.kl import KLControl, token_kl_rewards
from seeupo_gym.algorithms.rollout import RolloutBatch, TurnSample
from seeupo_gym.algorithms.rollout_correction import Correction, RolloutCorrection, correct


@dataclass
class LossOptionsConfig(AlgorithmConfig):
    """The options of the module doc, with verl's defaults (all off)."""

    use_kl_in_reward: bool = False
    # Estimator of the KL in the reward (verl's algorithm.kl_penalty; default kl = k1).
    kl_penalty: str = "kl"
    kl_ctrl: KLControl = field(default_factory=KLControl)
    entropy_coeff: float = 0.0
    rollout_correction: RolloutCorrection | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.kl_ctrl, dict):
            self.kl_ctrl = KLControl(**self.kl_ctrl)
        if isinstance(self.rollout_correction, dict):
            self.rollout_correction = RolloutCorrection(**self.rollout_correction)
        self.require_choice("kl_penalty", core.KL_ESTIMATORS)
        if not math.isfinite(self.entropy_coeff):
            raise ValueError(f"entropy_coeff must be a finite number, got {self.entropy_coeff}")

    def require_scale_factor(self) -> None:
        """seq-mean-token-sum-norm without a loss_scale_factor would depend on padding: refuse it."""
        if getattr(self, "loss_agg", None) == "seq-mean-token-sum-norm" and not (self.loss_scale_factor or 0) > 0:
            raise ValueError(
                "loss_agg: seq-mean-token-sum-norm needs loss_scale_factor > 0 (verl's default is the padded "
                "response length, e.g. max_new_tokens x max_turns for a whole trajectory)"
            )

    def refuse_token_weights_on_sequences(self, algorithm: str) -> None:
        """A sequence-level surrogate has one term per sequence: a weight per token has no place in it."""
        if self.rollout_correction is not None and self.rollout_correction.rollout_is == "token":
            raise ValueError(
                f"rollout_correction.rollout_is: token weighs each token, but {algorithm}'s surrogate is one term per "
                "sequence (its gradient would differ from verl's per-token form); use rollout_is: sequence"
            )


@dataclass
class StepInputs:
    """What the options change in one step, computed once before its minibatches."""

    rewards: dict[str, float] | None  # R_i with the KL penalty (use_kl_in_reward), by rollout_id
    token_rewards: dict[core.SampleKey, torch.Tensor] | None  # -beta * kl_j per sample (for GAE)
    correction: Correction | None
    sequence: str
    metrics: dict[str, float]


def prepare_step(
    algorithm: Algorithm,
    batch: RolloutBatch,
    learner: Learner,
    samples: Sequence[TurnSample],
    *,
    old: dict[core.SampleKey, torch.Tensor] | None,
    ref: dict[core.SampleKey, torch.Tensor] | None,
    sequence: str,
) -> StepInputs:
    """KL in the reward (updating the controller) and the rollout correction of a step, as verl
    orders them: rewards, then correction, then advantages (by the caller, from `rewards`)."""
    cfg: LossOptionsConfig = algorithm.config  # type: ignore[assignment]
    metrics: dict[str, float] = {}
    rewards = token_rewards = correction = None
    if cfg.use_kl_in_reward or cfg.rollout_correction is not None:
        old = old if old is not None else core.frozen_logprobs(learner, samples)
    if cfg.use_kl_in_reward:
        ref = ref if ref is not None else core.frozen_logprobs(learner, samples, reference=True)
        controller = algorithm.kl_ctrl_in_reward
        beta = controller.value
        token_rewards, current_kl = token_kl_rewards(old, ref, [core.sample_key(s) for s in samples], cfg.kl_penalty, beta)
        rewards = {t.rollout_id: t.reward for t in batch}
        for s in samples:
            rewards[s.rollout_id] += float(token_rewards[core.sample_key(s)].double().sum())
        controller.update(current_kl, n_steps=len(batch))
        metrics.update(reward_kl_penalty=current_kl, reward_kl_penalty_coeff=beta)
    if cfg.rollout_correction is not None:
        correction = correct(samples, old, cfg.rollout_correction, sequence)
        metrics.update({f"rollout_corr/{k}": v for k, v in correction.metrics.items()})
    return StepInputs(rewards, token_rewards, correction, sequence, metrics)


def totals(step: StepInputs, minibatch: Sequence[TurnSample]) -> core.Totals:
    """The minibatch's counts: the tokens rejection keeps (verl's modified response mask, its
    `batch_num_tokens`), and every sequence of the minibatch, also one that rejection emptied
    (verl v1's `global_batch_size`, the mini-batch's row count, which its trainer passes to
    `agg_loss`; `agg_loss` alone would count only the sequences that keep a token)."""
    before = core.Totals.of(minibatch, step.sequence)
    if step.correction is None or not any(not bool(k.all()) for k in _keeps(step, minibatch)):
        return before
    kept = {core.sample_key(s): int(k.sum()) for s, k in zip(minibatch, _keeps(step, minibatch))}
    tokens = sum(kept.values())
    if step.sequence == "turn":
        return core.Totals(before.samples, tokens)
    per_trajectory: dict[str, int] = {}
    for s in minibatch:
        per_trajectory[s.rollout_id] = per_trajectory.get(s.rollout_id, 0) + kept[core.sample_key(s)]
    return core.Totals(before.samples, tokens, per_trajectory)


def _keeps(step: StepInputs, samples: Sequence[TurnSample]) -> list[torch.Tensor]:
    return [step.correction.keep[core.sample_key(s)] for s in samples]


def corrected(step: StepInputs, part: Sequence[TurnSample], new: TokenLogprobs) -> tuple[TokenLogprobs, torch.Tensor | None]:
    """`new` with rejected tokens masked out, and the token weights [n, L] (or None); with a
    correction the learner's own truncated weight (`new.sampled`) no longer applies."""
    if step.correction is None:
        return new, None
    keep = core.pad_rows([k.float() for k in _keeps(step, part)], new.mask.shape[1]).to(new.mask.device) > 0.5
    masked = TokenLogprobs(new.logprobs, new.mask & keep, entropy=new.entropy)
    if step.correction.weights is None:
        return masked, None
    return masked, core.gather(step.correction.weights, part, new.logprobs).detach()


def token_loss(
    cfg: Any, step: StepInputs, part: Sequence[TurnSample], new: TokenLogprobs, old_logprobs: torch.Tensor,
    token_advantages: torch.Tensor, ref: Any, totals: core.Totals,
) -> tuple[torch.Tensor, Any]:
    """The token-level clipped surrogate (+ KL, entropy) of GRPO, PPO and the turn-credit methods with the
    config's clip, KL, aggregation and correction options. `old_logprobs` and `token_advantages` are [n, L]
    like `new.logprobs`; `totals` is the minibatch's (`totals(step, minibatch)`)."""
    kept, is_weights = corrected(step, part, new)
    return core.token_policy_loss(
        kept,
        old_logprobs,
        token_advantages,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        clip_ratio_c=cfg.clip_ratio_c,
        ref=core.gather(ref, part, new.logprobs) if ref is not None else None,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        loss_agg=cfg.loss_agg,
        totals=totals.part(part),
        loss_scale_factor=cfg.loss_scale_factor,
        rollout_is_weights=is_weights,
        entropy_coeff=cfg.entropy_coeff,
    )


def sequence_loss(
    cfg: Any, step: StepInputs, part: Sequence[TurnSample], new: TokenLogprobs, old_logprobs: torch.Tensor,
    advantages: torch.Tensor, ref: Any, totals: core.Totals, **aggregation: Any,
) -> tuple[torch.Tensor, Any]:
    """The sequence-level clipped surrogate (+ KL, entropy) of GSPO and SeeUPO with the config's clip, KL
    and correction options. `advantages` has one weight per row of `part`; `totals` is the part's
    (`totals(step, minibatch)`, `.part(part)` where sequences are trajectories); `aggregation` passes
    `loss_agg` and friends to `core.sequence_policy_loss` where the algorithm has them."""
    kept, is_weights = corrected(step, part, new)
    return core.sequence_policy_loss(
        kept,
        old_logprobs,
        advantages,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        ref=core.gather(ref, part, new.logprobs) if ref is not None else None,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        totals=totals,
        rollout_is_weights=sequence_weights(new, kept, is_weights, step, totals),
        entropy_coeff=cfg.entropy_coeff,
        **aggregation,
    )


def sequence_weights(
    new: TokenLogprobs, masked: TokenLogprobs, token_weights: torch.Tensor | None, step: StepInputs, part_totals: core.Totals
) -> torch.Tensor | None:
    """Per-row correction weights for a sequence-level loss: the sequence's weight (constant over all
    its tokens, rejected or not), 0 where rejection left its sequence no token; None without a
    correction. `new`: the rows before rejection; `part_totals`: `totals(..).part(part)`."""
    if step.correction is None:
        return None
    if part_totals.row_sequence_tokens is not None:  # the sequence is the row's trajectory
        has = torch.tensor([n > 0 for n in part_totals.row_sequence_tokens], device=new.mask.device)
    else:
        has = masked.mask.any(-1)
    has = has.to(new.logprobs.dtype)
    if token_weights is None:
        return has
    return core.masked_mean(token_weights, new.mask, dim=-1) * has


def minimize(learner: Learner, minibatch: Sequence[TurnSample], loss: MicroLoss, cfg: LossOptionsConfig, **kwargs: Any):
    """`learner.minimize`, asking for the token entropy only when the loss needs it."""
    if cfg.entropy_coeff:
        kwargs["entropy"] = True
    return learner.minimize(minibatch, loss, **kwargs)
