"""Intake refuses finite extremes as poisoned (issue 33, item 16): a reward of 1e30, a logprob of
+50 or -1e30, a loss_mask of 1000, a policy version of 10^15 or -5 are dead-lettered with their
reason, and their group never trains. Before, they passed intake and were dropped as stale in
the red team's run only by luck. Core event sequences: no Redis, no JAX."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from arlo.groups import MAX_ABS_REWARD
from arlo.proto.v1 import common_pb2
from services.trainer.core.groups import MAX_LOGPROB, MIN_LOGPROB
from services.trainer.core.lineage import MAX_VERSION
from services.trainer.core.records import Ack, DeadLetter, Wait
from services.trainer.core.trainer import CoreConfig, TrainerCore

_ids = itertools.count()


@dataclass(frozen=True)
class Entry:  # a StreamEntry's shape
    entry_id: str
    trajectory: common_pb2.Trajectory


def traj(group: str, reward: float) -> common_pb2.Trajectory:
    """Three context tokens (mask 0, version -1, logprob 0) and two model tokens at version 0."""
    return common_pb2.Trajectory(
        id=f"t{next(_ids)}", group_id=group, group_size=2, token_ids=[5, 6, 7, 8, 9],
        logprobs=[0.0] * 3 + [-1.0, -1.0], loss_mask=[0] * 3 + [1, 1], policy_versions=[-1] * 3 + [0] * 2,
        reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK)


def core() -> TrainerCore:
    return TrainerCore(CoreConfig(groups_per_step=1, group_size=2, max_staleness=1, vocab_size=100))


def admit(c: TrainerCore, trajectories: list[common_pb2.Trajectory]) -> list:
    entries = [Entry(f"{next(_ids)}-0", t) for t in trajectories]
    screened = c.book.screen(entries)
    decisions = c.book.admit(screened.candidates, version=c.state.version, read_at=0.0, now=0.0)
    for d in decisions:
        c.done(d)
    return decisions


def _set(t: common_pb2.Trajectory, change: str, value: float) -> None:
    if change == "reward":
        t.reward = value
    elif change == "component":
        t.reward_components["pass_rate"] = value
    elif change == "turn_reward":
        t.turn_rewards.add(token_end=5, reward=value)
    elif change == "model_logprob":
        t.logprobs[-1] = value
    elif change == "context_logprob":
        t.logprobs[1] = value
    elif change == "loss_mask":
        t.loss_mask[-1] = int(value)
    elif change == "model_version":
        t.policy_versions[-1] = int(value)
    elif change == "context_version":
        t.policy_versions[0] = int(value)
    else:
        raise AssertionError(change)


EXTREMES = [
    ("reward", 1e30, "reward"), ("reward", -1e30, "reward"), ("reward", MAX_ABS_REWARD * 2, "reward"),
    ("component", 1e30, "reward component"), ("turn_reward", -1e30, "turn reward"),
    ("model_logprob", 50.0, "logprob on a model token"), ("model_logprob", -1e30, "logprob on a model token"),
    ("model_logprob", MIN_LOGPROB * 2, "logprob on a model token"), ("loss_mask", 1000, "loss_mask"),
    ("loss_mask", 2, "loss_mask"), ("model_version", 10**15, "newer than this trainer's newest version 0"),
    ("model_version", 1, "newer than this trainer's newest version 0"),
    ("model_version", MAX_VERSION + 1, "policy version"), ("model_version", -5, "policy version"),
    ("model_version", -1, "policy version"), ("context_version", -5, "policy version"),
    # (logprob - behaviour) x mask: -inf x 0 is NaN, so a context token's logprob counts too (not the first).
    ("context_logprob", float("-inf"), "non-finite logprob on a context token"),
]


@pytest.mark.parametrize(("change", "value", "needle"), EXTREMES)
def test_a_finite_extreme_is_dead_lettered_as_poisoned_with_its_reason(change: str, value: float,
                                                                       needle: str) -> None:
    c = core()
    bad, mate = traj("g", 1.0), traj("g", 0.0)
    _set(bad, change, value)
    decisions = admit(c, [bad, mate])
    (dead,) = [d for d in decisions if isinstance(d, DeadLetter)]
    assert dead.counter == "poisoned" and len(dead.items) == 1
    _, trajectory, reason = dead.items[0]
    assert trajectory.id == bad.id and needle in reason, reason
    assert Ack((decisions[-1].entry_ids[0],), "dropped") == decisions[-1]  # its group mate, finished with
    assert isinstance(c.book.next_batch(c.state.version, 0.0), Wait)  # nothing of the group trains
    assert c.dropped()["poisoned"] == 2
    # Intake goes on: the next clean group is ready to train.
    admit(c, [traj("h", 1.0), traj("h", 0.0)])
    assert not isinstance(c.book.next_batch(c.state.version, 0.0), Wait)


@pytest.mark.parametrize(("change", "value"), [
    ("reward", MAX_ABS_REWARD), ("reward", -MAX_ABS_REWARD), ("turn_reward", 0.5),
    ("model_logprob", MAX_LOGPROB / 2), ("model_logprob", 0.0), ("model_logprob", MIN_LOGPROB),
    ("context_version", MAX_VERSION), ("context_version", -1),
])
def test_values_at_the_bounds_are_taken(change: str, value: float) -> None:
    """The bounds leave room for what sampling and scoring legitimately produce: bf16 rounding
    just above logprob 0, a very unlikely sampled token, context tokens at version -1."""
    c = core()
    ok = traj("g", 1.0)
    _set(ok, change, value)
    decisions = admit(c, [ok, traj("g", 0.0)])
    assert not [d for d in decisions if isinstance(d, DeadLetter)]
    assert not isinstance(c.book.next_batch(c.state.version, 0.0), Wait)
