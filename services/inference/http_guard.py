"""Bounds on the OpenAI endpoint's door (a uvicorn h11 server): connections, idle time, log lines.

An unauthenticated flood of idle connections once took every file descriptor of the inference
process (its gRPC API stopped answering, and the log grew by 105,345 error lines in 10 s), and
dripping request heads (slowloris) were held open for ever. Here:

- at most `max_connections` connections are open at once, counted on the accepted sockets
  themselves (`Listener`), so connections accepted but not yet handed to the protocol and TLS
  handshakes in progress count too; one over it is closed inside accept(), before asyncio makes
  a transport for it, counted, and not logged one by one;
- a connection that has not sent a complete request head within `read_timeout_s` of connecting,
  or of its first byte after a reply, is closed, and so is one whose TLS handshake takes longer;
- the servers' loggers (uvicorn's, asyncio's) pass at most `LOG_LINES` lines per `LOG_WINDOW_S`;
  what was dropped, and the connections refused, are summed up in one line per window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
LOG_LINES = 20
"""Lines each guarded logger passes per window; the rest are counted."""
LOG_WINDOW_S = 10.0
GUARDED_LOGGERS = ("uvicorn.error", "asyncio")
FD_SHARE = 2
"""At most 1/FD_SHARE of the process's descriptor limit goes to HTTP connections, whatever is
configured: gRPC, Redis and the model's files keep the rest."""


def connection_cap(configured: int) -> int:
    """`configured`, lowered to 1/FD_SHARE of this process's soft RLIMIT_NOFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return configured
    return max(1, min(configured, soft // FD_SHARE))


@dataclass
class DoorStats:
    refused: int = 0
    """Connections aborted because `max_connections` were open."""
    timed_out: int = 0
    """Connections closed for not sending a request head within `read_timeout_s`."""


class RateLimit(logging.Filter):
    """Passes at most `lines` records per `window_s` seconds; counts the rest (`take_dropped`)."""

    def __init__(self, lines: int = LOG_LINES, window_s: float = LOG_WINDOW_S) -> None:
        super().__init__()
        self.lines, self.window_s = lines, window_s
        self._start, self._passed, self._dropped = time.monotonic(), 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._start >= self.window_s:
            self._start, self._passed = now, 0
        if self._passed < self.lines:
            self._passed += 1
            return True
        self._dropped += 1
        return False

    def take_dropped(self) -> int:
        dropped, self._dropped = self._dropped, 0
        return dropped


class GuardedServer(uvicorn.Server):
    """uvicorn's server inside the service: no signal handlers of its own, and a TLS handshake
    not done within `handshake_timeout_s` dropped (uvicorn leaves asyncio's 60 s)."""

    def __init__(self, config: uvicorn.Config, *, handshake_timeout_s: float = 60.0) -> None:
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the service owns SIGTERM/SIGINT, not uvicorn
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, but serving `sockets` with `ssl_handshake_timeout`, which it does not pass."""
        if not sockets or self.config.ssl is None:
            return await super().startup(sockets)
        await super().startup([])  # everything but the listeners

        def protocol() -> asyncio.Protocol:
            return self.config.http_protocol_class(config=self.config, server_state=self.server_state,  # type: ignore[call-arg]
                                                   app_state=self.lifespan.state)

        loop = asyncio.get_running_loop()
        for sock in sockets:
            self.servers.append(await loop.create_server(protocol, sock=sock, ssl=self.config.ssl,
                                                         backlog=self.config.backlog,
                                                         ssl_handshake_timeout=self.handshake_timeout_s))


REFUSE_BATCH = 256
"""Connections over the cap closed per accept() call at most, so a flood cannot hold the loop."""


class Listener(socket.socket):
    """The endpoint's listening socket. Once `cap` is set, accept() closes each waiting connection
    while `limit` accepted sockets are open (a socket counts until it is closed: `_Conn`)."""

    def __init__(self, family: int, kind: int = socket.SOCK_STREAM) -> None:
        super().__init__(family, kind)
        self.limit: int | None = None
        self.stats = DoorStats()
        self.open = 0

    def cap(self, limit: int, stats: DoorStats) -> None:
        self.limit, self.stats = limit, stats

    def accept(self) -> tuple[socket.socket, Any]:
        for _ in range(REFUSE_BATCH):
            fd, addr = self._accept()  # type: ignore[attr-defined]  # BlockingIOError: none waiting
            if self.limit is None or self.open < self.limit:
                self.open += 1
                return _Conn(self, fd), addr
            os.close(fd)  # over the cap: no transport, no protocol, no log line
            self.stats.refused += 1
        raise BlockingIOError  # asyncio stops accepting for this turn of the loop, and comes back


class _Conn(socket.socket):
    """An accepted connection, counted against its Listener's cap until closed (or collected)."""

    def __init__(self, listener: Listener, fd: int) -> None:
        super().__init__(listener.family, listener.type, listener.proto, fileno=fd)
        self._listener: Listener | None = listener

    def _release(self) -> None:
        if self._listener is not None:
            self._listener.open -= 1
            self._listener = None

    def close(self) -> None:
        self._release()
        super().close()

    def detach(self) -> int:
        self._release()
        return super().detach()

    def __del__(self) -> None:  # never closed (a bug elsewhere): the count must not leak
        self._release()
        super().__del__()


def guarded_protocol(*, read_timeout_s: float, stats: DoorStats) -> type[H11Protocol]:
    """uvicorn's h11 protocol (Config(http=...)) with the request-head deadline."""

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_head():
                self._arm()  # the first byte of a head (after a reply) starts its clock; later ones do not
            super().data_received(data)
            if not self._waiting_for_head():
                self._disarm()

        def _waiting_for_head(self) -> bool:
            return self.conn.their_state is h11.IDLE

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(read_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self._waiting_for_head() and not self.transport.is_closing():
                stats.timed_out += 1
                self.transport.abort()

    return Guarded


async def report(stats: DoorStats, limits: list[RateLimit], window_s: float = LOG_WINDOW_S) -> None:
    """Every window: one line summing up the connections refused or timed out and the lines dropped."""
    reported = DoorStats()
    while True:
        await asyncio.sleep(window_s)
        refused, timed_out = stats.refused - reported.refused, stats.timed_out - reported.timed_out
        dropped = sum(limit.take_dropped() for limit in limits)
        reported = DoorStats(refused=stats.refused, timed_out=stats.timed_out)
        if refused or timed_out or dropped:
            log.warning("OpenAI endpoint, last %.0fs: %d connections refused (at the connection limit), %d closed "
                        "(no request head within the read timeout), %d log lines suppressed",
                        window_s, refused, timed_out, dropped)


def install_log_limits() -> list[RateLimit]:
    limits = []
    for name in GUARDED_LOGGERS:
        limit = RateLimit()
        logging.getLogger(name).addFilter(limit)
        limits.append(limit)
    return limits


def remove_log_limits(limits: list[RateLimit]) -> None:
    for name, limit in zip(GUARDED_LOGGERS, limits, strict=True):
        logging.getLogger(name).removeFilter(limit)
