"""What a comparison will run: the (algorithm, seed) runs, their resolved configs, the eval plan.

Everything a user can get wrong (algorithm names, options, seeds, eval settings, the config)
is checked here, before any run starts, so a typo never surfaces an hour into a comparison.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from seeupo_gym.training.config import (
    Config,
    ConfigError,
    ConfigPaths,
    config_from_dict,
    load_raw_config,
    parse_yaml,
)

logger = logging.getLogger(__name__)


@dataclass
class EvalPlan:
    """How runs are evaluated: n >= k rollouts per task on up to `max_tasks` tasks."""

    # Steps between evaluations (0: only before and after training).
    every: int = 2
    k: int = 4
    n: int | None = None
    # Task ids; None: env.eval_tasks, else the tasks of the (eval) env.
    tasks: list[str] | None = None
    max_tasks: int = 16
    temperature: float = 1.0
    # Merged over env.kwargs for evaluation only, e.g. {"split": "test"} or TurnBandit {"seed": 1}.
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    at_start: bool = True


@dataclass
class RunSpec:
    """One (algorithm, seed) run: its label, the resolved trainer config and its folder."""

    label: str
    algorithm: str
    seed: int
    config: Config
    folder: Path


@dataclass
class ComparePlan:
    runs: list[RunSpec]
    eval: EvalPlan
    eval_tasks: list[str]
    output_dir: Path
    save_checkpoints: bool = False


def plan_token_budget(plan: ComparePlan) -> int:
    """The most tokens a comparison generates: every run's training rollouts and evaluations, each
    turn using its whole budget (`evaluation.token_budget`)."""
    from seeupo_gym.training.evaluation import episode_turns, token_budget

    total = 0
    for run in plan.runs:
        config = run.config
        evals = len(eval_steps(config.train.steps, plan.eval.every, plan.eval.at_start))
        episodes = config.train.steps * config.train.tasks_per_step * config.train.group_size
        episodes += evals * len(plan.eval_tasks) * (plan.eval.n or plan.eval.k)
        total += token_budget(episodes, episode_turns(config.env.kwargs), config.sampling.max_new_tokens)
    return total


def parse_algorithms(text: str) -> dict[str, str]:
    """`seeupo,grpo,natural=seeupo` -> {label: registered name}."""
    pairs: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        label, _, name = item.partition("=")
        label, name = label.strip(), (name.strip() or label.strip())
        if label in pairs:
            raise ConfigError(f"--algorithms lists {label!r} twice; give repeated algorithms distinct labels (label=name)")
        pairs[label] = name
    if not pairs:
        raise ConfigError("--algorithms is empty; give e.g. seeupo,grpo")
    return pairs


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds must list distinct integers, got {text!r}")
    return seeds


def parse_sets(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`--set natural.order=natural` items -> {label: {option: value}} (values parsed as YAML)."""
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        label, dot, option = key.partition(".")
        if not sep or not dot or not label or not option:
            raise ConfigError(f"--set {item!r} is not of the form LABEL.key=value")
        options.setdefault(label.strip(), {})[option.strip()] = parse_yaml(value) if value.strip() else ""
    return options


def load_raw(paths: ConfigPaths, overrides: Sequence[str]) -> dict[str, Any]:
    """The shared config as a plain mapping (YAML files or preset names, merged in order, then overrides).

    Kept raw rather than typed: each run rewrites its `algorithm` section before validation.
    """
    return load_raw_config(paths, overrides)


def algorithm_options(name: str, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The config's algorithm options that `name` accepts, then the run's own (--set) options."""
    from seeupo_gym.algorithms.base import make_algorithm

    try:
        accepted = {f.name for f in dataclasses.fields(make_algorithm(name).config_class)}
    except ValueError as error:
        raise ConfigError(f"--algorithms: {error} (an algorithm of your own: load its file with --plugin)") from error
    dropped = sorted(set(shared) - accepted)
    if dropped:
        logger.info("%s does not take the config's algorithm option(s) %s; they apply to the others", name, dropped)
    return {**{k: v for k, v in shared.items() if k in accepted}, **own}


def eval_steps(steps: int, every: int, at_start: bool) -> list[int]:
    """The steps after which a run is evaluated (0 = before training); the last step always."""
    points = [0] if at_start else []
    if every:
        points += list(range(every, steps + 1, every))
    if steps not in points:
        points.append(steps)
    return points


def build_plan(
    raw: dict[str, Any],
    algorithms: dict[str, str],
    seeds: Sequence[int],
    output_dir: str | Path,
    eval_plan: EvalPlan,
    options: dict[str, dict[str, Any]] | None = None,
    save_checkpoints: bool = False,
) -> ComparePlan:
    """Resolve and check every run's config before any run starts (errors name the key)."""
    from seeupo_gym.training.tasks import eval_task_ids, train_task_ids
    from seeupo_gym.training.trainer import build_algorithm, check_trackers

    options = options or {}
    unknown = sorted(set(options) - set(algorithms))
    if unknown:
        raise ConfigError(f"--set names {unknown}, which are not among --algorithms labels {sorted(algorithms)}")
    for key in ("every", "max_tasks"):
        if getattr(eval_plan, key) < 0:
            raise ConfigError(f"--eval-{key.replace('_', '-')} must be >= 0, got {getattr(eval_plan, key)}")
    n = eval_plan.n if eval_plan.n is not None else eval_plan.k
    if eval_plan.k < 1 or n < eval_plan.k:
        raise ConfigError(f"need 1 <= eval k <= n, got k={eval_plan.k}, n={n}")
    eval_plan.n = n
    output = Path(output_dir)
    base = config_from_dict(raw)
    shared = dict(base.algorithm.options)
    # Listed once for all runs: every algorithm then draws its step's tasks from the same list.
    train_tasks = train_task_ids(base.env)

    runs: list[RunSpec] = []
    for label, name in algorithms.items():
        for seed in seeds:
            run_raw = copy.deepcopy(raw)
            run_raw["algorithm"] = {"name": name, **algorithm_options(name, shared, options.get(label, {}))}
            train = run_raw.setdefault("train", {})
            train["seed"] = int(seed)
            train["eval_every"] = 0  # the comparison evaluates (k rollouts per task), not the trainer
            train["save_every"] = 0  # checkpoints: at the end with --save-checkpoints, or on failure
            run_raw.setdefault("env", {})["train_tasks"] = list(train_tasks)
            run_raw.setdefault("log", {})["output_dir"] = str(output / label / f"seed-{seed}")
            run_raw["resume_from"] = None
            try:
                config = config_from_dict(run_raw)
                build_algorithm(config)
                check_trackers(config.log.trackers)
            except ConfigError as error:
                raise ConfigError(f"run {label} (seed {seed}): {error}") from error
            runs.append(RunSpec(label, name, int(seed), config, output / label / f"seed-{seed}"))

    tasks = list(eval_plan.tasks or eval_task_ids(base.env, eval_plan.env_kwargs))
    if eval_plan.max_tasks:
        tasks = tasks[: eval_plan.max_tasks]
    return ComparePlan(runs, eval_plan, tasks, output, save_checkpoints)
