"""The run's episodes, recorded for people: `rollouts.jsonl.gz` in the run folder.

One JSON line per episode (schema in docs/rollouts.md): its ids, task, reward, and turn by turn the
context delta (the text the context gained since the previous turn's response; the first turn holds
the whole prompt), the response, the tool calls the env accepted, the messages the env answered
with, and what the update did with the turn: the advantage A_i, and for SeeUPO the weight M_i of
turn t's pool and the ratio s(y_{i,t}) M was multiplied by after it.

Compact for long runs: contexts are stored as deltas (a context holds the previous turn's context
and response, so storing it whole would grow with the square of the turns), and each step is
appended as its own gzip member (the G rollouts of a group share their long first prompt, which
gzip stores about once). A run killed mid-write loses at most the last step's member: the reader
keeps every complete line before it.

`seeupo-view` (view.py) renders these records; `seeupo-export RUN_DIR --format jsonl|hf` writes them
as a dataset.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from seeupo_gym.algorithms.base import UpdatePhase
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory
from seeupo_gym.text import valid_unicode
from seeupo_gym.training.run_files import open_run_file, write_run_bytes

logger = logging.getLogger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl.gz"
SCHEMA = "seeupo-rollout/1"
EXPORT_FORMATS = ("jsonl", "hf")

# ------------------------------------------------------------------------------------ records


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _text(value: Any) -> str:
    # Model text may hold lone surrogates: escaped, so the record encodes as UTF-8 (and stays so
    # when read back: a JSON "\\ud800" escape would bring the surrogate back).
    return valid_unicode(value if isinstance(value, str) else str(value))


def _float(value: Any) -> float | None:
    # JSON has no NaN / Infinity: a value that is not finite is recorded as null.
    return float(value) if value is not None and math.isfinite(float(value)) else None


def _turn_messages(messages: Sequence[dict[str, Any]], turns: int) -> list[tuple[dict[str, Any] | None, list[dict[str, Any]]]]:
    """Per turn: the env's assistant message for it and the messages it answered with (user or tool).

    Every env appends one assistant message per step; an episode that ended early (an env error,
    the last step of an env that adds nothing when done) has fewer, and those turns get none.
    """
    starts = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    out: list[tuple[dict[str, Any] | None, list[dict[str, Any]]]] = []
    for t in range(turns):
        if t >= len(starts):
            out.append((None, []))
            continue
        end = starts[t + 1] if t + 1 < len(starts) else len(messages)
        out.append((messages[starts[t]], [m for m in messages[starts[t] + 1 : end] if isinstance(m, dict)]))
    return out


def _tool_calls(message: dict[str, Any] | None) -> list[dict[str, str]]:
    calls = []
    for call in (message or {}).get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", {})
        calls.append({
            "name": _text(function.get("name", "")),
            # A JSON string: arguments differ in shape from call to call, a dataset column cannot.
            "arguments": _text(arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, default=str)),
        })
    return calls


def _update_values(schedule: Sequence[UpdatePhase]) -> tuple[dict[str, float], dict[tuple[str, int], dict[str, Any]]]:
    """From an algorithm's phases: A_i per rollout, and per (rollout, turn) SeeUPO's M, ratio and the
    position of the turn's pool in the update order.

    A phase over every turn (`turn=None`: GRPO, GSPO, PPO) weighs trajectory i by its advantage; a
    per-turn phase (SeeUPO) by M_i, which starts as the normalized advantage: so A_i is the weight
    of the first phase that holds i.
    """
    advantage: dict[str, float] = {}
    per_turn: dict[tuple[str, int], dict[str, Any]] = {}
    for order, phase in enumerate(schedule):
        for rid in phase.rollout_ids:
            weight = phase.weights.get(rid)
            if weight is not None and rid not in advantage:
                advantage[rid] = float(weight)
            if phase.turn is not None:
                per_turn[(rid, phase.turn)] = {
                    "m": _float(weight),
                    "ratio": _float(phase.ratios_after.get(rid)),
                    "update_order": order + 1,
                }
    return advantage, per_turn


def episode_record(
    trajectory: Trajectory, tokenizer: Any, *, step: int, advantage: float | None = None,
    per_turn: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One episode as a JSON-ready record (schema `SCHEMA`, docs/rollouts.md)."""
    info = trajectory.info or {}
    messages = info.get("messages") or []
    actions = info.get("actions") or []
    per_turn = per_turn or {}
    turns = []
    previous: list[int] = []  # the previous turn's context + response
    for t, (turn, (assistant, answered)) in enumerate(zip(trajectory.turns, _turn_messages(messages, len(trajectory.turns))), start=1):
        kept = _common_prefix(previous, turn.context_ids)
        response = actions[t - 1] if t - 1 < len(actions) else tokenizer.decode(turn.response_ids, skip_special_tokens=False)
        values = per_turn.get(t, {})
        turns.append({
            "t": t,
            "context_tokens": len(turn.context_ids),
            # Tokens of the previous context + response this context starts with: all of them unless
            # the context was rebuilt (e.g. earlier <think> blocks dropped).
            "context_kept_tokens": kept,
            "context_delta": _text(tokenizer.decode(turn.context_ids[kept:], skip_special_tokens=False)),
            "response": _text(response),
            "response_tokens": len(turn.response_ids),
            "finish_reason": str(turn.finish_reason),
            "tool_calls": _tool_calls(assistant),
            "observation": [
                {"role": _text(m.get("role", "")), "name": _text(m.get("name", "") or ""), "content": _text(m.get("content", ""))}
                for m in answered
            ],
            "advantage": _float(advantage),
            "m": values.get("m"),
            "ratio": values.get("ratio"),
            "update_order": values.get("update_order"),
        })
        previous = list(turn.context_ids) + list(turn.response_ids)
    return {
        "schema": SCHEMA,
        "step": int(step),
        "rollout_id": _text(trajectory.rollout_id),
        "group_id": _text(trajectory.group_id),
        "task_id": _text(trajectory.task_id),
        "reward": _float(trajectory.reward),
        "success": bool(trajectory.success),
        "truncated": bool(trajectory.truncated),
        "end": _text(info.get("end", "")),
        "error": _text(info.get("error", "")),
        "advantage": _float(advantage),
        "num_turns": len(turns),
        "turns": turns,
    }


def batch_records(batch: RolloutBatch, tokenizer: Any, *, step: int, schedule: Sequence[UpdatePhase] = ()) -> list[dict[str, Any]]:
    """A step's episodes, with what the update (its `schedule`) did with each; episodes the update
    left out (flat groups, truncated) have null advantages."""
    advantage, per_turn = _update_values(schedule)
    records = []
    for trajectory in batch:
        rid = trajectory.rollout_id
        turns = {t: per_turn[(rid, t)] for t in range(1, trajectory.num_turns + 1) if (rid, t) in per_turn}
        records.append(episode_record(trajectory, tokenizer, step=step, advantage=advantage.get(rid), per_turn=turns))
    return records


# ------------------------------------------------------------------------------------ the file


class RolloutLog:
    """Appends each step's episodes to `<run folder>/rollouts.jsonl.gz`, one gzip member per step."""

    def __init__(self, run_dir: str | Path, tokenizer: Any) -> None:
        self.path = Path(run_dir) / ROLLOUTS_FILE
        self.tokenizer = tokenizer

    def write(self, batch: RolloutBatch, *, step: int, schedule: Sequence[UpdatePhase] = ()) -> None:
        records = batch_records(batch, self.tokenizer, step=step, schedule=schedule)
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with open_run_file(self.path, "ab") as f:
            f.write(gzip.compress(text.encode("utf-8")))

    def truncate(self, last_step: int) -> None:
        """Keep the steps up to `last_step` (a resumed run goes on from its checkpoint)."""
        if not self.path.exists():
            return
        kept = [r for r in read_rollouts(self.path) if r.get("step", 0) <= last_step]
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
        tmp = self.path.with_suffix(".tmp")
        write_run_bytes(tmp, gzip.compress(text.encode("utf-8")))
        tmp.replace(self.path)  # replaces a link itself, never its target


def rollouts_path(run_dir: str | Path) -> Path:
    """The rollouts file of a run folder (or the file itself), with a clear error when there is none."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / ROLLOUTS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no recorded rollouts at {path}: runs write {ROLLOUTS_FILE} in their folder (log.output_dir) unless "
            "log.rollouts=false"
        )
    return path


def read_rollouts(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The recorded episodes in order. A damaged tail (a run killed mid-write) ends the reading with a
    warning; a line that is not a JSON object is skipped."""
    path = rollouts_path(run_dir)
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        try:
            for number, line in enumerate(f, start=1):
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):  # RecursionError: a record nested past the parser's depth
                    logger.warning("%s: line %d is not JSON (or nested too deeply); skipped", path, number)
                    continue
                if isinstance(record, dict):
                    yield record
        except (EOFError, OSError, zlib.error) as error:
            logger.warning("%s: the file ends in a damaged step (%s); the episodes before it are read", path, error)


# ------------------------------------------------------------------------------------ export


def dataset_features() -> Any:
    """The episode schema as Hugging Face `datasets` features (docs/rollouts.md)."""
    from datasets import Features, List, Value

    turn = {
        "t": Value("int32"),
        "context_tokens": Value("int64"),
        "context_kept_tokens": Value("int64"),
        "context_delta": Value("string"),
        "response": Value("string"),
        "response_tokens": Value("int64"),
        "finish_reason": Value("string"),
        "tool_calls": List({"name": Value("string"), "arguments": Value("string")}),
        "observation": List({"role": Value("string"), "name": Value("string"), "content": Value("string")}),
        "advantage": Value("float64"),
        "m": Value("float64"),
        "ratio": Value("float64"),
        "update_order": Value("int32"),
    }
    return Features({
        "schema": Value("string"),
        "step": Value("int64"),
        "rollout_id": Value("string"),
        "group_id": Value("string"),
        "task_id": Value("string"),
        "reward": Value("float64"),
        "success": Value("bool"),
        "truncated": Value("bool"),
        "end": Value("string"),
        "error": Value("string"),
        "advantage": Value("float64"),
        "num_turns": Value("int32"),
        "turns": List(turn),
    })


def export_rollouts(run_dir: str | Path, out: str | Path, fmt: str = "jsonl") -> Path:
    """Write a run's episodes as a dataset: `jsonl` (one plain JSON line per episode) or `hf` (a
    `datasets.Dataset` saved with `save_to_disk`, load it with `datasets.load_from_disk`)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"--format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    records = list(read_rollouts(run_dir))
    out = Path(out)
    if fmt == "jsonl":
        out.parent.mkdir(parents=True, exist_ok=True)
        with open_run_file(out, "w") as f:  # by default beside the run's own rollouts
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        return out
    try:
        from datasets import Dataset
    except ImportError:
        raise ImportError("--format hf needs the `datasets` package (pip install 'seeupo-gym[trl]' or datasets)") from None
    features = dataset_features()
    rows = [{key: record.get(key) for key in features} for record in records]
    for row in rows:
        row["turns"] = [{key: turn.get(key) for key in features["turns"].feature} for turn in row["turns"] or []]
    Dataset.from_list(rows, features=features).save_to_disk(str(out))
    return out
