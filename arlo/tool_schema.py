"""Tool schemas in the OpenAI/MCP function format, and a checker for the JSON Schema subset
they use. Pure Python: the gateway must not depend on a schema library for a dozen keywords.

A tool is `{"type": "function", "function": {"name", "description", "parameters"}}` where
`parameters` is a JSON Schema object. The checker understands `type` (a name or a list of
names), `enum`, `properties`, `required`, `additionalProperties: false`, `items`,
`minLength`/`maxLength` and `minimum`/`maximum`: enough for tool arguments, and every
message names the argument and what was expected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


def function_tool(name: str, description: str, properties: Mapping[str, Mapping[str, Any]],
                  required: Sequence[str] | None = None) -> dict[str, Any]:
    """One tool in the OpenAI function format; every property is required unless told otherwise."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": dict(properties),
                       "required": list(properties if required is None else required),
                       "additionalProperties": False}}}


def tools_json(tools: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps(list(tools), separators=(",", ":"))


def tool_name(tool: Mapping[str, Any]) -> str:
    return str(tool["function"]["name"])


def json_type_name(value: Any) -> str:
    """The JSON name of a decoded value's type ("integer", not "int"), for messages."""
    if isinstance(value, bool):
        return "boolean"
    for name, kinds in _JSON_TYPES.items():
        if name != "number" and isinstance(value, kinds):
            return name
    return "number" if isinstance(value, float) else type(value).__name__


def _type_ok(value: Any, expected: str) -> bool:
    if isinstance(value, bool):  # JSON has no bool/int confusion to forgive
        return expected == "boolean"
    return isinstance(value, _JSON_TYPES.get(expected, ()))


def check_value(schema: Mapping[str, Any], value: Any, where: str) -> str | None:
    """Why `value` does not fit `schema` (naming `where`), or None when it does."""
    expected = schema.get("type")
    if expected is not None:
        names = [expected] if isinstance(expected, str) else list(expected)
        if not any(_type_ok(value, n) for n in names):
            return f"{where} must be {' or '.join(names)}, got {json_type_name(value)} {_short(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {_short(value)}"
    if isinstance(value, str):
        return _check_length(schema, len(value), where, "characters")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _check_range(schema, value, where)
    if isinstance(value, list):
        return _check_length(schema, len(value), where, "items") or _check_items(schema, value, where)
    if isinstance(value, dict):
        return check_object(schema, value, where)
    return None


def check_object(schema: Mapping[str, Any], value: Mapping[str, Any], where: str) -> str | None:
    properties: Mapping[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", ()) if k not in value]
    extra = sorted(set(value) - set(properties)) if schema.get("additionalProperties") is False else []
    problems = ([f"missing required argument(s) {missing}"] if missing else []) + \
        ([f"unexpected argument(s) {extra}"] if extra else [])
    if problems:
        return f"{where}: {' and '.join(problems)}; the arguments are {sorted(properties)}"
    for key, item in value.items():
        if key in properties:
            problem = check_value(properties[key], item, f"{where}.{key}")
            if problem:
                return problem
    return None


def _check_length(schema: Mapping[str, Any], size: int, where: str, unit: str) -> str | None:
    low, high = schema.get("minLength", schema.get("minItems")), schema.get("maxLength", schema.get("maxItems"))
    if low is not None and size < low:
        return f"{where} has {size} {unit}; at least {low} needed"
    if high is not None and size > high:
        return f"{where} has {size} {unit}; at most {high} allowed"
    return None


def _check_range(schema: Mapping[str, Any], value: float, where: str) -> str | None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if (low is not None and value < low) or (high is not None and value > high):
        return f"{where} must be in [{low if low is not None else '-inf'}, " \
               f"{high if high is not None else 'inf'}], got {_short(value)}"
    return None


def _check_items(schema: Mapping[str, Any], value: list[Any], where: str) -> str | None:
    items = schema.get("items")
    if items is None:
        return None
    return next((p for i, v in enumerate(value) if (p := check_value(items, v, f"{where}[{i}]"))), None)


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
