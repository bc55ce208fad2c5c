"""Native tool calling, shared by the envs: tool schemas, a registry of tool-call parsers, and the
checks every call passes before an env runs it.

With `action_format="tools"` an env publishes its tools as JSON schemas (OpenAI / Hugging Face
chat-template style, `{"type": "function", "function": {...}}`), the agent renders them through
its tokenizer's chat template (`apply_chat_template(tools=...)`), and the env reads the model's
calls back out of the response text with a *tool-call parser* chosen by name:

- "hermes" (the default; also "qwen"): Qwen2.5 / Qwen3 / Hermes style,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per response.
- "json": hermes blocks, or a response that is only a JSON call object (or a list of them),
  as small Qwen2.5-Coder models often write them.
- Anything else a user registers with `register_tool_parser(name, parser)`: a parser is a function
  `text -> ParsedTools` that never raises.

`parse_tool_response` then checks the calls against the published schemas: known tool names,
required and known parameter names, JSON types (recursively, where the schema says), literal sizes
and nesting depth. Model text is hostile: JSON is parsed by `json` (never `eval`), non-finite
numbers are refused, deep nesting and huge integers are errors, and no input makes it raise.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from seeupo_gym.templates import THINK_CLOSE, THINK_OPEN, ReActTemplate

# Control characters other than tab/newline/carriage return, and the replacement character that
# decoding invalid UTF-8 with errors="replace" produces.
_BINARY = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")
MAX_DEPTH = 32

ToolSchema = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its JSON arguments."""

    name: str
    arguments: Mapping[str, Any]

    def message(self) -> dict[str, Any]:
        """The call as a chat message's `tool_calls` item (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass(frozen=True)
class ParsedTools:
    """A response split into its text (outside the calls) and its calls, or an error."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    thought: str = field(default="", repr=False)


ToolParser = Callable[[str], ParsedTools]
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str, parser: ToolParser) -> None:
    """Make `parser` available as `tool_parser=name` in the envs' tools format.

    A parser gets the response text after the `<think>` block and returns `ParsedTools`: the text
    outside the calls and the calls, or an error. It must not raise (the env catches it anyway and
    reports an error observation). Arguments are validated afterwards, by the env, against the schemas.
    """
    if not name or not callable(parser):
        raise ValueError(f"a tool parser needs a non-empty name and a callable, got {name!r}, {parser!r}")
    _PARSERS[name] = parser


def tool_parser(name: str) -> ToolParser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; registered: {sorted(_PARSERS)}") from None


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


# ---------------------------------------------------------------------------------------- hermes

_CALL_OPEN = "<tool_call>"
_CALL_CLOSE = "</tool_call>"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def loads_json(text: str) -> Any:
    """`json.loads` that refuses NaN/Infinity and turns every failure into ValueError (deep nesting
    raises RecursionError inside the C scanner; integers over 4300 digits raise ValueError)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None
    except (ValueError, OverflowError, MemoryError) as error:
        raise ValueError(str(error).split("\n", 1)[0][:200]) from None


def parse_hermes(text: str) -> ParsedTools:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, in order (Qwen2.5/3, Hermes)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    while (start := text.find(_CALL_OPEN, position)) != -1:
        end = text.find(_CALL_CLOSE, start + len(_CALL_OPEN))
        if end == -1:
            return ParsedTools(content="", error=f"a {_CALL_OPEN} block is not closed with {_CALL_CLOSE}")
        kept.append(text[position:start])
        body = text[start + len(_CALL_OPEN) : end].strip()
        position = end + len(_CALL_CLOSE)
        try:
            payload = loads_json(body)
        except ValueError as error:
            return ParsedTools(content="", error=f"tool call {len(calls) + 1} is not valid JSON ({error})")
        call = _payload_call(payload, len(calls) + 1)
        if isinstance(call, str):
            return ParsedTools(content="", error=call)
        calls.append(call)
    if _CALL_CLOSE in text[position:]:
        return ParsedTools(content="", error=f"a {_CALL_CLOSE} has no {_CALL_OPEN} before it")
    kept.append(text[position:])
    return ParsedTools(content="".join(kept).strip(), calls=tuple(calls))


_FENCE = re.compile(r"^```(?:json)?[ \t]*\n?(.*?)\n?```$", re.DOTALL)


def _payload_call(payload: Any, index: int) -> ToolCall | str:
    """A `{"name": ..., "arguments": {...}}` object as a call, or why it is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return f'tool call {index} must be a JSON object {{"name": ..., "arguments": {{...}}}}'
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = loads_json(arguments) if arguments.strip() else {}
        except ValueError as error:
            return f"the arguments of tool call {index} are not valid JSON ({error})"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f'the "arguments" of tool call {index} must be a JSON object'
    return ToolCall(name=payload["name"], arguments=arguments)


def parse_json_calls(text: str) -> ParsedTools:
    """Hermes blocks, or a response that is only a JSON call object or a list of them (optionally in
    a ```json fence): small Qwen2.5-Coder models often drop the `<tool_call>` tags."""
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1).strip() if fenced else body
    if not body.startswith(("{", "[")):
        return parse_hermes(text)
    try:
        payload = loads_json(body)
    except ValueError as error:
        return ParsedTools(content="", error=f"the tool call is not valid JSON ({error})")
    calls = []
    for index, item in enumerate(payload if isinstance(payload, list) else [payload], start=1):
        call = _payload_call(item, index)
        if isinstance(call, str):
            return ParsedTools(content="", error=call)
        calls.append(call)
    return ParsedTools(content="", calls=tuple(calls))


register_tool_parser("hermes", parse_hermes)
register_tool_parser("qwen", parse_hermes)
register_tool_parser("json", parse_json_calls)


def render_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]], content: str = "") -> str:
    """A response in the hermes format making these calls: for scripted agents, tests and SFT data."""
    blocks = [f"{_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{_CALL_CLOSE}" for name, arguments in calls]
    return "\n".join(([content.strip()] if content.strip() else []) + blocks)


# ---------------------------------------------------------------------------------------- schemas

def function_schema(name: str, description: str, parameters: Mapping[str, Any]) -> ToolSchema:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": dict(parameters)}}


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, kind: str) -> bool:
    types = _JSON_TYPES.get(kind)
    if types is None:
        return True  # a type we do not check ("any", a dialect's own names)
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, types)


def _check_value(value: Any, schema: Mapping[str, Any], where: str, depth: int, max_int: int, types: bool) -> str | None:
    """Why `value` does not fit `schema` (types when `types`, nested items and properties; always
    the bounds: depth, integer size, finite numbers), or None."""
    if depth > MAX_DEPTH:
        return f"{where} is nested too deeply (more than {MAX_DEPTH} levels)"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} must be a finite number"
    if type(value) is int and abs(value) >= max_int:
        return f"{where} is too large an integer (at most {len(str(max_int)) - 1} digits)"
    if not types:
        schema = {}
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
    if kinds and not any(_type_ok(value, k) for k in kinds):
        return f"{where} must be of type {' or '.join(kinds)}, got {_json_type(value)}"
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema, Mapping) else None
        for index, item in enumerate(value):
            why = _check_value(item, items if isinstance(items, Mapping) else {}, f"{where}[{index}]", depth + 1, max_int, types)
            if why:
                return why
    elif isinstance(value, dict):
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        properties = properties if isinstance(properties, Mapping) else {}
        for key, item in value.items():
            sub = properties.get(key, {})
            why = _check_value(item, sub if isinstance(sub, Mapping) else {}, f"{where}.{key}", depth + 1, max_int, types)
            if why:
                return why
    enum = schema.get("enum") if isinstance(schema, Mapping) else None
    if isinstance(enum, list) and enum and value not in enum:
        return f"{where} must be one of {enum}"
    return None


def _json_type(value: Any) -> str:
    for name, types in _JSON_TYPES.items():
        if _type_ok(value, name):
            return name
    return type(value).__name__


def check_call(
    call: ToolCall, tools: Mapping[str, ToolSchema], *, max_int_digits: int = 20, check_arguments: bool = True
) -> str | None:
    """Why the env refuses `call`, or None: an unknown tool, values over the bounds (nesting depth,
    integer size, non-finite numbers) and, with `check_arguments`, a missing or unknown parameter or
    a value of the wrong JSON type."""
    tool = tools.get(call.name)
    if tool is None:
        return f"`{call.name}` is not an available tool (available: {', '.join(sorted(tools)) or 'none'})"
    parameters = tool["function"].get("parameters") or {}
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not check_arguments:
        for name, value in call.arguments.items():
            why = _check_value(value, {}, f"{call.name}: argument {name}", 1, 10**max_int_digits, False)
            if why:
                return why
        return None
    missing = [name for name in required if name not in call.arguments]
    if missing:
        return f"{call.name}: missing required argument(s) {', '.join(missing)}"
    unknown = [name for name in call.arguments if name not in properties]
    if unknown:
        return f"{call.name}: unknown argument(s) {', '.join(map(str, unknown))}; it takes {', '.join(properties) or 'none'}"
    for name, value in call.arguments.items():
        why = _check_value(value, properties[name], f"{call.name}: argument {name}", 1, 10**max_int_digits, True)
        if why:
            return why
    return None


def parse_tool_response(
    response: Any,
    tools: Sequence[ToolSchema],
    *,
    parser: str | ToolParser = "hermes",
    template: ReActTemplate | None = None,
    max_chars: int = 32_768,
    max_calls: int = 64,
    max_int_digits: int = 20,
    check_arguments: bool = True,
) -> ParsedTools:
    """Parse and check a response in the tools format. Never raises.

    The response may start with a `<think>` block (kept as `thought`, never searched for calls).
    Returns the text outside the calls as `content` (with the think block, if any), the checked
    calls, or an error (then no call).
    """
    if not isinstance(response, str):
        return ParsedTools(content="", error=f"the response must be a string, got {type(response).__name__}")
    if len(response) > max_chars:
        return ParsedTools(content="", error=f"the response is too long ({len(response)} characters; at most {max_chars})")
    if _BINARY.search(response):
        return ParsedTools(content="", error="the response contains binary data (control characters or undecodable bytes)")
    if not response.strip():
        return ParsedTools(content="", error="the response is empty")
    split = (template or ReActTemplate()).parse(response)
    if not split.think_closed:
        return ParsedTools(content="", error="the <think> block is not closed with </think>", thought=split.thought)
    parse = tool_parser(parser) if isinstance(parser, str) else parser
    try:
        parsed = parse(split.action)
    except Exception as error:  # a user's parser must not crash the env
        return ParsedTools(content="", error=f"the tool-call parser failed ({type(error).__name__}: {error})")
    if not isinstance(parsed, ParsedTools):
        return ParsedTools(content="", error=f"the tool-call parser returned {type(parsed).__name__}, not ParsedTools")
    # The content keeps the think block: the env's template decides whether history shows it.
    start = response.find(THINK_OPEN)
    if start != -1:
        think = response[start : response.find(THINK_CLOSE, start) + len(THINK_CLOSE)]
        parsed = ParsedTools(content=f"{think}\n{parsed.content}".strip(), calls=parsed.calls, error=parsed.error)
    if parsed.error:
        return ParsedTools(content=parsed.content, error=parsed.error, thought=split.thought)
    if len(parsed.calls) > max_calls:
        return ParsedTools(content=parsed.content, error=f"too many tool calls in one response ({len(parsed.calls)}; at most {max_calls})",
                           thought=split.thought)
    by_name = {tool["function"]["name"]: tool for tool in tools}
    for call in parsed.calls:
        why = check_call(call, by_name, max_int_digits=max_int_digits, check_arguments=check_arguments)
        if why:
            return ParsedTools(content=parsed.content, error=why, thought=split.thought)
    return ParsedTools(content=parsed.content, calls=parsed.calls, thought=split.thought)


# ---------------------------------------------------------------------------------- tool doors

# Where a tool call is one env step (the TRL adapter, seeupo-serve's MCP tools), an env whose user
# turns end with a plain-text response gets this tool; its reply is that response.
END_TURN_TOOL = "end_turn"
END_TURN_SCHEMA = function_schema(
    END_TURN_TOOL,
    "Reply to the user in plain text, which ends your turn; returns the user's next message.",
    {"type": "object", "properties": {"reply": {"type": "string", "description": "Your answer to the user."}},
     "required": ["reply"]},
)
TURN_END_REPLY = "Done."  # what an env is sent for a reply it would not read as plain text


def plain_reply(reply: Any, *, parser: str | ToolParser, template: ReActTemplate, max_chars: int) -> str:
    """`reply` when the env's parser reads it as plain text, else `TURN_END_REPLY`: an end-of-turn
    reply holding tool-call markup must end the turn, not run the calls."""
    if not isinstance(reply, str) or not reply.strip():
        return TURN_END_REPLY
    parsed = parse_tool_response(reply, [], parser=parser, template=template, max_chars=max_chars)
    return reply if parsed.error is None and not parsed.calls else TURN_END_REPLY


def step_tool_result(observation: str, info: Mapping[str, Any]) -> str:
    """What a one-call step returns as the tool's result: the env's `tool` message when the call ran
    (the env's own clipping applied), else its observation (an error, the next user message)."""
    messages = info.get("messages") or []
    if messages and messages[-1].get("role") == "tool" and not info.get("action_error"):
        return str(messages[-1]["content"])
    return observation


def assistant_message(content: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The assistant message of a tools-format response, as chat templates render it."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.message() for call in calls]
    return message


def tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}
