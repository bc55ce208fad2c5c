"""A run killed after step 1 and resumed from its checkpoint repeats the uninterrupted step 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from trainer_helpers import tiny_config

from seeupo_gym.training.checkpoint import checkpoints
from seeupo_gym.training.trainer import Trainer


@pytest.mark.parametrize("algorithm", ["seeupo"])
def test_resume_after_step_1_reproduces_step_2_metrics_and_weights(tmp_path, algorithm):
    uninterrupted = tiny_config(tmp_path / "a", f"algorithm.name={algorithm}", "train.steps=2", "train.save_every=1",
                                "train.keep_checkpoints=5", "env.kwargs={max_turns: 1}")
    with Trainer(uninterrupted) as trainer:
        records = trainer.train()
        final_weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    step2 = next(r for r in records if r["step"] == 2.0)
    saved = checkpoints(tmp_path / "a" / "run" / "checkpoints")
    assert [p.name for p in saved] == ["step-1", "step-2"]

    # A fresh process's view: new trainer, new model from scratch, state only from the step-1 checkpoint.
    # The run folder of a run killed after logging step 2 but before its step-2 checkpoint.
    resumed_dir = tmp_path / "b" / "run"
    shutil.copytree(tmp_path / "a" / "run", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step-2")
    lines = (resumed_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "lost": 1})
    (resumed_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    resumed = tiny_config(tmp_path / "b", f"algorithm.name={algorithm}", "train.steps=2", "resume_from=latest",
                          "env.kwargs={max_turns: 1}")
    with Trainer(resumed) as trainer:
        assert trainer.state.step == 1
        records = trainer.train()
        resumed_weights = trainer.model.state_dict()
        assert [r["step"] for r in records] == [2.0]
    again = records[0]
    compared = [k for k in step2 if not k.startswith("time/")]
    assert "update/policy_loss" in compared and "rollout/reward_mean" in compared
    for key in compared:
        assert again[key] == pytest.approx(step2[key], abs=1e-6), key
    for name, value in final_weights.items():
        torch.testing.assert_close(resumed_weights[name], value, atol=1e-6, rtol=0)
    # The lost run's step-2 record was dropped; the resumed one replaces it.
    logged = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and "lost" not in logged[1]


def test_resume_latest_without_checkpoints_starts_at_step_0(tmp_path):
    with Trainer(tiny_config(tmp_path, "resume_from=latest")) as trainer:
        assert trainer.state.step == 0
