"""SeeUPO on stock verl (0.9.1): one step driven from the controller with verl's actor calls.

A verl batch has one row per trajectory: prompt + the whole multi-turn response, `response_mask` 1 on
sampled tokens and 0 on tool / user tokens. `seeupo_step` turns it into the paper's Algorithm 1
without touching verl's internals; the math is the kit's (`seeupo_gym.algorithms.seeupo`, `core`):

1. turn t of row i = its t-th span of sampled tokens: `turn_spans` recorded by our `seeupo_env`
   agent loop (an empty turn is a zero-token span, so later turns keep their index), or else the
   runs of 1s of `response_mask` (verl's own tool agent loop);
2. `M_i <- normalize(A_i)`: GRAE over the rows (`uid` groups, reward = sum of `token_level_scores`);
3. for t in the order (reverse by default): `actor.update_actor` on the rows that have a turn t, with
   `response_mask` = turn t's tokens and `advantages` = M_i on them; verl's own `gspo` loss with
   `seq-mean-token-mean` then is `-mean_i clip_obj(s(y_{i,t}), M_i)` (+ its KL loss on those tokens);
   a row whose turn t is empty counts in the mean and adds nothing else (its s is 1);
4. `actor.compute_log_prob` on those rows at the new parameters: `M_i <- M_i * s(y_{i,t})`.

Cost: each pool's rows are cut at the end of turn t (`trimmed`: responses, masks, log-probs, and the
attention mask per row), so verl's worker, and its dynamic batch sizing, sees prefix-length rows:
causal attention makes the tokens after turn t irrelevant to turn t. The ratio pass after pool t
runs on the same cut rows. The kit shares that pass with the next pool's gradient pass; verl's
calls cannot: `update_actor` returns aggregated metrics only (no per-row log-probs) and its loss
reads only `response_mask` tokens, so the ratios are a `compute_log_prob` call of their own.

Learning rate: verl's worker advances its LR schedule once per `update_actor` call, so one step of T
pools would move it T steps. An actor with `save_lr_schedule` / `restore_lr_schedule`
(`WorkerGroupActor`) has the schedule put back before every pool but the first: every pool runs at
the step's rate and the step advances the schedule by one, as one verl PPO step does.

`actor` is verl's actor worker group through `WorkerGroupActor`, or anything with
`compute_log_prob(DataProto) -> Tensor` and `update_actor(DataProto) -> metrics`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Protocol

import numpy as np
import torch
from verl import DataProto

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.seeupo import OLD_POLICIES, ORDERS, m_weight, update_order
from seeupo_gym.algorithms.seeupo_authors import M_ALIGNMENTS, MFactors, authors_advantages, balance_order

# More turns than this in one row is not a conversation but a malformed row.
MAX_TURNS = 4096
# verl's actor options SeeUPO needs as they are: anything else changes the loss it computes.
REQUIRED_ACTOR = {"policy_loss.loss_mode": "gspo", "loss_agg_mode": "seq-mean-token-mean"}
# meta_info key: the pool's row count, rows left out of the call (empty turns) included.
POOL_ROWS = "seeupo_pool_rows"
# paper: Algorithm 1 (`seeupo_step`); authors: as the authors' code computes it (`seeupo_authors_step`).
VARIANTS = ("paper", "authors")


@dataclass
class VerlSeeUPOConfig:
    """`algorithm.seeupo.*` in verl's config (see the kit's `SeeUPOConfig` for each option)."""

    order: str = "reverse"  # reverse | natural | random
    normalization: str = "batch"  # GRAE: none | group | batch
    m_clip: tuple[float, float] | None = None  # the authors' code: [0.8, 1.2]
    old_policy: str = "step_start"  # step_start (the paper) | turn_start (the authors' code)
    seed: int = 0  # of the `random` order
    # paper | authors (the authors' code: algorithms/seeupo_authors.py; their run also sets old_policy
    # turn_start, m_clip [0.8, 1.2], max_steps 10, m_alignment position, balance_world_size 8). The
    # authors' advantage replaces `normalization`.
    variant: str = "paper"
    m_alignment: str = "rollout"  # authors: M by trajectory (rollout) or by row after balance_batch (position)
    max_steps: int | None = None  # authors: pools per step (their rollout.multi_turn.max_steps); null: longest row
    balance_world_size: int = 1  # authors, position: ranks balance_batch partitions each pool over

    def __post_init__(self) -> None:
        for name, choices in (("order", ORDERS), ("normalization", core.NORMALIZATIONS), ("old_policy", OLD_POLICIES),
                              ("variant", VARIANTS), ("m_alignment", M_ALIGNMENTS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"algorithm.seeupo.{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.m_clip is not None:
            low, high = (float(x) for x in self.m_clip)
            if not 0 <= low <= 1 <= high:
                raise ValueError(f"algorithm.seeupo.m_clip must be [low, high] with 0 <= low <= 1 <= high, got {self.m_clip}")
            self.m_clip = (low, high)
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or int(self.max_steps) < 1):
            raise ValueError(f"algorithm.seeupo.max_steps must be >= 1 or null, got {self.max_steps!r}")
        if int(self.balance_world_size) < 1:
            raise ValueError(f"algorithm.seeupo.balance_world_size must be >= 1, got {self.balance_world_size!r}")

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
    """The two actor calls a step makes (`WorkerGroupActor` serves them from verl's worker group)."""

    def compute_log_prob(self, data: DataProto) -> torch.Tensor: ...  # [rows, response_length], float32

    def update_actor(self, data: DataProto) -> Mapping[str, Any]: ...  # one update on data's response_mask


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


def mask_runs(mask_row: torch.Tensor, row: int = 0) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s: the turns of a row from verl's tool agent loop; more than
    `MAX_TURNS` (one pool update each) is refused as recorded spans are."""
    values = [int(v) for v in mask_row.tolist()]
    runs, start = [], None
    for k, v in enumerate(values + [0]):
        if v and start is None:
            start = k
        elif not v and start is not None:
            runs.append((start, k))
            start = None
    if len(runs) > MAX_TURNS:
        raise ValueError(f"row {row}: {len(runs)} runs of response_mask 1 (turns), more than {MAX_TURNS}")
    return runs


def checked_spans(raw: Any, mask_row: torch.Tensor, row: int) -> list[tuple[int, int]]:
    """Recorded turn spans of one row, refused in one line unless they are in-range, ordered,
    disjoint [start, end) pairs of ints over sampled tokens (mask 1). `start == end` is an empty
    turn (the server sampled nothing): it keeps its index and has no tokens."""
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
        if not previous_end <= start <= end <= length:
            raise ValueError(f"row {row}: turn span [{start}, {end}) is reversed, out of [0, {length}] or overlaps the one before")
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
        return [mask_runs(mask[i], i) for i in range(len(batch))]
    if len(recorded) != len(batch):
        raise ValueError(f"turn_spans has {len(recorded)} rows for a batch of {len(batch)}")
    return [checked_spans(recorded[i], mask[i], i) for i in range(len(batch))]


def turn_mask(spans: list[list[tuple[int, int]]], t: int, shape: torch.Size) -> torch.Tensor:
    """[rows, R] mask of turn t's tokens (0 on rows without a turn t, or whose turn t is empty)."""
    mask = torch.zeros(shape, dtype=torch.long)
    for i, row in enumerate(spans):
        if len(row) >= t:
            start, end = row[t - 1]
            mask[i, start:end] = 1
    return mask


def trimmed(data: DataProto, ends: list[int]) -> DataProto:
    """`data`'s rows cut after response position `ends[i]`: the response-wide tensors (responses, masks,
    log-probs, advantages) to the longest end, and each row's attention mask to its own end, so
    verl's worker (`left_right_2_no_padding`, its dynamic batch sizing) sees prefix-length rows."""
    if len(ends) != len(data):
        raise ValueError(f"{len(ends)} row ends for {len(data)} rows")
    prompt_width, response_width = data.batch["prompts"].shape[1], data.batch["responses"].shape[1]
    width = max(max(ends, default=0), 1)  # verl's padded layout wants a response column
    tensors = {}
    for key, value in data.batch.items():
        if key == "prompts" or value.dim() < 2:
            tensors[key] = value
        elif value.shape[-1] == prompt_width + response_width:  # input_ids, attention_mask, position_ids
            tensors[key] = value[..., : prompt_width + width].clone()
        elif value.shape[1] == response_width:
            tensors[key] = value[:, :width].clone()
        else:
            raise ValueError(f"cannot cut batch field {key!r} of shape {tuple(value.shape)} to the turn's end")
    cut = torch.arange(width)[None, :] >= torch.tensor(ends)[:, None]
    tensors["attention_mask"][:, prompt_width:][cut] = 0
    tensors["response_mask"][cut] = 0
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(data.non_tensor_batch), meta_info=dict(data.meta_info))


def fed_tokens(data: DataProto) -> int:
    """Tokens a verl call on `data` feeds the model: its attention mask summed."""
    return int(data.batch["attention_mask"].sum())


def trajectory_rewards(batch: DataProto) -> torch.Tensor:
    """R_i: the row's token-level rewards summed (KL-in-reward applied where verl computed it)."""
    key = "token_level_rewards" if "token_level_rewards" in batch.batch.keys() else "token_level_scores"
    if key not in batch.batch.keys():
        raise ValueError("the batch has no token_level_rewards or token_level_scores: score it before the SeeUPO step")
    rewards = batch.batch[key].sum(-1).to(torch.float64)
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
    old = step_start_log_probs(batch, actor, spans) if config.old_policy == "step_start" else None
    factor = [1.0] * len(batch)  # prod of s(y_{i,t'}) over the turns already updated
    pools = [(t, [i for i, row in enumerate(spans) if len(row) >= t])
             for t in update_order(max((len(row) for row in spans), default=0), config.order, generator)]
    pools = [(t, rows) for t, rows in pools if rows]
    metrics: dict[str, float] = {"seeupo/turn_pools": float(len(pools))}
    updates = 0
    for position, (t, rows) in enumerate(pools):
        ends = [spans[i][t - 1][1] for i in rows]
        # A row whose turn t is empty counts in the pool's mean (verl v1 counts every row of a
        # mini-batch) and feeds nothing: it is left out of the call, its s(y) is 1.
        fed = [k for k, i in enumerate(rows) if spans[i][t - 1][0] < spans[i][t - 1][1]]
        if not fed:
            continue
        pool = trimmed(batch.select_idxs([rows[k] for k in fed]), [ends[k] for k in fed])
        width = pool.batch["responses"].shape[1]
        pool_mask = turn_mask([spans[rows[k]] for k in fed], t, pool.batch["response_mask"].shape).to(mask.dtype)
        pool.batch["response_mask"] = pool_mask
        pool_old = actor.compute_log_prob(pool) if old is None or config.old_policy == "turn_start" else old[[rows[k] for k in fed], :width]
        weights = torch.tensor([m_weight(advantages[rows[k]], factor[rows[k]], config.m_clip) for k in fed], dtype=torch.float32)
        pool.batch["old_log_probs"] = pool_old
        pool.batch["advantages"] = weights[:, None] * pool_mask
        pool.meta_info[POOL_ROWS] = len(rows)
        _hold_learning_rate(actor, updates)
        for key, value in (actor.update_actor(pool) or {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                metrics[f"seeupo/turn{t}/{key}"] = float(value)
        updates += 1
        later = {i for _, rows_after in pools[position + 1 :] for i in rows_after}
        measured = [k for k, i in enumerate(rows[j] for j in fed) if i in later]
        if measured:  # M_i <- M_i * s(y_{i,t}) at the updated parameters, on the same cut rows
            scored = trimmed(pool.select_idxs(measured), [ends[fed[k]] for k in measured])
            new = actor.compute_log_prob(scored)
            cols = new.shape[1]
            ratios = core.sequence_ratio(new.double(), pool_old[measured, :cols].double(), pool_mask[measured, :cols].bool()).tolist()
            for k, ratio in zip(measured, ratios):
                factor[rows[fed[k]]] *= ratio
    final_m = torch.tensor([m_weight(a, f, config.m_clip) for a, f in zip(advantages, factor)])
    metrics.update({"seeupo/m_mean": float(final_m.mean()), "seeupo/m_abs_max": float(final_m.abs().max()),
                    "seeupo/ratio_product_min": min(factor), "seeupo/ratio_product_max": max(factor)})
    return metrics


def step_start_log_probs(batch: DataProto, actor: SeeUPOActor, spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """The batch's `old_log_probs`, else one frozen pass, each row cut after its last turn."""
    if "old_log_probs" in batch.batch.keys():
        return batch.batch["old_log_probs"].float()
    mask = batch.batch["response_mask"]
    scored = actor.compute_log_prob(trimmed(batch, [row[-1][1] if row else 0 for row in spans]))
    old = torch.zeros(mask.shape, dtype=torch.float32)
    old[:, : scored.shape[1]] = scored[:, : mask.shape[1]]
    return old


def seeupo_authors_step(batch: DataProto, actor: SeeUPOActor, config: VerlSeeUPOConfig,
                        generator: torch.Generator | None = None) -> dict[str, float]:
    """`variant: authors`: one step as the authors' code takes it (algorithms/seeupo_authors.py). Every
    pool t = 1..max_steps holds every row: its turn t, or past its last turn that last turn as a padding
    row (advantage 0, its tokens in the loss's mask, so verl's KL term applies to them; re-scored for M
    like any row). A = `authors_advantages` over the rows; after each pool M's factor <- clip(factor *
    clip(s)), by row (`m_alignment: rollout`) or by position in the pool's order (`position`:
    balance_batch's over `balance_world_size` ranks)."""
    if len(batch) == 0:
        raise ValueError("SeeUPO got an empty batch")
    generator = generator or torch.Generator().manual_seed(config.seed)
    spans = turn_spans(batch)
    empty = [i for i, row in enumerate(spans) if not row]
    if empty:
        raise ValueError(f"rows {empty[:5]} have no turn: the authors' pools pad with a row's last turn")
    max_steps = int(config.max_steps or max(len(row) for row in spans))
    if max(len(row) for row in spans) > max_steps:
        raise ValueError(f"a row has {max(len(row) for row in spans)} turns, more than algorithm.seeupo.max_steps={max_steps}")
    advantages = authors_advantages(trajectory_rewards(batch), group_index(batch))
    old = step_start_log_probs(batch, actor, spans) if config.old_policy == "step_start" else None
    prompt_tokens = batch.batch["attention_mask"][:, : batch.batch["prompts"].shape[1]].sum(-1).tolist()
    factors = MFactors(len(batch), config.m_alignment, config.m_clip)
    metrics: dict[str, float] = {"seeupo/turn_pools": float(max_steps)}
    updates = 0
    for t in update_order(max_steps, config.order, generator):
        turn = [min(t, len(row)) for row in spans]
        ends = [spans[i][turn[i] - 1][1] for i in range(len(batch))]
        rows = (list(range(len(batch))) if config.m_alignment == "rollout"
                else balance_order([p + e for p, e in zip(prompt_tokens, ends)], config.balance_world_size))
        pool = trimmed(batch.select_idxs(rows), [ends[i] for i in rows])
        ratio_mask = turn_mask([[spans[i][turn[i] - 1]] for i in rows], 1, pool.batch["response_mask"].shape)
        ratio_mask = ratio_mask.to(batch.batch["response_mask"].dtype)
        real = torch.tensor([t <= len(spans[i]) for i in rows])
        pool.batch["response_mask"] = ratio_mask
        width = pool.batch["responses"].shape[1]
        pool_old = actor.compute_log_prob(pool) if old is None or config.old_policy == "turn_start" else old[rows, :width]
        weights = (advantages[rows] * factors.of(rows) * real).float()  # their advantages x loss_mask
        fed = [k for k in range(len(rows)) if bool(ratio_mask[k].any())]  # an empty turn feeds nothing
        if fed:
            data = pool.select_idxs(fed)
            data.batch["response_mask"] = ratio_mask[fed]
            data.batch["old_log_probs"] = pool_old[fed]
            data.batch["advantages"] = weights[fed, None] * ratio_mask[fed]
            data.meta_info[POOL_ROWS] = len(rows)
            _hold_learning_rate(actor, updates)
            for key, value in (actor.update_actor(data) or {}).items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    metrics[f"seeupo/turn{t}/{key}"] = float(value)
            updates += 1
        new = actor.compute_log_prob(pool)  # every row, padding too, as their `update_ratios`
        cols = new.shape[1]
        ratios = core.sequence_ratio(new.double(), pool_old[:, :cols].double(), ratio_mask[:, :cols].bool())
        factors.update(rows, ratios)
    final = advantages * factors.factor
    metrics.update({"seeupo/m_mean": float(final.mean()), "seeupo/m_abs_max": float(final.abs().max()),
                    "seeupo/ratio_product_min": float(factors.factor.min()), "seeupo/ratio_product_max": float(factors.factor.max())})
    return metrics


def step_for(config: VerlSeeUPOConfig):
    """The step function of `config.variant`."""
    return seeupo_authors_step if config.variant == "authors" else seeupo_step


def _hold_learning_rate(actor: SeeUPOActor, updates_so_far: int) -> None:
    """Every pool of a step at the step's rate: the schedule as it was before the first pool's update
    (which verl's worker advances at its end) is put back before each later pool's."""
    if updates_so_far == 0:
        getattr(actor, "save_lr_schedule", lambda: None)()
    else:
        getattr(actor, "restore_lr_schedule", lambda: None)()


class WorkerGroupActor:
    """verl's actor worker group (`actor_rollout_wg` of any engine, or one in-process
    `ActorRolloutRefWorker`) as a `SeeUPOActor`, with the conversions verl's own trainer makes
    (`left_right_2_no_padding`, `no_padding_2_padding`).

    A pool is one mini-batch, `global_batch_size` its own row count (`POOL_ROWS`: with its empty
    turns): verl's trainer would divide a pool's seq-mean by `ppo_mini_batch_size * n`, a full
    batch's rows. A pool that does not split over the `dp_size` data-parallel workers is padded
    with copies of its first row whose response_mask is all 0: verl's `seq-mean-*` leaves fully
    masked rows out of its numerator, and `global_batch_size` does not count them.
    """

    def __init__(self, worker_group: Any, *, dp_size: int = 1, temperature: float = 1.0, calculate_entropy: bool = False,
                 seed: int = 42) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.worker_group, self.dp_size, self.temperature = worker_group, dp_size, temperature
        self.calculate_entropy, self.seed = calculate_entropy, seed

    def _padded(self, data: DataProto) -> tuple[DataProto, int]:
        data.meta_info.pop(POOL_ROWS, None)
        rows = len(data)
        extra = -rows % self.dp_size
        if not extra:
            return data, rows
        filler = data.select_idxs([0] * extra)
        filler.batch["response_mask"] = torch.zeros_like(filler.batch["response_mask"])
        if "advantages" in filler.batch.keys():
            filler.batch["advantages"] = torch.zeros_like(filler.batch["advantages"])
        return DataProto.concat([data, filler]), rows

    def compute_log_prob(self, data: DataProto) -> torch.Tensor:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        padded, rows = self._padded(data)
        td = left_right_2_no_padding(padded.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, temperature=self.temperature)
        output = self.worker_group.compute_log_prob(td)
        return no_padding_2_padding(tu.get(output, "log_probs"), td).float()[:rows]

    def update_actor(self, data: DataProto) -> dict[str, Any]:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        pool_rows = int(data.meta_info.get(POOL_ROWS, len(data)))
        padded, _ = self._padded(data)
        td = left_right_2_no_padding(padded.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=self.calculate_entropy, distillation_use_topk=False,
                             distillation_only=False, global_batch_size=pool_rows, mini_batch_size=len(padded), epochs=1,
                             seed=self.seed, dataloader_kwargs={"shuffle": False}, compute_loss=True,
                             temperature=self.temperature)
        metrics = tu.get(self.worker_group.update_actor(td), "metrics") or {}
        return {f"actor/{k}": _mean(v) for k, v in metrics.items() if _mean(v) is not None}

    def save_lr_schedule(self) -> None:
        """Keep, on every rank, the LR schedule's state and the optimizer's rates as they are now."""
        self._on_every_rank(save_lr_schedule)

    def restore_lr_schedule(self) -> None:
        """Put back what `save_lr_schedule` kept (undoing the schedule steps of the updates since)."""
        self._on_every_rank(restore_lr_schedule)

    def _on_every_rank(self, fn: Any) -> None:
        """`fn(worker)` on each worker process: verl's `execute_with_func_generator`, on every rank of a
        Ray worker group (`execute_all_sync`), or directly on one in-process worker."""
        if hasattr(self.worker_group, "execute_all_sync"):
            self.worker_group.execute_all_sync("execute_with_func_generator", fn)
        else:
            self.worker_group.execute_with_func_generator(fn)


def _schedule_of(worker: Any) -> tuple[Any, Any]:
    engine = getattr(getattr(worker, "actor", None), "engine", None)
    scheduler, optimizer = getattr(engine, "lr_scheduler", None), getattr(engine, "optimizer", None)
    if scheduler is None or optimizer is None or not hasattr(scheduler, "state_dict"):
        raise RuntimeError(f"SeeUPO holds the LR schedule through actor.engine.lr_scheduler / .optimizer, which "
                           f"{type(engine).__name__} does not have: use an engine that does (FSDP) or a constant schedule")
    return scheduler, optimizer


def save_lr_schedule(worker: Any) -> None:
    """Runs in a verl worker process: keep its LR schedule's state and its optimizer's current rates."""
    scheduler, optimizer = _schedule_of(worker)
    worker._seeupo_lr_schedule = (copy.deepcopy(scheduler.state_dict()), [group["lr"] for group in optimizer.param_groups])


def restore_lr_schedule(worker: Any) -> None:
    """Runs in a verl worker process: put back the state `save_lr_schedule` kept."""
    scheduler, optimizer = _schedule_of(worker)
    saved = getattr(worker, "_seeupo_lr_schedule", None)
    if saved is None:
        raise RuntimeError("restore_lr_schedule before save_lr_schedule on this worker")
    state, rates = saved
    scheduler.load_state_dict(copy.deepcopy(state))
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate


def _mean(value: Any) -> float | None:
    """A worker metric (a number, or one per micro-batch) as one float; None for anything else."""
    if isinstance(value, (list, tuple)):
        numbers = [float(x) for x in value if isinstance(x, (int, float)) and not isinstance(x, bool)]
        return sum(numbers) / len(numbers) if numbers and len(numbers) == len(value) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
