"""The configured MCP servers (`env_gateway.mcp_servers`) as environments `mcp:<name>`: connected
and registered at gateway start, described live in ListEnvironments, closed on shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from arlo.config import ConfigError, McpServerConfig
from arlo.proto.v1 import env_pb2
from services.env_gateway.envs.base import EnvUnavailableError
from services.env_gateway.envs.mcp_env import PREFIX, describe, mcp_spec
from services.env_gateway.mcp_client import McpServer
from services.env_gateway.registry import EnvRegistry
from services.env_gateway.tool_schema import tools_json

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 5.0
"""ListEnvironments never waits longer than this on a server that is not connected."""


class McpEnvs:
    def __init__(self, servers: Sequence[McpServer]) -> None:
        self.servers = {PREFIX + s.cfg.name: s for s in servers}

    @classmethod
    async def start(cls, configs: Sequence[McpServerConfig], registry: EnvRegistry) -> McpEnvs:
        """Connects every server (concurrently) and registers its environment. A server that cannot
        be reached now is registered all the same (its Resets fail UNAVAILABLE until it answers);
        a name that clashes with another environment is a ConfigError."""
        try:
            import mcp as _  # noqa: F401
        except ImportError:
            raise ConfigError("env_gateway.mcp_servers needs the mcp package: pip install -e '.[mcp]'") from None
        mcp = cls([McpServer(c) for c in configs])
        try:
            await asyncio.gather(*(mcp._first_contact(s) for s in mcp.servers.values()))
            for i, server in enumerate(mcp.servers.values()):
                spec = mcp_spec(server)
                if registry.get(spec.name) is not None:
                    raise ConfigError(f"env_gateway.mcp_servers[{i}].name: {spec.name!r} is already an environment")
                registry.register(spec)
        except BaseException:
            await mcp.aclose()  # no process left behind by a gateway that did not start
            raise
        return mcp

    @staticmethod
    async def _first_contact(server: McpServer) -> None:
        try:
            tools = await server.list_tools()
            log.info("%s: %d tools", server.label, len(tools))
        except EnvUnavailableError as e:
            log.warning("%s; its environment is listed, and tried again on each Reset", e)

    def serves(self, env_name: str) -> bool:
        return env_name in self.servers

    async def info(self, env_name: str, deadline_s: float | None) -> env_pb2.EnvironmentInfo:
        server = self.servers[env_name]
        cap = min(t for t in (LIST_TIMEOUT_S, deadline_s) if t is not None)
        try:
            await server.list_tools(cap)
        except EnvUnavailableError:
            pass  # described as not reached, with the tools it had (if any)
        return env_pb2.EnvironmentInfo(name=env_name, description=describe(server),
                                       tools_json=tools_json(server.tools or ()), max_turns=server.cfg.max_turns)

    async def aclose(self) -> None:
        await asyncio.gather(*(s.aclose() for s in self.servers.values()))
