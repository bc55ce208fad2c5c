"""The numbers of a comparison: metric series over steps and seeds, and the final-table rows.

Records are the runs' JSONL lines tagged with `algorithm` (the label) and `seed`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file; [] when it does not exist."""
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
    """`key` per label, over steps and seeds; records without a finite value are skipped."""
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
    # The interval of the final eval over seeds (min, max): the spread a winner's margin must clear.
    eval_last_low: float = math.nan
    eval_last_high: float = math.nan
    # What each run spent (means over seeds): per training step and in all; nan where the records
    # predate the trainer's budget/* metrics.
    rollouts_per_step: float = math.nan
    rollouts_total: float = math.nan
    optimizer_steps_per_step: float = math.nan
    optimizer_steps_total: float = math.nan
    gradient_tokens_per_step: float = math.nan
    gradient_tokens_total: float = math.nan
    train_seconds: float = math.nan


def low_high(values: Sequence[float]) -> tuple[float, float]:
    """The interval over seeds (nan for none)."""
    return (min(values), max(values)) if values else (math.nan, math.nan)


def _spent(train: Sequence[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """(mean per step, total) of `key` over a run's training records; None when a record lacks it."""
    values = [r.get(key, r.get(_SPENT_BEFORE.get(key, ""))) for r in train]
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return None
    return statistics.fmean(values), float(sum(values))


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample sd (0 for one value; nan for none)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def window_width(steps: int) -> int:
    """Steps averaged for "first" / "last" figures: a third of the run, at least 1, at most 3
    (one step alone is noisy)."""
    return max(1, min(3, steps // 3))


def _window(values: Sequence[float], last: bool) -> float:
    if not values:
        return math.nan
    width = window_width(len(values))
    return statistics.fmean(values[-width:] if last else values[:width])


def final_rows(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int) -> list[Row]:
    """One row per label: first/last training reward, first/last eval, seconds per step."""
    rows = []
    for label in labels:
        mine = [r for r in records if r.get("algorithm") == label]
        by_seed: dict[int, list[dict[str, Any]]] = {}
        for record in mine:
            by_seed.setdefault(int(record["seed"]), []).append(record)
        firsts, lasts, eval_firsts, eval_lasts, pass_lasts, step_s, update_s, steps = [], [], [], [], [], [], [], []
        spent: dict[str, list[tuple[float, float]]] = {key: [] for key in _SPENT}
        train_s = []
        for seed_records in by_seed.values():
            train = [r for r in seed_records if "rollout/reward_mean" in r]
            evals = [r for r in seed_records if f"eval/avg@{k}" in r]
            if train:
                rewards = [r["rollout/reward_mean"] for r in train]
                firsts.append(_window(rewards, last=False))
                lasts.append(_window(rewards, last=True))
                step_s += [r.get("time/rollout_s", 0.0) + r.get("time/update_s", 0.0) for r in train]
                update_s += [r.get("time/update_s", 0.0) for r in train]
                train_s.append(sum(r.get("time/rollout_s", 0.0) + r.get("time/update_s", 0.0) for r in train))
                steps.append(len(train))
                for key in _SPENT:
                    figures = _spent(train, key)
                    if figures is not None:
                        spent[key].append(figures)
            if evals:
                eval_firsts.append(evals[0][f"eval/avg@{k}"])
                eval_lasts.append(evals[-1][f"eval/avg@{k}"])
                pass_lasts.append(evals[-1][f"eval/pass@{k}"])
        eval_last, eval_sd = mean_sd(eval_lasts)
        pass_last, pass_sd = mean_sd(pass_lasts)
        low, high = low_high(eval_lasts)
        per_step = {key: mean_sd([f[0] for f in spent[key]])[0] if len(spent[key]) == len(by_seed) else math.nan
                    for key in _SPENT}
        total = {key: mean_sd([f[1] for f in spent[key]])[0] if len(spent[key]) == len(by_seed) else math.nan
                 for key in _SPENT}
        rows.append(
            Row(
                label=label,
                seeds=len(by_seed),
                reward_first=mean_sd(firsts)[0],
                reward_last=mean_sd(lasts)[0],
                eval_first=mean_sd(eval_firsts)[0],
                eval_last=eval_last,
                eval_last_sd=eval_sd,
                pass_last=pass_last,
                pass_last_sd=pass_sd,
                step_seconds=mean_sd(step_s)[0],
                update_seconds=mean_sd(update_s)[0],
                steps=max(steps, default=0),
                eval_last_low=low,
                eval_last_high=high,
                rollouts_per_step=per_step["rollout/trajectories"],
                rollouts_total=total["rollout/trajectories"],
                optimizer_steps_per_step=per_step["budget/optimizer_steps"],
                optimizer_steps_total=total["budget/optimizer_steps"],
                gradient_tokens_per_step=per_step["budget/gradient_tokens"],
                gradient_tokens_total=total["budget/gradient_tokens"],
                train_seconds=mean_sd(train_s)[0],
            )
        )
    return rows


# Per-step records of what a run spent: rollouts (the collector's), optimizer steps and gradient tokens
# (the trainer's CountingLearner).
_SPENT = ("rollout/trajectories", "budget/optimizer_steps", "budget/gradient_tokens")
# Records from before the counting learner: the algorithm's own count of its minimize calls
# (`core.mean_metrics`), the same number for every built-in algorithm.
_SPENT_BEFORE = {"budget/optimizer_steps": "update/optimizer_steps"}


@dataclass
class ModelRow:
    """The numbers of one model in a models comparison (means over seeds; sd when several seeds)."""

    label: str
    seeds: int
    avg: float
    avg_sd: float
    avg_low: float
    avg_high: float
    passed: float
    passed_sd: float
    # Mean avg@k per category (BFCL: base, miss_func, ...), when the env reports several.
    categories: dict[str, float]
    generated_tokens: float
    eval_seconds: float
    backend_errors: float


def model_rows(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int) -> list[ModelRow]:
    """One row per label from its seeds' eval records; a label without a record (it failed) gets nan."""
    rows = []
    for label in labels:
        mine = [r for r in records if r.get("algorithm") == label and f"eval/avg@{k}" in r]
        avg, avg_sd = mean_sd([r[f"eval/avg@{k}"] for r in mine])
        avg_low, avg_high = low_high([r[f"eval/avg@{k}"] for r in mine])
        passed, passed_sd = mean_sd([r[f"eval/pass@{k}"] for r in mine])
        suffix = f"/avg@{k}"
        names = sorted({key[len("eval/"):-len(suffix)] for r in mine for key in r
                        if key.startswith("eval/") and key.endswith(suffix) and key.count("/") == 2})
        categories = {name: mean_sd([r[f"eval/{name}{suffix}"] for r in mine if f"eval/{name}{suffix}" in r])[0]
                      for name in names}
        rows.append(ModelRow(
            label=label,
            seeds=len(mine),
            avg=avg,
            avg_sd=avg_sd,
            avg_low=avg_low,
            avg_high=avg_high,
            passed=passed,
            passed_sd=passed_sd,
            categories=categories,
            generated_tokens=mean_sd([r.get("eval/generated_tokens", math.nan) for r in mine])[0],
            eval_seconds=mean_sd([r.get("time/eval_s", math.nan) for r in mine])[0],
            backend_errors=sum(r.get("eval/backend_errors", 0.0) for r in mine),
        ))
    return rows
