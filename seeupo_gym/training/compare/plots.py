"""curves.png: training reward and eval avg@k versus step, per algorithm, over seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from seeupo_gym.training.compare.stats import collect_series
from seeupo_gym.training.run_files import open_run_file

# One marker and line style per label beside its colour: curves that coincide stay visible.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


def curves_figure(
    records: Sequence[dict[str, Any]], labels: Sequence[str], k: int, title: str, eval_tasks: str = "eval tasks"
) -> Any:
    """Two panels: training reward and eval avg@k versus step; mean over seeds, min-max band.
    `eval_tasks` says which tasks the eval panel scores (e.g. "training tasks", "held-out tasks")."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [
        ("rollout/reward_mean", "training reward (mean over the step's rollouts)"),
        (f"eval/avg@{k}", f"eval avg@{k} on {eval_tasks} ({k} rollouts each)"),
    ]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    colors = plt.get_cmap("tab10").colors
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
            axis.plot(steps, mean, color=color, marker=MARKERS[i % len(MARKERS)], markersize=5,
                      linestyle=LINESTYLES[i % len(LINESTYLES)], fillstyle="none" if i % 2 else "full",
                      label=f"{label} (n={seeds} seed{'s' if seeds > 1 else ''})")
            if seeds > 1:
                axis.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        axis.set_xlabel("training step")
        axis.set_ylabel(ylabel)
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize=8)
    figure.suptitle(title, fontsize=10)
    return figure


def plot_curves(
    records: Sequence[dict[str, Any]], labels: Sequence[str], k: int, path: Path, title: str,
    eval_tasks: str = "eval tasks",
) -> None:
    """`curves_figure` written to `path`."""
    import matplotlib.pyplot as plt

    figure = curves_figure(records, labels, k, title, eval_tasks)
    with open_run_file(path, "wb") as f:  # never through a link planted in the folder
        figure.savefig(f, format="png", dpi=110)
    plt.close(figure)


def scores_figure(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int, title: str) -> Any:
    """Two panels, as curves.png: eval avg@k and pass@k per model; mean over seeds, min-max bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    colors = plt.get_cmap("tab10").colors
    for axis, key in zip(axes, (f"eval/avg@{k}", f"eval/pass@{k}")):
        series = collect_series(records, key)
        for i, label in enumerate(labels):
            if label not in series:
                continue
            values = [v for vs in series[label].points.values() for v in vs]
            mean = sum(values) / len(values)
            axis.bar(i, mean, color=colors[i % len(colors)], hatch="//" if i % 2 else None,
                     label=f"{label} (n={len(values)} seed{'s' if len(values) > 1 else ''})")
            if len(values) > 1:
                axis.errorbar(i, mean, yerr=[[mean - min(values)], [max(values) - mean]], color="black", capsize=4)
            axis.text(i + 0.05, mean + 0.01, f"{mean:.3f}", ha="left", va="bottom", fontsize=8)
        axis.set_xticks(range(len(labels)), labels, fontsize=8)
        axis.set_ylabel(f"eval {key.split('/', 1)[1]} (mean over seeds, min-max)")
        axis.set_ylim(0, 1.08)
        axis.grid(alpha=0.3, axis="y")
    figure.suptitle(title, fontsize=10)
    return figure


def plot_scores(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int, path: Path, title: str) -> None:
    """`scores_figure` written to `path`."""
    import matplotlib.pyplot as plt

    figure = scores_figure(records, labels, k, title)
    with open_run_file(path, "wb") as f:  # never through a link planted in the folder
        figure.savefig(f, format="png", dpi=110)
    plt.close(figure)
