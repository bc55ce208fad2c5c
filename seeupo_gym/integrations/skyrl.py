"""Our envs in SkyRL (`skyrl_gym` 0.4): `register()`, then `skyrl_gym.make`.

    from seeupo_gym.integrations.skyrl import register
    import skyrl_gym

    register()
    env = skyrl_gym.make("seeupo/BFCL-v4-v0", env_config={"max_turns": 10, "action_format": "tools"},
                         extras={"task_id": "multi_turn_base_0"})
    prompt, metadata = env.init([])
    output = env.step(response_text)  # {"observations": [...], "reward", "done", "metadata"}

SkyRL builds an env per trajectory as `Env(env_config, extras)`: here `env_config` holds the
keyword arguments of `gym.make` (a dict or an OmegaConf config) and `extras` the dataset row,
whose `task_id` (top level, or inside `extra_info`) picks the task. `init` returns the env's own
prompt (system and first user message; the dataset's prompt is not used) and `step` returns the
messages the env added after the response: `user` messages (ReAct, a BFCL turn end) or `tool`
messages (tools format). SkyRL renders conversations without `tools=`, so in the tools format the
tool schemas are written into the system message (one JSON per line under "# Tools").

`build_dataset(env_id, task_ids, **env_kwargs)` gives the rows of a SkyRL dataset (`prompt`,
`env_class`, `reward_spec`, `data_source`, `extra_info` with the task id); SkyRL hands every column
but `prompt` and `env_class` to the env as `extras`. The env's kwargs stay in SkyRL's config
(`environment.skyrl_gym.<env_class>`), which becomes `env_config`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym

import seeupo_gym  # noqa: F401  (registers the Gymnasium ids)
from seeupo_gym.integrations.task_prompts import task_prompts

ENV_IDS = (
    "seeupo/TurnBandit-v0",
    "seeupo/BFCL-v4-v0",
    "seeupo/BFCL-v4-base-v0",
    "seeupo/BFCL-v4-miss-func-v0",
    "seeupo/BFCL-v4-miss-param-v0",
    "seeupo/BFCL-v4-long-context-v0",
    "seeupo/AppWorld-v0",
)


def _plain(config: Any) -> dict[str, Any]:
    """env_config as a plain dict (SkyRL passes OmegaConf configs)."""
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return dict(OmegaConf.to_container(config, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # omegaconf comes with skyrl-gym; a plain mapping needs nothing
        pass
    if not isinstance(config, Mapping):
        raise TypeError(f"env_config must be a mapping of gym.make keyword arguments, got {type(config).__name__}")
    return dict(config)


def _task_id(extras: Mapping[str, Any]) -> str:
    task_id = extras.get("task_id")
    if task_id is None and isinstance(extras.get("extra_info"), Mapping):
        task_id = extras["extra_info"].get("task_id")
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f'extras must name the task: {{"task_id": ...}} (or extra_info.task_id), got keys {sorted(extras)}')
    return task_id


@functools.cache  # built on first use: skyrl_gym is an optional dependency
def _env_class() -> type:
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

    class SeeupoTextEnv(BaseTextEnv):
        """One episode of a seeupo-gym env, SkyRL's way."""

        def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None, *, gym_id: str) -> None:
            super().__init__()
            self.task_id = _task_id(extras or {})
            self.env = gym.make(gym_id, **_plain(env_config))
            self.max_turns = int(getattr(self.env.unwrapped, "max_turns", 10))
            self._messages: list[dict[str, Any]] = []

        def init(self, prompt: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            _, info = self.env.reset(options={"task_id": self.task_id})
            self.turns = 0
            self._messages = [dict(m) for m in info["messages"]]
            conversation = [dict(m) for m in self._messages]
            tools = info.get("tools") or []
            if tools and conversation and conversation[0]["role"] == "system":
                listed = "\n".join(json.dumps(tool) for tool in tools)
                conversation[0]["content"] += f"\n\n# Tools\n{listed}"
            return conversation, {"task_id": self.task_id, "tools": tools}

        def step(self, action: str) -> BaseTextEnvStepOutput:
            self.turns += 1
            _, reward, terminated, truncated, info = self.env.step(action)
            messages = [dict(m) for m in info["messages"]]
            # What the env added after the response's own assistant message.
            observations = messages[len(self._messages) + 1 :]
            self._messages = messages
            metadata = {key: value for key, value in info.items() if key != "messages"}
            return BaseTextEnvStepOutput(
                observations=observations, reward=float(reward), done=bool(terminated or truncated), metadata=metadata
            )

        def close(self) -> None:
            self.env.close()

    return SeeupoTextEnv


def make_env(env_config: Any = None, extras: Mapping[str, Any] | None = None, *, gym_id: str) -> Any:
    """SkyRL's entry point for every id `register` adds."""
    return _env_class()(env_config, extras, gym_id=gym_id)


def register(env_ids: tuple[str, ...] = ENV_IDS) -> None:
    """Register our envs in skyrl_gym under their Gymnasium ids (idempotent)."""
    import skyrl_gym

    for env_id in env_ids:
        if env_id not in skyrl_gym.registry:
            skyrl_gym.register(id=env_id, entry_point=make_env, kwargs={"gym_id": env_id})


def build_dataset(
    env_id: str, task_ids: Sequence[str] | None = None, **env_kwargs: Any
) -> list[dict[str, Any]]:
    """SkyRL's dataset rows for the tasks of `env_id` (default: the env's own task list).

    `prompt` is the env's first messages (SkyRL filters overlong prompts with it; `init` renders the
    env's own prompt again), `env_class` the id `register` adds, `reward_spec` says the env scores,
    `extra_info` holds `task_id` (what picks the task), `split` (the env's split kwarg, default
    "train") and `index`.
    """
    if env_id not in ENV_IDS:
        raise ValueError(f"no SkyRL env for {env_id!r}; use one of {ENV_IDS}")
    return [
        {
            "data_source": env_id,
            "prompt": prompt,
            "env_class": env_id,
            "reward_spec": {"method": "env", "ground_truth": ""},
            "extra_info": {"split": str(env_kwargs.get("split", "train")), "index": index, "task_id": task_id},
        }
        for index, (task_id, prompt) in enumerate(task_prompts(env_id, task_ids, **env_kwargs))
    ]
