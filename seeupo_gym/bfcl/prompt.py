"""The BFCL system prompt: task protocol, action format and the entry's function docs.

BFCL documents functions in a JSON-schema dialect whose object type is called "dict". In the
ReAct format the docs are shown as Python signatures (the action format is Python calls), grouped
by backend, with the backend's shared blurb once instead of in every description. In the tools
format they are JSON schemas for the chat template (`tool_schema`).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from seeupo_gym.bfcl.data import FunctionDoc
from seeupo_gym.templates import ReActTemplate

_TYPE_NAMES = {"string": "str", "integer": "int", "float": "float", "number": "float", "boolean": "bool",
               "dict": "dict", "object": "dict", "tuple": "tuple", "any": "Any"}
_BLURB_MARK = "Tool description:"

ROLE = (
    "You are an assistant that completes a user's requests by calling functions. You are given "
    "the user's request and a set of functions. If none of the functions can do what the user "
    "asks, say so. If the request lacks a value a function needs, say so and ask for it."
)

ACTION_FORMAT = (
    "After </think>, write exactly one of:\n"
    "- a list of function calls and nothing else, in this format:\n"
    "  [func_name1(param1=value1, param2=value2), func_name2(param=value)]\n"
    "  Call only the functions listed under Tools, by their bare names, with literal values "
    "(strings, numbers, True/False/None, lists, dicts). The calls run in order and their "
    "results come back to you.\n"
    "- a plain-text reply to the user, with no function call. This ends your turn."
)


def protocol(max_turns: int) -> str:
    return (
        "The user makes requests over several turns. In each turn, keep calling functions and "
        "reading their results until the request is done; then reply in plain text, which "
        "ends your turn, and the user speaks next. A reply that is neither a valid call list "
        "nor plain text gets an error message and does not end the turn. You have at most "
        f"{max_turns} responses for the whole conversation."
    )


def _type_name(schema: Mapping[str, Any]) -> str:
    kind = schema.get("type", "any")
    if kind == "array":
        items = schema.get("items")
        return f"list[{_type_name(items)}]" if items else "list"
    return _TYPE_NAMES.get(kind, kind)


def _clean(text: str) -> str:
    return " ".join(text.split())


def _own_description(doc: FunctionDoc) -> str:
    head, mark, tail = doc.description.partition(_BLURB_MARK)
    return _clean(tail if mark else head)


def _blurb(doc: FunctionDoc) -> str:
    head, mark, _ = doc.description.partition(_BLURB_MARK)
    return _clean(head) if mark else ""


def render_function(doc: FunctionDoc) -> str:
    properties: Mapping[str, Any] = doc.parameters.get("properties", {})
    required = set(doc.parameters.get("required", ()))
    signature = []
    lines = []
    for name, schema in properties.items():
        type_name = _type_name(schema)
        if name in required:
            signature.append(f"{name}: {type_name}")
            status = "required"
        else:
            default = schema.get("default")
            signature.append(f"{name}: {type_name} = {default!r}")
            status = f"optional, default {default!r}"
        line = f"  - {name} ({type_name}, {status}): {_clean(schema.get('description', ''))}"
        nested = schema.get("properties")
        if nested:
            keys = "; ".join(f"{key} ({_type_name(sub)}): {_clean(sub.get('description', ''))}" for key, sub in nested.items())
            line += f" Keys: {keys}"
        lines.append(line)
    out = [f"{doc.name}({', '.join(signature)})", f"  {_own_description(doc)}"]
    if lines:
        out += ["  Parameters:"] + lines
    returns = doc.response.get("properties", {})
    if returns:
        fields = "; ".join(f"{key} ({_type_name(sub)}): {_clean(sub.get('description', ''))}" for key, sub in returns.items())
        out.append(f"  Returns: {fields}")
    return "\n".join(out)


def render_functions(docs: Iterable[FunctionDoc]) -> str:
    """Function docs grouped by backend, each backend's blurb once."""
    groups: dict[str, list[FunctionDoc]] = {}
    for doc in docs:
        groups.setdefault(doc.class_name, []).append(doc)
    sections = []
    for class_name, class_docs in groups.items():
        header = f"## {class_name}"
        blurb = _blurb(class_docs[0])
        if blurb:
            header += f"\n{blurb}"
        sections.append(header + "\n\n" + "\n\n".join(render_function(doc) for doc in class_docs))
    return "\n\n".join(sections)


def system_prompt(template: ReActTemplate, docs: Iterable[FunctionDoc], max_turns: int) -> str:
    return template.system_prompt(
        role=ROLE, protocol=protocol(max_turns), action_format=ACTION_FORMAT, tools=render_functions(docs)
    )


def reveal_message(docs: Iterable[FunctionDoc]) -> str:
    """The user message of a miss_func turn that makes held-back functions available."""
    return (
        "I have added more functions you can call:\n\n"
        + render_functions(docs)
        + "\n\nCan you do what I asked now?"
    )


# ---------------------------------------------------------------- the tools format (native tool calling)

# BFCL's schema dialect -> JSON Schema: its "dict" is JSON's "object", "float" is "number",
# "tuple" an array; "any" has no JSON type (left unchecked).
_JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array"}

TOOLS_ACTION_FORMAT = (
    "After </think>, either call functions with the tool-calling format (one or more tool calls; they run in "
    "order and their results come back to you), or reply to the user in plain text with no tool call, which "
    "ends your turn. Call only the functions you are given, with literal argument values."
)


def json_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A BFCL parameter schema in JSON Schema terms (recursively: items and properties)."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            if value == "any":
                continue
            out[key] = _JSON_TYPES.get(value, value)
        elif key == "properties" and isinstance(value, Mapping):
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, Mapping):
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


def tool_schema(doc: FunctionDoc) -> dict[str, Any]:
    """One BFCL function as a chat-template tool: its own description (the backend's blurb first)."""
    blurb, own = _blurb(doc), _own_description(doc)
    description = f"{own} ({doc.class_name}: {blurb})" if blurb else own
    parameters = json_schema(doc.parameters) if doc.parameters else {"type": "object", "properties": {}}
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})
    return {"type": "function", "function": {"name": doc.name, "description": description, "parameters": parameters}}


def tools_system_prompt(template: ReActTemplate, max_turns: int) -> str:
    """The system prompt of the tools format: the tools themselves go to the chat template."""
    return template.system_prompt(role=ROLE, protocol=protocol(max_turns), action_format=TOOLS_ACTION_FORMAT)


def tools_reveal_message(docs: Iterable[FunctionDoc]) -> str:
    """miss_func's reveal in the tools format: the new functions' schemas, one JSON per line."""
    schemas = "\n".join(json.dumps(tool_schema(doc)) for doc in docs)
    return f"I have added more functions you can call:\n<tools>\n{schemas}\n</tools>\n\nCan you do what I asked now?"
