"""The shared frame of the turn-level credit methods: one advantage per turn, one clipped loss.

Every method of the multi-turn credit study (docs/credit.md) differs only in how it computes the
advantage of each turn sample; the update is GRPO's token-level clipped surrogate + KL with that
advantage broadcast to the turn's response tokens (as each source copies a turn's advantage to its
tokens). A method subclasses `TurnAdvantageAlgorithm` and implements `turn_advantages`.

Per-turn rewards: a trajectory may carry `info["turn_rewards"]` (one float per turn, summing to its
reward; TurnBandit's `turn_rewards=True`, the tabular policy from a task's `turn_rewards`). Without
it, the reward sits on the last turn and every earlier turn has 0 (`turn_rewards`).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core, options
from seeupo_gym.algorithms.base import Algorithm, Learner, UpdatePhase
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory


@dataclass
class TurnCreditConfig(options.LossOptionsConfig):
    loss_agg: str = "token-mean"
    loss_scale_factor: float | None = None
    sequence: str = "trajectory"
    clip_ratio_c: float | None = 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("loss_agg", core.LOSS_AGGREGATIONS)
        self.require_choice("sequence", core.SEQUENCES)
        self.require_dual_clip()
        self.require_scale_factor()
        if self.use_kl_in_reward:
            raise ValueError("use_kl_in_reward is not supported by the turn-level credit methods; set it false")


def turn_rewards(trajectory: Trajectory) -> list[float]:
    """r_1..r_T of a trajectory: `info["turn_rewards"]` when it has them, else 0 ... 0, R."""
    given = trajectory.info.get("turn_rewards")
    if given is not None:
        if len(given) != trajectory.num_turns:
            raise ValueError(
                f"trajectory {trajectory.rollout_id!r} has {len(given)} turn_rewards for {trajectory.num_turns} turns"
            )
        return [float(r) for r in given]
    return [0.0] * (trajectory.num_turns - 1) + [float(trajectory.reward)] if trajectory.num_turns else []


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_t = r_t + gamma G_{t+1}, from the last turn back."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


class TurnAdvantageAlgorithm(Algorithm):
    """A GRPO-shaped update whose advantage is per turn sample, not per trajectory."""

    config_class = TurnCreditConfig
    config: TurnCreditConfig

    @abstractmethod
    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        """The advantage of every turn sample of `batch`, keyed by (rollout_id, t)."""

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        cfg = self.config
        self.schedule = []
        samples = batch.samples()
        old = core.old_logprobs(learner, samples, cfg.minibatch_size, cfg.epochs)
        ref = core.frozen_logprobs(learner, samples, reference=True) if cfg.kl_coef > 0 else None
        step = options.prepare_step(self, batch, learner, samples, old=old, ref=ref, sequence=cfg.sequence)
        advantages = self.turn_advantages(batch, learner)
        # A critic method (turn_gae) leaves its value targets and step-start values here.
        returns, old_values = getattr(self, "value_targets", None), getattr(self, "old_values", None)

        steps = []
        for minibatch in core.minibatches(samples, cfg.minibatch_size, cfg.epochs, generator):
            totals = options.totals(step, minibatch)

            def loss(part, new, values):
                per_turn = torch.tensor(
                    [advantages[core.sample_key(s)] for s in part], dtype=new.logprobs.dtype, device=new.logprobs.device
                )
                policy_loss = options.token_loss(cfg, step, part, new, core.old_or_detached(old, part, new.logprobs),
                                                 per_turn.unsqueeze(1).expand_as(new.logprobs), ref, totals)
                if returns is None:
                    return policy_loss
                policy, stats = policy_loss
                targets = torch.stack([returns[core.sample_key(s)] for s in part]).to(values.dtype).unsqueeze(1)
                start = torch.stack([old_values[core.sample_key(s)] for s in part]).to(values.dtype).unsqueeze(1)
                value_loss = core.clipped_value_loss(
                    values, start.expand_as(values), targets.expand_as(values), new.mask, cfg.value_clip, totals
                )
                return policy + cfg.vf_coef * value_loss, {**vars(stats), "value_loss": float(value_loss.detach())}

            steps.append(options.minimize(learner, minibatch, loss, cfg, values=returns is not None))

        first = {rid: advantages[(rid, 1)] for rid in batch.rollout_ids if (rid, 1) in advantages}
        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), first, len(steps)))
        return {**core.mean_metrics(steps), **step.metrics}


def _register_all() -> None:
    # The methods register themselves on import; `base._load_builtin_algorithms` imports this module.
    from seeupo_gym.algorithms import (  # noqa: F401
        broadcast,
        gigpo,
        mt_grpo,
        mt_grpo_atropos,
        nemo_rl_turn_grpo,
        prime_rl_turn_credit,
        roll_step_reinforce,
        turn_gae,
    )


_register_all()
