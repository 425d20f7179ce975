"""The groups the trainer holds, through their life: pending (members still arriving) -> ready
(whole, fresh) -> in step -> trained (held until durable, core/holds.py) -> acknowledged; or
dropped (stale, failed, equal rewards: acknowledged) or dead-lettered (malformed, poisoned, a
step that failed `STEP_ATTEMPTS` times or was refused).

Entries are de-duplicated against everything held (a group waiting for members, a ready group,
the step in flight, steps held for a checkpoint), judged against the staleness bound at the
version the next step trains from (core/lineage.py), and handed out oldest policy first. Every
method returns what the driver must do (core/records.py); nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from services.trainer.core.expiring import ExpiringWait, may_leave_behind
from services.trainer.core.groups import (
    GroupAssembler,
    ReadyGroup,
    group_oldest_version,
    has_reward_spread,
)
from services.trainer.core.lineage import Lineage
from services.trainer.core.records import Ack, CountStale, DeadLetter, Decision, Screened, TrainedStep, Wait

STEP_ATTEMPTS = 3
"""Tries of a batch whose step raises before its groups are dead-lettered with the error."""


class GroupBook:
    """`held_for_durability`: the trained steps not yet acknowledged (core/holds.py)."""

    def __init__(self, *, lineage: Lineage, groups_per_step: int, vocab_size: int, filter_zero_variance: bool,
                 expiring_wait_s: float, held_for_durability: Callable[[], Iterable[TrainedStep]],
                 routing_bytes: int = 0, kept_width: int = 0) -> None:
        self.lineage = lineage
        self.groups_per_step = groups_per_step
        self.filter_zero_variance = filter_zero_variance
        self.held_for_durability = held_for_durability
        self.assembler = GroupAssembler(max_staleness=lineage.max_staleness, vocab_size=vocab_size, lineage=lineage,
                                        routing_bytes=routing_bytes, kept_width=kept_width)
        self.expiring = ExpiringWait(bound_s=expiring_wait_s)
        self.ready: list[ReadyGroup] = []
        self.in_step: list[ReadyGroup] = []
        self.counts = {"repeats": 0, "zero_variance": 0, "malformed": 0, "poisoned": 0,
                       "step_error": 0, "nonfinite_step": 0}
        """Entries finished with, by reason; each moves once the driver reports its move done."""
        self._attempts: dict[str, int] = {}  # first entry id of a group -> failed steps it was in
        self._arrived: set[str] = set()  # groups held whole here since the in-flight set was last told

    # -- intake -----------------------------------------------------------------------------

    def screen(self, entries: Sequence[Any]) -> Screened:
        """Entries read (`StreamEntry`s) sorted into repeats of what is held and candidates for the
        stream's `seen:` check. XAUTOCLAIM and the pending re-read also return entries held here
        (waiting for their group, their batch or a checkpoint): taking them again would train them
        twice; another entry of a held trajectory is a producer's retry, finished with."""
        held_entries, held_trajs = self.held()
        entries = [e for e in entries if e.entry_id not in held_entries]
        repeats = tuple(e.entry_id for e in entries if e.trajectory.id in held_trajs)
        return Screened(repeats=Ack(repeats, "repeat") if repeats else None,
                        candidates=[e for e in entries if e.trajectory.id not in held_trajs])

    def admit(self, fresh: Sequence[Any], *, version: int, read_at: float, now: float) -> list[Decision]:
        """Takes unseen entries in; groups complete and fresh at `version` join the ready list."""
        drops = self.assembler.drops
        before = dataclasses.replace(drops)
        self.assembler.add(((e.entry_id, e.trajectory) for e in fresh), newest=version)
        self._arrived.update(g for g in {e.trajectory.group_id for e in fresh} if self.assembler.has_whole(g))
        ready, dropped = self.assembler.take_ready(version)
        decisions: list[Decision] = []
        dead = self.assembler.take_dead()
        for kind in ("malformed", "poisoned"):
            # The count covers whole groups judged malformed too (acknowledged, not dead-lettered).
            items = tuple(d for d in dead if (kind == "malformed") == bool(self.assembler.malformed(d[1])))
            count = getattr(drops, kind) - getattr(before, kind)
            if items or count:
                decisions.append(DeadLetter(items, kind, count))
        if drops.stale > before.stale:
            decisions.append(CountStale(drops.stale - before.stale))
        if self.filter_zero_variance:
            flat = [g for g in ready if not has_reward_spread(g)]
            ready = [g for g in ready if has_reward_spread(g)]
            dropped += [e for g in flat for e in g.entry_ids]
            self.counts["zero_variance"] += sum(len(g.entry_ids) for g in flat)
        self.ready.extend(dataclasses.replace(g, read_at=read_at or now, ready_at=now) for g in ready)
        if dropped:
            decisions.append(Ack(tuple(dropped), "dropped"))
        return decisions

    def held(self) -> tuple[set[str], set[str]]:
        """Entry ids and trajectory ids taken in but not yet acknowledged."""
        entries: set[str] = set()
        trajs: set[str] = set()
        for members in self.assembler.pending.values():
            entries.update(members)
            trajs.update(t.id for t in members.values())
        for group in (*self.ready, *self.in_step):
            entries.update(group.entry_ids)
            trajs.update(t.id for t in group.trajectories)
        for step in self.held_for_durability():
            entries.update(step.entry_ids)
            trajs.update(step.trajectory_ids)
        return entries, trajs

    def take_arrived(self) -> set[str]:
        """Groups held whole since the in-flight set was last told (the driver tells it)."""
        arrived, self._arrived = self._arrived, set()
        return arrived

    def untold(self, arrived: set[str]) -> None:
        """Telling the in-flight set failed: tell it next time."""
        self._arrived |= arrived

    # -- batches ----------------------------------------------------------------------------

    def drop_stale(self, version: int) -> list[Decision]:
        """Groups admitted at an older version may have aged past the bound while earlier steps
        trained: judged again at the version the next step trains from, so no trained token is
        ever further behind than the bound (or from before the warm start)."""
        stale = [g for g in self.ready if not self.lineage.admissible(group_oldest_version(g.trajectories), version)]
        if not stale:
            return []
        self.ready = [g for g in self.ready if not any(g is s for s in stale)]
        entry_ids = tuple(e for g in stale for e in g.entry_ids)
        self.assembler.drops.stale += len(entry_ids)
        return [CountStale(len(entry_ids)), Ack(entry_ids, "stale")]

    def candidates(self) -> list[ReadyGroup]:
        """The groups the next step takes, left in place. A batch needs one group size; groups of
        another size wait for their own batch. Oldest policy first: groups finish out of the order
        they started (multi-turn episodes, slow environments), and one left behind by younger ones
        would age past the staleness bound at the next step and be dropped."""
        if not self.ready:
            return []
        size = len(self.ready[0].trajectories)
        return sorted((g for g in self.ready if len(g.trajectories) == size),
                      key=lambda g: group_oldest_version(g.trajectories))[: self.groups_per_step]

    def batch_full(self) -> bool:
        return len(self.ready) >= self.groups_per_step

    def next_batch(self, version: int, now: float, in_flight: set[str] | None = None) -> list[ReadyGroup] | Wait:
        """The next step's groups (out of the ready list, into the step), or why not yet.
        `in_flight`: the in-flight set's answer for the floor a `Wait` asked about (None: not asked,
        or asking failed: not knowing costs at most the groups it would have waited for)."""
        if not self.batch_full():
            return Wait(f"{len(self.ready)} of trainer.groups_per_step={self.groups_per_step} groups ready")
        floor = self.lineage.floor(version)
        versions = [self.lineage.effective(group_oldest_version(g.trajectories)) for g in self.candidates()]
        if self.expiring.bound_s > 0 and may_leave_behind(versions, floor):
            if in_flight is None:
                return Wait("asking which groups are still in flight", in_flight_floor=floor)
            # Part of a group read, the rest still on its way. Below the floor it is too old anyway.
            partial = {gid for gid, members in self.assembler.pending.items()
                       if self.lineage.effective(group_oldest_version(list(members.values()))) == floor}
            missing = partial | {gid for gid in in_flight if not self.assembler.has_whole(gid)}
            if self.expiring.hold(missing, floor=floor, now=now):
                return Wait(f"{len(missing)} group(s) of version {floor} still in flight (trainer.expiring_wait_s)")
        batch = self.candidates()
        self.ready = [g for g in self.ready if not any(g is s for s in batch)]
        self.in_step = batch
        return batch

    # -- what became of a step's groups ----------------------------------------------------

    def trained(self) -> list[ReadyGroup]:
        """The step in flight applied: its groups' earlier failures are forgotten."""
        groups, self.in_step = self.in_step, []
        for g in groups:
            self._attempts.pop(g.entry_ids[0], None)
        return groups

    def step_failed(self, error: BaseException) -> list[Decision]:
        """The step in flight raised before its update applied: groups with tries left go back to
        the front of the ready list, the rest are dead-lettered with the error (never dropped,
        never acknowledged untrained)."""
        groups, self.in_step = self.in_step, []
        again, dead = [], []
        for g in groups:
            n = self._attempts[g.entry_ids[0]] = self._attempts.get(g.entry_ids[0], 0) + 1
            (dead if n >= STEP_ATTEMPTS else again).append(g)
        self.ready[:0] = again
        for g in dead:
            self._attempts.pop(g.entry_ids[0], None)
        if not dead:
            return []
        reason = f"step failed {STEP_ATTEMPTS} times: {type(error).__name__}: {error}"
        items = _items(dead, reason)
        return [DeadLetter(items, "step_error", len(items))]

    def refuse(self, groups: Sequence[ReadyGroup], reason: str) -> DeadLetter:
        """A step that would corrupt the weights (a non-finite loss, gradient or parameter):
        nothing published, its groups dead-lettered at once."""
        self.in_step = []
        for g in groups:
            self._attempts.pop(g.entry_ids[0], None)
        items = _items(groups, reason)
        return DeadLetter(items, "nonfinite_step", len(items))

    def dead_lettered(self, decision: DeadLetter) -> None:
        """A dead-letter move is durable: the counts a reader sees move now, with it."""
        self.counts[decision.counter] += decision.count


def _items(groups: Sequence[ReadyGroup], reason: str) -> tuple:
    return tuple((e, t, reason) for g in groups for e, t in zip(g.entry_ids, g.trajectories, strict=True))

