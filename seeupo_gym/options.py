"""`reset(options=...)` as every env reads it: one check, one message.

Options come from the caller (a user's RL code, a vector env, a served session), so a wrong
shape or an unknown key is a clear `ValueError` at reset, never an AttributeError deep inside
an env nor a silently ignored typo (`{"task": ...}` starting a random task).
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Mapping

# The options every env takes; the served and Ray clients check with the same function.
RESET_OPTIONS = ("task_id",)

# Task ids are names, not paths: letters, digits and `_-.:`, no separators, no `..`.
_TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def task_id_option(options: Mapping[str, Any] | None) -> str | None:
    """The `task_id` a caller asked for, or None; rejects unknown keys and any task id that is
    not a plain name."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise ValueError(f"reset(options=...) must be a dict such as {{'task_id': ...}}, got {type(options).__name__}")
    unknown = sorted(str(key) for key in options if key not in RESET_OPTIONS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], RESET_OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"reset: unknown option(s) {unknown[:8]}{hint}; the options are {list(RESET_OPTIONS)}")
    task_id = options.get("task_id")
    if task_id is None:
        return None
    if not isinstance(task_id, str) or not _TASK_ID.fullmatch(task_id) or ".." in task_id:
        raise ValueError(f"task_id must be a task name (letters, digits, '_-.:'), got {task_id!r}")
    return task_id
