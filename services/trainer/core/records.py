"""What the trainer core decides, as plain records the driver performs (services/trainer/loop.py).

Each record names one move on the outside world and why; the core has already updated its own
state for it. Counters that a reader compares with the stream (`arlo status`, the fault tests)
move only once the driver reports the move done (`TrainerCore.done`): a reader that sees a
count sees its dead letters too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from arlo.proto.v1 import common_pb2


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainedStep:
    """One step's data, unacknowledged until a durable state covers `version`."""

    version: int
    entry_ids: tuple[str, ...]
    trajectory_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ack:
    """Acknowledge entries the trainer is finished with without training them (dropped groups,
    repeats of a held trajectory): they must not pin the stream's backlog."""

    entry_ids: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Move entries to the dead-letter stream (acknowledged with it), each with its reason;
    `counter` moves by `count` once the move is done (intake counts whole malformed groups it
    acknowledges with the members it dead-letters)."""

    items: tuple[tuple[str, common_pb2.Trajectory, str], ...]
    counter: str
    count: int


@dataclass(frozen=True, slots=True)
class CountStale:
    """Tell the rollout's admission budget that `n` trajectories were dropped as stale."""

    n: int


@dataclass(frozen=True, slots=True)
class Acknowledge:
    """Mark the steps' trajectories trained (`seen:`) and acknowledge their entries: a durable
    state covers them (or, `undurable`, saves are failing and the hold bound let them go)."""

    steps: tuple[TrainedStep, ...]
    undurable: bool = False


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Save the current version; `covers` are the held steps it makes durable."""

    version: int
    covers: tuple[TrainedStep, ...]
    why: str = "due"


@dataclass(frozen=True, slots=True)
class StartCheckpoint:
    """Start a checkpoint of the current version now (`why`: the cadence or the hold bound)."""

    version: int
    why: str


Decision = Ack | DeadLetter | CountStale | Acknowledge | StartCheckpoint


@dataclass(frozen=True, slots=True)
class Wait:
    """No batch now, and why (the run's liveness report names it)."""

    why: str
    in_flight_floor: int | None = None
    """Ask the in-flight set (records.py `settle_in_flight`) about groups of this version, then ask again."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Screened:
    """Read entries sorted before the stream's `seen:` check."""

    repeats: Ack | None
    candidates: list = field(default_factory=list)
