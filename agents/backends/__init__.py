"""Generation backends: token ids in, token ids + per-token logprobs + finish reason out."""

from seeupo_gym.agents.backends.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Backend,
    Completion,
    SamplingParams,
    TrainingSetup,
)
from seeupo_gym.agents.backends.hf import HFBackend

__all__ = [
    "Backend", "Completion", "SamplingParams", "TrainingSetup", "HFBackend", "VLLMBackend", "FINISH_STOP",
    "FINISH_LENGTH", "BACKENDS", "backend_class",
]

# The engines a training run can generate with (`generation.backend`).
BACKENDS = ("hf", "vllm", "openai")


def backend_class(name: str) -> type[Backend]:
    """The backend class of `generation.backend` (vLLM, an optional extra, is imported only here)."""
    if name == "hf":
        return HFBackend
    if name == "vllm":
        from seeupo_gym.agents.backends.vllm import VLLMBackend

        return VLLMBackend
    if name == "openai":
        from seeupo_gym.agents.backends.openai import OpenAIBackend

        return OpenAIBackend
    raise ValueError(f"unknown generation backend {name!r}; choose one of {BACKENDS}")


def __getattr__(name: str):
    # vLLM is an optional extra: import it only when asked for.
    if name == "VLLMBackend":
        from seeupo_gym.agents.backends.vllm import VLLMBackend

        return VLLMBackend
    raise AttributeError(name)
