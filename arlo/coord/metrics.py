"""The trainer's per-step diagnostics on Redis: one stream entry per applied optimizer step.

The trainer appends (XADD, approximately capped at `MAX_RECORDS`); readers (`arlo train`,
`arlo demo`, `arlo status`) read forward from the last id they saw, so none skips a step the
way sampling a status every so often does. Each entry is one JSON object under field `json`
(services/trainer/diagnostics.py says what it holds).
"""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from arlo.coord.client import cancel_safe
from arlo.coord.keys import Keys

MAX_RECORDS = 100_000
"""Records kept (approximate trim): a reader further behind than this misses the oldest."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


class MetricsStream:
    def __init__(self, redis: Redis, run_id: str, *, max_records: int = MAX_RECORDS) -> None:
        self._redis = redis
        self._keys = Keys(run_id)
        self._max = max_records

    @property
    def key(self) -> str:
        return self._keys.metrics

    @cancel_safe
    async def add(self, record: dict[str, Any]) -> str:
        entry_id = await self._redis.xadd(self._keys.metrics, {"json": json.dumps(record)},
                                          maxlen=self._max, approximate=True)
        return _text(entry_id)

    @cancel_safe
    async def after(self, last_id: str, count: int = 1000) -> list[tuple[str, dict[str, Any]]]:
        """Records after `last_id` ("0-0": from the oldest kept), oldest first, at most `count`."""
        reply = await self._redis.xread({self._keys.metrics: last_id}, count=count)
        entries = reply[0][1] if reply else []
        return [(_text(i), json.loads(_text(f.get(b"json", f.get("json"))))) for i, f in entries if f]

    @cancel_safe
    async def last_id(self) -> str:
        """The newest entry's id ("0-0" when there is none): read `after` it for what comes next."""
        newest = await self._redis.xrevrange(self._keys.metrics, count=1)
        return _text(newest[0][0]) if newest else "0-0"

    @cancel_safe
    async def latest(self) -> dict[str, Any] | None:
        newest = await self._redis.xrevrange(self._keys.metrics, count=1)
        if not newest:
            return None
        fields = newest[0][1]
        return json.loads(_text(fields.get(b"json", fields.get("json"))))
