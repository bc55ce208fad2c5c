from seeupo_gym.algorithms.training.compare import main

__all__ = ["main"]
