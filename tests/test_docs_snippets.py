"""Every code block in README.md and docs/ marked runnable runs, so no snippet can rot.

A block is runnable when its fence says so after the language: ```` ```python run ```` (run by
the default suite) or ```` ```python run slow ```` (the slow suite: the embedded model, long
training). Each block runs on its own, in a fresh interpreter, in an empty folder of its own (so
`runs/...` in a block is that folder's), with the test's environment (offline hub, one torch thread).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\w+)([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)


def runnable_blocks() -> list[tuple[str, bool, str]]:
    """(where, slow, code) for each runnable block of the documentation."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = []
    for page in pages:
        text = page.read_text()
        for match in _FENCE.finditer(text):
            language, flags, code = match.group(1), match.group(2).split(), match.group(3)
            if language != "python" or "run" not in flags:
                continue
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((f"{page.relative_to(ROOT)}:{line}", "slow" in flags, code))
    return blocks


BLOCKS = runnable_blocks()


def test_the_documentation_has_runnable_blocks():
    # A guard against a fence format change silently leaving nothing to run.
    assert len(BLOCKS) >= 6, [where for where, _, _ in BLOCKS]
    assert any(where.startswith("README.md") for where, _, _ in BLOCKS)


@pytest.mark.parametrize(
    "code",
    [pytest.param(code, id=where, marks=[pytest.mark.slow] if slow else []) for where, slow, code in BLOCKS],
)
def test_runnable_block_runs(code, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
