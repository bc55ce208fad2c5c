"""The multi-turn credit-assignment study: turn-level methods x TurnBandit suites x policies x budgets, against J*.

Every run trains one method on one suite instance set (`--tasks` tasks of one task seed, trained
together) from one seed, on sampled batches of G rollouts per task, and ends with the exact J/J* of
every task (J by enumeration, J* by backward induction). A cell of the table is the mean over seeds
of the per-seed mean J/J*, with its 95% t-interval over seeds; a winner is named only where the
paired interval of its difference to every other method (same seed = same tasks and sampler seed)
excludes 0.

Policies (`--policies`): `tabular` (one logit row per context: one turn's update never moves
another's) and `shared` (`algorithms/shared_policy.py`: logits a linear function of features shared
across turns, as an LLM's turns share weights). Budgets (`--match`): `samples` (same rollouts, each
method its own optimizer steps per batch) and `steps` (same rollouts, every method as many optimizer
steps per batch as the method with the most, through `epochs`). Steps and gradient tokens are
counted by `CountingLearner` (algorithms/budget.py) during the runs, not predicted.

Methods: labels below, any registered algorithm name, `name:key=value,key=value` (algorithm options),
and a user's methods with `--plugin path/to/file.py` or `--plugin module:Class`. The default is the
labelled list plus every other registered algorithm found at run time.

    .venv/bin/python scripts/credit_study.py --out runs/credit_study
    .venv/bin/python scripts/credit_study.py --methods grpo "seeupo:order=natural" --suites ladder --match steps

writes `results.md` (the tables), `results.json` (every run) and `credit.png` into --out.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from seeupo_gym.algorithms.base import algorithm_class, available_algorithms, load_plugin, make_algorithm, register_algorithm
from seeupo_gym.algorithms.budget import CountingLearner
from seeupo_gym.algorithms.shared_policy import SharedPolicy
from seeupo_gym.algorithms.tabular import TabularPolicy, sample_batch
from seeupo_gym.turnbandit import make_tasks


@dataclass
class Method:
    label: str
    algorithm: str
    options: dict = field(default_factory=dict)
    observations: bool = False  # trajectories carry env-style observations (GiGPO's anchors repeat)


LABELLED = [
    Method("seeupo reverse/batch", "seeupo", {"order": "reverse", "normalization": "batch"}),
    Method("seeupo natural/batch", "seeupo", {"order": "natural", "normalization": "batch"}),
    Method("seeupo random/batch", "seeupo", {"order": "random", "normalization": "batch"}),
    Method("seeupo reverse/group", "seeupo", {"order": "reverse", "normalization": "group"}),
    Method("seeupo reverse/none", "seeupo", {"order": "reverse", "normalization": "none"}),
    Method("grpo", "grpo"),
    Method("gspo", "gspo"),
    Method("ppo", "ppo"),
    Method("broadcast rloo", "broadcast", {"estimator": "rloo"}),
    Method("mt_grpo", "mt_grpo"),
    Method("gigpo (history anchors)", "gigpo"),
    Method("gigpo (observation anchors)", "gigpo", observations=True),
    Method("turn_gae", "turn_gae"),
]
# gspo is left out of the default: on one-token responses its sequence ratio is GRPO's token ratio.
DEFAULT_LABELS = ["seeupo reverse/batch", "seeupo natural/batch", "grpo", "ppo", "broadcast rloo",
                  "mt_grpo", "gigpo (history anchors)", "turn_gae"]


@dataclass(frozen=True)
class Suite:
    name: str
    variant: str
    turns: tuple[int, int]
    options: int = 3
    turn_rewards: bool = False
    slip: float = 0.0


SUITES = {s.name: s for s in [
    Suite("climbing", "climbing", (2, 3)),
    Suite("stopping", "stopping", (2, 4)),
    Suite("ladder", "ladder", (6, 10), options=2),
    Suite("ladder+slip", "ladder", (4, 8), options=2, slip=0.1),
    Suite("stopping+slip", "stopping", (2, 4), slip=0.1),
    Suite("follow", "follow", (2, 3)),
    Suite("climbing+turn rewards", "climbing", (2, 3), turn_rewards=True),
    Suite("stopping+turn rewards", "stopping", (2, 4), turn_rewards=True),
]}
DEFAULT_SUITES = ["climbing", "stopping", "ladder", "ladder+slip"]
POLICIES = {"tabular": TabularPolicy, "shared": SharedPolicy}
MATCHES = ("samples", "steps")
# Two-sided 95% Student t quantiles by degrees of freedom (1..30); normal beyond.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def fail(message: str) -> None:
    """A mistake of the user's: one line on stderr, exit status 2."""
    print(f"credit_study: {message}", file=sys.stderr)
    raise SystemExit(2)


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval of the mean); half-width nan for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    t = _T95[len(values) - 2] if len(values) - 1 <= len(_T95) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False, "null": None, "none": None}.get(text.lower(), text)


def load_plugins(specs: list[str]) -> list[Method]:
    """Import each plug-in (a file, a dotted module, or `module:Class`); its registered algorithms become methods."""
    before = set(available_algorithms())
    named: list[str] = []
    for spec in specs:
        module, _, class_name = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
        try:
            load_plugin(module)
        except (ImportError, FileNotFoundError, SyntaxError) as err:
            fail(f"cannot load plug-in {spec!r}: {err}")
        if class_name:
            cls = getattr(sys.modules.get(module) or sys.modules.get(f"seeupo_plugin_{Path(module).stem}"), class_name, None)
            if cls is None:
                fail(f"plug-in {module!r} has no class {class_name!r}")
            if not cls.name:  # not decorated: register it under its class name
                register_algorithm(class_name.lower())(cls)
            named.append(cls.name)
    new = sorted(set(available_algorithms()) - before)
    return [Method(name, name) for name in dict.fromkeys(named + new)]


def resolve_methods(specs: list[str] | None, plugins: list[Method]) -> list[Method]:
    by_label = {m.label: m for m in LABELLED}
    registered = available_algorithms()
    if not specs:
        covered = {m.algorithm for m in LABELLED} | {"gspo"}
        extra = [Method(name, name) for name in registered if name not in covered]
        chosen = [by_label[label] for label in DEFAULT_LABELS] + extra
        return chosen + [p for p in plugins if p.label not in {m.label for m in chosen}]
    methods = []
    for spec in specs:
        if spec in by_label:
            methods.append(by_label[spec])
            continue
        name, _, rest = spec.partition(":")
        if name not in registered:
            fail(f"unknown method {spec!r}; known: labels {sorted(by_label)}; algorithms {registered} "
                 "(name:key=value,... for options; --plugin for your own)")
        options = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                fail(f"method {spec!r}: options are key=value, got {item!r}")
            options[key.strip()] = _value(value.strip())
        methods.append(Method(spec, name, options))
    return methods + [p for p in plugins if p.label not in {m.label for m in methods}]


def tasks_of(suite: Suite, seed: int, num_tasks: int) -> list:
    return make_tasks(suite.variant, num_tasks, seed=seed, turns=suite.turns, options=suite.options,
                      turn_rewards=suite.turn_rewards, slip=suite.slip)


def algorithm_of(method: Method, epochs: int):
    return make_algorithm(method.algorithm, {"kl_coef": 0.0, "minibatch_size": 10_000, **method.options,
                                             **({"epochs": epochs} if epochs > 1 else {})})


def steps_per_batch(method: Method, suite: Suite, policy: str, seed: int, num_tasks: int, group_size: int) -> int:
    """Optimizer steps of one update of `method` on the first batch of the suite's seed, counted."""
    learner = POLICIES[policy](tasks_of(suite, seed, num_tasks), lr=0.1, optimizer="adam", observations=method.observations)
    generator = torch.Generator().manual_seed(seed)
    counting = CountingLearner(learner)
    algorithm_of(method, 1).update(sample_batch(learner, group_size, generator), counting, generator)
    return counting.optimizer_steps


def train(method: Method, suite: Suite, policy: str, seed: int, *, lr: float, epochs: int, iterations: int,
          group_size: int, num_tasks: int, eval_every: int) -> dict:
    """One run: J/J* of every task at the end, the mean J/J* curve, and what the updates spent."""
    torch.manual_seed(seed)
    tasks = tasks_of(suite, seed, num_tasks)
    optimum = [task.optimal_value for task in tasks]
    learner = POLICIES[policy](tasks, lr=lr, optimizer="adam", observations=method.observations)
    algorithm = algorithm_of(method, epochs)
    generator = torch.Generator().manual_seed(seed)
    counting = CountingLearner(learner)

    def scores() -> list[float]:
        return [j / o for j, o in zip(learner.exact_returns(), optimum)]

    start = time.perf_counter()
    curve = [(0, statistics.fmean(scores()))]
    rollouts = 0
    for i in range(1, iterations + 1):
        batch = sample_batch(learner, group_size, generator)
        rollouts += len(batch)
        algorithm.update(batch, counting, generator)
        if eval_every and i % eval_every == 0 and i < iterations:
            curve.append((i, statistics.fmean(scores())))
    final = scores()
    curve.append((iterations, statistics.fmean(final)))
    return {
        "final": final, "mean": statistics.fmean(final), "curve": curve, "rollouts": rollouts,
        "optimizer_steps": counting.optimizer_steps, "gradient_tokens": counting.gradient_tokens,
        "wall_s": time.perf_counter() - start,
    }


def separation(runs: dict[str, list[dict]]) -> str:
    """The winner line of one column: the best mean, and the methods whose paired 95% interval of the
    difference to it contains 0 (not separated)."""
    means = {label: statistics.fmean(r["mean"] for r in rs) for label, rs in runs.items()}
    best = max(means, key=means.get)
    tied = []
    for label, rs in runs.items():
        if label == best:
            continue
        diffs = [b["mean"] - r["mean"] for b, r in zip(runs[best], rs)]
        mean, half = interval(diffs)
        if not (mean - half > 0):
            tied.append(label)
    if not tied:
        return f"**{best}** ({means[best]:.3f}), above every other method (paired 95% intervals exclude 0)"
    return f"no winner: {best} ({means[best]:.3f}) is not separated from {', '.join(tied)}"


def plot(results: dict, suites: list[Suite], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(results)  # (policy, match)
    fig, axes = plt.subplots(len(panels), len(suites), figsize=(4.2 * len(suites), 3.4 * len(panels)), squeeze=False)
    for row, key in enumerate(panels):
        for ax, suite in zip(axes[row], suites):
            for label, by_suite in results[key].items():
                runs = by_suite.get(suite.name) or []
                if not runs:
                    continue
                xs = [x for x, _ in runs[0]["curve"]]
                ys = [statistics.fmean(r["curve"][i][1] for r in runs) for i in range(len(xs))]
                ax.plot(xs, ys, label=label, linestyle="-" if label.startswith("seeupo") else "--")
            ax.set_title(f"{suite.name}: {key[0]}, match {key[1]}", fontsize=9)
            ax.set_xlabel("iteration")
            ax.set_ylabel("mean exact J / J*")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "credit.png", dpi=90)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/credit_study"))
    parser.add_argument("--methods", nargs="*", help="labels, algorithm names or name:key=value,... (default: all)")
    parser.add_argument("--plugin", action="append", default=[], help="a file or module:Class adding a method (repeatable)")
    parser.add_argument("--suites", nargs="*", help=f"suite names (default: {' '.join(DEFAULT_SUITES)})")
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), help="tabular and/or shared")
    parser.add_argument("--match", nargs="*", default=list(MATCHES), help="samples and/or steps")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per cell (seed s: task seed s, sampler seed s)")
    parser.add_argument("--tasks", type=int, default=10, help="instances (tasks) per seed, trained together")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--group-size", type=int, default=8, help="G rollouts per task per iteration")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.1], help="Adam LRs; several: a sweep per method and policy")
    parser.add_argument("--sweep-suite", default="climbing", help="the suite the LR sweep runs on (budget samples)")
    parser.add_argument("--sweep-seeds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    unknown = [s for s in args.suites or [] if s not in SUITES]
    if unknown:
        fail(f"unknown suite(s) {unknown}; known: {list(SUITES)}")
    for value, known, what in ((args.policies, POLICIES, "policy"), (args.match, MATCHES, "--match")):
        if bad := [v for v in value if v not in known]:
            fail(f"unknown {what} {bad}; known: {list(known)}")
    if args.sweep_suite not in SUITES:
        fail(f"unknown --sweep-suite {args.sweep_suite!r}; known: {list(SUITES)}")
    methods = resolve_methods(args.methods, load_plugins(args.plugin))
    suites = [SUITES[name] for name in (args.suites or DEFAULT_SUITES)]
    args.out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    common = dict(iterations=args.iterations, group_size=args.group_size, num_tasks=args.tasks, eval_every=args.eval_every)
    failed: dict[str, str] = {}

    # The LR of every (method, policy): the best mean final J/J* on the sweep suite, budget samples.
    lr_of: dict[tuple[str, str], float] = {}
    sweep: dict[str, dict[str, dict[str, float]]] = {}
    for policy in args.policies:
        for method in methods:
            if len(args.lrs) == 1:
                lr_of[method.label, policy] = args.lrs[0]
                continue
            scores = {}
            for lr in args.lrs:
                try:
                    runs = [train(method, SUITES[args.sweep_suite], policy, seed, lr=lr, epochs=1, **common)
                            for seed in range(args.sweep_seeds)]
                except Exception as err:  # a method that cannot run here is reported, not fatal
                    failed[method.label] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                    break
                scores[lr] = statistics.fmean(r["mean"] for r in runs)
            if scores:
                lr_of[method.label, policy] = max(scores, key=scores.get)
                sweep.setdefault(policy, {})[method.label] = {str(k): v for k, v in scores.items()}
                print(f"sweep {policy:<7} {method.label:<28} " + " ".join(f"{k:g}:{v:.3f}" for k, v in scores.items())
                      + f"  (load {os.getloadavg()[0]:.1f})", flush=True)
    methods = [m for m in methods if m.label not in failed]

    results: dict[tuple[str, str], dict[str, dict[str, list]]] = {}
    epochs_of: dict[tuple[str, str, int, str], int] = {}
    for policy in args.policies:
        for match in args.match:
            results[policy, match] = {m.label: {} for m in methods}
            for suite in suites:
                # Budget steps: each seed's tasks (their lengths set SeeUPO's pools) get their own epochs.
                for seed in range(args.seeds if match == "steps" else 0):
                    counted = {}
                    for m in methods:
                        try:
                            counted[m.label] = steps_per_batch(m, suite, policy, seed, args.tasks, args.group_size)
                        except Exception as err:
                            failed[m.label] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                    most = max(counted.values())
                    for label, steps in counted.items():
                        epochs_of[policy, suite.name, seed, label] = max(1, round(most / max(steps, 1)))
                for m in methods:
                    if m.label in failed:
                        continue
                    try:
                        runs = [train(m, suite, policy, seed, lr=lr_of[m.label, policy],
                                      epochs=epochs_of.get((policy, suite.name, seed, m.label), 1) if match == "steps" else 1,
                                      **common)
                                for seed in range(args.seeds)]
                    except Exception as err:
                        failed[m.label] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                        continue
                    results[policy, match][m.label][suite.name] = runs
                    mean, half = interval([r["mean"] for r in runs])
                    print(f"{policy:<7} {match:<7} {suite.name:<12} {m.label:<28} {mean:.3f} +- {half:.3f}  "
                          f"steps/it {statistics.fmean(r['optimizer_steps'] for r in runs) / args.iterations:.1f}  "
                          f"{statistics.fmean(r['wall_s'] for r in runs):.1f} s/run  (load {os.getloadavg()[0]:.1f})", flush=True)

    lines = [
        f"Sampled batches: G={args.group_size} rollouts per task, {args.tasks} tasks (instances) per seed trained together, "
        f"{args.iterations} iterations, {args.seeds} seeds (seed s: task seed s and sampler seed s). A cell: mean over seeds "
        "of the mean final exact J/J* over the tasks, +- the 95% t-interval over seeds. Adam, kl 0, one minibatch per step. "
        f"Load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (J is exact: load changes only the time).",
        "",
    ]
    if sweep:
        lines += [f"LR sweep (budget samples, suite {args.sweep_suite}, {args.sweep_seeds} seeds, mean final J/J*; the best is used):", "",
                  "| policy | method | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " | chosen |",
                  "|---|---|" + "---|" * (len(args.lrs) + 1)]
        for policy, by_method in sweep.items():
            for label, scores in by_method.items():
                lines.append(f"| {policy} | {label} | " + " | ".join(f"{scores.get(str(lr), float('nan')):.3f}" for lr in args.lrs)
                             + f" | {lr_of[label, policy]:g} |")
        lines.append("")
    for (policy, match), by_method in results.items():
        title = ("each method its own optimizer steps per batch" if match == "samples"
                 else "every method as many optimizer steps per batch as the one with the most, through epochs")
        lines += [f"### Policy {policy}, budget {match} ({title})", "",
                  "| method | lr | " + " | ".join(f"{s.name}: J/J* +- 95% | steps/it, grad tokens/it, s/run" for s in suites) + " |",
                  "|---|---|" + "---|---|" * len(suites)]
        for label, by_suite in by_method.items():
            if label in failed:
                continue
            cells = []
            for s in suites:
                runs = by_suite.get(s.name, [])
                if not runs:
                    cells += ["-", "-"]
                    continue
                mean, half = interval([r["mean"] for r in runs])
                steps = statistics.fmean(r["optimizer_steps"] for r in runs) / args.iterations
                tokens = statistics.fmean(r["gradient_tokens"] for r in runs) / args.iterations
                wall = statistics.fmean(r["wall_s"] for r in runs)
                cells += [f"{mean:.3f} +- {half:.3f}", f"{steps:.1f}, {tokens:.0f}, {wall:.1f}"]
            lines.append(f"| {label} | {lr_of[label, policy]:g} | " + " | ".join(cells) + " |")
        lines.append("")
        for s in suites:
            column = {label: rs[s.name] for label, rs in by_method.items() if s.name in rs}
            if len(column) > 1:
                lines.append(f"- {s.name}: {separation(column)}")
        lines.append("")
    rollouts = args.tasks * args.group_size
    lines.append(f"Rollouts: {rollouts} per iteration, {rollouts * args.iterations} per run, the same for every method.")
    for label, reason in failed.items():
        lines.append(f"- not run: {label}: {reason}")
    table = "\n".join(lines)
    print(table)
    (args.out / "results.md").write_text(table + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items()},
        "lr": {f"{label}|{policy}": lr for (label, policy), lr in lr_of.items()},
        "results": {f"{policy}|{match}": v for (policy, match), v in results.items()},
        "failed": failed,
    }))
    if results and any(results.values()):
        plot(results, suites, args.out)
    print(f"wrote {args.out}/results.md, results.json, credit.png")


if __name__ == "__main__":
    main()
