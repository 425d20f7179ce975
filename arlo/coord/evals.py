"""Evaluation requests and results on Redis: the driver asks, one rollout worker answers.

Requests go on a stream with a consumer group, so exactly one worker takes each and a worker
that dies mid-evaluation leaves it pending for another (claimed after `claim_idle_ms`).
Results are JSON on a second stream, keyed by the request id; nothing here is trained on.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from arlo.coord.client import cancel_safe
from arlo.coord.keys import Keys

log = logging.getLogger(__name__)

GROUP = "rollout"
MAX_RESULTS = 10_000
"""Results kept (approximate trim): evaluations are rare, this is years of them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalRequest:
    request_id: str
    tag: str
    """Free text naming the moment (e.g. "start", "after_sft", "v40"), echoed in the result."""
    min_version: int
    """The worker waits until inference serves at least this version before starting."""
    entry_id: str = ""


class EvalQueue:
    def __init__(self, redis: Redis, run_id: str, *, consumer: str = "") -> None:
        self._redis = redis
        self._keys = Keys(run_id)
        self._consumer = consumer
        self.groups_lost = 0
        """Times the request group was found missing (NOGROUP) and recreated: requests were lost."""

    @cancel_safe
    async def ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(self._keys.eval_requests, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # -- the asking side ---------------------------------------------------------------

    @cancel_safe
    async def request(self, tag: str, *, min_version: int = 0) -> str:
        request_id = uuid.uuid4().hex
        await self._redis.xadd(self._keys.eval_requests, {
            "request_id": request_id, "tag": tag, "min_version": str(min_version), "time": str(time.time())})
        return request_id

    @cancel_safe
    async def result(self, request_id: str) -> dict[str, Any] | None:
        """The result of `request_id`, if it has been written (scans newest first)."""
        for _, fields in await self._redis.xrevrange(self._keys.eval_results, count=1000):
            if _text(fields.get(b"request_id", fields.get("request_id"))) == request_id:
                return json.loads(_text(fields.get(b"json", fields.get("json"))))
        return None

    @cancel_safe
    async def latest_result(self) -> dict[str, Any] | None:
        """The newest result written (with its "tag"), if any."""
        newest = await self._redis.xrevrange(self._keys.eval_results, count=1)
        if not newest:
            return None
        fields = newest[0][1]
        result = json.loads(_text(fields.get(b"json", fields.get("json"))))
        return {"tag": _text(fields.get(b"tag", fields.get("tag"))), **result}

    # -- the answering side ------------------------------------------------------------

    @cancel_safe
    async def take(self, block_ms: int, claim_idle_ms: int) -> EvalRequest | None:
        """The next request for this consumer: an abandoned one first, else a new one. None when
        there is none, or when the group had vanished (a Redis wiped without persistence): it is
        recreated and the loss reported, instead of NOGROUP ending the worker's evaluation loop."""
        try:
            return await self._take(block_ms, claim_idle_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
        self.groups_lost += 1
        log.error("consumer group %s of %s vanished (Redis restarted without persistence, or its keys were "
                  "deleted): evaluation requests not yet answered are lost; recreating the group", GROUP,
                  self._keys.eval_requests)
        await self.ensure_group()
        return None

    async def _take(self, block_ms: int, claim_idle_ms: int) -> EvalRequest | None:
        claimed = await self._redis.xautoclaim(self._keys.eval_requests, GROUP, self._consumer,
                                               min_idle_time=claim_idle_ms, start_id="0-0", count=1)
        entries = claimed[1] if claimed and len(claimed) > 1 else []
        if not entries:
            reply = await self._redis.xreadgroup(GROUP, self._consumer, {self._keys.eval_requests: ">"},
                                                 count=1, block=block_ms)
            entries = reply[0][1] if reply else []
        for entry_id, fields in entries:
            if fields:  # a deleted entry comes back as (id, None)
                return _parse(_text(entry_id), fields)
        return None

    @cancel_safe
    async def finish(self, request: EvalRequest, result: dict[str, Any]) -> None:
        """Writes the result, then acknowledges the request (a crash between the two re-runs it)."""
        await self._redis.xadd(self._keys.eval_results, {
            "request_id": request.request_id, "tag": request.tag, "json": json.dumps(result)},
            maxlen=MAX_RESULTS, approximate=True)
        await self._redis.xack(self._keys.eval_requests, GROUP, request.entry_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _parse(entry_id: str, fields: dict[Any, Any]) -> EvalRequest:
    f = {_text(k): _text(v) for k, v in fields.items()}
    try:
        min_version = int(f.get("min_version", "0"))
    except ValueError:
        min_version = 0
    return EvalRequest(request_id=f.get("request_id") or entry_id, tag=f.get("tag", ""), min_version=min_version,
                       entry_id=entry_id)
