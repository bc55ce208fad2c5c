"""The multi-turn smoke comparison runs through the CLI with the turn-level credit methods by name,
and its report ends with the winner line."""

from __future__ import annotations

import pytest

from seeupo_gym.training.compare.cli import main


@pytest.mark.slow
def test_multiturn_smoke_compare_names_a_winner(tmp_path):
    out = tmp_path / "cmp"
    code = main([
        "--config", "smoke-multiturn", "--algorithms", "seeupo,grpo,gigpo,mt_grpo", "--seeds", "0",
        "--eval-every", "0", "-k", "2", "--eval-tasks", "2", "--out", str(out), "--no-progress",
        "train.steps=2",
    ])
    assert code == 0
    lines = (out / "report.md").read_text().strip().splitlines()
    assert lines[-1].startswith("**Winner**: ")
    assert any(name in lines[-1] for name in ("seeupo", "grpo", "gigpo", "mt_grpo")) or "tie" in lines[-1]
