"""Where an RL step's time went: the trainer's timing/anatomy of a step record, and the bench's
critical path over it (bench/step_anatomy.py), on hand-made marks whose answer is known."""

from __future__ import annotations

import pytest

from arlo.proto.v1 import common_pb2
from bench.step_anatomy import critical_path, summarise
from services.trainer.anatomy import StepClock, StepMarks, step_anatomy, step_timing, xadd_time

T0 = 1_700_000_000.0
APPROX = {"abs": 1e-6}


def traj(started: float, total: float, **timings: float) -> common_pb2.Trajectory:
    t = common_pb2.Trajectory(token_ids=[1, 2], logprobs=[0.0, -1.0], loss_mask=[0, 1], policy_versions=[-1, 3])
    t.timings.started_at, t.timings.total_s = started, total
    for name, value in timings.items():
        setattr(t.timings, name, value)
    return t


def entry(at: float) -> str:
    return f"{round(at * 1000)}-0"


def test_xadd_time_is_the_entry_ids_milliseconds() -> None:
    assert xadd_time("1700000000123-4") == pytest.approx(1_700_000_000.123, **APPROX)
    assert xadd_time("not-an-id") == 0.0


def test_timing_splits_the_interval_between_two_publishes() -> None:
    clock = StepClock()
    clock.step_done(T0)
    clock.tail_s = 0.01
    clock.add_intake(0.02)
    marks = StepMarks(read_at=T0 + 0.30, ready_at=T0 + 0.31, batch_at=T0 + 0.31, train_at=T0 + 0.32,
                      trained_at=T0 + 0.42, cut_at=T0 + 0.45)
    trajs = [traj(T0 + 0.05, 0.2, generate_s=0.15, reset_s=0.01), traj(T0 + 0.06, 0.22, generate_s=0.17)]
    timing = step_timing(clock, marks, trajs, [T0 + 0.30, T0 + 0.30], [entry(T0 + 0.28), entry(T0 + 0.29)])
    assert timing["step_s"] == pytest.approx(0.45, **APPROX)
    assert (timing["batch_s"], timing["train_s"], timing["publish_s"]) == pytest.approx((0.01, 0.10, 0.03), **APPROX)
    # What the loop did not spend on its tail, intake, batch, step or publish, it waited for data.
    assert timing["wait_s"] == pytest.approx(0.45 - 0.01 - 0.02 - 0.01 - 0.10 - 0.03, **APPROX)
    assert timing["rollout_generate_s"] == pytest.approx(0.16, **APPROX)
    assert timing["redis_wait_s"] == pytest.approx(0.015, abs=1e-3)


def test_anatomy_names_the_last_trajectory_of_the_last_read() -> None:
    clock = StepClock()
    clock.step_done(T0)
    marks = StepMarks(read_at=T0 + 0.5, ready_at=T0 + 0.5, batch_at=T0 + 0.5, train_at=T0 + 0.5,
                      trained_at=T0 + 0.6, cut_at=T0 + 0.6)
    early, late, latest_of_earlier_read = traj(T0, 0.3), traj(T0, 0.4, env_s=0.02), traj(T0, 0.45)
    anatomy = step_anatomy(clock, marks, [early, late, latest_of_earlier_read], [T0 + 0.5, T0 + 0.5, T0 + 0.46],
                           [entry(T0 + 0.41), entry(T0 + 0.41), entry(T0 + 0.455)])
    c = anatomy["critical"]
    assert c["total_s"] == 0.4 and c["env_s"] == 0.02 and c["xadd_at"] == pytest.approx(T0 + 0.41, **APPROX)
    assert c["min_version"] == 3 and anatomy["prev_cut_at"] == T0


def record(*, wait_s: float, started: float, sync: bool = True) -> dict:
    """A synchronous step: publish at T0, swap done at +0.05, episode +0.06..+0.26, read at +0.28."""
    return {"phase": "rl", "version": 7, "timing": {
        "batch_s": 0.01, "train_s": 0.1, "publish_s": 0.02, "tail_s": 0.01, "wait_s": wait_s},
        "anatomy": {"prev_cut_at": T0, "read_at": T0 + 0.28, "ready_at": T0 + 0.29, "batch_at": T0 + 0.29,
                    "cut_at": T0 + 0.42, "published_at": T0 + 0.42, "critical": {
                        "started_at": started, "reset_s": 0.01, "generate_s": 0.15, "generate_queue_s": 0.01,
                        "generate_engine_s": 0.12, "env_s": 0.01, "reward_s": 0.01, "total_s": 0.2,
                        "xadd_at": started + 0.21}}}


SYNCS = {6: {"notified_at": T0 + 0.01, "pull_s": 0.02, "verify_s": 0.01, "swap_s": 0.0, "served_at": T0 + 0.05}}


def test_a_data_bound_step_runs_back_through_the_rollout_and_the_swap() -> None:
    path = critical_path(record(wait_s=0.2, started=T0 + 0.06), SYNCS)
    assert path is not None
    assert sum(path.values()) == pytest.approx(0.42, **APPROX)  # the whole interval, nothing twice
    assert path["publish -> notify"] == pytest.approx(0.01, **APPROX) and path["pull"] == pytest.approx(0.02, **APPROX)
    assert path["admission"] == pytest.approx(0.01, **APPROX) and path["generate: engine"] == pytest.approx(0.12, **APPROX)
    assert path["generate: rpc"] == pytest.approx(0.02, **APPROX) and path["redis wait"] == pytest.approx(0.01, **APPROX)
    assert "trainer tail" not in path  # it ran beside the swap


def test_what_overlapped_the_previous_step_is_not_on_the_path() -> None:
    # The episode began before the previous publish (asynchronous): only its part after it counts.
    path = critical_path(record(wait_s=0.05, started=T0 - 0.1), SYNCS)
    assert path is not None and "pull" not in path and "reset" not in path
    assert path["generate: engine"] == pytest.approx(0.04, **APPROX) and path["redis wait"] == pytest.approx(0.17, **APPROX)
    assert sum(path.values()) == pytest.approx(0.42, **APPROX)


def test_a_trainer_bound_step_is_the_trainers_own_phases() -> None:
    path = critical_path(record(wait_s=0.0, started=T0 - 1.0), SYNCS)
    assert path is not None and set(path) == {"trainer tail", "intake", "trainer other", "batch", "train", "publish"}
    assert sum(path.values()) == pytest.approx(0.42, **APPROX)
    summary = summarise([record(wait_s=0.0, started=T0 - 1.0)], SYNCS, warmup=0)
    assert summary["platform_overhead"] == pytest.approx(1 - 0.1 / 0.42, **APPROX)
    assert summary["platform_overhead_by_bound"] == {"trainer": pytest.approx(1 - 0.1 / 0.42, **APPROX)}


def test_the_overhead_is_also_given_over_trainer_bound_and_data_bound_steps_apart() -> None:
    trainer_bound = record(wait_s=0.0, started=T0 - 1.0)
    data_bound = record(wait_s=0.2, started=T0 + 0.06)
    data_bound["version"] = trainer_bound["version"] + 1
    data_path = critical_path(data_bound, SYNCS)
    assert data_path is not None
    summary = summarise([trainer_bound, data_bound], SYNCS, warmup=0)
    split = summary["platform_overhead_by_bound"]
    assert split["trainer"] == pytest.approx(1 - 0.1 / 0.42, **APPROX)
    assert split["data"] == pytest.approx(1 - (data_path["generate: engine"] + data_path["train"]) / 0.42, **APPROX)
    assert summary["data_bound_fraction"] == 0.5


def test_a_batch_read_while_the_previous_step_trained_puts_no_intake_on_the_path() -> None:
    # The loop read and grouped this batch during the previous step's update (services/trainer/stream_side.py):
    # its read and ready marks fall before the interval, and the loop's own intake was nil.
    r = record(wait_s=0.0, started=T0 - 1.0)
    r["anatomy"].update(read_at=T0 - 0.05, ready_at=T0 - 0.04)
    r["timing"]["intake_s"] = 0.0
    path = critical_path(r, SYNCS)
    assert path is not None and path["intake"] == 0.0
    assert path["trainer other"] == pytest.approx(0.29 - 0.01, **APPROX)
    assert sum(path.values()) == pytest.approx(0.42, **APPROX)


def test_an_overlapped_publish_of_the_previous_version_is_its_own_phase_on_a_data_bound_path() -> None:
    # The previous step's version was cut at T0 and its pointer moved at +0.005, beside this step
    # (services/trainer/loop.py): the swap chain starts at the pointer's move.
    path = critical_path(record(wait_s=0.2, started=T0 + 0.06), SYNCS, {6: T0 + 0.005})
    assert path is not None
    assert path["publish: overlapped"] == pytest.approx(0.005, **APPROX)
    assert path["publish -> notify"] == pytest.approx(0.005, **APPROX)
    assert sum(path.values()) == pytest.approx(0.42, **APPROX)
