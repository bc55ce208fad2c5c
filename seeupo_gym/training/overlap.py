"""Collection overlapping the update, with bounded staleness (`train.max_staleness` = s > 0).

A collector thread collects the rollouts of step j with the weights after update j - 1 - s
(version j - 1 - s; the starting weights for the first steps) while the learner runs the
updates before j. With s = 1: step k + 1's rollouts are collected while step k updates. The
version is fixed by the step, not by timing, so a run repeats whatever the speeds; every turn
records it (`Turn.policy_version`), the losses reweight the samples by a truncated importance
weight of the learner's step-start policy over the sampler's (`algorithms.core.behaviour_weights`),
and `drop_stale` keeps any turn older than the bound out of an update.

Weights reach the sampler as snapshots: after update v the trainer publishes a copy of the
weights as version v, and the collector loads it into its own sampler between two collections,
never during one. With the HF backend the sampler is a copy of the policy (one more model in
memory); with vLLM it is the engine itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

import torch

from seeupo_gym.algorithms.rollout import RolloutBatch

logger = logging.getLogger(__name__)


def drop_stale(batch: RolloutBatch, learner_version: int, max_staleness: int) -> tuple[RolloutBatch, int]:
    """The trajectories all of whose turns were sampled at most `max_staleness` versions ago, and
    how many were dropped."""
    oldest = learner_version - max_staleness
    kept = [t for t in batch if all(turn.policy_version >= oldest for turn in t.turns)]
    return RolloutBatch(kept), len(batch) - len(kept)


def staleness_metrics(batch: RolloutBatch, learner_version: int, prefix: str) -> dict[str, float]:
    """Staleness of the batch's turns (learner version minus the version that sampled them)."""
    ages = [learner_version - turn.policy_version for t in batch for turn in t.turns]
    if not ages:
        return {}
    return {f"{prefix}/staleness_mean": sum(ages) / len(ages), f"{prefix}/staleness_max": float(max(ages))}


class OverlappedCollection:
    """The collector thread and the hand-over of batches and weight snapshots.

    collect(step, version): collects step's batch with the sampler holding `version` (runs on the
    collector thread). load_weights(snapshot): puts a published snapshot into the sampler (collector
    thread, between collections). Steps first_step..last_step are collected, in order; the starting
    weights are `start_version` and already in the sampler.
    """

    def __init__(
        self,
        collect: Callable[[int, int], Any],
        load_weights: Callable[[Any], None],
        *,
        max_staleness: int,
        first_step: int,
        last_step: int,
        start_version: int,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for overlapped collection, got {max_staleness}")
        self.max_staleness = max_staleness
        self._collect, self._load_weights = collect, load_weights
        self._start_version = start_version
        self._loaded: int | None = start_version  # the version in the sampler; None: unknown, reload
        self._snapshots: dict[int, Any] = {}
        self._ready: dict[int, tuple[Any, int, BaseException | None]] = {}
        self._wake = threading.Condition()
        self._collecting = threading.Lock()  # held while the sampler is in use
        self._closed = False
        # OpenMP thread counts are per thread: collect with the trainer's setting.
        self._thread = threading.Thread(
            target=self._run, args=(first_step, last_step, torch.get_num_threads()), name="collector", daemon=True
        )
        self._thread.start()

    def version_for(self, step: int) -> int:
        """The weights step `step` is sampled with."""
        return max(step - 1 - self.max_staleness, self._start_version)

    def publish(self, version: int, snapshot: Any) -> None:
        """The weights after update `version` (a copy the learner no longer changes)."""
        with self._wake:
            self._snapshots[version] = snapshot
            self._wake.notify_all()

    def take(self, step: int) -> tuple[Any, int]:
        """Step's collected batch (as `collect` returned it) and the version it was sampled with;
        re-raises the collector's error."""
        with self._wake:
            while step not in self._ready:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the collector stopped before step {step}")
                self._wake.wait(timeout=1.0)
            collected, version, error = self._ready.pop(step)
        if error is not None:
            raise error
        return collected, version

    @contextlib.contextmanager
    def paused(self, *, reload: bool = False) -> Iterator[None]:
        """Hold the collector between two collections (e.g. to evaluate on a shared engine); with
        reload=True the sampler's weights may change meanwhile, and the collector loads its own again."""
        with self._collecting:
            try:
                yield
            finally:
                if reload:
                    self._loaded = None

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join()

    def _run(self, first_step: int, last_step: int, threads: int) -> None:
        torch._C.set_num_threads(threads)
        for step in range(first_step, last_step + 1):
            version = self.version_for(step)
            with self._wake:
                while version not in self._snapshots and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                snapshot = self._snapshots[version]
                # Older snapshots are never loaded again.
                for old in [v for v in self._snapshots if v < version]:
                    del self._snapshots[old]
            collected, error = None, None
            with self._collecting:
                try:
                    if version != self._loaded:
                        self._load_weights(snapshot)
                        self._loaded = version
                    collected = self._collect(step, version)
                except BaseException as failure:  # handed to the trainer at take()
                    error = failure
            with self._wake:
                self._ready[step] = (collected, version, error)
                self._wake.notify_all()
            if error is not None:
                return
