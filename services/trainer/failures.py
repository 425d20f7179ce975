"""Steps that fail: where their groups go, and the counts a reader sees.

A step that raises before its update applied puts its groups back at the front of the ready
list, up to `STEP_ATTEMPTS` tries, after which they are dead-lettered with the error: nothing
is dropped or acknowledged untrained. A step that would corrupt the weights (a non-finite loss
or gradient, or non-finite weights at publish) is refused: its groups are dead-lettered at
once. Every counter moves only after the move it counts is durable, so a reader that sees a
count sees its dead letters too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from arlo.coord import TrajectoryStream
from services.trainer.core.groups import ReadyGroup
from services.trainer.state import TrainerState

log = logging.getLogger(__name__)

STEP_ATTEMPTS = 3
"""Tries of a batch whose step raises before its groups are dead-lettered with the error."""


class StepFailures:
    def __init__(self, stream: TrajectoryStream, state: TrainerState) -> None:
        self.stream, self.state = stream, state
        self.nonfinite = 0
        """Trajectories of refused steps."""
        self.step_errors = 0
        """Trajectories dead-lettered after STEP_ATTEMPTS failed steps."""
        self._attempts: dict[str, int] = {}  # first entry id of a group -> failed steps it was in

    def trained(self, groups: Sequence[ReadyGroup]) -> None:
        """The groups' step applied: their earlier failures are forgotten."""
        for g in groups:
            self._attempts.pop(g.entry_ids[0], None)

    async def failed(self, groups: Sequence[ReadyGroup], error: Exception,
                     put_back: Callable[[list[ReadyGroup]], None]) -> None:
        """A step that raised before its update applied: `put_back` the groups with tries left
        (before any await: they are never out of every list), dead-letter the rest."""
        self.state.failed_steps += 1
        again, dead = [], []
        for g in groups:
            n = self._attempts[g.entry_ids[0]] = self._attempts.get(g.entry_ids[0], 0) + 1
            (dead if n >= STEP_ATTEMPTS else again).append(g)
        put_back(again)
        log.error("step failed (%s: %s); %d groups put back, %d dead-lettered after %d tries", type(error).__name__,
                  error, len(again), len(dead), STEP_ATTEMPTS, extra={"failed_steps": self.state.failed_steps})
        if dead:
            reason = f"step failed {STEP_ATTEMPTS} times: {type(error).__name__}: {error}"
            items = [(e, t, reason) for g in dead for e, t in zip(g.entry_ids, g.trajectories, strict=True)]
            for g in dead:
                self._attempts.pop(g.entry_ids[0], None)
            await self.stream.dead_letter(items)
            self.step_errors += len(items)  # counted once the move is durable, so a reader sees both or neither

    async def refuse(self, groups: Sequence[ReadyGroup], reason: str) -> None:
        """A step that would corrupt the weights: nothing published, its groups dead-lettered."""
        items = [(e, t, reason) for g in groups for e, t in zip(g.entry_ids, g.trajectories, strict=True)]
        await self.stream.dead_letter(items)
        # Both counters move once the dead letters are durable, together: a reader that sees the
        # skipped step sees its dead letters and their count too.
        self.state.skipped_steps += 1
        self.nonfinite += len(items)
        log.error("step refused (%s); %d trajectories moved to %s, version stays %d", reason, len(items),
                  self.stream.keys.traj_dead, self.state.version,
                  extra={"skipped_steps": self.state.skipped_steps, "version": self.state.version})
