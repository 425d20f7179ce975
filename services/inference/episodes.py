"""What the OpenAI endpoint remembers per episode: each call's exact tokens, bounded. Pure.

A call tied to an episode (the `X-Arlo-Episode` header or the `user` field) is recorded
with the prompt ids the engine saw and each choice's sampled ids, logprobs and policy
versions, so the rollout can rebuild the trajectory without re-tokenizing anything.

The log also keeps, per returned choice, a *branch*: the conversation that led to it (a
canonical key of its messages and tools) and the full token sequence so far (prompt +
sampled + the turn's closing token). A later call whose messages start with a branch's
conversation plus that very reply continues from those tokens instead of re-rendering them
(`openai_chat.build_prompt`), which is what makes a multi-turn black-box episode token-exact.

Bounds: `max_calls` per episode (later calls are served and counted in `dropped`), a TTL
since the episode was last touched, and `max_episodes` (least recently used dropped first).
Everything runs on the service's event loop, so there is no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_BRANCHES = 16
"""Replies an episode can continue from (n > 1 calls and retries make several)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordedChoice:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    finish_reason: str
    routed_experts: bytes = b""
    """Each token's experts, packed as Completion.routed_experts (arlo/routing_replay.py), on a
    model with routed experts (a black-box episode of a run with routing replay is then replayed
    like any other); else empty."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordedCall:
    prompt_token_ids: tuple[int, ...]
    choices: tuple[RecordedChoice, ...]
    kind: str
    """"chat" or "completion"."""
    continued: bool
    """The prompt was built on an earlier call's tokens (see the module docstring)."""
    created_at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Branch:
    key: tuple[str, ...]
    """Canonical messages (the reply last), then the tools' canonical JSON as one more entry."""
    tokens: tuple[int, ...]


@dataclass(kw_only=True)
class EpisodeLog:
    calls: list[RecordedCall] = field(default_factory=list)
    dropped: int = 0
    branches: list[Branch] = field(default_factory=list)
    touched: float = 0.0


class EpisodeRecorder:
    def __init__(self, *, max_episodes: int, max_calls: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_episodes, self.max_calls, self.ttl_s = max_episodes, max_calls, ttl_s
        self._clock = clock
        self._logs: OrderedDict[str, EpisodeLog] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._logs)

    def record(self, episode_id: str, call: RecordedCall, branches: list[Branch]) -> None:
        log = self._touch(episode_id, create=True)
        assert log is not None
        if len(log.calls) >= self.max_calls:
            log.dropped += 1
            return
        log.calls.append(call)
        log.branches = (log.branches + branches)[-MAX_BRANCHES:]

    def branches(self, episode_id: str) -> list[Branch]:
        log = self._touch(episode_id, create=False)
        return list(log.branches) if log is not None else []

    def take(self, episode_id: str, *, keep: bool = False) -> EpisodeLog | None:
        """The episode's log, forgotten unless `keep` (the caller owns it now)."""
        log = self._touch(episode_id, create=False)
        if log is not None and not keep:
            del self._logs[episode_id]
        return log

    def _touch(self, episode_id: str, *, create: bool) -> EpisodeLog | None:
        now = self._clock()
        self._expire(now)
        log = self._logs.get(episode_id)
        if log is None:
            if not create:
                return None
            log = self._logs[episode_id] = EpisodeLog()
            while len(self._logs) > self.max_episodes:
                self._logs.popitem(last=False)
                self.evicted += 1
        self._logs.move_to_end(episode_id)
        log.touched = now
        return log

    def _expire(self, now: float) -> None:
        while self._logs:
            oldest_id, oldest = next(iter(self._logs.items()))
            if now - oldest.touched <= self.ttl_s:
                return
            del self._logs[oldest_id]
            self.evicted += 1
