"""The tasks of an env with their first messages: what every trainer's dataset row is built from."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import gymnasium as gym

import seeupo_gym  # noqa: F401  (registers the Gymnasium ids)


def task_prompts(env_id: str, task_ids: Sequence[str] | None = None, **env_kwargs: Any) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(task_id, [system, first user message]) per task, from one env reset each.

    task_ids: default the env's own task list (its split). The messages are the env's own prompt,
    which trainers use to filter overlong prompts; the adapters' envs render it again at reset.
    """
    env = gym.make(env_id, **env_kwargs)
    try:
        ids = list(task_ids) if task_ids is not None else list(env.unwrapped.task_ids)
        for task_id in ids:
            _, info = env.reset(options={"task_id": task_id})
            yield task_id, [{"role": m["role"], "content": m["content"]} for m in info["messages"]]
    finally:
        env.close()
