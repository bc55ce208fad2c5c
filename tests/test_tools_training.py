"""seeupo-train and seeupo-compare in the tools format (`env.kwargs.action_format=tools`), tiny model."""

from __future__ import annotations

import json

import pytest

from seeupo_gym.training.compare.cli import main as compare_main
from seeupo_gym.training.compare.stats import read_records
from seeupo_gym.training.cli import train_main

# The BFCL tasks with the shortest prompts, to keep the CPU tests fast.
SHORT_TASKS = "[multi_turn_miss_func_146, multi_turn_miss_func_121]"


def test_cli_trains_a_step_on_bfcl_in_the_tools_format(tmp_path):
    out = tmp_path / "tools"
    code = train_main([
        "--config", "tiny-cpu", f"log.output_dir={out}", "log.trackers=[]", "log.progress_bars=false",
        f"env.train_tasks={SHORT_TASKS}", "env.kwargs.action_format=tools", "env.kwargs.max_turns=2",
        "env.max_context_tokens=8192", "train.steps=1", "train.tasks_per_step=1", "train.save_every=0",
        "sampling.max_new_tokens=4", "algorithm.name=grpo",
    ])
    assert code == 0
    (train,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert train["step"] == 1 and train["rollout/trajectories"] == 2.0
    assert train["rollout/turns_mean"] == 2.0 and train["rollout/env_errors"] == 0.0


@pytest.mark.slow
def test_compare_runs_in_the_tools_format(tmp_path):
    out = tmp_path / "cmp"
    code = compare_main([
        "--config", "tiny-cpu", "--algorithms", "grpo", "--seeds", "0", "--eval-every", "0", "-k", "1",
        "--eval-task-ids", "multi_turn_miss_func_146", "--out", str(out), "--no-progress", "--no-eval-at-start",
        f"env.train_tasks={SHORT_TASKS}", "env.kwargs.action_format=tools", "env.kwargs.max_turns=1",
        "env.max_context_tokens=8192", "train.steps=1", "train.tasks_per_step=1", "train.save_every=0",
        "sampling.max_new_tokens=4", "log.trackers=[]",
    ])
    assert code == 0
    records = read_records(out / "metrics.jsonl")
    assert [r["step"] for r in records if "rollout/reward_mean" in r] == [1.0]
    assert any("eval/avg@1" in r for r in records)
    config = (out / "grpo" / "seed-0" / "config.yaml")
    assert "action_format: tools" in config.read_text()
