"""report.md and summary.json of a comparison folder, rebuilt from its run.json and the runs' JSONL.

The report is prose around four tables (final results with the best per column in bold,
eval scores by step, eval start -> final per seed, training reward by step) and links curves.png (`plots.py`).
A comparison of models (`seeupo-compare --model ...`, no training) has the same layout: the final
table (avg@k, pass@k, per category), per seed, and scores.png in place of the curves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from seeupo_gym.training.compare.match import MATCH_TEXT
from seeupo_gym.training.compare.plots import plot_curves, plot_scores
from seeupo_gym.training.compare.stats import (
    ModelRow,
    Row,
    collect_series,
    final_rows,
    model_rows,
    read_records,
    window_width,
)
from seeupo_gym.training.config import ConfigError
from seeupo_gym.text import counted
from seeupo_gym.training.run_files import refuse_links, write_run_text

# The comparison's own record: command, settings, eval tasks, runs, wall time, failures.
RUN_INFO = "run.json"


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
    write_run_text(folder / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    return records


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
    """The final-results table, one row per algorithm, the best per column in bold."""
    columns = [
        # (title, value, sd, higher is better (None: no best, e.g. where a run starts), digits)
        ("train reward, first steps", lambda r: r.reward_first, lambda r: None, None, 3),
        ("train reward, last steps", lambda r: r.reward_last, lambda r: None, True, 3),
        (f"eval avg@{k}, start", lambda r: r.eval_first, lambda r: None, None, 3),
        (f"eval avg@{k}, final", lambda r: r.eval_last, lambda r: r.eval_last_sd, True, 3),
        (f"eval pass@{k}, final", lambda r: r.pass_last, lambda r: r.pass_last_sd, True, 3),
        ("s / train step", lambda r: r.step_seconds, lambda r: None, False, 1),
        ("of which update", lambda r: r.update_seconds, lambda r: None, False, 1),
    ]
    return _bold_best_table("algorithm", columns, rows)


def budget_table(rows: Sequence[Row]) -> str:
    """What each method spent per training step and in all (no best: a budget is not a score)."""
    columns = [
        ("rollouts / step", lambda r: r.rollouts_per_step, lambda r: None, None, 1),
        ("rollouts in all", lambda r: r.rollouts_total, lambda r: None, None, 0),
        ("optimizer steps / step", lambda r: r.optimizer_steps_per_step, lambda r: None, None, 1),
        ("optimizer steps in all", lambda r: r.optimizer_steps_total, lambda r: None, None, 0),
        ("gradient tokens / step", lambda r: r.gradient_tokens_per_step, lambda r: None, None, 0),
        ("gradient tokens in all", lambda r: r.gradient_tokens_total, lambda r: None, None, 0),
        ("wall time, s", lambda r: r.train_seconds, lambda r: None, None, 1),
    ]
    return _bold_best_table("algorithm", columns, rows)


def eval_table(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int) -> str:
    """avg@k / pass@k per eval step and algorithm (means over seeds)."""
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


def seed_table(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int) -> str:
    """Eval avg@k at the first and last evaluation of every (algorithm, seed) run, and the change:
    the spread over seeds behind the final table's means."""
    by_run: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for record in records:
        value = record.get(f"eval/avg@{k}")
        if value is not None and math.isfinite(value):
            by_run.setdefault((record["algorithm"], int(record["seed"])), []).append((int(record["step"]), value))
    firsts = {key: min(points)[1] for key, points in by_run.items()}
    lasts = {key: max(points)[1] for key, points in by_run.items()}
    seeds = sorted({seed for _, seed in by_run})
    if not seeds:
        return "(no evaluations)"
    lines = ["| seed | " + " | ".join(f"{label} avg@{k}: start -> final (change)" for label in labels) + " |",
             "|---" * (len(labels) + 1) + "|"]
    changes: dict[str, list[float]] = {label: [] for label in labels}
    for seed in seeds:
        cells = []
        for label in labels:
            if (label, seed) not in firsts:
                cells.append("")
                continue
            first, last = firsts[(label, seed)], lasts[(label, seed)]
            changes[label].append(last - first)
            cells.append(f"{first:.3f} -> {last:.3f} ({_signed(last - first)})")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    if len(seeds) > 1:
        cells = []
        for label in labels:
            values = changes[label]
            sd = statistics.stdev(values) if len(values) > 1 else math.nan
            cells.append(f"change {_signed(statistics.fmean(values))} ± {sd:.3f}" if values else "")
        lines.append("| mean ± sd | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def train_table(records: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    """Training reward per step and algorithm (means over seeds)."""
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


def write_report(folder: str | Path) -> Path:
    """report.md, curves.png and summary.json of a compare folder, from its run.json and JSONL."""
    folder = Path(folder)
    info_path = folder / RUN_INFO
    refuse_links(folder)
    if not info_path.is_file():
        raise ConfigError(f"{str(folder)!r} is not a seeupo-compare folder (no {RUN_INFO})")
    info = json.loads(info_path.read_text())
    records = combine_run_records(folder, info)
    if info.get("kind") == "models":
        return write_models_report(folder, info, records)
    labels = list(dict.fromkeys(run["label"] for run in info["runs"]))
    seeds = sorted({run["seed"] for run in info["runs"]})
    k = int(info["eval"]["k"])
    config = info["config"]
    rows = final_rows(records, labels, k)
    env, train, sampling, model = config["env"], config["train"], config["sampling"], config["model"]
    title = (f"{model['name_or_path']}{' + LoRA' if model.get('lora') else ''} on {env['id']} "
             f"{_kwargs_text(env['kwargs'])}: {', '.join(labels)}")
    plot_curves(records, labels, k, folder / "curves.png", title, eval_tasks_text(info))
    flat = flat_reward(records, k)

    wall = info.get("wall_seconds")
    failures = info.get("failures") or {}
    matched = info.get("match", "samples")  # folders from before --match held samples
    incomplete = [f"{row.label} ({row.steps} of {train['steps']} steps)" for row in rows if row.steps < train["steps"]]
    lines = [
        f"# {', '.join(labels)} on {env['id']}",
        "",
        f"Model **{model['name_or_path']}**{' with LoRA ' + _kwargs_text(model['lora']) if model.get('lora') else ''}, "
        f"env `{env['id']}` {_kwargs_text(env['kwargs'])}. "
        f"Every run: {train['steps']} steps x {train['tasks_per_step']} tasks x {train['group_size']} rollouts, "
        f"responses of at most {counted(sampling['max_new_tokens'], 'token')} at temperature {sampling['temperature']}, "
        f"lr {config['optim']['lr']:g}; seeds {', '.join(map(str, seeds))} (the same for every algorithm: same tasks "
        "per step, same initial weights).",
        f"Evaluation: {len(info['eval_tasks'])} tasks x {info['eval']['n']} rollouts at temperature "
        f"{info['eval']['temperature']}{' with env kwargs ' + _kwargs_text(info['eval']['env_kwargs']) if info['eval']['env_kwargs'] else ''}, "
        "before training and " + (f"every {info['eval']['every']} steps." if info["eval"]["every"] else "after the last step."),
        f"Budget matched: **{MATCH_TEXT.get(matched, matched)}**; what each method spent is under *Budget*.",
        "",
        f"Started {info['started']} on {info['host']['cpus']} CPU(s), {info['host']['platform']}"
        + (f"; total wall time **{wall / 60:.1f} min**." if wall else "."),
        "",
        "## Final results",
        "",
        *([f"**Interrupted before the end**: partial results; {', '.join(incomplete)}. The rows below are "
           "what each run reached.", ""] if wall is None or incomplete else []),
        *([_flat_text(flat)] if flat is not None else [final_table(rows, k)]),
        "",
        f"Evaluated on {eval_tasks_text(info)}. Means over seeds (± sd when there are several). *Train reward*: the mean reward of the step's "
        f"rollouts, averaged over the first / last {_window_text(train['steps'])} of the run. *avg@{k}*: mean task score "
        f"over {info['eval']['n']} sampled rollouts per eval task; *pass@{k}*: the unbiased chance that at least one "
        f"of {k} rollouts succeeds. *s / train step*: wall time of rollout + update. Best per column in **bold**. "
        "The winner line names a winner only when its seeds' interval of final eval scores (lowest to highest seed) "
        "lies wholly above the runner-up's.",
        "",
        "![training reward and eval score versus step](curves.png)",
        "",
        "## Budget",
        "",
        budget_table(rows),
        "",
        f"Means over seeds. *Rollouts*: episodes collected; *optimizer steps*: parameter updates, counted as the "
        "update ran (SeeUPO: one per non-empty turn pool x epochs x minibatches; a single-phase method one per "
        "minibatch x epochs); *gradient tokens*: response tokens trained on with autograd, summed over those steps; "
        "*wall time*: rollout + update over all steps. "
        + ("Every method's epochs were raised per batch until its steps reached the most any compared method "
           "takes on that batch (the next whole epoch where its steps per epoch do not divide that target)."
           if matched == "steps" else "Each method took its own optimizer steps on the same number of rollouts "
           "(`--match steps` gives every method the most)."),
        "",
        "## Evaluation by step",
        "",
        eval_table(records, labels, k),
        "",
        "## Per seed",
        "",
        seed_table(records, labels, k),
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
        winner_line([(r.label, r.eval_last, r.eval_last_low, r.eval_last_high, r.seeds) for r in rows],
                    f"final eval avg@{k}", matched)
        if flat is None else f"**Winner**: none at matched {_MATCHED_WORDS.get(matched, matched)} (every reward was "
        "equal: nothing to tell the algorithms apart).",
        "",
    ]
    write_run_text(folder / "report.md", "\n".join(lines))
    summary = {"k": k, "wall_seconds": wall, "failures": failures, "every_reward_equal": flat, "match": matched,
               "algorithms": {row.label: dataclasses.asdict(row) for row in rows}}
    write_run_text(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
    return folder / "report.md"


def flat_reward(records: Sequence[dict[str, Any]], k: int) -> float | None:
    """The one value every training reward and eval score of a comparison took, or None when they differ."""
    values = {round(float(r[key]), 9) for r in records for key in ("rollout/reward_mean", f"eval/avg@{k}")
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])}
    return values.pop() if len(values) == 1 else None


def _flat_text(value: float) -> str:
    return (f"**Every training reward and eval score of this comparison is {value:.3f}: no run got a signal to "
            "learn from, so this comparison cannot tell the algorithms apart (no results table).** Each group's "
            "rollouts scored alike (see `rollout/flat_group_rate` in metrics.jsonl). Give the model a task it can "
            "score on: a stronger model, an easier env variant, longer responses, or `--config smoke` for a "
            "setting in which the tiny model learns.")


def eval_tasks_text(info: dict[str, Any]) -> str:
    """Which tasks the evaluations score, relative to training: "training tasks", "held-out tasks"..."""
    env = info["config"]["env"]
    eval_kwargs = {**env["kwargs"], **(env.get("eval_kwargs") or {}), **(info["eval"].get("env_kwargs") or {})}
    changed = {k: v for k, v in eval_kwargs.items() if env["kwargs"].get(k, object()) != v}
    if changed:
        return f"tasks of the eval env {_kwargs_text(changed)}"
    count = len(info["eval_tasks"])
    train = env.get("train_tasks")
    evaluated = set(info["eval_tasks"])
    if train is None or evaluated <= set(train):
        return f"{count} training tasks"
    if not evaluated & set(train):
        return f"{count} held-out tasks"
    return f"{count} tasks, {len(evaluated & set(train))} of them training tasks"


def _kwargs_text(kwargs: Any) -> str:
    if not kwargs:
        return ""
    if isinstance(kwargs, dict):
        return "(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
    return f"({kwargs})"


def _window_text(steps: int) -> str:
    width = window_width(steps)
    return "step" if width == 1 else f"{width} steps"


def _signed(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:+.3f}"


def winner_line(
    scores: Sequence[tuple[str, float, float, float, int]], metric: str, matched: str | None = None
) -> str:
    """The report's last line: the best of (label, mean over seeds, lowest seed, highest seed, seeds) by
    `metric` and its margin over the runner-up. The spread over seeds is each method's interval
    [lowest seed, highest seed]: a winner is named only when the best's interval lies wholly above the
    runner-up's (no seed of the runner-up reached the best's worst seed), never with one seed.
    matched: the budget the comparison held equal (`match.MATCHES`), named in the line."""
    at = f" at matched {_MATCHED_WORDS.get(matched, matched)}" if matched else ""
    ranked = sorted(((value, label, low, high, seeds) for label, value, low, high, seeds in scores
                     if value is not None and math.isfinite(value)), key=lambda item: item[0], reverse=True)
    if len(ranked) < 2:
        return f"**Winner**: none{at} (fewer than two runs have a final {metric})."
    (best, label, low, _, seeds), (second, runner_up, _, second_high, second_seeds) = ranked[0], ranked[1]
    margin = best - second
    if margin == 0:
        return f"**Winner**: none{at}: {label} and {runner_up} tie at {metric} {best:.3f}."
    lead = f"{metric} {best:.3f} vs {second:.3f} for {runner_up} (margin {_signed(margin)}"
    if min(seeds, second_seeds) < 2:
        return f"**Winner**: none{at}: {label} leads, {lead}), but with one seed there is no spread over seeds to weigh it."
    if low > second_high:
        return (f"**Winner**: {label}{at}, {lead}; over seeds {label} {_interval(ranked[0])} lies above "
                f"{runner_up} {_interval(ranked[1])}).")
    return (f"**Winner**: none{at}: {label} leads, {lead}), inside the spread over seeds ({label} "
            f"{_interval(ranked[0])} and {runner_up} {_interval(ranked[1])} overlap).")


_MATCHED_WORDS = {"samples": "samples", "steps": "optimizer steps"}


def _interval(ranked: tuple[float, str, float, float, int]) -> str:
    return f"[{ranked[2]:.3f}, {ranked[3]:.3f}]"


def model_table(rows: Sequence[ModelRow], k: int) -> str:
    """The final table of a models comparison, one row per model, the best per column in bold."""
    categories = sorted({name for row in rows for name in row.categories})
    columns = [
        # (title, value, sd, higher is better, digits)
        (f"avg@{k}", lambda r: r.avg, lambda r: r.avg_sd, True, 3),
        (f"pass@{k}", lambda r: r.passed, lambda r: r.passed_sd, True, 3),
        *([(f"{name} avg@{k}", (lambda r, name=name: r.categories.get(name, math.nan)), lambda r: None, True, 3)
           for name in categories] if len(categories) > 1 else []),
        ("tokens generated", lambda r: r.generated_tokens, lambda r: None, None, 0),
        ("s / eval", lambda r: r.eval_seconds, lambda r: None, False, 1),
        ("failed requests", lambda r: r.backend_errors, lambda r: None, None, 0),
    ]
    return _bold_best_table("model", columns, rows)


def model_seed_table(records: Sequence[dict[str, Any]], labels: Sequence[str], k: int) -> str:
    """avg@k / pass@k of every (model, seed): the spread behind the final table's means."""
    scores = {(r["algorithm"], int(r["seed"])): (r[f"eval/avg@{k}"], r[f"eval/pass@{k}"])
              for r in records if f"eval/avg@{k}" in r}
    seeds = sorted({seed for _, seed in scores})
    if not seeds:
        return "(no evaluations)"
    lines = ["| seed | " + " | ".join(f"{label} avg@{k} / pass@{k}" for label in labels) + " |",
             "|---" * (len(labels) + 1) + "|"]
    for seed in seeds:
        cells = [f"{scores[(label, seed)][0]:.3f} / {scores[(label, seed)][1]:.3f}" if (label, seed) in scores else ""
                 for label in labels]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_models_report(folder: Path, info: dict[str, Any], records: list[dict[str, Any]]) -> Path:
    """report.md, scores.png and summary.json of a models comparison."""
    labels = list(info["models"])
    k, ev, env = int(info["eval"]["k"]), info["eval"], info["config"]["env"]
    rows = model_rows(records, labels, k)
    title = f"{', '.join(labels)} on {env['id']} {_kwargs_text(info['env_kwargs'])}"
    plot_scores(records, labels, k, folder / "scores.png", title)
    wall = info.get("wall_seconds")
    failures = info.get("failures") or {}
    seeds = info["seeds"]
    models = "; ".join(f"**{label}**: {model['source']}" for label, model in info["models"].items())
    lines = [
        f"# {', '.join(labels)} on {env['id']}",
        "",
        f"Models: {models}. Env `{env['id']}` {_kwargs_text(info['env_kwargs'])}.",
        f"Evaluation: {len(info['eval_tasks'])} tasks x {ev['n']} rollouts at temperature "
        f"{ev['temperature']}, responses of at "
        f"most {ev['max_new_tokens']} tokens per turn; seeds {', '.join(map(str, seeds))} (the same tasks and draws "
        "for every model; each (model, seed) scores as `seeupo-eval --seed` would).",
        "",
        f"Started {info['started']} on {info['host']['cpus']} CPU(s), {info['host']['platform']}"
        + (f"; total wall time **{wall / 60:.1f} min**." if wall else "."),
        "",
        "## Final results",
        "",
        *(["**Interrupted before the end**: partial results.", ""] if wall is None else []),
        model_table(rows, k),
        "",
        f"Means over seeds (± sd when there are several). *avg@{k}*: mean task score over {ev['n']} sampled "
        f"rollouts per task; *pass@{k}*: the unbiased chance that at least one of {k} rollouts succeeds. "
        "*tokens generated*: mean per evaluation (not counted for a model behind a chat API); *failed requests*: episodes "
        "a server ended without a usable reply, scored as failures. Best per column in **bold**.",
        "",
        f"![eval avg@{k} and pass@{k} per model](scores.png)",
        "",
        "## Per seed",
        "",
        model_seed_table(records, labels, k),
    ]
    if failures:
        lines += ["", "## Failed models", ""] + [f"- {name}: {error}" for name, error in failures.items()]
    lines += [
        "",
        "## Files",
        "",
        "- `metrics.jsonl`: every model's eval records, tagged `algorithm` (the label) and `seed`.",
        "- `<label>/seed-<s>/`: each evaluation's metrics.jsonl and result.json (seeupo-eval's JSON, per task).",
        f"- `{RUN_INFO}`: the command, the settings, the models and the eval task ids (API keys are never written).",
        "",
        f"Command: `{info.get('command') or 'seeupo-compare'}`",
        "",
        winner_line([(r.label, r.avg, r.avg_low, r.avg_high, r.seeds) for r in rows], f"avg@{k}"),
        "",
    ]
    write_run_text(folder / "report.md", "\n".join(lines))
    summary = {"k": k, "wall_seconds": wall, "failures": failures,
               "models": {row.label: dataclasses.asdict(row) for row in rows}}
    write_run_text(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
    return folder / "report.md"


def _bold_best_table(first: str, columns: Sequence[tuple], rows: Sequence[Any]) -> str:
    """A markdown table of `rows` under (header, value, sd, best rule or None, digits) columns, the
    best value of each ruled column in bold."""
    lines = [f"| {first} | " + " | ".join(c[0] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    best = [_best([c[1](r) for r in rows], c[3]) if c[3] is not None else set() for c in columns]
    for i, row in enumerate(rows):
        cells = []
        for j, (_, value, sd, _, digits) in enumerate(columns):
            text = _fmt(value(row), sd(row), digits)
            cells.append(f"**{text}**" if i in best[j] else text)
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
