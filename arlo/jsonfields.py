"""JSON a client sends (config_json, metadata_json, tool-call bodies): one bounded parser, one
error wording.

Nesting is bounded before parsing: within the size bounds, "[[[[..." thousands deep made the
stdlib parser raise RecursionError, which reached clients as INTERNAL.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in client JSON."""


def loads_bounded(text: str | bytes) -> Any:
    """json.loads, raising json.JSONDecodeError (never RecursionError) past MAX_DEPTH levels."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if text.count("[") + text.count("{") > MAX_DEPTH:
        too_deep = _depth_exceeded_at(text)
        if too_deep is not None:
            raise json.JSONDecodeError(f"nesting deeper than {MAX_DEPTH} levels", text, too_deep)
    try:
        return json.loads(text)
    except RecursionError:  # unreachable after the scan; kept so the promise holds regardless
        raise json.JSONDecodeError(f"nesting deeper than {MAX_DEPTH} levels", text, 0) from None


def _depth_exceeded_at(text: str) -> int | None:
    """Offset where nesting first passes MAX_DEPTH (brackets inside strings do not count)."""
    depth, in_string, escaped = 0, False, False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return i
        elif c in "]}":
            depth -= 1
    return None


def parse_json_object(text: str, field: str) -> dict[str, Any]:
    """The JSON object in `text` ("" means {}); ValueError naming `field` otherwise."""
    if not text:
        return {}
    try:
        value = loads_bounded(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object, got {type(value).__name__}")
    return value
