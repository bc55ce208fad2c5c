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


def test_turnbandit_capital_takes_every_answer_and_rewards_a_capital_start():
    from seeupo_gym.turnbandit import TurnBanditEnv

    env = TurnBanditEnv(variant="capital", num_tasks=2)
    env.reset(options={"task_id": "capital-0-0"})
    _, reward, done, _, info = env.step("hello")
    assert (reward, done, info["action_error"], info["choices"]) == (0.0, False, "", "B")
    _, reward, done, _, info = env.step("  Zebra")
    assert (reward, done, info["choices"]) == (0.5, True, "BA")
    env.reset(options={"task_id": "capital-0-1"})
    for answer in env.task.optimal_answers():
        _, reward, _, _, _ = env.step(answer)
    assert reward == 1.0
