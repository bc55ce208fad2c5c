"""A regular (non-editable) install imported from the checkout's root, as the GPU check does; and the
wheel, installed into a fresh venv outside the checkout beside openai-agents, trains, saves a
checkpoint `from_pretrained` loads, and its envs run under async `make_vec` with gymnasium's defaults."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_package import project_free_python

ROOT = Path(__file__).resolve().parent.parent


def test_a_regular_install_into_a_fresh_target_imports_from_the_checkout_root(tmp_path):
    # this working tree's wheel, built offline from a copy (nothing written into the checkout)
    source = tmp_path / "src"
    for name in ("seeupo_gym", "agents", "algorithms", "pyproject.toml", "README.md", "LICENSE"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("seeupo_gym-*.whl"))
    assert {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()} == {"seeupo_gym", "seeupo_gym-0.1.0.dist-info"}
    target = tmp_path / "target"
    subprocess.run([*pip, "install", "-q", "--no-index", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    python = project_free_python(tmp_path / "venv")
    code = ("import sys, seeupo_gym.agents, seeupo_gym.algorithms, seeupo_gym.training.cli\n"
            "assert 'agents' not in sys.modules and 'algorithms' not in sys.modules\n"
            "print(seeupo_gym.agents.__name__)")
    env = {**os.environ, "PYTHONPATH": str(target)}
    for cwd in (ROOT, tmp_path):  # the checkout's root shadows the install; elsewhere the install itself
        result = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"from {cwd}: {result.stderr[-2000:]}"
        assert result.stdout.strip() == "seeupo_gym.agents"


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_wheel_installs_beside_openai_agents_trains_and_its_checkpoint_loads(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "fresh_install.py"), "--work", str(tmp_path)],
                            capture_output=True, text=True, timeout=2300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "wheel top-level names: seeupo_gym, seeupo_gym-0.1.0.dist-info" in out
    assert "/site-packages/agents/__init__.py | seeupo_gym.agents ->" in out  # both, side by side
    assert "from_pretrained: Qwen2ForCausalLM" in out
    assert "make_vec async (shared memory): seeupo/TurnBandit-v0 ok" in out
    assert "make_vec async (shared memory): seeupo/BFCL-v4-v0 ok" in out
    assert "fresh install: all checks passed" in out
