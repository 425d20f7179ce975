"""Local process supervision for `arlo up` / `arlo demo`: start, wait healthy, restart, stop.

Each service is a real subprocess (`python -m services.<name>`) logging to its own file.
Children are started with the `spawn`-safe exec model (a fresh interpreter), never fork-only,
because gRPC does not survive fork() without exec.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arlo.app.stopping import Stop, shielded

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServiceFailed(RuntimeError):
    """A service exited or never became healthy; the message carries the tail of its log."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessSpec:
    name: str
    argv: tuple[str, ...]
    address: str
    """host:port answering grpc.health.v1."""
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    ready: Callable[[str, float], bool] | None = None
    """Readiness probe (address, timeout_s); None: grpc.health.v1 SERVING."""
    stop_last: bool = False
    """Stopped after every other child (Redis: services flush to it while they stop)."""


# A child must not outlive the process that started it: a kill -9 of `arlo up`, `arlo demo` or
# `arlo train` (or pytest-timeout killing one) left every service running as an orphan. Linux
# delivers PR_SET_PDEATHSIG when the parent dies, whatever the way; it survives execve. It is set
# by util-linux's `setpriv --pdeathsig` in front of the child's argv, never by a preexec_fn: Python
# code between fork and exec in a threaded process (grpc and rich run threads here) deadlocked the
# spawn of the trainer in the demo e2e test (the parent waited on a futex forever).
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` prefixed so that the child gets SIGKILL when this process dies (unchanged where
    setpriv is missing, or off the main thread: the signal follows the *thread* that forked, and
    only the main thread lives as long as the process). SIGKILL, not SIGTERM: a parent that died
    without stopping its children left no one to wait for a graceful exit, and every service is
    built to survive a kill -9."""
    if _SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return list(argv)
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]


def service_spec(name: str, config_path: Path, address: str, log_dir: Path, env: Mapping[str, str]) -> ProcessSpec:
    return ProcessSpec(name=name, argv=(sys.executable, "-m", f"services.{name}", "-c", str(config_path)),
                       address=address, log_path=log_dir / f"{name}.log", env=env)


def health_status(address: str, timeout_s: float = 1.0) -> int:
    """The overall health status of the server at `address` (UNKNOWN when unreachable)."""
    # Its own subchannels: a restarted service answers on its old port at once (arlo/rpc/client.py).
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout_s)
            return int(resp.status)
        except grpc.RpcError:
            return int(health_pb2.HealthCheckResponse.UNKNOWN)


def is_serving(address: str, timeout_s: float = 1.0) -> bool:
    return health_status(address, timeout_s) == health_pb2.HealthCheckResponse.SERVING


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class _Child:
    spec: ProcessSpec
    process: subprocess.Popen[bytes]
    restarts: int = 0
    recent: list[float] = field(default_factory=list)
    """When it was restarted within the last RESTART_WINDOW_S (monotonic seconds)."""


RESTART_WINDOW_S = 600.0
"""`max_restarts` counts within this window: a service that restarts now and then over a week-long
run (a trainer stopping for a restart from its newest good checkpoint) is not given up on."""


class Supervisor:
    """Starts services in order, restarts a crashed one (up to `max_restarts` within
    `window_s`), stops all in reverse."""

    def __init__(self, specs: Sequence[ProcessSpec], *, max_restarts: int = 3,
                 window_s: float = RESTART_WINDOW_S) -> None:
        self.specs = list(specs)
        self.max_restarts, self.window_s = max_restarts, window_s
        self.children: dict[str, _Child] = {}

    def _spawn(self, spec: ProcessSpec) -> subprocess.Popen[bytes]:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(spec.log_path, "ab")  # noqa: SIM115 (owned by the child for its lifetime)
        try:
            return subprocess.Popen(die_with_parent(spec.argv), stdout=logf, stderr=subprocess.STDOUT,
                                    env={**os.environ, **spec.env}, start_new_session=True)
        finally:
            logf.close()

    def start(self, spec: ProcessSpec, timeout_s: float = 120.0) -> None:
        self.children[spec.name] = _Child(spec=spec, process=self._spawn(spec))
        self.wait_healthy(spec.name, timeout_s)

    def start_all(self, timeout_s: float = 120.0) -> None:
        self.start_many(self.specs, timeout_s)

    def start_many(self, specs: Sequence[ProcessSpec], timeout_s: float = 120.0) -> None:
        """Spawns every spec, then waits for each to be healthy (one deadline for all)."""
        for spec in specs:
            self.children[spec.name] = _Child(spec=spec, process=self._spawn(spec))
        deadline = time.monotonic() + timeout_s
        for spec in specs:
            self.wait_healthy(spec.name, max(deadline - time.monotonic(), 1.0))

    def wait_healthy(self, name: str, timeout_s: float) -> None:
        child = self.children[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child.process.poll() is not None:
                raise ServiceFailed(f"{name} exited with {child.process.returncode} while starting; "
                                    f"log {child.spec.log_path}:\n{log_tail(child.spec.log_path)}")
            if (child.spec.ready or is_serving)(child.spec.address, 0.5):
                log.info("%s is serving on %s", name, child.spec.address)
                return
            time.sleep(0.2)
        raise ServiceFailed(f"{name} not healthy on {child.spec.address} after {timeout_s:.0f}s; "
                            f"log {child.spec.log_path}:\n{log_tail(child.spec.log_path)}")

    def check(self) -> list[str]:
        """Restarts any child that died; returns the names restarted. Raises when one keeps dying."""
        restarted = []
        for name, child in self.children.items():
            code = child.process.poll()
            if code is None:
                continue
            now = time.monotonic()
            child.recent = [t for t in child.recent if now - t < self.window_s]
            if len(child.recent) >= self.max_restarts:
                raise ServiceFailed(f"{name} exited with {code} after {len(child.recent)} restarts in "
                                    f"{self.window_s:.0f}s; log {child.spec.log_path}:\n{log_tail(child.spec.log_path)}")
            log.warning("%s exited with %s; restarting", name, code)
            child.process = self._spawn(child.spec)
            child.restarts += 1
            child.recent.append(now)
            restarted.append(name)
        return restarted

    def stop_all(self, grace_s: float = 10.0) -> dict[str, int | None]:
        """SIGTERM in reverse start order, SIGKILL what is left after `grace_s`; returns exit codes.
        A Ctrl-C (or SIGTERM's Stop) while it waits is the user saying "now": what is still
        running is killed at once (a second Ctrl-C of `arlo demo` used to escape from here as a
        traceback and leave the rest to the kernel's parent-death signal)."""
        # Never raises: it runs on every way out (a child may be gone, stopped or a zombie).
        children = list(reversed(self.children.values()))
        try:
            for batch in ([c for c in children if not c.spec.stop_last], [c for c in children if c.spec.stop_last]):
                self._stop_batch(batch, grace_s)
        except (KeyboardInterrupt, Stop) as e:
            log.warning("stopping interrupted (%s); killing the services still running", type(e).__name__)
            self._kill_all(children)
        return {name: c.process.returncode for name, c in self.children.items()}

    @staticmethod
    def _kill_all(children: list[_Child], wait_s: float = 10.0) -> None:
        """SIGKILL to every child still running, then reaps them (bounded; nothing it does raises)."""
        with shielded():
            for child in children:
                if child.process.poll() is None:
                    with contextlib.suppress(OSError):
                        os.killpg(child.process.pid, signal.SIGKILL)
            deadline = time.monotonic() + wait_s
            for child in children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _stop_batch(self, children: list[_Child], grace_s: float) -> None:
        for child in children:
            if child.process.poll() is None:
                _signal(child.process, signal.SIGCONT)  # a stopped child would never see SIGTERM
                _signal(child.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0fs; killing", child.spec.name, grace_s)
                try:
                    os.killpg(child.process.pid, signal.SIGKILL)
                except OSError:
                    pass
                child.process.wait()


def _signal(process: subprocess.Popen[bytes], signum: int) -> None:
    try:
        process.send_signal(signum)
    except OSError:
        pass


SUPERVISE_EVERY_S = 1.0


async def supervising(main: Awaitable[T], check: Callable[[], object], every_s: float = SUPERVISE_EVERY_S) -> T:
    """`await main` while `check()` (a `Supervisor.check`) runs every `every_s` beside it, on its own
    cadence: a service killed while `main` waits in a retry is restarted meanwhile. `arlo demo`
    checked only between the driver's polls, so a killed trainer stayed dead while the driver
    retried GetStatus for `--outage-s` and the run failed (issue 33, item 5). The checks run on
    this event loop, in the main thread, so a restarted child still dies with this process
    (`die_with_parent`). An error of `check()` (a service that keeps dying) ends `main` with it."""
    task = asyncio.ensure_future(main)
    failure: BaseException | None = None

    async def watch() -> None:
        nonlocal failure
        while True:
            await asyncio.sleep(every_s)
            try:
                check()
            except Exception as e:  # noqa: BLE001 (handed to `main`'s awaiter below)
                failure = e
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if failure is not None and task.cancelled():
            raise failure from None
        raise
    finally:
        watcher.cancel()
        if not task.done():  # we were cancelled from outside (Ctrl-C): so is `main`, and it unwinds
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
