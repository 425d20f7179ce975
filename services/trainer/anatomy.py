"""Where one RL step's time went, from the trainer's side: the `timing` and `anatomy` of its record.

Each step record carries (services/trainer/diagnostics.py):

- `timing`: durations in seconds, exported like any scalar (TensorBoard `timing/*`). The step
  is the interval between two version cuts (a cut: the loop is done with a step and may start
  the next; with the publish inline that is the pointer's move, with it overlapped the device
  copy of the weights, the rest of the publish running beside the next step, as
  `publish_overlapped_s`: loop.py). The loop spends it, in order, on the previous
  step's tail (its record, log and acknowledgements after its publish), waiting for data,
  intake (stream reads that returned data, decode, de-duplication, grouping), building the
  batch, the jitted step, and publishing (serialise, store, move the pointer; overlapped: the
  device copy only). `wait_s` is what
  is left: the loop had nothing to train on. `intake_overlapped_s` (the next batch's intake) and
  `tail_overlapped_s` (the previous step's record and acknowledgements) ran while the jitted
  step did, off the critical path and in none of the above. The means over the batch's
  trajectories of their rollout phases (Trajectory.timings) and of their Redis wait (XADD to
  the trainer's read) are beside them.
- `anatomy`: the step's wall-clock marks (Unix seconds: `prev_cut_at`, `cut_at`, and
  `published_at`, when the pointer named this version) and the timings of its *critical*
  trajectory (the member of the last group to complete the batch that finished last), so a
  reader can lay the step's critical path across services (bench/step_anatomy.py).

Cheap and always on: a few clock reads per step and one pass over the batch's timings.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from arlo.proto.v1 import common_pb2

ROLLOUT_PHASES = ("reset_s", "generate_s", "generate_queue_s", "generate_engine_s", "env_s", "reward_s", "total_s")
"""Trajectory.timings fields averaged over the batch (as `rollout_<name>` in `timing`)."""


def xadd_time(entry_id: str) -> float:
    """Unix seconds at which Redis appended a stream entry (its id's millisecond part)."""
    millis, _, _ = entry_id.partition("-")
    try:
        return int(millis) / 1000.0
    except ValueError:
        return 0.0


@dataclass(kw_only=True)
class StepClock:
    """The loop's marks between two pointer moves; `since_publish` restarts it."""

    cut_at: float = 0.0
    """When the previous step's version was cut (0 before the first RL step)."""
    tail_s: float = 0.0
    """The previous step's work after its publish (record, log, acknowledgements)."""
    intake_s: float = 0.0
    """Stream reads that returned data and their intake, since the previous step."""
    overlapped_intake_s: float = 0.0
    """Intake while this step trained (off the critical path: services/trainer/stream_side.py)."""
    overlapped_tail_s: float = 0.0
    """The previous step's tail, run while this step trained (services/trainer/tail.py)."""

    def add_intake(self, seconds: float) -> None:
        self.intake_s += seconds

    def add_overlapped_intake(self, seconds: float) -> None:
        self.overlapped_intake_s += seconds

    def add_overlapped_tail(self, seconds: float) -> None:
        self.overlapped_tail_s += seconds

    def step_done(self, cut_at: float) -> None:
        """The step's version was cut at `cut_at`; its tail and the next intake start now."""
        self.cut_at, self.intake_s, self.tail_s = cut_at, 0.0, 0.0
        self.overlapped_intake_s = self.overlapped_tail_s = 0.0

    def tail_done(self) -> None:
        if self.cut_at:
            self.tail_s = time.time() - self.cut_at


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMarks:
    """Unix seconds of one step's phases, taken by the loop."""

    read_at: float
    """The read that completed the batch's last group returned."""
    ready_at: float
    """That group was judged and ready (intake done)."""
    batch_at: float
    """The loop took the batch's groups and started building it."""
    train_at: float
    trained_at: float
    cut_at: float
    """The loop was done with the step (see the module docstring)."""
    published_at: float = 0.0
    """The pointer named the step's version (the cut, with the publish inline; later, overlapped;
    0 while unknown or when the publish failed)."""


def step_timing(clock: StepClock, marks: StepMarks, trajectories: Sequence[common_pb2.Trajectory],
                read_at: Sequence[float], entry_ids: Sequence[str]) -> dict[str, float]:
    """The record's `timing`: the step's durations (see the module docstring). `read_at[i]` is
    when the trainer's read returned trajectory i, `entry_ids[i]` its stream entry."""
    batch_s, train_s = marks.train_at - marks.batch_at, marks.trained_at - marks.train_at
    publish_s = marks.cut_at - marks.trained_at
    out = {"batch_s": batch_s, "train_s": train_s, "publish_s": publish_s, "intake_s": clock.intake_s,
           "tail_s": clock.tail_s, "intake_overlapped_s": clock.overlapped_intake_s,
           "tail_overlapped_s": clock.overlapped_tail_s}
    if clock.cut_at:
        step_s = marks.cut_at - clock.cut_at
        out["step_s"] = step_s
        out["wait_s"] = max(step_s - clock.tail_s - clock.intake_s - batch_s - train_s - publish_s, 0.0)
    n = len(trajectories)
    if n:
        for name in ROLLOUT_PHASES:
            out[f"rollout_{name}"] = sum(getattr(t.timings, name) for t in trajectories) / n
        waits = [r - xadd_time(e) for r, e in zip(read_at, entry_ids, strict=True) if xadd_time(e)]
        if waits:
            out["redis_wait_s"] = sum(waits) / len(waits)
    return out


def step_anatomy(clock: StepClock, marks: StepMarks, trajectories: Sequence[common_pb2.Trajectory],
                 read_at: Sequence[float], entry_ids: Sequence[str]) -> dict[str, Any]:
    """The record's `anatomy`: the marks, and the critical trajectory's timings and XADD time."""
    out: dict[str, Any] = {"prev_cut_at": clock.cut_at, "read_at": marks.read_at,
                           "ready_at": marks.ready_at, "batch_at": marks.batch_at, "train_at": marks.train_at,
                           "trained_at": marks.trained_at, "cut_at": marks.cut_at,
                           "published_at": marks.published_at}
    if not trajectories:
        return out
    last_read = max(read_at)
    # The batch waited for the last read; of what it brought, the trajectory that ended last.
    candidates = [i for i, r in enumerate(read_at) if r == last_read]
    i = max(candidates, key=lambda i: trajectories[i].timings.started_at + trajectories[i].timings.total_s)
    t = trajectories[i].timings
    out["first_started_at"] = min(x.timings.started_at for x in trajectories if x.timings.started_at) \
        if any(x.timings.started_at for x in trajectories) else 0.0
    out["critical"] = {"started_at": t.started_at, "reset_s": t.reset_s, "generate_s": t.generate_s,
                       "generate_queue_s": t.generate_queue_s, "generate_engine_s": t.generate_engine_s,
                       "env_s": t.env_s, "reward_s": t.reward_s, "total_s": t.total_s,
                       "turns": trajectories[i].num_turns, "xadd_at": xadd_time(entry_ids[i]),
                       "read_at": read_at[i], "min_version": _min_version(trajectories[i])}
    return out


def _min_version(traj: common_pb2.Trajectory) -> int:
    versions = [v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m]
    return min(versions) if versions else -1
