"""The supervisor's checks run on their own cadence beside the drive (issue 33, item 5).

`arlo demo` checked its children only between the driver's polls: a trainer killed -9 while the
driver retried GetStatus stayed dead for the whole `--outage-s`, and the demo failed. Here a real
child (a gRPC health server, `python` as a subprocess) is killed -9 while the awaited coroutine
retries a call to it; `supervising` must restart it so the retry succeeds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arlo.app.redis_server import free_port
from arlo.app.resilient import RetryPolicy, retry
from arlo.app.supervisor import ProcessSpec, ServiceFailed, Supervisor, supervising

HEALTH_SERVER = """
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(2))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
server.add_insecure_port(sys.argv[1])
server.start()
server.wait_for_termination()
"""


def _spec(tmp_path: Path, name: str, argv: tuple[str, ...], address: str) -> ProcessSpec:
    return ProcessSpec(name=name, argv=argv, address=address, log_path=tmp_path / f"{name}.log")


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return resp.status


@pytest.mark.timeout(120)
def test_a_service_killed_while_the_drive_retries_is_restarted_beside_it(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    sup = Supervisor([_spec(tmp_path, "svc", (sys.executable, "-c", HEALTH_SERVER, address), address)])
    try:
        sup.start(sup.specs[0], timeout_s=60)
        os.kill(sup.children["svc"].process.pid, signal.SIGKILL)
        sup.children["svc"].process.wait(timeout=10)
        started = time.monotonic()
        # The drive's call retries for at most 30 s, never calling check() itself (the driver's
        # GetStatus retry); only the checks beside it can bring the service back.
        status = asyncio.run(supervising(retry(lambda: _health(address), what="health",
                                               policy=RetryPolicy(outage_s=30, backoff_max_s=0.5)),
                                         sup.check, every_s=0.2))
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert sup.children["svc"].restarts == 1
        assert time.monotonic() - started < 30
    finally:
        sup.stop_all(grace_s=5)


@pytest.mark.timeout(60)
def test_a_service_that_keeps_dying_ends_the_drive_with_its_error(tmp_path: Path) -> None:
    spec = ProcessSpec(name="crashy", argv=(sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(3)"), address="-",
                       log_path=tmp_path / "crashy.log", ready=lambda address, timeout_s: True)
    sup = Supervisor([spec], max_restarts=1)
    try:
        sup.start(spec)
        started = time.monotonic()
        with pytest.raises(ServiceFailed, match="crashy exited with 3 after 1 restarts in"):
            asyncio.run(supervising(asyncio.sleep(30), sup.check, every_s=0.2))
        assert time.monotonic() - started < 20  # not the 30 s the drive would have waited
    finally:
        sup.stop_all(grace_s=5)


@pytest.mark.timeout(60)
def test_restarts_count_within_a_window_not_over_the_whole_run(tmp_path: Path) -> None:
    """A week-long run's fourth legitimate restart (a trainer stopping to restore its newest good
    checkpoint) must not end every service: only restarts within `window_s` count."""
    spec = ProcessSpec(name="rare", argv=(sys.executable, "-c", "raise SystemExit(1)"), address="-",
                       log_path=tmp_path / "rare.log", ready=lambda address, timeout_s: True)
    sup = Supervisor([spec], max_restarts=1, window_s=0.5)
    try:
        sup.children["rare"] = _spawned(sup, spec)
        for _ in range(3):  # each death comes after the previous restart left the window
            sup.children["rare"].process.wait(10)
            time.sleep(0.6)
            assert sup.check() == ["rare"]
        assert sup.children["rare"].restarts == 3  # over max_restarts 1, each alone in its window
        sup.children["rare"].process.wait(10)
        with pytest.raises(ServiceFailed, match="rare exited with 1 after 1 restarts in 0s"):
            sup.check()  # twice within the window
    finally:
        sup.stop_all(grace_s=5)


def _spawned(sup: Supervisor, spec: ProcessSpec):
    from arlo.app.supervisor import _Child

    return _Child(spec=spec, process=sup._spawn(spec))


def test_a_stop_from_outside_cancels_the_drive_and_the_checks() -> None:
    calls: list[float] = []
    drive_cancelled = asyncio.Event()

    async def drive() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            drive_cancelled.set()
            raise

    async def main() -> None:
        outer = asyncio.ensure_future(supervising(drive(), lambda: calls.append(time.monotonic()), every_s=0.05))
        await asyncio.sleep(0.3)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        seen = len(calls)
        await asyncio.sleep(0.2)
        assert len(calls) == seen  # the checks stopped with it

    asyncio.run(main())
    assert drive_cancelled.is_set() and len(calls) >= 2
