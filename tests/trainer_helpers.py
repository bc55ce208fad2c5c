"""Shared builders for the trainer / learner tests (not a test module)."""

from __future__ import annotations

import random

from algorithms.rollout import RolloutBatch, Trajectory, Turn


def synthetic_batch(
    num_tasks: int = 2, group_size: int = 2, max_turns: int = 3, seed: int = 0, vocab: int = 1000
) -> RolloutBatch:
    """A RolloutBatch of random token ids: turn t's context extends turn t-1's context and response.

    Trajectories have 1..max_turns turns and rewards in [0, 1], so groups have spread and
    turn pools differ in size (what SeeUPO's schedule depends on).
    """
    rng = random.Random(seed)
    trajectories = []
    for task in range(num_tasks):
        for g in range(group_size):
            context = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
            turns = []
            for _ in range(rng.randint(1, max_turns)):
                response = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
                turns.append(Turn(list(context), response, [0.0] * len(response)))
                context = context + response + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            trajectories.append(
                Trajectory(
                    task_id=f"task{task}",
                    group_id=f"task{task}",
                    rollout_id=f"task{task}-{g}",
                    turns=turns,
                    reward=rng.random(),
                    success=False,
                )
            )
    return RolloutBatch(trajectories)
