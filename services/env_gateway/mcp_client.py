"""One MCP tool server, as the gateway sees it: a shared client session, tool schemas, and tool
calls under a deadline.

One session per server, shared by every episode of `mcp:<name>`, opened on first use. It lives in
an owner task (the SDK's client is an anyio context that must be entered and left in one task);
a session whose transport died (the stdio process exited, the HTTP server went away) is dropped
and the next call opens a new one: for stdio that restarts the process. Connect failures,
crashes and tool calls that run out the server's own timeout feed a circuit breaker (the one
remote backends use): once open, calls fail fast with EnvUnavailableError until `breaker_reset_s`
has passed, which is the restart backoff, and a breaker that opens drops the session so the probe
starts from a fresh process.

What the agent gets: a tool's result or its own error (`is_error`), a timeout, or a crash during
the call are all a `ToolOutcome` (an observation it can react to). Only a server that cannot be
reached at all raises EnvUnavailableError: the step fails (UNAVAILABLE) instead of training the
agent on an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from arlo.config import McpServerConfig
from services.env_gateway.breaker import OPEN, CircuitBreaker
from services.env_gateway.envs.base import EnvUnavailableError

log = logging.getLogger(__name__)

MAX_RESULT_CHARS = 16384
"""A tool result longer than this is cut (with a note): one chatty tool must not fill the context."""
CLOSE_TIMEOUT_S = 5.0
"""Closing a session waits this long (the SDK gives a stdio server 2s after closing its stdin, then
kills its process tree)."""
STDERR_TAIL_CHARS = 1500
"""How much of a stdio server's own error output (its end) travels with a failed connect: "Connection
closed" alone hid "No module named 'mcp'" in the gateway's log (issue 33, item 3)."""


class ServerFailed(ConnectionError):
    """The server's session could not be opened; the message ends with what the server wrote to stderr."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolOutcome:
    text: str
    is_error: bool = False


def openai_tool(tool: Any) -> dict[str, Any]:
    """An MCP `Tool` in the OpenAI function format (what chat templates and tool_calls.py read)."""
    schema = dict(tool.input_schema or {"type": "object", "properties": {}})
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": schema}}


def result_text(result: Any) -> ToolOutcome:
    """A `CallToolResult` as observation text: its text blocks joined, other blocks named, the
    structured content when there is no text."""
    parts: list[str] = []
    for block in result.content:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'non-text')} content omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, default=str))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[... {len(text) - MAX_RESULT_CHARS} more characters cut]"
    if result.is_error and not text.lower().startswith("error"):
        text = f"error: {text}"
    return ToolOutcome(text=text, is_error=bool(result.is_error))


class _Connection:
    """A live client session and the task that owns it."""

    def __init__(self) -> None:
        self.client: Any = None
        self.tools: list[dict[str, Any]] = []
        self.stop = asyncio.Event()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done() and not self.stop.is_set()


class McpServer:
    """See the module docstring. Use inside the event loop that serves the gateway."""

    def __init__(self, cfg: McpServerConfig) -> None:
        self.cfg = cfg
        self.label = f"MCP server {cfg.name!r} ({' '.join(cfg.command) if cfg.command else cfg.url})"
        self.breaker = CircuitBreaker(failures=cfg.breaker_failures, reset_s=cfg.breaker_reset_s)
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._conn: _Connection | None = None
        self._opening: asyncio.Task[_Connection] | None = None
        self._old: set[asyncio.Task[None]] = set()
        self.tools: list[dict[str, Any]] | None = None
        """The tool schemas of the last session opened; None until one was."""
        self.restarts = 0
        """Sessions opened after the first: how often it was reconnected."""

    # -- the session -------------------------------------------------------------------------

    def _client(self, http_client: Any, errlog: Any) -> Any:
        from mcp import Client, StdioServerParameters  # imported late: the gateway runs without mcp
        if self.cfg.command:
            from mcp.client.stdio import stdio_client
            params = StdioServerParameters(command=self.cfg.command[0], args=list(self.cfg.command[1:]),
                                           env=dict(self.cfg.env) or None, cwd=self.cfg.cwd or None)
            return Client(stdio_client(params, errlog=errlog), mode="legacy")
        from mcp.client.streamable_http import streamable_http_client
        return Client(streamable_http_client(self.cfg.url, http_client=http_client), mode="legacy")

    async def _own(self, conn: _Connection) -> None:
        """Holds the session open until `conn.stop`; its end (any reason) marks the session dead.
        A stdio server's stderr goes to a file of the session's, whose end joins a failed connect's
        error and is logged when the session ends."""
        errlog = tempfile.TemporaryFile() if self.cfg.command else None  # noqa: SIM115 (closed below)
        try:
            async with contextlib.AsyncExitStack() as stack:
                http_client = None
                if self.cfg.url:
                    import httpx2  # the mcp SDK's HTTP client
                    http_client = await stack.enter_async_context(httpx2.AsyncClient(
                        headers=dict(self.cfg.headers), timeout=httpx2.Timeout(30.0, read=300.0)))
                conn.client = await stack.enter_async_context(self._client(http_client, errlog))
                conn.tools = await self._list_tools(conn.client)
                conn.ready.set_result(None)
                await conn.stop.wait()
        except BaseException as e:  # the owner must end quietly: callers learn of it through `ready`
            if not conn.ready.done():
                failure = e if isinstance(e, Exception) else ConnectionError("cancelled")
                if tail := _tail(errlog):
                    failure = ServerFailed(f"{_describe(failure)}; the server's stderr ends: {tail}")
                conn.ready.set_exception(failure)
            elif not conn.stop.is_set():
                log.warning("%s: the session ended: %s%s", self.label, _describe(e),
                            f"; the server's stderr ends: {tail}" if (tail := _tail(errlog)) else "")
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            conn.stop.set()
            if errlog is not None:
                errlog.close()

    @staticmethod
    async def _list_tools(client: Any) -> list[dict[str, Any]]:
        tools: list[dict[str, Any]] = []
        cursor = None
        for _ in range(100):  # a paginator that never ends must not hang the connect
            page = await client.list_tools(cursor=cursor)
            tools += [openai_tool(t) for t in page.tools]
            cursor = page.next_cursor
            if not cursor:
                break
        return tools

    async def _open(self) -> _Connection:
        conn = _Connection()
        conn.task = asyncio.get_running_loop().create_task(self._own(conn), name=f"mcp-{self.cfg.name}")
        try:
            async with asyncio.timeout(self.cfg.connect_timeout_s):
                await asyncio.shield(conn.ready)
        except BaseException:
            conn.task.cancel()
            await asyncio.gather(conn.task, return_exceptions=True)
            raise
        if self.tools is not None:
            self.restarts += 1
            log.info("%s: reconnected (restart %d)", self.label, self.restarts)
        self.tools = conn.tools
        self._conn = conn
        return conn

    async def _connected(self, end: float) -> _Connection:
        """The live session, opening one (shared by concurrent callers) if there is none."""
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        if conn is not None:
            self._drop(conn)
        if self._opening is None or self._opening.done():
            self._opening = asyncio.get_running_loop().create_task(self._open())
            # Retrieved even when every waiter gave up first (no "exception never retrieved").
            self._opening.add_done_callback(lambda t: t.cancelled() or t.exception())
        async with asyncio.timeout_at(end):
            return await asyncio.shield(self._opening)

    def _drop(self, conn: _Connection) -> None:
        """Ends a session in the background (a stdio process gets its stdin closed, then killed)."""
        if self._conn is conn:
            self._conn = None
        conn.stop.set()
        if conn.task is not None and not conn.task.done():
            self._old.add(conn.task)
            conn.task.add_done_callback(self._old.discard)

    def _failed(self, error: str, conn: _Connection | None) -> None:
        self.breaker.failure(error)
        if conn is not None and self.breaker.state == OPEN:
            self._drop(conn)  # a hung server is restarted by the probe, not reused

    # -- calls -------------------------------------------------------------------------------

    def _unavailable(self, reason: str) -> EnvUnavailableError:
        return EnvUnavailableError(f"{self.label} is unavailable: {reason}")

    async def list_tools(self, deadline_s: float | None = None) -> list[dict[str, Any]]:
        """The server's tools (OpenAI format), connecting if needed; EnvUnavailableError if it cannot."""
        if self.tools is not None and self._conn is not None and self._conn.alive:
            return self.tools
        loop = asyncio.get_running_loop()
        end = loop.time() + min(t for t in (self.cfg.connect_timeout_s, deadline_s) if t is not None)
        reason = self.breaker.allow()
        if reason:
            if self.tools is not None:
                return self.tools  # known from an earlier session: Reset can still show them
            raise self._unavailable(reason)
        try:
            await self._connected(end)
        except Exception as e:
            self._failed(f"connect: {_describe(e)}", None)
            raise self._unavailable(f"cannot connect: {_describe(e)}") from None
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        self.breaker.success()
        assert self.tools is not None
        return self.tools

    async def call(self, name: str, arguments: dict[str, Any], deadline_s: float | None) -> ToolOutcome:
        """Calls tool `name` under min(timeout_s, deadline_s); see the module docstring for outcomes."""
        loop = asyncio.get_running_loop()
        timeout = min(t for t in (self.cfg.timeout_s, deadline_s) if t is not None)
        config_bound = deadline_s is None or timeout < deadline_s  # the caller's deadline is no verdict
        end = loop.time() + timeout
        reason = self.breaker.rejection()
        if reason:
            raise self._unavailable(reason)
        try:
            async with asyncio.timeout_at(end):
                await self._slots.acquire()
        except TimeoutError:
            return ToolOutcome(is_error=True, text=f"error: {name} was not run: all {self.cfg.max_concurrency} "
                                                   f"call slots of the server stayed busy for {timeout:.3g}s")
        try:
            reason = self.breaker.allow()
            if reason:
                raise self._unavailable(reason)
            return await self._call(name, arguments, end, timeout, config_bound)
        finally:
            self._slots.release()

    async def _call(self, name: str, arguments: dict[str, Any], end: float, timeout: float,
                    config_bound: bool) -> ToolOutcome:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            conn = await self._connected(end)
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except Exception as e:
            self._failed(f"connect: {_describe(e)}", None)
            raise self._unavailable(f"cannot connect: {_describe(e)}") from None
        try:
            async with asyncio.timeout_at(end):
                result = await conn.client.call_tool(name, arguments)
        except TimeoutError:
            if config_bound:
                self._failed(f"{name} timed out", conn)
            else:
                self.breaker.abandon()
            return ToolOutcome(is_error=True, text=f"error: {name} did not answer within {timeout:.3g}s")
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except MCPError as e:
            if e.error.code != CONNECTION_CLOSED:
                self.breaker.success()  # the server answered: it is up, the call was wrong
                return ToolOutcome(is_error=True, text=f"error: {e.error.message}")
            return self._crashed(name, conn, e)
        except Exception as e:  # the transport broke (a closed stream, a failed HTTP request)
            return self._crashed(name, conn, e)
        self.breaker.success()
        return result_text(result)

    def _crashed(self, name: str, conn: _Connection, error: BaseException) -> ToolOutcome:
        log.warning("%s: %s failed: %s; the session is dropped", self.label, name, _describe(error))
        self._drop(conn)
        self._failed(f"{name}: {_describe(error)}", None)
        return ToolOutcome(is_error=True, text=f"error: the tool server failed during {name} "
                                               f"({_describe(error)}); it is being restarted")

    async def aclose(self) -> None:
        """Ends the session and any dropped ones still closing; a stdio process is gone after this."""
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
            await asyncio.gather(self._opening, return_exceptions=True)
        if self._conn is not None:
            self._drop(self._conn)
        pending = list(self._old)
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=CLOSE_TIMEOUT_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def _tail(errlog: Any) -> str:
    """The end of what a stdio server wrote to stderr (read without moving the file's offset, which
    the process shares), on one line; "" without any."""
    if errlog is None:
        return ""
    try:
        size = os.fstat(errlog.fileno()).st_size
        start = max(0, size - STDERR_TAIL_CHARS * 4)
        text = os.pread(errlog.fileno(), size - start, start).decode(errors="replace")
    except (OSError, ValueError):
        return ""
    text = " | ".join(line.strip() for line in text.splitlines() if line.strip())
    return text[-STDERR_TAIL_CHARS:]


def _describe(error: BaseException) -> str:
    if isinstance(error, BaseExceptionGroup) and error.exceptions:
        return _describe(error.exceptions[0])
    if isinstance(error, ServerFailed):
        return str(error)
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
