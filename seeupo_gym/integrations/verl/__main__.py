"""`python -m seeupo_gym.integrations.verl [flags] <verl Hydra overrides>`: SeeUPO on stock verl 0.9.1.

The config is Hydra's, composed from `seeupo_trainer` (config/seeupo_trainer.yaml: verl's own
`ppo_trainer` with SeeUPO's place in it), the experiments shipped beside it (`+experiment=paper_bfcl`)
and your overrides; it is checked, then run by verl's own launcher (`run_ppo` with its v1 task runner).
`--cfg job` prints the composed config as Hydra does; `--print-config` checks it and prints every
key, resolved; neither starts anything. `--help` lists the options.
"""

from __future__ import annotations

import os
import sys
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

from seeupo_gym.integrations.verl.seeupo import VerlSeeUPOConfig, check_actor_options
from seeupo_gym.integrations.verl.launch_check import check_layout, resolve_for_workers

HOOK = "seeupo_gym.integrations.verl.trainer.register"
CONFIG_DIR = Path(__file__).resolve().parent / "config"
CONFIG_NAME = "seeupo_trainer"
PKG_PREFIX = "pkg://seeupo_gym.integrations.verl/"  # a file shipped in this package, as a config value
PKG_KEYS = ("actor_rollout_ref.rollout.agent.agent_loop_config_path",)

# SeeUPO's place in verl's config (what config/seeupo_trainer.yaml sets and `check` insists on).
DEFAULTS = (
    "trainer.v1.trainer_mode=seeupo",
    "algorithm.adv_estimator=seeupo",
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "algorithm.seeupo.order=reverse",
    "algorithm.seeupo.normalization=batch",
    "algorithm.seeupo.m_clip=null",
    "algorithm.seeupo.old_policy=step_start",
    "algorithm.seeupo.seed=0",
    "algorithm.seeupo.variant=paper",
    "algorithm.seeupo.m_alignment=rollout",
    "algorithm.seeupo.max_steps=null",
    "algorithm.seeupo.balance_world_size=1",
    f"ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}",
)

OPTIONS = (  # (key, default, meaning)
    ("algorithm.seeupo.order", "reverse", "pool order: reverse (T..1, the paper) | natural (1..T) | random"),
    ("algorithm.seeupo.normalization", "batch", "GRAE of the initial M: batch (the paper) | group | none"),
    ("algorithm.seeupo.m_clip", "null", "[low, high] clip of M's ratio product (the authors' code: [0.8,1.2])"),
    ("algorithm.seeupo.old_policy", "step_start", "ratios against theta_k (the paper) | turn_start (the authors' code)"),
    ("algorithm.seeupo.seed", "0", "seed of the random order"),
    ("algorithm.seeupo.variant", "paper", "paper (Algorithm 1) | authors (as the authors' code: docs/algorithms.md)"),
    ("algorithm.seeupo.m_alignment", "rollout", "authors: M by trajectory (rollout) | by row after balance_batch (position)"),
    ("algorithm.seeupo.max_steps", "null", "authors: turn pools per step, padding rows included (null: longest row)"),
    ("algorithm.seeupo.balance_world_size", "1", "authors, position: ranks balance_batch partitions each pool over"),
)

EXPERIMENTS = ("paper_bfcl", "paper_appworld")

HELP = """usage: python -m seeupo_gym.integrations.verl [--print-config | --cfg job [--resolve]]
           [--config-path DIR] [--config-name NAME] [verl Hydra overrides ...]

SeeUPO (turn pools updated in order, weighted by M) on stock verl 0.9.1: verl's own config system,
its v1 trainer and any of its engines; the actor update is SeeUPO's.

  --cfg job          print the composed config (YAML, interpolations kept) and exit, as Hydra does
  --resolve          with --cfg job: resolve the interpolations
  --print-config     check the config as a run would, print every key resolved (key=value) and exit
  --config-name NAME the primary config (default seeupo_trainer); yours may list seeupo_trainer in its
                     defaults
  --config-path DIR  a folder searched first for --config-name and config groups
Shipped configs (seeupo_gym/integrations/verl/config): seeupo_trainer, and experiments composed with
+experiment=NAME: {experiments} (the paper's runs, docs/integrations.md "SeeUPO in verl").

SeeUPO's options (override as algorithm.seeupo.order=natural):
{options}

Set for you (changing them is refused): trainer.v1.trainer_mode=seeupo, algorithm.adv_estimator=seeupo,
actor_rollout_ref.actor.policy_loss.loss_mode=gspo, actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean,
actor_rollout_ref.actor.ppo_epochs=1.
Refused: a critic, algorithm.rollout_correction, actor_rollout_ref.actor.entropy_coeff != 0,
actor_rollout_ref.rollout.n < 2, trainer.use_v1=false; a run on fewer GPUs than
trainer.n_gpus_per_node x trainer.nnodes, or with rollout.name=vllm where vllm is not installed.
Every other verl option works as in verl (see `python -m verl.trainer.main_ppo --help`). The paper's
run with its data: scripts/verl_seeupo_paper.sh bfcl|appworld.
"""


def usage() -> str:
    width = max(len(k) for k, _, _ in OPTIONS)
    return HELP.format(options="\n".join(f"  {k:<{width}}  {d:<10}  {m}" for k, d, m in OPTIONS),
                       experiments=", ".join(EXPERIMENTS))


def verl_config_dir() -> str:
    import verl

    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def compose(overrides: list[str], config_name: str = CONFIG_NAME, config_path: str | None = None) -> Any:
    """Hydra's compose: `config_name` from `config_path` (if given), this package's configs, then verl's."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    search = [str(CONFIG_DIR), verl_config_dir()]
    primary = os.path.abspath(config_path) if config_path else search.pop(0)
    if config_path and not os.path.isdir(primary):
        raise ValueError(f"--config-path {config_path}: no such folder")
    GlobalHydra.instance().clear()
    with warnings.catch_warnings():
        # hydra-core 1.3 calling omegaconf 2.4 (`make venv` installs the two side by side): deprecations of
        # hydra's own calls, nothing a user's config can change; every other warning is shown.
        warnings.filterwarnings("ignore", r"register_new_resolver\(\) is deprecated", UserWarning)
        warnings.filterwarnings("ignore", r"Implicit conversion from Version to str", FutureWarning)
        with initialize_config_dir(config_dir=primary, version_base=None):
            config = hydra_compose(config_name, overrides=[
                f"hydra.searchpath=[{','.join('file://' + p for p in search)}]", *overrides])
    from omegaconf import OmegaConf

    for key in PKG_KEYS:  # pkg:// values name files shipped here; verl wants a path
        value = OmegaConf.select(config, key, default=None)
        if isinstance(value, str) and value.startswith(PKG_PREFIX):
            relative = value[len(PKG_PREFIX):]
            path = resources.files("seeupo_gym.integrations.verl").joinpath(relative)
            if ".." in Path(relative).parts or Path(relative).is_absolute() or not path.is_file():
                raise ValueError(f"{key}={value}: no such file in seeupo_gym.integrations.verl")
            OmegaConf.update(config, key, str(path))
    return config


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
    check_layout(config)
    return VerlSeeUPOConfig.from_mapping(OmegaConf.to_container(config.algorithm.seeupo, resolve=True))


FLAGS_WITH_VALUE = ("--cfg", "--config-name", "--config-path")


def parse(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Split the launcher's flags (Hydra's spellings: `--cfg job` or `--cfg=job`) from the overrides."""
    flags: dict[str, Any] = {"--print-config": False, "--resolve": False}
    overrides: list[str] = []
    rest = iter(args)
    for arg in rest:
        name, eq, value = arg.partition("=")
        if name in FLAGS_WITH_VALUE:
            if not eq:
                value = next(rest, "")
            if not value or value.startswith("-"):
                raise ValueError(f"{name} needs a value")
            flags[name] = value
        elif arg in ("--print-config", "--resolve"):
            flags[arg] = True
        elif arg.startswith("-"):
            raise ValueError(f"unknown flag {arg!r}; give verl Hydra overrides (key=value) or --help")
        else:
            overrides.append(arg)
    if flags.get("--cfg") not in (None, "job"):
        raise ValueError(f"--cfg {flags['--cfg']}: only `--cfg job` is supported (the config verl runs)")
    if flags["--resolve"] and "--cfg" not in flags:
        raise ValueError("--resolve goes with --cfg job")
    return flags, overrides


def flat(node: Any, prefix: str = "") -> list[str]:
    """Every leaf of a resolved config as `key=value`, in the config's order (values as Hydra reads them)."""
    import json

    if isinstance(node, dict):
        if not node and prefix:
            return [f"{prefix}={{}}"]
        return [line for key, value in node.items() for line in flat(value, f"{prefix}.{key}" if prefix else str(key))]
    if node is None:
        text = "null"
    elif isinstance(node, bool):
        text = str(node).lower()
    elif isinstance(node, (int, float)):
        text = repr(node)
    elif isinstance(node, list):
        text = json.dumps(node)
    else:  # a string that would read back as another type ("true", "1", "") is quoted, as an override needs
        text = str(node)
        if text in ("", "???") or _reads_as_other(text):
            text = text if text == "???" else json.dumps(text)
    return [f"{prefix}={text}"]


def _reads_as_other(text: str) -> bool:
    import yaml

    try:
        return yaml.safe_load(text) != text
    except yaml.YAMLError:
        return False


def machine_check(config: Any) -> str | None:
    """Why this machine cannot start the run, in one line, or None. verl's Ray placement otherwise
    waits for GPUs that never come, silently."""
    import importlib.util

    import torch

    wanted = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted > 0 and have < wanted:
        return (f"this run needs {wanted} GPU(s) (trainer.n_gpus_per_node={config.trainer.n_gpus_per_node} x "
                f"trainer.nnodes={config.trainer.nnodes}) and this machine has {have}; set trainer.n_gpus_per_node "
                f"to what it has, or check the config without GPUs with --print-config")
    name = str(config.actor_rollout_ref.rollout.name)
    if name in ("vllm", "sglang") and importlib.util.find_spec(name) is None:
        return (f"actor_rollout_ref.rollout.name={name} but {name} is not installed here: "
                f"pip install -r scripts/verl_gpu_requirements.txt (docs/install.md, verl on GPUs)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):
        print(usage())
        return 0
    try:
        flags, overrides = parse(args)
    except ValueError as error:
        print(f"seeupo verl: {error}", file=sys.stderr)
        return 2
    known = {key.rsplit(".", 1)[1] for key, _, _ in OPTIONS}
    unknown = [a.split("=", 1)[0] for a in overrides if a.lstrip("+~").startswith("algorithm.seeupo.")
               and a.split("=", 1)[0].lstrip("+~").rsplit(".", 1)[1] not in known]
    if unknown:
        print(f"seeupo verl: no SeeUPO option {unknown[0]!r}; the options are {sorted(known)} (--help)", file=sys.stderr)
        return 2
    try:
        config = compose(overrides, flags.get("--config-name", CONFIG_NAME), flags.get("--config-path"))
    except Exception as error:  # Hydra's: one line, no traceback
        print(f"seeupo verl: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
        return 2
    from omegaconf import OmegaConf

    if "--cfg" in flags:  # Hydra's `--cfg job`: the composed config, before any check
        print(OmegaConf.to_yaml(config, resolve=flags["--resolve"]), end="")
        return 0
    try:
        options = check(resolve_for_workers(config))  # the values the workers get, not re-read in their environment
    except Exception as error:  # ours: one line, no traceback
        print(f"seeupo verl: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
        return 2
    if flags["--print-config"]:
        print(f"SeeUPO: {options}")
        print("\n".join(flat(OmegaConf.to_container(config, resolve=True))))
        return 0
    problem = machine_check(config)
    if problem:
        print(f"seeupo verl: {problem}", file=sys.stderr)
        return 2
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
