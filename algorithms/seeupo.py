"""SeeUPO: sequence-level sequential update, SeeUPPO-GRAE (the paper's Algorithm 1).

1. `M_i <- normalize(A_i)` for every trajectory i (GRAE, default `batch` normalization).
2. For t in the update order (reverse T_max..1 by default; `natural` 1..T_max; `random`: a fresh
   permutation per step), skipping empty pools: update on the turn pool D_t alone with
   `-mean_{i in D_t} clip_obj(s(y_{i,t}), M_i)` + KL on turn t's tokens (epochs x minibatches);
   then, with the updated parameters, `M_i <- M_i * s(y_{i,t})` (detached) for every i in D_t.
3. The next step samples with the final parameters.

Ratios are taken against theta_k, the parameters at the start of the step (`old_policy:
step_start`), as in the paper's equations; `turn_start` recomputes the "old" logprobs of each
pool just before its update, as the authors' code does (a different estimator). `M` is keyed
by rollout_id, so shuffling a pool into minibatches never moves a weight to another sample.

Cost: the frozen passes (old, reference) score each trajectory once, packed; the gradient passes
of pool t are inherently prefix-length (context_t + response_t per trajectory), because the
parameters change between pools; the ratios after pool t cost one more prefix-length pass over
the trajectories that still have a pool to come.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Algorithm, AlgorithmConfig, Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch

ORDERS = ("reverse", "natural", "random")
OLD_POLICIES = ("step_start", "turn_start")


@dataclass
class SeeUPOConfig(AlgorithmConfig):
    # GRAE normalization of the initial M: none | group | batch.
    normalization: str = "batch"
    # Turn update order: reverse (T_max..1) | natural (1..T_max) | random (new permutation each step).
    order: str = "reverse"
    # Where ratios are anchored: step_start (theta_k, the paper) | turn_start (the authors' code).
    old_policy: str = "step_start"
    # Optional [low, high] clip of M's importance factor prod_{t' updated} s(y_{i,t'}) (the sign of A_i is
    # kept); None (default) = no clipping. The authors' code uses [0.8, 1.2].
    m_clip: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("normalization", core.NORMALIZATIONS)
        self.require_choice("order", ORDERS)
        self.require_choice("old_policy", OLD_POLICIES)
        if self.m_clip is not None:
            low, high = self.m_clip
            if not 0 <= low <= 1 <= high:
                raise ValueError(f"m_clip must be [low, high] with 0 <= low <= 1 <= high, got {self.m_clip}")
            self.m_clip = (float(low), float(high))


def update_order(max_turns: int, order: str, generator: torch.Generator) -> list[int]:
    """The turns 1..max_turns in the order their pools are updated."""
    if order == "reverse":
        return list(range(max_turns, 0, -1))
    if order == "natural":
        return list(range(1, max_turns + 1))
    return [t + 1 for t in torch.randperm(max_turns, generator=generator).tolist()]


@register_algorithm("seeupo")
class SeeUPO(Algorithm):
    config_class = SeeUPOConfig
    config: SeeUPOConfig

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        cfg = self.config
        self.schedule = []
        advantages = core.trajectory_advantages(batch, cfg.normalization)  # step 1
        factor = {rid: 1.0 for rid in advantages}  # prod of s(y_{i,t'}) over turns already updated
        samples = batch.samples()
        old = core.frozen_logprobs(learner, samples) if cfg.old_policy == "step_start" else {}
        ref = core.frozen_logprobs(learner, samples, reference=True) if cfg.kl_coef > 0 else None

        def weight(rid: str) -> float:  # M_i
            f = factor[rid] if cfg.m_clip is None else min(max(factor[rid], cfg.m_clip[0]), cfg.m_clip[1])
            return advantages[rid] * f

        pools = [(t, batch.turn_pool(t)) for t in update_order(batch.max_turns, cfg.order, generator)]
        pools = [(t, pool) for t, pool in pools if pool]
        steps = []
        for position, (t, pool) in enumerate(pools):  # step 2
            if cfg.old_policy == "turn_start":
                old.update(core.frozen_logprobs(learner, pool))
            weights = {s.rollout_id: weight(s.rollout_id) for s in pool}
            steps_before = len(steps)
            for minibatch in core.minibatches(pool, cfg.minibatch_size, cfg.epochs, generator):
                totals = core.Totals.of(minibatch)

                def loss(part, new, values):
                    return core.sequence_policy_loss(
                        new,
                        core.gather(old, part, new.logprobs),
                        core.per_sample(weights, part, new.logprobs),
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        ref=core.gather(ref, part, new.logprobs) if ref is not None else None,
                        kl_coef=cfg.kl_coef,
                        kl_estimator=cfg.kl_estimator,
                        totals=totals,
                    )

                steps.append(learner.minimize(minibatch, loss))

            # M_i is read again only if trajectory i has a turn in a pool still to come; the forward
            # pass for s(y_{i,t}) is spent on those samples alone (none after the last pool).
            later = {s.rollout_id for _, later_pool in pools[position + 1 :] for s in later_pool}
            needed = [s for s in pool if s.rollout_id in later]
            ratios_after: dict[str, float] = {}
            if needed:
                after = core.frozen_logprobs(learner, needed)
                ratios = core.frozen_sequence_ratios(after, old, needed).tolist()
                for s, ratio in zip(needed, ratios):
                    ratios_after[s.rollout_id] = ratio
                    factor[s.rollout_id] *= ratio  # M_i <- M_i * s(y_{i,t})
            self.record_phase(
                UpdatePhase(t, tuple(s.rollout_id for s in pool), weights, len(steps) - steps_before, ratios_after)
            )

        metrics = core.mean_metrics(steps)
        final_m = torch.tensor([weight(rid) for rid in advantages])
        metrics.update(m_mean=float(final_m.mean()), m_abs_max=float(final_m.abs().max()) if len(final_m) else 0.0)
        metrics["turn_pools"] = float(len(pools))
        return metrics
