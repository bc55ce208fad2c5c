"""Text spaces for LLM envs.

gymnasium's `Text` rejects any character outside its charset (real model output is full of
them) and its `repr` prints the whole charset. `UnicodeText` accepts every Python string up
to a length bound and prints in one short line. It subclasses `Text` so gymnasium's vector
utilities (`batch_space`, `batch_differing_spaces`) treat it as the text space it is, and it
registers its own shared-memory layout, so `gym.make_vec(..., vectorization_mode="async")`
works with gymnasium's defaults.
"""

from __future__ import annotations

import collections.abc
import multiprocessing as mp
import string
from typing import Any

import numpy as np
from gymnasium.spaces import Text
from gymnasium.vector.utils import create_shared_memory, read_from_shared_memory, write_to_shared_memory

# Used only by `sample()`: a mix of ASCII, code punctuation and a few non-Latin scripts.
_SAMPLE_CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n\táéüßçñøЖжλΩ中文日本語한국어😀"


class UnicodeText(Text):
    """Any Unicode string with `min_length <= len(x) <= max_length` characters."""

    def __init__(self, max_length: int, *, min_length: int = 0, seed: Any = None) -> None:
        if max_length < min_length:
            raise ValueError(f"max_length ({max_length}) is below min_length ({min_length})")
        super().__init__(max_length, min_length=min_length, charset=_SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    @property
    def is_np_flattenable(self) -> bool:
        # Flattening indexes characters in the charset, which real strings leave.
        return False

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"

    def __eq__(self, other: object, /) -> bool:
        return (
            isinstance(other, UnicodeText)
            and self.min_length == other.min_length
            and self.max_length == other.max_length
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.min_length, self.max_length))


# Shared memory for AsyncVectorEnv (gymnasium's default): per env one int32 slot holding the
# length, then max_length slots of code points (UTF-32, so every string fits, lone surrogates
# included). gymnasium reads the buffer once, at start-up, and then hands out
# `deepcopy(observations)` each step (or the object itself with copy=False); so the reader
# returns a live view whose deepcopy is a tuple of the current strings.
_UTF32 = "utf-32-le"


@create_shared_memory.register(UnicodeText)
def _create_text_shared_memory(space: UnicodeText, n: int = 1, ctx: Any = mp) -> Any:
    return ctx.Array("i", n * (space.max_length + 1))


@write_to_shared_memory.register(UnicodeText)
def _write_text_to_shared_memory(space: UnicodeText, index: int, value: str, shared_memory: Any) -> None:
    if not isinstance(value, str) or len(value) > space.max_length:
        size = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise ValueError(f"observation ({size}) is not in {space}; the env must clip its observations")
    slots = np.frombuffer(shared_memory.get_obj(), dtype=np.int32).reshape(-1, space.max_length + 1)
    slots[index, 0] = len(value)
    slots[index, 1 : len(value) + 1] = np.frombuffer(value.encode(_UTF32, "surrogatepass"), dtype=np.int32)


class SharedTexts(collections.abc.Sequence):
    """The strings in a vector env's shared memory, read when accessed (a live view)."""

    def __init__(self, space: UnicodeText, shared_memory: Any, n: int) -> None:
        self._slots = np.frombuffer(shared_memory.get_obj(), dtype=np.int32).reshape(n, space.max_length + 1)

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(len(self))[index])
        slot = self._slots[index]
        return slot[1 : slot[0] + 1].tobytes().decode(_UTF32, "surrogatepass")

    def __deepcopy__(self, memo: dict) -> tuple[str, ...]:
        return tuple(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, collections.abc.Sequence) and tuple(self) == tuple(other)

    def __repr__(self) -> str:
        return f"SharedTexts({tuple(self)!r})"


@read_from_shared_memory.register(UnicodeText)
def _read_text_from_shared_memory(space: UnicodeText, shared_memory: Any, n: int = 1) -> SharedTexts:
    return SharedTexts(space, shared_memory, n)
