"""`mcp:<name>`: an episode whose tools are an MCP server's (see docs/mcp.md).

Reset's config is the task: `{"prompt": ..., "reference": ..., "system_prompt": ..., "max_turns": ...}`.
The first observation is the (system and) user message, and tools_json holds the server's tool
schemas in the OpenAI function format, which the rollout renders with the model's chat template.
Each step parses the model's text for tool calls (in `model.tool_format`: Hermes `<tool_call>`,
Llama 3 JSON, Qwen3-Coder, Mistral or Gemma; see tool_calls.py); every call goes to the server in the order written, each under the server's
timeout shortened to what is left of the RPC's deadline, and comes back as a `tool` message named
after the tool, results and errors alike. A reply without a tool call is the final answer: the
episode ends, and the reward service scores the answer against `reference`.

Asynchronous: the gateway awaits `reset`/`step` on its event loop, so hundreds of episodes wait
on their tool servers concurrently without a thread each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.env_gateway.envs.base import (
    EpisodeOverError,
    Message,
    ResetResult,
    StepResult,
    check_range,
    describe_config,
    parse_config,
)
from services.env_gateway.mcp_client import McpServer
from services.env_gateway.spec import EnvSpec
from services.env_gateway.tool_calls import BadToolCall, error_message, parse_tool_calls
from services.env_gateway.tool_schema import tools_json

PREFIX = "mcp:"
MAX_TURNS = 64
REPLY_MARGIN = 0.1
"""A tool call gets the RPC's remaining time less this share (at most REPLY_MARGIN_S), so the
error observation of a call that runs it out reaches the caller before its own deadline."""
REPLY_MARGIN_S = 0.25


@dataclass(frozen=True, kw_only=True, slots=True)
class McpTaskConfig:
    prompt: str = ""
    """The task, as the user message."""
    system_prompt: str = ""
    """A system message before it (optional)."""
    reference: str = ""
    """What the reward function scores the final answer against."""
    task_id: str = ""
    """A stable id for the task (empty: the server name and the seed)."""
    max_turns: int = 0
    """Turns before the episode ends unanswered; 0 is the server's max_turns, the most allowed."""

    def validate(self) -> None:
        if not self.prompt:
            raise ValueError('prompt is required (Reset config_json {"prompt": "...", "reference": "..."})')
        check_range("max_turns", self.max_turns, 0, MAX_TURNS)


class McpEnv:
    def __init__(self, server: McpServer, env_name: str, *, tool_format: str = "auto") -> None:
        self._server = server
        self._tool_format = tool_format
        self._name = env_name
        self._tools: list[dict[str, Any]] = []
        self._reference = ""
        self._max_turns = 0
        self._turns = 0
        self._tool_calls = 0
        self._tool_errors = 0
        self._done = True

    async def reset(self, seed: int, config: Mapping[str, Any], deadline_s: float | None = None) -> ResetResult:
        cfg = parse_config(McpTaskConfig, config, self._name)
        if cfg.max_turns > self._server.cfg.max_turns:
            raise ValueError(f"{self._name} config: max_turns {cfg.max_turns} is above the server's "
                             f"max_turns ({self._server.cfg.max_turns})")
        self._tools = await self._server.list_tools(deadline_s)  # EnvUnavailableError -> UNAVAILABLE
        self._reference, self._max_turns = cfg.reference, cfg.max_turns or self._server.cfg.max_turns
        self._turns = self._tool_calls = self._tool_errors = 0
        self._done = False
        observation = ([Message(role="system", content=cfg.system_prompt)] if cfg.system_prompt else []) + \
            [Message(role="user", content=cfg.prompt)]
        return ResetResult(observation=observation, task_id=cfg.task_id or f"{self._name}-{seed}",
                           tools_json=tools_json(self._tools))

    async def step(self, action: str, deadline_s: float | None = None) -> StepResult:
        if self._done:
            raise EpisodeOverError("the episode is over; call Reset to start another")
        loop = asyncio.get_running_loop()
        end = None if deadline_s is None else loop.time() + deadline_s
        self._turns += 1
        parsed = parse_tool_calls(action, self._tools, format=self._tool_format)
        if not parsed.calls:
            return self._finish(parsed.text)
        replies: list[Message] = []
        for call in parsed.calls:  # in order: a tool may depend on what the one before it did
            if isinstance(call, BadToolCall):
                replies.append(error_message(call))
                self._tool_errors += 1
                continue
            left = None if end is None else end - loop.time()
            if left is not None:
                left -= min(REPLY_MARGIN_S, REPLY_MARGIN * left)
            if left is not None and left <= 0:
                replies.append(Message(role="tool", name=call.name,
                                       content="error: not run: the step's deadline ran out"))
                self._tool_errors += 1
                continue
            self._tool_calls += 1
            outcome = await self._server.call(call.name, call.arguments, left)
            self._tool_errors += outcome.is_error
            replies.append(Message(role="tool", name=call.name, content=outcome.text))
        if self._turns >= self._max_turns:
            return self._finish("", out_of_turns=True)
        return StepResult(observation=replies, done=False, info=self._info())

    def _finish(self, answer: str, *, out_of_turns: bool = False) -> StepResult:
        self._done = True
        return StepResult(observation=[], done=True, answer=answer, reference=self._reference,
                          info={**self._info(), "out_of_turns": out_of_turns})

    def _info(self) -> dict[str, Any]:
        return {"turns": self._turns, "tool_calls": self._tool_calls, "tool_errors": self._tool_errors}


def describe(server: McpServer) -> str:
    if server.cfg.description:
        return server.cfg.description
    names = [t["function"]["name"] for t in server.tools or ()]
    tools = f"tools {', '.join(names)}" if server.tools is not None else "tools not listed yet (server not reached)"
    return (f"{server.label}; {tools}; the final answer is the first reply without a tool call. "
            f"Config: {describe_config(McpTaskConfig)}.")


def mcp_spec(server: McpServer) -> EnvSpec:
    """The registry entry of `mcp:<name>`; its tools are those listed when the gateway started
    (ListEnvironments asks the server again, see McpEnvs)."""
    name = PREFIX + server.cfg.name
    return EnvSpec(name=name, description=describe(server), factory=lambda ctx: McpEnv(server, name, tool_format=ctx.tool_format),
                   config_type=McpTaskConfig, tools=tuple(server.tools or ()), max_turns=server.cfg.max_turns,
                   asynchronous=True)
