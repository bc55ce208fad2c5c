"""The task ids an env offers, for configs that do not list them; and where a config evaluates,
resolved once for the trainer, `seeupo-eval` and `seeupo-compare`."""

from __future__ import annotations

from typing import Any

from seeupo_gym.remote import env_target
from seeupo_gym.training.config import ConfigError, EnvConfig


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


def env_workers(env: EnvConfig) -> dict[str, Any]:
    """Where the config's envs run, as VectorAgent's `workers` / `url` / `worker_options`."""
    return {"workers": env.workers, "url": env.url, "worker_options": env.worker_options}


def agent_options(env: EnvConfig) -> dict[str, Any]:
    """VectorAgent's keyword arguments that say how the config's envs are stepped and where they
    run, the same for training and evaluation."""
    return {"vectorization": env.vectorization, "schedule": env.schedule, **env_workers(env)}


def listed_task_ids(env: EnvConfig, env_kwargs: dict[str, Any]) -> list[str]:
    """`env_task_ids` of the config's env with `env_kwargs`, asked where the envs run (locally,
    on Ray workers or behind `env.url`)."""
    return env_task_ids(*env_target(env.id, env_kwargs, **env_workers(env)))


def train_task_ids(env: EnvConfig) -> list[str]:
    """`env.train_tasks`, or every task of the training env."""
    return list(env.train_tasks or listed_task_ids(env, env.kwargs))


def eval_env_kwargs(env: EnvConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The eval env's kwargs: `env.kwargs`, then `env.eval_kwargs`, then `extra` (a command-line
    flag's or a comparison's), each over the last."""
    return {**env.kwargs, **(env.eval_kwargs or {}), **(extra or {})}


def eval_task_ids(env: EnvConfig, extra: dict[str, Any] | None = None) -> list[str]:
    """The eval tasks: `env.eval_tasks` (unless `extra` changes the env); else, when the eval env
    differs from the training env (`env.eval_kwargs` or `extra`), all of its tasks; else the
    training tasks (`env.train_tasks`, or all of the env's)."""
    if env.eval_tasks and not extra:
        return list(env.eval_tasks)
    if env.eval_kwargs is not None or extra:
        return listed_task_ids(env, eval_env_kwargs(env, extra))
    return train_task_ids(env)
