"""Multi-turn sessions: a finished turn's slot stays parked with its KV so the next turn
prefills only the tokens it adds.

A parked slot is idle capacity: the scheduler evicts the least recently used one whenever
a new request needs a slot, so sessions never make a request wait. Reuse is exact or not
at all: only the longest common prefix of the parked tokens and the new prompt is kept,
and only when every cached key/value came from the policy version now served (KV from
older weights would make the next turn differ from a fresh prefill).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Parked:
    slot: int
    tokens: tuple[int, ...]
    """The tokens whose KV the slot holds, at positions 0..len-1."""
    version: int
    """The one policy version that wrote all of that KV."""


@dataclass(kw_only=True, slots=True)
class SessionStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    reused_tokens: int = 0


def reusable_prefix(parked: Parked, prompt: Sequence[int], version: int) -> int:
    """Prompt tokens whose KV the parked slot already holds; at least one token is always
    prefilled, because its logits give the first sampled token."""
    if parked.version != version:
        return 0
    limit = min(len(parked.tokens), len(prompt) - 1)
    same = 0
    while same < limit and parked.tokens[same] == prompt[same]:
        same += 1
    return same


class SessionCache:
    """Parked slots by session id, least recently parked first."""

    def __init__(self) -> None:
        self._parked: OrderedDict[str, Parked] = OrderedDict()
        self.stats = SessionStats()

    def __len__(self) -> int:
        return len(self._parked)

    def peek(self, session_id: str) -> Parked | None:
        return self._parked.get(session_id)

    def take(self, session_id: str) -> Parked | None:
        return self._parked.pop(session_id, None)

    def park(self, session_id: str, parked: Parked) -> int | None:
        """Returns the slot of an entry this one replaces (two turns of one session ran at once)."""
        old = self._parked.pop(session_id, None)
        self._parked[session_id] = parked
        return None if old is None else old.slot

    def evict(self) -> int:
        _, parked = self._parked.popitem(last=False)
        self.stats.evictions += 1
        return parked.slot
