"""SeeUPO: sequence-level sequential update, SeeUPPO-GRAE (the paper's Algorithm 1).

1. `M_i <- normalize(A_i)` for every trajectory i (GRAE, default `batch` normalization).
2. For t in the update order (reverse T_max..1 by default; `natural` 1..T_max; `random`: a fresh
   permutation per step), skipping empty pools: update on the turn pool D_t alone with
   `-mean_{i in D_t} clip_obj(s(y_{i,t}), M_i)` + KL on turn t's tokens (epochs x minibatches);
   then, with the updated parameters, `M_i <- M_i * s(y_{i,t})` (detached) for every i in D_t.
3. The next step samples with the final parameters.

Episodes of different lengths (one that ended before turn t, e.g. at a TurnBandit `stopping` stop):
the kit leaves it out of D_t (`RolloutBatch.turn_pool`: the trajectories that reached turn t), where
the paper pads D_t with a no-op placeholder. Both give the same update, up to its size: a no-op has
no tokens, so its s is a constant 1 (no gradient) and its M is never read by a later pool; it adds
a constant to pool t's objective and nothing to the gradient or to any M. What differs is the
denominator: the kit's loss is the mean over D_t, a padded pool's the mean over all N, so the paper's
step on pool t is |D_t|/N of the kit's (exactly, under SGD with one minibatch per pool). Adam
rescales that away where each parameter serves one turn: on the tabular policy the two differ by
4e-8 in a 0.22 step (not measured where turns share parameters, as an LLM's). The kit keeps the
mean over D_t so that a late pool of a few long episodes still takes a full step and its
minibatches hold real turns only. M_i starts from the trajectory's own GRAE advantage over all N,
not a per-turn-index baseline (biased where the policy decides when to stop: docs/algorithms.md).
Tested against Algorithm 1 written out with early ends, both orders, on hand-made and sampled
TurnBandit `stopping` batches, and against the placeholder form with its step rescaled by N/|D_t|
(SGD) or under Adam (tests/test_seeupo_shared_pass.py).

Ratios are taken against theta_k, the parameters at the start of the step (`old_policy:
step_start`), as in the paper's equations; `turn_start` recomputes the "old" logprobs of each
pool just before its update, as the authors' code does (a different estimator; `seeupo_authors`,
algorithms/seeupo_authors.py, is their computation whole: padded pools, clamped advantages, M's
factor clipped per turn and kept by row position). `M` is keyed
by rollout_id, so shuffling a pool into minibatches never moves a weight to another sample. `s(y)` is
GSPO's, `log s` clamped above at 10 as verl's, in the loss and in M alike; a response without tokens
is no sequence (no loss; its s is 1).

Cost: the frozen passes (old, reference) score each trajectory once, packed; the gradient passes
of pool t are inherently prefix-length (context_t + response_t per trajectory), because the
parameters change between pools. The ratios after pool t are taken at the parameters the next
pool's first gradient pass runs with, so that pass scores them too (turn t packs with the
trajectory's next-updated turn into one sequence): no extra pass, unless a context was rebuilt.
That sharing needs a learner that says it can (`measures_alongside`: it keeps a packed sequence in
one part and sums the parts' diagnostics); any other learner, and any update with an `on_phase`
callback (which must see `ratios_after` filled), gets a separate ratio pass: the same numbers.

verl's options (algorithms/options.py): `use_kl_in_reward` (the penalized rewards give A_i, so M
starts from them), `entropy_coeff` (per-sequence entropy of the pool's turns), `rollout_correction`
(per turn, against the step-start policy; it reweights and masks the pool losses, while the ratios
that update M stay over every token), every `kl_estimator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms import core, options
from seeupo_gym.algorithms.base import Algorithm, Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.budget import UpdateBudget, minibatch_cut
from seeupo_gym.algorithms.rollout import RolloutBatch, TurnSample

ORDERS = ("reverse", "natural", "random")
OLD_POLICIES = ("step_start", "turn_start")


@dataclass
class SeeUPOConfig(options.LossOptionsConfig):
    # GRAE normalization of the initial M: none | group | batch.
    normalization: str = "batch"
    # Turn update order: reverse (T_max..1) | natural (1..T_max) | random (new permutation each step).
    order: str = "reverse"
    # Where ratios are anchored: step_start (theta_k, the paper) | turn_start (the authors' code).
    old_policy: str = "step_start"
    # Optional [low, high] clip of M's importance factor prod_{t' updated} s(y_{i,t'}) (the sign of A_i is
    # kept); None (default) = no clipping. The authors' code uses [0.8, 1.2].
    m_clip: tuple[float, float] | None = None
    # Measure the ratios after pool t inside the next pool's first gradient pass (same numbers, one
    # policy pass fewer per pool) where the learner allows it (`measures_alongside`) and no `on_phase`
    # callback waits for them; false: always a separate frozen pass, as a reference for that.
    share_ratio_pass: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("normalization", core.NORMALIZATIONS)
        self.require_choice("order", ORDERS)
        self.require_choice("old_policy", OLD_POLICIES)
        self.refuse_token_weights_on_sequences("SeeUPO")
        if self.m_clip is not None:
            low, high = self.m_clip
            if not 0 <= low <= 1 <= high:
                raise ValueError(f"m_clip must be [low, high] with 0 <= low <= 1 <= high, got {self.m_clip}")
            self.m_clip = (float(low), float(high))


def m_weight(advantage: float, factor: float, m_clip: tuple[float, float] | None) -> float:
    """`M_i = A_i * clip(prod_{t' updated} s(y_{i,t'}))`: the advantage times its importance factor, clipped to
    `m_clip` when given (the sign of A_i is kept). Shared with the verl and TRL trainers."""
    return advantage * (factor if m_clip is None else min(max(factor, m_clip[0]), m_clip[1]))


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

    def budget(self, batch: RolloutBatch, generator: torch.Generator | None = None) -> UpdateBudget | None:
        # Epochs x minibatches on each non-empty pool D_t, in any order; a pool holds one sample per
        # trajectory, so its cut does not depend on the shuffle. The ratios measured inside a gradient
        # pass are not trained on (`budget.CountingLearner`).
        batch = self.selected(batch)
        pools = [batch.turn_pool(t) for t in range(1, batch.max_turns + 1)]
        cuts = [minibatch_cut(pool, self.config.minibatch_size, self.config.epochs) for pool in pools if pool]
        return sum(cuts, UpdateBudget())  # type: ignore[arg-type]

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        cfg = self.config
        self.schedule = []
        samples = batch.samples()
        old = core.frozen_logprobs(learner, samples) if cfg.old_policy == "step_start" else {}
        ref = core.frozen_logprobs(learner, samples, reference=True) if cfg.kl_coef > 0 else None
        step = options.prepare_step(self, batch, learner, samples, old=old or None, ref=ref, sequence="turn")
        advantages = core.trajectory_advantages(batch, cfg.normalization, step.rewards)  # step 1
        factor = {rid: 1.0 for rid in advantages}  # prod of s(y_{i,t'}) over turns already updated

        def weight(rid: str, ratio: float = 1.0) -> float:  # M_i (times a ratio not yet applied)
            return m_weight(advantages[rid], factor[rid] * ratio, cfg.m_clip)

        def apply_ratios(phase: UpdatePhase, ratios: dict[str, float]) -> None:  # M_i <- M_i * s(y_{i,t})
            for rid, ratio in ratios.items():
                factor[rid] *= ratio
                phase.ratios_after[rid] = ratio

        def measure_apart(phase: UpdatePhase, samples: list[TurnSample]) -> None:  # a frozen ratio pass
            ratios = core.frozen_sequence_ratios(core.frozen_logprobs(learner, samples), old, samples).tolist()
            apply_ratios(phase, dict(zip([s.rollout_id for s in samples], ratios)))

        share = cfg.share_ratio_pass and self.on_phase is None and bool(getattr(learner, "measures_alongside", False))
        pools = [(t, batch.turn_pool(t)) for t in update_order(batch.max_turns, cfg.order, generator)]
        pools = [(t, pool) for t, pool in pools if pool]
        steps = []
        pending: list[TurnSample] = []  # the pool just updated: samples whose s(y) a later M_i reads
        for position, (t, pool) in enumerate(pools):  # step 2
            if cfg.old_policy == "turn_start":
                old.update(core.frozen_logprobs(learner, pool))
            batches = list(core.minibatches(pool, cfg.minibatch_size, cfg.epochs, generator))
            # M_i <- M_i * s(y_{i,t'}) for the pool t' just updated, at the current parameters: inside
            # this pool's first gradient pass where the sample packs with its trajectory's turn t (one
            # policy pass fewer), else in a frozen pass now.
            shared = core.packing_with(pending, batches[0]) if share else []
            frozen = [s for s in pending if core.sample_key(s) not in {core.sample_key(x) for x in shared}]
            if frozen:
                measure_apart(self.schedule[-1], frozen)

            for k, minibatch in enumerate(batches):
                totals = options.totals(step, minibatch)

                def loss(part, new, ratios):  # ratios: s(y) measured alongside, not yet in M
                    weights = {s.rollout_id: weight(s.rollout_id, ratios.get(s.rollout_id, 1.0)) for s in part}
                    return options.sequence_loss(cfg, step, part, new, core.gather(old, part, new.logprobs),
                                                 core.per_sample(weights, part, new.logprobs), ref, totals)

                extra = shared if k == 0 else []
                metrics = options.minimize(learner, minibatch + extra, core.measuring_alongside(t, extra, old, loss), cfg)
                measured = core.pop_ratio_diagnostics(metrics)
                missing = sorted({s.rollout_id for s in extra} - measured.keys())
                if missing:  # the parameters have moved since: M can no longer be completed
                    raise RuntimeError(
                        f"{type(learner).__name__}.minimize returned no ratio for {missing}: a learner with "
                        f"measures_alongside = True must return its parts' diagnostics summed"
                    )
                if measured:
                    apply_ratios(self.schedule[-1], measured)
                steps.append(metrics)

            later = {s.rollout_id for _, later_pool in pools[position + 1 :] for s in later_pool}
            pending = [s for s in pool if s.rollout_id in later]
            phase = UpdatePhase(t, tuple(s.rollout_id for s in pool), {s.rollout_id: weight(s.rollout_id) for s in pool},
                                len(batches))
            if pending and not share:  # measured now, so that on_phase sees them
                measure_apart(phase, pending)
                pending = []
            self.record_phase(phase)

        metrics = core.mean_metrics(steps)
        final_m = torch.tensor([weight(rid) for rid in advantages])
        metrics.update(m_mean=float(final_m.mean()), m_abs_max=float(final_m.abs().max()) if len(final_m) else 0.0)
        metrics["turn_pools"] = float(len(pools))
        return {**metrics, **step.metrics}


# The authors' variant (`seeupo_authors`) is built on this class and registers with it.
from seeupo_gym.algorithms import seeupo_authors  # noqa: E402,F401
