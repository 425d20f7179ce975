"""Live episodes: session id -> environment instance, with an idle timeout, a size bound and a
bound per client (one client flooding Resets must not take every session from the others)."""

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


class ClientSessionLimitError(SessionLimitError):
    """This client holds max_sessions_per_client live sessions (others may still open theirs)."""


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
    client: str = ""
    """Who opened it (the gRPC peer), for the per-client bound; "" in-process."""


class SessionStore:
    """Sessions ordered by last use, so expiring the idle ones is O(expired), not O(all).

    Expiry is lazy (on create and on lookup): no background task to manage, and an idle
    gateway does no work.
    """

    def __init__(self, *, idle_timeout_s: float, max_sessions: int, max_per_client: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`max_per_client`: live sessions one client may hold (0: no bound but `max_sessions`)."""
        if idle_timeout_s <= 0 or max_sessions < 1 or max_per_client < 0:
            raise ValueError("idle_timeout_s must be > 0, max_sessions >= 1 and max_per_client >= 0")
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        self.max_per_client = max_per_client
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._held: dict[str, int] = {}  # client -> its live sessions; no entry outlives its last

    def held_by(self, client: str) -> int:
        return self._held.get(client, 0)

    def _forget(self, session: Session) -> None:
        left = self._held[session.client] - 1
        if left:
            self._held[session.client] = left
        else:
            del self._held[session.client]

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
            self._forget(self._sessions.popitem(last=False)[1])
            dropped += 1
        return dropped

    def check_room(self, client: str = "") -> None:
        """Raises ClientSessionLimitError or SessionLimitError when `client` may not open one more."""
        self.expire()
        held = self._held.get(client, 0)
        if self.max_per_client and held >= self.max_per_client:
            raise ClientSessionLimitError(
                f"this client holds {held} open sessions (env_gateway.max_sessions_per_client is "
                f"{self.max_per_client}); close finished sessions or retry later")
        if len(self._sessions) >= self.max_sessions:
            raise SessionLimitError(f"{self.max_sessions} sessions are open (env_gateway.max_sessions); "
                                    "close finished sessions or retry later")

    def create(self, env_name: str, env: Environment, *, blocking: bool = False,
               asynchronous: bool = False, client: str = "") -> Session:
        self.check_room(client)
        held = self._held.get(client, 0)
        session = Session(id=uuid.uuid4().hex, env_name=env_name, env=env, last_used=self._clock(),
                          blocking=blocking, asynchronous=asynchronous, client=client)
        self._sessions[session.id] = session
        self._held[client] = held + 1
        return session

    def get(self, session_id: str) -> Session:
        """The session, marked as just used; SessionNotFoundError when unknown or expired."""
        session = self._sessions.get(session_id)
        now = self._clock()
        if session is None or now - session.last_used >= self.idle_timeout_s:
            if session is not None:
                del self._sessions[session_id]
                self._forget(session)
            raise SessionNotFoundError(f"session {session_id!r} is unknown, closed, or expired after "
                                       f"{self.idle_timeout_s:g}s idle; call Reset to start a new one")
        session.last_used = now
        self._sessions.move_to_end(session_id)
        return session

    def close(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._forget(session)
        return True
