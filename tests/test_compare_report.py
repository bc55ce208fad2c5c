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
    assert last.startswith(f"**Winner**: {best}, final eval avg@2 "), last
    assert "margin +" in last


def test_a_flat_comparison_names_no_winner(tmp_path):
    folder = synthetic_folder(tmp_path)
    _flatten(folder, 0.5)
    assert write_report(folder).read_text().strip().splitlines()[-1].startswith("**Winner**: none")


@pytest.mark.parametrize(
    "scores, expected",
    [
        # (label, mean, sd, seeds): a margin of 0.2 against sds of 0.05 and 0.1 is a win
        ([("grpo", 0.5, 0.1, 3), ("seeupo", 0.7, 0.05, 3)], "**Winner**: seeupo, m 0.700 vs 0.500 for grpo "
         "(margin +0.200, larger than the spread over seeds (sd up to 0.100))."),
        # the same margin inside an sd of 0.25 is a tie
        ([("grpo", 0.5, 0.25, 3), ("seeupo", 0.7, 0.05, 3)], "**Winner**: seeupo, m 0.700 vs 0.500 for grpo "
         "(margin +0.200, inside the spread over seeds (sd up to 0.250): a tie)."),
        ([("grpo", 0.5, 0.0, 1), ("seeupo", 0.7, 0.0, 1)], "**Winner**: seeupo, m 0.700 vs 0.500 for grpo "
         "(margin +0.200, one seed, so no spread to weigh the margin against)."),
        ([("grpo", 0.5, 0.0, 2), ("seeupo", float("nan"), 0.0, 2)], "**Winner**: none (fewer than two runs have a final m)."),
    ],
)
def test_the_winner_line_weighs_the_margin_against_the_spread_over_seeds(scores, expected):
    from seeupo_gym.training.compare.report import winner_line

    assert winner_line(scores, "m") == expected
