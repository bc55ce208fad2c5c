"""Random rollout batches for the source-transcription tests of the turn-level credit methods
(tests/test_credit_sources_*.py): ragged turn counts, groups of one, tied rewards, per-turn rewards on
some trajectories and not on others, turns without tokens where asked, and repeated observations."""

from __future__ import annotations

import random

from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn

# Exact binary fractions, so tied rewards stay exactly tied in any summation order.
REWARD_VALUES = (0.0, 0.25, 0.5, 1.0)
OBSERVATIONS = (1, "1", 1.0, "x", (1, 2), [1, 2], {"a": 1}, "y")


def random_batch(
    seed: int,
    *,
    groups: int = 5,
    max_group: int = 5,
    max_turns: int = 4,
    empty_turns: bool = False,
    observations: bool = False,
    dense: bool = False,
) -> RolloutBatch:
    """A batch of `groups` groups of 1..max_group trajectories of 1..max_turns turns; group 0 has one
    trajectory. Rewards come from REWARD_VALUES (ties), or are uniform draws when `dense`."""
    rng = random.Random(seed)
    draw = (lambda: rng.uniform(-1, 2)) if dense else (lambda: rng.choice(REWARD_VALUES))
    trajectories = []
    for g in range(groups):
        size = 1 if g == 0 else rng.randint(1, max_group)
        for i in range(size):
            num_turns = rng.randint(1, max_turns)
            turns = []
            for t in range(num_turns):
                length = rng.randint(0 if empty_turns else 1, 3)
                context = [0, g, t] if rng.random() < 0.5 else [0, g, t, i]
                turns.append(Turn(context, [rng.randint(1, 9) for _ in range(length)], [0.0] * length))
            info = {}
            if rng.random() < 0.6:
                info["turn_rewards"] = [draw() for _ in range(num_turns)]
                reward = sum(info["turn_rewards"])
            else:
                reward = draw()
            if observations:
                info["observations"] = [rng.choice(OBSERVATIONS) for _ in range(num_turns)]
            trajectories.append(Trajectory(f"task{g}", f"g{g}", f"r{g}-{i}", turns, reward, reward > 0.5, info=info))
    return RolloutBatch(trajectories)


def step_rewards(trajectory: Trajectory) -> list[float]:
    """The per-turn rewards as the sources receive them: `info["turn_rewards"]`, else 0 ... 0, R."""
    given = trajectory.info.get("turn_rewards")
    if given is not None:
        return [float(r) for r in given]
    return [0.0] * (trajectory.num_turns - 1) + [float(trajectory.reward)]


def max_abs_difference(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(abs(ours[k] - theirs[k]) for k in ours)
