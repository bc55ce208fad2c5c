"""SeeUPO as its authors' code computes it (`seeupo_authors`): the update behind the paper's numbers.

Source: github.com/modelscope/AgentEvolver, branch `seeupo`, commit e59dea41e7211f31d04993bbb28c6666bd153e73,
`beyondagent/module/trainer/ba_ray_trainer.py` (`compute_grpo_outcome_advantage_local` with `special_norm`,
`compute_advantage`, `update_ratios`, the sequential loop of `fit`, `_balance_batch`),
`beyondagent/module/env_manager/env_manager.py` (`trajectories_to_samples_list`) and
`context_manager_templates/cmt_linear_think.py` (`group_tokenize_turns`, `tokenize_steps_pure_padding`).
Where it differs from Algorithm 1 (`seeupo.py`; docs/algorithms.md lists each with its source line):

1. Pools: every trajectory yields exactly `max_steps` rows, one per turn pool; past its last turn a
   row is a copy of that last turn with loss mask 0 that carries the trajectory's reward. The loss
   mask zeroes only its advantage: the actor's loss runs over `response_mask`, the response's
   attention (`compute_response_mask`), so a padding row is a sequence of the pool's mean with
   advantage 0 whose tokens still take the KL term (its last turn pulled to the reference once more
   per padding pool), and it gets a ratio (its last turn re-scored) like any row. Every pool has all
   N rows: `max_steps` optimizer steps per step always.
2. Advantage: `A_i = R_i - mean_{group(i)} R` (a group of one keeps its raw R_i: mean 0), then
   z-scored over the pool's N rows, padding included (unbiased std, no eps; centred only when the std
   is <= 1e-6), then clamped to [-3, 3]. Every pool holds the same N rewards, so A is the same in each.
3. M: after each pool, each row's length-normalized ratio `s` is clipped to [1 - low, 1 + high] and
   multiplies the row's factor, and the product is clipped again (`m_clip`, [0.8, 1.2] there).
4. Alignment: the factors are a tensor by row position, and verl's `balance_batch` reorders every
   turn's batch before its update, so row j's factor after pool t weights whichever trajectory lands
   on row j in the next pool. `m_alignment: position` reproduces that (a permutation per pool, given,
   or simulated as `balance_batch` does from the rows' token counts over `balance_world_size` ranks);
   `rollout` (default) keys the factor by trajectory, as Algorithm 1.
Ratios are against the parameters just before each pool (`old_policy: turn_start`, their recompute of
old log-probs per turn); pools run max_steps..1 (`order: reverse`, their SeeUPO launchers'
`update_order: "reverse"`, `launcher/qwen3_bfcl/qwen3-seeupo-bfcl.yaml`: max_steps 10, 8 GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from seeupo_gym.algorithms import core, options
from seeupo_gym.algorithms.base import Learner, UpdatePhase, register_algorithm
from seeupo_gym.algorithms.budget import UpdateBudget, minibatch_cut
from seeupo_gym.algorithms.rollout import RolloutBatch, TurnSample
from seeupo_gym.algorithms.seeupo import SeeUPO, SeeUPOConfig, update_order

M_ALIGNMENTS = ("rollout", "position")
ADVANTAGE_CLAMP = 3.0  # `torch.clamp(scores, -3, 3)` after the batch z-score
FLAT_STD = 1e-6  # below it the z-score only centres


def authors_advantages(rewards: torch.Tensor, group_index: torch.Tensor, clamp: float = ADVANTAGE_CLAMP) -> torch.Tensor:
    """Per row: R_i minus its group's mean (a group of one: mean 0), z-scored over all rows given
    (unbiased std, centred only if the std is <= 1e-6), clamped to [-clamp, clamp]. [N] float64."""
    rewards = rewards.to(torch.float64)
    centred = torch.empty_like(rewards)
    for g in torch.unique(group_index):
        members = group_index == g
        mean = rewards[members].mean() if int(members.sum()) > 1 else torch.zeros((), dtype=rewards.dtype)
        centred[members] = rewards[members] - mean
    if len(centred) > 1 and float(centred.std()) > FLAT_STD:
        centred = (centred - centred.mean()) / centred.std()
    else:
        centred = centred - centred.mean()
    return centred.clamp(-clamp, clamp)


def clipped_product(factor: torch.Tensor, ratio: torch.Tensor, m_clip: tuple[float, float] | None) -> torch.Tensor:
    """`clip(factor * clip(ratio))`: one pool's step of the authors' M factor (no clip if m_clip is None)."""
    if m_clip is None:
        return factor * ratio
    low, high = m_clip
    return (factor * ratio.clamp(low, high)).clamp(low, high)


def balance_order(lengths: Sequence[int], world_size: int) -> list[int]:
    """The row order verl's `balance_batch` gives a batch whose rows have these token counts:
    row j of the reordered batch is row `order[j]` of the original (`get_seqlen_balanced_partitions`,
    equal sizes, partitions concatenated). One rank, or a batch that does not split: unchanged."""
    if world_size <= 1 or len(lengths) < world_size or len(lengths) % world_size:
        return list(range(len(lengths)))
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions  # verl's own balancing

    partitions = get_seqlen_balanced_partitions(list(lengths), k_partitions=world_size, equal_size=True)
    return [j for partition in partitions for j in partition]


class MFactors:
    """The authors' ratio product, by trajectory (`rollout`) or by row position (`position`).

    `rows`: the trajectory (index 0..N-1) on each row of a pool, in the pool's row order."""

    def __init__(self, size: int, alignment: str, m_clip: tuple[float, float] | None) -> None:
        if alignment not in M_ALIGNMENTS:
            raise ValueError(f"m_alignment must be one of {M_ALIGNMENTS}, got {alignment!r}")
        self.alignment, self.m_clip = alignment, m_clip
        self.factor = torch.ones(size, dtype=torch.float64)

    def _slots(self, rows: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(rows), dtype=torch.long) if self.alignment == "rollout" else torch.arange(len(rows))

    def of(self, rows: Sequence[int]) -> torch.Tensor:
        """The factor each row of the pool is weighted by, in row order."""
        return self.factor[self._slots(rows)]

    def update(self, rows: Sequence[int], ratios: torch.Tensor) -> None:
        """After the pool: each row's factor <- clip(factor * clip(s)), s = that row's ratio."""
        slots = self._slots(rows)
        self.factor[slots] = clipped_product(self.factor[slots], ratios.to(torch.float64), self.m_clip)


@dataclass
class SeeUPOAuthorsConfig(SeeUPOConfig):
    # The authors' run: pools max_steps..1, old log-probs recomputed per pool, M's factor in [0.8, 1.2].
    order: str = "reverse"
    old_policy: str = "turn_start"
    m_clip: tuple[float, float] | None = (0.8, 1.2)
    # Pools per step (their rollout.multi_turn.max_steps); None: the batch's longest trajectory.
    max_steps: int | None = None
    # rollout: M by trajectory (Algorithm 1); position: by row, as their tensor after balance_batch.
    m_alignment: str = "rollout"
    # `position`: ranks balance_batch partitions each pool over (their n_gpus_per_node * nnodes); 1: no reorder.
    balance_world_size: int = 1
    advantage_clamp: float = ADVANTAGE_CLAMP
    # Not read here: `normalization` (the authors' advantage replaces it) and `share_ratio_pass` (every
    # row is re-scored after its pool in a frozen pass, padding rows too, as their `update_ratios`).

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("m_alignment", M_ALIGNMENTS)
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or null, got {self.max_steps}")
        if self.balance_world_size < 1:
            raise ValueError(f"balance_world_size must be >= 1, got {self.balance_world_size}")
        if not self.advantage_clamp > 0:
            raise ValueError(f"advantage_clamp must be > 0, got {self.advantage_clamp}")


def padded_pool(batch: RolloutBatch, t: int) -> tuple[list[TurnSample], list[bool]]:
    """Pool t as the authors build it: every trajectory's turn t, or its last turn as a padding row."""
    samples, padding = [], []
    for trajectory in batch:
        last = min(t, trajectory.num_turns)
        samples.append(TurnSample(trajectory.rollout_id, trajectory.group_id, last, trajectory.turns[last - 1], trajectory))
        padding.append(t > trajectory.num_turns)
    return samples, padding


@register_algorithm("seeupo_authors")
class SeeUPOAuthors(SeeUPO):
    """SeeUPO with the authors' pools, advantages, M clipping and (optionally) positional M."""

    config_class = SeeUPOAuthorsConfig
    config: SeeUPOAuthorsConfig
    # `position`: the row order of pool t given (e.g. a run's recorded balance_batch permutation):
    # (t, the pool in batch order) -> order, row j = trajectory order[j]; None: `balance_world_size`.
    row_order: Callable[[int, list[TurnSample]], list[int]] | None = None

    def pools(self, batch: RolloutBatch) -> int:
        return self.config.max_steps or batch.max_turns

    def budget(self, batch: RolloutBatch, generator: torch.Generator | None = None) -> UpdateBudget | None:
        # max_steps pools always, each of all N rows (padding rows are fed and counted: their forward
        # is part of the authors' update too); one row per trajectory, so the cut is shuffle-free.
        batch = RolloutBatch([trajectory for trajectory in self.selected(batch) if trajectory.turns])
        if not len(batch):
            return UpdateBudget()
        cuts = [minibatch_cut(padded_pool(batch, t)[0], self.config.minibatch_size, self.config.epochs)
                for t in range(1, self.pools(batch) + 1)]
        return sum(cuts, UpdateBudget())  # type: ignore[arg-type]

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        cfg = self.config
        self.schedule = []
        batch = RolloutBatch([trajectory for trajectory in batch if trajectory.turns])
        if not len(batch):
            return {"turn_pools": 0.0, "optimizer_steps": 0.0}
        max_steps = self.pools(batch)
        if batch.max_turns > max_steps:
            raise ValueError(f"a trajectory has {batch.max_turns} turns, more than max_steps={max_steps}")
        samples = batch.samples()
        old = core.frozen_logprobs(learner, samples) if cfg.old_policy == "step_start" else {}
        ref = core.frozen_logprobs(learner, samples, reference=True) if cfg.kl_coef > 0 else None
        step = options.prepare_step(self, batch, learner, samples, old=old or None, ref=ref, sequence="turn")
        ids = batch.rollout_ids
        reward_of = step.rewards if step.rewards is not None else batch.rewards()
        group_names = {name: k for k, name in enumerate(batch.groups())}
        advantages = authors_advantages(torch.tensor([reward_of[rid] for rid in ids], dtype=torch.float64),
                                        torch.tensor([group_names[batch[rid].group_id] for rid in ids]),
                                        cfg.advantage_clamp)
        factors = MFactors(len(ids), cfg.m_alignment, cfg.m_clip)
        steps = []
        for t in update_order(max_steps, cfg.order, generator):
            pool, padding = padded_pool(batch, t)
            rows = self._row_order(t, pool)
            pool, padding = [pool[j] for j in rows], [padding[j] for j in rows]
            m = advantages[rows] * factors.of(rows) * ~torch.tensor(padding)  # their advantages x loss_mask
            weight = {core.sample_key(s): float(w) for s, w in zip(pool, m)}
            if cfg.old_policy == "turn_start":
                old.update(core.frozen_logprobs(learner, pool))
            batches = list(core.minibatches(pool, cfg.minibatch_size, cfg.epochs, generator))
            for minibatch in batches:
                totals = options.totals(step, minibatch)

                def loss(part, new, values=None, totals=totals):
                    rows = torch.tensor([weight[core.sample_key(s)] for s in part], dtype=new.logprobs.dtype,
                                        device=new.logprobs.device)
                    return options.sequence_loss(cfg, step, part, new, core.gather(old, part, new.logprobs), rows, ref, totals)

                steps.append(options.minimize(learner, minibatch, loss, cfg))
            # their `update_ratios`: every row, padding too, re-scored at the new parameters
            ratios = core.frozen_sequence_ratios(core.frozen_logprobs(learner, pool), old, pool)
            phase = UpdatePhase(t, tuple(s.rollout_id for s in pool), {s.rollout_id: weight[core.sample_key(s)] for s in pool},
                                len(batches), {s.rollout_id: float(r) for s, r in zip(pool, ratios)})
            factors.update(rows, ratios)
            self.record_phase(phase)
        self.m_factors = factors.factor  # by trajectory (batch order) or by row position: for audits
        metrics = core.mean_metrics(steps)
        final = advantages * factors.factor
        metrics.update(m_mean=float(final.mean()), m_abs_max=float(final.abs().max()), turn_pools=float(max_steps))
        return {**metrics, **step.metrics}

    def _row_order(self, t: int, pool: list[TurnSample]) -> list[int]:
        if self.config.m_alignment == "rollout":
            return list(range(len(pool)))
        if self.row_order is not None:
            order = list(self.row_order(t, pool))
            if sorted(order) != list(range(len(pool))):
                raise ValueError(f"row_order for pool {t} is not a permutation of its {len(pool)} rows")
            return order
        return balance_order([len(s.turn.context_ids) + s.turn.num_response_tokens for s in pool],
                             self.config.balance_world_size)
