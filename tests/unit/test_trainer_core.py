"""The trainer core (services/trainer/core/) as sequences of events and the decisions expected:
no Redis, no gRPC, no model. The fault tests (tests/faults/test_trainer_faults.py) drive the same
rules through a real trainer service; here each rule is one short story."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import dataclass

import pytest

from arlo.proto.v1 import common_pb2
from services.trainer.core.book import STEP_ATTEMPTS
from services.trainer.core.lineage import WRITERS_KEPT, foreign_checkpoint, writers_after_restore
from services.trainer.core.records import Ack, Acknowledge, CountStale, DeadLetter, StartCheckpoint, Wait
from services.trainer.core.trainer import REFUSED_IN_A_ROW, CoreConfig, TrainerCore

PROMPT = [5, 6, 7]
_ids = itertools.count()


@dataclass(frozen=True)
class Entry:  # a StreamEntry's shape: the core reads .entry_id and .trajectory
    entry_id: str
    trajectory: common_pb2.Trajectory


def traj(group: str, reward: float, version: int = 0, *, size: int = 2) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        id=f"t{next(_ids)}", group_id=group, group_size=size, token_ids=PROMPT + [8, 9],
        logprobs=[0.0] * 3 + [-1.0, -1.0], loss_mask=[0] * 3 + [1, 1], policy_versions=[-1] * 3 + [version] * 2,
        reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK)


def group(name: str, version: int = 0) -> list[Entry]:
    return [Entry(f"{next(_ids)}-0", traj(name, r, version)) for r in (1.0, 0.0)]


def core(**kw) -> TrainerCore:
    defaults = dict(groups_per_step=1, group_size=2, max_staleness=1, vocab_size=100)
    return TrainerCore(CoreConfig(**{**defaults, **kw}))


def admit(c: TrainerCore, entries: list[Entry]) -> list:
    """Read -> screen -> (all unseen) -> admit, with every decision reported done."""
    screened = c.book.screen(entries)
    decisions = ([screened.repeats] if screened.repeats else []) + c.book.admit(
        screened.candidates, version=c.state.version, read_at=0.0, now=0.0)
    for d in decisions:
        c.done(d)
    return decisions


def step(c: TrainerCore, *, published: bool = True, now: float = 0.0) -> tuple[list, list]:
    """One step that applies and publishes; (its groups, the decisions after it)."""
    for d in c.book.drop_stale(c.state.version):
        c.done(d)
    batch = c.book.next_batch(c.state.version, now)
    assert not isinstance(batch, Wait), batch
    c.stepped()
    trained = c.finished(batch, metrics=None, num_tokens=4)
    decisions = c.holds.stepped(trained.version, published=published, now=now)
    return batch, decisions


def test_the_core_imports_no_io_nor_jax() -> None:
    code = ("import sys, services.trainer.core.trainer as t; "
            "print(sorted(m for m in ('redis', 'grpc', 'asyncio', 'jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_whole_fresh_group_trains_once_and_is_acknowledged_after_its_publish() -> None:
    c = core()
    g = group("a")
    assert admit(c, g[:1]) == [] and isinstance(c.book.next_batch(0, 0.0), Wait)  # half a group waits
    admit(c, g[1:])
    batch, decisions = step(c)
    assert c.state.version == 1 and [e for b in batch for e in b.entry_ids] == [e.entry_id for e in g]
    (ack,) = decisions  # no checkpoints: the publish makes it as durable as it gets
    assert isinstance(ack, Acknowledge) and ack.steps[0].entry_ids == tuple(e.entry_id for e in g)
    c.done(ack)
    assert c.state.held_entries == 0 and c.state.consumed == 2


def test_a_redelivered_or_retried_entry_of_a_held_trajectory_is_never_trained_twice() -> None:
    c = core(checkpoints=True, checkpoint_every=10)
    g = group("a")
    admit(c, g)
    step(c)  # held until a checkpoint covers it
    assert c.book.screen(g).candidates == []  # XAUTOCLAIM / pending re-read: still held, ignored
    retry = Entry("99-0", g[0].trajectory)  # a producer's retry: another entry, same trajectory
    (repeat,) = admit(c, [retry])
    assert repeat == Ack(("99-0",), "repeat") and c.dropped()["duplicate"] == 1


def test_a_failing_step_puts_its_groups_back_then_dead_letters_them_after_its_last_try() -> None:
    c = core()
    admit(c, group("a"))
    for attempt in range(1, STEP_ATTEMPTS + 1):
        batch = c.book.next_batch(0, 0.0)
        assert not isinstance(batch, Wait)
        decisions = c.step_failed(RuntimeError("boom"))
        if attempt < STEP_ATTEMPTS:
            assert decisions == [] and len(c.book.ready) == 1  # first in line again
    (dead,) = decisions
    assert isinstance(dead, DeadLetter) and dead.counter == "step_error" and len(dead.items) == 2
    assert "failed 3 times: RuntimeError: boom" in dead.items[0][2]
    assert c.dropped()["step_error"] == 0  # counted only once the move is durable
    c.done(dead)
    assert c.dropped()["step_error"] == 2 and c.state.failed_steps == STEP_ATTEMPTS and not c.book.ready


def test_a_step_that_succeeds_forgets_its_groups_earlier_failures() -> None:
    c = core()
    admit(c, group("a"))
    c.book.next_batch(0, 0.0)
    c.step_failed(RuntimeError("once"))
    step(c)
    assert c.book._attempts == {}


def test_a_group_is_judged_stale_at_the_version_the_step_trains_from() -> None:
    c = core(max_staleness=1)
    admit(c, group("old", version=0))
    c.state.version = 2  # two steps went by (another group trained): version 0 is 2 behind
    decisions = c.book.drop_stale(c.state.version)
    assert decisions[0] == CountStale(2) and isinstance(decisions[1], Ack) and c.dropped()["stale"] == 2


def test_nothing_sampled_before_the_warm_start_is_trained_after_it() -> None:
    c = core(max_staleness=4, sft_steps=10)
    admit(c, group("pre-sft", version=0))
    assert c.warm_start_done() == 1
    decisions = c.book.drop_stale(c.state.version)
    assert decisions and decisions[0] == CountStale(2)  # within max_staleness, but from before SFT
    admit(c, group("late", version=0))  # one still arriving: dropped on arrival
    assert c.dropped()["stale"] == 4 and not c.book.ready
    admit(c, group("post-sft", version=1))
    assert len(c.book.ready) == 1


def test_a_restart_judges_redelivered_samples_in_the_restored_lineage() -> None:
    """Checkpoint 60 restored; the dead trainer had published up to 63: ours is 64. Samples of 57
    (3 behind the restored weights) were dropped as 7 behind (issue 33, item 14)."""
    c = core(max_staleness=4)
    assert c.started(restored=60, pointer=63, on_disk=60, step_count=60) == 64
    admit(c, group("a", version=57))
    admit(c, group("b", version=62))  # sampled on weights this lineage never had: as new as the restore
    assert c.dropped()["stale"] == 0 and len(c.book.ready) == 2
    admit(c, group("c", version=55))  # 5 behind the restored weights: stale
    assert c.dropped()["stale"] == 2
    assert c.staleness([group("x", version=57)[0].trajectory], trained_from=64) == (3.0, 3)


def test_versions_are_numbered_above_the_pointer_and_a_foreign_pointer() -> None:
    c = core()
    assert c.started(restored=0, pointer=0, on_disk=0, step_count=0) == 0  # nothing published yet
    c = core()
    assert c.started(restored=0, pointer=7, on_disk=0, step_count=0) == 8
    assert c.pointer_conflict(1_000_000) == 1_000_001 and c.owes_publish and c.state.pointer_conflicts == 1
    c.published(1_000_001)
    assert not c.owes_publish


@pytest.mark.parametrize("pointer", [-1, 2**53 - 1, 2**63 - 2])
def test_a_pointer_outside_the_version_range_is_refused_not_followed(pointer: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        core().started(restored=0, pointer=pointer, on_disk=0, step_count=0)
    with pytest.raises(ValueError, match="outside"):
        core().pointer_conflict(pointer)


def test_with_checkpoints_a_step_is_acknowledged_only_once_a_checkpoint_covers_it() -> None:
    c = core(checkpoints=True, checkpoint_every=2)
    admit(c, group("a"))
    _, decisions = step(c)
    assert decisions == [] and c.state.held_entries == 2  # version 1: not due
    admit(c, group("b"))
    _, decisions = step(c)
    assert decisions == [StartCheckpoint(2, "trainer.checkpoint_every")]
    checkpoint = c.holds.begin(2)
    assert [s.version for s in checkpoint.covers] == [1, 2] and c.state.held_entries == 4
    ack = c.holds.saved(checkpoint)
    c.done(ack)
    c.holds.checkpointed(2, "file:///ckpt/2")
    assert ack.steps == checkpoint.covers and c.state.held_entries == 0 and c.state.checkpoint_version == 2


def test_held_entries_never_fill_the_backlog_a_checkpoint_comes_early() -> None:
    """Backlog 16, 2 entries a step, a checkpoint every 100 versions: without the hold bound the
    held entries filled the backlog and no checkpoint ever came (issue 33, item 8)."""
    c = core(checkpoints=True, checkpoint_every=100, max_backlog=16)
    for v in range(1, 5):
        admit(c, group(f"g{v}", version=c.state.version))
        _, decisions = step(c)
        if decisions:
            break
    assert decisions == [StartCheckpoint(v, "the hold bound")] and c.state.held_entries <= 8


def test_failing_saves_back_off_and_let_the_oldest_published_steps_go_past_the_bound() -> None:
    c = core(checkpoints=True, checkpoint_every=1, max_backlog=8)  # hold bound 4
    admit(c, group("a"))
    step(c)
    checkpoint = c.holds.begin(1)
    assert c.holds.save_failed(checkpoint, "OSError: [Errno 28] No space left", now=100.0) == []
    assert c.state.checkpoint_failures == 1 and c.holds.retry_at == 101.0
    assert not c.holds.owed(100.5, save_in_flight=False) and c.holds.owed(101.0, save_in_flight=False)
    released = []
    for name in "bcd":
        admit(c, group(name, version=c.state.version))
        _, decisions = step(c, now=100.5)  # not due while backing off; the bound applies instead
        released += decisions
    assert released and all(isinstance(d, Acknowledge) and d.undurable for d in released)
    for d in released:
        c.done(d)
    assert c.state.held_entries <= 4 and c.state.acked_undurable == sum(len(d.steps) * 2 for d in released)
    assert c.holds.owed(200.0, save_in_flight=False)  # a checkpoint is still owed for what was let go


def test_a_failed_acknowledgement_holds_the_steps_again() -> None:
    c = core(checkpoints=True, checkpoint_every=1)
    admit(c, group("a"))
    step(c)
    checkpoint = c.holds.begin(1)
    ack = c.holds.saved(checkpoint)
    c.holds.put_back(ack.steps)  # the driver's mark/ack raised
    c.holds.checkpointed(1, "uri")
    retry = c.holds.begin(1)  # complete on disk: the next begin acknowledges again
    assert retry.why == "already saved" and retry.covers == ack.steps


def test_a_refused_step_dead_letters_its_groups_and_takes_its_version_back() -> None:
    c = core()
    admit(c, group("a"))
    batch = c.book.next_batch(0, 0.0)
    c.stepped()
    (dead,) = c.step_refused(batch, "not published: NaN", unpublished=True)
    assert c.state.version == 0 and dead.counter == "nonfinite_step"
    c.done(dead)
    c.refused()
    assert c.state.skipped_steps == 1 and c.dropped()["nonfinite_step"] == 2
    # Weights made non-finite by an applied update: the state is damaged, the process must restart.
    assert "non-finite" in c.state.must_restart


def refuse(c: TrainerCore, name: str) -> None:
    """A step over one fresh group whose loss or gradient was non-finite (nothing applied)."""
    admit(c, group(name))
    for d in c.step_refused(c.book.next_batch(c.state.version, 0.0), "step skipped: loss nan"):
        c.done(d)
    c.refused()


def test_refusals_in_a_row_mean_a_damaged_state_and_an_applied_step_clears_the_count() -> None:
    """One refused batch is the batch's; REFUSED_IN_A_ROW in a row are the state's (NaN weights or
    optimizer state): the driver must stop for a restart from the newest good checkpoint."""
    c = core()
    for name in ("a", "b"):
        refuse(c, name)
    assert c.state.must_restart == "" and c.state.refused_in_a_row == REFUSED_IN_A_ROW - 1
    admit(c, group("ok"))
    step(c)
    assert c.state.refused_in_a_row == 0
    for i in range(REFUSED_IN_A_ROW - 1):
        refuse(c, f"x{i}")
    assert c.state.must_restart == ""
    refuse(c, "last")
    assert f"{REFUSED_IN_A_ROW} steps refused in a row" in c.state.must_restart
    c.state_damaged("checkpoint 3 not saved: optimizer state: [0] holds NaN or inf")
    assert "steps refused in a row" in c.state.must_restart  # the first cause is kept


def test_a_save_refused_for_a_non_finite_state_marks_the_state_damaged() -> None:
    c = core(checkpoints=True, checkpoint_every=1)
    c.state_damaged("checkpoint 1 not saved: optimizer state: [0].mu holds NaN or inf")
    assert c.state.must_restart.startswith("checkpoint 1 not saved")


def test_a_pause_comes_at_the_step_count_asked_for() -> None:
    c = core(start_paused=True)
    assert c.state.paused
    assert not c.resume(until_step=3, step_count=1)
    c.pause_if_due(2)
    assert not c.state.paused
    c.pause_if_due(3)
    assert c.state.paused and c.resume(until_step=3, step_count=3)  # already there: stays paused


def test_a_batch_takes_the_oldest_groups_of_one_size_and_waits_for_one_about_to_expire() -> None:
    c = core(groups_per_step=1, max_staleness=1, expiring_wait_s=5.0)
    c.state.version = 1
    admit(c, group("young", version=1))
    wait = c.book.next_batch(1, now=0.0)
    assert isinstance(wait, Wait) and wait.in_flight_floor == 0  # a group of version 0 may be in flight
    assert isinstance(c.book.next_batch(1, now=0.0, in_flight={"old"}), Wait)  # it is: wait for it
    batch = c.book.next_batch(1, now=6.0, in_flight={"old"})  # the wait is bounded
    assert not isinstance(batch, Wait) and batch[0].trajectories[0].group_id == "young"
    assert (c.book.expiring.waits, c.book.expiring.timeouts) == (1, 1)


def test_a_checkpoint_above_the_record_is_the_runs_only_when_its_recorder_is_among_its_writers() -> None:
    """Whose checkpoint is the run's (core/lineage.py). The recorder "b" restored "a"'s checkpoint 60."""
    def foreign(version: int, writers: tuple[str, ...], recorded: int = 60, recorder: str = "b") -> bool:
        return foreign_checkpoint(version=version, writers=writers, recorded_version=recorded,
                                  recorded_writer=recorder) is not None

    assert foreign(64, ("a",))  # "a" saved after it was fenced out, then died before setting it aside
    assert not foreign(64, ("a", "b"))  # "b"'s own save whose record failed
    assert not foreign(80, ("a", "b"), recorder="a")  # a Redis restored from before "b" took over
    assert not foreign(60, ("a",)) and not foreign(50, ("z",))  # at or below the record: the run's own
    assert not foreign(64, ())  # written before writers were kept: cannot tell
    assert not foreign(64, ("a",), recorder="")  # recorded unfenced: cannot tell
    long_lineage = tuple(f"t{i}" for i in range(WRITERS_KEPT))
    assert not foreign(64, long_lineage)  # the recorder may have been cut off the front


def test_a_trainer_writes_the_writers_it_restored_and_its_own_token_last_and_bounded() -> None:
    assert writers_after_restore((), "c") == ("c",)
    assert writers_after_restore(("a", "b"), "c") == ("a", "b", "c")
    assert writers_after_restore(("a", "b"), "") == ("a", "b")  # no lease: nothing to name
    assert writers_after_restore(("a", "c"), "c") == ("a", "c")
    many = tuple(f"t{i}" for i in range(WRITERS_KEPT))
    assert writers_after_restore(many, "new") == (*many[1:], "new")
