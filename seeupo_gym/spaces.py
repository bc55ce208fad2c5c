"""Text spaces for LLM envs.

gymnasium's `Text` rejects any character outside its charset (real model output is full of
them) and its `repr` prints the whole charset. `UnicodeText` accepts every Python string up
to a length bound and prints in one short line. It subclasses `Text` so gymnasium's vector
utilities (`batch_space`, `batch_differing_spaces`) treat it as the text space it is.
"""

from __future__ import annotations

import string
from typing import Any

from gymnasium.error import CustomSpaceError
from gymnasium.spaces import Text
from gymnasium.vector.utils import create_shared_memory

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


@create_shared_memory.register(UnicodeText)
def _no_shared_memory(space: UnicodeText, n: int = 1, ctx: Any = None) -> Any:
    # AsyncVectorEnv would read text observations out of shared memory once and then keep
    # returning that stale buffer; refuse, and gymnasium tells the user the fix.
    raise CustomSpaceError(
        "UnicodeText observations cannot live in shared memory; "
        "use gym.make_vec(..., vector_kwargs={'shared_memory': False})"
    )
