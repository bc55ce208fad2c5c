"""`seeupo-compare`: several algorithms on the same env, model, seeds and budget, side by side.

Every (algorithm, seed) run trains from the same config with only `algorithm` and
`train.seed` changed, so the runs see the same tasks in the same order and start from the
same weights. Each run is evaluated before training and every `--eval-every` steps on the
same eval tasks with k rollouts per task (avg@k, unbiased pass@k; see `seeupo-eval`). The
run folder then holds:

    report.md      the final table (best per column in bold), eval scores by step, settings
    curves.png     training reward and eval avg@k versus step, mean and spread over seeds
    metrics.jsonl  every record of every run, tagged with algorithm and seed
    summary.json   the numbers of the final table
    <label>/seed-<s>/   each run's own folder (config.yaml, metrics.jsonl, checkpoints/)

Examples:
    seeupo-compare --config demo --algorithms seeupo,grpo --out runs/demo
    seeupo-compare --config tiny-cpu --algorithms seeupo,grpo,gspo,ppo --seeds 0,1 train.steps=4
    # an ablation: a label=name pair runs `name` under `label`, --set gives it options
    seeupo-compare --config demo --algorithms seeupo,natural=seeupo --set natural.order=natural
    seeupo-compare --report-only runs/demo        # rebuild report.md / curves.png from the JSONL

Runs are sequential in one process (use `seeupo-train` under `accelerate launch` to spread
one run over devices). A run that fails is reported as failed; the others still run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import yaml

from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.algorithms.training.config import Config, ConfigError, apply_override, config_from_dict

logger = logging.getLogger(__name__)

RUN_INFO = "run.json"


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


# --------------------------------------------------------------------------- planning


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


def algorithm_options(name: str, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The config's algorithm options that `name` accepts, then the run's own (--set) options."""
    from seeupo_gym.algorithms.base import make_algorithm

    try:
        accepted = {f.name for f in dataclasses.fields(make_algorithm(name).config_class)}
    except ValueError as error:
        raise ConfigError(f"--algorithms: {error}") from error
    dropped = sorted(set(shared) - accepted)
    if dropped:
        logger.info("%s does not take the config's algorithm option(s) %s; they apply to the others", name, dropped)
    return {**{k: v for k, v in shared.items() if k in accepted}, **own}


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
    from seeupo_gym.algorithms.training.trainer import build_algorithm

    from seeupo_gym.algorithms.training.tasks import env_task_ids

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
    train_tasks = base.env.train_tasks or env_task_ids(base.env.id, base.env.kwargs)

    runs: list[RunSpec] = []
    for label, name in algorithms.items():
        for seed in seeds:
            run_raw = copy.deepcopy(raw)
            run_raw["algorithm"] = {"name": name, **algorithm_options(name, shared, options.get(label, {}))}
            run_raw.setdefault("train", {})["seed"] = int(seed)
            run_raw["train"]["eval_every"] = 0  # this script evaluates (k rollouts per task)
            run_raw.setdefault("env", {})["train_tasks"] = list(train_tasks)
            run_raw.setdefault("log", {})["output_dir"] = str(output / label / f"seed-{seed}")
            run_raw["resume_from"] = None
            try:
                config = config_from_dict(run_raw)
                build_algorithm(config)
            except ConfigError as error:
                raise ConfigError(f"run {label} (seed {seed}): {error}") from error
            runs.append(RunSpec(label, name, int(seed), config, output / label / f"seed-{seed}"))

    eval_kwargs = {**base.env.kwargs, **(base.env.eval_kwargs or {}), **eval_plan.env_kwargs}
    tasks = eval_plan.tasks or (base.env.eval_tasks if not eval_plan.env_kwargs else None)
    tasks = list(tasks or env_task_ids(base.env.id, eval_kwargs))
    if eval_plan.max_tasks:
        tasks = tasks[: eval_plan.max_tasks]
    return ComparePlan(runs, eval_plan, tasks, output, save_checkpoints)


# --------------------------------------------------------------------------- running


def evaluate_run(trainer: Any, plan: ComparePlan, run: RunSpec, progress: bool) -> dict[str, float]:
    """k rollouts per eval task with the trainer's current weights; logged to the run's JSONL."""
    ev = plan.eval
    return trainer.evaluate(
        plan.eval_tasks,
        k=ev.k,
        n=ev.n,
        temperature=ev.temperature,
        # The same eval draws for every algorithm at a given (seed, step): paired comparisons.
        seed=derive_seed(run.seed, trainer.state.step, 7),
        env_kwargs=ev.env_kwargs,
        progress=progress,
    )


def eval_steps(steps: int, every: int, at_start: bool) -> list[int]:
    """The steps after which a run is evaluated (0 = before training); the last step always."""
    points = [0] if at_start else []
    if every:
        points += list(range(every, steps + 1, every))
    if steps not in points:
        points.append(steps)
    return points


def run_all(plan: ComparePlan, *, progress: bool = True, command: str = "") -> Path:
    """Train and evaluate every run, then write the report; returns the run folder."""
    from tqdm.auto import tqdm

    from seeupo_gym.algorithms.training.trainer import Trainer

    plan.output_dir.mkdir(parents=True, exist_ok=True)
    first = plan.runs[0].config
    info = {
        "command": command,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "eval": dataclasses.asdict(plan.eval),
        "eval_tasks": plan.eval_tasks,
        "runs": [{"label": r.label, "algorithm": r.algorithm, "seed": r.seed, "folder": str(r.folder)} for r in plan.runs],
        "config": {**first.to_dict(), "algorithm": None},
        "algorithms": {r.label: r.config.to_dict()["algorithm"] for r in plan.runs},
    }
    (plan.output_dir / RUN_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
    combined = plan.output_dir / "metrics.jsonl"
    combined.write_text("")

    units = sum(r.config.train.steps + len(eval_steps(r.config.train.steps, plan.eval.every, plan.eval.at_start))
                for r in plan.runs)
    started = time.perf_counter()
    failures: dict[str, str] = {}
    start_evals: dict[str, dict[str, float]] = {}
    with tqdm(total=units, desc="compare", unit="step", disable=not progress, dynamic_ncols=True) as bar:
        for run in plan.runs:
            name = f"{run.label}/seed-{run.seed}"
            points = set(eval_steps(run.config.train.steps, plan.eval.every, plan.eval.at_start))
            done_units = 0
            run.config.log.progress_bars = False  # the compare bar stands for every run
            try:
                bar.set_postfix_str(f"{name}: loading model")
                # A rerun into the same folder starts afresh rather than appending to old records.
                (run.folder / "metrics.jsonl").unlink(missing_ok=True)
                trainer = Trainer(run.config)
                with trainer:
                    if 0 in points:
                        start_key = _start_key(run)
                        if start_key in start_evals:
                            # Same initial weights and eval draws as an earlier run: same rollouts.
                            record = {**start_evals[start_key], "eval/shared_with_earlier_run": 1.0}
                            trainer.log(record)
                        else:
                            bar.set_postfix_str(f"{name}: eval step 0")
                            record = start_evals[start_key] = evaluate_run(trainer, plan, run, progress)
                        bar.update(1)
                        done_units += 1
                    while trainer.state.step < run.config.train.steps:
                        record = trainer.train_step()
                        bar.update(1)
                        done_units += 1
                        step = trainer.state.step
                        bar.set_postfix_str(f"{name}: step {step} reward {record.get('rollout/reward_mean', float('nan')):.3f}")
                        if step in points:
                            record = evaluate_run(trainer, plan, run, progress)
                            bar.update(1)
                            done_units += 1
                            bar.set_postfix_str(f"{name}: step {step} eval avg@{plan.eval.k} "
                                                f"{record[f'eval/avg@{plan.eval.k}']:.3f}")
                    if plan.save_checkpoints:
                        trainer.save_checkpoint()
                del trainer
            except Exception as error:  # one broken run must not lose the others
                logger.exception("run %s failed", name)
                failures[name] = f"{type(error).__name__}: {error}"
                bar.update(max(0, run.config.train.steps + len(points) - done_units))
            finally:
                gc.collect()
            _append_run_records(combined, run)
            tqdm.write(_run_line(run, plan, failures.get(name)), file=sys.stderr)

    info["wall_seconds"] = time.perf_counter() - started
    info["failures"] = failures
    (plan.output_dir / RUN_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
    write_report(plan.output_dir)
    return plan.output_dir


def _start_key(run: RunSpec) -> str:
    """Runs whose configs differ only in the algorithm start from the same weights (the policy is
    built from model settings and train.seed alone), so their step-0 evaluations coincide."""
    data = run.config.to_dict()
    data.pop("algorithm")
    data["log"] = {}
    return json.dumps(data, sort_keys=True, default=str)


def _append_run_records(combined: Path, run: RunSpec) -> None:
    source = run.folder / "metrics.jsonl"
    if not source.is_file():
        return
    with open(combined, "a") as out:
        for line in source.read_text().splitlines():
            if line.strip():
                out.write(json.dumps({"algorithm": run.label, "seed": run.seed, **json.loads(line)}) + "\n")


def combine_run_records(folder: Path, info: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run's records tagged with algorithm and seed, rebuilt from the runs' own JSONL
    (the source of truth), so an interrupted comparison still gets a report of what it did."""
    records: list[dict[str, Any]] = []
    found = False
    for run in info["runs"]:
        path = Path(run["folder"])
        if not path.is_absolute() and not path.exists():
            path = folder / run["label"] / f"seed-{run['seed']}"
        if (path / "metrics.jsonl").is_file():
            found = True
        records += [{"algorithm": run["label"], "seed": run["seed"], **r} for r in read_records(path / "metrics.jsonl")]
    if not found:  # run folders moved away: fall back on the combined file
        return read_records(folder / "metrics.jsonl")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _run_line(run: RunSpec, plan: ComparePlan, failure: str | None) -> str:
    if failure:
        return f"{run.label} seed {run.seed}: FAILED ({failure})"
    records = read_records(run.folder / "metrics.jsonl")
    rewards = [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r]
    evals = [r[f"eval/avg@{plan.eval.k}"] for r in records if f"eval/avg@{plan.eval.k}" in r]
    parts = [f"{run.label} seed {run.seed}:"]
    if rewards:
        parts.append(f"train reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")
    if evals:
        parts.append(f"eval avg@{plan.eval.k} {evals[0]:.3f} -> {evals[-1]:.3f}")
    return " ".join(parts)


# --------------------------------------------------------------------------- report


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Series:
    """One metric of one algorithm: step -> values over seeds."""

    points: dict[int, list[float]] = field(default_factory=dict)

    def add(self, step: int, value: float) -> None:
        self.points.setdefault(step, []).append(value)

    def steps(self) -> list[int]:
        return sorted(self.points)

    def mean(self) -> list[float]:
        return [statistics.fmean(self.points[s]) for s in self.steps()]

    def low_high(self) -> tuple[list[float], list[float]]:
        return [min(self.points[s]) for s in self.steps()], [max(self.points[s]) for s in self.steps()]


def collect_series(records: Sequence[dict[str, Any]], key: str) -> dict[str, Series]:
    series: dict[str, Series] = {}
    for record in records:
        if key in record and record[key] is not None and math.isfinite(record[key]):
            series.setdefault(record["algorithm"], Series()).add(int(record["step"]), float(record[key]))
    return series


@dataclass
class Row:
    """The final-table numbers of one algorithm (means over seeds; sd when several seeds)."""

    label: str
    seeds: int
    reward_first: float
    reward_last: float
    eval_first: float
    eval_last: float
    eval_last_sd: float
    pass_last: float
    pass_last_sd: float
    step_seconds: float
    update_seconds: float
    steps: int


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _window(values: Sequence[float], last: bool) -> float:
    # Mean of the first / last third of a run's steps (at least 1, at most 3): one step is noisy.
    if not values:
        return math.nan
    width = _window_width(len(values))
    return statistics.fmean(values[-width:] if last else values[:width])


def final_rows(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int) -> list[Row]:
    rows = []
    for label in labels:
        mine = [r for r in records if r.get("algorithm") == label]
        by_seed: dict[int, list[dict[str, Any]]] = {}
        for record in mine:
            by_seed.setdefault(int(record["seed"]), []).append(record)
        firsts, lasts, eval_firsts, eval_lasts, pass_lasts, step_s, update_s, steps = [], [], [], [], [], [], [], []
        for seed_records in by_seed.values():
            train = [r for r in seed_records if "rollout/reward_mean" in r]
            evals = [r for r in seed_records if f"eval/avg@{k}" in r]
            if train:
                rewards = [r["rollout/reward_mean"] for r in train]
                firsts.append(_window(rewards, last=False))
                lasts.append(_window(rewards, last=True))
                step_s += [r.get("time/rollout_s", 0.0) + r.get("time/update_s", 0.0) for r in train]
                update_s += [r.get("time/update_s", 0.0) for r in train]
                steps.append(len(train))
            if evals:
                eval_firsts.append(evals[0][f"eval/avg@{k}"])
                eval_lasts.append(evals[-1][f"eval/avg@{k}"])
                pass_lasts.append(evals[-1][f"eval/pass@{k}"])
        eval_last, eval_sd = _mean_sd(eval_lasts)
        pass_last, pass_sd = _mean_sd(pass_lasts)
        rows.append(
            Row(
                label=label,
                seeds=len(by_seed),
                reward_first=_mean_sd(firsts)[0],
                reward_last=_mean_sd(lasts)[0],
                eval_first=_mean_sd(eval_firsts)[0],
                eval_last=eval_last,
                eval_last_sd=eval_sd,
                pass_last=pass_last,
                pass_last_sd=pass_sd,
                step_seconds=_mean_sd(step_s)[0],
                update_seconds=_mean_sd(update_s)[0],
                steps=max(steps, default=0),
            )
        )
    return rows


def _fmt(value: float, sd: float | None = None, digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    text = f"{value:.{digits}f}"
    if sd is not None and math.isfinite(sd) and sd > 0:
        text += f" ± {sd:.{digits}f}"
    return text


def _best(values: Sequence[float], higher: bool) -> set[int]:
    finite = [(i, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    if len(finite) < 2 or len({v for _, v in finite}) == 1:
        return set()
    target = max(v for _, v in finite) if higher else min(v for _, v in finite)
    return {i for i, v in finite if v == target}


def final_table(rows: Sequence[Row], k: int) -> str:
    columns = [
        # (title, value, sd, higher is better, digits)
        ("train reward, first steps", lambda r: r.reward_first, lambda r: None, True, 3),
        ("train reward, last steps", lambda r: r.reward_last, lambda r: None, True, 3),
        (f"eval avg@{k}, start", lambda r: r.eval_first, lambda r: None, True, 3),
        (f"eval avg@{k}, final", lambda r: r.eval_last, lambda r: r.eval_last_sd, True, 3),
        (f"eval pass@{k}, final", lambda r: r.pass_last, lambda r: r.pass_last_sd, True, 3),
        ("s / train step", lambda r: r.step_seconds, lambda r: None, False, 1),
        ("of which update", lambda r: r.update_seconds, lambda r: None, False, 1),
    ]
    lines = ["| algorithm | " + " | ".join(c[0] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    best = [_best([c[1](r) for r in rows], c[3]) for c in columns]
    for i, row in enumerate(rows):
        cells = []
        for j, (_, value, sd, _, digits) in enumerate(columns):
            text = _fmt(value(row), sd(row), digits)
            cells.append(f"**{text}**" if i in best[j] else text)
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def eval_table(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int) -> str:
    avg = collect_series(records, f"eval/avg@{k}")
    passed = collect_series(records, f"eval/pass@{k}")
    steps = sorted({s for series in avg.values() for s in series.steps()})
    if not steps:
        return "(no evaluations)"
    lines = ["| step | " + " | ".join(f"{label} avg@{k} / pass@{k}" for label in labels) + " |",
             "|---" * (len(labels) + 1) + "|"]
    for step in steps:
        cells = []
        for label in labels:
            a, p = avg.get(label), passed.get(label)
            if a is None or step not in a.points:
                cells.append("")
                continue
            cells.append(f"{statistics.fmean(a.points[step]):.3f} / {statistics.fmean(p.points[step]):.3f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def train_table(records: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    reward = collect_series(records, "rollout/reward_mean")
    steps = sorted({s for series in reward.values() for s in series.steps()})
    if not steps:
        return "(no training steps)"
    lines = ["| step | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for step in steps:
        cells = [f"{statistics.fmean(reward[l].points[step]):.3f}" if l in reward and step in reward[l].points else ""
                 for l in labels]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int, path: Path, title: str) -> None:
    """Two panels: training reward and eval avg@k versus step; mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rollout/reward_mean", "training reward (mean over the step's rollouts)"),
        (f"eval/avg@{k}", f"eval avg@{k} (held-out tasks, {k} rollouts each)"),
    ]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (key, ylabel) in zip(axes, panels):
        series = collect_series(records, key)
        for i, label in enumerate(labels):
            if label not in series:
                continue
            s = series[label]
            steps, mean = s.steps(), s.mean()
            low, high = s.low_high()
            seeds = max(len(v) for v in s.points.values())
            color = colors[i % len(colors)]
            axis.plot(steps, mean, marker="o", markersize=3, color=color,
                      label=f"{label} (n={seeds} seed{'s' if seeds > 1 else ''})")
            if seeds > 1:
                axis.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
        axis.set_xlabel("training step")
        axis.set_ylabel(ylabel)
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(folder: str | Path) -> Path:
    """report.md, curves.png and summary.json of a compare folder, from its run.json and JSONL."""
    folder = Path(folder)
    info_path = folder / RUN_INFO
    if not info_path.is_file():
        raise ConfigError(f"{str(folder)!r} is not a seeupo-compare folder (no {RUN_INFO})")
    info = json.loads(info_path.read_text())
    records = combine_run_records(folder, info)
    labels = list(dict.fromkeys(run["label"] for run in info["runs"]))
    seeds = sorted({run["seed"] for run in info["runs"]})
    k = int(info["eval"]["k"])
    config = info["config"]
    rows = final_rows(records, labels, k)
    env, train, sampling, model = config["env"], config["train"], config["sampling"], config["model"]
    title = (f"{model['name_or_path']}{' + LoRA' if model.get('lora') else ''} on {env['id']} "
             f"{_kwargs_text(env['kwargs'])}: {', '.join(labels)}")
    plot_curves(records, labels, k, folder / "curves.png", title)

    wall = info.get("wall_seconds")
    failures = info.get("failures") or {}
    incomplete = [f"{row.label} ({row.steps} of {train['steps']} steps)" for row in rows if row.steps < train["steps"]]
    lines = [
        f"# {', '.join(labels)} on {env['id']}",
        "",
        f"Model **{model['name_or_path']}**{' with LoRA ' + _kwargs_text(model['lora']) if model.get('lora') else ''}, "
        f"env `{env['id']}` {_kwargs_text(env['kwargs'])}. "
        f"Every run: {train['steps']} steps x {train['tasks_per_step']} tasks x {train['group_size']} rollouts, "
        f"responses of at most {sampling['max_new_tokens']} tokens at temperature {sampling['temperature']}, "
        f"lr {config['optim']['lr']:g}; seeds {', '.join(map(str, seeds))} (the same for every algorithm: same tasks "
        "per step, same initial weights).",
        f"Evaluation: {len(info['eval_tasks'])} tasks x {info['eval']['n']} rollouts at temperature "
        f"{info['eval']['temperature']}{' with env kwargs ' + _kwargs_text(info['eval']['env_kwargs']) if info['eval']['env_kwargs'] else ''}, "
        "before training and " + (f"every {info['eval']['every']} steps." if info["eval"]["every"] else "after the last step."),
        "",
        f"Started {info['started']} on {info['host']['cpus']} CPU(s), {info['host']['platform']}"
        + (f"; total wall time **{wall / 60:.1f} min**." if wall else "."),
        "",
        "## Final results",
        "",
        *([f"**Interrupted before the end**: partial results; {', '.join(incomplete)}. The rows below are "
           "what each run reached.", ""] if wall is None or incomplete else []),
        final_table(rows, k),
        "",
        f"Means over seeds (± sd when there are several). *Train reward*: the mean reward of the step's "
        f"rollouts, averaged over the first / last {_window_text(train['steps'])} of the run. *avg@{k}*: mean task score "
        f"over {info['eval']['n']} sampled rollouts per eval task; *pass@{k}*: the unbiased chance that at least one "
        f"of {k} rollouts succeeds. *s / train step*: wall time of rollout + update. Best per column in **bold**.",
        "",
        "![training reward and eval score versus step](curves.png)",
        "",
        "## Evaluation by step",
        "",
        eval_table(records, labels, k),
        "",
        "## Training reward by step",
        "",
        train_table(records, labels),
        "",
        "## What moved",
        "",
    ]
    for row in rows:
        lines.append(
            f"- **{row.label}**: training reward {_fmt(row.reward_first)} -> {_fmt(row.reward_last)} "
            f"({_signed(row.reward_last - row.reward_first)}), eval avg@{k} {_fmt(row.eval_first)} -> "
            f"{_fmt(row.eval_last)} ({_signed(row.eval_last - row.eval_first)}) over {row.steps} steps."
        )
    if failures:
        lines += ["", "## Failed runs", ""] + [f"- {name}: {error}" for name, error in failures.items()]
    lines += [
        "",
        "## Files",
        "",
        "- `metrics.jsonl`: every training and eval record of every run, tagged `algorithm` and `seed`.",
        "- `<algorithm>/seed-<s>/`: each run's config.yaml and metrics.jsonl (and checkpoints with --save-checkpoints).",
        f"- `{RUN_INFO}`: the command, the resolved settings and the eval task ids.",
        "",
        f"Command: `{info.get('command') or 'seeupo-compare'}`",
        "",
    ]
    (folder / "report.md").write_text("\n".join(lines))
    summary = {"k": k, "wall_seconds": wall, "failures": failures,
               "algorithms": {row.label: dataclasses.asdict(row) for row in rows}}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return folder / "report.md"


def _kwargs_text(kwargs: Any) -> str:
    if not kwargs:
        return ""
    if isinstance(kwargs, dict):
        return "(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
    return f"({kwargs})"


def _window_width(steps: int) -> int:
    return max(1, min(3, steps // 3))


def _window_text(steps: int) -> str:
    width = _window_width(steps)
    return "step" if width == 1 else f"{width} steps"


def _signed(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:+.3f}"


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="seeupo-compare",
        description="Train several algorithms on the same env, model, seeds and budget; write a report with curves.",
    )
    parser.add_argument("--config", help="YAML trainer config shared by every run (see configs/)")
    parser.add_argument("--algorithms", default="seeupo,grpo",
                        help="comma-separated registered names, or label=name pairs (default seeupo,grpo)")
    parser.add_argument("--set", action="append", default=[], metavar="LABEL.key=value",
                        help="an algorithm option for one label only, e.g. seeupo.order=natural (repeatable)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, the same for every algorithm (default 0)")
    parser.add_argument("--out", help="run folder (default: log.output_dir of the config)")
    parser.add_argument("--plugin", action="append", default=[], help="Python file registering algorithms (repeatable)")
    group = parser.add_argument_group("evaluation")
    group.add_argument("--eval-every", type=int, default=EvalPlan.every, help="steps between evaluations (0: start and end only)")
    group.add_argument("-k", "--eval-k", type=int, default=EvalPlan.k, help="k of avg@k / pass@k")
    group.add_argument("-n", "--eval-n", type=int, help="rollouts per eval task (>= k; default k)")
    group.add_argument("--eval-tasks", type=int, default=EvalPlan.max_tasks, help="number of eval tasks (0: all)")
    group.add_argument("--eval-task-ids", help="comma-separated eval task ids (default: env.eval_tasks or the env's tasks)")
    group.add_argument("--eval-temperature", type=float, default=EvalPlan.temperature)
    group.add_argument("--eval-env-kwargs", type=json.loads, default={},
                       help="JSON merged over env.kwargs for evaluation, e.g. '{\"split\": \"test\"}'")
    group.add_argument("--no-eval-at-start", action="store_true", help="skip the evaluation before training")
    parser.add_argument("--save-checkpoints", action="store_true", help="save each run's final checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--report-only", metavar="FOLDER", help="rebuild report.md / curves.png of an existing run folder")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the shared config")
    return parser.parse_args(argv)


def load_raw(path: str | None, overrides: Sequence[str]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            raw = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path!r} is not valid YAML: {error}") from error
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping at the top")
    for override in overrides:
        apply_override(raw, override)
    return raw


def parse_sets(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        label, dot, option = key.partition(".")
        if not sep or not dot or not label or not option:
            raise ConfigError(f"--set {item!r} is not of the form LABEL.key=value")
        options.setdefault(label.strip(), {})[option.strip()] = yaml.safe_load(value) if value.strip() else ""
    return options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.report_only:
            print(f"report: {write_report(args.report_only)}")
            return 0
        from seeupo_gym.algorithms.base import load_plugin

        raw = load_raw(args.config, args.overrides)
        # Loaded before any run starts so that a broken plug-in fails the whole plan at once;
        # --plugin files join the config so that each run's config.yaml can be resumed.
        raw["plugins"] = list(raw.get("plugins") or []) + list(args.plugin)
        for plugin in raw["plugins"]:
            try:
                load_plugin(plugin)
            except Exception as error:  # a user's file: say which one and why
                raise ConfigError(f"plugin {plugin!r} failed to load: {type(error).__name__}: {error}") from error
        if not isinstance(args.eval_env_kwargs, dict):
            raise ConfigError(f"--eval-env-kwargs must be a JSON object, got {args.eval_env_kwargs!r}")
        eval_plan = EvalPlan(
            every=args.eval_every,
            k=args.eval_k,
            n=args.eval_n,
            tasks=[t.strip() for t in args.eval_task_ids.split(",") if t.strip()] if args.eval_task_ids else None,
            max_tasks=args.eval_tasks,
            temperature=args.eval_temperature,
            env_kwargs=dict(args.eval_env_kwargs),
            at_start=not args.no_eval_at_start,
        )
        output = args.out or config_from_dict(raw).log.output_dir
        plan = build_plan(
            raw,
            parse_algorithms(args.algorithms),
            parse_seeds(args.seeds),
            output,
            eval_plan,
            options=parse_sets(args.set),
            save_checkpoints=args.save_checkpoints,
        )
    except ConfigError as error:
        print(f"seeupo-compare: {error}", file=sys.stderr)
        return 2
    runs = ", ".join(f"{r.label}/seed-{r.seed}" for r in plan.runs)
    print(f"seeupo-compare: {len(plan.runs)} run(s) ({runs}), {len(plan.eval_tasks)} eval tasks -> {plan.output_dir}",
          file=sys.stderr)
    command = "seeupo-compare " + " ".join(_quote(a) for a in (sys.argv[1:] if argv is None else argv))
    folder = run_all(plan, progress=not args.no_progress, command=command)
    print(f"report: {folder / 'report.md'}")
    print(f"curves: {folder / 'curves.png'}")
    return 0


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


if __name__ == "__main__":
    sys.exit(main())
