"""Episodes as bfcl-eval result files, so bfcl-eval's own evaluation can score what our env scored.

bfcl-eval reads, per category, `BFCL_v4_multi_turn_<category>_result.json`: one JSON object per
line, `{"id": ..., "result": [per user turn: [per response: the model's output]]}`. We write each
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
    """Write the rollouts (`task_id`, `actions`; seeupo-eval's `--rollouts` records) as result files:
    `folder/rollout-<r>/BFCL_v4_multi_turn_<category>_result.json`, the r-th rollout of each task
    in the r-th folder (bfcl-eval scores one result per id). Returns the files written."""
    seen: dict[str, int] = {}
    by_file: dict[Path, list[dict[str, Any]]] = {}
    for rollout in rollouts:
        task_id = str(rollout["task_id"])
        index = seen[task_id] = seen.get(task_id, -1) + 1
        path = Path(folder) / f"rollout-{index}" / RESULT_FILE.format(category=category_of(task_id))
        by_file.setdefault(path, []).append(result_record(task_id, rollout["actions"], env_kwargs))
    for path, records in by_file.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as handle:
            for record in sorted(records, key=lambda r: int(r["id"].rsplit("_", 1)[1])):
                handle.write(json.dumps(record) + "\n")
    return sorted(by_file)
