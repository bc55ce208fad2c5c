"""bfcl-eval's official multi_turn_checker, run as the reference our scoring must agree with.

It `eval`s call strings and leaves state in its process (mpmath precision, long-context module
dicts it mutates, its instance cache), so it runs in a spawned process of its own. The checker
sees call strings that tests write (ground truth, rearrangements of it) or that our export
rebuilt from validated literals; bfcl's decoder sees the recorded model texts only when
`evaluable` finds nothing in them it would `eval`.
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.util
import multiprocessing
import os
import sys
import tempfile
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Steps = list[list[list[str]]]  # per user turn, per response, the call strings


def official_verdicts(cases: list[tuple[str, Steps]], failing_turn: bool = True) -> list[tuple[bool, str, int]]:
    """(valid, error_type, failing turn or -1) per (entry id, steps), by the official checker.
    The failing turn is the first prefix of turns the checker fails on (-1 without `failing_turn`)."""
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
        if not result["valid"] and failing_turn:
            failed = next(turns - 1 for turns in range(1, entry.num_user_turns + 1) if not run(entry, steps, turns)["valid"])
        verdicts.append((bool(result["valid"]), str(result.get("error_type") or ""), failed))
    return verdicts


def _prompting_decoder() -> tuple[Callable[[str], list[str]], Callable[[list], bool]]:
    """bfcl-eval's prompting decoder and its empty-response test, imported in this (spawned) process.
    Importing them creates bfcl's result folders under BFCL_PROJECT_ROOT (site-packages unless
    set: one in the temporary folder here), and imports its Java and JavaScript parsers, which need
    tree_sitter, not installed: stand-ins take their place (the Python decoder never calls them)."""
    os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(tempfile.gettempdir(), "seeupo-bfcl-reference"))
    for module, function in (("java_parser", "parse_java_function_call"), ("js_parser", "parse_javascript_function_call")):
        name = f"bfcl_eval.model_handler.parser.{module}"
        if name not in sys.modules and importlib.util.find_spec("tree_sitter") is None:
            stand_in = types.ModuleType(name)
            setattr(stand_in, function, None)
            sys.modules[name] = stand_in
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response
    from bfcl_eval.model_handler.utils import default_decode_execute_prompting

    return default_decode_execute_prompting, is_empty_execute_response


def runner_verdicts(records: list[dict]) -> list[tuple[bool, str, int]]:
    """bfcl-eval's eval runner on result-file records (`_evaluate_single_multi_turn_entry`): a result
    with fewer turns than the ground truth fails as force-terminated before the checker runs; each
    step is decoded with the prompting decoder, and a step that does not decode or decodes to no
    call is skipped; then the checker (`official_verdicts`) judges the decoded steps. Mirrored, not
    called: importing bfcl's eval_runner imports every API model client (anthropic, ...)."""
    from seeupo_gym.bfcl.data import get_entry

    default_decode_execute_prompting, is_empty_execute_response = _prompting_decoder()
    verdicts: dict[str, tuple[bool, str, int]] = {}
    complete = []
    for record in records:
        if len(record["result"]) != get_entry(record["id"]).num_user_turns:
            verdicts[record["id"]] = (False, "multi_turn:force_terminated", -1)
            continue
        steps: Steps = []
        for turn in record["result"]:
            steps.append([])
            for output in turn:
                try:
                    calls = default_decode_execute_prompting(output)
                except Exception:  # noqa: BLE001  as bfcl's runner: an undecodable step is skipped
                    continue
                if not is_empty_execute_response(calls):
                    steps[-1].append(calls)
        complete.append((record["id"], steps))
    verdicts.update(zip([task_id for task_id, _ in complete], official_verdicts(complete, failing_turn=False)))
    return [verdicts[record["id"]] for record in records]


def raw_verdicts(records: list[dict]) -> list[tuple[bool, str, int] | None]:
    """bfcl-eval's runner on result records that hold the model's raw texts (as its own inference
    writes them): `runner_verdicts`, where every step is `evaluable` and every decoded call is a
    function of the entry's backends with literal arguments (so its checker's `eval` runs only
    those methods); None for a record that is not (its checker never sees it)."""
    from seeupo_gym.bfcl.calls import ActionError, parse_call_list
    from seeupo_gym.bfcl.data import function_docs, get_entry

    decode, _ = _prompting_decoder()
    safe = []
    for record in records:
        names = {doc.name for class_name in get_entry(record["id"]).involved_classes for doc in function_docs()[class_name]}
        try:
            for output in (output for turn in record["result"] for output in turn):
                if not evaluable(output):
                    raise ActionError("bfcl's decoder would eval it")
                try:
                    calls = decode(output)
                except Exception:  # noqa: BLE001  skipped by bfcl's runner
                    continue
                if not all(call.name in names for call in parse_call_list("[" + ", ".join(calls) + "]")):
                    raise ActionError("a call to no function of the entry")
            safe.append(record)
        except ActionError:
            continue
    judged = dict(zip([r["id"] for r in safe], runner_verdicts(safe)))
    return [judged.get(record["id"]) for record in records]


def bfcl_decodings(texts: list[str]) -> list[list[str] | None]:
    """bfcl-eval's own decoding of prompting-format outputs (`default_decode_execute_prompting`, what
    its eval runner applies to each step of a result file): the call strings, or None where it
    fails to decode (its runner then skips the step). Only texts that `evaluable` passed."""
    default_decode_execute_prompting, _ = _prompting_decoder()
    decoded: list[list[str] | None] = []
    for text in texts:
        try:
            decoded.append(list(default_decode_execute_prompting(text)))
        except Exception:  # noqa: BLE001  bfcl's runner skips a step it cannot decode
            decoded.append(None)
    return decoded


def evaluable(text: str) -> bool:
    """Whether bfcl's decoder may see `text`: it `eval`s arithmetic and lambdas among the arguments,
    so a text holding any is never given to it (its decoder's own preparation, then `ast`)."""
    text = text.strip("`\n ")
    text = ("" if text.startswith("[") else "[") + text + ("" if text.endswith("]") else "]")
    try:
        tree = ast.parse(text.strip().strip("'"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return True  # bfcl's own ast.parse fails the same way, before any eval
    return not any(isinstance(node, (ast.BinOp, ast.Lambda)) for node in ast.walk(tree))


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
