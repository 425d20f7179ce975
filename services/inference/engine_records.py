"""What the engine hands out and keeps: a submitted request's handle, its counters, and the
timeline of decode chunks (services/inference/engine.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from services.inference.requests import OnDone, OnTokens, Sample, TokenDelta


@dataclass(kw_only=True)
class EngineStats:
    requests: int = 0
    generated_tokens: int = 0
    swaps: int = 0
    prefills: int = 0
    decode_chunks: int = 0
    decode_rows: int = 0
    """Sum over chunks of the sequences in the chunk: decode_rows / decode_chunks is the mean batch."""
    largest_batch: int = 0
    """Most sequences decoded in one chunk so far (inference.max_batch is the capacity)."""
    aborted: int = 0
    recomputed: int = 0
    """Requests stopped at a swap and continued on the new weights with their KV recomputed (partial rollouts)."""
    busy_s: float = 0.0
    """Wall time inside engine steps (prefill + decode); the rest of the time it waited for work."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkRecord:
    """One decode chunk on the timeline (for the bench's swap pause and batch figures)."""

    start: float
    end: float
    steps: int
    rows: int
    positions: int
    """Sum over rows of the cached length at the chunk's start (what attention reads)."""
    version: int


class RequestHandle:
    """A submitted request: `result()` blocks; the callbacks run on the engine thread."""

    def __init__(self, request_id: int, on_tokens: OnTokens | None, on_done: OnDone | None) -> None:
        self.id = request_id
        self._on_tokens = on_tokens
        self._on_done = on_done
        self._event = threading.Event()
        self._result: list[Sample] | BaseException | None = None

    def result(self, timeout: float | None = None) -> list[Sample]:
        if not self._event.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout}s")
        if isinstance(self._result, BaseException):
            raise self._result
        assert self._result is not None
        return self._result

    def _tokens(self, delta: TokenDelta) -> None:
        if self._on_tokens is not None:
            self._on_tokens(delta)

    def _done(self, result: list[Sample] | BaseException) -> None:
        self._result = result
        self._event.set()
        if self._on_done is not None:
            self._on_done(result)
