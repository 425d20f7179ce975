"""Fixtures shared by contract modules."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.support.inference_server import served  # noqa: F401 (a fixture: the inference contract tests')
from tests.support.openai_server import Served, inference_service


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def openai_served(redis_url: str) -> AsyncIterator[Served]:
    """One real inference service for every OpenAI endpoint and black-box agent test: its first
    requests compile the engine's programs, which the later tests then reuse. Up to 5 top
    logprobs per token (legacy completions' most), so a larger chat top_logprobs is refused."""
    with pytest.MonkeyPatch.context() as mp:
        async with inference_service(mp, redis_url, f"openai-{uuid.uuid4().hex[:8]}", max_top_logprobs=5) as s:
            yield s
