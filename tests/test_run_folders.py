"""Runs never mix: one run per folder, resumed only from its own checkpoints, its id on every record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seeupo_gym.training.checkpoint import open_run_folder, run_id_of, write_run_file
from seeupo_gym.training.cli import train_main
from seeupo_gym.training.config import ConfigError


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_readme_sequence_refuses_a_second_run_and_resumes_the_first(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["--config", "tiny-turnbandit", "--out", str(run), "log.progress_bars=false"]
    assert train_main(base) == 0
    first_id = run_id_of(run)
    assert first_id and [r["step"] for r in _records(run)] == [1, 2]

    assert train_main([*base, "train.steps=1"]) == 2  # a second run into the same folder
    error = capsys.readouterr().err
    assert f"already holds run {first_id}" in error and "--out DIR" in error and "--resume latest" in error
    assert [r["step"] for r in _records(run)] == [1, 2]

    assert train_main([*base, "train.steps=3", "--resume", "latest"]) == 0
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {r["run_id"] for r in records} == {first_id} == {run_id_of(run)}
    assert run_id_of(run / "checkpoints" / "step-3") == first_id


def _fake_run(folder: Path, run_id: str, steps: int) -> None:
    write_run_file(folder, run_id)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "run_id": run_id}) + "\n" for s in range(1, steps + 1)))
    for step in range(1, steps + 1):
        write_run_file(folder / "checkpoints" / f"step-{step}", run_id, step=step)


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    _fake_run(tmp_path / "a", "run-a", 2)
    _fake_run(tmp_path / "b", "run-b", 1)
    with pytest.raises(ConfigError, match="belongs to run run-a, but run folder .* holds run run-b"):
        open_run_folder(tmp_path / "b", str(tmp_path / "a" / "checkpoints" / "step-2"))
    assert open_run_folder(tmp_path / "b", "latest") == ("run-b", tmp_path / "b" / "checkpoints" / "step-1")
    assert open_run_folder(tmp_path / "b", str(tmp_path / "b" / "checkpoints" / "step-1"))[0] == "run-b"


def test_a_checkpoint_of_another_run_starts_a_new_run_in_an_empty_folder(tmp_path):
    _fake_run(tmp_path / "a", "run-a", 2)
    run_id, path = open_run_folder(tmp_path / "fork", str(tmp_path / "a" / "checkpoints" / "step-2"))
    assert run_id != "run-a" and path == tmp_path / "a" / "checkpoints" / "step-2"


def test_resume_latest_refuses_a_run_without_checkpoints_and_starts_an_empty_folder(tmp_path):
    write_run_file(tmp_path / "a", "run-a")
    (tmp_path / "a" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ConfigError, match="holds run run-a but no checkpoint"):
        open_run_folder(tmp_path / "a", "latest")
    run_id, path = open_run_folder(tmp_path / "empty", "latest")
    assert run_id and path is None


def test_a_folder_left_by_a_run_that_died_before_step_1_is_reused(tmp_path):
    write_run_file(tmp_path / "a", "run-a")
    (tmp_path / "a" / "config.yaml").write_text("{}\n")
    (tmp_path / "a" / "metrics.jsonl").write_text("")
    run_id, path = open_run_folder(tmp_path / "a", None)
    assert run_id != "run-a" and path is None
