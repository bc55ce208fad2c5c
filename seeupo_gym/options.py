"""`reset(options=...)` as every env reads it: one check, one message.

Options come from the caller (a user's RL code, a vector env), so a wrong shape is a clear
`ValueError` at reset, never an AttributeError deep inside an env.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

# Task ids are names, not paths: letters, digits and `_-.:`, no separators, no `..`.
_TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def task_id_option(options: Mapping[str, Any] | None) -> str | None:
    """The `task_id` a caller asked for, or None; rejects anything that is not a plain name."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise ValueError(f"reset(options=...) must be a dict such as {{'task_id': ...}}, got {type(options).__name__}")
    task_id = options.get("task_id")
    if task_id is None:
        return None
    if not isinstance(task_id, str) or not _TASK_ID.fullmatch(task_id) or ".." in task_id:
        raise ValueError(f"task_id must be a task name (letters, digits, '_-.:'), got {task_id!r}")
    return task_id
