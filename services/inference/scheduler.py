"""Continuous batching over fixed slots: who waits, who runs, who finishes. No JAX, no gRPC.

The engine loop is vLLM v1's: `schedule()` admits waiting requests into free slots (they
are prefilled this step), the runner executes one prefill and one decode chunk over every
running sequence, and the engine reports tokens back with `append` / `finish`, which
frees slots for the next step. Requests from many callers share every decode step.

A request is admitted whole (its n samples share one prefill and need n slots at once)
and in arrival order: when the head of the queue does not fit, the requests behind it
wait too, so a large request is never starved by a stream of small ones. Slots are the
KV cache budget; a full engine queues requests, it never fails them.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.inference.requests import SamplingRequest
from services.inference.sessions import Parked, SessionCache, reusable_prefix


@dataclass(eq=False, kw_only=True)
class Sequence:
    """One sample of a request while it runs; the engine thread owns it."""

    request: Request
    index: int
    slot: int = -1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: set[int] = field(default_factory=set)
    """Policy versions that wrote this slot's KV (a session is parked only when it is one)."""
    finish_reason: str | None = None

    @property
    def position(self) -> int:
        """Where the newest token is fed next; the slot's KV is valid below it."""
        return len(self.request.params.prompt) + len(self.token_ids) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False, kw_only=True)
class Request:
    id: int
    params: SamplingRequest
    seed: int
    stop_ids: tuple[int, ...]
    seqs: list[Sequence] = field(default_factory=list)
    reuse: int = 0
    """Prompt tokens whose KV came from the session's parked slot: prefill starts here."""
    submitted_at: float = 0.0
    """time.perf_counter() when the engine took the request, and when a step admitted it."""
    admitted_at: float = 0.0

    def __post_init__(self) -> None:
        self.seqs = [Sequence(request=self, index=i) for i in range(self.params.n)]

    @property
    def session_key(self) -> str:
        return self.params.session_id if self.params.n == 1 else ""

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs)


class Scheduler:
    def __init__(self, *, num_slots: int, prefill_tokens: int) -> None:
        if num_slots < 1 or prefill_tokens < 1:
            raise ValueError("Scheduler: num_slots and prefill_tokens must be >= 1")
        self.num_slots = num_slots
        self.prefill_tokens = prefill_tokens
        self._free = list(range(num_slots))  # a heap: the lowest free slot goes first (deterministic)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.sessions = SessionCache()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        if req.params.n > self.num_slots:
            raise ValueError(f"n={req.params.n} exceeds the engine's {self.num_slots} slots")
        self.waiting.append(req)

    def schedule(self, versions: tuple[int, ...]) -> list[Request]:
        """Admits waiting requests, in order, while slots and this step's prefill budget last.
        `versions`: the version served per adapter slot (one entry without several adapters)."""
        admitted: list[Request] = []
        budget = self.prefill_tokens
        while self.waiting:
            req = self.waiting[0]
            own = self.sessions.peek(req.session_key) if req.session_key else None
            need = req.params.n - (own is not None)
            if need > len(self._free) + len(self.sessions) - (own is not None):
                break
            version = versions[req.params.adapter]
            tokens = len(req.params.prompt) - (reusable_prefix(own, req.params.prompt, version) if own else 0)
            if admitted and tokens > budget:
                break
            self.waiting.popleft()
            self._admit(req, version)
            budget -= tokens
            admitted.append(req)
        return admitted

    def decoding(self) -> list[Sequence]:
        """Every running sequence, in slot order (a stable batch layout)."""
        seqs = [s for r in self.running.values() for s in r.seqs if not s.finished and s.token_ids]
        return sorted(seqs, key=lambda s: s.slot)

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[float], version: int) -> None:
        seq.token_ids.extend(tokens)
        seq.logprobs.extend(logprobs)
        seq.versions.extend([version] * len(tokens))
        seq.kv_versions.add(version)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sample and releases its slot (parked for the session, or freed)."""
        assert not seq.finished, "a sample finishes once"
        seq.finish_reason = reason
        self._release(seq)
        if seq.request.done:
            self.running.pop(seq.request.id, None)

    def abort(self, request_id: int) -> Request | None:
        """Drops a waiting or running request at once; returns it, or None if unknown or done."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                for seq in req.seqs:
                    seq.finish_reason = "abort"
                return req
        req = self.running.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self._release(seq)
        return req

    def drop_sessions(self) -> None:
        """Forgets every parked slot (their KV is gone, e.g. after the cache was reset)."""
        while len(self.sessions):
            heapq.heappush(self._free, self.sessions.evict())

    def iter_running(self) -> Iterator[Request]:
        return iter(list(self.running.values()))

    def _admit(self, req: Request, version: int) -> None:
        stats = self.sessions.stats
        own = self.sessions.take(req.session_key) if req.session_key else None
        slots = []
        if own is not None:
            req.reuse = reusable_prefix(own, req.params.prompt, version)
            slots.append(own.slot)
        if req.session_key:
            stats.hits += req.reuse > 0
            stats.misses += req.reuse == 0
            stats.reused_tokens += req.reuse
        while len(self._free) < req.params.n - len(slots):
            heapq.heappush(self._free, self.sessions.evict())
        while len(slots) < req.params.n:
            slots.append(heapq.heappop(self._free))
        for seq, slot in zip(req.seqs, slots, strict=True):
            seq.slot = slot
            if req.reuse:
                seq.kv_versions.add(version)
        self.running[req.id] = req

    def _release(self, seq: Sequence) -> None:
        slot, seq.slot = seq.slot, -1
        if slot < 0:
            return
        key = seq.request.session_key
        if key and seq.finish_reason != "abort" and len(seq.kv_versions) == 1:
            tokens = (*seq.request.params.prompt, *seq.token_ids)[: max(seq.position, 0)]
            displaced = self.sessions.park(key, Parked(slot=slot, tokens=tokens, version=next(iter(seq.kv_versions))))
            if displaced is not None:
                heapq.heappush(self._free, displaced)
            return
        heapq.heappush(self._free, slot)
