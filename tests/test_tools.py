"""The tool-call parser registry and the checks every tools-format call passes (seeupo_gym.tools)."""

from __future__ import annotations

import json
import time

import pytest

from seeupo_gym.tools import (
    ParsedTools,
    ToolCall,
    function_schema,
    parse_hermes,
    parse_tool_response,
    register_tool_parser,
    render_tool_calls,
    tool_parser,
    tool_parser_names,
)

TOOLS = [
    function_schema(
        "move",
        "Move a file.",
        {
            "type": "object",
            "properties": {
                "source": {"type": "string"},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "options": {"type": "object", "properties": {"force": {"type": "boolean"}}},
            },
            "required": ["source"],
        },
    ),
    function_schema("ls", "List.", {"type": "object", "properties": {}}),
]


def call(arguments, name="move") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_hermes_calls_are_read_in_order_with_the_text_around_them():
    response = "<think>plan</think>\nMoving now." + call({"source": "a", "count": 2}) + call({}, name="ls")
    parsed = parse_tool_response(response, TOOLS)
    assert parsed.error is None
    assert parsed.calls == (ToolCall("move", {"source": "a", "count": 2}), ToolCall("ls", {}))
    assert parsed.content == "<think>plan</think>\nMoving now."
    assert parsed.thought == "plan"


def test_plain_text_has_no_calls_and_no_error():
    assert parse_tool_response("All done.", TOOLS) == ParsedTools(content="All done.")


def test_arguments_sent_as_a_json_string_are_accepted():
    response = "<tool_call>" + json.dumps({"name": "move", "arguments": json.dumps({"source": "a"})}) + "</tool_call>"
    assert parse_tool_response(response, TOOLS).calls == (ToolCall("move", {"source": "a"}),)


def test_render_tool_calls_round_trips():
    response = render_tool_calls([("move", {"source": "x", "tags": ["a"]}), ("ls", {})], content="ok")
    parsed = parse_tool_response(response, TOOLS)
    assert parsed.calls == (ToolCall("move", {"source": "x", "tags": ["a"]}), ToolCall("ls", {}))
    assert parsed.content == "ok"


BAD = {
    "unknown tool": (call({}, name="rm"), "`rm` is not an available tool"),
    "wrong type": (call({"source": 3}), "argument source must be of type string, got integer"),
    "bool is not an integer": (call({"source": "a", "count": True}), "must be of type integer, got boolean"),
    "nested wrong type": (call({"source": "a", "tags": ["x", 1]}), "tags[1] must be of type string"),
    "nested object type": (call({"source": "a", "options": {"force": "yes"}}), "options.force must be of type boolean"),
    "missing required": (call({"count": 1}), "missing required argument(s) source"),
    "unknown argument": (call({"source": "a", "speed": 1}), "unknown argument(s) speed"),
    "malformed json": ('<tool_call>{"name": "move", "arguments": {"source": }}</tool_call>', "is not valid JSON"),
    "not an object": ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    "arguments not an object": ('<tool_call>{"name": "move", "arguments": [1]}</tool_call>', '"arguments" of tool call 1'),
    "unclosed block": ('<tool_call>{"name": "ls"}', "is not closed"),
    "stray close": ("</tool_call>", "has no <tool_call>"),
    "nan": ('<tool_call>{"name": "move", "arguments": {"source": "a", "ratio": NaN}}</tool_call>', "not a finite number"),
    "huge integer": (call({"source": "a", "count": 10**30}), "too large an integer"),
    "integer over python's digit limit": ('<tool_call>{"name": "ls", "arguments": {"n": ' + "9" * 5000 + "}}</tool_call>",
                                          "is not valid JSON"),
    "depth 10,000": ('<tool_call>{"name": "move", "arguments": {"source": ' + "[" * 10_000 + "]" * 10_000 + "}}</tool_call>",
                     "nested too deeply"),
    "depth 40 inside the limit of json": (call({"source": "a", "options": {"deep": json.loads("[" * 40 + "]" * 40)}}),
                                          "nested too deeply"),
    "empty": ("   ", "the response is empty"),
    "binary": ("\x00" + call({"source": "a"}), "binary data"),
    "unclosed think": ("<think>" + call({"source": "a"}), "<think> block is not closed"),
    "not a string": (b"bytes", "must be a string"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tool_calls_are_errors_with_no_calls_and_never_raise(case):
    response, message = BAD[case]
    parsed = parse_tool_response(response, TOOLS)
    assert parsed.calls == ()
    assert message in parsed.error


def test_ten_megabyte_arguments_are_refused_by_length_fast():
    response = call({"source": "x" * 10_000_000})
    start = time.perf_counter()
    parsed = parse_tool_response(response, TOOLS)
    assert time.perf_counter() - start < 1.0
    assert parsed.calls == () and "too long" in parsed.error
    # Without the length bound the call itself is valid: the bound is what refuses it.
    assert parse_tool_response(response, TOOLS, max_chars=20_000_000).calls[0].name == "move"


def test_too_many_calls_are_refused():
    parsed = parse_tool_response(call({}, name="ls") * 3, TOOLS, max_calls=2)
    assert parsed.calls == () and "too many tool calls" in parsed.error


def test_without_argument_checks_only_names_and_bounds_are_checked():
    loose = parse_tool_response(call({"source": 3, "speed": 1}), TOOLS, check_arguments=False)
    assert loose.calls == (ToolCall("move", {"source": 3, "speed": 1}),)
    assert "too large" in parse_tool_response(call({"n": 10**30}), TOOLS, check_arguments=False).error
    assert "not an available tool" in parse_tool_response(call({}, name="rm"), TOOLS, check_arguments=False).error


def test_a_user_registered_parser_is_used_by_name_and_its_crash_is_an_error():
    def parse_call_lines(text: str) -> ParsedTools:
        calls = [ToolCall(line[5:].strip(), {}) for line in text.splitlines() if line.startswith("CALL ")]
        return ParsedTools(content="", calls=tuple(calls))

    def broken(text: str) -> ParsedTools:
        raise RuntimeError("boom")

    register_tool_parser("call-lines", parse_call_lines)
    register_tool_parser("broken", broken)
    assert "call-lines" in tool_parser_names() and tool_parser("hermes") is parse_hermes
    assert parse_tool_response("CALL ls", TOOLS, parser="call-lines").calls == (ToolCall("ls", {}),)
    assert "parser failed (RuntimeError: boom)" in parse_tool_response("x", TOOLS, parser="broken").error


def test_an_unknown_parser_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        tool_parser("nope")


@pytest.mark.parametrize(
    "response, calls",
    [
        ('{"name": "ls", "arguments": {}}', (ToolCall("ls", {}),)),
        ('```json\n[{"name": "ls"}, {"name": "move", "arguments": {"source": "a"}}]\n```',
         (ToolCall("ls", {}), ToolCall("move", {"source": "a"}))),
        (call({}, name="ls"), (ToolCall("ls", {}),)),
        ("plain text", ()),
    ],
)
def test_the_json_parser_reads_bare_json_calls_too(response, calls):
    parsed = parse_tool_response(response, TOOLS, parser="json")
    assert parsed.error is None and parsed.calls == calls


def test_the_json_parser_refuses_malformed_json_objects():
    assert "not valid JSON" in parse_tool_response('{"name": "ls", ', TOOLS, parser="json").error
    assert "must be a JSON object" in parse_tool_response("[1]", TOOLS, parser="json").error
