"""Evaluation metrics over k rollouts per task: avg@k and pass@k."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from math import comb
from typing import Iterable, Mapping, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c succeeded: 1 - C(n-c, k) / C(n, k).

    Chen et al. (2021), eq. 1; with n == k it is 1 if any sample succeeded.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least k={k} samples per task, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass(frozen=True)
class Outcome:
    """One rollout's result on one task."""

    task_id: str
    score: float
    success: bool
    category: str = "all"


def summarize(outcomes: Iterable[Outcome], k: int) -> dict[str, dict[str, float]]:
    """avg@k and pass@k per category and overall ("overall").

    avg@k is the mean task score over a task's rollouts (the unbiased estimate of the mean
    over k when n > k), averaged over tasks; pass@k uses the unbiased estimator.
    """
    by_task: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_task[outcome.task_id].append(outcome)
    if not by_task:
        raise ValueError("no outcomes to summarize")

    per_category: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for task_id, rollouts in by_task.items():
        categories = {o.category for o in rollouts}
        if len(categories) != 1:
            raise ValueError(f"task {task_id!r} has rollouts in several categories: {sorted(categories)}")
        avg = sum(o.score for o in rollouts) / len(rollouts)
        passed = pass_at_k(len(rollouts), sum(o.success for o in rollouts), k)
        per_category[categories.pop()].append((avg, passed))
        per_category["overall"].append((avg, passed))

    return {
        category: _table_row(rows, k)
        for category, rows in sorted(per_category.items(), key=lambda item: (item[0] == "overall", item[0]))
    }


def _table_row(rows: Sequence[tuple[float, float]], k: int) -> dict[str, float]:
    return {
        "tasks": float(len(rows)),
        f"avg@{k}": sum(avg for avg, _ in rows) / len(rows),
        f"pass@{k}": sum(passed for _, passed in rows) / len(rows),
    }


def format_table(summary: Mapping[str, Mapping[str, float]]) -> str:
    """A markdown table of `summarize`'s result."""
    columns = list(next(iter(summary.values())))
    lines = ["| category | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for category, row in summary.items():
        cells = [f"{int(row[c])}" if c == "tasks" else f"{row[c]:.3f}" for c in columns]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
