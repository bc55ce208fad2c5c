"""The pure algorithm kit: rollout records, shared loss parts, PPO/GRPO/GSPO/SeeUPO, a tabular policy.

It imports torch and itself only; `seeupo_gym.training` is the run layer above it.
"""

from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn, TurnSample

__all__ = ["RolloutBatch", "Trajectory", "Turn", "TurnSample"]
