"""Live episodes: session id -> environment instance, with an idle timeout and a size bound."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.env_gateway.envs.base import Environment


class SessionNotFoundError(LookupError):
    """Unknown, closed or expired session."""


class SessionLimitError(RuntimeError):
    """max_sessions are live."""


class SessionBusyError(RuntimeError):
    """A step of this session is still running (blocking environments only)."""


@dataclass(slots=True)
class Session:
    id: str
    env_name: str
    env: Environment
    last_used: float
    blocking: bool = False
    """Its steps run in a worker thread (see Gateway.step_async)."""
    asynchronous: bool = False
    """Its env's reset/step are coroutines, awaited on the event loop (see EnvSpec.asynchronous)."""
    busy: bool = False
    """A step is running in a worker thread; a second one would race it."""


class SessionStore:
    """Sessions ordered by last use, so expiring the idle ones is O(expired), not O(all).

    Expiry is lazy (on create and on lookup): no background task to manage, and an idle
    gateway does no work.
    """

    def __init__(self, *, idle_timeout_s: float, max_sessions: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if idle_timeout_s <= 0 or max_sessions < 1:
            raise ValueError("idle_timeout_s must be > 0 and max_sessions >= 1")
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def expire(self) -> int:
        """Drops sessions idle for longer than the timeout; returns how many."""
        cutoff = self._clock() - self.idle_timeout_s
        dropped = 0
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest.last_used > cutoff:
                break
            self._sessions.popitem(last=False)
            dropped += 1
        return dropped

    def create(self, env_name: str, env: Environment, *, blocking: bool = False,
               asynchronous: bool = False) -> Session:
        self.expire()
        if len(self._sessions) >= self.max_sessions:
            raise SessionLimitError(f"{self.max_sessions} sessions are open (env_gateway.max_sessions); "
                                    "close finished sessions or retry later")
        session = Session(id=uuid.uuid4().hex, env_name=env_name, env=env, last_used=self._clock(),
                          blocking=blocking, asynchronous=asynchronous)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The session, marked as just used; SessionNotFoundError when unknown or expired."""
        session = self._sessions.get(session_id)
        now = self._clock()
        if session is None or now - session.last_used >= self.idle_timeout_s:
            if session is not None:
                del self._sessions[session_id]
            raise SessionNotFoundError(f"session {session_id!r} is unknown, closed, or expired after "
                                       f"{self.idle_timeout_s:g}s idle; call Reset to start a new one")
        session.last_used = now
        self._sessions.move_to_end(session_id)
        return session

    def close(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None
