"""What the trainer may acknowledge, and when a checkpoint must come.

The rule: a trajectory is marked trained (`seen:`) and acknowledged only once a durable state
covers it. With checkpoints that is a complete checkpoint whose step used it: until then its
step is held here, so a kill -9 at any moment re-delivers exactly what the restored model has
not learned from. Without checkpoints nothing is durable: a step is acknowledged once its
version is published.

Liveness: held steps pin their entries in the stream's pending list, which producers count as
backlog. A checkpoint comes every `checkpoint_every` versions, and also as soon as the held
entries would pass `hold_bound` (half the backlog) with the next step: held entries alone can
never fill the backlog and stop the data a checkpoint waits for (issue 33, item 8: backlog 64,
4x4 groups per step and a checkpoint every 10 versions stalled at version 4, 64/64 held). While
saves fail (disk full) the oldest published steps past the bound are acknowledged without one
(`acked_undurable`), and the status says what a crash would lose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.trainer.core.records import Acknowledge, Checkpoint, Decision, StartCheckpoint, TrainedStep
from services.trainer.core.state import TrainerState

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class HoldPolicy:
    checkpoints: bool
    """trainer.checkpoint_dir is set."""
    every: int
    """trainer.checkpoint_every (0: by version never, only on request or by the hold bound)."""
    hold_bound: int
    """Held entries past which a checkpoint is taken early (saving) or steps are let go (failing)."""
    step_entries: int
    """Entries one step holds at most (groups_per_step x group_size)."""


class Holds:
    def __init__(self, policy: HoldPolicy, state: TrainerState) -> None:
        self.policy = policy
        self.state = state
        self.awaiting: list[TrainedStep] = []  # trained, not yet covered by a checkpoint (or published)
        self.saving: list[TrainedStep] = []  # covered by the checkpoint being written
        self.failing = 0  # consecutive failed saves
        self.retry_at = 0.0
        self.undurable_through = 0  # newest version with steps acknowledged without a checkpoint
        self.published_through = 0  # newest version the pointer names

    def held(self) -> tuple[TrainedStep, ...]:
        return (*self.awaiting, *self.saving)

    def _count(self) -> None:
        self.state.held_entries = sum(len(s.entry_ids) for s in self.held())

    def hold(self, step: TrainedStep) -> None:
        """A step whose update applied: held until a decision acknowledges it."""
        self.awaiting.append(step)
        self._count()

    def put_back(self, steps: Sequence[TrainedStep]) -> None:
        """Steps whose acknowledgement failed (or whose save failed): held again, in version order
        (the hold bound takes the oldest first)."""
        self.awaiting = sorted((*steps, *self.awaiting), key=lambda s: s.version)
        self._count()

    # -- when ---------------------------------------------------------------------------------

    def checkpoint_due(self, version: int, now: float) -> bool:
        """A step at `version` starts a checkpoint: the cadence, or the hold bound (liveness)."""
        p = self.policy
        if not p.checkpoints or now < self.retry_at:
            return False
        by_version = p.every > 0 and version % p.every == 0
        by_hold = not self.failing and self.state.held_entries + p.step_entries > p.hold_bound
        return by_version or by_hold

    def acknowledges_before_next_step(self, version: int, now: float) -> bool:
        """The step's acknowledgement must finish before the next step starts: it starts a
        checkpoint (which copies the arrays the next step donates), or saves are failing and the
        hold bound is applied as each step joins the held ones."""
        return self.checkpoint_due(version, now) or bool(self.failing)

    def owed(self, now: float, *, save_in_flight: bool) -> bool:
        """A save is owed and due, whether or not another step comes."""
        if not self.policy.checkpoints or save_in_flight or now < self.retry_at:
            return False
        return checkpoint_owed([s.version for s in self.awaiting], every=self.policy.every,
                               undurable_through=self.undurable_through,
                               checkpoint_version=self.state.checkpoint_version) or (
            not self.failing and bool(self.awaiting) and self.state.held_entries > self.policy.hold_bound)

    # -- what a step, a publish and a save let go ---------------------------------------------

    def stepped(self, version: int, *, published: bool, now: float) -> list[Decision]:
        """After `hold(step)` and its publish: what the rule allows now."""
        if published:
            self.published_through = max(self.published_through, version)
        if not self.policy.checkpoints:
            return self.published(version) if published else []
        if self.checkpoint_due(version, now):
            by_version = self.policy.every > 0 and version % self.policy.every == 0
            return [StartCheckpoint(version, "trainer.checkpoint_every" if by_version else "the hold bound")]
        if self.failing and published:
            return self._past_bound(version)
        return []

    def published(self, version: int) -> list[Decision]:
        """The pointer names `version`: without checkpoints that is as durable as it gets."""
        self.published_through = max(self.published_through, version)
        if not self.policy.checkpoints:
            done = [s for s in self.awaiting if s.version <= version]
            self.awaiting = [s for s in self.awaiting if s.version > version]
            self._count()
            return [Acknowledge(tuple(done))] if done else []
        return self._past_bound(version) if self.failing else []

    def _past_bound(self, version: int) -> list[Decision]:
        """The oldest held steps up to `version` while more than `hold_bound` entries are held,
        counted out at once (a status read while they are acknowledged sees what stays held)."""
        excess = sum(len(s.entry_ids) for s in self.held()) - self.policy.hold_bound
        done: list[TrainedStep] = []
        while self.awaiting and excess > 0 and self.awaiting[0].version <= version:
            done.append(self.awaiting.pop(0))
            excess -= len(done[-1].entry_ids)
        self._count()
        return [Acknowledge(tuple(done), undurable=True)] if done else []

    def begin(self, version: int, why: str = "requested") -> Checkpoint:
        """A checkpoint of `version` covering every held step (the driver saves it)."""
        if version == self.state.checkpoint_version:  # complete on disk; acknowledging its steps failed
            covered = [s for s in self.awaiting if s.version <= version]
            self.awaiting = [s for s in self.awaiting if s.version > version]
            self._count()
            return Checkpoint(version, tuple(covered), why="already saved")
        covered, self.awaiting = self.awaiting, []
        self.saving = covered
        return Checkpoint(version, tuple(covered), why=why)

    def not_started(self, checkpoint: Checkpoint) -> None:
        """The save could not start (the copy failed): its steps are held again."""
        self.saving = []
        self.put_back(checkpoint.covers)

    def saved(self, checkpoint: Checkpoint) -> Acknowledge:
        """The checkpoint is complete: its steps are durable."""
        self.saving = []
        self.failing, self.retry_at, self.state.checkpoint_error = 0, 0.0, ""
        self._count()
        return Acknowledge(checkpoint.covers)

    def save_failed(self, checkpoint: Checkpoint | None, error: str, now: float, *, storage: bool = True) -> list[Decision]:
        """A save failed (`storage`: a storage failure, not a shutdown): its steps are held again,
        retried with backoff; past the hold bound the oldest published ones are let go."""
        if checkpoint is not None:
            self.saving = []
            self.put_back(checkpoint.covers)
        self.failing += 1
        self.state.checkpoint_failures += 1
        self.state.checkpoint_error = error
        self.retry_at = now + min(RETRY_FIRST_S * 2 ** (self.failing - 1), RETRY_MAX_S)
        self._count()
        return self._past_bound(self.published_through) if storage else []

    def acknowledged(self, decision: Acknowledge) -> None:
        """The driver marked and acknowledged `decision`'s steps."""
        if decision.undurable and decision.steps:
            self.state.acked_undurable += sum(len(s.trajectory_ids) for s in decision.steps)
            self.undurable_through = max(self.undurable_through, decision.steps[-1].version)
        self._count()

    def checkpointed(self, version: int, uri: str) -> None:
        """Reported once its steps are acknowledged (or that failed): complete on disk all the same."""
        self.state.checkpoint_version, self.state.checkpoint_uri = version, uri


def checkpoint_owed(held_versions: list[int], *, every: int, undurable_through: int,
                    checkpoint_version: int) -> bool:
    """A checkpoint is owed, whether or not another step comes: a held step's version was due
    (`every`) and no save covers it (the save failed, or was skipped while a failed one backed off
    and then a save of an older version succeeded), or steps were acknowledged without a
    checkpoint while saves failed and none covers them yet (the hold bound can acknowledge every
    step as it publishes, leaving nothing held). Until then a crash loses what the model learned."""
    due = every > 0 and any(v % every == 0 for v in held_versions)  # every 0: by version never
    return due or undurable_through > checkpoint_version
