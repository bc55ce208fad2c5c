"""The algorithm interface: what an algorithm needs of a learner, and how algorithms register.

An algorithm owns its whole update step: which samples are updated in which order, with
what advantage weights, and how the weights change between sub-updates (SeeUPO's reverse
turn order and its factor M live here, not in the trainer). It talks to the policy only
through `Learner`, which an LLM (the trainer's) and a tabular softmax policy (TurnBandit)
both implement, so the same algorithm code runs on either.

One optimizer step is `learner.minimize(minibatch, loss)`: the algorithm says which samples
the step covers and how the loss of any part of them is computed (`MicroLoss`); the learner
decides how to cut them into micro-batches (packed trajectories, a token budget, processes)
and accumulates the gradients. So `loss` must return each part's *share* of the minibatch
loss, normalized by minibatch-wide counts (`core.Totals`), for the sum of the shares to be
the minibatch loss whatever the cut.

A user algorithm is a subclass of `Algorithm` decorated with `@register_algorithm("name")`
in any file; the trainer finds it by name once that file is imported (config key
`plugins: [path/to/file.py]` or `--plugin`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol, Sequence, TypeVar, Union

import torch

from seeupo_gym.algorithms.rollout import RolloutBatch, TurnSample

if TYPE_CHECKING:
    from seeupo_gym.algorithms.budget import UpdateBudget


@dataclass
class TokenLogprobs:
    """Per-token log-probabilities of a list of responses, right-padded to one length.

    logprobs[i, j] is log pi(y_ij | context_i, y_i<j) for sample i; mask marks real tokens.
    """

    logprobs: torch.Tensor  # [n, L] float
    mask: torch.Tensor  # [n, L] bool
    # The sampler's logprobs of the same tokens ([n, L]), set by a learner only when the rollouts may
    # come from older weights (overlapped collection); the shared losses then correct for the
    # mismatch with a truncated importance weight capped at `sampled_cap` (`core.behaviour_weights`).
    sampled: torch.Tensor | None = None
    sampled_cap: float = 2.0
    # The policy's entropy at each token ([n, L], with autograd), set by a learner whose `minimize`
    # was called with entropy=True (an algorithm with entropy_coeff > 0).
    entropy: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.logprobs.shape != self.mask.shape:
            raise ValueError(f"logprobs {tuple(self.logprobs.shape)} and mask {tuple(self.mask.shape)} differ in shape")


# A part's share of the minibatch loss, optionally with diagnostics that also sum over parts.
LossShare = Union[torch.Tensor, tuple[torch.Tensor, Mapping[str, float]]]


class MicroLoss(Protocol):
    """The loss of one optimizer step, evaluated on any part of its minibatch.

    part: some of the step's samples; new: their logprobs under the current parameters (with
    autograd); values: their value estimates [n, L] with autograd when `minimize` was called
    with values=True, else None. Returns the part's share of the minibatch loss (and, optionally,
    diagnostics as shares too): shares of a partition must add up to the minibatch's loss.
    """

    def __call__(self, part: Sequence[TurnSample], new: "TokenLogprobs", values: torch.Tensor | None) -> LossShare: ...


class Learner(Protocol):
    """The policy being trained, as an algorithm sees it.

    Optional attribute `measures_alongside` (False when absent): True says that `minimize` never cuts
    the samples one packed sequence scores (a trajectory's turns whose contexts extend each other)
    across parts, and returns its parts' diagnostics summed over parts and processes. SeeUPO then
    measures the ratios of a pool just updated inside the next pool's gradient pass.
    """

    def logprobs(self, samples: Sequence[TurnSample], *, grad: bool = True) -> TokenLogprobs:
        """Response-token logprobs under the current parameters (with autograd when grad=True).

        With grad=True the whole list is one graph: use `minimize` for training at scale.
        """
        ...

    def ref_logprobs(self, samples: Sequence[TurnSample]) -> TokenLogprobs:
        """Response-token logprobs under the frozen reference policy (no autograd)."""
        ...

    def values(self, samples: Sequence[TurnSample]) -> torch.Tensor:
        """Value estimates per response token, [n, L] aligned with `logprobs` (value-based algorithms only)."""
        ...

    def minimize(self, samples: Sequence[TurnSample], loss: MicroLoss, *, values: bool = False) -> dict[str, float]:
        """One optimizer step on the minibatch `samples`: score them in parts, backpropagate each part's
        `loss` share, step once. Returns the summed diagnostics of the shares and e.g. grad_norm."""
        ...

    def optimize(self, loss: torch.Tensor) -> dict[str, float]:
        """One optimizer step on a scalar `loss` built from `logprobs(..., grad=True)` (backward,
        gradient clipping, step, zero_grad); the simple path, one graph for the whole minibatch."""
        ...


def loss_share(result: LossShare) -> tuple[torch.Tensor, dict[str, float]]:
    """Split a `MicroLoss` result into (loss, diagnostics), whichever form it took."""
    if isinstance(result, tuple):
        loss, stats = result
        items = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
        return loss, {k: float(v) for k, v in items.items() if v is not None}
    return result, {}


@dataclass
class AlgorithmConfig:
    """Hyperparameters every algorithm shares. Subclasses add their own fields with defaults."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    # KL penalty in the loss, on by default at the SeeUPO paper's 0.002; verl's `use_kl_loss` is off by
    # default (set 0 for verl's default).
    kl_coef: float = 0.002
    # KL(pi || pi_ref) per token: k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10] as verl;
    # low_var_kl is verl's name for the same estimator).
    kl_estimator: str = "k3"
    # Sample reuse: every sample takes part in `epochs` passes, in minibatches of this many
    # samples; the same for every algorithm so that comparisons spend equal compute.
    epochs: int = 1
    # Counted in turn samples (a minibatch closes once it holds this many, whole trajectories only);
    # verl's `ppo_mini_batch_size` counts prompts, each with its `rollout.n` trajectories.
    minibatch_size: int = 64

    def __post_init__(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip_low/clip_high must be >= 0, got {self.clip_low}/{self.clip_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.epochs < 1 or self.minibatch_size < 1:
            raise ValueError(f"epochs and minibatch_size must be >= 1, got {self.epochs}/{self.minibatch_size}")
        from seeupo_gym.algorithms.core import KL_ESTIMATORS  # core imports this module

        self.require_choice("kl_estimator", KL_ESTIMATORS)

    def require_dual_clip(self) -> None:
        """Check a `clip_ratio_c` option: None (off) or a bound > 1 on the ratio where A < 0."""
        c = getattr(self, "clip_ratio_c")
        if c is not None and not c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 (dual clip) or null (off), got {c}")

    def require_choice(self, option: str, allowed: Sequence[str]) -> None:
        """Reject a string option outside `allowed`, naming the option and the choices."""
        value = getattr(self, option)
        if value not in allowed:
            raise ValueError(f"{option} must be one of {tuple(allowed)}, got {value!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "AlgorithmConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown algorithm option(s) {unknown} for {cls.__name__}; allowed: {sorted(known)}"
            )
        return cls(**values)


ConfigT = TypeVar("ConfigT", bound=AlgorithmConfig)


@dataclass
class UpdatePhase:
    """One sub-update of a step: which samples were updated, with which weights, in which order.

    GRPO/GSPO/PPO have one phase per step covering every turn (`turn=None`); SeeUPO has one
    per turn pool D_t, in its update order. Tests and logs read `Algorithm.schedule`.
    """

    turn: int | None
    rollout_ids: tuple[str, ...]
    # Advantage weight per rollout_id used in this phase (SeeUPO: M_i before the phase).
    weights: dict[str, float]
    optimizer_steps: int
    # SeeUPO: s(y_{i,t}) under the parameters after this phase, by rollout_id (the factor M_i
    # was multiplied by), for the trajectories that still have a turn to update; empty after the
    # last phase of a step, where nothing reads M again.
    ratios_after: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class UpdateSelection:
    """Which trajectories of a batch an update learns from (`core.select_for_update`).

    Episodes that never started (no turn) are always left out. truncated: `score` (default) trains on
    a truncated episode with the reward the env gave it, `mask` leaves it out of the update and of its
    group's statistics; drop_flat_groups: leave out groups of two or more rollouts with one reward.
    """

    truncated: str = "score"
    drop_flat_groups: bool = False


def _selecting_first(update: Callable[..., dict[str, float]]) -> Callable[..., dict[str, float]]:
    """`update` behind the selection: it receives only the trajectories to learn from, and its metrics
    gain the counts of those left out; with none left it is not called (`skipped_empty_batch`)."""

    @functools.wraps(update)
    def selected(self: "Algorithm", batch: RolloutBatch, learner: "Learner", generator: torch.Generator) -> dict[str, float]:
        if getattr(self, "_updating", False):  # a subclass's update calling super().update(): selected already
            return update(self, batch, learner, generator)
        from seeupo_gym.algorithms.core import select_for_update  # core imports this module

        selection = getattr(self, "selection", None) or UpdateSelection()
        batch, left_out = select_for_update(
            batch, truncated=selection.truncated, drop_flat_groups=selection.drop_flat_groups
        )
        if len(batch) == 0:
            self.schedule = []
            return {**left_out, "skipped_empty_batch": 1.0}
        self._updating = True
        try:
            metrics = update(self, batch, learner, generator)
        finally:
            self._updating = False
        return {**metrics, **left_out}

    selected.selects_first = True  # type: ignore[attr-defined]
    return selected


class Algorithm(ABC):
    """An RL update rule. Subclasses set `config_class` and implement `update`.

    Every subclass's `update` runs behind `selection` (`UpdateSelection`): it sees only the
    trajectories to learn from, whoever calls it (the trainer, a benchmark, a test).
    """

    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    # True when the learner must carry a value model (PPO).
    needs_value_model: ClassVar[bool] = False
    name: ClassVar[str] = ""

    def __init__(
        self,
        config: AlgorithmConfig | dict[str, Any] | None = None,
        *,
        on_phase: Callable[[UpdatePhase], None] | None = None,
        selection: UpdateSelection | None = None,
    ) -> None:
        if config is None:
            config = self.config_class()
        elif isinstance(config, dict):
            config = self.config_class.from_dict(config)
        elif not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} expects a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        # The phases of the latest `update`, in order; `on_phase` sees each as it completes.
        self.schedule: list[UpdatePhase] = []
        # Called with each phase once its update is done and its `ratios_after` are measured (SeeUPO then
        # measures them in a pass of their own: with several processes, set it on every process).
        self.on_phase = on_phase
        self.selection = selection or UpdateSelection()
        self._updating = False
        # State carried from step to step (KL in the reward's coefficient); saved with checkpoints.
        self.kl_ctrl_in_reward = None
        if getattr(config, "use_kl_in_reward", False):
            from seeupo_gym.algorithms.kl import KLController

            self.kl_ctrl_in_reward = KLController(config.kl_ctrl)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        update = cls.__dict__.get("update")
        if update is None or getattr(update, "selects_first", False) or getattr(update, "__isabstractmethod__", False):
            return
        cls.update = _selecting_first(update)  # type: ignore[method-assign]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep for the next step to be the same (empty for most)."""
        return {} if self.kl_ctrl_in_reward is None else {"kl_ctrl_in_reward": self.kl_ctrl_in_reward.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.kl_ctrl_in_reward is not None and "kl_ctrl_in_reward" in state:
            self.kl_ctrl_in_reward.load_state_dict(state["kl_ctrl_in_reward"])

    def record_phase(self, phase: UpdatePhase) -> None:
        self.schedule.append(phase)
        if self.on_phase is not None:
            self.on_phase(phase)

    def selected(self, batch: RolloutBatch) -> RolloutBatch:
        """The trajectories of `batch` that `update` learns from (`selection`)."""
        from seeupo_gym.algorithms.core import select_for_update  # core imports this module

        selection = self.selection or UpdateSelection()
        return select_for_update(batch, truncated=selection.truncated, drop_flat_groups=selection.drop_flat_groups)[0]

    def budget(self, batch: RolloutBatch, generator: torch.Generator | None = None) -> "UpdateBudget | None":
        """What `update(batch, ...)` will spend (`budget.UpdateBudget`: optimizer steps, gradient passes,
        gradient tokens), from the batch and the config alone, without a learner.

        The default is a single-phase update's: `epochs` passes over the selected samples in
        `core.minibatches`' cut, one optimizer step per minibatch. An algorithm that updates otherwise
        overrides it (SeeUPO: per turn pool) or returns None where it cannot say (a comparison then reads
        the count of `budget.CountingLearner`); tests/test_budget.py holds every registered algorithm to
        its prediction. generator: one in the state `update` will get (copied, never advanced), needed
        only where the cut depends on the shuffle (`budget.minibatch_cut`).
        """
        from seeupo_gym.algorithms.budget import minibatch_cut

        return minibatch_cut(self.selected(batch).samples(), self.config.minibatch_size, self.config.epochs, generator)

    @abstractmethod
    def update(self, batch: RolloutBatch, learner: Learner, generator: torch.Generator) -> dict[str, float]:
        """One training step on `batch`; returns scalar metrics. `generator` drives any shuffling.

        Called, it first leaves out what `selection` says (never-started episodes always) and adds the
        counts to the metrics (`never_started`, `truncated_masked`, `flat_groups_dropped`); a batch
        with nothing left returns those and `skipped_empty_batch` without touching the learner."""


_REGISTRY: dict[str, type[Algorithm]] = {}

A = TypeVar("A", bound=type[Algorithm])


def register_algorithm(name: str) -> Callable[[A], A]:
    """Class decorator: make an algorithm available under `name`."""

    def decorate(cls: A) -> A:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"an algorithm named {name!r} is already registered ({_REGISTRY[name].__qualname__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _load_builtin_algorithms() -> None:
    # Imported lazily so that `import algorithms` stays cheap; each module registers itself.
    for module in ("ppo", "grpo", "gspo", "seeupo", "turn_credit"):
        spec = importlib.util.find_spec(f"seeupo_gym.algorithms.{module}")
        if spec is not None:
            importlib.import_module(f"seeupo_gym.algorithms.{module}")


def load_plugin(path: str | Path) -> None:
    """Import a user file (or dotted module) that registers algorithms. Loading it again is a no-op."""
    path_str = str(path)
    if path_str.endswith(".py") or Path(path_str).exists():
        file = Path(path_str).resolve()
        if not file.is_file():
            raise FileNotFoundError(f"algorithm plugin {path_str!r} does not exist")
        module_name = f"seeupo_plugin_{file.stem}"
        loaded = sys.modules.get(module_name)
        if loaded is not None and getattr(loaded, "__file__", None) == str(file):
            # Executing the file again would register new classes under names already taken.
            return
        spec = importlib.util.spec_from_file_location(module_name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        importlib.import_module(path_str)


def available_algorithms() -> list[str]:
    _load_builtin_algorithms()
    return sorted(_REGISTRY)


def algorithm_class(name: str) -> type[Algorithm]:
    """The algorithm registered under `name`."""
    _load_builtin_algorithms()
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def make_algorithm(name: str, config: dict[str, Any] | None = None) -> Algorithm:
    """Build the algorithm registered under `name` with `config` overriding its defaults."""
    return algorithm_class(name)(config or {})
