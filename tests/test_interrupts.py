"""Ctrl-C and SIGTERM end a run cleanly: the last finished step is checkpointed (also with
`save_every: 0`), one line says how to continue, exit 130; the printed command continues the run.
The installed commands run in subprocesses and get real signals: Ctrl-C as a terminal sends it,
to the whole process group."""

from __future__ import annotations

import json
import shlex
import signal
import time
from pathlib import Path

import pytest

from cli_helpers import run, signal_group, start

SMOKE = ["--config", "smoke", "log.progress_bars=false"]


def _train_steps(path: Path) -> list[float]:
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if line.strip() and "rollout/reward_mean" in json.loads(line)]


def _wait_for_steps(path: Path, steps: int, process, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while len(_train_steps(path)) < steps:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run did not reach its steps in time"
        time.sleep(0.05)


def _stopped(process) -> tuple[str, str]:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "Aborted" not in err, err
    return out, err


def test_ctrl_c_keeps_the_last_finished_step_with_save_every_0_and_the_printed_command_continues(tmp_path):
    folder = tmp_path / "run"
    process = start("seeupo-train", *SMOKE, "--out", str(folder), "train.steps=100")
    _wait_for_steps(folder / "metrics.jsonl", 2, process)
    signal_group(process, signal.SIGINT)
    _, err = _stopped(process)
    last = err.strip().splitlines()[-1]
    kept = _train_steps(folder / "metrics.jsonl")
    assert kept == [float(s) for s in range(1, len(kept) + 1)]  # the step in progress finished or dropped, whole
    step = len(kept)
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [f"step-{step}"]  # save_every: 0
    assert last.startswith("seeupo-train: stopped by SIGINT; ") and f"step {step} is kept in " in last, err
    assert last.endswith("--resume latest"), last

    command = shlex.split(last.split("continue with: ", 1)[1])
    assert command[0] == "seeupo-train"
    # The printed command, with a shorter budget added at its end (overrides go anywhere).
    done = run(*command, f"train.steps={step + 1}")
    assert done.returncode == 0, done.stderr
    assert f"resumed from {folder / 'checkpoints' / f'step-{step}'} at step {step}" in done.stderr
    assert _train_steps(folder / "metrics.jsonl") == [float(s) for s in range(1, step + 2)]


def test_sigterm_to_the_trainer_alone_ends_it_the_same_way(tmp_path):
    folder = tmp_path / "run"
    process = start("seeupo-train", *SMOKE, "--out", str(folder), "train.steps=100", "train.save_every=0")
    _wait_for_steps(folder / "metrics.jsonl", 1, process)
    process.send_signal(signal.SIGTERM)  # as a scheduler or `kill` does
    _, err = _stopped(process)
    step = len(_train_steps(folder / "metrics.jsonl"))
    assert (folder / "checkpoints" / f"step-{step}").is_dir()
    assert "stopped by SIGTERM" in err.strip().splitlines()[-1]


def test_ctrl_c_before_the_first_step_leaves_a_folder_the_same_command_reuses(tmp_path):
    folder = tmp_path / "run"
    process = start("seeupo-train", *SMOKE, "--out", str(folder), "train.steps=100")
    deadline = time.monotonic() + 120
    while not (folder / "config.yaml").is_file():  # the trainer is being built
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    signal_group(process, signal.SIGINT)
    _, err = _stopped(process)
    assert "nothing to keep; run the same command again" in err.strip().splitlines()[-1]
    done = run("seeupo-train", *SMOKE, "--out", str(folder), "train.steps=1")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow  # ~25 s: two short training runs with evaluations, one of them twice
def test_seeupo_compare_interrupted_continues_its_plan_with_the_printed_command(tmp_path):
    out = tmp_path / "cmp"
    args = ["--config", "smoke", "--algorithms", "seeupo,grpo", "--eval-every", "2", "--eval-tasks", "4", "-k", "1",
            "--out", str(out), "train.steps=3", "--no-progress"]
    process = start("seeupo-compare", *args)
    _wait_for_steps(out / "seeupo" / "seed-0" / "metrics.jsonl", 2, process)
    signal_group(process, signal.SIGINT)
    _, err = _stopped(process)
    last = err.strip().splitlines()[-1]
    assert last.startswith("seeupo-compare: stopped by SIGINT in seeupo/seed-0") and last.endswith(" --resume"), err
    assert not (out / "grpo" / "seed-0" / "metrics.jsonl").exists()

    command = shlex.split(last.split("continue with: ", 1)[1])
    done = run(*command)
    assert done.returncode == 0, done.stderr
    for label in ("seeupo", "grpo"):
        records = [json.loads(line) for line in (out / label / "seed-0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "rollout/reward_mean" in r] == [1.0, 2.0, 3.0]  # each step once
        assert [r["step"] for r in records if "eval/avg@1" in r] == [0.0, 2.0, 3.0]  # the plan's evaluations
        assert not (out / label / "seed-0" / "checkpoints").exists()  # kept only with --save-checkpoints
    assert "grpo" in (out / "report.md").read_text()


def test_resuming_another_plan_into_a_comparisons_folder_is_refused(tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"runs": [], "eval": {}}))
    done = run("seeupo-compare", "--config", "smoke", "--algorithms", "grpo", "--out", str(out), "--resume")
    assert done.returncode == 2 and "was planned with other runs" in done.stderr, done.stderr


def test_an_inherited_ignored_sigint_stays_ignored():
    from seeupo_gym.training.interrupts import Interrupts

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Interrupts():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # nohup / a background job: left alone
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)
