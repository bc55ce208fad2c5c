"""SeeUPO on stock verl (0.9.1): one step driven from the controller with verl's actor calls.

A verl batch has one row per trajectory: prompt + the whole multi-turn response, `response_mask` 1 on
sampled tokens and 0 on tool / user tokens. `seeupo_step` turns it into the paper's Algorithm 1
without touching verl's internals; the math is the kit's (`seeupo_gym.algorithms.seeupo`, `core`):

1. turn t of row i = its t-th span of sampled tokens: `turn_spans` recorded by our `seeupo_env`
   agent loop, or else the runs of 1s of `response_mask` (verl's own tool agent loop);
2. `M_i <- normalize(A_i)`: GRAE over the rows (`uid` groups, reward = sum of `token_level_scores`);
3. for t in the order (reverse by default): `actor.update_actor` on the rows that have a turn t, with
   `response_mask` = turn t's tokens and `advantages` = M_i on them; verl's own `gspo` loss with
   `seq-mean-token-mean` then is `-mean_i clip_obj(s(y_{i,t}), M_i)` (+ its KL loss on those tokens);
4. `actor.compute_log_prob` on those rows at the new parameters: `M_i <- M_i * s(y_{i,t})`.

`actor` is verl's actor worker group (`VerlWorkerActor` adapts `actor_rollout_wg`) or anything with
`compute_log_prob(DataProto) -> DataProto["old_log_probs"]` and `update_actor(DataProto) -> DataProto`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Protocol

import numpy as np
import torch
from verl import DataProto

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.seeupo import OLD_POLICIES, ORDERS, m_weight, update_order

# More turns than this in one row is not a conversation but a malformed row.
MAX_TURNS = 4096
# verl's actor options SeeUPO needs as they are: anything else changes the loss it computes.
REQUIRED_ACTOR = {"policy_loss.loss_mode": "gspo", "loss_agg_mode": "seq-mean-token-mean"}


@dataclass
class VerlSeeUPOConfig:
    """`algorithm.seeupo.*` in verl's config (see the kit's `SeeUPOConfig` for each option)."""

    order: str = "reverse"  # reverse | natural | random
    normalization: str = "batch"  # GRAE: none | group | batch
    m_clip: tuple[float, float] | None = None  # the authors' code: [0.8, 1.2]
    old_policy: str = "step_start"  # step_start (the paper) | turn_start (the authors' code)
    seed: int = 0  # of the `random` order

    def __post_init__(self) -> None:
        for name, choices in (("order", ORDERS), ("normalization", core.NORMALIZATIONS), ("old_policy", OLD_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"algorithm.seeupo.{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.m_clip is not None:
            low, high = (float(x) for x in self.m_clip)
            if not 0 <= low <= 1 <= high:
                raise ValueError(f"algorithm.seeupo.m_clip must be [low, high] with 0 <= low <= 1 <= high, got {self.m_clip}")
            self.m_clip = (low, high)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> "VerlSeeUPOConfig":
        options = dict(options or {})
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"algorithm.seeupo has no option {unknown}; it takes {[f.name for f in fields(cls)]}")
        if options.get("m_clip") is not None:
            options["m_clip"] = tuple(options["m_clip"])
        return cls(**options)


class SeeUPOActor(Protocol):
    def compute_log_prob(self, data: DataProto) -> DataProto: ...

    def update_actor(self, data: DataProto) -> DataProto: ...


def check_actor_options(actor_options: Mapping[str, Any]) -> None:
    """Refuse, in one line, verl actor options under which the pools' updates are not SeeUPO's."""
    for key, wanted in REQUIRED_ACTOR.items():
        value: Any = actor_options
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value != wanted:
            raise ValueError(f"SeeUPO needs actor_rollout_ref.actor.{key}={wanted} (got {value!r})")
    if actor_options.get("ppo_epochs", 1) != 1:
        raise ValueError("SeeUPO's verl trainer runs one epoch per pool: set actor_rollout_ref.actor.ppo_epochs=1")


# ------------------------------------------------------------------------------- turn pools


def mask_runs(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s: the turns of a row from verl's tool agent loop."""
    values = [int(v) for v in mask_row.tolist()]
    runs, start = [], None
    for k, v in enumerate(values + [0]):
        if v and start is None:
            start = k
        elif not v and start is not None:
            runs.append((start, k))
            start = None
    return runs


def checked_spans(raw: Any, mask_row: torch.Tensor, row: int) -> list[tuple[int, int]]:
    """Recorded turn spans of one row, refused in one line unless they are in-range, ordered,
    disjoint [start, end) pairs of ints over sampled tokens (mask 1)."""
    if isinstance(raw, np.ndarray):
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"row {row}: turn_spans must be a list of [start, end] pairs, got {type(raw).__name__}")
    if len(raw) > MAX_TURNS:
        raise ValueError(f"row {row}: {len(raw)} turn spans, more than {MAX_TURNS}")
    spans, length, previous_end = [], mask_row.shape[0], 0
    for span in raw:
        if isinstance(span, np.ndarray):
            span = span.tolist()
        if (not isinstance(span, (list, tuple)) or len(span) != 2
                or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in span)):
            raise ValueError(f"row {row}: a turn span must be [start, end] ints, got {span!r:.80}")
        start, end = int(span[0]), int(span[1])
        if not previous_end <= start < end <= length:
            raise ValueError(f"row {row}: turn span [{start}, {end}) is empty, out of [0, {length}) or overlaps the one before")
        if not bool(mask_row[start:end].all()):
            raise ValueError(f"row {row}: turn span [{start}, {end}) covers tokens with response_mask 0")
        spans.append((start, end))
        previous_end = end
    return spans


def turn_spans(batch: DataProto) -> list[list[tuple[int, int]]]:
    """Each row's turns: its recorded `turn_spans`, else the runs of 1s of its response_mask."""
    mask = batch.batch["response_mask"]
    recorded = batch.non_tensor_batch.get("turn_spans")
    if recorded is None:
        return [mask_runs(mask[i]) for i in range(len(batch))]
    return [checked_spans(recorded[i], mask[i], i) for i in range(len(batch))]


def turn_mask(spans: list[list[tuple[int, int]]], t: int, shape: torch.Size) -> torch.Tensor:
    """[rows, R] mask of turn t's tokens (0 on rows without a turn t)."""
    mask = torch.zeros(shape, dtype=torch.long)
    for i, row in enumerate(spans):
        if len(row) >= t:
            start, end = row[t - 1]
            mask[i, start:end] = 1
    return mask


def trajectory_rewards(batch: DataProto) -> torch.Tensor:
    rewards = batch.batch["token_level_scores"].sum(-1).to(torch.float64)
    bad = [i for i, r in enumerate(rewards.tolist()) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"rows {bad[:5]} have a non-finite reward; SeeUPO refuses the batch")
    return rewards


def group_index(batch: DataProto) -> torch.Tensor:
    uids = batch.non_tensor_batch.get("uid")
    if uids is None or len(uids) != len(batch):
        raise ValueError("SeeUPO needs a `uid` (the group of each row) in non_tensor_batch")
    names: dict[str, int] = {}
    return torch.tensor([names.setdefault(str(u), len(names)) for u in uids])


# ------------------------------------------------------------------------------- the step


def seeupo_step(batch: DataProto, actor: SeeUPOActor, config: VerlSeeUPOConfig, generator: torch.Generator | None = None
                ) -> dict[str, float]:
    """One SeeUPO step on `batch` through `actor`'s verl calls (module doc). Returns SeeUPO's metrics."""
    if len(batch) == 0:
        raise ValueError("SeeUPO got an empty batch")
    generator = generator or torch.Generator().manual_seed(config.seed)
    spans = turn_spans(batch)  # checks before anything runs
    advantages = core.group_advantages(trajectory_rewards(batch), group_index(batch), config.normalization).tolist()
    mask = batch.batch["response_mask"]
    old = None
    if config.old_policy == "step_start":
        old = batch.batch["old_log_probs"] if "old_log_probs" in batch.batch.keys() else log_probs(actor, batch)
    factor = [1.0] * len(batch)  # prod of s(y_{i,t'}) over the turns already updated
    pools = [(t, [i for i, row in enumerate(spans) if len(row) >= t])
             for t in update_order(max((len(row) for row in spans), default=0), config.order, generator)]
    pools = [(t, rows) for t, rows in pools if rows]
    metrics: dict[str, float] = {"seeupo/turn_pools": float(len(pools))}
    for position, (t, rows) in enumerate(pools):
        pool = batch.select_idxs(rows)
        pool_old = log_probs(actor, pool) if old is None or config.old_policy == "turn_start" else old[rows]
        pool_mask = turn_mask([spans[i] for i in rows], t, mask[rows].shape)
        weights = torch.tensor([m_weight(advantages[i], factor[i], config.m_clip) for i in rows], dtype=torch.float32)
        pool.batch["response_mask"] = pool_mask
        pool.batch["old_log_probs"] = pool_old
        pool.batch["advantages"] = weights[:, None] * pool_mask
        pool.meta_info.setdefault("seeupo_turn", t)
        output = actor.update_actor(pool)
        for key, value in (getattr(output, "meta_info", None) or {}).get("metrics", {}).items():
            if isinstance(value, (int, float)):
                metrics[f"seeupo/turn{t}/{key}"] = float(value)
        later = {i for _, rows_after in pools[position + 1 :] for i in rows_after}
        measured = [k for k, i in enumerate(rows) if i in later]
        if measured:  # M_i <- M_i * s(y_{i,t}) at the updated parameters
            new = log_probs(actor, pool.select_idxs(measured))
            ratios = core.sequence_ratio(new, pool_old[measured], pool_mask[measured].bool()).tolist()
            for k, ratio in zip(measured, ratios):
                factor[rows[k]] *= ratio
    final_m = torch.tensor([m_weight(a, f, config.m_clip) for a, f in zip(advantages, factor)])
    metrics.update({"seeupo/m_mean": float(final_m.mean()), "seeupo/m_abs_max": float(final_m.abs().max())})
    return metrics


def log_probs(actor: SeeUPOActor, data: DataProto) -> torch.Tensor:
    return actor.compute_log_prob(data).batch["old_log_probs"].float()


class VerlWorkerActor:
    """verl's actor worker group (`RayPPOTrainer.actor_rollout_wg`, any engine) as a `SeeUPOActor`.

    Log-probs go through the trainer's own `_compute_old_log_prob`. The update repeats
    `RayPPOTrainer._update_actor`'s conversion with one change: the pool is one mini-batch and its own
    `global_batch_size` (verl's would divide the pool's seq-mean by `ppo_mini_batch_size * n` rows).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def compute_log_prob(self, data: DataProto) -> DataProto:
        old_log_prob, _ = self.trainer._compute_old_log_prob(data)
        return old_log_prob

    def update_actor(self, data: DataProto) -> DataProto:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        config = self.trainer.config.actor_rollout_ref
        world = self.trainer.actor_rollout_wg.world_size
        if len(data) % world:
            raise ValueError(f"a turn pool of {len(data)} rows does not split over {world} data-parallel workers; "
                             "use a batch whose pools are multiples of the world size")
        data.meta_info["multi_turn"] = config.rollout.multi_turn.enable
        data.meta_info["temperature"] = config.rollout.temperature
        batch_td = left_right_2_no_padding(data.to_tensordict())
        tu.assign_non_tensor(
            batch_td,
            calculate_entropy=config.actor.calculate_entropy or config.actor.entropy_coeff != 0.0,
            distillation_use_topk=False,
            distillation_only=False,
            global_batch_size=len(data),
            mini_batch_size=len(data),
            epochs=1,
            seed=config.actor.data_loader_seed,
            dataloader_kwargs={"shuffle": False},
            compute_loss=True,
        )
        output = tu.get(self.trainer.actor_rollout_wg.update_actor(batch_td), "metrics")
        return DataProto.from_single_dict(data={}, meta_info={"metrics": {f"actor/{k}": v for k, v in output.items()}})
