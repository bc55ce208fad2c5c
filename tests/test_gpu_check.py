"""scripts/gpu_check.sh (the GPU check) and scripts/gpu_check_wheels.sh (what it carries), run on CPU:
its dry run at toy sizes, its table, a failing part, its time budget, and its one-line refusal without CUDA."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def check(*args: str, tmp_path: Path, timeout: float = 400, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                            timeout=timeout, cwd=ROOT, env={**os.environ, "PY": sys.executable, **env})
    table = out / "table.tsv"
    rows = [line.split("\t") for line in table.read_text().splitlines()] if table.exists() else []
    return result, rows


def test_a_dry_run_of_two_parts_passes_and_prints_one_table(tmp_path):
    result, rows = check("--dry-run", "--parts", "imports,update-7b-lora", tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert [(r[0], r[1]) for r in rows] == [("imports", "ok"), ("update-7b-lora", "ok")]
    assert "cuda=False" in rows[0][3]
    # the update's figure: SeeUPO and GRPO each timed on the LoRA model
    assert rows[1][3].startswith("tiny LoRA, 2 traj") and "grpo" in rows[1][3] and "seeupo" in rows[1][3]
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert table[0] == "| part | status | seconds | key figure |" and len(table) == 4
    assert result.stdout.splitlines()[-2].startswith("imports ") and "gpu check (dry run, CPU)" in result.stdout


def test_a_failing_part_is_a_row_and_the_exit_status_but_does_not_stop_the_next(tmp_path):
    # control: an interpreter that cannot import the project fails `imports`; `smoke` still runs (and fails)
    result, rows = check("--dry-run", "--parts", "imports,smoke", tmp_path=tmp_path, PY="/bin/false")
    assert result.returncode == 1
    assert [(r[0], r[1]) for r in rows] == [("imports", "FAIL(1)"), ("smoke", "FAIL(1)")]


def test_parts_past_the_budget_are_skipped_in_their_rows(tmp_path):
    result, rows = check("--dry-run", "--parts", "imports,tests", "--budget", "5", tmp_path=tmp_path)
    assert result.returncode == 0
    assert [(r[0], r[1], r[3]) for r in rows] == [("imports", "skip", "out of budget (5 s)"),
                                                  ("tests", "skip", "out of budget (5 s)")]


def test_without_cuda_the_real_run_says_so_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result, rows = check("--parts", "imports", tmp_path=tmp_path, timeout=120)
    assert result.returncode == 2 and rows == []
    assert result.stdout.strip().splitlines()[-1].startswith("gpu check: no CUDA device visible to")


def test_an_unknown_option_is_refused(tmp_path):
    result, _ = check("--frob", tmp_path=tmp_path, timeout=30)
    assert result.returncode == 2 and "unknown option '--frob'" in result.stderr


@pytest.mark.slow
def test_the_whole_dry_run_passes_on_cpu(tmp_path):
    result, rows = check("--dry-run", tmp_path=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    status = {r[0]: r[1] for r in rows}
    assert all(status[p] == "ok" for p in ("imports", "tests", "smoke", "update-1.5b", "update-7b-lora")), rows
    assert status["install"] == "skip"


@pytest.mark.slow
def test_the_wheel_bundle_fits_in_64_mib_and_ships_the_verl_configs(tmp_path):
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        pytest.skip("no network: the builder downloads wheels")
    out = tmp_path / "wheels"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check_wheels.sh"), str(out)], capture_output=True,
                            text=True, timeout=600, cwd=ROOT, env={**os.environ, "PY": sys.executable})
    assert result.returncode == 0, result.stderr[-2000:]
    wheels = list(out.glob("*.whl"))
    assert sum(w.stat().st_size for w in wheels) <= 64 * 2**20
    ours = next(w for w in wheels if w.name.startswith("seeupo_gym-"))
    names = zipfile.ZipFile(ours).namelist()
    assert "seeupo_gym/integrations/verl/config/experiment/paper_bfcl.yaml" in names
    assert all(w.name.endswith(("none-any.whl", "x86_64.whl")) for w in wheels)
