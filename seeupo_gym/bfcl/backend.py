"""BFCL's backends and scoring, used without their hazards.

BFCL's own executor `eval`s call strings (the model's and the ground truth's), keeps every
instance in module globals under names built from the model name and test id (so concurrent
checks of one entry race on that cache, and it only grows), and lets MathAPI set decimal's and
mpmath's precision for the whole process.

- `EpisodeBackend` holds one episode's backend instances (GorillaFileSystem, TwitterAPI, ...),
  set up as BFCL sets them up, and dispatches validated `Call`s to their public methods
  itself: no `eval`, no module-global instance cache. Dropping the object frees the state.
  Argument names must be parameters of the function (a model-written name never reaches
  anything but a dict key), and the arguments of `ARGUMENT_BOUNDS` are bounded whether given
  as numbers or as numeric strings; a string mpmath reads as a number (`MPMATH_STRINGS`) may
  have exponents of at most `MAX_INT_DIGITS` digits. MessageAPI's `send_message` is an error
  once `MESSAGE_IDS_GIVEN_LIMIT` message ids are given (at 90,000 it would loop forever).
- Process-global state a backend call may write (mpmath's precision, decimal's context,
  vehicle_control's long-context weather dict) is saved before and restored after every call,
  under one process-wide lock, so concurrent episodes neither see nor keep each other's settings.
  Long-context TravelAPI instances would share bfcl-eval's module-level card and booking dicts
  (and mutate them); each instance gets private copies instead.
- GorillaFileSystem's `cp` copies a folder shallowly (the copy shares the original's
  entries) and `mv` can share a folder's entries too, so a few calls per level double a shared
  tree: 30 levels hold 2^30 entries to every call that walks it (`du`, `find`) and to the
  checker's comparisons. Here a file system may hold at most `FILE_SYSTEM_BOUNDS` more entries
  and bytes than its scenario, counting a shared entry once per place it appears: a `cp` or
  `mv` that would pass the bound (or make a folder contain itself) is undone and reported, and
  the response's later calls do not run. A call that did not run is not replayed when scoring.
- `check_episode` scores an episode as BFCL's `multi_turn_checker` does, without its executor:
  it replays the model's validated calls and the ground truth's calls (parsed with `ast`, see
  `ground_truth_calls`) on two fresh `EpisodeBackend`s, turn by turn, and calls bfcl-eval's own
  `state_checker` and `response_checker` on them. Its verdicts equal the official checker's on
  every ground-truth replay (tests/test_bfcl_scoring.py).

Only `bfcl_eval.eval_checker.multi_turn_eval` and the backend modules are imported; those
create no folders (`bfcl_eval.utils` / `model_handler` / `constants.eval_config` would).
"""

from __future__ import annotations

import contextlib
import copy
import decimal
import functools
import importlib
import inspect
import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Iterator

from seeupo_gym.bfcl.calls import MAX_INT_DIGITS, ActionError, Call, parse_call_list
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

# Arguments mpmath reads as numbers, strings included ("1e5", "3/4", "1+2j"). It builds a
# string's 10**exponent by repeated squaring, at a cost growing with the exponent's digits
# (MathAPI.logarithm: 0.6 s for 1,000 digits, 32 s for 4,250, at any precision). A string here
# may have exponents of at most MAX_INT_DIGITS digits, as integers may; ground truth passes numbers.
MPMATH_STRINGS: frozenset[tuple[str, str]] = frozenset({("logarithm", "value"), ("logarithm", "base")})
# An exponent as mpmath finds it, after dropping what it or float() ignore (spaces, underscores);
# \d is every digit int() reads, fullwidth ones included.
_EXPONENT = re.compile(r"e[+-]?(\d+)", re.IGNORECASE)


def _longest_exponent(text: str) -> int:
    """The digits of the largest exponent in a numeric string (leading zeros not counted)."""
    compact = re.sub(r"[\s_]", "", text)
    return max((len(digits.lstrip("0")) for digits in _EXPONENT.findall(compact)), default=0)


# MessageAPI draws each message id at random from 10000..99999 until it finds one not yet given:
# with all 90,000 given, `send_message` loops forever (each call is a model's choice; 64 a
# response). Here it is an error once this many are given (a draw then takes 90 tries at most).
MESSAGE_IDS_GIVEN_LIMIT = 89_000


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


def result_text(value: Any) -> str:
    """A call's return value as text, exactly as BFCL's executor writes it (what scoring compares)."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def format_result(value: Any) -> str:
    """A call's return value as the model sees it: BFCL's text, in valid Unicode (a string the
    call built may hold lone surrogates, written then as escapes)."""
    return valid_unicode(result_text(value))


def _numeric(value: Any) -> float | None:
    """The number a bounded argument stands for: an int or float, or a string the backend would
    turn into one (mpmath reads `precision='200000'` as 200000). None when it is no number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # also what int() accepts: signs, spaces, underscores, other digits
        except (ValueError, OverflowError):
            return None
    return None


# The process-global state a backend call may write: mpmath's precision (MathAPI.logarithm),
# decimal's context (MathAPI.square_root; per thread) and a dict of vehicle_control's module
# that its long-context weather call overwrites and returns. One lock for all: the calls are
# bounded to milliseconds, and a save/restore pair is only sound if no other thread runs between.
_PROCESS_STATE_LOCK = threading.Lock()


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Run a backend call with the process-global state it may write saved and restored after it
    (after its result is formatted: mpmath formats at the precision the call set)."""
    import mpmath
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import vehicle_control

    with _PROCESS_STATE_LOCK:
        dps = mpmath.mp.dps
        weather = vehicle_control.LONG_WEATHER_EXTENSION
        saved_weather = dict(weather)
        try:
            with decimal.localcontext():
                yield
        finally:
            mpmath.mp.dps = dps
            if weather != saved_weather:
                weather.clear()
                weather.update(saved_weather)


@functools.cache
def _parameter_names(cls: type, name: str) -> frozenset[str]:
    """The parameters a backend method takes (the same names as its BFCL function doc)."""
    return frozenset(inspect.signature(getattr(cls, name)).parameters) - {"self"}


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
                if entry.long_context:
                    # TravelAPI's long-context setup puts bfcl-eval's module-level dicts into the
                    # instance, which its calls then mutate: private copies keep episodes apart.
                    vars(instance).update(copy.deepcopy(vars(instance)))
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
            raise ActionError(f"`{valid_unicode(call.name[:100])}` is not an available function (see the Tools list)")
        # A model-written name stays a dict key here, but it would be code to any executor that
        # builds call strings: only the function's own parameter names pass.
        parameters = _parameter_names(type(method.__self__), call.name)
        unknown = [name for name, _ in call.kwargs if name not in parameters]
        if unknown:
            shown = ", ".join(repr(valid_unicode(str(name)[:100])) for name in unknown[:5])
            raise ActionError(f"{call.name}: unknown argument(s) {shown}; it takes {', '.join(sorted(parameters)) or 'none'}")
        bounded = [(param, limit) for (name, param), limit in ARGUMENT_BOUNDS.items() if name == call.name]
        read_by_mpmath = [param for name, param in MPMATH_STRINGS if name == call.name]
        if not bounded and not read_by_mpmath:
            return
        try:
            bound = inspect.signature(method).bind(*call.args, **dict(call.kwargs))
        except TypeError:
            return  # runs and fails with BFCL's own error message
        for param, limit in bounded:
            number = _numeric(bound.arguments.get(param))
            if number is not None and not abs(number) <= limit:  # also NaN and infinities
                raise ActionError(f"{call.name}: {param} must be at most {limit:g} in absolute value")
        for param in read_by_mpmath:
            value = bound.arguments.get(param)
            if isinstance(value, str) and _longest_exponent(value) > MAX_INT_DIGITS:
                raise ActionError(f"{call.name}: {param} has an exponent of more than {MAX_INT_DIGITS} digits")

    def named(self, call: Call) -> Call:
        """The call with its positional arguments passed by name (the method's own parameter names),
        which runs the same; unchanged when they do not bind. bfcl-eval's decoder of call strings
        keeps keyword arguments only, so result files must hold these."""
        method = self._methods.get(call.name)
        if method is None or not call.args:
            return call
        signature = inspect.signature(method)
        if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in signature.parameters.values()):
            return call
        try:
            bound = signature.bind(*call.args, **dict(call.kwargs))
        except TypeError:
            return call  # it failed when it ran, with the method's own error
        return Call(name=call.name, kwargs=tuple(bound.arguments.items()))

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
        result = valid_unicode(self.run(call))
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

    def run(self, call: Call) -> str:
        """Run one call and return its result as BFCL's executor writes it (errors as text,
        "Error during execution: ..."); process-global state is restored after it."""
        method = self._methods.get(call.name)
        if method is None:  # BFCL's eval would raise NameError; the env refuses such calls first
            return f"Error during execution: name '{call.name}' is not defined"
        if call.name == "send_message" and len(getattr(method.__self__, "generated_ids", ())) >= MESSAGE_IDS_GIVEN_LIMIT:
            return (f"Error during execution: {MESSAGE_IDS_GIVEN_LIMIT} message ids are given, "
                    "the most this message API gives; no message was sent")
        # Fresh values per call, as `eval` of a call string makes them: a backend keeps the lists
        # it is given (a tweet's `mentions`) and mutates them later, which must not reach the
        # `Call` (replayed when scoring) or the cached ground truth.
        args, kwargs = copy.deepcopy((call.args, dict(call.kwargs)))
        with _process_state_kept():
            try:
                return result_text(method(*args, **kwargs))
            except Exception as error:  # a backend error is an observation, never a crash
                return f"Error during execution: {error}"


@dataclass
class CheckResult:
    """BFCL's verdict on an episode, plus which user turn failed."""

    valid: bool
    error_type: str | None = None
    error_message: str | None = None
    # "passed" / "failed" / "not_checked" per user turn (the checker stops at the first failure).
    turn_results: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def ground_truth_calls(entry: Entry) -> tuple[tuple[Call, ...], ...]:
    """The entry's ground truth, per user turn, parsed with `ast` into literal calls (BFCL's
    checker `eval`s these strings). Raises ActionError on a string that is not a literal call."""
    return _parsed_ground_truth(entry.ground_truth)


@functools.lru_cache(maxsize=1024)
def _parsed_ground_truth(ground_truth: tuple[tuple[str, ...], ...]) -> tuple[tuple[Call, ...], ...]:
    return tuple(parse_call_list("[" + ", ".join(calls) + "]", max_calls=max(64, len(calls))) for calls in ground_truth)


def _small_details(result: dict, limit: int = 2_000) -> dict[str, str]:
    """The checker's reason in a few kB: long-context states are megabytes."""
    details = result.get("details") or {}
    kept = {}
    for key in ("differences", "missing_items"):
        if key in details:
            text = valid_unicode(json.dumps(details[key], default=str))
            kept[key] = text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"
    return kept


def _first_failure(entry: Entry, calls_per_turn: Sequence[Sequence[Sequence[Call]]]) -> tuple[int, dict] | None:
    """(turn index, BFCL's failure dict) of the first turn that fails, or None: the loop of
    bfcl-eval's `multi_turn_checker` with our dispatcher in place of its `eval` executor."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import response_checker, state_checker

    model, truth = EpisodeBackend(entry), EpisodeBackend(entry)
    model_results: list[str] = []  # all turns so far: a call made early counts for later turns
    for turn, truth_calls in enumerate(ground_truth_calls(entry)):
        steps = calls_per_turn[turn]
        for step in steps:
            model_results.extend(model.run(call) for call in step)
        truth_results = [truth.run(call) for call in truth_calls]
        if not truth_calls:  # a turn where the request cannot be done: nothing to compare
            continue
        if not steps or (len(steps) == 1 and not steps[0]):
            return turn, {
                "valid": False,
                "error_message": f"Model response list is empty for turn {turn}",
                "error_type": "multi_turn:empty_turn_model_response",
            }
        state = state_checker(model.instances, truth.instances)
        if not state["valid"]:
            return turn, state
        response = response_checker(model_results, truth_results, turn)
        if not response["valid"]:
            return turn, response
    return None


def check_episode(entry: Entry, calls_per_turn: Sequence[Sequence[Sequence[Call]]]) -> CheckResult:
    """Score a finished episode as BFCL's multi_turn_checker does: reward 1 iff after every user
    turn the backends' states equal the ground truth's and the results so far contain the
    ground truth's results of that turn.

    calls_per_turn[i] holds the steps of user turn i, each the calls that ran in one response
    (responses without calls are left out, as BFCL's evaluation does).

    It runs in the calling process, and that is safe: no string is `eval`ed or `exec`ed (calls are
    `Call`s, ground truth is parsed with `ast`); every call is one the env already ran within its
    bounds (argument bounds, file-system bounds, at most a step's call deadline), so replaying it
    costs what the step cost, and the ground truth's own calls are BFCL's few fixed ones; each
    episode builds its own instances, so concurrent checks share nothing; process-global state is
    restored after every call (`_process_state_kept`). A crash in bfcl-eval's comparisons scores
    0.0 with its reason rather than raising.
    """
    num_turns = entry.num_user_turns
    if len(calls_per_turn) != num_turns:
        raise ValueError(f"{entry.id}: {len(calls_per_turn)} turns of calls for {num_turns} user turns")
    try:
        failure = _first_failure(entry, calls_per_turn)
    except Exception as error:  # never kills training: scores 0 with the reason
        failure = 0, {"valid": False, "error_type": "seeupo:checker_error", "error_message": f"{type(error).__name__}: {error}"}
    if failure is None:
        return CheckResult(valid=True, turn_results=["passed"] * num_turns)
    failed_at, result = failure
    turn_results = ["passed"] * failed_at + ["failed"] + ["not_checked"] * (num_turns - failed_at - 1)
    return CheckResult(
        valid=False,
        error_type=result.get("error_type"),
        error_message=valid_unicode(str(result.get("error_message") or "")),
        turn_results=turn_results,
        details=_small_details(result),
    )
