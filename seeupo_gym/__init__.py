"""seeupo-gym: sequence-level multi-turn text envs for LLM agents.

Importing this package registers the env ids with *string* entry points, so it stays
cheap: nothing heavy (bfcl-eval, httpx servers, torch) is imported until `gym.make`.
"""

from __future__ import annotations

from gymnasium.envs.registration import register, registry

from seeupo_gym.spaces import UnicodeText

__all__ = ["UnicodeText"]

# id -> "module:callable"; string entry points keep this import cheap.
_ENVS: dict[str, str] = {
    "seeupo/AppWorld-v0": "seeupo_gym.appworld.env:AppWorldEnv",
    "seeupo/TurnBandit-v0": "seeupo_gym.turnbandit:TurnBanditEnv",
    "seeupo/BFCL-v4-v0": "seeupo_gym.bfcl.env:BFCLEnv",
    "seeupo/BFCL-v4-base-v0": "seeupo_gym.bfcl.env:make_base",
    "seeupo/BFCL-v4-miss-func-v0": "seeupo_gym.bfcl.env:make_miss_func",
    "seeupo/BFCL-v4-miss-param-v0": "seeupo_gym.bfcl.env:make_miss_param",
    "seeupo/BFCL-v4-long-context-v0": "seeupo_gym.bfcl.env:make_long_context",
    # Any of the above served by `seeupo-serve` (needs the serve extra) or held by a Ray actor
    # (the ray extra): gym.make("seeupo/Remote-v0", url=..., env_id=..., env_kwargs=...).
    "seeupo/Remote-v0": "seeupo_gym.remote:RemoteEnv",
    "seeupo/Ray-v0": "seeupo_gym.remote_ray:RayEnv",
}

for _env_id, _entry_point in _ENVS.items():
    if _env_id not in registry:
        register(id=_env_id, entry_point=_entry_point)
