"""Shared fixtures: a real Redis (the one at ARLO_TEST_REDIS_URL / 127.0.0.1:6379, else our own)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from arlo.app.redis_server import redis_answers, start_local_redis

# Keep JAX on a small, predictable CPU footprint in tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("ARLO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    if redis_answers(url):
        yield url
        return
    server = start_local_redis()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def run_id() -> str:
    """A fresh run namespace per test, so tests never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:12]}"
