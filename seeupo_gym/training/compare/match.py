"""Which budget a comparison holds equal across its methods (`seeupo-compare --match`).

samples: every method learns from the same number of rollouts per step and takes the optimizer steps
    its own update takes on them (SeeUPO one per non-empty turn pool x epochs x minibatches, GRPO one
    per minibatch x epochs): the comparison as it is usually run, now labelled.
steps: as samples, and every method also takes as many optimizer steps per batch as the compared
    method taking the most on that batch (`StepMatched`): its epochs are raised until its own
    `Algorithm.budget` reaches that target. Where its steps per epoch do not divide the target, it
    takes the next whole epoch: at least the target, fewer than one epoch's steps more (the report
    states every method's counted steps, so any excess shows).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # the report imports this module's words without torch
    import torch

    from seeupo_gym.algorithms.base import Algorithm, Learner
    from seeupo_gym.algorithms.rollout import RolloutBatch

logger = logging.getLogger(__name__)

MATCHES = ("samples", "steps")

MATCH_TEXT = {
    "samples": "samples (the same rollouts per step for every method, each taking its own optimizer steps)",
    "steps": "optimizer steps (the same rollouts per step, and every method as many optimizer steps per batch as "
             "the method taking the most, by raising its epochs)",
}


class StepMatched:
    """`algorithm` with its epochs raised on each batch until its optimizer steps reach the most that
    any of `peers` (the compared algorithms, itself among them) would take on that batch.

    Everything else is the wrapped algorithm's (name, schedule, state_dict, ...). An algorithm whose
    budget cannot be predicted (`budget` returns None) runs as configured, with `budget/matched` 0.
    """

    def __init__(self, algorithm: Algorithm, peers: Sequence[Algorithm]) -> None:
        self.algorithm = algorithm
        self.peers = list(peers)
        self._warned = False

    def __getattr__(self, name: str) -> Any:  # only for names this class does not define
        if name == "algorithm":
            raise AttributeError(name)
        return getattr(self.algorithm, name)

    @property
    def schedule(self) -> Any:
        return self.algorithm.schedule

    @schedule.setter
    def schedule(self, value: Any) -> None:
        self.algorithm.schedule = value

    def target(self, batch: RolloutBatch, generator: torch.Generator | None) -> int | None:
        """The most optimizer steps any compared algorithm would take on `batch` (None: none can say)."""
        steps = [b.optimizer_steps for b in (peer.budget(batch, generator) for peer in self.peers) if b is not None]
        return max(steps, default=None)

    def epochs_for(self, batch: RolloutBatch, generator: torch.Generator | None, target: int) -> int | None:
        """The fewest epochs (no fewer than configured) at which this algorithm takes >= `target` steps."""
        config = self.algorithm.config
        configured = config.epochs
        epochs = configured
        try:
            for _ in range(target + 1):  # steps grow by at least one per epoch while there is anything to learn
                config.epochs = epochs
                own = self.algorithm.budget(batch, generator)
                if own is None:
                    return None
                if own.optimizer_steps >= target or own.optimizer_steps == 0:
                    return epochs
                epochs += 1
            return epochs
        finally:
            config.epochs = configured

    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        config = self.algorithm.config
        configured = config.epochs
        target = self.target(batch, generator)
        epochs = self.epochs_for(batch, generator, target) if target is not None else None
        if epochs is None and not self._warned:
            self._warned = True
            logger.warning("%s cannot predict its optimizer steps (or no compared method can): it runs with its "
                           "own epochs, unmatched (update/budget_matched = 0 in metrics.jsonl)", self.algorithm.name)
        config.epochs = epochs or configured
        try:
            metrics = self.algorithm.update(batch, learner, generator)
        finally:
            config.epochs = configured
        return {**metrics, "budget_target_steps": float(target if target is not None else math.nan),
                "budget_epochs": float(epochs or configured), "budget_matched": float(epochs is not None)}
