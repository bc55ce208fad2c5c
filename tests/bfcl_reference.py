"""bfcl-eval's official multi_turn_checker, run as the reference our scoring must agree with.

It `eval`s call strings and leaves state in its process (mpmath precision, long-context module
dicts it mutates, its instance cache), so it runs in a spawned process of its own, on strings
that only tests write (ground truth and rearrangements of it), never on model text.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

Steps = list[list[list[str]]]  # per user turn, per response, the call strings


def official_verdicts(cases: list[tuple[str, Steps]]) -> list[tuple[bool, str, int]]:
    """(valid, error_type, failing turn or -1) per (entry id, steps), by the official checker.
    The failing turn is the first prefix of turns the checker fails on."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils

    from seeupo_gym.bfcl.data import get_entry

    def run(entry, steps: Steps, turns: int) -> dict:
        model_name = f"reference_{uuid.uuid4().hex}"
        try:
            return multi_turn_checker.multi_turn_checker(
                steps[:turns], [list(calls) for calls in entry.ground_truth[:turns]], dict(entry.raw),
                f"multi_turn_{entry.category}", model_name,
            )
        finally:
            cache = vars(multi_turn_utils)
            for key in [key for key in cache if key.startswith(model_name)]:
                del cache[key]

    verdicts = []
    for task_id, steps in cases:
        entry = get_entry(task_id)
        result = run(entry, steps, entry.num_user_turns)
        failed = -1
        if not result["valid"]:
            failed = next(turns - 1 for turns in range(1, entry.num_user_turns + 1) if not run(entry, steps, turns)["valid"])
        verdicts.append((bool(result["valid"]), str(result.get("error_type") or ""), failed))
    return verdicts


@contextmanager
def reference_process() -> Iterator[concurrent.futures.Executor]:
    """A spawned worker in which `official_verdicts` may run (its state dies with it)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def variants(ground_truth: tuple[tuple[str, ...], ...]) -> dict[str, Steps]:
    """The ground-truth replay and wrong (or merely rearranged) answers built from it."""
    turns = [list(calls) for calls in ground_truth]
    one_step = [[calls] if calls else [] for calls in turns]
    cases: dict[str, Steps] = {"ground truth": one_step}
    cases["one call per step"] = [[[call] for call in calls] for calls in turns]
    filled = [index for index, calls in enumerate(turns) if calls]
    if filled:
        last, first = filled[-1], filled[0]
        dropped = [list(step) for step in one_step]
        dropped[last] = [turns[last][:-1]] if len(turns[last]) > 1 else []
        cases["last call left out"] = dropped
        skipped = [list(step) for step in one_step]
        skipped[first] = []
        cases["first turn skipped"] = skipped
        repeated = [list(step) for step in one_step]
        repeated[first] = [turns[first], turns[first][:1]]
        cases["first call repeated"] = repeated
        reversed_ = [list(step) for step in one_step]
        reversed_[last] = [list(reversed(turns[last]))]
        cases["last turn reversed"] = reversed_
    if len(filled) >= 2:
        early = [list(step) for step in one_step]
        early[filled[0]] = [turns[filled[0]] + turns[filled[1]]]
        early[filled[1]] = []
        cases["second turn done early"] = early
    return cases
