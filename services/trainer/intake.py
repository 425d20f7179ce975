"""The trainer's intake: stream entries -> whole groups -> the groups the next step takes.

Entries are de-duplicated against everything the trainer still holds (a group waiting for its
members, a ready group, the step in flight, steps held for a checkpoint), grouped
(batching.py's GroupAssembler), judged against the staleness bound at the version the next
step trains from, and handed out oldest policy first. Dropped or dead-lettered entries are
acknowledged here: a group finished with must not pin the stream's backlog.

The in-flight set (records.py `settle_in_flight`) lets a step wait, bounded, for an older group
still being generated that the batch would otherwise leave to age past the bound (expiring.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from redis.exceptions import RedisError

from arlo.coord import TrajectoryStream
from arlo.coord.stream import StreamEntry
from services.trainer.core.groups import GroupAssembler, ReadyGroup, group_oldest_version, has_reward_spread
from services.trainer.expiring import ExpiringWait, may_leave_behind
from services.trainer.state import TrainedStep

log = logging.getLogger(__name__)


class Intake:
    """Groups waiting for a step. `held_elsewhere`: the steps trained but not yet acknowledged
    (durability.py), whose entries must not be taken in again."""

    def __init__(self, *, stream: TrajectoryStream, groups_per_step: int, max_staleness: int, vocab_size: int,
                 filter_zero_variance: bool, expiring_wait_s: float,
                 held_elsewhere: Callable[[], Iterable[TrainedStep]]) -> None:
        self.stream = stream
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.filter_zero_variance = filter_zero_variance
        self.held_elsewhere = held_elsewhere
        self.assembler = GroupAssembler(max_staleness=max_staleness, vocab_size=vocab_size)
        self.expiring = ExpiringWait(bound_s=expiring_wait_s)
        self.ready: list[ReadyGroup] = []
        self.in_step: list[ReadyGroup] = []  # taken by the step in flight, not yet held by durability
        self.repeats = 0  # entries of a trajectory already held (a producer's retry)
        self.zero_variance = 0  # entries of groups dropped for equal rewards (filter_zero_variance)
        # The assembler's dead-lettered counts (malformed, poisoned) as of its last durable move: it
        # counts at intake, before `traj:dead` holds them, and a reader must see both or neither.
        self.dead_lettered = dataclasses.replace(self.assembler.drops)
        self._arrived: set[str] = set()  # groups held whole here since the in-flight set was last told

    async def admit(self, entries: Sequence[StreamEntry], *, version: int, read_at: float = 0.0) -> None:
        """Takes `entries` in; groups complete and fresh at `version` join the ready list."""
        held_entries, held_trajs = self.held()
        # XAUTOCLAIM and the pending re-read also return entries this trainer still holds (waiting
        # for their group, their batch or a checkpoint): taking them again would train them twice.
        entries = [e for e in entries if e.entry_id not in held_entries]
        repeats = [e.entry_id for e in entries if e.trajectory.id in held_trajs]
        if repeats:
            # Another entry of a trajectory held here (a producer's retry): finished with.
            self.repeats += len(repeats)
            await self.stream.ack(repeats)
        fresh = await self.stream.filter_unseen([e for e in entries if e.trajectory.id not in held_trajs])
        self.assembler.add((e.entry_id, e.trajectory) for e in fresh)
        self._arrived.update(gid for gid in {e.trajectory.group_id for e in fresh} if self.assembler.has_whole(gid))
        stale_before = self.assembler.drops.stale
        ready, dropped = self.assembler.take_ready(version)
        await self.stream.dead_letter(self.assembler.take_dead())  # acknowledged with it
        self.dead_lettered = dataclasses.replace(self.assembler.drops)
        if self.assembler.drops.stale > stale_before:
            await self.stream.count_stale(self.assembler.drops.stale - stale_before)
        if self.filter_zero_variance:
            flat = [g for g in ready if not has_reward_spread(g)]
            ready = [g for g in ready if has_reward_spread(g)]
            self.zero_variance += sum(len(g.entry_ids) for g in flat)
            dropped += [e for g in flat for e in g.entry_ids]
        now = time.time()
        self.ready.extend(dataclasses.replace(g, read_at=read_at or now, ready_at=now) for g in ready)
        if dropped:
            # A dropped group is finished with: acknowledge it now, or it pins the backlog.
            await self.stream.ack(dropped)

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
        for step in self.held_elsewhere():
            entries.update(step.entry_ids)
            trajs.update(step.trajectory_ids)
        return entries, trajs

    async def drop_stale(self, version: int) -> None:
        """Groups admitted at an older version may have aged past the bound while earlier steps
        trained: judged again here, at the version the next step trains from, so no trained token
        is ever more than max_staleness versions behind (the bound the docs state, exactly)."""
        floor = version - self.max_staleness
        stale = [g for g in self.ready if group_oldest_version(g.trajectories) < floor]
        if not stale:
            return
        self.ready = [g for g in self.ready if not any(g is s for s in stale)]
        entry_ids = [e for g in stale for e in g.entry_ids]
        self.assembler.drops.stale += len(entry_ids)
        await self.stream.count_stale(len(entry_ids))
        await self.stream.ack(entry_ids)

    def batch_full(self) -> bool:
        return len(self.ready) >= self.groups_per_step

    async def waiting_for_expiring(self, version: int) -> bool:
        """Whether the next step should wait for a group still in flight that it would leave to
        age past the bound (expiring.py); the loop's next read brings it, or the wait runs out."""
        floor = version - self.max_staleness
        versions = [group_oldest_version(g.trajectories) for g in self.candidates()]
        if self.expiring.bound_s <= 0 or not may_leave_behind(versions, floor):
            return False
        in_flight = await self.settle_in_flight(floor)
        if in_flight is None:  # not knowing costs at most the groups it would have waited for
            return False
        # Part of a group read, the rest still on its way. Below the floor it is too old anyway.
        partial = {gid for gid, members in self.assembler.pending.items()
                   if group_oldest_version(list(members.values())) == floor}
        missing = partial | {gid for gid in in_flight if not self.assembler.has_whole(gid)}
        timeouts = self.expiring.timeouts
        if self.expiring.hold(missing, floor=floor, now=time.monotonic()):
            return True
        if self.expiring.timeouts > timeouts:
            log.warning("%d group(s) of version %d still in flight after %.1f s (trainer.expiring_wait_s): the step "
                        "goes ahead, and they will be dropped as stale", len(missing), floor, self.expiring.bound_s,
                        extra={"expiring_timeouts": self.expiring.timeouts})
        return False

    async def settle_in_flight(self, floor: int) -> set[str] | None:
        """Tells the in-flight set which groups arrived whole here and how old a batch may take
        (records.py `settle_in_flight`); the ids still in flight on `floor`, None if Redis failed."""
        arrived, self._arrived = self._arrived, set()
        try:
            return await self.stream.settle_in_flight(arrived=arrived, floor=floor)
        except (RedisError, OSError) as e:
            self._arrived |= arrived
            log.warning("groups in flight unknown (%s)", e)
            return None

    def take_batch(self) -> list[ReadyGroup]:
        """The next step's groups, out of the ready list and into `in_step`."""
        # A batch needs one group size; groups of another size wait for their own batch. Oldest
        # policy first: groups finish out of the order they started (multi-turn episodes, slow
        # environments), and one left behind by younger ones would age past the staleness bound
        # at the next step and be dropped (the agent workload's async run dropped 8 of 1,280).
        same = self.candidates()
        self.ready = [g for g in self.ready if not any(g is s for s in same)]
        self.in_step = same
        return same

    def candidates(self) -> list[ReadyGroup]:
        """The groups the next step takes, left in place."""
        if not self.ready:
            return []
        size = len(self.ready[0].trajectories)
        return sorted((g for g in self.ready if len(g.trajectories) == size),
                      key=lambda g: group_oldest_version(g.trajectories))[: self.groups_per_step]

    def put_back(self, groups: list[ReadyGroup]) -> None:
        """A failed step's groups, first in line again."""
        self.ready[:0] = groups
