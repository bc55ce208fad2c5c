"""`python -m seeupo_gym.integrations.verl <verl Hydra overrides>`: SeeUPO on stock verl 0.9.1.

verl's own config (`verl/trainer/config/ppo_trainer.yaml`) with SeeUPO's defaults first and yours
after, checked, then verl's own launcher (`run_ppo` with its v1 task runner). `--help` lists the
options; `--print-config` checks and prints them without starting anything.
"""

from __future__ import annotations

import sys
from typing import Any

from seeupo_gym.integrations.verl.seeupo import VerlSeeUPOConfig, check_actor_options
from seeupo_gym.integrations.verl.launch_check import resolve_for_workers

HOOK = "seeupo_gym.integrations.verl.trainer.register"

# SeeUPO's place in verl's config: its trainer and estimator, the loss its pools need, its options.
DEFAULTS = (
    "trainer.v1.trainer_mode=seeupo",
    "algorithm.adv_estimator=seeupo",
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "+algorithm.seeupo.order=reverse",
    "+algorithm.seeupo.normalization=batch",
    "+algorithm.seeupo.m_clip=null",
    "+algorithm.seeupo.old_policy=step_start",
    "+algorithm.seeupo.seed=0",
    f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}",
)

OPTIONS = (  # (key, default, meaning)
    ("algorithm.seeupo.order", "reverse", "pool order: reverse (T..1, the paper) | natural (1..T) | random"),
    ("algorithm.seeupo.normalization", "batch", "GRAE of the initial M: batch (the paper) | group | none"),
    ("algorithm.seeupo.m_clip", "null", "[low, high] clip of M's ratio product (the authors' code: [0.8,1.2])"),
    ("algorithm.seeupo.old_policy", "step_start", "ratios against theta_k (the paper) | turn_start (the authors' code)"),
    ("algorithm.seeupo.seed", "0", "seed of the random order"),
)

HELP = """usage: python -m seeupo_gym.integrations.verl [--print-config] [verl Hydra overrides ...]

SeeUPO (turn pools updated in order, weighted by M) on stock verl 0.9.1: verl's own config system,
its v1 trainer and any of its engines; the actor update is SeeUPO's.

SeeUPO's options (override as algorithm.seeupo.order=natural):
{options}

Set for you (changing them is refused): trainer.v1.trainer_mode=seeupo, algorithm.adv_estimator=seeupo,
actor_rollout_ref.actor.policy_loss.loss_mode=gspo, actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean,
actor_rollout_ref.actor.ppo_epochs=1.
Refused: a critic, algorithm.rollout_correction, actor_rollout_ref.actor.entropy_coeff != 0,
actor_rollout_ref.rollout.n < 2, trainer.use_v1=false.
Every other verl option works as in verl (see `python -m verl.trainer.main_ppo --help`). The paper's
run: scripts/verl_seeupo_paper.sh bfcl|appworld (docs/integrations.md, "SeeUPO in verl").
"""


PRINTED = ("actor_rollout_ref.model.path", "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.n",
           "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.clip_ratio_low",
           "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.use_kl_loss",
           "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type", "data.train_batch_size")


def usage() -> str:
    width = max(len(k) for k, _, _ in OPTIONS)
    return HELP.format(options="\n".join(f"  {k:<{width}}  {d:<10}  {m}" for k, d, m in OPTIONS))


def compose(overrides: list[str]) -> Any:
    from seeupo_gym.integrations.verl.cpu import verl_config

    return verl_config([*DEFAULTS, *overrides])


def check(config: Any) -> VerlSeeUPOConfig:
    """Refuse, in one line each, what SeeUPO's trainer cannot honour."""
    from omegaconf import OmegaConf

    if not config.trainer.use_v1:
        raise ValueError("SeeUPO runs on verl's v1 trainer: drop trainer.use_v1=false")
    if config.trainer.v1.trainer_mode != "seeupo":
        raise ValueError(f"trainer.v1.trainer_mode must stay seeupo (got {config.trainer.v1.trainer_mode!r})")
    if config.algorithm.adv_estimator != "seeupo":
        raise ValueError(f"algorithm.adv_estimator must stay seeupo (got {config.algorithm.adv_estimator!r})")
    actor = OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True)
    check_actor_options(actor)
    if float(actor.get("entropy_coeff") or 0.0) != 0.0:
        raise ValueError("SeeUPO's loss has no entropy bonus: set actor_rollout_ref.actor.entropy_coeff=0")
    if config.critic.get("enable"):
        raise ValueError("SeeUPO is critic-free: set critic.enable=false")
    correction = config.algorithm.get("rollout_correction")
    if correction is not None and (correction.get("rollout_is") or correction.get("rollout_rs") or correction.get("bypass_mode")):
        raise ValueError("algorithm.rollout_correction is not applied to SeeUPO's pools: turn it off")
    if int(config.actor_rollout_ref.rollout.n) < 2:
        raise ValueError("SeeUPO's group-relative advantages need actor_rollout_ref.rollout.n >= 2")
    return VerlSeeUPOConfig.from_mapping(OmegaConf.to_container(config.algorithm.seeupo, resolve=True))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):
        print(usage())
        return 0
    print_only = "--print-config" in args
    overrides = [a for a in args if a != "--print-config"]
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        print(f"seeupo verl: unknown flag {bad[0]!r}; give verl Hydra overrides (key=value) or --help", file=sys.stderr)
        return 2
    known = {key.rsplit(".", 1)[1] for key, _, _ in OPTIONS}
    unknown = [a.split("=", 1)[0] for a in overrides if a.lstrip("+~").startswith("algorithm.seeupo.")
               and a.split("=", 1)[0].lstrip("+~").rsplit(".", 1)[1] not in known]
    if unknown:
        print(f"seeupo verl: no SeeUPO option {unknown[0]!r}; the options are {sorted(known)} (--help)", file=sys.stderr)
        return 2
    try:
        config = compose(overrides)
        options = check(resolve_for_workers(config))  # the values the workers get, not re-read in their environment
    except Exception as error:  # Hydra's and ours: one line, no traceback
        print(f"seeupo verl: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
        return 2
    if print_only:
        from omegaconf import OmegaConf

        def value(key: str) -> Any:
            return OmegaConf.select(config, key, default="?", throw_on_missing=False)

        print(f"SeeUPO: {options}")
        print("verl: " + ", ".join(f"{key}={value(key)}" for key in PRINTED))
        return 0
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo, validate_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.device import auto_set_device

    from seeupo_gym.integrations.verl.trainer import register

    register()
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=TaskRunnerV1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
