"""reward on an ephemeral port: Score, ScoreBatch, ListRewardFunctions, every bad-input class."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import pytest

from arlo.config import AuthConfig, RewardConfig, RunConfig, ServerConfig
from arlo.proto.v1 import reward_pb2, reward_pb2_grpc
from arlo.rpc import RunningServer, ServiceBinding, make_channel, start_server
from services.reward.__main__ import start_reward
from services.reward.registry import RewardSpec, default_registry
from services.reward.scoring import Scorer
from services.reward.server import SERVICE_NAME, RewardServicer
from services.reward.verifiers.base import Verdict

TOKEN = "reward-token"
TOKEN_ENV = "ARLO_TEST_REWARD_TOKEN"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
OK, ERROR, TIMEOUT = reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_ERROR, reward_pb2.SCORE_STATUS_TIMEOUT
MiB = 1 << 20


@pytest.fixture
def auth(monkeypatch: pytest.MonkeyPatch) -> AuthConfig:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return AuthConfig(token_env=TOKEN_ENV)


@pytest.fixture
async def reward_server(auth: AuthConfig) -> AsyncIterator[RunningServer]:
    running = await start_reward(RunConfig(auth=auth, reward=RewardConfig(server=ServerConfig(port=0, metrics_port=-1))))
    try:
        yield running
    finally:
        await running.stop(None)


@pytest.fixture
async def stub(reward_server: RunningServer) -> AsyncIterator[reward_pb2_grpc.RewardStub]:
    async with make_channel(f"127.0.0.1:{reward_server.port}", token=TOKEN) as channel:
        yield reward_pb2_grpc.RewardStub(channel)


_release = threading.Event()


def raises(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    raise ZeroDivisionError("verifier bug")


def hangs(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    _release.wait(5)
    return Verdict(reward=1.0)


def echo_metadata(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    return Verdict(reward=float(metadata.get("weight", 0.0)))


@pytest.fixture
async def faulty_stub(auth: AuthConfig) -> AsyncIterator[reward_pb2_grpc.RewardStub]:
    registry = default_registry()
    for name, fn in (("raises", raises), ("hangs", hangs), ("echo_metadata", echo_metadata)):
        registry.register(RewardSpec(name=name, fn=fn, description=name))
    servicer = RewardServicer(registry, Scorer(timeout_s=0.3))
    running = await start_server("reward", ServerConfig(port=0, metrics_port=-1), auth, [
        ServiceBinding(SERVICE_NAME, reward_pb2_grpc.add_RewardServicer_to_server, servicer)])
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            yield reward_pb2_grpc.RewardStub(channel)
    finally:
        _release.set()
        await running.stop(None)
        _release.clear()


def item(reward_fn: str = "exact_match", response: str = "4", reference: str = "4",
         metadata_json: str = "") -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(reward_fn=reward_fn, response=response, reference=reference,
                                   metadata_json=metadata_json)


async def fails(call: object, code: grpc.StatusCode, fragment: str = "") -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call  # type: ignore[misc]
    assert e.value.code() == code, e.value.details()
    assert fragment in (e.value.details() or "")


async def test_list_reward_functions(stub: reward_pb2_grpc.RewardStub) -> None:
    reply = await stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=5)
    assert [f.name for f in reply.functions] == ["code_tests", "composite", "exact_match", "format_regex",
                                                 "format_think", "math_equiv", "math_think"]
    assert all(f.description for f in reply.functions)


async def test_every_rpc_needs_the_token(reward_server: RunningServer) -> None:
    async with make_channel(f"127.0.0.1:{reward_server.port}", token=None) as channel:
        anonymous = reward_pb2_grpc.RewardStub(channel)
        for call in (anonymous.Score(item(), timeout=5),
                     anonymous.ScoreBatch(reward_pb2.ScoreBatchRequest(items=[item()]), timeout=5),
                     anonymous.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=5)):
            await fails(call, grpc.StatusCode.UNAUTHENTICATED)


async def test_score(stub: reward_pb2_grpc.RewardStub) -> None:
    hit = await stub.Score(item(response=" 4 \n"), timeout=5)
    assert (hit.status, hit.reward, dict(hit.components), hit.error) == (OK, 1.0, {"exact_match": 1.0}, "")
    miss = await stub.Score(item(response="5"), timeout=5)
    assert (miss.status, miss.reward) == (OK, 0.0)


@pytest.mark.parametrize(("request_", "code", "fragment"), [
    (item(reward_fn=""), INVALID, "reward_fn is required"),
    (item(reward_fn="nope"), grpc.StatusCode.NOT_FOUND, "exact_match"),
    (item(reward_fn="x" * 129), INVALID, "reward_fn"),
    (item(response="x" * (MiB + 1)), INVALID, "response"),
    (item(response="é" * (MiB // 2 + 1)), INVALID, "response is 1048578 bytes"),
    (item(reference="x" * (MiB + 1)), INVALID, "reference"),
    (item(metadata_json=" " * (64 * 1024 + 1)), INVALID, "metadata_json"),
    (item(metadata_json="{"), INVALID, "not valid JSON"),
    (item(metadata_json="[1]"), INVALID, "JSON object"),
    # Deep nesting within the size bound was a RecursionError, answered INTERNAL.
    (item(metadata_json='{"a": ' + "[" * 20000 + "]" * 20000 + "}"), INVALID, "metadata_json is not valid JSON"),
], ids=["no-fn", "unknown-fn", "long-fn", "big-response", "big-utf8-response", "big-reference", "big-metadata",
        "bad-metadata", "metadata-not-object", "deep-metadata"])
async def test_score_bad_inputs(stub: reward_pb2_grpc.RewardStub, request_: reward_pb2.ScoreRequest,
                                code: grpc.StatusCode, fragment: str) -> None:
    await fails(stub.Score(request_, timeout=5), code, fragment)


async def test_multibyte_text_under_the_limit_is_fine(stub: reward_pb2_grpc.RewardStub) -> None:
    reply = await stub.Score(item(response="é" * (MiB // 2), reference="é" * (MiB // 2)), timeout=5)
    assert reply.status == OK and reply.reward == 1.0


async def test_score_batch_items_keep_order_and_their_own_status(stub: reward_pb2_grpc.RewardStub) -> None:
    items = [item(), item(response="5"), item(reward_fn="nope"), item(metadata_json="{"), item(reward_fn="")]
    reply = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=items), timeout=5)
    assert [(r.status, r.reward) for r in reply.results] == [(OK, 1.0), (OK, 0.0), (ERROR, 0.0), (ERROR, 0.0),
                                                             (ERROR, 0.0)]
    assert "unknown reward_fn 'nope'" in reply.results[2].error
    assert "not valid JSON" in reply.results[3].error
    assert "reward_fn is required" in reply.results[4].error


async def test_score_batch_bounds(stub: reward_pb2_grpc.RewardStub) -> None:
    await fails(stub.ScoreBatch(reward_pb2.ScoreBatchRequest(), timeout=5), INVALID, "1 to 1024")
    await fails(stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=[item()] * 1025), timeout=5), INVALID, "1025")
    oversized = [item(), item(reference="x" * (MiB + 1))]
    await fails(stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=oversized), timeout=5), INVALID,
                "items[1].reference")
    full = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=[item()] * 1024), timeout=30)
    assert len(full.results) == 1024 and all(r.status == OK and r.reward == 1.0 for r in full.results)


async def test_failing_verifiers_are_never_a_silent_zero(faulty_stub: reward_pb2_grpc.RewardStub) -> None:
    broken = await faulty_stub.Score(item(reward_fn="raises"), timeout=5)
    assert broken.status == ERROR and "ZeroDivisionError: verifier bug" in broken.error
    slow = await faulty_stub.Score(item(reward_fn="hangs"), timeout=5)
    assert slow.status == TIMEOUT and "deadline" in slow.error
    batch = await faulty_stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=[
        item(reward_fn="raises"), item(), item(reward_fn="hangs"), item(reward_fn="echo_metadata",
                                                                        metadata_json='{"weight": 0.5}')]), timeout=5)
    assert [(r.status, r.reward) for r in batch.results] == [(ERROR, 0.0), (OK, 1.0), (TIMEOUT, 0.0), (OK, 0.5)]


MATH_AND_FORMAT = '{"components": [{"fn": "math_equiv", "weight": 0.9}, {"fn": "format_think", "weight": 0.1}]}'


async def test_score_batch_mixes_verifiers_and_statuses(stub: reward_pb2_grpc.RewardStub) -> None:
    think = "<think>half of one</think><answer>\\frac{1}{2}</answer>"
    items = [
        item("math_equiv", "so \\boxed{\\frac{1}{2}}", "0.5"),
        item("math_equiv", "x^2+2x+1", "(x+1)^2"),
        item("math_equiv", "3.14159", "\\pi", '{"rel_tol": 1e-5}'),
        item("math_equiv", "3.14159", "\\pi"),
        item("math_equiv", "I give up", "2"),
        item("math_equiv", "2", "two"),
        item("math_equiv", "2", "2", '{"rel_tol": -1}'),
        item("format_think", think, ""),
        item("format_regex", "Answer: 7", "", '{"patterns": {"tagged": "^Answer: \\\\d+$"}}'),
        item("format_regex", "Answer: 7", "", '{"patterns": {"broken": "("}}'),
        item("composite", think, "1/2", MATH_AND_FORMAT),
        item("composite", "\\boxed{1/2}", "1/2", MATH_AND_FORMAT),
        item("composite", "x", "x", '{"components": [{"fn": "nope", "weight": 1}]}'),
        item("math_think", think, "0.5"),
        item("nope"),
        item("exact_match", "4", "4"),
        item("code_tests", "```python\ndef add(a, b):\n    return a + b\n```", "",
             '{"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}'),
        item("code_tests", "def add(a, b): return a + b", ""),
    ]
    reply = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=items), timeout=30)
    got = [(r.status, round(r.reward, 6)) for r in reply.results]
    assert got == [(OK, 1.0), (OK, 1.0), (OK, 1.0), (OK, 0.0), (OK, 0.0), (ERROR, 0.0), (ERROR, 0.0),
                   (OK, 1.0), (OK, 1.0), (ERROR, 0.0), (OK, 1.0), (OK, 0.95), (ERROR, 0.0), (OK, 1.0),
                   (ERROR, 0.0), (OK, 1.0), (OK, 0.5), (ERROR, 0.0)]
    r = reply.results
    assert dict(r[4].components) == {"parsed": 0.0, "math_equiv": 0.0}  # no answer: wrong, not an error
    assert "reference answer 'two' cannot be parsed" in r[5].error
    assert "rel_tol" in r[6].error
    assert dict(r[7].components) == {"think": 1.0, "answer": 1.0}
    assert "not a valid regex" in r[9].error
    assert dict(r[11].components) == {"math_equiv": 1.0, "math_equiv.parsed": 1.0, "math_equiv.math_equiv": 1.0,
                                      "format_think": 0.5, "format_think.think": 0.0, "format_think.answer": 1.0}
    assert "unknown reward function 'nope'" in r[12].error
    assert set(r[13].components) >= {"math_equiv", "format_think.think"}
    assert "unknown reward_fn 'nope'" in r[14].error
    assert dict(r[16].components) == {"tests_passed": 0.5, "compiled": 1.0}
    assert "no tests" in r[17].error


async def test_the_rollout_client_coalesces_concurrent_scores_and_a_refused_item_fails_alone(
        reward_server: RunningServer) -> None:
    """Scores that arrive together leave as one ScoreBatch; ScoreBatch refuses a whole batch for
    one bad item (a reward_fn name past 128 bytes), so the client sends that batch again item by
    item; an item past 64 KiB goes alone from the start."""
    import asyncio

    from services.rollout.clients import RewardClient
    from services.rollout.types import BackendError

    async with make_channel(f"127.0.0.1:{reward_server.port}", token=TOKEN) as channel:
        client = RewardClient(channel, timeout_s=10.0, batch_window_s=0.05)
        right, wrong = await asyncio.gather(client.score("exact_match", "4", "4"), client.score("exact_match", "5", "4"))
        assert (right.status, right.reward, wrong.status, wrong.reward) == ("ok", 1.0, "ok", 0.0)
        assert client.batcher.calls == {"single": 0, "batch": 1, "batched_requests": 2}
        outcomes = await asyncio.gather(client.score("exact_match", "4", "4"),
                                        client.score("f" * 200, "4", "4"),
                                        client.score("nope", "4", "4"),
                                        client.score("exact_match", "x" * (MiB + 1), "4"), return_exceptions=True)
        assert client.batcher.calls == {"single": 0, "batch": 2, "batched_requests": 5}  # the oversized one went alone
        # ScoreBatch alone would answer an unknown function with an error status; the client sends
        # such an item again alone, so it fails as a lone Score does, whatever shared its call.
        unknown_in_good_company = await asyncio.gather(client.score("exact_match", "4", "4"),
                                                       client.score("nope", "4", "4"), return_exceptions=True)
        lone = await client.score("exact_match", "4", "4")
    good, long_name, unknown, oversized = outcomes
    assert good.status == "ok" and good.reward == 1.0
    assert isinstance(long_name, BackendError) and long_name.code == "INVALID_ARGUMENT"
    assert isinstance(unknown, BackendError) and unknown.code == "NOT_FOUND"  # sent alone: Score's answer
    assert isinstance(oversized, BackendError) and oversized.code == "INVALID_ARGUMENT"
    fine, refused = unknown_in_good_company
    assert fine.reward == 1.0 and isinstance(refused, BackendError) and refused.code == "NOT_FOUND"
    assert lone.reward == 1.0 and client.batcher.calls["single"] == 1
