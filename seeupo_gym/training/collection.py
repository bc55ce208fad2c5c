"""Rollout collection for the trainer: each process collects its share, retried, then gathered.

Every process collects a contiguous share of the step's tasks with the vectorized agent; a
failed attempt (an env or the agent raised) is retried with the same seed (tenacity), and
episodes an env error ended are left out of the batch. The trajectories are then gathered so
every process holds the whole batch, with rollout ids made unique across processes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import numpy as np
from tenacity import RetryError, Retrying, stop_after_attempt

from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.agents.vector import END_ENV_ERROR  # the agent's `info["end"]` for an env exception
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory

logger = logging.getLogger(__name__)



class RolloutError(RuntimeError):
    """Collecting a step's rollouts failed on some process, after the configured retries."""


@dataclasses.dataclass
class Collected:
    batch: RolloutBatch
    # Episodes an env error ended, left out of `batch` (all processes together).
    env_errors: int


def collect(
    accelerator: Any,
    agent: Any,
    tasks: Sequence[str],
    group_size: int,
    *,
    seed: int,
    retries: int,
    what: str,
) -> Collected:
    """This process collects its contiguous share of `tasks`; returns the gathered batch.

    Raises `RolloutError` (on every process alike) when some process failed after `retries`
    retries, or when every episode hit an env error.
    """
    from accelerate.utils import gather_object

    world, rank = accelerator.num_processes, accelerator.process_index
    share = math.ceil(len(tasks) / world)
    mine = list(tasks[rank * share : (rank + 1) * share])
    trajectories: list[Trajectory] = []
    error: str | None = None
    if mine:
        def attempt() -> list[Trajectory]:
            return list(agent.collect(mine, group_size, seed=derive_seed(seed, rank)).trajectories)

        def log_failure(state: Any) -> None:
            logger.warning("%s: rollout attempt %d failed on tasks %s: %r",
                           what, state.attempt_number, mine, state.outcome.exception())

        try:
            trajectories = Retrying(stop=stop_after_attempt(retries + 1), after=log_failure, reraise=False)(attempt)
        except RetryError as failed:
            exc = failed.last_attempt.exception()
            error = f"process {rank}: {type(exc).__name__}: {exc}"
    if world > 1:
        errors = [e for e in gather_object([error]) if e]
        gathered = gather_object(trajectories)
    else:
        errors = [error] if error else []
        gathered = trajectories
    failed = [t for t in gathered if t.info.get("end") == END_ENV_ERROR]
    if failed and not errors:
        logger.warning(
            "%s: %d of %d episodes hit an env error and are left out of the batch, e.g. task %s: %s",
            what, len(failed), len(gathered), failed[0].task_id, failed[0].info.get("error"),
        )
        if len(failed) == len(gathered):
            errors = [f"every episode hit an env error, e.g. task {failed[0].task_id}: {failed[0].info.get('error')}"]
    if errors:
        raise RolloutError(f"{what}: collecting rollouts failed after {retries + 1} attempt(s): {'; '.join(errors)}")
    gathered = [t for t in gathered if t.info.get("end") != END_ENV_ERROR]
    if world > 1:
        # rollout ids are unique per process; make them unique in the gathered batch.
        per_rank = gather_object([len([t for t in trajectories if t.info.get("end") != END_ENV_ERROR])])
        owners = [r for r, count in enumerate(per_rank) for _ in range(count)]
        gathered = [dataclasses.replace(t, rollout_id=f"p{r}/{t.rollout_id}", group_id=f"p{r}/{t.group_id}")
                    for r, t in zip(owners, gathered)]
    return Collected(RolloutBatch(gathered), len(failed))


def rollout_metrics(batch: RolloutBatch, prefix: str) -> dict[str, float]:
    """Reward, success, truncation, turns and response length of a batch, under `prefix/`; and
    two signs of a policy gone deterministic: `flat_group_rate`, the share of groups whose
    rollouts all got one reward (zero group-relative advantage: nothing to learn from), and
    `sampled_nll_mean`, the mean -log p of the sampled tokens (a Monte Carlo estimate of the
    sampling policy's entropy per token)."""
    trajectories = batch.trajectories
    n = len(trajectories)
    if n == 0:
        return {f"{prefix}/trajectories": 0.0}
    turns = [t.num_turns for t in trajectories]
    tokens = [turn.num_response_tokens for t in trajectories for turn in t.turns]
    logprobs = [lp for t in trajectories for turn in t.turns for lp in turn.sample_logprobs]
    groups: dict[str, set[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, set()).add(t.reward)
    return {
        f"{prefix}/flat_group_rate": float(np.mean([len(rewards) == 1 for rewards in groups.values()])),
        f"{prefix}/sampled_nll_mean": -float(np.mean(logprobs)) if logprobs else 0.0,
        f"{prefix}/trajectories": float(n),
        f"{prefix}/reward_mean": float(np.mean([t.reward for t in trajectories])),
        f"{prefix}/success_rate": float(np.mean([t.success for t in trajectories])),
        f"{prefix}/truncated_rate": float(np.mean([t.truncated for t in trajectories])),
        f"{prefix}/turns_mean": float(np.mean(turns)),
        f"{prefix}/response_tokens_mean": float(np.mean(tokens)) if tokens else 0.0,
    }
