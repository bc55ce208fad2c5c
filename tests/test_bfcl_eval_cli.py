"""bfcl-eval's own command line scores `seeupo-eval --export-bfcl` as we do: the command seeupo-eval
prints, run as it is with `bfcl` from `make bfcl-eval-venv`, gives our avg@1 (slow suite; skipped
where that venv is not built)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from bfcl_reference import variants
from cli_helpers import run
from test_bfcl_export import WRONG, _script
from test_openai_backend import _start

from seeupo_gym.bfcl.data import get_entry
from seeupo_gym.bfcl.export import BFCL_MODEL

ROOT = Path(__file__).resolve().parent.parent
BFCL = ROOT / ".venv-bfcl" / "bin" / "bfcl"


@pytest.mark.slow
@pytest.mark.skipif(not BFCL.is_file(), reason="bfcl-eval's own CLI is not built here: `make bfcl-eval-venv`")
def test_bfcl_evaluate_on_the_export_gives_our_avg_at_1(tmp_path):
    tasks = [f"multi_turn_base_{i}" for i in range(4)]
    script = {}
    for number, task_id in enumerate(tasks):  # two ground truths, two of bfcl's own kinds of wrong answer
        cases = variants(get_entry(task_id).ground_truth)
        script[get_entry(task_id).user_messages[0]] = _script(task_id, cases["ground truth" if number % 2 == 0 else WRONG[number]])
    process, url = _start(tmp_path, script)
    try:
        done = run("seeupo-eval", "--base-url", url + "/v1", "--model", "scripted", "--env", "seeupo/BFCL-v4-v0",
                   "--env-kwargs", json.dumps({"action_format": "tools", "split": "all", "max_turns": 20}),
                   "--tasks", ",".join(tasks), "--out", str(tmp_path / "ours.json"),
                   "--export-bfcl", str(tmp_path / "bfcl"), "--no-progress", cwd=ROOT)
    finally:
        process.kill()
        process.wait()
    assert done.returncode == 0, done.stderr
    ours = json.loads((tmp_path / "ours.json").read_text())["summary"]["overall"]["avg@1"]
    assert 0 < ours < 1  # the test can tell a right score from a wrong one

    command = done.stderr.split("bfcl-eval's own score of the first rollouts (make bfcl-eval-venv): ", 1)[1].strip()
    scored = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stdout + scored.stderr
    (score_file,) = (tmp_path / "bfcl" / "score-0" / BFCL_MODEL / "multi_turn").glob("*_score.json")
    header = json.loads(score_file.read_text().splitlines()[0])
    assert header["total_count"] == len(tasks)
    assert header["accuracy"] == ours, (header, ours)
    assert f"Accuracy: {100 * ours:.2f}%" in scored.stdout
