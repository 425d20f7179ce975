"""Engine-thread callbacks into an asyncio handler: what the gRPC servicer and the OpenAI endpoint share."""

from __future__ import annotations

import asyncio
from typing import Any


class Bridge:
    """Engine-thread callbacks -> one asyncio queue on the handler's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
