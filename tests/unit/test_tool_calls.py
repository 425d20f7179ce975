"""Tool calls parsed from model text (Hermes/Qwen and Llama 3 formats) and checked against schemas."""

from __future__ import annotations

import json

import pytest

from services.env_gateway.tool_calls import BadToolCall, ToolCall, error_message, parse_tool_calls
from services.env_gateway.tool_schema import check_value, function_tool, tools_json

TOOLS = (
    function_tool("calculator", "Evaluate.", {"expression": {"type": "string", "maxLength": 20}}),
    function_tool("guess", "Guess.", {"number": {"type": "integer", "minimum": 1, "maximum": 100}}),
    function_tool("mode", "Pick.", {"kind": {"type": "string", "enum": ["a", "b"]},
                                     "tags": {"type": "array", "items": {"type": "string"}}}, required=["kind"]),
)


def only_call(text: str) -> ToolCall | BadToolCall:
    (call,) = parse_tool_calls(text, TOOLS).calls
    return call


def error_of(text: str) -> str:
    call = only_call(text)
    assert isinstance(call, BadToolCall), call
    return call.error


def test_tools_are_openai_function_format() -> None:
    (tool,) = json.loads(tools_json(TOOLS[:1]))
    assert tool == {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 20}},
                       "required": ["expression"], "additionalProperties": False}}}


def test_hermes_one_call_with_text_around() -> None:
    turn = parse_tool_calls('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
                            '{"expression": "12*34"}}\n</tool_call>', TOOLS)
    assert turn.format == "hermes" and turn.text == "Let me compute."
    assert turn.calls == (ToolCall(name="calculator", arguments={"expression": "12*34"}),)


def test_hermes_several_calls_in_order_and_unclosed_last() -> None:
    text = ('<tool_call>{"name": "guess", "arguments": {"number": 50}}</tool_call> then '
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}')  # stopped before the close tag
    turn = parse_tool_calls(text, TOOLS)
    assert [c.name for c in turn.calls] == ["guess", "calculator"]
    assert all(isinstance(c, ToolCall) for c in turn.calls) and turn.text == "then"


def test_arguments_as_json_string_and_fenced_json() -> None:
    call = only_call('<tool_call>{"name": "guess", "arguments": "{\\"number\\": 7}"}</tool_call>')
    assert call == ToolCall(name="guess", arguments={"number": 7})
    call = only_call('<tool_call>```json\n{"name": "guess", "arguments": {"number": 8}}\n```</tool_call>')
    assert call == ToolCall(name="guess", arguments={"number": 8})


@pytest.mark.parametrize(("text", "fragment"), [
    ('<tool_call>{"name": "guess", "arguments": {"number": 5}</tool_call>', "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'has no "name"'),
    ('<tool_call>{"name": "calc", "arguments": {}}</tool_call>', "unknown tool 'calc'; available tools: "
                                                                  "['calculator', 'guess', 'mode']"),
    ('<tool_call>{"name": "guess", "arguments": {}}</tool_call>', "missing required argument(s) ['number']"),
    ('<tool_call>{"name": "guess"}</tool_call>', "missing required argument(s) ['number']"),
    ('<tool_call>{"name": "guess", "arguments": {"number": 5, "x": 1}}</tool_call>',
     "guess arguments: unexpected argument(s) ['x']; the arguments are ['number']"),
    ('<tool_call>{"name": "guess", "arguments": {"number": "5"}}</tool_call>',
     'guess arguments.number must be integer, got string "5"'),
    ('<tool_call>{"name": "guess", "arguments": {"number": true}}</tool_call>', "must be integer, got boolean"),
    ('<tool_call>{"name": "guess", "arguments": {"number": 5.5}}</tool_call>', "must be integer, got number"),
    ('<tool_call>{"name": "guess", "arguments": {"number": 500}}</tool_call>', "must be in [1, 100], got 500"),
    ('<tool_call>{"name": "guess", "arguments": [5]}</tool_call>', "arguments must be a JSON object, got array"),
    ('<tool_call>{"name": "guess", "arguments": "{5"}</tool_call>', "arguments is a string but not valid JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "' + "1" * 21 + '"}}</tool_call>',
     "has 21 characters; at most 20 allowed"),
    ('<tool_call>{"name": "mode", "arguments": {"kind": "c"}}</tool_call>', "must be one of ['a', 'b']"),
    ('<tool_call>{"name": "mode", "arguments": {"kind": "a", "tags": ["x", 1]}}</tool_call>',
     "mode arguments.tags[1] must be string, got integer"),
], ids=["bad-json", "not-object", "no-name", "unknown-tool", "missing-arg", "no-arguments", "extra-arg",
        "wrong-type", "bool-not-int", "float-not-int", "out-of-range", "args-not-object", "args-bad-json-string",
        "too-long", "enum", "item-type"])
def test_malformed_calls_say_exactly_what_is_wrong(text: str, fragment: str) -> None:
    assert fragment in error_of(text)


def test_bad_json_keeps_the_tool_name_when_readable() -> None:
    call = only_call('<tool_call>{"name": "guess", "arguments": {"number": }}</tool_call>')
    assert isinstance(call, BadToolCall) and call.name == "guess"
    message = error_message(call)
    assert message.role == "tool" and message.name == "guess" and message.content.startswith("error: tool call 1")


def test_too_many_calls_are_cut_with_a_message() -> None:
    one = '<tool_call>{"name": "guess", "arguments": {"number": 1}}</tool_call>'
    turn = parse_tool_calls(one * 3, TOOLS, max_calls=2)
    assert [type(c) for c in turn.calls] == [ToolCall, ToolCall, BadToolCall]
    assert "more than 2 tool calls" in turn.calls[-1].error  # type: ignore[union-attr]


@pytest.mark.parametrize("text", [
    '{"name": "guess", "parameters": {"number": 42}}',
    '  <|python_tag|>{"name": "guess", "parameters": {"number": 42}}<|eom_id|>',
    '{"name": "guess", "arguments": {"number": 42}}',
])
def test_llama3_whole_message_json(text: str) -> None:
    turn = parse_tool_calls(text, TOOLS)
    assert turn.format == "llama3" and turn.text == ""
    assert turn.calls == (ToolCall(name="guess", arguments={"number": 42}),)


def test_llama3_list_of_calls_and_errors() -> None:
    turn = parse_tool_calls('[{"name": "guess", "parameters": {"number": 3}}, '
                            '{"name": "nope", "parameters": {}}]', TOOLS)
    assert isinstance(turn.calls[0], ToolCall) and "unknown tool 'nope'" in turn.calls[1].error  # type: ignore[union-attr]
    assert "not valid JSON" in error_of('<|python_tag|>{"name": "guess", "parameters": {')
    assert "not valid JSON" in error_of('{"name": "guess", "parameters": {"number": 3,}}')


@pytest.mark.parametrize("text", [
    "The answer is 42.", "{not json} but prose", '{"answer": 5}', "", "I would call {\"name\": x} maybe",
])
def test_plain_text_has_no_calls(text: str) -> None:
    turn = parse_tool_calls(text, TOOLS)
    assert turn.calls == () and turn.format == "" and turn.text == text.strip()


def test_schema_type_lists_and_numbers() -> None:
    schema = {"type": ["integer", "string"]}
    assert check_value(schema, 5, "v") is None and check_value(schema, "5", "v") is None
    assert check_value(schema, 5.0, "v") == "v must be integer or string, got number 5.0"
    assert check_value({"type": "number"}, 5, "v") is None
    assert check_value({"type": "number", "minimum": 0}, -1, "v") == "v must be in [0, inf], got -1"
