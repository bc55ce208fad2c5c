"""seeupo-compare: runs, report, curves and JSONL of a side-by-side comparison."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from seeupo_gym.training.config import ConfigError
from seeupo_gym.training.compare.cli import main
from seeupo_gym.training.compare.plan import EvalPlan, build_plan, eval_steps, load_raw, parse_algorithms
from seeupo_gym.training.compare.report import write_report
from seeupo_gym.training.compare.stats import final_rows, read_records

TINY = {
    "model": {"name_or_path": "tiny"},
    "env": {"id": "seeupo/TurnBandit-v0", "kwargs": {"variant": "easy", "num_tasks": 8, "max_turns": 2},
            "num_envs": 4, "max_context_tokens": 1024},
    "sampling": {"max_new_tokens": 4},
    "algorithm": {"name": "seeupo", "order": "reverse", "minibatch_size": 8},
    "optim": {"lr": 1e-3},
    "train": {"steps": 1, "tasks_per_step": 1, "group_size": 2},
    "log": {"trackers": [], "progress_bars": False},
}

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_config(tmp_path: Path) -> Path:
    import yaml

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_tiny_comparison_end_to_end_writes_report_curves_and_jsonl(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main([
        "--config", str(write_config(tmp_path)), "--algorithms", "seeupo,grpo", "--seeds", "0",
        "--eval-every", "1", "-k", "2", "--eval-tasks", "2", "--eval-env-kwargs", '{"seed": 1}',
        "--out", str(out), "--no-progress",
    ])
    assert code == 0
    assert f"report: {out / 'report.md'}" in capsys.readouterr().out
    assert (out / "curves.png").read_bytes()[:8] == PNG_MAGIC

    records = read_records(out / "metrics.jsonl")
    for label in ("seeupo", "grpo"):
        mine = [r for r in records if r["algorithm"] == label]
        assert [r["step"] for r in mine if "rollout/reward_mean" in r] == [1.0]
        assert [r["step"] for r in mine if "eval/avg@2" in r] == [0.0, 1.0]
        # The run's own JSONL holds the same records.
        own = read_records(out / label / "seed-0" / "metrics.jsonl")
        assert len(own) == len(mine)
        evals = [r for r in mine if "eval/avg@2" in r]
        assert [(r["eval/tasks"], r["eval/rollouts_per_task"]) for r in evals] == [(2.0, 2.0)] * 2
        # No checkpoints unless --save-checkpoints.
        assert not (out / label / "seed-0" / "checkpoints").exists()
    # Both runs start from the same weights: the step-0 evaluation is run once and shared.
    starts = [r for r in records if r["step"] == 0.0]
    assert starts[0]["eval/avg@2"] == starts[1]["eval/avg@2"] and starts[1]["eval/shared_with_earlier_run"] == 1.0
    # Same seed, same tasks per step, whatever the algorithm.
    run_info = json.loads((out / "run.json").read_text())
    assert run_info["eval_tasks"] == ["easy-1-0", "easy-1-1"]
    assert run_info["algorithms"]["grpo"]["name"] == "grpo" and "order" not in run_info["algorithms"]["grpo"]
    assert run_info["algorithms"]["seeupo"]["order"] == "reverse"

    summary = json.loads((out / "summary.json").read_text())
    for label in ("seeupo", "grpo"):
        mine = [r for r in records if r["algorithm"] == label]
        evals = [r for r in mine if "eval/avg@2" in r]
        train = [r for r in mine if "rollout/reward_mean" in r]
        row = summary["algorithms"][label]
        assert row["eval_last"] == pytest.approx(evals[-1]["eval/avg@2"])
        assert row["pass_last"] == pytest.approx(evals[-1]["eval/pass@2"])
        assert row["reward_last"] == pytest.approx(train[-1]["rollout/reward_mean"])
        assert row["step_seconds"] == pytest.approx(train[0]["time/rollout_s"] + train[0]["time/update_s"])
    report = (out / "report.md").read_text()
    assert "| seeupo |" in report and "| grpo |" in report and "![training reward" in report


def synthetic_folder(tmp_path: Path) -> Path:
    """A compare folder with known numbers: two algorithms, two seeds, three steps."""
    folder = tmp_path / "synthetic"
    folder.mkdir()
    runs = [{"label": a, "algorithm": a, "seed": s, "folder": str(folder / a / f"seed-{s}")}
            for a in ("seeupo", "grpo") for s in (0, 1)]
    config = {"model": {"name_or_path": "tiny", "lora": None}, "env": {"id": "seeupo/TurnBandit-v0", "kwargs": {}},
              "train": {"steps": 3, "tasks_per_step": 2, "group_size": 4}, "sampling": {"max_new_tokens": 8, "temperature": 1.0},
              "optim": {"lr": 1e-3}}
    info = {"command": "seeupo-compare test", "started": "2026-11-29T00:00:00+00:00", "host": {"platform": "x", "cpus": 2},
            "eval": {"every": 3, "k": 2, "n": 4, "temperature": 1.0, "env_kwargs": {}}, "eval_tasks": ["a", "b"],
            "runs": runs, "config": config, "wall_seconds": 120.0}
    (folder / "run.json").write_text(json.dumps(info))
    rewards = {("seeupo", 0): [0.2, 0.4, 0.8], ("seeupo", 1): [0.3, 0.5, 0.6],
               ("grpo", 0): [0.2, 0.3, 0.4], ("grpo", 1): [0.3, 0.3, 0.2]}
    finals = {("seeupo", 0): (0.7, 0.9), ("seeupo", 1): (0.5, 0.7), ("grpo", 0): (0.4, 1.0), ("grpo", 1): (0.2, 0.8)}
    lines = []
    for (label, seed), values in rewards.items():
        lines.append({"algorithm": label, "seed": seed, "step": 0.0, "eval/avg@2": 0.1, "eval/pass@2": 0.2})
        for step, value in enumerate(values, start=1):
            lines.append({"algorithm": label, "seed": seed, "step": float(step), "rollout/reward_mean": value,
                          "time/rollout_s": 2.0 if label == "seeupo" else 1.0, "time/update_s": 1.0,
                          "rollout/trajectories": 8.0, "budget/optimizer_steps": 3.0 if label == "seeupo" else 1.0,
                          "budget/gradient_tokens": 60.0 if label == "seeupo" else 40.0 + seed})
        avg, passed = finals[(label, seed)]
        lines.append({"algorithm": label, "seed": seed, "step": 3.0, "eval/avg@2": avg, "eval/pass@2": passed})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_report_numbers_are_means_over_seeds_and_the_best_is_bold(tmp_path):
    folder = synthetic_folder(tmp_path)
    report = write_report(folder).read_text()
    rows = {row.label: row for row in final_rows(read_records(folder / "metrics.jsonl"), ["seeupo", "grpo"], 2)}
    assert rows["seeupo"].eval_last == pytest.approx(0.6)
    assert rows["seeupo"].eval_last_sd == pytest.approx(statistics.stdev([0.7, 0.5]))
    assert rows["grpo"].pass_last == pytest.approx(0.9)
    assert rows["seeupo"].reward_first == pytest.approx(0.25) and rows["seeupo"].reward_last == pytest.approx(0.7)
    assert rows["grpo"].step_seconds == pytest.approx(2.0) and rows["seeupo"].step_seconds == pytest.approx(3.0)
    seeupo_line = next(line for line in report.splitlines() if line.startswith("| seeupo |"))
    grpo_line = next(line for line in report.splitlines() if line.startswith("| grpo |"))
    # seeupo: best final avg@2 and last-step reward; grpo: best pass@2 and time per step.
    assert "**0.600 ± 0.141**" in seeupo_line and "**0.700**" in seeupo_line
    assert "**0.900 ± 0.141**" in grpo_line and "**2.0**" in grpo_line
    assert "**" not in seeupo_line.split("|")[6] and "**" not in grpo_line.split("|")[5]
    # Equal values (both start at eval 0.1) are not marked, nor is any starting point "best".
    assert "**0.100**" not in report
    assert all("**" not in line.split("|")[column] for line in (seeupo_line, grpo_line) for column in (2, 4))
    assert (folder / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert "total wall time **2.0 min**" in report


def test_the_report_states_each_algorithms_rollouts_optimizer_steps_and_gradient_tokens(tmp_path):
    folder = synthetic_folder(tmp_path)
    report = write_report(folder).read_text()
    budget = report.split("## Budget", 1)[1].split("##", 1)[0]
    assert "optimizer steps / step" in budget and "gradient tokens / step" in budget
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in budget.splitlines() if line.startswith("| seeupo |") or line.startswith("| grpo |")}
    # rollouts / step, in all; optimizer steps / step, in all; gradient tokens / step, in all; wall time
    assert rows["seeupo"] == ["8.0", "24", "3.0", "9", "60", "180", "9.0"]
    assert rows["grpo"] == ["8.0", "24", "1.0", "3", "40", "122", "6.0"]  # tokens 40 and 41 per step by seed
    assert "Budget matched: **samples" in report
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["match"] == "samples" and summary["algorithms"]["seeupo"]["optimizer_steps_total"] == 9.0


def test_report_only_rebuilds_from_the_jsonl(tmp_path, capsys):
    folder = synthetic_folder(tmp_path)
    assert main(["--report-only", str(folder)]) == 0
    assert (folder / "report.md").is_file() and "report:" in capsys.readouterr().out
    assert main(["--report-only", str(tmp_path)]) == 2
    assert "not a seeupo-compare folder" in capsys.readouterr().err


def test_a_failing_run_is_reported_and_the_others_still_run(tmp_path):
    plugin = tmp_path / "boom.py"
    plugin.write_text(
        "from seeupo_gym.algorithms.base import Algorithm, register_algorithm\n"
        "@register_algorithm('boom')\n"
        "class Boom(Algorithm):\n"
        "    def update(self, batch, learner, generator):\n"
        "        raise RuntimeError('boom in update')\n"
    )
    out = tmp_path / "cmp"
    code = main(["--config", str(write_config(tmp_path)), "--plugin", str(plugin), "--algorithms", "boom,grpo",
                 "--eval-tasks", "1", "-k", "1", "--no-eval-at-start", "--out", str(out), "--no-progress"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "boom/seed-0" in summary["failures"] and "boom in update" in summary["failures"]["boom/seed-0"]
    assert summary["algorithms"]["grpo"]["steps"] == 1
    assert "## Failed runs" in (out / "report.md").read_text()


def test_a_run_failing_after_its_first_step_keeps_a_checkpoint_of_it(tmp_path):
    plugin = tmp_path / "late_boom.py"
    plugin.write_text(
        "from seeupo_gym.algorithms.base import register_algorithm\n"
        "from seeupo_gym.algorithms.grpo import GRPO\n"
        "@register_algorithm('late_boom')\n"
        "class LateBoom(GRPO):\n"
        "    updates = 0\n"
        "    def update(self, batch, learner, generator):\n"
        "        LateBoom.updates += 1\n"
        "        if LateBoom.updates == 2:\n"
        "            raise RuntimeError('boom in the second update')\n"
        "        return super().update(batch, learner, generator)\n"
    )
    out = tmp_path / "cmp"
    code = main(["--config", str(write_config(tmp_path)), "--plugin", str(plugin), "--algorithms", "late_boom",
                 "--eval-tasks", "1", "-k", "1", "--no-eval-at-start", "--out", str(out), "--no-progress",
                 "train.steps=3"])
    assert code == 1  # its only run failed, so the comparison as a whole did
    summary = json.loads((out / "summary.json").read_text())
    assert "boom in the second update" in summary["failures"]["late_boom/seed-0"]
    # The trainer's loop ran the steps, so its checkpoint-on-failure kept step 1.
    assert [p.name for p in (out / "late_boom" / "seed-0" / "checkpoints").iterdir()] == ["step-1"]


def test_a_steps_matched_comparison_gives_every_method_the_same_optimizer_steps(tmp_path):
    out = tmp_path / "cmp"
    code = main(["--config", str(write_config(tmp_path)), "--algorithms", "seeupo,grpo", "--match", "steps",
                 "--eval-every", "0", "--no-eval-at-start", "-k", "1", "--eval-tasks", "1", "--out", str(out),
                 "--no-progress", "env.kwargs.variant=follow"])  # follow: every episode runs both turns
    assert code == 0
    train = {r["algorithm"]: r for r in read_records(out / "metrics.jsonl") if "rollout/reward_mean" in r}
    # SeeUPO: one step per turn pool (2); GRPO: one per epoch, raised to 2 epochs.
    assert train["seeupo"]["budget/optimizer_steps"] == train["grpo"]["budget/optimizer_steps"] == 2.0
    assert train["grpo"]["update/budget_epochs"] == 2.0 and train["seeupo"]["update/budget_epochs"] == 1.0
    # Steps matched, tokens not: each GRPO epoch trains on every turn, SeeUPO's pools each on one turn.
    assert train["grpo"]["budget/gradient_tokens"] == 2 * train["seeupo"]["budget/gradient_tokens"] > 0
    report = (out / "report.md").read_text()
    assert "Budget matched: **optimizer steps" in report
    assert " at matched optimizer steps" in report.strip().splitlines()[-1]
    assert json.loads((out / "run.json").read_text())["match"] == "steps"


def test_the_shared_config_may_be_a_preset_name():
    raw = load_raw("tiny-cpu", ["train.steps=3"])
    assert raw["model"]["name_or_path"] == "tiny" and raw["train"]["steps"] == 3


def test_plans_are_checked_before_any_run(tmp_path):
    plan = EvalPlan(k=2, max_tasks=3)
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'"):
        build_plan(dict(TINY), {"nope": "nope"}, [0], tmp_path, plan)
    with pytest.raises(ConfigError, match="not among --algorithms"):
        build_plan(dict(TINY), {"seeupo": "seeupo"}, [0], tmp_path, plan, options={"grpo": {"x": 1}})
    with pytest.raises(ConfigError, match="run natural \\(seed 0\\).*order"):
        build_plan(dict(TINY), {"natural": "seeupo"}, [0], tmp_path, plan, options={"natural": {"order": "sideways"}})
    with pytest.raises(ConfigError, match="k <= n"):
        build_plan(dict(TINY), {"grpo": "grpo"}, [0], tmp_path, EvalPlan(k=3, n=2))
    with pytest.raises(ConfigError, match="twice"):
        parse_algorithms("seeupo,seeupo")
    resolved = build_plan(dict(TINY), parse_algorithms("seeupo,natural=seeupo"), [0, 1], tmp_path, plan,
                          options={"natural": {"order": "natural"}})
    assert [(r.label, r.seed) for r in resolved.runs] == [("seeupo", 0), ("seeupo", 1), ("natural", 0), ("natural", 1)]
    assert resolved.runs[2].config.algorithm.options["order"] == "natural"
    assert resolved.runs[1].config.train.seed == 1
    assert resolved.eval_tasks == ["easy-0-0", "easy-0-1", "easy-0-2"]


def test_eval_points_include_the_start_and_the_last_step():
    assert eval_steps(5, 2, True) == [0, 2, 4, 5]
    assert eval_steps(4, 2, False) == [2, 4]
    assert eval_steps(3, 0, True) == [0, 3]


def test_the_report_shows_every_seed_start_to_final_and_the_spread_of_the_change(tmp_path):
    report = write_report(synthetic_folder(tmp_path)).read_text()
    section = report.split("## Per seed")[1].split("##")[0]
    # seeupo: 0.1 -> 0.7 and 0.1 -> 0.5; grpo: 0.1 -> 0.4 and 0.1 -> 0.2.
    assert "| 0 | 0.100 -> 0.700 (+0.600) | 0.100 -> 0.400 (+0.300) |" in section
    assert "| 1 | 0.100 -> 0.500 (+0.400) | 0.100 -> 0.200 (+0.100) |" in section
    assert f"change +0.500 ± {statistics.stdev([0.6, 0.4]):.3f}" in section
    assert f"change +0.200 ± {statistics.stdev([0.3, 0.1]):.3f}" in section


def test_a_report_of_records_from_before_the_counting_learner_reads_the_algorithms_own_step_count(tmp_path):
    folder = synthetic_folder(tmp_path)
    records = read_records(folder / "metrics.jsonl")
    for record in records:
        if "budget/optimizer_steps" in record:
            record["update/optimizer_steps"] = record.pop("budget/optimizer_steps")
            del record["budget/gradient_tokens"]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = {row.label: row for row in final_rows(read_records(folder / "metrics.jsonl"), ["seeupo", "grpo"], 2)}
    assert rows["seeupo"].optimizer_steps_per_step == 3.0 and rows["grpo"].optimizer_steps_total == 3.0
    assert math.isnan(rows["seeupo"].gradient_tokens_per_step)
    assert "| seeupo | 8.0 | 24 | 3.0 | 9 | n/a | n/a |" in write_report(folder).read_text()
