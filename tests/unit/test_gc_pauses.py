"""arlo/gc_pauses.py: start-up's objects frozen out of the collector's walks, and its pauses timed."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from arlo.config import load_config
from arlo.gc_pauses import FREEZE_ENV, GcPauses, freeze_startup


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test process collects as before


@pytest.mark.usefixtures("unfrozen")
def test_freezing_takes_start_up_objects_out_of_a_full_collections_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FREEZE_ENV, raising=False)
    start_up = [[i] for i in range(100_000)]  # tracked objects, long-lived as a service's imports and model
    tracked = len(gc.get_objects())
    assert freeze_startup() >= len(start_up)
    assert len(gc.get_objects()) < tracked - len(start_up)  # what a full collection still walks
    assert start_up[-1] == [99_999]  # frozen, not freed
    gc.unfreeze()
    monkeypatch.setenv(FREEZE_ENV, "0")  # the A/B switch
    assert freeze_startup() == 0 and gc.get_freeze_count() == 0


def test_every_collection_is_timed_by_generation_and_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FREEZE_ENV, raising=False)
    registry = CollectorRegistry()
    pauses = GcPauses(registry)
    try:
        gc.collect()
        gc.collect(0)
        full_collections = pauses.counts[2]
        freeze_startup()  # its own collection is deliberate, off the path: not a pause
        gc.unfreeze()
        assert pauses.counts[2] == full_collections >= 1 and pauses.counts[0] >= 1
    finally:
        pauses.close()
    gc.collect()  # after close: not counted
    assert pauses.counts[2] == full_collections
    full = registry.get_sample_value("arlo_gc_pause_seconds_total", {"generation": "2"})
    assert full is not None and full == pytest.approx(pauses.seconds[2]) and full > 0
    assert pauses.summary().startswith(f"gc: {full_collections} full collections")


def test_a_collection_started_while_a_scrape_holds_the_counters_lock_does_not_hang() -> None:
    """A /metrics scrape holds the counter's lock while it allocates, which can start a collection
    on the scraper's thread; a callback that took that lock (`labels()`) waited for it forever."""
    pauses = GcPauses(CollectorRegistry())
    done = threading.Event()

    def scrape_that_collects() -> None:
        with pauses._counter._lock:
            gc.collect()
        done.set()

    try:
        threading.Thread(target=scrape_that_collects, daemon=True).start()
        assert done.wait(10), "the collector's callback waited on the lock its own thread held"
    finally:
        pauses.close()


def test_a_service_freezes_after_start_up_and_logs_its_pauses_at_stop(tmp_path: Path) -> None:
    """The real path: a service under run_until_signal, started and stopped as `arlo up` does."""
    from arlo.app.local import prepare_cluster

    cfg = load_config(None, {"run_id": "test-gc", "auth": {"disabled": True}, "local": {"cpus": "off"}})
    cluster = prepare_cluster(cfg, home=tmp_path, free_ports=True)
    try:
        cluster.start(("reward",), timeout_s=120.0)
    finally:
        cluster.stop()
    log = (tmp_path / "logs" / "reward.log").read_text()
    for _ in range(50):  # the last line is written as the process ends
        if "gc: " in log:
            break
        time.sleep(0.1)
        log = (tmp_path / "logs" / "reward.log").read_text()
    assert "start-up objects frozen out of the garbage collector's walks" in log
    assert "gc: " in log and "full collections" in log
