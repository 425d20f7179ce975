"""An MCP tool server for arlo's `mcp:` environments, written with the mcp SDK (MCPServer, the
FastMCP of mcp 1.x). The gateway runs it over stdio (see gateway.yaml); for streamable HTTP run
`python -m examples.mcp_env.tools_server --http 8000` and point `url` at http://127.0.0.1:8000/mcp.
"""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("unit-tools", log_level="WARNING")

_METRES = {"m": 1.0, "km": 1000.0, "cm": 0.01, "mi": 1609.344, "ft": 0.3048, "in": 0.0254}


@server.tool()
def convert(value: float, from_unit: str, to_unit: str) -> float:
    """Convert a length between units: m, km, cm, mi, ft, in."""
    for unit in (from_unit, to_unit):
        if unit not in _METRES:
            raise ToolError(f"unknown unit {unit!r}; known: {sorted(_METRES)}")
    return round(value * _METRES[from_unit] / _METRES[to_unit], 6)


@server.tool()
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", port=int(sys.argv[2]) if len(sys.argv) > 2 else 8000)
    else:
        server.run("stdio")
