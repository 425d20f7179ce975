"""Tool schemas (`arlo/tool_schema.py`, shared with the tool-call parser inference also uses) under
the import path environments and plugins use (docs/environments.md)."""

from __future__ import annotations

from arlo.tool_schema import check_object, check_value, function_tool, json_type_name, tool_name, tools_json

__all__ = ["check_object", "check_value", "function_tool", "json_type_name", "tool_name", "tools_json"]
