"""Mutations of a valid action, for fuzzing an env's parser: the same mangler for every env."""

from __future__ import annotations

import random


def mangled(valid: str, rng: random.Random, alphabet: str) -> str:
    """`valid` with 1-6 characters replaced by ones from `alphabet` or deleted."""
    chars = list(valid)
    for _ in range(rng.randint(1, 6)):
        position = rng.randrange(len(chars))
        if rng.random() < 0.5:
            chars[position] = rng.choice(alphabet)
        else:
            del chars[position]
    return "".join(chars)
