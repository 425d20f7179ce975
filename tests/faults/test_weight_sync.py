"""Weight sync to a fleet survives its faults: the storage writer killed -9 mid-write, a corrupted
delta (a torn body, and a well-formed delta of the wrong weights), a replica killed -9 and restarted
10 versions behind (and one stopped while they went by). Every replica ends serving the newest
version with its sha256, and every version any replica installed hashes to the trainer's
(none was ever half-applied).

Real processes over a real Redis: the trainer side is bench/weight_trainer.py (the real
VersionEncoder, store, pointer and TrainerServicer), each replica bench/weight_replica.py (the
real WeightSync into a bare parameter tree, printing each installed tree's sha256), at the tiny
shape: seconds per version, most of a test is the processes' start."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.weight_fanout import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def fleet(redis_url: str, run_id: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(redis_url=redis_url, model="tiny", storage=f"file://{tmp_path}/weights", full_every=4, lr=1e-6,
              check=True, run=run_id)
    try:
        yield f
    finally:
        f.close()


class Versions:
    """The sha256 the trainer published for each version, to check every install against."""

    def __init__(self) -> None:
        self.sha: dict[int, str] = {}

    def add(self, published: dict) -> dict:
        self.sha[published["version"]] = published["sha256"]
        return published

    def check(self, lines: list[dict]) -> None:
        for line in lines:
            assert line["sha256"] == self.sha[line["version"]], f"version {line['version']} installed half-applied"


def _drain(replica, versions: Versions, until: int) -> list[dict]:
    """Every line the replica printed up to version `until`, each checked."""
    lines = []
    while True:
        line = replica.next(120)
        lines.append(line)
        if line["version"] >= until:
            versions.check(lines)
            return lines


def test_a_storage_writer_killed_mid_write_leaves_the_fleet_on_whole_versions(fleet: Fleet, tmp_path: Path) -> None:
    versions = Versions()
    fleet.start_trainer()
    replicas = [fleet.start_replica(), fleet.start_replica()]
    for _ in range(2):
        v = versions.add(fleet.publish())["version"]
    for r in replicas:
        _drain(r, versions, v)
    fleet.trainer.send("publish stall")
    assert fleet.trainer.next(120) == {"stalled": v + 1}
    fleet.trainer.kill()  # kill -9 with half of version v + 1 on disk under a temporary name
    assert [p.name for p in (tmp_path / "weights").glob("*.tmp")]
    # A new trainer numbers above the pointer and publishes full, then deltas again.
    fleet.start_trainer()
    for _ in range(3):
        published = versions.add(fleet.publish())
    assert published["kind"] == "delta" and published["version"] == v + 3
    for r in replicas:
        assert _drain(r, versions, v + 3)[-1]["version"] == v + 3
    assert not list((tmp_path / "weights").glob("*.tmp"))  # the next full's prune removed the leftover


def test_a_corrupted_delta_is_refused_and_the_version_pulled_full(fleet: Fleet) -> None:
    versions = Versions()
    fleet.start_trainer()
    replicas = [fleet.start_replica(), fleet.start_replica()]
    for _ in range(2):
        versions.add(fleet.publish())
    corrupt = versions.add(fleet.publish("corrupt"))  # a flipped byte: the envelope's own sha256 refuses it
    assert corrupt["kind"] == "delta"
    for r in replicas:
        _drain(r, versions, corrupt["version"])
    forged = versions.add(fleet.publish("forge"))  # well-formed, wrong weights: the pointer's sha256 refuses it
    for r in replicas:
        _drain(r, versions, forged["version"])
    after = versions.add(fleet.publish())  # and deltas go on from the full payload pulled
    for r in replicas:
        _drain(r, versions, after["version"])
    # Both replicas pulled both bad versions whole from the trainer, and nothing else.
    assert after["sent_bytes"] == 2 * 2 * after["full_bytes"]


def test_a_replica_restarted_ten_versions_behind_catches_up(fleet: Fleet) -> None:
    versions = Versions()
    fleet.start_trainer()
    stopped, killed = fleet.start_replica(), fleet.start_replica()
    first = versions.add(fleet.publish())["version"]
    for r in (stopped, killed):
        _drain(r, versions, first)
    os.kill(stopped.proc.pid, signal.SIGSTOP)  # holds version 1's payload, asleep while 10 go by
    killed.kill()
    for _ in range(10):
        newest = versions.add(fleet.publish())
    assert newest["kind"] == "delta"  # fulls at 1, 5, 9 (full_every 4); 10 and 11 are deltas
    restarted = fleet.start_replica()
    os.kill(stopped.proc.pid, signal.SIGCONT)
    for r in (stopped, restarted):
        lines = _drain(r, versions, newest["version"])
        assert lines[-1]["version"] == newest["version"] == first + 10
    assert newest["sent_bytes"] == 0  # from the newest full in storage and its deltas, not the trainer


def test_deltas_without_storage_go_over_pull_weights(redis_url: str, run_id: str) -> None:
    fleet = Fleet(redis_url=redis_url, model="tiny", storage="", full_every=8, lr=1e-6, check=True, run=run_id)
    versions = Versions()
    try:
        fleet.start_trainer()
        replica = fleet.start_replica()
        first = versions.add(fleet.publish())
        _drain(replica, versions, first["version"])
        for _ in range(2):
            delta = versions.add(fleet.publish())
            _drain(replica, versions, delta["version"])
        assert delta["kind"] == "delta"
        # One full pull, then two deltas' envelopes: far less than three full copies.
        assert first["full_bytes"] <= delta["sent_bytes"] < 1.3 * first["full_bytes"]
    finally:
        fleet.close()
