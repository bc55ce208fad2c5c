"""scripts/gpu_check.sh (the GPU check) and scripts/gpu_check_wheels.sh (what it carries), run on CPU:
its dry run at toy sizes along the real path (this tree's wheel installed into a fresh --target, run
from the repository root by an interpreter without the project), its table, a failing part, its time
budget, its one-line refusals; the bundle builder's guard of folders it did not make."""

from __future__ import annotations

import os
import shutil
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
                            timeout=timeout, cwd=tmp_path, env={**{k: v for k, v in os.environ.items() if k != "PY"}, **env})
    table = out / "table.tsv"
    rows = [line.split("\t") for line in table.read_text().splitlines()] if table.exists() else []
    return result, rows


def test_a_dry_run_of_two_parts_installs_the_wheel_first_passes_and_prints_one_table(tmp_path):
    result, rows = check("--dry-run", "--parts", "imports,update-7b-lora", tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert [(r[0], r[1]) for r in rows] == [("install", "ok"), ("imports", "ok"), ("update-7b-lora", "ok")]
    assert rows[0][3].startswith("installed ") and "cuda=False" in rows[1][3]
    # the update's figure: SeeUPO and GRPO each timed on the LoRA model
    assert rows[2][3].startswith("tiny LoRA, 2 traj") and "grpo" in rows[2][3] and "seeupo" in rows[2][3]
    # the dry run's interpreter has no project of its own: the install is in the fresh target
    python = tmp_path / "out" / "python" / "bin" / "python"
    assert "(" + str(python) + ")" in result.stdout.splitlines()[0]
    alone = subprocess.run([str(python), "-c", "import seeupo_gym"], cwd=tmp_path, capture_output=True, text=True)
    assert alone.returncode == 1 and "No module named 'seeupo_gym'" in alone.stderr
    assert (tmp_path / "out" / "site" / "seeupo_gym" / "agents" / "__init__.py").is_file()
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert table[0] == "| part | status | seconds | key figure |" and len(table) == 5
    assert result.stdout.splitlines()[-2].startswith("imports ") and "gpu check (dry run, CPU)" in result.stdout


def test_a_failing_part_is_a_row_and_the_exit_status_but_does_not_stop_the_next(tmp_path):
    # control: an interpreter that cannot import the project fails `imports`; `smoke` still runs (and fails)
    result, rows = check("--dry-run", "--parts", "imports,smoke", tmp_path=tmp_path, PY="/bin/false")
    assert result.returncode == 1
    assert [(r[0], r[1]) for r in rows] == [("install", "FAIL(1)"), ("imports", "FAIL(1)"), ("smoke", "FAIL(1)")]


def test_parts_past_the_budget_are_skipped_in_their_rows(tmp_path):
    result, rows = check("--dry-run", "--parts", "imports,tests", "--budget", "5", tmp_path=tmp_path)
    assert result.returncode == 0
    assert [(r[0], r[1], r[3]) for r in rows] == [(part, "skip", "out of budget (5 s)") for part in ("install", "imports", "tests")]


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


def test_a_dry_run_without_the_venv_names_what_to_run_in_one_line(tmp_path):
    # the script in a checkout that has no .venv
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tmp_path / "repo" / "scripts" / "gpu_check.sh")
    result = subprocess.run(["bash", str(tmp_path / "repo" / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=30, cwd=tmp_path,
                            env={k: v for k, v in os.environ.items() if k != "PY"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == ("gpu check: the dry run needs .venv (make venv), "
                                     "or PY=<a python with torch, transformers, accelerate>")


def test_the_real_run_without_a_bundle_names_what_builds_it_in_one_line(tmp_path):
    # /bin/true stands in for a python that sees CUDA (the check before the bundle's)
    result, rows = check("--wheels", str(tmp_path / "empty"), tmp_path=tmp_path, timeout=30, PY="/bin/true")
    assert result.returncode == 2 and rows == []
    assert result.stderr.strip() == (f"gpu check: no wheels in {tmp_path / 'empty'}; build them where there is network "
                                     "(bash scripts/gpu_check_wheels.sh) and carry that folder")


WHEELS = ROOT / "scripts" / "gpu_check_wheels.sh"


def test_the_bundle_builder_leaves_a_folder_of_someone_elses_files_untouched(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a wheel")
    result = subprocess.run(["bash", str(WHEELS), str(folder)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "holds files this script did not make" in result.stderr
    assert [p.name for p in folder.iterdir()] == ["notes.txt"] and (folder / "notes.txt").read_text() == "not a wheel"


def test_the_bundle_builder_prints_its_help_and_refuses_an_unknown_option():
    result = subprocess.run(["bash", str(WHEELS), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "gpu_check_wheels.sh DIR" in result.stdout and not (ROOT / "--help").exists()
    result = subprocess.run(["bash", str(WHEELS), "--frob"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "unknown option '--frob'" in result.stderr


def test_no_file_of_the_repository_names_a_registry_host_in_an_index_url():
    # pip's configured index (pip.conf, $PIP_INDEX_URL) is the user's choice, not the repository's
    found = subprocess.run(["git", "grep", "-nIiE", r"(index-url|find-links)[ =\"',]+https?://"], cwd=ROOT,
                           capture_output=True, text=True)
    assert found.returncode == 1, found.stdout


@pytest.mark.slow
def test_the_whole_dry_run_passes_on_cpu(tmp_path):
    result, rows = check("--dry-run", tmp_path=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    status = {r[0]: r[1] for r in rows}
    assert all(status[p] == "ok" for p in ("imports", "tests", "smoke", "update-1.5b", "update-7b-lora")), rows
    assert status["install"] == "ok"


@pytest.mark.slow
def test_the_wheel_bundle_fits_in_64_mib_ships_the_verl_configs_and_rebuilds_its_own_folder(tmp_path):
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp_path / "probe"),
                            "farama-notifications==0.0.6"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip("no package index reachable: the builder downloads wheels")
    out = tmp_path / "wheels"
    for attempt in range(2):  # the second run empties and refills the folder the first one made
        result = subprocess.run(["bash", str(WHEELS), str(out)], capture_output=True,
                                text=True, timeout=600, cwd=ROOT, env={**os.environ, "PY": sys.executable})
        assert result.returncode == 0, result.stderr[-2000:]
    wheels = list(out.glob("*.whl"))
    assert sum(w.stat().st_size for w in wheels) <= 64 * 2**20
    ours = next(w for w in wheels if w.name.startswith("seeupo_gym-"))
    names = zipfile.ZipFile(ours).namelist()
    assert "seeupo_gym/integrations/verl/config/experiment/paper_bfcl.yaml" in names
    assert all(w.name.endswith(("none-any.whl", "x86_64.whl")) for w in wheels)
