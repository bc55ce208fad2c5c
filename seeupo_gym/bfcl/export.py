"""Episodes as bfcl-eval result files, so bfcl-eval's own evaluation can score what our env scored.

bfcl-eval reads, per model and category, `<result dir>/<model>/multi_turn/BFCL_v4_multi_turn_<category>_result.json`:
one JSON object per line, `{"id": ..., "result": [per user turn: [per response: the model's output]]}`. We write each
response's output in the prompting format its default decoder parses, `"[f(a=1), g(b='x')]"`,
built from the calls that ran in our env (validated values, never the model's text). An episode
cut short holds only its finished user turns, which bfcl-eval fails as force-terminated, as our
env scores truncation 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from seeupo_gym.bfcl.data import category_of
from seeupo_gym.bfcl.env import BFCLEnv

RESULT_FILE = "BFCL_v4_multi_turn_{category}_result.json"
# The model folder bfcl-eval's `evaluate` reads the files under (`--model`): a *prompting* model,
# because each step is written as the prompting decoder's call list (an `-FC` model's results are
# lists of {name: arguments} objects, and our strings decode there as empty turns: 0%). Of the
# prompting models, one whose handler decodes with bfcl's default prompting decoder, needs no local
# model (only an OpenAI client: OPENAI_API_KEY=dummy, nothing is sent) and has no "_" in its name
# (bfcl maps "_" in folder names back to "/"). `multi_turn/` is bfcl's own folder for the category.
BFCL_MODEL = "gpt-4o-2024-11-20"
RESULT_SUBDIR = "multi_turn"


def result_dir(folder: str | Path, rollout: int) -> Path:
    """The `--result-dir` of the r-th rollout of each task: bfcl-eval scores one result per id."""
    return Path(folder) / f"rollout-{rollout}"


def bfcl_evaluate_command(folder: str | Path, rollout: int = 0, bfcl: str = "bfcl") -> str:
    """The command that scores the r-th rollouts with bfcl-eval's own CLI (`make bfcl-eval-venv`
    gives `.venv-bfcl/bin/bfcl`); `--partial-eval`: only the exported entries are scored."""
    import shlex

    results = result_dir(folder, rollout).resolve()
    return (f"OPENAI_API_KEY=dummy BFCL_PROJECT_ROOT={shlex.quote(str(results.parent / 'bfcl-root'))} "
            f"{bfcl} evaluate --model {BFCL_MODEL} --test-category multi_turn --partial-eval "
            f"--result-dir {shlex.quote(str(results))} --score-dir {shlex.quote(str(results.parent / f'score-{rollout}'))}")


def result_record(task_id: str, actions: Iterable[str], env_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The result line of one episode: its actions replayed in a fresh env (BFCL is deterministic)."""
    kwargs = {k: v for k, v in dict(env_kwargs or {}).items() if k not in ("categories", "split")}
    env = BFCLEnv(categories=(category_of(task_id),), split="all", **kwargs)
    try:
        env.reset(options={"task_id": task_id})
        for action in actions:
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
        steps = env.calls_per_turn
    finally:
        env.close()
    return {"id": task_id, "result": [["[" + ", ".join(calls) + "]" for calls in turn] for turn in steps]}


def write_results(rollouts: Iterable[Mapping[str, Any]], folder: str | Path, env_kwargs: Mapping[str, Any] | None = None) -> list[Path]:
    """Write the rollouts (`task_id`, `actions`; seeupo-eval's `--rollouts` records) as result files
    in bfcl-eval's layout, `folder/rollout-<r>/<BFCL_MODEL>/multi_turn/BFCL_v4_multi_turn_<category>_result.json`,
    the r-th rollout of each task under the r-th folder. Returns the files written."""
    seen: dict[str, int] = {}
    by_file: dict[Path, list[dict[str, Any]]] = {}
    for rollout in rollouts:
        task_id = str(rollout["task_id"])
        index = seen[task_id] = seen.get(task_id, -1) + 1
        path = result_dir(folder, index) / BFCL_MODEL / RESULT_SUBDIR / RESULT_FILE.format(category=category_of(task_id))
        by_file.setdefault(path, []).append(result_record(task_id, rollout["actions"], env_kwargs))
    for path, records in by_file.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as handle:
            for record in sorted(records, key=lambda r: int(r["id"].rsplit("_", 1)[1])):
                handle.write(json.dumps(record) + "\n")
    return sorted(by_file)
