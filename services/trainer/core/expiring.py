"""A step waits, bounded, for an in-flight group that would otherwise age past the staleness bound.

The admission rule (services/rollout/admission.py) lets a group start on version u only if it
fits into a batch trained at version u + max_staleness at the latest, counting groups in the
order they start. Batches take groups in the order they *finish*: a multi-turn episode or a slow
environment can still be running when younger groups fill the last batch it could have joined,
and at the next step it is too stale and dropped (the agent workload's async run dropped 4 of
1,280 trajectories, one group, after batches already took the oldest ready groups first).

So before a step the trainer asks whether the batch would leave such a group behind: one
admitted on the floor version (the oldest a batch may still hold), not yet here whole, while
the batch holds a younger group it could replace. Rollout workers mark each admitted group in
flight (`arlo.coord.records.mark_in_flight`); the trainer takes the mark off once it holds the
group whole (a worker unmarking after its write could do so before the trainer read the group,
which would then look neither in flight nor here), the worker only for a group it never wrote.
A mark is the version the admission check counted on, a lower bound (a swap before the group's
first token makes it one newer), so marks one below the floor count too. Then the step waits
for it, for at most `trainer.expiring_wait_s`: a worker that died mid-group leaves its mark
behind (waited for at two floors, then pruned). Only a batch holding a group younger than the
floor can leave one behind, so in synchronous mode no step asks Redis and no worker marks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


def may_leave_behind(batch_versions: Iterable[int], floor: int) -> bool:
    """Whether a batch of groups of these (oldest) policy versions could be taking the place of
    a group of version `floor`: only a group younger than the floor can."""
    return any(v > floor for v in batch_versions)


@dataclass
class ExpiringWait:
    """When to keep a step waiting for groups about to expire (`missing`), and for how long."""

    bound_s: float
    """The longest one floor version is waited for; 0: never wait."""
    waits: int = 0
    """Steps that waited."""
    timeouts: int = 0
    """Waits that ran out: the step went ahead, and the groups will be dropped as stale."""
    _floor: int = -1
    _since: float = 0.0
    _gave_up: int = -1  # the floor a wait ran out on: not waited for again

    def hold(self, missing: Collection[str], *, floor: int, now: float) -> bool:
        """True: the step should wait (for `missing`, groups of version `floor` still in flight)."""
        if not missing:
            self._floor = -1  # what it waited for came: a later wait on this floor starts afresh
            return False
        if self.bound_s <= 0 or floor == self._gave_up:
            return False
        if floor != self._floor:
            self._floor, self._since = floor, now
            self.waits += 1
        if now - self._since < self.bound_s:
            return True
        self.timeouts += 1
        self._gave_up = floor
        return False
