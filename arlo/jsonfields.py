"""JSON-object fields of requests (config_json, metadata_json): one parser, one error wording."""

from __future__ import annotations

import json
from typing import Any


def parse_json_object(text: str, field: str) -> dict[str, Any]:
    """The JSON object in `text` ("" means {}); ValueError naming `field` otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object, got {type(value).__name__}")
    return value
