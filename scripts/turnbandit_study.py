"""Exact comparison of the algorithms on TurnBandit with the tabular softmax policy.

Every configuration trains one tabular policy on a fixed suite of tasks, for several seeds, with
the same sample budget (tasks x rollouts x iterations) and the same sample reuse (epochs,
minibatch size). After every iteration the exact expected return J of each task is computed by
enumerating joint actions, so the curves carry no evaluation noise.

    .venv/bin/python scripts/turnbandit_study.py --out runs/turnbandit_study
    .venv/bin/python scripts/turnbandit_study.py --variant stopping --num-tasks 9 --iterations 300 --out ...
    .venv/bin/python scripts/turnbandit_study.py --variant stopping --num-tasks 9 --batches expected \
        --rollouts 100 --lr 0.1 --minibatch-size 10000 --iterations 100 --seeds 3 --out ...

(the tables of docs/algorithms.md).

writes `results.md` (the table), `results.json` (every curve) and `curves.png` into --out.
`--batches expected` trains on deterministic batches whose joint-action counts follow the policy
(`tabular.expected_batch`: no sampling noise) instead of sampled ones. The `stopping` variant's
tasks are grouped by where their optimum ends: at the last turn, at a later stop, at the first stop.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.tabular import TabularPolicy, expected_batch, sample_batch
from seeupo_gym.turnbandit import make_tasks


@dataclass
class StudyConfig:
    label: str
    algorithm: str
    options: dict = field(default_factory=dict)


CONFIGS = [
    StudyConfig("seeupo reverse/batch", "seeupo", {"order": "reverse", "normalization": "batch"}),
    StudyConfig("seeupo natural/batch", "seeupo", {"order": "natural", "normalization": "batch"}),
    StudyConfig("seeupo random/batch", "seeupo", {"order": "random", "normalization": "batch"}),
    StudyConfig("seeupo reverse/none", "seeupo", {"order": "reverse", "normalization": "none"}),
    StudyConfig("seeupo reverse/group", "seeupo", {"order": "reverse", "normalization": "group"}),
    StudyConfig("grpo", "grpo", {}),
    StudyConfig("gspo", "gspo", {}),
    StudyConfig("ppo", "ppo", {}),
    # verl's per-trajectory forms: each trajectory's turns weigh 1/(its number of turns), a length
    # the policy chooses in the `stopping` variant.
    StudyConfig("grpo seq-mean-token-mean", "grpo", {"loss_agg": "seq-mean-token-mean", "sequence": "trajectory"}),
    StudyConfig("gspo trajectory", "gspo", {"sequence": "trajectory"}),
]


def run(config: StudyConfig, tasks: list, seed: int, args: argparse.Namespace) -> list[list[float]]:
    """J/J* of every task after every iteration (row 0: the initial policy)."""
    torch.manual_seed(seed)
    policy = TabularPolicy(tasks, lr=args.lr, optimizer=args.optimizer)
    options = {"kl_coef": args.kl_coef, "epochs": args.epochs, "minibatch_size": args.minibatch_size, **config.options}
    algorithm = make_algorithm(config.algorithm, options)
    generator = torch.Generator().manual_seed(seed)
    optimum = [task.optimal_value for task in tasks]

    def scores() -> list[float]:
        return [policy.exact_return(k) / optimum[k] for k in range(len(tasks))]

    def batch():
        if args.batches == "expected":
            return expected_batch(policy, args.rollouts)
        return sample_batch(policy, args.rollouts, generator)

    curve = [scores()]
    for _ in range(args.iterations):
        algorithm.update(batch(), policy, generator)
        curve.append(scores())
    return curve


def group_of(task) -> str:
    """The table's column group of a task: its kind; stopping tasks by where their optimum ends."""
    if not getattr(task, "stops", ()):
        return task.kind
    actions = task.optimal()[1]
    if len(actions) == 1:
        return "stop first"
    return "stop later" if actions[-1] == task.stops[len(actions) - 1] else "to the end"


def summarize(curves: list[list[list[float]]], threshold: float) -> dict[str, float]:
    """curves[seed][iteration][task] -> final mean J/J*, mean iterations to `threshold` (runs that never
    reach it count as the budget), fraction of (seed, task) runs at or above it at the end, and the
    fraction of seeds whose every task ends there."""
    finals = [c[-1] for c in curves]
    budget = len(curves[0]) - 1
    hits = []
    for c in curves:
        for k in range(len(c[0])):
            hit = next((i for i, row in enumerate(c) if row[k] >= threshold), None)
            hits.append(budget if hit is None else hit)
    runs = [v for final in finals for v in final]
    return {
        "final_j_over_jstar": sum(runs) / len(runs),
        "iterations_to_99": sum(hits) / len(hits),
        "runs_at_optimum": sum(v >= threshold for v in runs) / len(runs),
        "seeds_all_optimal": sum(all(v >= threshold for v in final) for final in finals) / len(finals),
    }


def plot(results: dict[str, list[list[list[float]]]], tasks: list, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({group_of(t) for t in tasks})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        members = [k for k, t in enumerate(tasks) if group_of(t) == kind]
        for label, curves in results.items():
            iterations = len(curves[0])
            mean = [
                sum(c[i][k] for c in curves for k in members) / (len(curves) * len(members)) for i in range(iterations)
            ]
            ax.plot(range(iterations), mean, label=label, linestyle="-" if label.startswith("seeupo") else "--")
        ax.set_title(f"{kind} tasks ({len(members)}), mean over seeds")
        ax.set_xlabel("iteration")
        ax.set_ylabel("exact J / J*")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/turnbandit_study"))
    parser.add_argument("--variant", default="mixed", help="TurnBandit variant of the suite")
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--task-seed", type=int, default=0)
    parser.add_argument("--options", type=int, default=3, help="K options per turn")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--rollouts", type=int, default=16, help="G rollouts per task per iteration")
    parser.add_argument("--batches", default="sampled", choices=["sampled", "expected"],
                        help="sampled rollouts, or expected batches (counts follow the policy, no noise)")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatch-size", type=int, default=64)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--threshold", type=float, default=0.99)
    parser.add_argument("--only", nargs="*", help="run only the configurations with these labels")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tasks = make_tasks(args.variant, args.num_tasks, args.task_seed, options=args.options)
    configs = [c for c in CONFIGS if not args.only or c.label in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[list[list[float]]]] = {}
    load_start = os.getloadavg()[0]
    for config in configs:
        start = time.perf_counter()
        results[config.label] = [run(config, tasks, seed, args) for seed in range(args.seeds)]
        print(f"{config.label:<24} {time.perf_counter() - start:6.1f} s", flush=True)

    kinds = sorted({group_of(t) for t in tasks})
    header = "| configuration | " + " | ".join(
        f"{kind}: final J/J* | {kind}: iters to {args.threshold:.0%} | {kind}: runs at optimum | {kind}: seeds all optimal"
        for kind in kinds
    ) + " |"
    lines = [
        f"TurnBandit `{args.variant}` suite: {len(tasks)} tasks (task seed {args.task_seed}, K={args.options}), "
        f"{args.seeds} seeds, {args.iterations} iterations x {args.rollouts} {args.batches} rollouts per task, "
        f"{args.optimizer} lr {args.lr}, epochs {args.epochs}, minibatch {args.minibatch_size}, kl {args.kl_coef}. "
        f"'iters to' counts runs that never get there as {args.iterations}. "
        f"Load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (J is exact: load changes only the time).",
        "",
        header,
        "|" + "---|" * (1 + 4 * len(kinds)),
    ]
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for label, curves in results.items():
        cells = []
        summary[label] = {}
        for kind in kinds:
            members = [k for k, t in enumerate(tasks) if group_of(t) == kind]
            part = [[[row[k] for k in members] for row in c] for c in curves]
            s = summarize(part, args.threshold)
            summary[label][kind] = s
            cells += [
                f"{s['final_j_over_jstar']:.3f}",
                f"{s['iterations_to_99']:.1f}",
                f"{s['runs_at_optimum']:.2f}",
                f"{s['seeds_all_optimal']:.2f}",
            ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    (args.out / "results.md").write_text(table + "\n")
    (args.out / "results.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "curves": results})
    )
    plot(results, tasks, args.out)
    print(f"wrote {args.out}/results.md, results.json, curves.png")


if __name__ == "__main__":
    main()
