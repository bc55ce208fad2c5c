"""curves.png: training reward and eval avg@k versus step, per algorithm, over seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from seeupo_gym.training.compare.stats import collect_series


def plot_curves(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int, path: Path, title: str) -> None:
    """Two panels: training reward and eval avg@k versus step; mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
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
