"""Tool calls parsed from model text, checked against the episode's tool schemas. Pure.

Shared: the environments read the agent's calls with it, and inference reads the same formats
for its OpenAI API (a reply's `tool_calls`), so the two never disagree on what a call is.

The formats open models emit (`FORMATS`; `model.tool_format` picks one, "auto" reads any):
- hermes (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  or several, with free text around them.
- llama3: the whole message is `{"name": ..., "parameters": {...}}` (or a list of such),
  optionally after `<|python_tag|>`.
- qwen3_coder: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`.
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]NAME[ARGS]{...}`.
- gemma: `<|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>` (Gemma 4; FunctionGemma's
  `<start_function_call>`/`<escape>` alike).
The last three are read by tool_formats.py. "auto" tells them apart by their markers, which do
not overlap (a Qwen3-Coder `<tool_call>` holds `<function=`, a Hermes one JSON).

A malformed call never raises: it becomes a `BadToolCall` whose message says exactly what was
wrong and how a correct call looks, so the environment can answer it as a "tool" observation
and the agent can learn to fix it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from arlo import tool_formats as fmt
from arlo.choices import ToolFormat
from arlo.jsonfields import loads_bounded
from arlo.tool_schema import check_object, json_type_name, tool_name

MAX_CALLS_PER_TURN = 8
FORMATS: tuple[ToolFormat, ...] = get_args(ToolFormat)

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class BadToolCall:
    name: str
    """The tool name as written; "" when it could not be read."""
    error: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedTurn:
    text: str
    """The message without its tool-call markup, stripped."""
    calls: tuple[ToolCall | BadToolCall, ...]
    """In the order written."""
    format: str = ""
    """The format the calls were read in (one of FORMATS but "auto"), or "" when the turn has none."""


def hermes_example(tools: Sequence[Mapping[str, Any]]) -> str:
    name = tool_name(tools[0]) if tools else "tool"
    return f'<tool_call>{{"name": "{name}", "arguments": {{...}}}}</tool_call>'


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]], *, format: str = "auto",
                     max_calls: int = MAX_CALLS_PER_TURN) -> ParsedTurn:
    """The tool calls in `text`, each checked against `tools` (OpenAI function format), read in
    `format` (one of FORMATS; "auto": whichever format's markers the text holds)."""
    if format not in FORMATS:
        raise ValueError(f"tool call format: expected one of {FORMATS}, got {format!r}")
    if not any(mark in text for mark in _MARKS):
        return ParsedTurn(text=text.strip(), calls=())  # most turns: plain text, told at C speed
    by_name = {tool_name(t): t for t in tools}
    if format == "auto":
        format = _detect(text)
    if format == "qwen3_coder" and fmt.has_qwen3_coder_call(text):
        return _checked(fmt.read_qwen3_coder(text, by_name, max_calls), by_name, max_calls, format)
    if format == "mistral" and fmt.is_mistral(text):
        return _checked(fmt.read_mistral(text, max_calls), by_name, max_calls, format)
    if format == "gemma" and fmt.is_gemma(text):
        return _checked(fmt.read_gemma(text, max_calls), by_name, max_calls, format)
    if format == "hermes" and "<tool_call>" in text:
        bodies = _HERMES.findall(text)
        rest = _HERMES.sub(" ", text).replace("</tool_call>", " ")
        calls = [_call_from_json(b, i, by_name, "arguments") for i, b in enumerate(bodies[:max_calls])]
        calls += [_too_many(max_calls)] if len(bodies) > max_calls else []
        return ParsedTurn(text=rest.strip(), calls=tuple(calls), format="hermes")
    if format == "llama3":
        return _parse_llama3(text, by_name, max_calls)
    return ParsedTurn(text=text.strip(), calls=())


_MARKS = ("{", "<|", "<tool_call>", "<function=", fmt.TOOL_CALLS, "<start_function_call>")


def _detect(text: str) -> str:
    if fmt.is_gemma(text):
        return "gemma"
    if fmt.is_mistral(text):
        return "mistral"
    if fmt.is_qwen3_coder(text):
        return "qwen3_coder"
    return "hermes" if "<tool_call>" in text else "llama3"


def _checked(found: fmt.Found, by_name: Mapping[str, Any], max_calls: int, format: str) -> ParsedTurn:
    calls: list[ToolCall | BadToolCall] = []
    for i, (name, arguments) in enumerate(found.calls):
        if isinstance(arguments, str):
            calls.append(BadToolCall(name=name, error=arguments))
        else:
            calls.append(_call_from_value({"name": name, "arguments": arguments}, i, by_name, "arguments"))
    calls += [_too_many(max_calls)] if found.total > max_calls else []
    return ParsedTurn(text=found.text, calls=tuple(calls), format=format)


def _parse_llama3(text: str, by_name: Mapping[str, Any], max_calls: int) -> ParsedTurn:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG)
    for end in _END_TOKENS:
        body = body.removesuffix(end)
    body = body.strip()
    # Untagged, only a message that is one JSON value naming a tool counts: prose stays prose.
    looks_like_json = body[:1] in ("{", "[") and body[-1:] in ("}", "]") and '"name"' in body
    if not (tagged or looks_like_json):
        return ParsedTurn(text=text.strip(), calls=())
    try:
        value = loads_bounded(body)
    except json.JSONDecodeError as e:
        return ParsedTurn(text="", format="llama3", calls=(BadToolCall(name=_guess_name(body), error=(
            f"the tool call is not valid JSON ({e.msg} at char {e.pos}); write the whole message as "
            '{"name": "<tool>", "parameters": {...}}')),))
    items = value if isinstance(value, list) else [value]
    if not tagged and not all(isinstance(v, dict) and "name" in v for v in items):
        return ParsedTurn(text=text.strip(), calls=())
    calls = [_call_from_value(v, i, by_name, "parameters") for i, v in enumerate(items[:max_calls])]
    calls += [_too_many(max_calls)] if len(items) > max_calls else []
    return ParsedTurn(text="", calls=tuple(calls), format="llama3")


def _too_many(max_calls: int) -> BadToolCall:
    return BadToolCall(name="", error=f"more than {max_calls} tool calls in one turn; the rest were ignored")


def _call_from_json(body: str, index: int, by_name: Mapping[str, Any], args_key: str) -> ToolCall | BadToolCall:
    body = body.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        value = loads_bounded(body)
    except json.JSONDecodeError as e:
        return BadToolCall(name=_guess_name(body), error=(
            f"tool call {index + 1} is not valid JSON ({e.msg} at char {e.pos}); write "
            f'<tool_call>{{"name": "<tool>", "{args_key}": {{...}}}}</tool_call>'))
    return _call_from_value(value, index, by_name, args_key)


def _call_from_value(value: Any, index: int, by_name: Mapping[str, Any], args_key: str) -> ToolCall | BadToolCall:
    where = f"tool call {index + 1}"
    if not isinstance(value, dict):
        return BadToolCall(name="", error=f"{where} must be a JSON object with \"name\" and \"{args_key}\", "
                                          f"got {json_type_name(value)}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return BadToolCall(name="", error=f"{where} has no \"name\" (a string naming one of {sorted(by_name)})")
    tool = by_name.get(name)
    if tool is None:
        return BadToolCall(name=name, error=f"unknown tool {name!r}; available tools: {sorted(by_name)}")
    # Both keys are accepted in both formats: models mix them up, and the meaning is not in doubt.
    arguments = value.get(args_key, value.get("parameters" if args_key == "arguments" else "arguments", {}))
    if isinstance(arguments, str):  # OpenAI's wire format sends arguments as a JSON string
        try:
            arguments = loads_bounded(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return BadToolCall(name=name, error=f"{name}: {args_key} is a string but not valid JSON ({e.msg})")
    if not isinstance(arguments, dict):
        return BadToolCall(name=name, error=f"{name}: {args_key} must be a JSON object, "
                                            f"got {json_type_name(arguments)}")
    problem = check_object(tool["function"].get("parameters", {}), arguments, f"{name} arguments")
    if problem:
        return BadToolCall(name=name, error=problem)
    return ToolCall(name=name, arguments=arguments)


def _guess_name(body: str) -> str:
    match = re.search(r'"name"\s*:\s*"([^"]{1,64})"', body)
    return match.group(1) if match else ""

