"""The documented per-turn advantage plug-in (docs/examples/turn_credit_plugin.py) works as docs/algorithms.md says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seeupo_gym.algorithms.base import load_plugin, make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.algorithms.tabular import TabularPolicy, sample_batch
from seeupo_gym.turnbandit import make_tasks

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "docs" / "examples" / "turn_credit_plugin.py"

torch.set_num_threads(1)


def _trajectory(rid: str, turns: int, reward: float) -> Trajectory:
    return Trajectory(task_id="t", group_id="g", rollout_id=rid, reward=reward, success=False,
                      turns=[Turn(context_ids=[0, k], response_ids=[1], sample_logprobs=[-0.5]) for k in range(turns)])


def test_reward_to_go_plugin_keys_turns_from_one_with_a_per_turn_leave_one_out_baseline():
    load_plugin(PLUGIN)
    algorithm = make_algorithm("reward_to_go", {"kl_coef": 0.0})
    batch = RolloutBatch([_trajectory("a", 2, 1.0), _trajectory("b", 1, 0.0), _trajectory("c", 2, 0.5)])
    advantages = algorithm.turn_advantages(batch, learner=None)
    # reward-to-go: a (1, 1), b (0,), c (0.5, 0.5); turn 2's baseline leaves out b, which ended at turn 1.
    assert advantages == pytest.approx({("a", 1): 1 - 0.25, ("a", 2): 1 - 0.5, ("b", 1): 0 - 0.75,
                                        ("c", 1): 0.5 - 0.5, ("c", 2): 0.5 - 1.0})


def test_reward_to_go_plugin_trains_the_tabular_policy_towards_the_optimum():
    load_plugin(PLUGIN)
    tasks = make_tasks("climbing", 4, seed=0, turns=(2, 3))
    policy = TabularPolicy(tasks, lr=0.3, optimizer="adam")
    algorithm = make_algorithm("reward_to_go", {"kl_coef": 0.0, "minibatch_size": 10_000})
    generator = torch.Generator().manual_seed(0)
    before = sum(policy.exact_returns())
    for _ in range(15):
        algorithm.update(sample_batch(policy, 8, generator), policy, generator)
    assert sum(policy.exact_returns()) > before + 0.4


@pytest.mark.slow
def test_seeupo_train_runs_the_plugin_for_a_step(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "seeupo_gym.training.cli", "--config", "tiny-cpu", "--plugin", str(PLUGIN),
         "algorithm.name=reward_to_go", "train.steps=1", "train.tasks_per_step=1", "train.save_every=0",
         f"log.output_dir={tmp_path / 'run'}", "log.trackers=[]", "log.progress_bars=false", "sampling.max_new_tokens=4"],
        capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
