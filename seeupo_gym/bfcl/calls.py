"""The BFCL action format: decoding model responses into safe calls, and rendering them.

A response is `<think>...</think>` followed by the action (the shared ReAct template). The
action is one of:

- a call list in BFCL's Python prompting format, `[func(a=1, b='x'), other()]` (the brackets
  may be left out; a ``` fence around it is ignored). Its calls are executed and their
  results are the next observation. `[]` is a call list with no calls: it ends the turn.
- plain text: an answer to the user. It ends the current user turn.

What counts as an attempted call list: after the think block and any code fence, the action
starts with `[` followed by `]` or by `name(`, or starts with `name(` (a name may hold dots,
so `os.system(` is an attempt too). Such an action that fails to parse or validate is an
*error*: nothing runs, the env replies with the reason, and the turn goes on. Everything else
is plain text. An empty action, an unclosed think block, a response over the length limit
and a response holding binary data (NUL and other control characters, or U+FFFD from
undecodable bytes) are errors too.

Safety: model text never reaches `eval`. The call list is parsed with `ast`; a call must be a
bare function name with literal arguments (strings, numbers, True/False/None and lists,
tuples, sets, dicts of them). The env then checks the name against the functions the model
has been shown (and argument names against its parameters) and dispatches to the backend's
method itself; scoring replays the same `Call`s. `Call.source` rebuilds a call string from the
validated values (`repr` of literals) for observations and `info["calls"]`; nothing evaluates it.

Cost: integers have at most `MAX_INT_DIGITS` digits. The backends' arithmetic is then cheap
(MathAPI's `power` with the exponent bound of `backend.ARGUMENT_BOUNDS` costs microseconds
instead of seconds at a 4299-digit base), and every literal converts back to a string
(CPython refuses int -> str beyond 4300 digits, which `0x` literals of 4000 hex digits exceed).
Strings, lists and dicts cost time linear in their length, which `max_chars` bounds.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from seeupo_gym.templates import ReActTemplate

# Control characters other than tab/newline/carriage return, and the replacement character
# that decoding invalid UTF-8 with errors="replace" produces.
_BINARY = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")
_CALL_START = re.compile(r"\[\s*(?:\]|[A-Za-z_][\w.]*\s*\()|[A-Za-z_][\w.]*\(")
_FENCE = re.compile(r"^```[\w+-]*[ \t]*\n?(.*?)\n?```$", re.DOTALL)
_MAX_LITERAL_DEPTH = 32
# BFCL's ground truth uses integers of at most 6 digits; 20 holds any 64-bit id or count.
MAX_INT_DIGITS = 20
_INT_BOUND = 10**MAX_INT_DIGITS

_DEFAULT_TEMPLATE = ReActTemplate()


class ActionError(ValueError):
    """A response the env refuses to run; the message is shown to the model."""


@dataclass(frozen=True)
class Call:
    """One validated call: a bare function name and literal arguments."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def source(self) -> str:
        """The call as Python source, rebuilt from the validated values (never the model's text)."""
        parts = [repr(value) for value in self.args] + [f"{key}={value!r}" for key, value in self.kwargs]
        return f"{self.name}({', '.join(parts)})"


@dataclass(frozen=True)
class DecodedResponse:
    """What a response asks for: run calls, end the turn (with a text answer), or nothing (error)."""

    kind: Literal["calls", "turn_end", "error"]
    calls: tuple[Call, ...] = ()
    text: str = ""
    error: str | None = None
    thought: str = field(default="", repr=False)


def strip_fence(action: str) -> str:
    action = action.strip()
    fenced = _FENCE.match(action)
    return fenced.group(1).strip() if fenced else action


def looks_like_calls(action: str) -> bool:
    """Whether an action is an attempted call list (see the module docstring)."""
    return _CALL_START.match(strip_fence(action)) is not None


def _literal(node: ast.AST, depth: int = 0) -> Any:
    if depth > _MAX_LITERAL_DEPTH:
        raise ActionError("an argument is nested too deeply")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, float) and not math.isfinite(value):
            raise ActionError("numbers must be finite")
        if type(value) is int and abs(value) >= _INT_BOUND:
            raise ActionError(f"integers must have at most {MAX_INT_DIGITS} digits")
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        raise ActionError(f"literal of type {type(value).__name__} is not allowed as an argument")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = node.operand
        if isinstance(operand, ast.Constant) and type(operand.value) in (int, float):
            value = _literal(operand, depth + 1)
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_literal(item, depth + 1) for item in node.elts]
        if isinstance(node, ast.List):
            return items
        if isinstance(node, ast.Tuple):
            return tuple(items)
        try:
            return set(items)
        except TypeError:
            raise ActionError("set elements must be hashable") from None
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ActionError("`**` unpacking is not allowed")
        result = {}
        for key_node, value_node in zip(node.keys, node.values):
            key = _literal(key_node, depth + 1)
            try:
                result[key] = _literal(value_node, depth + 1)
            except TypeError:
                raise ActionError("dict keys must be hashable") from None
        return result
    if isinstance(node, ast.Name):
        raise ActionError(f"`{node.id}` is a bare name, not a value; quote strings, e.g. '{node.id}'")
    if isinstance(node, ast.Starred):
        raise ActionError("`*` unpacking is not allowed")
    kind = {ast.Call: "a function call", ast.Attribute: "attribute access", ast.Subscript: "subscripting",
            ast.BinOp: "arithmetic", ast.Lambda: "a lambda"}.get(type(node), f"a {type(node).__name__} expression")
    raise ActionError(f"arguments must be literal values (strings, numbers, True/False/None, lists, dicts); found {kind}")


def _call(node: ast.AST) -> Call:
    if not isinstance(node, ast.Call):
        raise ActionError("every item of the list must be a function call like func(a=1)")
    if not isinstance(node.func, ast.Name):
        raise ActionError("call functions by their bare name, e.g. ls(a=True), not through attributes or expressions")
    name = node.func.id
    if name.startswith("_"):
        raise ActionError(f"`{name}` is not an available function")
    args = tuple(_literal(arg) for arg in node.args)
    kwargs: list[tuple[str, Any]] = []
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ActionError("`**` unpacking is not allowed")
        if keyword.arg.startswith("_"):
            raise ActionError(f"parameter names cannot start with '_' (got {keyword.arg!r})")
        if any(keyword.arg == seen for seen, _ in kwargs):
            raise ActionError(f"parameter {keyword.arg!r} is given twice in {name}(...)")
        kwargs.append((keyword.arg, _literal(keyword.value)))
    return Call(name=name, args=args, kwargs=tuple(kwargs))


def parse_call_list(action: str, *, max_calls: int = 64) -> tuple[Call, ...]:
    """Parse an attempted call list into calls with literal arguments. Raises ActionError."""
    text = strip_fence(action)
    if not text.startswith("["):
        text = f"[{text}]"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise ActionError(
            f"the call list is not valid Python syntax ({error.msg}); write only the list, e.g. [func(a=1)]"
        ) from None
    except (ValueError, RecursionError, MemoryError, OverflowError) as error:
        raise ActionError(f"the call list cannot be parsed ({type(error).__name__})") from None
    if not isinstance(tree.body, ast.List):
        raise ActionError("write the calls as one list: [func1(a=1), func2(b='x')]")
    if len(tree.body.elts) > max_calls:
        raise ActionError(f"too many calls in one response ({len(tree.body.elts)}; at most {max_calls})")
    return tuple(_call(node) for node in tree.body.elts)


def decode_response(
    response: str,
    template: ReActTemplate = _DEFAULT_TEMPLATE,
    *,
    max_chars: int = 32_768,
    max_calls: int = 64,
) -> DecodedResponse:
    """Classify a response as calls, a turn-ending answer or an error. Never raises."""
    if not isinstance(response, str):
        return DecodedResponse("error", error=f"the response must be a string, got {type(response).__name__}")
    if len(response) > max_chars:
        return DecodedResponse("error", error=f"the response is too long ({len(response)} characters; at most {max_chars})")
    if _BINARY.search(response):
        return DecodedResponse("error", error="the response contains binary data (control characters or undecodable bytes)")
    if not response.strip():
        return DecodedResponse("error", error="the response is empty")
    parsed = template.parse(response)
    if not parsed.think_closed:
        return DecodedResponse("error", error="the <think> block is not closed with </think>, so there is no action")
    action = strip_fence(parsed.action)
    if not action:
        return DecodedResponse("error", error="there is no action after the </think> block", thought=parsed.thought)
    if not looks_like_calls(action):
        return DecodedResponse("turn_end", text=action, thought=parsed.thought)
    try:
        calls = parse_call_list(action, max_calls=max_calls)
    except ActionError as error:
        return DecodedResponse("error", error=str(error), thought=parsed.thought)
    if not calls:
        return DecodedResponse("turn_end", text="", thought=parsed.thought)
    return DecodedResponse("calls", calls=calls, thought=parsed.thought)


def render_action(calls: list[str], thought: str = "", template: ReActTemplate = _DEFAULT_TEMPLATE) -> str:
    """A response that makes these calls, e.g. render_action(["cd(folder='docs')", "ls()"]).

    For scripted agents, tests and SFT data; the env decodes it back to exactly these calls.
    """
    if not calls:
        raise ValueError("render_action needs at least one call; use render_turn_end to end a turn")
    action = "[" + ", ".join(call.strip() for call in calls) + "]"
    parse_call_list(action, max_calls=max(64, len(calls)))  # raises ActionError on a malformed call
    return template.render(action, thought=thought)


def render_turn_end(
    text: str = "I have done what you asked.", thought: str = "", template: ReActTemplate = _DEFAULT_TEMPLATE
) -> str:
    """A response that answers in plain text and so ends the current user turn."""
    if not text.strip() or looks_like_calls(text):
        raise ValueError(f"a turn-ending answer must be non-empty text that is not a call list, got {text!r}")
    return template.render(text.strip(), thought=thought)
