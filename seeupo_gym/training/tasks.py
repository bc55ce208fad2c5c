"""The task ids an env offers, for configs that do not list them."""

from __future__ import annotations

from typing import Any

from seeupo_gym.training.config import ConfigError


def env_task_ids(env_id: str, env_kwargs: dict[str, Any]) -> list[str]:
    """The env's `task_ids` (an attribute or a method of the unwrapped env)."""
    import gymnasium as gym

    import seeupo_gym  # noqa: F401  (registers the ids)

    try:
        env = gym.make(env_id, **env_kwargs)
    except Exception as error:
        raise ConfigError(f"env.id {env_id!r} with env.kwargs {env_kwargs}: cannot make the env: {error}") from error
    try:
        ids = getattr(env.unwrapped, "task_ids", None)
        if callable(ids):
            ids = ids()
    finally:
        env.close()
    if not ids:
        raise ConfigError(f"env {env_id!r} does not list its tasks (no `task_ids`); set env.train_tasks")
    return [str(task) for task in ids]
