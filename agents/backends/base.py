"""The generation backend contract: token ids in, token ids + logprobs + finish reason out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of completions.

    temperature: 0 means greedy. top_p: nucleus mass (1.0 = off).
    stop_strings: generation ends once the decoded completion contains one of them; the token
    that completed the string is the last one kept. stop_token_ids: generation ends on one of
    these tokens, which is kept as the last token of the completion (so the context of the next
    turn continues after it). Backends add the tokenizer's end-of-turn / eos token when the
    tuple is empty. seed: makes a call reproducible (same prompts, same seed, same completions
    on the same backend and device); None draws fresh randomness.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    """One sampled response.

    logprobs[k] is the log-probability of token_ids[k] under the policy at the sampling
    temperature: log_softmax(logits / temperature) before top-p truncation (temperature 1
    when greedy). At temperature 1 it equals the teacher-forced `response_logprobs`.
    finish_reason: "stop" (a stop token or string) or "length" (max_new_tokens reached).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class TrainingSetup:
    """What a backend needs to serve a training run, read from the run's config by the trainer
    (this layer does not import the run layer)."""

    model_name: str  # model.name_or_path
    dtype: str
    seed: int
    lora_rank: int | None  # None: full fine-tuning
    max_context_tokens: int
    processes: int  # training processes, each with its own backend
    sharded: bool  # the weights are sharded across processes (FSDP, DeepSpeed)
    # The config's `generation` section (backend, prefix_cache_mib, gpu_memory_utilization, ...).
    options: Mapping[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """A generation engine: `generate` and `update_weights`, plus hooks with no-op defaults.

    A backend a training run can use also implements `for_training`, building itself from the
    run's settings; the trainer picks the class by name (`agents.backends.backend_class`).
    """

    # Tokens that end a turn when `SamplingParams.stop_token_ids` is empty (e.g. <|im_end|>, eos).
    default_stop_token_ids: tuple[int, ...] = ()

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """One completion per prompt, in prompt order."""

    @abstractmethod
    def update_weights(self, state_dict_or_model: Any) -> None:
        """Make later `generate` calls sample from the learner's current weights."""

    def release_memory(self) -> None:
        """Between rollouts: give back memory the learner needs (the next generate takes it again)."""

    def close(self) -> None:
        """Free the engine's resources; the backend is not used afterwards."""

    @classmethod
    def for_training(cls, model: Any, tokenizer: Any, setup: TrainingSetup) -> "Backend":
        """A backend serving a run whose learner trains `model`, holding its current weights."""
        raise NotImplementedError(f"{cls.__name__} cannot serve a training run")

    def overlapped_sampler(self) -> "Backend":
        """A backend that keeps sampling while the learner changes the weights (overlapped
        collection, `train.max_staleness` > 0); new weights reach it only through `update_weights`."""
        raise NotImplementedError(f"{type(self).__name__} cannot sample while the learner updates")


class RequestError(RuntimeError):
    """A request the backend could not serve (a remote server's bad or missing reply, after its
    retries): the agent ends that episode (`info["end"] == "backend_error"`) and the run goes on."""


def check_prompts(prompts: list[list[int]]) -> None:
    """Refuse empty prompts before they reach a model (which would index an empty sequence)."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
