"""BFCL v4 multi-turn as a Gymnasium env: `gym.make("seeupo/BFCL-v4-v0", categories=[...], split=...)`.

The env, its action formats (`render_action`, `render_turn_end`; `render_tool_action` for tools) and the data helpers. The
BFCL backends and checker are imported only when an env is built.
"""

from __future__ import annotations

from seeupo_gym.bfcl.calls import ActionError, Call, decode_response, looks_like_calls, render_action, render_turn_end
from seeupo_gym.bfcl.data import CATEGORIES, SPLITS, Entry, get_entry, load_category, task_ids
from seeupo_gym.bfcl.env import BFCLEnv, render_tool_action

__all__ = [
    "ActionError",
    "BFCLEnv",
    "CATEGORIES",
    "Call",
    "Entry",
    "SPLITS",
    "decode_response",
    "get_entry",
    "load_category",
    "looks_like_calls",
    "render_action",
    "render_tool_action",
    "render_turn_end",
    "task_ids",
]
