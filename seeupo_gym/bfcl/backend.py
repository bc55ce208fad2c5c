"""BFCL's backends and checker, used without their hazards.

BFCL's own executor `eval`s the model's call strings, keeps every instance in module globals
under names built from the model name and test id (so runs under one name share state and the
cache only grows), and lets MathAPI set decimal's and mpmath's precision for the whole process.

- `EpisodeBackend` holds one episode's backend instances (GorillaFileSystem, TwitterAPI, ...),
  set up as BFCL sets them up, and dispatches validated `Call`s to their public methods
  itself: no `eval`, no module-global instance cache. Dropping the object frees the state.
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
        the calls that ran (a prefix). Each call is cheap by the argument bounds; this bounds
        how many run, so a response of many slow-ish calls cannot hold a step for long."""
        deadline = time.monotonic() + seconds
        results = []
        for call in calls:
            if time.monotonic() >= deadline:
                break
            results.append(self.execute(call))
        return results

    def execute(self, call: Call) -> str:
        """Run one checked call; errors come back as text, as in BFCL's executor."""
        with self._math_precision_kept():
            try:
                return format_result(self._methods[call.name](*call.args, **dict(call.kwargs)))
            except Exception as error:  # a backend error is an observation, never a crash
                return f"Error during execution: {error}"

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
