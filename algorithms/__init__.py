"""Rollout records, advantage estimators, losses and the algorithms that use them."""

from algorithms.rollout import RolloutBatch, Trajectory, Turn, TurnSample

__all__ = ["RolloutBatch", "Trajectory", "Turn", "TurnSample"]
