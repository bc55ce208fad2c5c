"""The policy side: model loading, generation backends and the vectorized agent.

    from agents import load_model, HFBackend, SamplingParams, VectorAgent, response_logprobs

Names are imported on first use, so `import agents` stays cheap (no torch until needed).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_model": "agents.models",
    "response_logprobs": "agents.scoring",
    "Backend": "agents.backends.base",
    "Completion": "agents.backends.base",
    "SamplingParams": "agents.backends.base",
    "HFBackend": "agents.backends.hf",
    "VLLMBackend": "agents.backends.vllm",
    "VectorAgent": "agents.vector",
    "CollectStats": "agents.vector",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agents' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
