"""The compare report and curves say what they show: a flat comparison says so in bold, the
curves tell every label apart on whole-number steps, and the eval axis names its tasks."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from test_compare import synthetic_folder

from seeupo_gym.training.compare.plots import curves_figure
from seeupo_gym.training.compare.report import eval_tasks_text, write_report
from seeupo_gym.training.compare.stats import read_records


def _flatten(folder: Path, value: float) -> None:
    records = read_records(folder / "metrics.jsonl")
    for record in records:
        for key in ("rollout/reward_mean", "eval/avg@2", "eval/pass@2"):
            if key in record:
                record[key] = value
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for run in json.loads((folder / "run.json").read_text())["runs"]:  # keep the combined file the source
        assert not Path(run["folder"]).exists()


def test_a_comparison_whose_every_reward_is_equal_says_so_in_bold_instead_of_a_table(tmp_path):
    folder = synthetic_folder(tmp_path)
    _flatten(folder, 0.0)
    report = write_report(folder).read_text()
    final = report.split("## Final results")[1].split("##")[0]
    assert "**Every training reward and eval score of this comparison is 0.000" in final
    assert "| seeupo |" not in final and "| grpo |" not in final
    assert json.loads((folder / "summary.json").read_text())["every_reward_equal"] == 0.0


def test_a_comparison_with_different_rewards_gets_its_table(tmp_path):
    report = write_report(synthetic_folder(tmp_path)).read_text()
    final = report.split("## Final results")[1].split("##")[0]
    assert "| seeupo |" in final and "Every training reward" not in final
    assert json.loads((tmp_path / "synthetic" / "summary.json").read_text())["every_reward_equal"] is None


def test_curves_tell_labels_apart_on_integer_steps_and_name_the_eval_tasks(tmp_path):
    folder = synthetic_folder(tmp_path)
    info = json.loads((folder / "run.json").read_text())
    records = read_records(folder / "metrics.jsonl")
    labels = ["seeupo", "grpo", "gspo"]
    # A third label whose curve lies exactly on grpo's: it must still be told apart.
    records += [{**r, "algorithm": "gspo"} for r in records if r["algorithm"] == "grpo"]
    figure = curves_figure(records, labels, 2, "title", eval_tasks_text(info))
    try:
        train_axis, eval_axis = figure.axes
        for axis in (train_axis, eval_axis):
            lines = axis.get_lines()
            assert len(lines) == 3
            styles = {(line.get_color() if isinstance(line.get_color(), str) else tuple(line.get_color()),
                       line.get_marker(), line.get_linestyle()) for line in lines}
            assert len({s[0] for s in styles}) == 3 and len({s[1] for s in styles}) == 3
            assert len({s[2] for s in styles}) == 3
            figure.canvas.draw()
            ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks)
        assert eval_axis.get_ylabel() == "eval avg@2 on 2 training tasks (2 rollouts each)"
        assert "held-out" not in eval_axis.get_ylabel()
    finally:
        plt.close(figure)


@pytest.mark.parametrize(
    "env, eval_kwargs, expected",
    [
        ({"kwargs": {"split": "train"}}, {"split": "test"}, "tasks of the eval env (split=test)"),
        ({"kwargs": {}, "eval_kwargs": {"split": "test"}}, {}, "tasks of the eval env (split=test)"),
        ({"kwargs": {}, "train_tasks": ["c", "d"]}, {}, "2 held-out tasks"),
        ({"kwargs": {}, "train_tasks": ["a", "c"]}, {}, "2 tasks, 1 of them training tasks"),
        ({"kwargs": {}, "train_tasks": None}, {}, "2 training tasks"),
    ],
)
def test_the_eval_tasks_are_named_relative_to_training(env, eval_kwargs, expected):
    info = {"config": {"env": env}, "eval": {"env_kwargs": eval_kwargs}, "eval_tasks": ["a", "b"]}
    assert eval_tasks_text(info) == expected


def test_every_compare_report_ends_with_a_winner_line_naming_the_margin(tmp_path):
    report = write_report(synthetic_folder(tmp_path)).read_text()
    last = report.strip().splitlines()[-1]
    summary = json.loads((tmp_path / "synthetic" / "summary.json").read_text())["algorithms"]
    best = max(summary, key=lambda label: summary[label]["eval_last"])
    assert last.startswith(f"**Winner**: {best} at matched samples, final eval avg@2 "), last
    assert "margin +" in last


def test_a_flat_comparison_names_no_winner(tmp_path):
    folder = synthetic_folder(tmp_path)
    _flatten(folder, 0.5)
    assert write_report(folder).read_text().strip().splitlines()[-1].startswith("**Winner**: none")


@pytest.mark.parametrize(
    "scores, expected",
    [
        # (label, mean, lowest seed, highest seed, seeds): seeupo's worst seed above grpo's best: a win
        ([("grpo", 0.5, 0.4, 0.6, 3), ("seeupo", 0.7, 0.65, 0.75, 3)],
         "**Winner**: seeupo at matched optimizer steps, m 0.700 vs 0.500 for grpo (margin +0.200; over seeds "
         "seeupo [0.650, 0.750] lies above grpo [0.400, 0.600])."),
        # the same margin with intervals that overlap names no winner
        ([("grpo", 0.5, 0.2, 0.8, 3), ("seeupo", 0.7, 0.65, 0.75, 3)],
         "**Winner**: none at matched optimizer steps: seeupo leads, m 0.700 vs 0.500 for grpo (margin +0.200), "
         "inside the spread over seeds (seeupo [0.650, 0.750] and grpo [0.200, 0.800] overlap)."),
        ([("grpo", 0.5, 0.5, 0.5, 1), ("seeupo", 0.7, 0.7, 0.7, 1)],
         "**Winner**: none at matched optimizer steps: seeupo leads, m 0.700 vs 0.500 for grpo (margin +0.200), "
         "but with one seed there is no spread over seeds to weigh it."),
        ([("grpo", 0.5, 0.4, 0.6, 2), ("seeupo", float("nan"), 0.0, 0.0, 2)],
         "**Winner**: none at matched optimizer steps (fewer than two runs have a final m)."),
    ],
)
def test_the_winner_line_names_a_winner_only_outside_the_spread_over_seeds_and_names_the_budget(scores, expected):
    from seeupo_gym.training.compare.report import winner_line

    assert winner_line(scores, "m", "steps") == expected


def test_a_models_winner_line_names_no_budget():
    from seeupo_gym.training.compare.report import winner_line

    assert winner_line([("a", 0.9, 0.9, 0.9, 2), ("b", 0.1, 0.1, 0.1, 2)], "avg@2").startswith("**Winner**: a, avg@2")
