"""Red team: a link planted in a run folder never sends the run's writes outside it.

Before `run_files.py`, `--resume` appended through a `metrics.jsonl` planted as a link to a file
outside the folder (and truncated it to the kept steps first). Now a run or comparison that
opens a folder holding a link refuses with one line, and every run file is opened with
O_NOFOLLOW, which also stops a link planted while the run goes on.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_compare import synthetic_folder
from trainer_helpers import tiny_config

from seeupo_gym.training import cli
from seeupo_gym.training.compare.report import write_report
from seeupo_gym.training.rollouts import ROLLOUTS_FILE, RolloutLog
from seeupo_gym.training.run_files import RunFolderError, open_run_file
from seeupo_gym.training.trainer import Trainer

OUTSIDE = '{"step": 99, "precious": true}\n'


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A real run folder with a step-1 checkpoint, metrics and rollouts (the tiny model, one step)."""
    root = tmp_path_factory.mktemp("saved")
    with Trainer(tiny_config(root, "train.steps=1", "train.save_every=1", "env.kwargs={max_turns: 1}")) as trainer:
        trainer.train()
    assert (root / "run" / ROLLOUTS_FILE).is_file()
    return root / "run"


@pytest.fixture
def run_copy(saved_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    return run


def plant(run: Path, name: str, outside: Path) -> None:
    """Replace `run/name` with a link to `outside` (a copy of what was there, plus a line)."""
    target = run / name
    if target.is_dir():
        shutil.copytree(target, outside)
        shutil.rmtree(target)
    else:
        outside.write_bytes(target.read_bytes() + OUTSIDE.encode())
        target.unlink()
    target.symlink_to(outside)


def snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["metrics.jsonl", ROLLOUTS_FILE, "config.yaml", "run_id.json", "checkpoints",
                                  "checkpoints/step-1/config.yaml"])
def test_resume_refuses_a_run_folder_holding_a_link(run_copy, tmp_path, name):
    outside = tmp_path / "outside"
    plant(run_copy, name, outside)
    before = snapshot(outside)
    with pytest.raises(RunFolderError, match="is a symbolic link") as refused:
        Trainer(tiny_config(run_copy.parent, "train.steps=2", "resume_from=latest", "env.kwargs={max_turns: 1}"))
    assert snapshot(outside) == before
    assert Path(name).name in str(refused.value) and "\n" not in str(refused.value)


def test_seeupo_train_resume_through_a_metrics_link_exits_2_with_one_line(run_copy, tmp_path, capsys):
    outside = tmp_path / "outside.jsonl"
    plant(run_copy, "metrics.jsonl", outside)
    before = outside.read_bytes()
    code = cli.train_main(["--config", str(run_copy / "config.yaml"), "--resume", "latest", "train.steps=2",
                           f"log.output_dir={run_copy}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and outside.read_bytes() == before
    assert len(err.splitlines()) == 1 and "metrics.jsonl' is a symbolic link" in err, err


def test_a_link_planted_while_the_run_goes_on_is_not_written_through(run_copy, tmp_path):
    """The O_NOFOLLOW opens: the trainer's metrics and the rollout log, after the folder was checked."""
    with Trainer(tiny_config(run_copy.parent, "train.steps=2", "resume_from=latest", "env.kwargs={max_turns: 1}")) as trainer:
        for name in ("metrics.jsonl", ROLLOUTS_FILE):
            outside = tmp_path / f"outside-{name}"
            plant(run_copy, name, outside)
            before = outside.read_bytes()
            with pytest.raises(RunFolderError, match=name):
                if name == ROLLOUTS_FILE:
                    with open_run_file(trainer.rollout_log.path, "ab"):
                        pass
                else:
                    trainer.log({"step": 2.0, "x": 1.0})
            assert outside.read_bytes() == before
        RolloutLog(run_copy, trainer.tokenizer).truncate(0)  # the rewrite replaces the link, never its target
        assert outside.read_bytes() == before and not (run_copy / ROLLOUTS_FILE).is_symlink()


def test_seeupo_compare_report_refuses_a_linked_report(tmp_path):
    folder = synthetic_folder(tmp_path)
    outside = tmp_path / "outside.md"
    outside.write_text("precious\n")
    (folder / "report.md").symlink_to(outside)
    with pytest.raises(RunFolderError, match="report.md"):
        write_report(folder)
    assert outside.read_text() == "precious\n"
    assert cli_compare_exit(folder) == 2


def cli_compare_exit(folder: Path, *args: str) -> int:
    from seeupo_gym.training.compare.cli import main as compare_main

    return compare_main(list(args) or ["--report-only", str(folder)])


def test_seeupo_compare_resume_refuses_a_linked_metrics_file_before_writing(tmp_path, capsys):
    """Before: the comparison truncated the combined metrics.jsonl through the link at once."""
    folder = tmp_path / "cmp"
    folder.mkdir()
    outside = tmp_path / "outside.jsonl"
    outside.write_text(OUTSIDE)
    (folder / "metrics.jsonl").symlink_to(outside)
    code = cli_compare_exit(folder, "--config", "tiny-cpu", "--algorithms", "grpo", "--seeds", "0", "--out",
                            str(folder), "--resume", "--no-progress", "--eval-tasks", "1")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and outside.read_text() == OUTSIDE
    assert "metrics.jsonl' is a symbolic link" in err[-1] and not (folder / "run.json").exists(), err


def test_open_run_file_refuses_a_dangling_link_and_creates_nothing(tmp_path):
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(tmp_path / "elsewhere")
    for mode in ("w", "a", "wb", "ab"):
        with pytest.raises(RunFolderError):
            open_run_file(link, mode)
    assert not (tmp_path / "elsewhere").exists() and os.path.islink(link)
