"""Every service's real server, in process, on ephemeral ports, in a background event loop.

Synchronous tests (hypothesis drives plain functions) call the servers with blocking gRPC
stubs while the servers run in their own thread; `call` runs a coroutine on that loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from arlo.background import TaskGroup
from arlo.config import RunConfig
from arlo.rpc import RunningServer

T = TypeVar("T")


@dataclass
class Stack:
    cfg: RunConfig
    addresses: dict[str, str] = field(default_factory=dict)
    servers: dict[str, RunningServer] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    """The cores behind the servers (engine, training loop, env servicer), for white-box checks."""
    loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None

    def call(self, fn: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
        """Runs `fn()` on the servers' loop and returns its result."""
        assert self.loop is not None
        future: Future[T] = asyncio.run_coroutine_threadsafe(_run(fn), self.loop)
        return future.result(timeout_s)

    def start(self, timeout_s: float = 180.0) -> None:
        ready: Future[None] = Future()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main(ready)), name="stack", daemon=True)
        self._thread.start()
        ready.result(timeout_s)

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(60)

    async def _main(self, ready: Future[None]) -> None:
        from services.env_gateway.__main__ import build_servicer, start_env_gateway
        from services.inference.__main__ import start_inference
        from services.reward.__main__ import start_reward
        from services.trainer.__main__ import start_trainer

        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        tasks = TaskGroup()
        try:
            trainer, self.objects["loop"] = await start_trainer(self.cfg, tasks)
            inference, self.objects["engine"] = await start_inference(self.cfg, tasks)
            self.objects["env"] = await build_servicer(self.cfg)
            env = await start_env_gateway(self.cfg, self.objects["env"])
            reward = await start_reward(self.cfg)
            self.servers = {"trainer": trainer, "inference": inference, "env_gateway": env, "reward": reward}
            self.addresses = {name: f"127.0.0.1:{s.port}" for name, s in self.servers.items()}
        except BaseException as e:
            ready.set_exception(e)
            await tasks.cancel_all()
            raise
        ready.set_result(None)
        try:
            await self._stop.wait()
        finally:
            await tasks.cancel_all()
            for server in self.servers.values():
                await server.stop(0.2)
            await self.objects["env"].aclose()


async def _run(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()
