"""BFCL's backends and checker, used without their hazards.

BFCL's own executor `eval`s the model's call strings, keeps every instance in module globals
under names built from the model name and test id (so runs under one name share state and the
cache only grows), and lets MathAPI set decimal's and mpmath's precision for the whole process.

- `EpisodeBackend` holds one episode's backend instances (GorillaFileSystem, TwitterAPI, ...),
  set up as BFCL sets them up, and dispatches validated `Call`s to their public methods
  itself: no `eval`, no module-global instance cache. Dropping the object frees the state.
- GorillaFileSystem's `cp` copies a folder shallowly (the copy shares the original's
  entries) and `mv` can share a folder's entries too, so a few calls per level double a shared
  tree: 30 levels hold 2^30 entries to every call that walks it (`du`, `find`) and to the
  checker's comparisons. Here a file system may hold at most `FILE_SYSTEM_BOUNDS` more entries
  and bytes than its scenario, counting a shared entry once per place it appears: a `cp` or
  `mv` that would pass the bound (or make a folder contain itself) is undone and reported, and
  the response's later calls do not run. A call that did not run is not replayed by the checker.
- `check_episode` runs BFCL's official `multi_turn_checker` on the call strings rebuilt from
  the validated calls (literals only), under a model name unique to the check, and then
  removes the instances the checker cached in BFCL's module globals, so nothing grows
  across episodes and no check sees another's state.

Only `bfcl_eval.eval_checker.multi_turn_eval` and the backend modules are imported; those
create no folders (`bfcl_eval.utils` / `model_handler` / `constants.eval_config` would).
"""

from __future__ import annotations

import contextlib
import copy
import decimal
import importlib
import inspect
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from seeupo_gym.bfcl.calls import ActionError, Call
from seeupo_gym.bfcl.data import Entry
from seeupo_gym.text import valid_unicode

_BACKEND_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
_BACKEND_MODULES: dict[str, str] = {
    "GorillaFileSystem": "gorilla_file_system",
    "MathAPI": "math_api",
    "MessageAPI": "message_api",
    "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}
# Backends BFCL builds without loading a scenario.
_STATELESS = frozenset({"MathAPI"})

# Arguments whose cost grows without bound (a huge integer power, a million-digit precision
# that also sets mpmath's process-wide precision). BFCL runs them as given; here a call over
# the bound is refused before anything runs. Ground truth stays far below.
ARGUMENT_BOUNDS: dict[tuple[str, str], float] = {
    ("power", "exponent"): 1_000,
    ("square_root", "precision"): 1_000,
    ("logarithm", "precision"): 1_000,
    ("round_number", "decimal_places"): 1_000,
}


# Entries (files and folders) and bytes of file content a GorillaFileSystem may hold beyond its
# scenario's own, each shared entry counted wherever it appears. At the bound a `du` or `find`
# walks 20,000 entries (milliseconds) and the checker compares as many.
FILE_SYSTEM_BOUNDS = (20_000, 8 * 2**20)
_SHARING_CALLS = frozenset({"cp", "mv"})  # the calls that can make a folder share entries


class FileSystemBoundError(ActionError):
    """A call would take a file system past its bounds; it was undone."""


def file_system_size(root: Any) -> tuple[int, int]:
    """(entries, bytes of file content) under `root`, a shared entry counted each place it
    appears: what a walk of the tree visits. Raises FileSystemBoundError on a folder that
    contains itself. Each distinct folder is measured once, so this costs the distinct
    entries, not the (possibly exponential) entries it counts."""
    sizes: dict[int, tuple[int, int]] = {}
    open_folders: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        contents = getattr(node, "contents", None)
        if not isinstance(contents, dict):  # a file
            sizes[key] = (1, len(str(getattr(node, "content", ""))))
            continue
        if children_done:
            open_folders.discard(key)
            entries, size = 1, 0
            for child in contents.values():
                child_entries, child_size = sizes[id(child)]
                entries, size = entries + child_entries, size + child_size
            sizes[key] = (entries, size)
            continue
        if key in open_folders:
            raise FileSystemBoundError("a folder would contain itself")
        open_folders.add(key)
        stack.append((node, True))
        for child in contents.values():
            if id(child) in open_folders:
                raise FileSystemBoundError("a folder would contain itself")
            stack.append((child, False))
    return sizes[id(root)]


def format_result(value: Any) -> str:
    """A call's return value as BFCL's executor reports it to the model (valid Unicode: a
    string the call built may hold lone surrogates, written then as escapes)."""
    if type(value) is str:
        return valid_unicode(value)
    if type(value) is dict:
        try:
            return json.dumps(value)  # ASCII: surrogates come out as escapes
        except (TypeError, ValueError):
            return valid_unicode(str(value))
    return valid_unicode(str(value))


class EpisodeBackend:
    """The backend instances of one episode of one entry."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.instances: dict[str, Any] = {}
        self._methods: dict[str, Any] = {}
        self.stop_reason = ""  # why `execute_within` left calls out ("" when all ran)
        for class_name in entry.involved_classes:
            module = importlib.import_module(f"{_BACKEND_PACKAGE}.{_BACKEND_MODULES[class_name]}")
            instance = getattr(module, class_name)()
            if class_name not in _STATELESS:
                scenario = copy.deepcopy(entry.initial_config.get(class_name, {}))
                instance._load_scenario(scenario, long_context=entry.long_context)
            self.instances[class_name] = instance
            # Public methods only; on a name clash the later class wins, as in BFCL's executor.
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self._methods[name] = method
        file_system = self.instances.get("GorillaFileSystem")
        self._fs_limits: tuple[int, int] | None = None
        if file_system is not None:
            entries, size = file_system_size(file_system.root)
            self._fs_limits = (entries + FILE_SYSTEM_BOUNDS[0], size + FILE_SYSTEM_BOUNDS[1])

    @property
    def method_names(self) -> frozenset[str]:
        return frozenset(self._methods)

    def check_call(self, call: Call) -> None:
        """Refuse a call that is unknown or over a resource bound. Raises ActionError."""
        method = self._methods.get(call.name)
        if method is None:
            raise ActionError(f"`{call.name}` is not an available function (see the Tools list)")
        bounded = [(param, limit) for (name, param), limit in ARGUMENT_BOUNDS.items() if name == call.name]
        if not bounded:
            return
        try:
            bound = inspect.signature(method).bind(*call.args, **dict(call.kwargs))
        except TypeError:
            return  # runs and fails with BFCL's own error message
        for param, limit in bounded:
            value = bound.arguments.get(param)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > limit:
                raise ActionError(f"{call.name}: {param} must be at most {limit:g} in absolute value")

    def execute_within(self, calls: tuple[Call, ...], seconds: float) -> list[str]:
        """Run checked calls in order, starting none after `seconds` of wall time: the results of
        the calls that ran (a prefix). Each call is cheap by the argument bounds and the file
        system's bounds; this bounds how many run, so a response of many slow-ish calls cannot
        hold a step for long. A call that would pass the file system's bounds is undone and
        ends the prefix; `stop_reason` says why calls were left out ("" when all ran)."""
        deadline = time.monotonic() + seconds
        results: list[str] = []
        self.stop_reason = ""
        for call in calls:
            if time.monotonic() >= deadline:
                self.stop_reason = f"a response's calls must start within {seconds:g} s"
                break
            try:
                results.append(self.execute(call))
            except FileSystemBoundError as error:
                self.stop_reason = f"{call.name}: {error}; it was undone"
                break
        return results

    def execute(self, call: Call) -> str:
        """Run one checked call; errors come back as text, as in BFCL's executor. Raises
        FileSystemBoundError (having undone the call) for one past the file system's bounds."""
        method = self._methods[call.name]
        file_system = self.instances.get("GorillaFileSystem")
        guarded = call.name in _SHARING_CALLS and file_system is not None and method.__self__ is file_system
        before = copy.deepcopy(vars(file_system)) if guarded else None  # keeps sharing; small by the bounds
        with self._math_precision_kept():
            try:
                result = format_result(method(*call.args, **dict(call.kwargs)))
            except Exception as error:  # a backend error is an observation, never a crash
                result = valid_unicode(f"Error during execution: {error}")
        if guarded:
            try:
                self._check_file_system(file_system)
            except FileSystemBoundError:
                vars(file_system).clear()
                vars(file_system).update(before)
                raise
        return result

    def _check_file_system(self, file_system: Any) -> None:
        assert self._fs_limits is not None
        entries, size = file_system_size(file_system.root)
        max_entries, max_bytes = self._fs_limits
        if entries > max_entries or size > max_bytes:
            raise FileSystemBoundError(
                f"the file system would hold {entries} entries and {size} bytes, counting each copy, over its bound "
                f"of {max_entries} entries and {max_bytes} bytes"
            )

    @contextlib.contextmanager
    def _math_precision_kept(self) -> Iterator[None]:
        """MathAPI sets decimal's and mpmath's precision for the whole thread/process; undo it
        after the call (and after its result is formatted) so other code is not affected."""
        if "MathAPI" not in self.instances:
            yield
            return
        import mpmath

        dps = mpmath.mp.dps
        try:
            with decimal.localcontext():
                yield
        finally:
            mpmath.mp.dps = dps


@dataclass
class CheckResult:
    """BFCL's verdict on an episode, plus which user turn failed."""

    valid: bool
    error_type: str | None = None
    error_message: str | None = None
    # "passed" / "failed" / "not_checked" per user turn (the checker stops at the first failure).
    turn_results: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def _run_checker(entry: Entry, decoded: list[list[list[str]]], num_turns: int) -> dict:
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils

    # BFCL caches instances in multi_turn_utils' globals under names built from the model name.
    # A fresh name per run keeps runs apart; the finally block removes them.
    model_name = f"seeupo_{uuid.uuid4().hex}"
    try:
        return multi_turn_checker.multi_turn_checker(
            decoded[:num_turns],
            [list(calls) for calls in entry.ground_truth[:num_turns]],
            entry.raw,
            f"multi_turn_{entry.category}",
            model_name,
        )
    except Exception as error:  # a checker crash scores 0 with the reason, never kills training
        return {"valid": False, "error_type": "seeupo:checker_error", "error_message": f"{type(error).__name__}: {error}"}
    finally:
        cache = vars(multi_turn_utils)
        for key in [key for key in cache if key.startswith(model_name)]:
            del cache[key]


def _small_details(result: dict, limit: int = 2_000) -> dict[str, str]:
    """The checker's reason in a few kB: long-context states are megabytes."""
    details = result.get("details") or {}
    kept = {}
    for key in ("differences", "missing_items"):
        if key in details:
            text = json.dumps(details[key], default=str)
            kept[key] = text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"
    return kept


def check_episode(entry: Entry, decoded: list[list[list[str]]]) -> CheckResult:
    """Score a finished episode with BFCL's multi_turn_checker.

    decoded[i] holds the steps of user turn i, each the list of call strings executed in one
    response (responses without calls are left out, as BFCL's evaluation does).
    """
    num_turns = entry.num_user_turns
    if len(decoded) != num_turns:
        raise ValueError(f"{entry.id}: {len(decoded)} turns of calls for {num_turns} user turns")
    result = _run_checker(entry, decoded, num_turns)
    if result.get("valid"):
        return CheckResult(valid=True, turn_results=["passed"] * num_turns)
    # The checker stops at the first failing turn without naming it: the first failing prefix does.
    failed_at = num_turns - 1
    for prefix in range(1, num_turns):
        if not _run_checker(entry, decoded, prefix).get("valid"):
            failed_at = prefix - 1
            break
    turn_results = ["passed"] * failed_at + ["failed"] + ["not_checked"] * (num_turns - failed_at - 1)
    return CheckResult(
        valid=False,
        error_type=result.get("error_type"),
        error_message=result.get("error_message"),
        turn_results=turn_results,
        details=_small_details(result),
    )
