"""Rollout records: what the agent hands the algorithms.

A trajectory is a list of turns; turn t (1-based) of trajectory i is one model response
`response_ids` sampled on the exact context `context_ids` the model was conditioned on.
Algorithms work on per-turn samples; SeeUPO additionally works on turn pools D_t.
Everything that identifies a sample is keyed by `rollout_id`, never by position.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class Turn:
    """One model response and the token ids it was sampled on."""

    context_ids: list[int]
    response_ids: list[int]
    sample_logprobs: list[float]
    # "old" and reference logprobs are not stored here: algorithms recompute them from the
    # learner at the start of each update (the sampler's are never used as "old").
    finish_reason: str = "stop"
    # The version of the weights that sampled this turn: the number of updates they had seen.
    # Collection that overlaps the update samples with older weights than the learner's.
    policy_version: int = 0
    # The temperature T of `sample_logprobs` (log_softmax(logits / T); 1 for greedy sampling), set by
    # the agent; the learner scores at one temperature and refuses weights against another. None: unknown.
    logprob_temperature: float | None = None

    def __post_init__(self) -> None:
        if len(self.sample_logprobs) != len(self.response_ids):
            raise ValueError(
                f"sample_logprobs has {len(self.sample_logprobs)} entries for "
                f"{len(self.response_ids)} response tokens"
            )

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)


@dataclass
class Trajectory:
    """One episode: the turns of one rollout of one task, and its team reward."""

    task_id: str
    group_id: str
    rollout_id: str
    turns: list[Turn]
    reward: float
    success: bool
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def turn(self, t: int) -> Turn | None:
        """Turn t (1-based), or None when the trajectory ended before it."""
        if t < 1:
            raise ValueError(f"turns are 1-based, got t={t}")
        return self.turns[t - 1] if t <= len(self.turns) else None


@dataclass(frozen=True)
class TurnSample:
    """Turn `t` of the trajectory `rollout_id`: the unit every algorithm updates on."""

    rollout_id: str
    group_id: str
    t: int
    turn: Turn
    trajectory: Trajectory


@dataclass
class RolloutBatch:
    """The trajectories of one training step (B tasks x G rollouts)."""

    trajectories: list[Trajectory]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for trajectory in self.trajectories:
            if trajectory.rollout_id in seen:
                raise ValueError(f"rollout_id {trajectory.rollout_id!r} appears twice in the batch")
            seen.add(trajectory.rollout_id)
        self._by_rollout = {trajectory.rollout_id: trajectory for trajectory in self.trajectories}

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def __getitem__(self, rollout_id: str) -> Trajectory:
        return self._by_rollout[rollout_id]

    @property
    def rollout_ids(self) -> list[str]:
        return [trajectory.rollout_id for trajectory in self.trajectories]

    @property
    def max_turns(self) -> int:
        """T_max of the batch: the longest trajectory's number of turns."""
        return max((trajectory.num_turns for trajectory in self.trajectories), default=0)

    def groups(self) -> dict[str, list[Trajectory]]:
        """Trajectories by group (the G rollouts of one task), in batch order."""
        grouped: dict[str, list[Trajectory]] = defaultdict(list)
        for trajectory in self.trajectories:
            grouped[trajectory.group_id].append(trajectory)
        return dict(grouped)

    def rewards(self) -> dict[str, float]:
        return {trajectory.rollout_id: trajectory.reward for trajectory in self.trajectories}

    def turn_pool(self, t: int) -> list[TurnSample]:
        """D_t: turn t of every trajectory that has one. Trajectories that ended earlier are absent."""
        pool = []
        for trajectory in self.trajectories:
            turn = trajectory.turn(t)
            if turn is not None:
                pool.append(TurnSample(trajectory.rollout_id, trajectory.group_id, t, turn, trajectory))
        return pool

    def samples(self) -> list[TurnSample]:
        """Every turn of every trajectory, trajectory-major."""
        return [
            TurnSample(trajectory.rollout_id, trajectory.group_id, t, turn, trajectory)
            for trajectory in self.trajectories
            for t, turn in enumerate(trajectory.turns, start=1)
        ]

    def num_response_tokens(self) -> int:
        return sum(turn.num_response_tokens for trajectory in self.trajectories for turn in trajectory.turns)
