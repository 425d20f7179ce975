"""Feeding stdin and reading stdout/stderr of a run with a byte cap and a deadline.

Never buffers more than `cap` bytes per stream: past the cap the run is stopped (a flood
would otherwise fill the service's memory) and the rest is read and dropped until EOF.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable
from dataclasses import dataclass

_CHUNK = 1 << 16
_DRAIN_S = 2.0
"""How long to keep reading after a stop before giving up on EOF (a process that
escaped the kill must not hang the caller)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Captured:
    stdout: bytes
    stderr: bytes
    flooded: bool
    """A stream passed the cap; `stop` was called."""
    backstop: bool
    """The deadline passed before EOF."""


def pump(*, stdin_fd: int, stdout_fd: int, stderr_fd: int, payload: bytes, cap: int, deadline: float,
         stop: Callable[[], None]) -> Captured:
    """Writes `payload` to stdin_fd and reads both outputs until EOF.

    `stop` is called once when an output passes `cap` or `deadline` (time.monotonic)
    passes; reading goes on until EOF or for _DRAIN_S more. Closes all three fds.
    """
    sel = selectors.DefaultSelector()
    bufs = {stdout_fd: bytearray(), stderr_fd: bytearray()}
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    view, sent = memoryview(payload), 0
    os.set_blocking(stdin_fd, False)
    sel.register(stdin_fd, selectors.EVENT_WRITE)
    flooded = backstop = False
    give_up = float("inf")
    open_fds = {stdin_fd, stdout_fd, stderr_fd}  # each closed exactly once: fd numbers are reused
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= give_up:
                break
            if now >= deadline and not backstop:
                backstop = True
                if not flooded:
                    stop()
                give_up = min(give_up, now + _DRAIN_S)
            wake = give_up if backstop else min(deadline, give_up)
            for key, _ in sel.select(max(0.0, wake - now)):
                fd = key.fd
                if fd == stdin_fd:
                    sent = _feed(fd, view, sent)
                    if sent >= len(view):  # all written, or the program will not read more
                        sel.unregister(fd)
                        _close(fd, open_fds)
                    continue
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                buf += chunk[:max(0, room)]
                if len(chunk) > room and not flooded:
                    flooded = True
                    stop()
                    give_up = min(give_up, time.monotonic() + _DRAIN_S)
    finally:
        sel.close()
        for fd in list(open_fds):
            _close(fd, open_fds)
    return Captured(stdout=bytes(bufs[stdout_fd]), stderr=bytes(bufs[stderr_fd]), flooded=flooded,
                    backstop=backstop)


def _feed(fd: int, view: memoryview, sent: int) -> int:
    """Writes what the pipe takes now; returns the new offset (len(view) when refused)."""
    try:
        return sent + os.write(fd, view[sent:sent + _CHUNK])
    except BlockingIOError:
        return sent
    except OSError:  # EPIPE: the program exited or closed its stdin, the rest is moot
        return len(view)


def _close(fd: int, open_fds: set[int]) -> None:
    open_fds.discard(fd)
    os.close(fd)
