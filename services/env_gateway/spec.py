"""What an environment module needs to declare itself: `EnvSpec` and the `EnvContext` its factory
gets. Kept apart from the registry, which imports every built-in environment: a module (a built-in
or a user's plugin) imports this, never the registry, so nothing imports in a circle."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arlo.config import EnvGatewayConfig
from services.env_gateway.envs.base import Environment, EnvUnavailableError
from services.env_gateway.envs.python_exec import CodeRunner
from services.env_gateway.tool_schema import tools_json


class EnvContext:
    """What environment factories receive: the gateway's config and objects shared by sessions.

    Shared objects are built on first use, so a gateway whose clients never pick the python
    environment never probes for a sandbox.
    """

    def __init__(self, config: EnvGatewayConfig | None = None, *, sandbox: CodeRunner | None = None,
                 tool_format: str = "auto") -> None:
        self.config = config if config is not None else EnvGatewayConfig()
        self._sandbox = sandbox
        self.tool_format = tool_format
        """How the agent's tool calls are read (`model.tool_format`): the environments that read
        calls take it, and a plugin's may (`parse_tool_calls(..., format=ctx.tool_format)`)."""

    @property
    def sandbox(self) -> CodeRunner:
        if self._sandbox is None:
            from arlo.sandbox import Sandbox, SandboxError  # imported late: only the python env needs it

            try:
                self._sandbox = Sandbox(self.config.sandbox)
            except SandboxError as e:
                raise EnvUnavailableError(f"no code sandbox on this gateway: {e}") from e
        return self._sandbox


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvSpec:
    name: str
    description: str
    factory: Callable[[EnvContext], Environment]
    """A fresh instance per session."""
    config_type: type[Any]
    """The typed config (a frozen dataclass) that Reset's config_json is read into."""
    tools: Sequence[Mapping[str, Any]] = ()
    """Tool schemas in the OpenAI function format."""
    max_turns: int = 1
    """Upper bound on turns any config of this environment allows."""
    blocking: bool = False
    """reset/step may block (run code, do I/O): the gateway calls them in a worker thread.
    Cheap environments stay inline, where a StepBatch of them costs about one Step."""
    asynchronous: bool = False
    """reset/step are coroutines `reset(seed, config, deadline_s)`, `step(action, deadline_s)` that
    the gateway awaits on its event loop (environments that wait on a network service, like MCP);
    `deadline_s` is what is left of the caller's RPC deadline, or None."""
    tools_json: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools_json", tools_json(self.tools))
