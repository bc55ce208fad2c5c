"""What a comparison will run: the (algorithm, seed) runs, their resolved configs, the eval plan.

Everything a user can get wrong (algorithm names, options, seeds, eval settings, the config)
is checked here, before any run starts, so a typo never surfaces an hour into a comparison.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
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
from seeupo_gym.training.model_source import SERVED_SPEC, ModelSource

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
    # None: 1.0 for a training comparison, the config's sampling.temperature for a models comparison.
    temperature: float | None = 1.0
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
    # The budget held equal across methods: samples | steps (`match.py`).
    match: str = "samples"

    def compared_algorithms(self) -> list[Any]:
        """One algorithm per label, built from its first run's config: the methods a step-matched run
        takes its target from (`match.StepMatched`)."""
        from seeupo_gym.training.trainer import build_algorithm

        first: dict[str, RunSpec] = {}
        for run in self.runs:
            first.setdefault(run.label, run)
        return [build_algorithm(run.config) for run in first.values()]


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
    match: str = "samples",
) -> ComparePlan:
    """Resolve and check every run's config before any run starts (errors name the key)."""
    from seeupo_gym.training.compare.match import MATCHES

    from seeupo_gym.training.tasks import eval_task_ids, train_task_ids
    from seeupo_gym.training.trainer import build_algorithm, check_trackers

    options = options or {}
    if match not in MATCHES:
        raise ConfigError(f"--match must be one of {MATCHES}, got {match!r}")
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
    return ComparePlan(runs, eval_plan, tasks, output, save_checkpoints, match)


# --------------------------------------------------------------------------- models, side by side

# A label names a folder of the comparison: no separators, no dot-dot.
_LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
# --set LABEL.key=value options of a served model (seeupo-eval's --api-key-env, --mode, --tokenizer, --concurrency).
SERVER_OPTIONS = {"api_key_env": str, "mode": str, "tokenizer": str, "concurrency": int,
                  "request_timeout_s": float, "episode_timeout_s": float}


@dataclass
class ModelRun:
    """One label of a models comparison: what it evaluates, and the config a local model loads with
    (the shared config; a checkpoint's own model settings and seed)."""

    label: str
    source: ModelSource
    config: Config
    folder: Path


@dataclass
class ModelsPlan:
    """Every model evaluated on the same tasks, seeds, env and sampling (seeupo-eval's protocol)."""

    models: list[ModelRun]
    seeds: list[int]
    eval: EvalPlan
    eval_tasks: list[str]
    env_kwargs: dict[str, Any]
    max_new_tokens: int
    output_dir: Path


def parse_model(item: str, options: dict[str, Any] | None = None) -> tuple[str, ModelSource]:
    """`LABEL=SPEC` -> (label, ModelSource). SPEC: NAME@URL (a model on an OpenAI-compatible server),
    a checkpoint folder (holding hf/ or adapter/), else a model name or folder ('tiny', 'embedded',
    a Hugging Face id, a local path). `options`: the label's --set server options."""
    from seeupo_gym.training.checkpoint import ADAPTER_FOLDER, HF_FOLDER

    label, sep, spec = item.partition("=")
    label, spec = label.strip(), spec.strip()
    if not sep or not label or not spec:
        raise ConfigError(f"--model {item!r} is not of the form LABEL=SPEC, e.g. base=embedded, "
                          "trained=runs/x/checkpoints/step-8, or gpt=gpt-4o-mini@https://api.openai.com/v1")
    if not _LABEL.match(label):
        raise ConfigError(f"--model label {label!r} must be letters, digits and _ . + - (it names a folder)")
    options = dict(options or {})
    served = SERVED_SPEC.match(spec)
    if served:
        unknown = sorted(set(options) - set(SERVER_OPTIONS))
        if unknown:
            raise ConfigError(f"--set {label}.{unknown[0]}: a served model takes {sorted(SERVER_OPTIONS)}")
        typed = {}
        for key, value in options.items():
            kind = SERVER_OPTIONS[key]
            try:
                typed[key] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"--set {label}.{key} must be {'an integer' if kind is int else 'a number'}, "
                                  f"got {value!r}") from None
        return label, ModelSource(served["name"], base_url=served["url"], **typed)
    if options:
        raise ConfigError(f"--set {label}.{sorted(options)[0]}: {label} is not a served model (NAME@URL); "
                          f"server options {sorted(SERVER_OPTIONS)} apply to served models only")
    path = Path(spec).expanduser()
    if "@" in spec and not path.exists():
        raise ConfigError(f"--model {label}={spec}: a served model is NAME@URL with an http:// or https:// URL, "
                          "e.g. gpt-4o-mini@https://api.openai.com/v1")
    if (path / HF_FOLDER).is_dir() or (path / ADAPTER_FOLDER).is_dir():
        return label, ModelSource("", checkpoint=str(path))  # the base model's name comes from its config.yaml
    if (path / "checkpoints").is_dir():
        raise ConfigError(f"--model {label}={spec}: that is a run folder; give one of its checkpoints, "
                          f"e.g. {path / 'checkpoints' / 'step-N'}")
    return label, ModelSource(spec)


def parse_models(items: Sequence[str], options: dict[str, dict[str, Any]]) -> dict[str, ModelSource]:
    """The --model items (repeatable) with their --set options -> {label: ModelSource}."""
    models: dict[str, ModelSource] = {}
    for item in items:
        label, source = parse_model(item, options.get(item.partition("=")[0].strip()))
        if label in models:
            raise ConfigError(f"--model lists the label {label!r} twice; give each model its own label")
        models[label] = source
    unknown = sorted(set(options) - set(models))
    if unknown:
        raise ConfigError(f"--set names {unknown}, which are not among the --model labels {sorted(models)}")
    return models


def build_models_plan(
    raw: dict[str, Any],
    models: dict[str, ModelSource],
    seeds: Sequence[int],
    output_dir: str | Path,
    eval_plan: EvalPlan,
    max_new_tokens: int,
) -> ModelsPlan:
    """Resolve and check every model before any is loaded (errors name the label)."""
    from seeupo_gym.training.cli import resolve_config
    from seeupo_gym.training.tasks import eval_env_kwargs, eval_task_ids

    n = eval_plan.n if eval_plan.n is not None else eval_plan.k
    if eval_plan.k < 1 or n < eval_plan.k:
        raise ConfigError(f"need 1 <= eval k <= n, got k={eval_plan.k}, n={n}")
    if eval_plan.max_tasks < 0:
        raise ConfigError(f"--eval-tasks must be >= 0, got {eval_plan.max_tasks}")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    eval_plan.n = n
    output = Path(output_dir)
    shared = config_from_dict(raw)
    if eval_plan.temperature is None:  # as seeupo-eval: the config's sampling temperature
        eval_plan.temperature = shared.sampling.temperature
    runs: list[ModelRun] = []
    for label, source in models.items():
        config = config_from_dict(copy.deepcopy(raw))
        try:
            if source.checkpoint is not None:
                if not Path(source.checkpoint).is_dir():
                    raise ConfigError(f"checkpoint {source.checkpoint!r} is not a folder")
                if (Path(source.checkpoint) / "config.yaml").is_file():
                    # The weights load as their run built them (base model, LoRA, dtype, seed of the base).
                    own = resolve_config(None, source.checkpoint, [])
                    config.model, config.train.seed = own.model, own.train.seed
                source.name = config.model.name_or_path
            source.check()
        except ConfigError as error:
            raise ConfigError(f"--model {label}: {error}") from error
        runs.append(ModelRun(label, source, config, output / label))
    tasks = list(eval_plan.tasks or eval_task_ids(shared.env, eval_plan.env_kwargs))
    if eval_plan.max_tasks:
        tasks = tasks[: eval_plan.max_tasks]
    if not tasks:
        raise ConfigError("no eval tasks: the env lists none (give --eval-task-ids)")
    return ModelsPlan(runs, list(seeds), eval_plan, tasks, eval_env_kwargs(shared.env, eval_plan.env_kwargs),
                      max_new_tokens, output)
