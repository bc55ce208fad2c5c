"""The wheel, installed into a fresh venv outside the checkout beside openai-agents, trains, saves a
checkpoint `from_pretrained` loads, and its envs run under async `make_vec` with gymnasium's defaults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
