"""The config the launcher checks is the config verl's workers run.

verl's task runner resolves the config's interpolations in its own Ray process, whose environment
is not the launcher's (`ray_kwargs.ray_init.runtime_env.env_vars` sets variables there): a value
such as `trainer.v1.trainer_mode=${oc.env:MODE,seeupo}` reads "seeupo" when the launcher checks it
and "sync" in the workers. So the launcher resolves every interpolation here, once, before its
checks: what verl ships to its workers is the literal values that were checked.
"""

from __future__ import annotations

from typing import Any


def resolve_for_workers(config: Any) -> Any:
    """`config` with every interpolation resolved in place, in this process (returned for chaining).
    Unresolvable values fail here, in one line (the launcher prints it), not in a worker."""
    from omegaconf import OmegaConf

    OmegaConf.resolve(config)
    return config
