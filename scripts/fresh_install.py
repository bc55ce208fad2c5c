"""Install the wheel into a fresh venv outside the repository, beside openai-agents, and use it.

    python scripts/fresh_install.py [--work DIR] [--keep]

Steps (each printed; the first failure stops the script with exit code 1):
1. export the committed tree (HEAD) to DIR/src and build the wheel there (nothing is
   written into the checkout); print the wheel's top-level names;
2. a fresh venv: the CPU torch first (a resolver choosing torch itself pulls a CUDA build),
   then the wheel and openai-agents (which installs a top-level `agents` package), then
   bfcl-eval without its declared deps, as the Makefile does;
3. in DIR/work: `seeupo-train --config tiny-turnbandit` for one step, then load the
   checkpoint with `AutoModelForCausalLM.from_pretrained(<checkpoint>/hf)`;
4. `gym.make_vec(..., vectorization_mode="async")` with gymnasium's defaults (shared memory)
   for TurnBandit and BFCL, and `gym.make("seeupo_gym:seeupo/TurnBandit-v0")` in a process
   that never imports seeupo_gym itself.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
BFCL_EVAL = "bfcl-eval==2026.3.23"

CHECK_NAMESPACES = """
import agents, seeupo_gym.agents, seeupo_gym.training.trainer
assert hasattr(agents, "Agent"), "top-level agents is not openai-agents"
assert seeupo_gym.agents.__name__ == "seeupo_gym.agents"
print("agents ->", agents.__file__, "| seeupo_gym.agents ->", seeupo_gym.agents.__file__)
"""

CHECK_CHECKPOINT = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder)
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer("Pick the fruit:", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=2, do_sample=False)
print("from_pretrained:", type(model).__name__, sum(p.numel() for p in model.parameters()), "parameters,",
      out.shape[1] - ids.shape[1], "new tokens")
"""

CHECK_MAKE_VEC = """
import gymnasium as gym
import seeupo_gym  # noqa: F401
for env_id, kwargs in (("seeupo/TurnBandit-v0", {"variant": "easy"}), ("seeupo/BFCL-v4-v0", {"max_turns": 2})):
    envs = gym.make_vec(env_id, 2, vectorization_mode="async", **kwargs)  # gymnasium's defaults
    try:
        observations, infos = envs.reset(seed=0)
        observations, rewards, terminated, truncated, infos = envs.step(["A", "B"])
        assert all(isinstance(o, str) and o for o in observations)
    finally:
        envs.close()
    print("make_vec async (shared memory):", env_id, "ok")
"""

CHECK_PREFIXED_ID = """
import gymnasium as gym, sys
env = gym.make("seeupo_gym:seeupo/TurnBandit-v0")
observation, info = env.reset(seed=0)
assert isinstance(observation, str)
print("gym.make('seeupo_gym:seeupo/TurnBandit-v0') ok")
"""


def run(command: list[str], cwd: Path | None = None) -> str:
    print("$", " ".join(str(c) for c in command), flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"failed (exit {result.returncode}): {' '.join(str(c) for c in command)}")
    print(f"  ok in {time.perf_counter() - started:.0f} s", flush=True)
    return result.stdout


def export_head(destination: Path) -> None:
    """The committed tree (HEAD): not others' half-done edits, untracked files or build/."""
    destination.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)


def wheel_top_level(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return sorted({name.split("/")[0] for name in archive.namelist()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", help="folder to work in (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the folder afterwards")
    args = parser.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="seeupo-fresh-"))
    work.mkdir(parents=True, exist_ok=True)
    if ROOT in (work.resolve(), *work.resolve().parents):
        raise SystemExit(f"--work {work} is inside the repository; pick a folder outside it")
    try:
        src, dist, venv, run_dir = work / "src", work / "dist", work / "venv", work / "work"
        export_head(src)
        run([sys.executable, "-m", "venv", "--clear", str(venv)])
        python = venv / "bin" / "python"
        run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"])
        run([str(python), "-m", "pip", "install", "-q", TORCH])
        run([str(python), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)])
        wheel = next(dist.glob("seeupo_gym-*.whl"))
        print("wheel top-level names:", ", ".join(wheel_top_level(wheel)))
        run([str(python), "-m", "pip", "install", "-q", str(wheel), "openai-agents"])
        run([str(python), "-m", "pip", "install", "-q", "--no-deps", BFCL_EVAL])
        print(run([str(python), "-c", CHECK_NAMESPACES], cwd=work), end="")

        run_dir.mkdir(exist_ok=True)
        shutil.rmtree(run_dir / "run", ignore_errors=True)  # a folder holds one run: a rerun starts a new one
        run([str(venv / "bin" / "seeupo-train"), "--config", "tiny-turnbandit", "train.steps=1",
             "log.output_dir=run", "log.progress_bars=false"], cwd=run_dir)
        checkpoint = run_dir / "run" / "checkpoints" / "step-1"
        print(run([str(python), "-c", CHECK_CHECKPOINT, str(checkpoint / "hf")], cwd=run_dir), end="")
        print(run([str(python), "-c", CHECK_MAKE_VEC], cwd=run_dir), end="")
        print(run([str(python), "-c", CHECK_PREFIXED_ID], cwd=run_dir), end="")
        print("fresh install: all checks passed")
        return 0
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
