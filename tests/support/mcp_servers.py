"""Real MCP servers (the `mcp` SDK's MCPServer, formerly FastMCP) for the gateway's tests.

`python -m tests.support.mcp_servers [--http]`: stdio by default; with --http it serves streamable
HTTP on an ephemeral port of 127.0.0.1 and prints `PORT <n>` once it listens (tests read it).

Tools: add and echo (answer at once), hang (never answers: the deadline test), crash (the
process exits mid-call: the restart test), fail (raises: a tool error), pid (which process
answered, so a test can tell a restarted server from the first one).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("arlo-test-tools", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
async def hang(seconds: float = 3600.0) -> str:
    """Sleep for `seconds` (default: an hour), then answer."""
    await asyncio.sleep(seconds)
    return "woke up"


@server.tool()
def crash() -> str:
    """Kill this server process in the middle of the call."""
    os._exit(3)


@server.tool()
def fail(reason: str) -> str:
    """Raise an error with the given reason."""
    raise ToolError(reason)


@server.tool()
def pid() -> int:
    """The process id of the server."""
    return os.getpid()


async def serve_http() -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    app = server.streamable_http_app(host="127.0.0.1")
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    http = uvicorn.Server(config)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    await http.serve(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", action="store_true")
    if parser.parse_args().http:
        asyncio.run(serve_http())
    else:
        server.run("stdio")


if __name__ == "__main__":
    sys.exit(main())
