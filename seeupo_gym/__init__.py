"""seeupo-gym: sequence-level multi-turn text envs for LLM agents.

Importing this package registers the env ids with *string* entry points, so it stays
cheap: nothing heavy (bfcl-eval, httpx servers, torch) is imported until `gym.make`.
"""

from __future__ import annotations

import os

from gymnasium.envs.registration import register, registry


def _checkout_layers() -> None:
    """In the repository, agents/ and algorithms/ sit beside this folder; an install puts them
    inside it (pyproject's package-dir). Imported straight from a checkout (the root on sys.path:
    `python -c` from the root shadows a regular install), the root joins this package's path so
    that `seeupo_gym.agents` and `seeupo_gym.algorithms` still resolve, never as top-level names."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if any(os.path.isdir(os.path.join(here, layer)) for layer in ("agents", "algorithms")):
        return  # installed: the layers are inside
    beside = all(os.path.isfile(os.path.join(root, layer, "__init__.py")) for layer in ("agents", "algorithms"))
    if beside and os.path.isfile(os.path.join(root, "pyproject.toml")) and root not in __path__:
        __path__.append(root)


_checkout_layers()

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
