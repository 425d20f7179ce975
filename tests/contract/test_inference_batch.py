"""GenerateBatch over a real gRPC server, and the rollout's InferenceClient that coalesces
concurrent calls into it: one admission for the batch, the same tokens as one Generate each,
a refused request failing alone, and callers that go away freeing their slots."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from arlo.config import SamplingConfig
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc
from arlo.rpc import make_channel
from services.inference.engine import Engine
from services.rollout.clients import InferenceClient
from services.rollout.types import BackendError, RetryableError
from tests.support.inference_server import TOKEN, hold_after_first_tokens_until_cancelled, request

PROMPTS = [(40 + i, 41, 42) for i in range(6)]


async def until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_batch_is_admitted_at_once_and_samples_what_one_call_each_samples(served: tuple[str, Engine]) -> None:
    address, engine = served
    requests = [request(10, seed=100 + i, prompt=p) for i, p in enumerate(PROMPTS)]
    async with make_channel(address, token=TOKEN) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        singles = [await stub.Generate(r) for r in requests]  # one at a time: nothing shared
        prefills = engine.stats.prefills
        messages = [m async for m in stub.GenerateBatch(inference_pb2.GenerateBatchRequest(requests=requests))]
    assert engine.stats.prefills - prefills == 1  # one admission for the whole batch
    results = [r for m in messages for r in m.results]
    assert sorted(r.index for r in results) == list(range(len(requests)))
    for r in results:
        assert r.code == 0, r.message
        assert list(r.response.completions[0].token_ids) == list(singles[r.index].completions[0].token_ids)
        assert r.response.engine_s > 0


async def test_a_refused_request_fails_alone_and_a_batch_has_bounds(served: tuple[str, Engine]) -> None:
    address, _ = served
    bad = request(4)
    bad.n = 0
    too_long = request(4, prompt=tuple(range(40, 80)))  # past max_prompt_tokens (32)
    async with make_channel(address, token=TOKEN) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        # Greedy: sampled at temperature 1, the tiny model may draw the stop id 263 early.
        batch = inference_pb2.GenerateBatchRequest(requests=[request(4, temperature=0.0), bad, too_long,
                                                             request(4, temperature=0.0)])
        results = {r.index: r async for m in stub.GenerateBatch(batch) for r in m.results}
        for empty_or_huge in ([], [request(1)] * 257):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.GenerateBatch(inference_pb2.GenerateBatchRequest(requests=empty_or_huge)):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "1 to 256" in (err.value.details() or "")
    assert sorted(results) == [0, 1, 2, 3]
    assert results[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "n must be" in results[1].message
    assert results[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "prompt" in results[2].message
    assert all(results[i].code == 0 and len(results[i].response.completions[0].token_ids) == 4 for i in (0, 3))


async def test_a_batch_whose_client_goes_away_frees_every_slot(served: tuple[str, Engine],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    address, engine = served
    hold_after_first_tokens_until_cancelled(monkeypatch, engine)  # nothing can finish before the cancel
    async with make_channel(address, token=TOKEN) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        call = stub.GenerateBatch(inference_pb2.GenerateBatchRequest(
            requests=[request(200, prompt=p) for p in PROMPTS[:3]]))
        consumer = asyncio.ensure_future(call.read())
        # Cancelled once the engine runs the batch (a deadline could pass before the server saw it).
        await until(lambda: engine.stats.generated_tokens > 0, "the batch never started")
        call.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await until(lambda: engine.stats.aborted >= 3 and not engine.scheduler.running and not engine.scheduler.waiting,
                    "the batch's slots were not freed")
    assert engine.scheduler.pool.used_pages == 0


def client(channel: grpc.aio.Channel, window_s: float, timeout_s: float = 30.0) -> InferenceClient:
    return InferenceClient(channel, SamplingConfig(temperature=0.0, stop_token_ids=(263,)), stop_token_ids=(),
                           timeout_s=timeout_s, batch_window_s=window_s)


async def test_the_rollout_client_sends_concurrent_calls_as_one_batch(served: tuple[str, Engine]) -> None:
    address, engine = served
    async with make_channel(address, token=TOKEN) as ch:
        batched, plain = client(ch, 0.05), client(ch, 0.0)
        turns = await asyncio.gather(*(batched.generate(p, max_tokens=6) for p in PROMPTS))
        expected = [await plain.generate(p, max_tokens=6) for p in PROMPTS]
        lone = await batched.generate(PROMPTS[0], max_tokens=6)  # alone: a plain Generate
        (batcher,) = batched._batchers.values()
    assert batcher.calls == {"single": 1, "batch": 1, "batched_requests": len(PROMPTS)}
    assert [t.token_ids for t in turns] == [t.token_ids for t in expected]  # greedy: order kept per caller
    assert lone.token_ids == expected[0].token_ids
    assert all(len(t.token_ids) == 6 and len(t.logprobs) == 6 and t.engine_s > 0 for t in turns)


async def test_a_refused_call_in_a_coalesced_batch_fails_only_its_caller(served: tuple[str, Engine]) -> None:
    address, _ = served
    async with make_channel(address, token=TOKEN) as ch:
        batched = client(ch, 0.05)
        outcomes = await asyncio.gather(batched.generate(PROMPTS[0], max_tokens=4),
                                        batched.generate(tuple(range(40, 80)), max_tokens=4),
                                        batched.generate(PROMPTS[1], max_tokens=4), return_exceptions=True)
    good, refused, other = outcomes
    assert isinstance(refused, BackendError) and not isinstance(refused, RetryableError)
    assert refused.code == "INVALID_ARGUMENT" and "prompt" in str(refused)
    assert len(good.token_ids) == 4 and len(other.token_ids) == 4


async def test_coalesced_callers_that_go_away_cancel_the_batch(served: tuple[str, Engine],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    address, engine = served
    hold_after_first_tokens_until_cancelled(monkeypatch, engine)
    async with make_channel(address, token=TOKEN) as ch:
        batched = client(ch, 0.05, timeout_s=200.0)  # the slots must be freed by the cancel, not a deadline
        callers = [asyncio.create_task(batched.generate(p, max_tokens=200)) for p in PROMPTS[:3]]
        await until(lambda: engine.stats.generated_tokens > 0, "the batch never started")
        callers[0].cancel()
        await asyncio.sleep(0.2)
        assert engine.stats.aborted == 0  # others still wait on the batch
        for c in callers[1:]:
            c.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        await until(lambda: engine.stats.aborted >= 3 and not engine.scheduler.running,
                    "the cancelled batch's slots were not freed")
    assert engine.scheduler.pool.used_pages == 0


async def test_a_batch_to_a_server_that_is_gone_is_retryable_for_every_caller() -> None:
    async with make_channel("127.0.0.1:1", token=TOKEN) as ch:
        batched = InferenceClient(ch, SamplingConfig(), stop_token_ids=(), timeout_s=2.0, batch_window_s=0.05)
        outcomes = await asyncio.gather(*(batched.generate(p, max_tokens=4) for p in PROMPTS[:3]),
                                        return_exceptions=True)
    assert all(isinstance(o, RetryableError) and o.code == "UNAVAILABLE" for o in outcomes), outcomes


def test_results_that_finished_together_are_cut_into_messages_under_the_size_budget() -> None:
    from arlo.budget import runs_under

    def result(index: int, tokens: int) -> inference_pb2.GenerateBatchResult:
        return inference_pb2.GenerateBatchResult(index=index, response=inference_pb2.GenerateResponse(
            completions=[inference_pb2.Completion(token_ids=[7] * tokens)]))

    results = [result(i, n) for i, n in enumerate((100, 100, 5000, 100, 100, 100))]
    runs = list(runs_under(results, inference_pb2.GenerateBatchResult.ByteSize, 1000))
    assert [r.index for run in runs for r in run] == list(range(6))  # nothing lost, order kept
    assert all(sum(r.ByteSize() for r in run) <= 1000 for run in runs if len(run) > 1)
    assert [len(run) for run in runs] == [2, 1, 3]  # the big one alone
    assert list(runs_under([], len, 1000)) == []


class OldServer(inference_pb2_grpc.InferenceServicer):
    """An inference build from before GenerateBatch: Generate only (a rolling upgrade's old replica)."""

    def __init__(self, engine: Engine) -> None:
        from services.inference.server import InferenceServicer

        self.current = InferenceServicer(engine, "byte")

    async def Generate(self, request, context):  # noqa: N802
        return await self.current.Generate(request, context)

    async def GenerateBatch(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")  # what gRPC answers for it


async def test_a_server_without_generate_batch_gets_one_call_each(served: tuple[str, Engine]) -> None:
    from arlo.config import load_config
    from arlo.rpc import ServiceBinding, start_server

    _, engine = served
    cfg = load_config(overrides={"inference": {"server": {"port": 0, "metrics_port": -1, "grace_s": 0.5}}})
    name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    old = await start_server("inference", cfg.inference.server, cfg.auth, [ServiceBinding(
        name=name, add_to_server=inference_pb2_grpc.add_InferenceServicer_to_server, servicer=OldServer(engine))])
    try:
        async with make_channel(f"127.0.0.1:{old.port}", token=TOKEN) as ch:
            batched = client(ch, 0.05)
            turns = await asyncio.gather(*(batched.generate(p, max_tokens=5) for p in PROMPTS))
    finally:
        await old.stop(0.1)
    (batcher,) = batched._batchers.values()
    assert batcher.calls["batch"] == 1  # tried, refused UNIMPLEMENTED, then one Generate each
    assert all(len(t.token_ids) == 5 for t in turns)
