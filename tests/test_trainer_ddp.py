"""Data parallel training through `accelerate launch` on CPU (gloo): slow, two processes each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import ROOT, SHAPED_BFCL_ID, SHORT_TASKS

# `--cpu` would start a single process; several CPU processes come from the multi-process
# launcher, and the trainer asks accelerate for gloo when no GPU is there.
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]


def launch(num_processes: int, *args: str, multi: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = ACCELERATE if multi else [a for a in ACCELERATE if a != "--multi_gpu"]
    result = subprocess.run([*command, "--num_processes", str(num_processes), *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def ran_gloo(result: subprocess.CompletedProcess) -> bool:
    """Whether the launch started a gloo process group (the trainer logs accelerate's mode)."""
    return "MULTI_CPU" in result.stdout + result.stderr


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_trains_a_step(tmp_path):
    out = tmp_path / "run"
    result = launch(
        2, "-m", "seeupo_gym.training.cli", "--config", "tiny-cpu",
        "--plugin", str(ROOT / "tests" / "trainer_helpers.py"), f"env.id={SHAPED_BFCL_ID}",
        f"env.train_tasks=[{', '.join(SHORT_TASKS)}]", "env.kwargs={max_turns: 2}", "train.steps=1",
        "train.tasks_per_step=2", "sampling.max_new_tokens=4", f"log.output_dir={out}", "log.progress_bars=false",
    )
    assert ran_gloo(result)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1  # only the main process writes
    # Each process collected one task x 2 rollouts; the update saw all 4 trajectories.
    assert records[0]["rollout/trajectories"] == 4.0
    assert records[0]["update/optimizer_steps"] >= 1 and records[0]["update/grad_norm"] > 0
    checkpoint = out / "checkpoints" / "step-1"
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two launches of two processes each; minutes on a shared 2-core machine
@pytest.mark.parametrize("algorithm", ["seeupo", "grpo"])
def test_two_process_update_equals_the_one_process_update(tmp_path, algorithm):
    """Batch statistics are over the whole batch and the gradient is the full-batch gradient."""
    script = str(ROOT / "tests" / "trainer_ddp_update.py")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    launch(1, script, algorithm, str(tmp_path / "one"), multi=False)
    assert ran_gloo(launch(2, script, algorithm, str(tmp_path / "two")))
    one = torch.load(tmp_path / "one" / "weights.pt")
    two = torch.load(tmp_path / "two" / "weights.pt")
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, atol=1e-5, rtol=1e-4, msg=name)
    metrics_one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    metrics_two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key, value in metrics_one.items():
        assert metrics_two[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert metrics_one["optimizer_steps"] >= 2 and metrics_one["grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_process_fsdp2_update_equals_the_one_process_update(tmp_path):
    """FSDP2 shards every weight over the two processes; the update is still the one-process update.

    On CPU accelerate 1.15 keeps DDP (it enables FSDP for GPU-like backends only), so the script
    shards with torch's fully_shard over gloo; with 2+ GPUs it goes through accelerate's FSDP2 plugin.
    """
    script = str(ROOT / "tests" / "trainer_ddp_update.py")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    launch(1, script, "grpo", str(tmp_path / "one"), multi=False)
    result = launch(2, script, "grpo", str(tmp_path / "two"), "fsdp")
    assert "sharded=True" in result.stdout
    one = torch.load(tmp_path / "one" / "weights.pt")
    two = torch.load(tmp_path / "two" / "weights.pt")
    assert set(one) == set(two)
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, atol=1e-5, rtol=1e-4, msg=name)
    metrics_one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    metrics_two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key, value in metrics_one.items():
        assert metrics_two[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
