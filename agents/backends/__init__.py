"""Generation backends: token ids in, token ids + per-token logprobs + finish reason out."""

from seeupo_gym.agents.backends.base import FINISH_LENGTH, FINISH_STOP, Backend, Completion, SamplingParams
from seeupo_gym.agents.backends.hf import HFBackend

__all__ = ["Backend", "Completion", "SamplingParams", "HFBackend", "VLLMBackend", "FINISH_STOP", "FINISH_LENGTH"]


def __getattr__(name: str):
    # vLLM is an optional extra: import it only when asked for.
    if name == "VLLMBackend":
        from seeupo_gym.agents.backends.vllm import VLLMBackend

        return VLLMBackend
    raise AttributeError(name)
