"""The trainer core: events in, decisions out, one state with one writer. No I/O.

The driver (services/trainer/loop.py) reads the stream, runs steps, publishes and saves; it
tells the core what happened and performs what the core returns (core/records.py). The core
owns the groups' lifecycle (core/book.py), the version numbers and what they mean for staleness
(core/lineage.py), what may be acknowledged and when a checkpoint must come (core/holds.py),
and pausing. It imports no redis, grpc, asyncio or jax (tests/unit/test_layout.py checks it);
tests/unit/test_trainer_core*.py drive it as sequences of events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.trainer.core.book import GroupBook
from services.trainer.core.groups import ReadyGroup
from services.trainer.core.holds import HoldPolicy, Holds
from services.trainer.core.lineage import Lineage, check_version
from services.trainer.core.records import Ack, Acknowledge, DeadLetter, Decision, TrainedStep
from services.trainer.core.state import TrainerState


@dataclass(frozen=True, kw_only=True, slots=True)
class CoreConfig:
    groups_per_step: int
    group_size: int
    max_staleness: int
    vocab_size: int
    filter_zero_variance: bool = False
    expiring_wait_s: float = 0.0
    checkpoints: bool = False
    checkpoint_every: int = 0
    max_backlog: int = 4096
    sft_steps: int = 0
    start_paused: bool = False
    routing_bytes: int = 0
    """Bytes of Trajectory.routed_experts per model token for this model (arlo/routing_replay.py);
    0: a model without routed experts (the field is not checked)."""
    kept_width: int = 0
    """Filter replay's K (arlo/filter_replay.py kept_width of the run's rollout.sampling); 0: off."""


REFUSED_IN_A_ROW = 3
"""Refused steps in a row after which the learner's state itself is taken for damaged. One
refused step is a batch the intake could not judge (an overflow of finite values); after the
intake's checks, every batch refusing means the weights or the optimizer state hold NaN or inf
(a restored optimizer state with a matching checksum did: issue 33, item 13)."""


def hold_bound(max_backlog: int) -> int:
    """Held entries allowed before a checkpoint is taken early (or, saves failing, steps let go):
    half the backlog, so a step's worth of new data always fits beside them."""
    return max(max_backlog // 2, 1)


class TrainerCore:
    def __init__(self, cfg: CoreConfig) -> None:
        self.cfg = cfg
        self.state = TrainerState(paused=cfg.start_paused)
        self.lineage = Lineage(max_staleness=cfg.max_staleness)
        policy = HoldPolicy(checkpoints=cfg.checkpoints, every=cfg.checkpoint_every,
                            hold_bound=hold_bound(cfg.max_backlog), step_entries=cfg.groups_per_step * cfg.group_size)
        self.holds = Holds(policy, self.state)
        self.book = GroupBook(lineage=self.lineage, groups_per_step=cfg.groups_per_step, vocab_size=cfg.vocab_size,
                              filter_zero_variance=cfg.filter_zero_variance, expiring_wait_s=cfg.expiring_wait_s,
                              held_for_durability=self.holds.held, routing_bytes=cfg.routing_bytes,
                              kept_width=cfg.kept_width)
        self.owes_publish = False
        """The newest version's publish failed or met a foreign pointer: publish before the next step."""

    # -- versions ---------------------------------------------------------------------------

    def started(self, *, restored: int, pointer: int, on_disk: int, step_count: int) -> int:
        """The trainer restored checkpoint `restored` (0: none); returns the version to publish
        now (0: none). A trainer restored past its warm start keeps the boundary at the
        restored version: what the pointer's older versions sampled is from before it or
        already trained."""
        version = self.lineage.start(restored=restored, pointer=pointer, on_disk=on_disk)
        if restored and step_count >= self.cfg.sft_steps > 0:
            self.lineage.warm_started(version)
        if version:
            self.state.version = version
        return version

    def pointer_conflict(self, pointer: int) -> int:
        """The pointer holds `pointer`, a version this trainer did not write: ours is re-numbered
        above it (a foreign HSET cannot live-lock training). Returns the new version."""
        check_version(pointer, "the weight pointer")
        self.state.pointer_conflicts += 1
        self.state.version = max(self.state.version, pointer) + 1
        self.owes_publish = True
        return self.state.version

    def warm_start_done(self) -> int:
        """The SFT warm start's last step applied: its version is published and is the boundary."""
        self.state.version += 1
        self.lineage.warm_started(self.state.version)
        return self.state.version

    # -- steps ------------------------------------------------------------------------------

    def sft_stepped(self, metrics: Any, *, num_tokens: int) -> None:
        self.state.last = metrics
        self.state.tokens_trained += num_tokens

    def stepped(self) -> int:
        """An RL step's update applied: the version moves on (published next)."""
        self.book.trained()
        self.state.version += 1
        self.state.waiting_on = ""
        self.state.refused_in_a_row = 0
        return self.state.version

    def finished(self, groups: Sequence[ReadyGroup], metrics: Any, *, num_tokens: int) -> TrainedStep:
        """The applied step is published (or its publish is owed): counted, its entries held."""
        trained_from = self.state.version - 1
        trajs = [t for g in groups for t in g.trajectories]
        self.state.consumed += len(trajs)
        self.state.last = metrics
        self.state.tokens_trained += num_tokens
        self.state.generated_tokens += sum(sum(t.loss_mask) for t in trajs)
        self.state.last_staleness, self.state.last_staleness_max = self.staleness(trajs, trained_from)
        step = TrainedStep(version=self.state.version, entry_ids=tuple(e for g in groups for e in g.entry_ids),
                           trajectory_ids=tuple(t.id for t in trajs))
        self.holds.hold(step)  # from here a producer's retry of these trajectories is a repeat
        return step

    def staleness(self, trajs: Sequence[Any], trained_from: int) -> tuple[float, int]:
        """(mean, max) over model tokens of how far behind the weights trained from they were sampled."""
        lags = [self.lineage.lag(v, trained_from) for t in trajs
                for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m]
        return (sum(lags) / len(lags), max(lags)) if lags else (0.0, 0)

    def step_failed(self, error: BaseException) -> list[Decision]:
        self.state.failed_steps += 1
        return self.book.step_failed(error)

    def step_refused(self, groups: Sequence[ReadyGroup], reason: str, *, unpublished: bool = False) -> list[Decision]:
        """A step whose loss/gradient (or, `unpublished`, whose new weights) are non-finite: its
        groups are dead-lettered; the version stays (an unpublishable one is taken back).

        Weights that went non-finite in an applied update, or REFUSED_IN_A_ROW refusals, mean the
        learner's state is damaged: `must_restart` says so, and the driver stops for a restart
        from the newest good checkpoint (rolling back; what was trained since is re-delivered,
        never acknowledged: acks wait for a checkpoint, and a damaged state is never saved)."""
        self.state.refused_in_a_row += 1
        if unpublished:
            self.state.version -= 1
            self.state.must_restart = f"trainer state damaged: an applied update made the weights non-finite ({reason})"
        elif self.state.refused_in_a_row >= REFUSED_IN_A_ROW:
            self.state.must_restart = (f"trainer state damaged: {self.state.refused_in_a_row} steps refused in a "
                                       f"row, the last: {reason}; the weights or optimizer state hold NaN or inf")
        return [self.book.refuse(groups, reason)]

    def state_damaged(self, why: str) -> None:
        """This process may not train on: its state was found non-finite outside a step (a
        checkpoint save's check), or the run was taken over (a fenced write refused in a job)."""
        self.state.must_restart = self.state.must_restart or why

    def refused(self) -> None:
        """The refused step's dead letters are durable: it counts as skipped now."""
        self.state.skipped_steps += 1

    # -- publishing ---------------------------------------------------------------------------

    def publish_failed(self) -> None:
        self.owes_publish = True
        self.state.publish_failures += 1

    def published(self, version: int) -> list[Decision]:
        if version >= self.state.version:
            self.owes_publish = False
        return self.holds.published(version)

    # -- pausing ----------------------------------------------------------------------------

    def resume(self, until_step: int, step_count: int) -> bool:
        """Unpauses (until `until_step` when > 0); returns whether the trainer is now paused."""
        self.state.until_step = until_step
        self.state.paused = bool(until_step) and step_count >= until_step
        return self.state.paused

    def pause_due(self, step_count: int) -> bool:
        return bool(self.state.until_step) and step_count >= self.state.until_step

    def pause_if_due(self, step_count: int) -> None:
        if self.pause_due(step_count):
            self.state.paused = True

    def pause(self) -> None:
        self.state.paused = True

    def done(self, decision: Decision) -> None:
        """The driver performed `decision`: the counters that follow it move now."""
        if isinstance(decision, Ack) and decision.why == "repeat":
            self.book.counts["repeats"] += len(decision.entry_ids)
        elif isinstance(decision, DeadLetter):
            self.book.dead_lettered(decision)
        elif isinstance(decision, Acknowledge):
            self.holds.acknowledged(decision)

    # -- what the status shows ----------------------------------------------------------------

    def dropped(self, *, stream_malformed: int = 0, stream_duplicates: int = 0) -> dict[str, int]:
        """Trajectories not trained on, by reason (the stream's own decode drops beside ours)."""
        c, drops = self.book.counts, self.book.assembler.drops
        return {"stale": drops.stale, "failed": drops.failed, "malformed": c["malformed"] + stream_malformed,
                "duplicate": stream_duplicates + c["repeats"], "zero_variance": c["zero_variance"],
                "poisoned": c["poisoned"], "nonfinite_step": c["nonfinite_step"], "step_error": c["step_error"]}

    def restored_past(self, damaged: int) -> None:
        """The restore passed over `damaged` newer checkpoints (an older complete one was used)."""
        self.state.checkpoint_fallbacks += damaged

    def recorded(self, record: dict[str, Any]) -> None:
        self.state.last_record = record

    def waiting(self, why: str) -> None:
        """Why no step is taken now, for the status and the log (issue 33: a run that makes no
        step says which bound holds it)."""
        self.state.waiting_on = why

    def add_time(self, *, busy_s: float = 0.0, io_s: float = 0.0) -> None:
        self.state.busy_s += busy_s
        self.state.io_s += io_s
