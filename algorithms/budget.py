"""Update budgets: how much optimizing an algorithm does on one batch.

Methods compared on the same rollouts can still spend very different compute on them: SeeUPO
takes one optimizer step per non-empty turn pool (times epochs x minibatches), GRPO one per
minibatch of the whole batch. `UpdateBudget` states it in three numbers; `Algorithm.budget(batch)`
predicts it from the batch and the config alone, and `CountingLearner` counts what an update
really did, so that a test can hold every registered algorithm to its prediction.

optimizer_steps: `minimize`/`optimize` calls (parameter updates asked for; a learner may skip one whose
    gradient is zero or not finite, which `CountingLearner.skipped_steps` counts apart).
gradient_passes: passes that score samples with autograd (`minimize`, `logprobs(grad=True)`).
gradient_tokens: response tokens of the samples those passes train on, summed over passes (a
    sample trained on in two epochs counts twice). Samples a loss only measures inside the pass
    (SeeUPO's ratios after the previous pool, `scored_alongside`) are not trained on and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from seeupo_gym.algorithms.base import Learner, MicroLoss, TokenLogprobs
from seeupo_gym.algorithms.rollout import TurnSample

# The attribute a `MicroLoss` may carry naming the samples it scores without training on them.
SCORED_ALONGSIDE = "scored_alongside"


@dataclass(frozen=True)
class UpdateBudget:
    """What one update spends: optimizer steps, gradient passes, gradient (response) tokens."""

    optimizer_steps: int = 0
    gradient_passes: int = 0
    gradient_tokens: int = 0

    def __add__(self, other: "UpdateBudget") -> "UpdateBudget":
        return UpdateBudget(
            self.optimizer_steps + other.optimizer_steps,
            self.gradient_passes + other.gradient_passes,
            self.gradient_tokens + other.gradient_tokens,
        )

    def times(self, k: int) -> "UpdateBudget":
        """The budget of `k` repeats of this one (`k` epochs of one pass each)."""
        return UpdateBudget(k * self.optimizer_steps, k * self.gradient_passes, k * self.gradient_tokens)

    def as_metrics(self) -> dict[str, float]:
        return {
            "optimizer_steps": float(self.optimizer_steps),
            "gradient_passes": float(self.gradient_passes),
            "gradient_tokens": float(self.gradient_tokens),
        }


def response_tokens(samples: Sequence[TurnSample]) -> int:
    return sum(s.turn.num_response_tokens for s in samples)


def minibatch_budget(minibatches: Sequence[Sequence[TurnSample]]) -> UpdateBudget:
    """One optimizer step and one gradient pass per minibatch, over its samples' response tokens."""
    return UpdateBudget(len(minibatches), len(minibatches), sum(response_tokens(m) for m in minibatches))


def minibatch_cut(
    samples: Sequence[TurnSample], size: int, epochs: int, generator: torch.Generator | None = None
) -> UpdateBudget | None:
    """The budget of `epochs` passes over `samples` in `core.minibatches`' cut, one optimizer step per
    minibatch: the single-phase update's.

    The number of minibatches depends on the shuffle only where whole trajectories of different
    lengths are cut into more than one minibatch; there a `generator` in the state the update will
    get (copied here, never advanced) gives the exact count, and without one the answer is None.
    """
    from seeupo_gym.algorithms import core  # core imports base, which imports this module lazily

    if generator is not None:
        replay = torch.Generator()
        replay.set_state(generator.get_state())
        return minibatch_budget(list(core.minibatches(samples, size, epochs, replay)))
    lengths: dict[str, int] = {}
    for sample in samples:
        lengths[sample.rollout_id] = lengths.get(sample.rollout_id, 0) + 1
    if len(samples) > size and len(set(lengths.values())) > 1:
        return None
    one_pass = list(core.minibatches(samples, size, 1, torch.Generator().manual_seed(0)))
    return minibatch_budget(one_pass).times(epochs)


def _key(sample: TurnSample) -> tuple[str, int]:
    return (sample.rollout_id, sample.t)


class CountingLearner:
    """A `Learner` that passes every call through to `learner` and counts what the update did.

    Read `optimizer_steps`, `gradient_passes`, `gradient_tokens` (or `budget()`) after the update, and
    `skipped_steps`: the steps the learner reported skipping (`skipped_no_gradient`, `skipped_nonfinite`).
    `reset()` starts a new count. Any other attribute is the wrapped learner's.
    """

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.reset()

    def reset(self) -> None:
        self.optimizer_steps = 0
        self.gradient_passes = 0
        self.gradient_tokens = 0
        self.skipped_steps = 0

    def budget(self) -> UpdateBudget:
        return UpdateBudget(self.optimizer_steps, self.gradient_passes, self.gradient_tokens)

    def __getattr__(self, name: str) -> Any:  # only for names this class does not define
        if name == "learner":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.learner, name)

    def logprobs(self, samples: Sequence[TurnSample], *, grad: bool = True, **kwargs: Any) -> TokenLogprobs:
        if grad and torch.is_grad_enabled():
            self.gradient_passes += 1
            self.gradient_tokens += response_tokens(samples)
        return self.learner.logprobs(samples, grad=grad, **kwargs)

    def ref_logprobs(self, samples: Sequence[TurnSample]) -> TokenLogprobs:
        return self.learner.ref_logprobs(samples)

    def values(self, samples: Sequence[TurnSample]) -> torch.Tensor:
        return self.learner.values(samples)

    def minimize(self, samples: Sequence[TurnSample], loss: MicroLoss, **kwargs: Any) -> dict[str, float]:
        measured = {_key(s) for s in getattr(loss, SCORED_ALONGSIDE, ())}
        self.optimizer_steps += 1
        self.gradient_passes += 1
        self.gradient_tokens += response_tokens([s for s in samples if _key(s) not in measured])
        return self._stepped(self.learner.minimize(samples, loss, **kwargs))

    def optimize(self, loss: torch.Tensor) -> dict[str, float]:
        self.optimizer_steps += 1
        return self._stepped(self.learner.optimize(loss))

    def _stepped(self, metrics: dict[str, float]) -> dict[str, float]:
        if metrics.get("skipped_no_gradient") or metrics.get("skipped_nonfinite"):
            self.skipped_steps += 1
        return metrics
