"""BFCL v4 multi-turn over `seeupo-serve seeupo/BFCL-v4-v0`: `vf-eval seeupo-vf-bfcl --env.taskset.serve-url URL
[--env.taskset.categories '[base,miss_func]'] [--env.taskset.split test]`. The split and the categories
one can pick are the server's (`seeupo-serve seeupo/BFCL-v4-v0 split=all categories=[...]`): a split
other than the served one is refused, categories filter the served tasks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf

from seeupo_verifiers import SeeupoConfig, SeeupoTask, SeeupoEnv, SeeupoHarness, SeeupoTaskset


class BfclConfig(SeeupoConfig):
    categories: list[str] = []
    """BFCL categories to play (base, miss_func, miss_param, long_context); default: all the server serves."""
    split: str | None = None
    """The split the server must serve (train, test, paper-test, all...); default: whatever it serves."""


# verifiers reads a taskset's config class off its own `Taskset[Task, Config]` base.
class BfclTaskset(SeeupoTaskset, vf.Taskset[SeeupoTask, BfclConfig]):
    ENV_ID = "seeupo/BFCL-v4-v0"
    def resets(self) -> Iterator[dict[str, Any]]:
        served = self.served()
        kwargs = {**(served.get("default_kwargs") or {}), **(served.get("env_kwargs") or {})}
        if self.config.split is not None and kwargs.get("split") != self.config.split:
            raise ValueError(f"{self.config.serve_url} serves BFCL split {kwargs.get('split')!r}, not "
                             f"{self.config.split!r}: start `seeupo-serve seeupo/BFCL-v4-v0 split={self.config.split}`")
        unknown = set(self.config.categories) - set(kwargs.get("categories") or [])
        if unknown:
            raise ValueError(f"{self.config.serve_url} does not serve the BFCL categories {sorted(unknown)} (it serves "
                             f"{kwargs.get('categories')}): start seeupo-serve with categories=[...]")
        task_ids = self.config.task_ids or served.get("task_ids") or []
        prefixes = tuple(f"multi_turn_{category}_" for category in self.config.categories)
        for task_id in task_ids:
            if not prefixes or str(task_id).startswith(prefixes):
                yield {"task_id": str(task_id)}


__all__ = ["BfclTaskset", "SeeupoEnv", "SeeupoHarness"]
