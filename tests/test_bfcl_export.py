"""Leaderboard parity: what our env scores equals bfcl-eval's own evaluation of the same responses.

`seeupo-eval --export-bfcl DIR` writes the episodes as bfcl-eval result files; bfcl-eval's
multi_turn_checker (in a spawned process: it `eval`s call strings) then scores those files, after
the decoding its prompting handlers apply (the `[f(a=1), ...]` list parsed with `ast`, each call
unparsed). Responses come from a scripted model server (the ground truth, or answers made wrong
in bfcl's own ways); the slow test uses the embedded model's own responses.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from bfcl_reference import official_verdicts, reference_process, variants
from test_openai_backend import _start

from seeupo_gym.bfcl.data import get_entry
from seeupo_gym.training.cli import eval_main

WRONG = ["last call left out", "first turn skipped", "first call repeated", "last turn reversed"]


def _decoded(result_file: Path) -> list[tuple[str, list[list[list[str]]]]]:
    """bfcl-eval's decoding of a prompting model's outputs: each `[...]` list into call strings."""
    cases = []
    for line in result_file.read_text().splitlines():
        record = json.loads(line)
        steps = [[[ast.unparse(call) for call in ast.parse(step, mode="eval").body.elts] for step in turn]
                 for turn in record["result"]]
        cases.append((record["id"], steps))
    return cases


def _script(task_id: str, steps: list[list[list[str]]]) -> tuple[str, list[dict]]:
    from seeupo_gym.bfcl.env import render_tool_action
    from seeupo_gym.tools import parse_hermes

    replies: list[dict] = []
    for turn in steps:
        for step in turn:
            parsed = parse_hermes(render_tool_action(list(step)).split("</think>")[-1])
            replies.append({"content": "", "tool_calls": [[c.name, dict(c.arguments)] for c in parsed.calls]})
        replies.append({"content": "Done."})
    return get_entry(task_id).user_messages[0], replies


def _verdicts_agree(folder: Path, rollouts: list[dict]) -> None:
    ours = {r["task_id"]: r["reward"] for r in rollouts}
    cases = [case for path in sorted(folder.rglob("*_result.json")) for case in _decoded(path)]
    assert sorted(task for task, _ in cases) == sorted(ours)
    # bfcl-eval's runner fails a result with fewer turns than the ground truth as force-terminated
    # before its checker runs (`_evaluate_single_multi_turn_entry`); the checker sees the others.
    complete = [(task_id, steps) for task_id, steps in cases if len(steps) == get_entry(task_id).num_user_turns]
    with reference_process() as pool:
        official = dict(zip([task_id for task_id, _ in complete], pool.submit(official_verdicts, complete).result()))
    for task_id, _ in cases:
        valid, error_type, _ = official.get(task_id, (False, "multi_turn:force_terminated", -1))
        assert (ours[task_id] == 1.0) == valid, (task_id, error_type)


def test_our_scores_equal_bfcl_evals_own_on_the_exported_result_files(tmp_path):
    entries = [f"multi_turn_{category}_{index}" for category in ("base", "miss_func", "miss_param", "long_context")
               for index in (0, 1)]
    script = {}
    for number, task_id in enumerate(entries):
        cases = variants(get_entry(task_id).ground_truth)
        name = "ground truth" if number % 2 == 0 else WRONG[number // 2 % len(WRONG)]
        marker, replies = _script(task_id, cases[name])
        script[marker] = replies
    process, url = _start(tmp_path, script)
    try:
        code = eval_main([
            "--base-url", url + "/v1", "--model", "scripted", "--env", "seeupo/BFCL-v4-v0",
            "--env-kwargs", json.dumps({"action_format": "tools", "split": "all", "max_turns": 20}),
            "--tasks", ",".join(entries), "--rollouts", str(tmp_path / "rollouts.jsonl"),
            "--export-bfcl", str(tmp_path / "bfcl"), "--no-progress",
        ])
    finally:
        process.kill()
        process.wait()
    assert code == 0
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    rewards = sorted(r["reward"] for r in rollouts)
    assert rewards.count(1.0) >= 4 and rewards.count(0.0) >= 1  # both verdicts are exercised
    assert len(list((tmp_path / "bfcl" / "rollout-0").glob("*_result.json"))) == 4  # one file per category
    _verdicts_agree(tmp_path / "bfcl", rollouts)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_our_scores_equal_bfcl_evals_own_on_the_embedded_models_responses(tmp_path):
    entries = [f"multi_turn_{category}_{index}" for category in ("base", "miss_func", "miss_param", "long_context")
               for index in range(10)]
    code = eval_main([
        "--model", "embedded", "--env", "seeupo/BFCL-v4-v0", "--tasks", ",".join(entries),
        "--env-kwargs", json.dumps({"split": "all", "max_turns": 3}), "--max-new-tokens", "64",
        "--rollouts", str(tmp_path / "rollouts.jsonl"), "--export-bfcl", str(tmp_path / "bfcl"), "--no-progress",
    ])
    assert code == 0
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 40
    _verdicts_agree(tmp_path / "bfcl", rollouts)
