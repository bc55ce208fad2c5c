"""Running a comparison: each (algorithm, seed) run in turn through `Trainer.train(on_step=...)`.

The trainer's own loop runs every step (so a failing run keeps a checkpoint of the steps it
finished, as any training run does); this module only adds the comparison's evaluations
(k rollouts per eval task at the planned steps), one progress bar over all runs, and the
combined records. A run that fails is recorded as failed and the others still run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import platform
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.training.compare.match import StepMatched
from seeupo_gym.training.compare.plan import ComparePlan, ModelRun, ModelsPlan, RunSpec, eval_steps
from seeupo_gym.training.compare.report import RUN_INFO, write_report
from seeupo_gym.training.checkpoint import CHECKPOINTS_FOLDER, checkpoints, clear_run_folder
from seeupo_gym.training.run_files import open_run_file, refuse_links, write_run_text
from seeupo_gym.training.compare.stats import read_records

logger = logging.getLogger(__name__)

# Purpose mixed into derive_seed(seed, step, purpose) for the comparison's eval draws.
_COMPARE_EVAL = 7


def evaluate_run(trainer: Any, plan: ComparePlan, run: RunSpec, progress: bool) -> dict[str, float]:
    """k rollouts per eval task with the trainer's current weights; logged to the run's JSONL."""
    ev = plan.eval
    return trainer.evaluate(
        plan.eval_tasks,
        k=ev.k,
        n=ev.n,
        temperature=ev.temperature,
        # The same eval draws for every algorithm at a given (seed, step): paired comparisons.
        seed=derive_seed(run.seed, trainer.state.step, _COMPARE_EVAL),
        env_kwargs=ev.env_kwargs,
        progress=progress,
    )


class CompareInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a comparison; `run` names the run it stopped in, `step` its last kept step."""

    def __init__(self, signal_name: str, run: str, step: int) -> None:
        super().__init__(signal_name)
        self.signal_name, self.run, self.step = signal_name, run, step


def run_all(plan: ComparePlan, *, progress: bool = True, command: str = "", resume: bool = False) -> Path:
    """Train and evaluate every run, then write the report; returns the run folder.

    resume: continue the comparison already in the folder (the same plan): finished runs are kept,
    the interrupted one goes on from its checkpoint, the rest run. Ctrl-C or SIGTERM ends it with
    CompareInterrupted after the running run kept its last finished step."""
    from tqdm.auto import tqdm

    plan.output_dir.mkdir(parents=True, exist_ok=True)
    refuse_links(plan.output_dir)
    info = _run_info(plan, command)
    if resume:
        check_same_plan(plan.output_dir, info)
    write_run_text(plan.output_dir / RUN_INFO, json.dumps(info, indent=2, default=str) + "\n")
    combined = plan.output_dir / "metrics.jsonl"
    write_run_text(combined, "")

    units = sum(_units(run, plan) for run in plan.runs)
    started = time.perf_counter()
    failures: dict[str, str] = {}
    start_evals: dict[str, dict[str, float]] = {}
    with tqdm(total=units, desc="compare", unit="step", disable=not progress, dynamic_ncols=True) as bar:
        for run in plan.runs:
            name = f"{run.label}/seed-{run.seed}"
            done = [0]  # units of this run already on the bar
            if resume and (run.folder / RUN_DONE).is_file():
                bar.update(_units(run, plan))
                _append_run_records(combined, run)
                tqdm.write(_run_line(run, plan, None) + " (kept from before)", file=sys.stderr)
                continue
            try:
                _run_one(run, plan, bar, done, start_evals, progress, resume=resume)
            except KeyboardInterrupt as interrupt:  # the trainer kept the run's last finished step
                info["wall_seconds"] = time.perf_counter() - started
                info["failures"] = failures
                info["interrupted"] = name
                write_run_text(plan.output_dir / RUN_INFO, json.dumps(info, indent=2, default=str) + "\n")
                with contextlib.suppress(Exception):  # a report of what is done, if there is enough for one
                    write_report(plan.output_dir)
                kept = checkpoints(run.folder / CHECKPOINTS_FOLDER)
                raise CompareInterrupted(getattr(interrupt, "signal_name", "SIGINT"), name,
                                         int(kept[-1].name.split("-")[-1]) if kept else 0) from None
            except Exception as error:  # one broken run must not lose the others
                logger.exception("run %s failed", name)
                failures[name] = f"{type(error).__name__}: {error}"
                bar.update(max(0, _units(run, plan) - done[0]))
            finally:
                gc.collect()
            _append_run_records(combined, run)
            tqdm.write(_run_line(run, plan, failures.get(name)), file=sys.stderr)

    info["wall_seconds"] = time.perf_counter() - started
    info["failures"] = failures
    write_run_text(plan.output_dir / RUN_INFO, json.dumps(info, indent=2, default=str) + "\n")
    write_report(plan.output_dir)
    return plan.output_dir


# A finished run's mark in its folder: `--resume` keeps such runs as they are.
RUN_DONE = "compare-done.json"


def check_same_plan(folder: Path, info: dict[str, Any]) -> None:
    """--resume continues the comparison in `folder` only with the same runs and evaluations."""
    from seeupo_gym.training.config import ConfigError

    try:
        before = json.loads((folder / RUN_INFO).read_text())
    except (OSError, ValueError):
        raise ConfigError(f"--resume: {str(folder)!r} holds no comparison to continue ({RUN_INFO} missing)") from None
    if info.get("kind") != "models":  # a folder from before --match held samples
        before.setdefault("match", "samples")
    for key in ("runs", "eval", "eval_tasks", "config", "algorithms", "match"):
        if json.loads(json.dumps(before.get(key), default=str)) != json.loads(json.dumps(info.get(key), default=str)):
            raise ConfigError(f"--resume: the comparison in {str(folder)!r} was planned with other {key}; give the "
                              f"same command with --resume, or a new --out")


def _run_one(
    run: RunSpec, plan: ComparePlan, bar: Any, done: list[int], start_evals: dict[str, dict[str, float]], progress: bool,
    resume: bool = False,
) -> None:
    from seeupo_gym.training.trainer import Trainer

    name = f"{run.label}/seed-{run.seed}"
    points = set(eval_steps(run.config.train.steps, plan.eval.every, plan.eval.at_start))
    run.config.log.progress_bars = False  # the compare bar stands for every run

    def advance(text: str) -> None:
        bar.update(1)
        done[0] += 1
        bar.set_postfix_str(text)

    def on_step(trainer: Any, record: dict[str, float]) -> None:
        step = trainer.state.step
        advance(f"{name}: step {step} reward {record.get('rollout/reward_mean', float('nan')):.3f}")
        if step in points:
            evaluated = evaluate_run(trainer, plan, run, progress)
            advance(f"{name}: step {step} eval avg@{plan.eval.k} {evaluated[f'eval/avg@{plan.eval.k}']:.3f}")

    bar.set_postfix_str(f"{name}: loading model")
    (run.folder / RUN_DONE).unlink(missing_ok=True)
    if resume and checkpoints(run.folder / CHECKPOINTS_FOLDER):
        run.config.resume_from = "latest"  # the run an interrupt stopped: on from its last kept step
    else:  # a rerun of a comparison into its folder replaces each run (a run folder holds one run)
        clear_run_folder(run.folder)
    trainer = Trainer(run.config)
    if plan.match == "steps":
        trainer.algorithm = StepMatched(trainer.algorithm, plan.compared_algorithms())
    with trainer:
        resumed_at = trainer.state.step
        if resumed_at:
            evaluated = {r["step"] for r in read_records(run.folder / "metrics.jsonl") if f"eval/avg@{plan.eval.k}" in r}
            missing = resumed_at in points and float(resumed_at) not in evaluated  # stopped in that step's evaluation
            skipped = resumed_at + len([p for p in points if p <= resumed_at]) - int(missing)
            bar.update(skipped)
            done[0] += skipped
            if missing:
                evaluated_now = evaluate_run(trainer, plan, run, progress)
                advance(f"{name}: step {resumed_at} eval avg@{plan.eval.k} {evaluated_now[f'eval/avg@{plan.eval.k}']:.3f}")
        elif 0 in points:
            key = _start_key(run)
            if key in start_evals:
                # Same initial weights and eval draws as an earlier run: same rollouts.
                trainer.log({**start_evals[key], "eval/shared_with_earlier_run": 1.0})
                advance(f"{name}: eval step 0 (shared)")
            else:
                bar.set_postfix_str(f"{name}: eval step 0")
                start_evals[key] = evaluate_run(trainer, plan, run, progress)
                advance(f"{name}: eval step 0")
        trainer.train(on_step=on_step, save_at_end=plan.save_checkpoints)
    del trainer
    if not plan.save_checkpoints:  # an interrupted and resumed run's checkpoints served their purpose
        shutil.rmtree(run.folder / CHECKPOINTS_FOLDER, ignore_errors=True)
    write_run_text(run.folder / RUN_DONE, json.dumps({"done": True}) + "\n")


def _units(run: RunSpec, plan: ComparePlan) -> int:
    """Progress-bar units of a run: its training steps plus its evaluations."""
    return run.config.train.steps + len(eval_steps(run.config.train.steps, plan.eval.every, plan.eval.at_start))


def _run_info(plan: ComparePlan, command: str) -> dict[str, Any]:
    first = plan.runs[0].config
    return {
        "command": command,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "eval": dataclasses.asdict(plan.eval),
        "eval_tasks": plan.eval_tasks,
        "match": plan.match,
        "runs": [{"label": r.label, "algorithm": r.algorithm, "seed": r.seed, "folder": str(r.folder)} for r in plan.runs],
        "config": {**first.to_dict(), "algorithm": None},
        "algorithms": {r.label: r.config.to_dict()["algorithm"] for r in plan.runs},
    }


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
    with open_run_file(combined, "a") as out:
        for line in source.read_text().splitlines():
            if line.strip():
                out.write(json.dumps({"algorithm": run.label, "seed": run.seed, **json.loads(line)}) + "\n")


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


# --------------------------------------------------------------------------- models, side by side


def evaluate_models(plan: ModelsPlan, *, progress: bool = True, command: str = "", resume: bool = False) -> Path:
    """Evaluate every model at every seed (`model_source.evaluate_source`, seeupo-eval's own path),
    then write the report; returns the run folder. A model that fails is reported, the others go on.
    resume: the (model, seed) evaluations already in the folder (same plan) are kept."""
    from tqdm.auto import tqdm

    from seeupo_gym.training.model_source import evaluate_source, public_url

    plan.output_dir.mkdir(parents=True, exist_ok=True)
    refuse_links(plan.output_dir)
    info = _models_info(plan, command)
    if resume:
        check_same_plan(plan.output_dir, info)
    write_run_text(plan.output_dir / RUN_INFO, json.dumps(info, indent=2, default=str) + "\n")
    started = time.perf_counter()
    failures: dict[str, str] = {}
    ev = plan.eval
    with tqdm(total=len(plan.models) * len(plan.seeds), desc="compare", unit="eval", disable=not progress,
              dynamic_ncols=True) as bar:
        for run in plan.models:
            opened = None
            done = 0
            kept = [seed for seed in plan.seeds if resume and (run.folder / f"seed-{seed}" / "result.json").is_file()]
            for seed in plan.seeds:  # a rerun into the folder replaces each model's results
                for name in ("metrics.jsonl", "result.json"):
                    if seed not in kept:
                        (run.folder / f"seed-{seed}" / name).unlink(missing_ok=True)
            bar.update(len(kept))
            done += len(kept)
            if len(kept) == len(plan.seeds):
                continue
            try:
                bar.set_postfix_str(f"{run.label}: loading {run.source.describe()}")
                opened = run.source.open(run.config)
                for seed in plan.seeds:
                    if seed in kept:
                        continue
                    bar.set_postfix_str(f"{run.label}: seed {seed}")
                    result = evaluate_source(
                        opened, run.config, plan.eval_tasks, env_kwargs=plan.env_kwargs, k=ev.k, n=ev.n or ev.k,
                        temperature=ev.temperature, max_new_tokens=plan.max_new_tokens, seed=seed, progress=progress,
                        program="seeupo-compare", desc=f"{run.label} seed {seed}",
                        slow_hint="fewer models, seeds, eval tasks, rollouts (-n, -k) or tokens (--max-new-tokens) shorten it",
                    )
                    _write_model_result(run.folder / f"seed-{seed}", run, result)
                    if result.all_failed_on_the_server:  # a score of 0 that measures no model
                        raise RuntimeError(f"seed {seed}: every episode ({result.backend_errors}) ended with "
                                           f"backend_error; first: {result.backend_error_episodes[0]}")
                    bar.update(1)
                    done += 1
                    tqdm.write(f"{run.label} seed {seed}: avg@{ev.k} {result.avg_at_k:.3f}, pass@{ev.k} "
                               f"{result.pass_at_k:.3f} ({result.wall_seconds:.1f} s)", file=sys.stderr)
            except KeyboardInterrupt as interrupt:  # finished (model, seed) evaluations are kept for --resume
                info["wall_seconds"] = time.perf_counter() - started
                info["failures"] = failures
                info["interrupted"] = run.label
                write_run_text(plan.output_dir / RUN_INFO, json.dumps(info, indent=2, default=str) + "\n")
                raise CompareInterrupted(getattr(interrupt, "signal_name", "SIGINT"), run.label, 0) from None
            except Exception as error:  # one broken model (or server) must not lose the others
                logger.exception("model %s failed", run.label)
                text = f"{type(error).__name__}: {error}"
                if run.source.base_url:  # the URL as the report shows it, never its credentials
                    text = text.replace(run.source.base_url, public_url(run.source.base_url))
                failures[run.label] = text
                bar.update(len(plan.seeds) - done)
                tqdm.write(f"{run.label}: FAILED ({text})", file=sys.stderr)
            finally:
                if opened is not None:
                    opened.close()
    info["wall_seconds"] = time.perf_counter() - started
    info["failures"] = failures
    write_run_text(plan.output_dir / RUN_INFO, json.dumps(info, indent=2, default=str) + "\n")
    write_report(plan.output_dir)
    return plan.output_dir


def _write_model_result(folder: Path, run: ModelRun, result: Any) -> None:
    """The seed's metrics record (as a training run's eval record, at step 0) and seeupo-eval's JSON."""
    from seeupo_gym.training.evaluation import eval_record

    folder.mkdir(parents=True, exist_ok=True)
    record = {**eval_record(result, 0), "eval/backend_errors": float(result.backend_errors)}
    if not (run.source.served and run.source.mode == "chat"):  # a chat API's tokens are not counted: n/a
        record["eval/generated_tokens"] = float(result.generated_tokens)
    write_run_text(folder / "metrics.jsonl", json.dumps(record) + "\n")
    write_run_text(folder / "result.json", json.dumps({"label": run.label, "source": run.source.describe(),
                                                       **result.to_dict()}, indent=2, default=str) + "\n")


def _models_info(plan: ModelsPlan, command: str) -> dict[str, Any]:
    """run.json of a models comparison; a served model appears as its description (name, public URL,
    mode) and the name of its key's variable, never the key."""
    return {
        "kind": "models",
        "command": command,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "eval": {**dataclasses.asdict(plan.eval), "max_new_tokens": plan.max_new_tokens},
        "eval_tasks": plan.eval_tasks,
        "env_kwargs": plan.env_kwargs,
        "seeds": plan.seeds,
        "models": {
            run.label: {"source": run.source.describe(), "served": run.source.served, "checkpoint": run.source.checkpoint,
                        "api_key_env": run.source.api_key_env if run.source.served else None}
            for run in plan.models
        },
        "runs": [{"label": r.label, "seed": s, "folder": str(r.folder / f"seed-{s}")} for r in plan.models for s in plan.seeds],
        "config": {**plan.models[0].config.to_dict(), "algorithm": None, "model": None},
    }
