"""What a dataset row may choose for its env: rows are data, not configuration.

A trainer's dataset (verl's parquet rows, say) is data anyone may have written; the trainer's own
config is not. A row may pick its task and the env's episode options, listed per env id below; everything
that decides isolation, executables, paths, addresses, credentials or resource bounds (AppWorld's
`sandbox`, `python`, `data_dir`, `limits`; a served env's `url` and `token`; BFCL's call time;
TurnBandit's task count and sizes) comes
from the trainer's config only. A row that names anything else, or an env id outside this table
(`seeupo/Remote-v0` and `seeupo/Ray-v0` choose where code runs and whom the token goes to), is
refused with one line naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_BFCL = frozenset({"categories", "split", "max_turns", "keep_think", "action_format"})

# env id -> the gym.make kwargs a row may set.
ROW_KWARGS: dict[str, frozenset[str]] = {
    # Sizes (num_tasks, turns, options) are resource bounds: a row asking for 10**9 tasks would take the worker's memory.
    "seeupo/TurnBandit-v0": frozenset({"variant", "seed", "hint", "optimum", "invalid_penalty", "max_turns", "brief",
                                       "action_format"}),
    "seeupo/BFCL-v4-v0": _BFCL,
    "seeupo/BFCL-v4-base-v0": _BFCL - {"categories"},
    "seeupo/BFCL-v4-miss-func-v0": _BFCL - {"categories"},
    "seeupo/BFCL-v4-miss-param-v0": _BFCL - {"categories"},
    "seeupo/BFCL-v4-long-context-v0": _BFCL - {"categories"},
    "seeupo/AppWorld-v0": frozenset({"split", "max_turns", "keep_think", "action_format"}),
}


class RowError(ValueError):
    """A dataset row asks for something only the trainer's config may set, or is malformed."""


def row_env_kwargs(env_id: str, raw: Any, *, max_turns: int | None = None) -> dict[str, Any]:
    """The env kwargs a row gives (a JSON object, or a mapping), each key one the row may set for
    `env_id`, and its `max_turns` an int from 1 to `max_turns` (the caller's turn cap; NaN, 1e9 or
    a string would lift it); otherwise `RowError` naming the key."""
    if env_id not in ROW_KWARGS:
        raise RowError(f"a row may name one of {sorted(ROW_KWARGS)} as its env, not {str(env_id)[:80]!r}; where the "
                       f"env runs (a server url, Ray workers) is the trainer's config")
    if raw is None or raw == "":
        return {}
    try:
        kwargs = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except (ValueError, RecursionError) as error:
        raise RowError(f"the row's env_kwargs is not JSON: {error}"[:200]) from None
    if not isinstance(kwargs, Mapping):
        raise RowError(f"the row's env_kwargs must be a JSON object of gym.make arguments, got {str(raw)[:120]!r}")
    allowed = ROW_KWARGS[env_id]
    for key in kwargs:
        if key not in allowed:
            raise RowError(f"a row may not set {str(key)[:80]!r} for {env_id} (only {sorted(allowed)}); "
                           f"set it in the trainer's config")
    if "max_turns" in kwargs:
        turns = kwargs["max_turns"]
        if type(turns) is not int or not 1 <= turns <= (max_turns if max_turns is not None else turns):
            raise RowError(f"a row's max_turns must be an int from 1 to {max_turns if max_turns is not None else 'any'}, "
                           f"got {str(turns)[:40]}")
    return dict(kwargs)
