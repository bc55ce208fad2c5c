"""The policy side: model loading, generation backends and the vectorized agent.

    from seeupo_gym.agents import load_model, HFBackend, SamplingParams, VectorAgent, response_logprobs

Names are imported on first use, so `import agents` stays cheap (no torch until needed).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_model": "seeupo_gym.agents.models",
    "load_tokenizer": "seeupo_gym.agents.models",
    "response_logprobs": "seeupo_gym.agents.scoring",
    "Backend": "seeupo_gym.agents.backends.base",
    "Completion": "seeupo_gym.agents.backends.base",
    "SamplingParams": "seeupo_gym.agents.backends.base",
    "HFBackend": "seeupo_gym.agents.backends.hf",
    "VLLMBackend": "seeupo_gym.agents.backends.vllm",
    "OpenAIBackend": "seeupo_gym.agents.backends.openai",
    "VectorAgent": "seeupo_gym.agents.vector",
    "CollectStats": "seeupo_gym.agents.vector",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agents' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
