"""`seeupo-train --config smoke`: the tiny random-init model raises its reward on a CPU."""

from __future__ import annotations

import json
import statistics

import pytest

from seeupo_gym.training.cli import train_main
from seeupo_gym.training.config import load_config


# ~85 s of CPU time (15 steps, 32 one-token rollouts each): over the default suite's budget.
@pytest.mark.slow
def test_smoke_preset_raises_the_reward_of_the_tiny_model_within_its_steps(tmp_path):
    assert load_config("smoke").train.steps <= 30
    assert train_main(["--config", "smoke", "--out", str(tmp_path / "run"), "log.progress_bars=false"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    # Measured (seed 0): about 0.2 over the first three steps, 1.0 over the last three.
    assert first < 0.4 and last > first + 0.4, rewards
