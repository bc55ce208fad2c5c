"""The one seed mixer of the project: independent, reproducible streams from integers."""

from __future__ import annotations

import numpy as np


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers, e.g. (run seed, step, purpose): stable across runs and processes.

    31 bits fit every consumer (torch, numpy, gymnasium, vLLM's per-request seeds).
    """
    return int(np.random.SeedSequence([abs(int(p)) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)
