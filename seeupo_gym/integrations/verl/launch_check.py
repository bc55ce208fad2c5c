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


def check_layout(config: Any) -> None:
    """The rollout's tensor parallelism fits the GPUs the run asks for (trainer.n_gpus_per_node x
    trainer.nnodes): verl otherwise accepts the config and its workers fail, or wait, once placed.
    Raises ValueError (one line)."""
    rollout = config.actor_rollout_ref.rollout
    tp = int(rollout.get("tensor_model_parallel_size") or 1)
    gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    where = (f"trainer.n_gpus_per_node={config.trainer.n_gpus_per_node} x trainer.nnodes={config.trainer.nnodes} "
             f"= {gpus} GPU(s)")
    if tp > gpus:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} is more than the run's {where}; "
                         f"set it to at most {gpus}, or ask for more GPUs")
    if gpus % tp:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the run's {where} "
                         "into whole rollout engines")
