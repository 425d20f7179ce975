"""The inference servicer over a real gRPC server on an ephemeral port (no Redis needed):
concurrent calls share decode steps, GenerateStream streams per chunk, and a client that
goes away frees its slot."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from arlo.config import InferenceConfig, load_config
from arlo.model.source import preset_source
from arlo.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from arlo.rpc import ServiceBinding, make_channel, start_server
from services.inference.engine import Engine
from services.inference.server import InferenceServicer
from tests.support.inference_server import TOKEN, hold_after_first_tokens_until_cancelled, request


async def test_concurrent_generate_calls_share_decode_steps(served: tuple[str, Engine]) -> None:
    address, engine = served
    async with make_channel(address, token=TOKEN) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        replies = await asyncio.gather(*(stub.Generate(request(12, prompt=(40 + i, 41, 42), temperature=0.0))
                                         for i in range(6)))
    assert all(len(r.completions[0].token_ids) == 12 for r in replies)
    assert engine.stats.largest_batch > 1  # separate calls, one batch


async def test_stream_sends_tokens_as_chunks_complete_and_matches_generate(served: tuple[str, Engine]) -> None:
    address, _ = served
    async with make_channel(address, token=TOKEN) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        parts = [m async for m in stub.GenerateStream(inference_pb2.GenerateStreamRequest(request=request(12, seed=3)))]
        whole = await stub.Generate(request(12, seed=3))
    assert len(parts) >= 3  # the prefill token, then chunks of 2
    assert [t for m in parts for t in m.token_ids] == list(whole.completions[0].token_ids)
    assert [m.finish_reason for m in parts[:-1]] == [inference_pb2.FINISH_REASON_UNSPECIFIED] * (len(parts) - 1)
    assert parts[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert all(v == 0 for m in parts for v in m.policy_versions)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async with make_channel(address, token=TOKEN) as ch:
            bad = inference_pb2.GenerateStreamRequest(request=inference_pb2.GenerateRequest(
                prompt_token_ids=[1], n=2, sampling=common_pb2.SamplingParams(max_tokens=2)))
            async for _ in inference_pb2_grpc.InferenceStub(ch).GenerateStream(bad):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_cancelled_stream_frees_its_slot(served: tuple[str, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    address, engine = served
    hold_after_first_tokens_until_cancelled(monkeypatch, engine)
    async with make_channel(address, token=TOKEN) as ch:
        call = inference_pb2_grpc.InferenceStub(ch).GenerateStream(
            inference_pb2.GenerateStreamRequest(request=request(200, temperature=0.0)))
        first = await call.read()
        assert len(first.token_ids) >= 1
        call.cancel()
        deadline = asyncio.get_running_loop().time() + 60
        while engine.stats.aborted < 1 or engine.scheduler.running:
            assert asyncio.get_running_loop().time() < deadline, "the slot was not freed"
            await asyncio.sleep(0.02)
    assert engine.scheduler.pool.used_pages == 0
    assert engine.stats.generated_tokens < 200


async def test_a_cancelled_generate_frees_its_slot(served: tuple[str, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    address, engine = served
    hold_after_first_tokens_until_cancelled(monkeypatch, engine)  # the deadline passes mid-generation
    async with make_channel(address, token=TOKEN) as ch:
        await ch.channel_ready()  # the deadline is for the request, not the connection
        stub = inference_pb2_grpc.InferenceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(request(200, temperature=0.0), timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = asyncio.get_running_loop().time() + 60
        while engine.stats.aborted < 1 or engine.scheduler.running or engine.scheduler.waiting:
            assert asyncio.get_running_loop().time() < deadline, "the slot was not freed"
            await asyncio.sleep(0.02)
    assert engine.scheduler.pool.used_pages == 0


async def test_rollout_counts_the_oldest_version_any_replica_serves(served: tuple[str, Engine]) -> None:
    """Evaluation waits on `served_version`: its episodes spread over every replica, so one
    replica still on old weights must hold it back (it used to ask replica 0 only)."""
    from arlo.config import SamplingConfig
    from arlo.rpc.replicas import ReplicaSet
    from services.rollout.clients import InferenceClient
    from services.rollout.types import RetryableError

    address, first = served
    cfg = load_config(overrides={"inference": {"server": {"port": 0, "metrics_port": -1, "grace_s": 0.5}}})
    second = Engine(preset_source("tiny"), config=InferenceConfig(max_n=1, max_tokens=8, max_prompt_tokens=32, max_batch=2))
    name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    running = await start_server("inference", cfg.inference.server, cfg.auth, [
        ServiceBinding(name=name, add_to_server=inference_pb2_grpc.add_InferenceServicer_to_server,
                       servicer=InferenceServicer(second, "byte"))])
    replicas = ReplicaSet(f"ipv4:{address},127.0.0.1:{running.port}", lambda a: make_channel(a, token=TOKEN),
                          service="inference")
    client = InferenceClient(replicas, SamplingConfig(), stop_token_ids=first.tokenizer.stop_token_ids, timeout_s=10.0)
    try:
        first.swap(first.state, 5)
        second.swap(second.state, 3)
        assert await client.served_version() == 3
        second.swap(second.state, 7)
        assert await client.served_version() == 5
        await running.stop(0.1)  # a replica that cannot answer is not counted as caught up
        with pytest.raises(RetryableError):  # UNAVAILABLE, as the rollout's core sees it
            await client.served_version()
    finally:
        await replicas.aclose()
        await running.stop(0.1)
        await asyncio.to_thread(second.close)


async def test_n_zero_and_a_session_with_n_above_one_are_invalid(served: tuple[str, Engine]) -> None:
    """n = 0 was served as 1, and a session (one conversation's KV) was accepted with n = 2."""
    address, _ = served
    zero = request(2)
    zero.n = 0
    session = request(2)
    session.n, session.session_id = 2, "conversation-1"
    async with make_channel(address, token=TOKEN) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        for bad, field in ((zero, "n must be"), (session, "session_id")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert field in (err.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.GenerateStream(inference_pb2.GenerateStreamRequest(request=bad)):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
