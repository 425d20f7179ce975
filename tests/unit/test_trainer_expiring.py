"""When a step waits for groups about to expire, and for how long (services/trainer/core/expiring.py)."""

from __future__ import annotations

from services.trainer.core.expiring import ExpiringWait, may_leave_behind


def test_only_a_batch_holding_a_group_younger_than_the_floor_can_leave_one_behind() -> None:
    assert not may_leave_behind([3, 3], floor=3)  # all on the floor: an in-flight one could not fit anyway
    assert may_leave_behind([3, 4], floor=3)
    assert not may_leave_behind([], floor=0)


def test_a_wait_holds_until_the_groups_arrive_or_the_bound_runs_out_once_per_floor() -> None:
    wait = ExpiringWait(bound_s=2.0)
    assert not wait.hold(set(), floor=1, now=0.0)  # nothing in flight
    assert wait.hold({"g"}, floor=1, now=10.0)
    assert wait.hold({"g"}, floor=1, now=11.9)  # one wait, however often asked
    assert not wait.hold({"g"}, floor=1, now=12.0)  # ran out: the step goes ahead
    assert not wait.hold({"g"}, floor=1, now=12.1)  # and is not held again on this floor
    assert (wait.waits, wait.timeouts) == (1, 1)
    assert wait.hold({"h"}, floor=2, now=13.0)  # the next floor waits afresh
    assert not wait.hold(set(), floor=2, now=13.5)  # it arrived
    assert (wait.waits, wait.timeouts) == (2, 1)


def test_a_zero_bound_never_waits() -> None:
    assert not ExpiringWait(bound_s=0.0).hold({"g"}, floor=0, now=0.0)


def test_a_second_wait_on_the_same_floor_gets_the_whole_bound() -> None:
    wait = ExpiringWait(bound_s=2.0)
    assert wait.hold({"g"}, floor=1, now=0.0)
    assert not wait.hold(set(), floor=1, now=1.0)  # it came; the step was then skipped, say
    assert wait.hold({"h"}, floor=1, now=5.0)  # another group of the floor: waited for afresh
    assert wait.hold({"h"}, floor=1, now=6.9)
    assert (wait.waits, wait.timeouts) == (2, 0)
