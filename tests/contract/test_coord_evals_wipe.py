"""An evaluation worker outlives a Redis wiped under it (issue 33, item 17b): the request
group's NOGROUP used to escape EvalQueue.take and end the worker's evaluation loop for good;
now the group is recreated, the loss is reported, and the next request is answered."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from arlo.config import RedisConfig
from arlo.coord import Keys, connect, delete_run
from arlo.coord.evals import EvalQueue


@pytest.fixture
async def r(redis_url: str, run_id: str) -> AsyncIterator[Redis]:
    client = await connect(RedisConfig(url=redis_url))
    yield client
    await delete_run(client, run_id)
    await client.aclose()


async def test_a_vanished_request_group_is_recreated_and_reported(r: Redis, run_id: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    asking, worker = EvalQueue(r, run_id), EvalQueue(r, run_id, consumer="w")
    await worker.ensure_group()
    await asking.request("lost")
    await r.delete(Keys(run_id).eval_requests)  # e.g. Redis restarted without persistence
    with caplog.at_level(logging.ERROR):
        assert await worker.take(block_ms=0, claim_idle_ms=60_000) is None  # was: ResponseError NOGROUP
    assert worker.groups_lost == 1
    assert any("evaluation requests not yet answered are lost" in rec.getMessage() for rec in caplog.records)
    await asking.request("after")
    taken = await worker.take(block_ms=100, claim_idle_ms=60_000)
    assert taken is not None and taken.tag == "after"
