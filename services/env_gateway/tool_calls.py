"""Tool calls as environments see them: the parser (`arlo/tool_calls.py`, shared with inference's
OpenAI API) under the import path environments and plugins use (docs/environments.md), and the
observation that answers a malformed call."""

from __future__ import annotations

from arlo.tool_calls import BadToolCall, ParsedTurn, ToolCall, parse_tool_calls
from services.env_gateway.envs.base import Message

__all__ = ["BadToolCall", "ParsedTurn", "ToolCall", "error_message", "parse_tool_calls"]


def error_message(bad: BadToolCall) -> Message:
    """The observation that answers a malformed call."""
    return Message(role="tool", name=bad.name, content=f"error: {bad.error}")
