"""Files under a dataset root that are not what they say (issue 33 items 12 and 15), through a
real env gateway: a named pipe named like a dataset is refused before it is opened, at once, and
Resets of good files, before, beside and after it, go on; a row nested 50,000 deep is that
dataset's INVALID_ARGUMENT, not INTERNAL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from arlo.config import load_config
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from services.env_gateway.__main__ import start_env_gateway

TOKEN, TOKEN_ENV = "files-token", "ARLO_TEST_FILES_TOKEN"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "good.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n"
                                                 for i in range(4)))
    (tmp_path / "deep.jsonl").write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n"
                                         + '{"prompt": "q", "answer": ' + "[" * 50_000 + "]" * 50_000 + "}\n")
    for name in ("pipe.jsonl", "pipe.parquet"):
        os.mkfifo(tmp_path / name)
    yield tmp_path
    for name in ("pipe.jsonl", "pipe.parquet"):  # a reader the old code left blocked in open() is let go
        with contextlib.suppress(OSError):
            os.close(os.open(tmp_path / name, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
async def stub(root: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[env_pb2_grpc.EnvironmentStub]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = load_config(overrides={"auth": {"token_env": TOKEN_ENV}, "env_gateway": {
        "server": {"port": 0, "metrics_port": -1}, "dataset_roots": [str(root)]}})
    running = await start_env_gateway(cfg)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            yield env_pb2_grpc.EnvironmentStub(channel)
    finally:
        await running.stop(None)


def reset(stub: env_pb2_grpc.EnvironmentStub, path: Path, seed: int = 0) -> object:
    return stub.Reset(env_pb2.ResetRequest(env_name="dataset", config_json=json.dumps({"path": str(path)}), seed=seed),
                      timeout=10)


async def test_a_named_pipe_is_refused_at_once_and_good_files_still_reset(stub: env_pb2_grpc.EnvironmentStub,
                                                                          root: Path) -> None:
    for name in ("pipe.jsonl", "pipe.parquet"):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await reset(stub, root / name)
        assert time.monotonic() - started < 3
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert "named pipe (FIFO), not a regular file" in refused.value.details()
        assert name in refused.value.details()
    # Side by side and after: the pipe holds nothing up.
    results = await asyncio.gather(reset(stub, root / "pipe.jsonl"), reset(stub, root / "good.jsonl", 1),
                                   reset(stub, root / "good.jsonl", 2), return_exceptions=True)
    assert isinstance(results[0], grpc.aio.AioRpcError)
    assert [r.task_id for r in results[1:]] and all(r.task_id.startswith("dataset-") for r in results[1:])


async def test_a_row_nested_50000_deep_is_invalid_argument_naming_the_row(stub: env_pb2_grpc.EnvironmentStub,
                                                                          root: Path) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await reset(stub, root / "deep.jsonl")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "deep.jsonl:2" in refused.value.details() and "nesting deeper than" in refused.value.details()
    assert (await reset(stub, root / "good.jsonl")).task_id
